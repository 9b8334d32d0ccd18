"""benchmarks/paired_loss.py: two runs' losses compared step by step, per window: each run's mean,
the mean difference and its standard error, only over steps both runs logged; a chart of both."""

import gzip
import json

import pytest

from scripts import load_script


def _log(path, losses, extra=()):
    lines = [json.dumps({"step": s, "loss": v, "seconds": s * 0.1}) for s, v in losses] + [json.dumps(e) for e in extra]
    text = "\n".join(lines) + "\n"
    path.write_bytes(gzip.compress(text.encode())) if path.suffix == ".gz" else path.write_text(text)


def test_windows_pair_the_same_steps_and_measure_the_difference(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    # B is lower by 0.01 on even steps and 0.03 on odd ones, and stopped at step 6 of A's 8.
    _log(a, [(s, 2.0 - 0.1 * s) for s in range(1, 9)], extra=[{"step": 4, "eval_accept": 1.7}])
    _log(b, [(s, 2.0 - 0.1 * s - (0.01 if s % 2 == 0 else 0.03)) for s in range(1, 7)])
    out = tmp_path / "chart.json"
    windows = load_script("paired_loss").main([str(a), str(b), "--labels", "narrow", "wide", "--window", "4",
                                               "--out", str(out)])
    assert [(w["first"], w["last"], w["steps"]) for w in windows] == [(1, 4, 4), (5, 6, 2)]
    first = windows[0]
    assert first["a"] == pytest.approx(2.0 - 0.25) and first["b"] == pytest.approx(2.0 - 0.25 - 0.02)
    assert first["diff"] == pytest.approx(-0.02)
    assert first["stderr"] == pytest.approx((0.01 * 2 / 3**0.5) / 2)  # sd of (-.03, -.01, -.03, -.01) over sqrt(4)
    assert windows[1]["diff"] == pytest.approx(-0.02) and windows[1]["a"] == pytest.approx(2.0 - 0.55)
    printed = capsys.readouterr().out
    assert "| 1-4 | 1.750 | 1.730 | -0.0200 (0.0058) |" in printed
    spec = json.loads(out.read_text())
    assert "vconcat" in spec and "narrow" in json.dumps(spec) and "wide - narrow" in json.dumps(spec)


def test_a_file_without_training_steps_is_refused_by_name(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _log(a, [(1, 2.0), (2, 1.9)])
    b.write_text(json.dumps({"eval_accept": 1.5}) + "\n")
    with pytest.raises(SystemExit) as e:
        load_script("paired_loss").main([str(a), str(b)])
    assert e.value.code == 2 and f"{b} holds no training steps" in capsys.readouterr().err
