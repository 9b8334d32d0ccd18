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
from dspark_lab.engine.speculative import LOOKUP_NS, speculative_generate
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


def test_a_pipelined_calibration_times_the_pipelined_loops_parts(pair, tmp_path, monkeypatch):
    """Mode dspark-pipe measures its own loop's parts: each verify width is the compiled forward
    at an array offset (Target.forward_at; width 1 the compiled one-row step), each draft the
    loop's draft_step_at (compiled as asked), and real pipelined rounds at every cap, which are
    what a round costs (not its parts' sum: the loop overlaps them), and plain decoding as it runs
    (cap 0), which is what the controller weighs them against. Its curves are stored under
    their own key (the compiled draft and the target's routing in it), apart from mode dspark's,
    and a controller on them drives the pipelined loop to the greedy tokens."""
    import dspark_lab.engine.pipeline as pipeline

    target, tok, drafter = pair
    seen = {"forward_at": [], "draft_step_at": [], "caps": [], "lookup_n": set()}
    real_forward_at, real_draft, real_loop = target.forward_at, drafter.draft_step_at, pipeline.pipelined_loop

    def forward_at(ids, *a, **kw):
        seen["forward_at"].append(ids.shape[0])
        return real_forward_at(ids, *a, **kw)

    def draft_step_at(*a, compiled=False, **kw):
        seen["draft_step_at"].append(compiled)
        return real_draft(*a, compiled=compiled, **kw)

    def loop(*a, **kw):
        seen["caps"].append(kw["cap"])
        seen["lookup_n"].add(kw["lookup_n"])
        return real_loop(*a, **kw)

    monkeypatch.setattr(target, "forward_at", forward_at)
    monkeypatch.setattr(drafter, "draft_step_at", draft_step_at)
    monkeypatch.setattr(pipeline, "pipelined_loop", loop)
    db = open_db(tmp_path / "r.duckdb")
    ctrl = calibrate(target, drafter, mode="dspark-pipe", db=db, plan=PLAN, max_cap=4, compile_draft=True)
    c = ctrl.curves
    assert sorted(c.verify) == [1, 2, 3, 4, 5] and sorted(c.drafter) == [1, 2, 3, 4] and sorted(c.rounds) == [0, 1, 2, 3, 4]
    assert all(c.round_ms(cap) == c.rounds[cap].median_ms > 0 for cap in c.rounds if cap)  # the rounds, not the parts' sum
    assert c.plain_ms() == c.rounds[0].median_ms > 0  # plain decoding as greedy_generate runs it
    assert c.round_ms(3, depth=c.short_ctx + 100) == pytest.approx(c.rounds[3].median_ms + 100 * c.depth_slope_ms)
    assert {1, 2, 3, 4, 5} <= set(seen["forward_at"]) and seen["draft_step_at"] and all(seen["draft_step_at"])
    assert seen["caps"] == [1, 1, 2, 2, 3, 3, 4, 4] and seen["lookup_n"] == {()}  # at each cap a warm-up and the timed rounds
    stored = calibrate(target, drafter, mode="dspark-pipe", db=db, plan=PLAN, max_cap=4, compile_draft=True)
    assert stored.reused and stored.curves.rounds == c.rounds
    assert not calibrate(target, drafter, mode="dspark-pipe", db=db, plan=PLAN, max_cap=4).reused  # the draft uncompiled
    seen["lookup_n"].clear()
    assert not calibrate(target, drafter, mode="dspark-pipe", db=db, plan=PLAN, max_cap=4, compile_draft=True, lookup_drafts=True).reused
    assert seen["lookup_n"] == {LOOKUP_NS}  # the device-side n-gram match runs in the timed rounds
    seen["forward_at"].clear()
    assert not calibrate(target, drafter, mode="dspark", db=db, plan=PLAN, max_cap=4).reused  # the plain loop: its own
    assert not seen["forward_at"]
    with Session(db) as s:
        rows = s.exec(select(CalibrationRecord).where(CalibrationRecord.mode == "dspark-pipe")).all()
    assert len(rows) == 3 and {(json.loads(r.options)["compile_draft"], json.loads(r.options)["lookup_drafts"]) for r in rows} == {
        (True, False), (False, False), (True, True)}
    assert all(json.loads(r.options)["rows_routed"] is False and json.loads(r.options)["rounds_timed"] for r in rows)
    monkeypatch.undo()
    for p in PROMPTS[:4] + REPETITIVE[:2]:
        base = greedy_generate(target, tok, p, max_new_tokens=24)
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, cap_controller=ctrl, pipeline=True, compile_draft=True)
        assert r.token_ids == base.token_ids
    assert ctrl.history and all(0 <= cap <= 4 for cap in ctrl.history)


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
