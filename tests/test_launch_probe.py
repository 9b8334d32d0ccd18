"""--launch-every auto (lab/launch_probe.py): the probe times every candidate, admits only
settings whose logits equal launch_every=0's bit for bit, stores its verdict keyed by the device
stamp and reuses it; generate and sweep apply it. Which setting wins is the machine's business:
the tests check the rule that picks it, never a timing."""

import json

import pytest
from typer.testing import CliRunner

from dspark_lab import load_target
from dspark_lab.cli import app
from dspark_lab.db import open_db
from dspark_lab.lab import launch_probe
from dspark_lab.lab.launch_probe import LaunchVerdict, choose_launch_every, measure_launch_every


def test_probe_measures_every_candidate_and_finds_them_exact(tiny_dirs):
    target, _ = load_target(tiny_dirs["qwen3"])
    target.launch_every = 0
    assert target.num_layers == 2
    v = measure_launch_every(target, width=3, context=40, repeats=2, candidates=(1, 2, 8))
    assert set(v.median_ms) == {0, 1} and all(ms > 0 for ms in v.median_ms.values())  # N >= the layer count is N=0 again
    assert v.exact == {0: True, 1: True}  # the same operations run at every setting
    assert v.every in (0, 1) and target.launch_every == 0  # the probe leaves the target as it found it
    if v.every:
        assert v.median_ms[v.every] <= (1 - launch_probe.MARGIN) * v.median_ms[0]


def test_the_rule_keeps_zero_unless_an_exact_candidate_wins_by_the_margin(tiny_dirs, monkeypatch):
    target, _ = load_target(tiny_dirs["qwen3"])
    # Fake a machine where handing layers over early saves half the time.
    costs = {0: 10.0, 1: 5.0}
    state = {"t": 0.0}

    def perf_counter():
        return state["t"]

    real_forward = target.forward

    def forward(ids, cache, **kw):
        state["t"] += costs[target.launch_every] / 1000
        return real_forward(ids, cache, **kw)

    monkeypatch.setattr(launch_probe.time, "perf_counter", perf_counter)
    monkeypatch.setattr(target, "forward", forward)
    v = measure_launch_every(target, width=2, context=16, repeats=3, candidates=(1,))
    assert v.every == 1 and v.median_ms == {0: pytest.approx(10.0), 1: pytest.approx(5.0)}
    costs[1] = 9.8  # 2% faster: within the margin, so off
    assert measure_launch_every(target, width=2, context=16, repeats=3, candidates=(1,)).every == 0


def test_verdict_is_stored_and_reused_per_machine_and_model(tiny_dirs, tmp_path):
    target, _ = load_target(tiny_dirs["qwen3"])
    db = open_db(tmp_path / "p.duckdb")
    first = choose_launch_every(target, db=db, model_id="tiny", width=3)
    assert not first.reused and set(first.median_ms) >= {0}
    again = choose_launch_every(target, db=db, model_id="tiny", width=3)
    assert again.reused and again.every == first.every and again.median_ms == first.median_ms
    assert not choose_launch_every(target, db=db, model_id="tiny", width=3, reprobe=True).reused
    assert not choose_launch_every(target, db=db, model_id="another", width=3).reused
    assert LaunchVerdict.from_dict(json.loads(json.dumps(first.to_dict()))).median_ms == first.median_ms


def test_generate_and_sweep_take_auto(tiny_dirs, tmp_path):
    runner = CliRunner()
    db = tmp_path / "r.duckdb"
    args = ["generate", "-m", str(tiny_dirs["qwen3"]), "--mode", "lookup", "-p", "a b c a b c", "-n", "8", "--db", str(db)]
    r = runner.invoke(app, args + ["--launch-every", "auto"])
    assert r.exit_code == 0, r.output
    assert "--launch-every auto: launch_every" in r.output and "measured" in r.output
    r = runner.invoke(app, args + ["--launch-every", "auto"])
    assert r.exit_code == 0 and "stored" in r.output  # the second run reuses the verdict
    r = runner.invoke(app, args + ["--launch-every", "often"])
    assert r.exit_code == 2 and "--launch-every must be a number of layers >= 0 (0: off) or 'auto'" in r.output
    r = runner.invoke(app, ["sweep", "-m", str(tiny_dirs["qwen3"]), "--modes", "lookup", "--caps", "2", "--prompts", "code",
                            "--prompt-limit", "1", "--trials", "1", "-n", "6", "--db", str(db), "--launch-every", "auto"])
    assert r.exit_code == 0, r.output
    assert "launch_every" in r.output and "stored" in r.output
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        config = json.loads(con.execute("select config from runs").fetchone()[0])
    chosen = config["launch_every_chosen"][str(tiny_dirs["qwen3"])]
    assert config["launch_every"] == "auto" and str(chosen["every"]) in chosen["median_ms"] and "0" in chosen["median_ms"]


@pytest.mark.parametrize("bad", [-1, "sometimes", 1.5])
def test_sweep_config_refuses_other_values(tiny_dirs, bad):
    from dspark_lab.errors import InputError
    from dspark_lab.lab.sweep import SweepConfig

    with pytest.raises(InputError, match="launch-every"):
        SweepConfig(models=[str(tiny_dirs["qwen3"])], modes=["baseline", "lookup"], launch_every=bad)
