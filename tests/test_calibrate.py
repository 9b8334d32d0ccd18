"""Calibration on a tiny pair: curves measured, stored keyed by the device stamp, reused,
recalibrated on request, corrupt records ignored with a warning; the controller it returns
drives generation losslessly."""

import json
import warnings

import pytest
from sqlmodel import Session, select

from conftest import PROMPTS, REPETITIVE
from dspark_lab import InputError, greedy_generate, lookup_generate
from dspark_lab.db import open_db
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.speculative import speculative_generate
from dspark_lab.lab.calibrate import CalibrationPlan, calibrate, measure_curves
from dspark_lab.schemas.records import CalibrationRecord
from dspark_lab.tiny import build_tiny_dspark

PLAN = CalibrationPlan(max_cap=4, repeats=3, short_ctx=16, long_ctx=64, overhead_rounds=4)


@pytest.fixture(scope="module")
def pair(qwen3, tiny_dirs, tmp_path_factory):
    target, tok = qwen3
    vocab = target.vocab_size
    head = build_tiny_dspark(tmp_path_factory.mktemp("cal") / "h", tiny_dirs["qwen3"], markov_rank=vocab, repeat_bias=20.0)
    return target, tok, load_dspark(head, target, bits=16)


def test_measured_curves_have_every_point(pair):
    target, _, drafter = pair
    c = measure_curves(target, drafter, plan=PLAN)
    assert sorted(c.verify) == [1, 2, 3, 4, 5] and sorted(c.drafter) == [1, 2, 3, 4]
    assert all(p.samples == 3 and p.median_ms > 0 and p.spread_ms >= 0 for p in c.verify.values())
    assert c.fit.max_rel_error >= 0 and 1 <= c.fit.knee <= 5
    assert c.round_ms(3) > c.verify_ms(4) > 0
    assert c.depth_slope_ms == c.depth_slope_ms  # not NaN


def test_store_reuse_recalibrate(pair, tmp_path):
    target, _, drafter = pair
    db = open_db(tmp_path / "r.duckdb")
    ctrl = calibrate(target, drafter, db=db, plan=PLAN, max_cap=4)
    c1 = ctrl.curves
    assert not ctrl.reused
    ctrl = calibrate(target, drafter, db=db, plan=PLAN, max_cap=4)
    assert ctrl.reused and ctrl.curves.to_dict() == c1.to_dict()
    assert not calibrate(target, drafter, db=db, plan=PLAN, max_cap=4, recalibrate=True).reused
    assert not calibrate(target, drafter, db=db, plan=CalibrationPlan(max_cap=3, repeats=3, short_ctx=16, long_ctx=64), max_cap=3).reused  # another option, another key
    with Session(db) as s:
        rows = s.exec(select(CalibrationRecord)).all()
    assert len(rows) == 3
    stamp = json.loads(rows[0].device_stamp)
    assert stamp and rows[0].machine and rows[0].device_key


@pytest.mark.parametrize("damage", ["not json", json.dumps({"verify": {}}), json.dumps({"foreign": True})])
def test_corrupt_or_foreign_record_is_ignored_with_a_warning(pair, tmp_path, damage):
    target, _, drafter = pair
    db = open_db(tmp_path / "c.duckdb")
    calibrate(target, drafter, db=db, plan=PLAN, max_cap=4)
    with Session(db) as s:
        row = s.exec(select(CalibrationRecord)).one()
        row.curves = damage
        s.add(row)
        s.commit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctrl = calibrate(target, drafter, db=db, plan=PLAN, max_cap=4)
    assert not ctrl.reused and ctrl.curves.verify
    assert any("ignoring calibration record" in str(w.message) for w in caught)


def test_controller_drives_generation_losslessly(pair):
    target, tok, drafter = pair
    ctrl = calibrate(target, drafter, plan=PLAN, max_cap=4)
    for p in PROMPTS[:6] + REPETITIVE[:3]:
        base = greedy_generate(target, tok, p, max_new_tokens=24)
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, cap_controller=ctrl, lookup_drafts=False)
        assert r.token_ids == base.token_ids
    assert len(ctrl.history) > 0 and all(0 <= c <= 4 for c in ctrl.history)


def test_lookup_calibration_needs_no_drafter(qwen3):
    target, tok = qwen3
    ctrl = calibrate(target, None, mode="lookup", plan=PLAN, max_cap=4)
    assert sorted(ctrl.curves.drafter) == [1, 2, 3, 4]
    r = lookup_generate(target, tok, REPETITIVE[0], max_new_tokens=20, cap_controller=ctrl)
    assert r.token_ids == greedy_generate(target, tok, REPETITIVE[0], max_new_tokens=20).token_ids


def test_bad_calibration_requests(qwen3):
    target, _ = qwen3
    with pytest.raises(InputError, match="mode must be one of"):
        calibrate(target, None, mode="warp")
    with pytest.raises(InputError, match="needs a drafter"):
        calibrate(target, None, mode="dspark")
