"""Sweeps end to end on tiny pairs: every trial stored with its lossless flag, a SIGKILLed sweep
resumed with no trial lost or duplicated, one database per writer, export -> ingest, and
malformed result files rejected by message."""

import json
import os
import signal
import subprocess
import sys
import time

import duckdb
import pytest
from typer.testing import CliRunner

from dspark_lab.cli import app
from dspark_lab.db import open_db
from dspark_lab.errors import DsparkError, InputError
from dspark_lab.lab import results as results_mod
from dspark_lab.lab.prompts import load_prompt_set
from dspark_lab.lab.results import export_run, ingest, read_result
from dspark_lab.schemas.records import SCHEMA_VERSION
from dspark_lab.lab.sweep import SweepConfig, load_grid, run_sweep
from dspark_lab.tiny import build_tiny_dspark

from labdb import as_older_schema, legacy_grid_key, rows, store_other_weights
from scripts import BENCHMARKS

runner = CliRunner()


@pytest.fixture(scope="module")
def head(tiny_dirs, tmp_path_factory):
    return build_tiny_dspark(tmp_path_factory.mktemp("sweephead") / "h", tiny_dirs["qwen3"], block_size=4)


def small_config(model, head, **kw):
    base = dict(models=[str(model)], drafters=[str(head)], modes=["baseline", "lookup", "dspark"], caps=["2", "auto"],
                prompt_sets=["code", "chat"], trials=2, max_new_tokens=10, prompt_limit=2)
    base.update(kw)
    return SweepConfig(**base)


def test_sweep_stores_every_trial(tiny_dirs, head, tmp_path):
    db = tmp_path / "r.duckdb"
    rid = run_sweep(small_config(tiny_dirs["qwen3"], head), db, progress=False)
    # arms: baseline + lookup x 2 caps + dspark x 2 caps = 5; cells: 2 sets x 2 prompts x 2 trials = 8
    assert rows(db, "select count(*) from trials")[0][0] == 40
    assert rows(db, "select id, status from runs")[0] == (rid, "finished")
    assert rows(db, "select count(*) from trials where mode = 'baseline' and lossless is not null")[0][0] == 0
    assert rows(db, "select count(*) from trials where mode != 'baseline' and lossless")[0][0] == 32
    assert rows(db, "select count(*) from trials where cap = 'auto' and caps_chosen is null")[0][0] == 0
    assert rows(db, "select count(*) from (select arm_key, trial_index from trials group by all having count(*) > 1)")[0][0] == 0
    # Every trial names its prompt's own digest, the one the prompt has in its whole set.
    whole = {(s, p.id): p.digest for s in ("code", "chat") for p in load_prompt_set(s).prompts}
    stored = rows(db, "select distinct prompt_set, prompt_id, prompt_digest from trials")
    assert len(stored) == 4 and all(whole[(s, pid)] == digest for s, pid, digest in stored)
    cfg = json.loads(rows(db, "select config from runs")[0][0])
    assert set(cfg["prompt_set_versions"]) == {"code", "chat"}
    stamp = json.loads(rows(db, "select device_stamp from runs")[0][0])
    assert stamp["mlx_version"] and rows(db, "select count(*) from calibration")[0][0] >= 2  # auto calibrated both modes
    types = dict(rows(db, "select column_name, data_type from information_schema.columns where table_name = 'trials'"))
    assert types["decode_tokens_per_sec"] == "DOUBLE"
    # Every head trial names the version of the head's weights it ran; arms without one, none.
    from dspark_lab.engine.loading import weights_digest

    digests = dict(rows(db, "select mode, list(distinct coalesce(drafter_digest, '-')) from trials group by mode"))
    assert digests == {"baseline": ["-"], "lookup": ["-"], "dspark": [weights_digest(head)]}


def test_a_resumed_run_refuses_a_head_changed_since(tiny_dirs, head, tmp_path):
    """A head continued and stored again at its path between a run and its resume would pool two
    heads' trials as one arm: the resume refuses, names both digests, and keeps every trial."""
    import shutil

    from dspark_lab.engine.loading import weights_digest

    mine = shutil.copytree(head, tmp_path / "head")
    db = tmp_path / "c.duckdb"
    cfg = small_config(tiny_dirs["qwen3"], mine, modes=["baseline", "dspark"], caps=["2"], trials=1, prompt_sets=["code"])
    rid = run_sweep(cfg, db, progress=False)
    before = weights_digest(mine)
    stored = rows(db, "select count(*) from trials")[0][0]
    store_other_weights(mine)
    with pytest.raises(DsparkError, match=f"holds other weights than run {rid} measured \\(weights digest {before} then, "
                                          f"{weights_digest(mine)} now\\).*start a new run"):
        run_sweep(cfg, db, resume=rid, progress=False)
    assert rows(db, "select count(*) from trials")[0][0] == stored
    assert rows(db, "select status from runs")[0][0] == "finished"  # the refused resume changed nothing


def test_the_pipelined_loop_is_an_arm_of_its_own(tiny_dirs, head, tmp_path):
    """dspark-pipe runs beside dspark with the same head: lossless, arms of its own, and cap auto
    works (the controller starts from the dspark curves)."""
    db = tmp_path / "p.duckdb"
    run_sweep(small_config(tiny_dirs["qwen3"], head, modes=["baseline", "dspark", "dspark-pipe"], caps=["3", "auto"], trials=1), db, progress=False)
    assert rows(db, "select count(*), count(*) filter (where lossless) from trials where mode = 'dspark-pipe'")[0] == (8, 8)
    assert sorted(r[0] for r in rows(db, "select distinct cap from trials where mode = 'dspark-pipe'")) == ["3", "auto"]
    assert rows(db, "select count(*) from trials where mode = 'dspark-pipe' and cap = 'auto' and caps_chosen is not null")[0][0] == 4


def test_tree_arms_run_lossless_at_fixed_caps(tiny_dirs, tmp_path, monkeypatch):
    """dspark-tree runs a head without a Markov term at the grid's fixed caps (no auto arm: no tree
    cost curves), lossless, with its tree size in the run's config and stamp; a head with a Markov
    term is skipped in that mode by name, and still runs in dspark."""
    markov_free = build_tiny_dspark(tmp_path / "m0", tiny_dirs["qwen3"], block_size=4, markov_rank=0)
    markov = build_tiny_dspark(tmp_path / "m16", tiny_dirs["qwen3"], block_size=4)
    events = []
    cfg = small_config(tiny_dirs["qwen3"], markov_free, drafters=[str(markov_free), str(markov)],
                       modes=["baseline", "dspark", "dspark-tree", "dspark-tree-pipe"], caps=["3", "auto"], trials=1, tree_nodes=6)
    db = tmp_path / "t.duckdb"
    run_sweep(cfg, db, progress=False, on_event=events.append)
    for mode in ("dspark-tree", "dspark-tree-pipe"):  # the plain tree loop, and trees chosen and verified on the device
        got = rows(db, f"select drafter_id, cap, count(*), count(*) filter (where lossless) from trials where mode = '{mode}' group by all")
        assert got == [(str(markov_free), "3", 4, 4)], mode
    assert any("skipping drafter" in e and "dspark-tree-pipe" in e and "Markov term" in e for e in events)
    assert any("skipping drafter" in e and "dspark-tree" in e and "Markov term" in e for e in events)
    assert rows(db, "select count(distinct drafter_id) from trials where mode = 'dspark'")[0][0] == 2
    # 6 of the head's drafts a round, and a lookup match's path grafted on (at most the cap's 3 more)
    assert max(max(json.loads(d)) for (d,) in rows(db, "select draft_lengths from trials where mode = 'dspark-tree'")) <= 6 + 3
    (stamp, config), = rows(db, "select device_stamp, config from runs")
    assert json.loads(config)["tree_nodes"] == 6 and json.loads(stamp)["engine_options"]["tree_nodes"] == 6
    # Rechecked as mismatches, each tree arm's divergence is measured through a tree forward of the
    # rows its verify fed: the plain loop's 6 nodes, root and a lookup branch padded to the head's
    # max_drafts (4: block 4, logits from its first row), whatever the cap; the pipelined loop's
    # 6 nodes and root (no pipe_lookup in this grid).
    from dspark_lab.lab import lossless
    from dspark_lab.lab.recheck import recheck_mismatches

    engine = open_db(db)
    with engine.begin() as conn:
        conn.exec_driver_sql("update trials set lossless = false where mode in ('dspark-tree', 'dspark-tree-pipe')")
    widths = {}
    monkeypatch.setattr(lossless, "first_divergence",
                        lambda *a, tree_width=0, **k: widths.setdefault(tree_width, 0) and None)
    assert len(recheck_mismatches(engine)) == 8
    engine.dispose()
    assert set(widths) == {6 + 1 + 4, 6 + 1}
    with pytest.raises(InputError, match="tree-nodes must be >= 1"):
        small_config(tiny_dirs["qwen3"], markov_free, tree_nodes=0)


def test_dspark_pipe_is_skipped_where_caches_cannot_be_pipelined(tmp_path):
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "lfm2", "lfm2", num_layers=2)
    head = build_tiny_dspark(tmp_path / "h", model)
    events = []
    run_sweep(small_config(model, head, modes=["baseline", "dspark", "dspark-pipe"], caps=["2"], trials=1), tmp_path / "h.duckdb",
              progress=False, on_event=events.append)
    assert any("skipping mode dspark-pipe" in e and "lfm2" in e for e in events)
    assert rows(tmp_path / "h.duckdb", "select count(*) from trials where mode = 'dspark-pipe'")[0][0] == 0
    assert rows(tmp_path / "h.duckdb", "select count(*) from trials where mode = 'dspark'")[0][0] == 4


def test_a_mismatch_is_flagged_and_kept(tiny_dirs, head, tmp_path, monkeypatch):
    import dspark_lab.engine as engine_mod

    real = engine_mod.lookup_generate

    def broken(*a, **k):  # a lookup that changes one token: the sweep must flag it, not drop it
        r = real(*a, **k)
        r.token_ids = r.token_ids[:-1] + [(r.token_ids[-1] + 1) % 50]
        return r

    monkeypatch.setattr(engine_mod, "lookup_generate", broken)
    db = tmp_path / "m.duckdb"
    events = []
    run_sweep(small_config(tiny_dirs["qwen3"], head, modes=["baseline", "lookup"], caps=["2"], trials=1), db, progress=False, on_event=events.append)
    assert rows(db, "select count(*) from trials where mode = 'lookup' and not lossless and mismatch_index is not null")[0][0] == 4
    assert any("NOT LOSSLESS" in e for e in events)
    # A token swapped on purpose is no rounding accident: the trial says so, with the logit gap.
    gaps = rows(db, "select mismatch_gap, mismatch_tie from trials where mode = 'lookup'")
    assert all(gap is not None and gap > 0 and tie is False for gap, tie in gaps), gaps
    assert any("a REAL divergence" in e for e in events)

    # Classified again later (after the tie test changed): the same verdict, and --update stores it
    # over a stale one.
    from dspark_lab.lab.recheck import recheck_mismatches

    engine = open_db(db)
    with engine.begin() as conn:
        conn.exec_driver_sql("update trials set mismatch_tie = true where mode = 'lookup'")
    again = recheck_mismatches(engine, update=True)
    engine.dispose()
    assert len(again) == 4 and all(r["was_tie"] is True and r["tie"] is False and r["gap"] > 0 for r in again)
    assert all(r["divergence"]["index"] == r_idx for r, (r_idx,) in
               zip(again, rows(db, "select mismatch_index from trials where mode = 'lookup' order by id")))
    assert rows(db, "select count(*) from trials where mode = 'lookup' and mismatch_tie = false")[0][0] == 4
    script = BENCHMARKS / "recheck_ties.py"
    done = subprocess.run([sys.executable, str(script), "--db", str(db), "--out", str(tmp_path / "re.json")],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1, done.stderr  # real divergences remain: the exit status says so
    assert "4 mismatched trials: 0 ties, 4 real; 0 verdicts changed" in done.stdout and "now REAL" in done.stdout
    assert len(json.loads((tmp_path / "re.json").read_text())) == 4

    # A run whose prompt file this machine lacks is refused, saying where to recheck it.
    engine = open_db(db)
    with engine.begin() as conn:
        cfg = json.loads(conn.exec_driver_sql("select config from runs").fetchone()[0])
        cfg["prompt_sets"] = [str(tmp_path / "gone.jsonl")]
        conn.exec_driver_sql("update runs set config = ?", (json.dumps(cfg),))
    with pytest.raises(InputError, match=r"prompt sets .*gone\.jsonl.* cannot be read here .*on a machine that has its prompt files"):
        recheck_mismatches(engine)
    engine.dispose()


def test_a_version_1_database_gains_the_tie_and_digest_columns(tmp_path):
    """Databases written before schemas 2, 3 and 4 are migrated in place; their old trials stay unknown (NULL)."""
    db = tmp_path / "old.duckdb"
    engine = open_db(db)
    as_older_schema(engine, 1, ["mismatch_gap", "mismatch_tie", "drafter_digest", "prompt_digest"])  # a version-1 database
    engine.dispose()
    open_db(db).dispose()
    cols = {c for (c,) in rows(db, "select column_name from information_schema.columns where table_name = 'trials'")}
    assert {"mismatch_gap", "mismatch_tie", "drafter_digest", "prompt_digest"} <= cols
    assert rows(db, "select max(version) from schema_info")[0][0] == SCHEMA_VERSION


SWEEP_ARGS = ["--caps", "2,4", "--prompts", "code,math", "--trials", "3", "-n", "12", "--prompt-limit", "3", "--no-warmup", "-v"]


def start_sweep(model, head, db):
    cmd = [sys.executable, "-m", "dspark_lab", "sweep", "-m", str(model), "-d", str(head), "--db", str(db), *SWEEP_ARGS]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env={**os.environ, "COLUMNS": "200"})


def wait_for(proc, needle, limit=240):
    t = time.time()
    for line in proc.stderr:
        if needle in line:
            return line
        if time.time() - t > limit:
            break
    raise AssertionError(f"never saw {needle!r}")


def test_killed_sweep_resumes_without_loss_or_duplicates(tiny_dirs, head, tmp_path):
    db = tmp_path / "k.duckdb"
    proc = start_sweep(tiny_dirs["qwen3"], head, db)
    wait_for(proc, "stored trial 7:")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stored = rows(db, "select count(*) from trials")[0][0]
    assert stored >= 7
    assert rows(db, "select status from runs")[0][0] == "running"  # killed: never marked finished
    r = runner.invoke(app, ["sweep", "-m", str(tiny_dirs["qwen3"]), "-d", str(head), "--db", str(db), "--resume", *SWEEP_ARGS])
    assert r.exit_code == 0, r.output
    total = 7 * 2 * 3 * 3  # arms (baseline, lookup, dspark, dspark-pipe at 2 caps) x sets x prompts x trials
    assert rows(db, "select count(*) from trials")[0][0] == total
    assert rows(db, "select count(*) from (select arm_key, trial_index from trials group by all having count(*) > 1)")[0][0] == 0
    assert rows(db, "select count(*), min(status) from runs")[0] == (1, "finished")


def test_two_sweeps_on_one_database_get_a_clear_error(tiny_dirs, head, tmp_path):
    db = tmp_path / "busy.duckdb"
    proc = start_sweep(tiny_dirs["qwen3"], head, db)
    try:
        wait_for(proc, "stored trial 1:")
        r = runner.invoke(app, ["sweep", "-m", str(tiny_dirs["qwen3"]), "--db", str(db), "--trials", "1", "-n", "4", "--prompt-limit", "1"])
        assert r.exit_code == 2 and "in use by another dspark-lab process" in r.output
    finally:
        proc.kill()
        proc.wait()


def test_export_ingest_round_trip(tiny_dirs, head, tmp_path):
    db = tmp_path / "a.duckdb"
    rid = run_sweep(small_config(tiny_dirs["qwen3"], head, trials=1, caps=["2"]), db, progress=False)
    engine = open_db(db)
    path = export_run(engine, rid, tmp_path / "result.json")
    engine.dispose()
    doc = json.loads(path.read_text())
    assert doc["format"] == "dspark-lab-result" and doc["schema_version"] == SCHEMA_VERSION == 4 and doc["run"]["device_stamp"]
    other = open_db(tmp_path / "b.duckdb")
    assert "ingested run" in ingest(other, [path])[0][1]
    assert "already in the database" in ingest(other, [path])[0][1]
    other.dispose()
    assert rows(tmp_path / "b.duckdb", "select count(*) from trials")[0][0] == rows(db, "select count(*) from trials")[0][0]
    assert rows(tmp_path / "b.duckdb", "select source from runs")[0][0] == "ingested:result.json"
    r = runner.invoke(app, ["export", "--db", str(db), "--parquet", str(tmp_path / "pq")])
    assert r.exit_code == 0, r.output
    assert rows(db, f"select count(*) from '{tmp_path / 'pq' / 'trials.parquet'}'")[0][0] == len(doc["trials"])


@pytest.fixture(scope="module")
def good_result(tiny_dirs, head, tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    rid = run_sweep(small_config(tiny_dirs["qwen3"], head, trials=1, caps=["2"], prompt_limit=1, prompt_sets=["code"]), d / "g.duckdb", progress=False)
    engine = open_db(d / "g.duckdb")
    path = export_run(engine, rid, d / "good.json")
    engine.dispose()
    return json.loads(path.read_text())


def mutate(doc, fn):
    doc = json.loads(json.dumps(doc))
    fn(doc)
    return doc


MALFORMED = [
    ("not-json", "{not json", "not valid JSON"),
    ("empty", "", "the file is empty"),
    ("list", [], "expected a JSON object"),
    ("format", lambda d: d.update(format="other"), "not a dspark-lab result file"),
    ("no-version", lambda d: d.pop("schema_version"), "missing or invalid schema_version"),
    ("newer", lambda d: d.update(schema_version=99), "newer than this dspark-lab reads"),
    ("no-run", lambda d: d.pop("run"), "field 'run' is missing"),
    ("trials-dict", lambda d: d.update(trials={}), "field 'trials' is missing or not a list"),
    ("bad-type", lambda d: d["trials"][0].update(num_tokens="many"), "trial 0 is invalid: field 'num_tokens'"),
    ("missing-field", lambda d: d["trials"][0].pop("output_hash"), "trial 0 is invalid: field 'output_hash'"),
    ("foreign-trial", lambda d: d["trials"][0].update(run_id="elsewhere"), "belongs to run 'elsewhere'"),
    ("not-a-list", lambda d: d["trials"][0].update(accept_lengths="{}"), "field 'accept_lengths' is not a JSON list"),
    ("run-invalid", lambda d: d["run"].pop("device_key"), "run record is invalid: field 'device_key'"),
]


@pytest.mark.parametrize("name, change, match", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_result_files_are_rejected(good_result, tmp_path, name, change, match):
    path = tmp_path / f"{name}.json"
    if isinstance(change, str):
        path.write_text(change)
    elif isinstance(change, list):
        path.write_text(json.dumps(change))
    else:
        path.write_text(json.dumps(mutate(good_result, change)))
    with pytest.raises(DsparkError, match=match):
        read_result(path)
    engine = open_db(tmp_path / "x.duckdb")
    assert ingest(engine, [path])[0][1].startswith("rejected")
    engine.dispose()


def test_oversized_result_file_is_rejected(good_result, tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    path.write_text(json.dumps(good_result))
    monkeypatch.setattr(results_mod, "MAX_BYTES", 100)
    with pytest.raises(DsparkError, match="larger than"):
        read_result(path)


def test_ingest_cli_reports_rejects(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    r = runner.invoke(app, ["ingest", str(bad), "--db", str(tmp_path / "i.duckdb")])
    assert r.exit_code == 2 and "rejected" in r.output


def test_grid_file(tiny_dirs, head, tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(f'models = ["{tiny_dirs["qwen3"]}"]\ndrafters = ["{head}"]\nmodes = ["baseline", "dspark"]\ncaps = [3]\n'
                    'prompt_sets = ["math"]\ntrials = 1\nmax_new_tokens = 6\nprompt_limit = 1\n')
    r = runner.invoke(app, ["sweep", "--grid", str(grid), "--db", str(tmp_path / "g.duckdb")])
    assert r.exit_code == 0, r.output
    assert rows(tmp_path / "g.duckdb", "select count(*) from trials")[0][0] == 2
    grid.write_text('models = ["x"]\nbogus = 1\n')
    with pytest.raises(InputError, match="unknown key"):
        load_grid(grid)
    grid.write_text("models = [")
    with pytest.raises(InputError, match="invalid TOML"):
        load_grid(grid)


@pytest.mark.parametrize("kw, match", [
    (dict(modes=["baseline", "warp"]), "unknown mode"),
    (dict(drafters=[]), "mode dspark needs at least one --drafter"),
    (dict(caps=["two"]), "is not a positive number or 'auto'"),
    (dict(trials=0), "must be >= 1"),
    (dict(models=[]), "needs at least one --model"),
    (dict(precisions=["fp8"]), "precision 'fp8' is not one of as-loaded, dequantized, rows-kernel, unfused or weight bits"),
])
def test_bad_sweep_configs(tiny_dirs, head, kw, match):
    with pytest.raises(InputError, match=match):
        small_config(tiny_dirs["qwen3"], head, **kw)


def test_launch_every_changes_no_output_and_keeps_old_grid_keys(tiny_dirs, head, tmp_path):
    """--launch-every reaches every arm's target; outputs are the same token ids as without it,
    and a grid that does not use it keeps the key it had before the option existed."""
    plain = small_config(tiny_dirs["qwen3"], head, caps=["2"], trials=1)
    early = small_config(tiny_dirs["qwen3"], head, caps=["2"], trials=1, launch_every=1)
    assert plain.key() != early.key()
    assert plain.key() == legacy_grid_key(plain)
    outs = []
    for cfg, name in ((plain, "a"), (early, "b")):
        db = tmp_path / f"{name}.duckdb"
        run_sweep(cfg, db, progress=False)
        outs.append(rows(db, "select arm_key, prompt_id, output_hash from trials order by all"))
    assert [r[1:] for r in outs[0]] == [r[1:] for r in outs[1]]
    with pytest.raises(InputError, match="launch-every"):
        small_config(tiny_dirs["qwen3"], head, launch_every=-1)


def test_pipelined_arm_options_reach_the_loop_and_keep_old_grid_keys(tiny_dirs, head, tmp_path, monkeypatch):
    """pipe_lookup and compile_draft reach every dspark-pipe arm (and no other), its auto arm's
    calibration included, the outputs stay the baseline's, the run's stamp records them, and a
    grid without them keeps its old key."""
    import dspark_lab.engine as engine_module

    seen = []
    real = engine_module.speculative_generate

    def spy(*a, **kw):
        seen.append((kw.get("pipeline"), kw.get("lookup_drafts"), kw.get("compile_draft")))
        return real(*a, **kw)

    monkeypatch.setattr(engine_module, "speculative_generate", spy)
    import dspark_lab.lab.calibrate as calibrate_module

    calibrated = {}  # mode -> the loop options its auto arm's curves were timed with
    real_calibrate = calibrate_module.calibrate

    def calibrate(*a, **kw):
        calibrated[kw["mode"]] = (kw.get("compile_draft"), kw.get("lookup_drafts"))
        return real_calibrate(*a, **kw)

    monkeypatch.setattr(calibrate_module, "calibrate", calibrate)
    plain = small_config(tiny_dirs["qwen3"], head, modes=["baseline", "dspark", "dspark-pipe"], caps=["2"], trials=1)
    both = small_config(tiny_dirs["qwen3"], head, modes=["baseline", "dspark", "dspark-pipe"], caps=["2", "auto"], trials=1,
                        pipe_lookup=True, compile_draft=True)
    assert plain.key() != both.key()
    assert plain.key() == legacy_grid_key(plain)
    db = tmp_path / "p.duckdb"
    run_sweep(both, db, progress=False)
    assert set(seen) == {(False, None, None), (True, True, True)}
    assert calibrated == {"dspark": (False, False), "dspark-pipe": (True, True)}  # the auto arm's curves: its own loop
    lossless = rows(db, "select distinct mode, lossless from trials order by all")
    assert lossless == [("baseline", None), ("dspark", True), ("dspark-pipe", True)]
    (stamp, config), = rows(db, "select device_stamp, config from runs")
    assert json.loads(config)["pipe_lookup"] is True and '"compile_draft": true' in stamp


def test_a_sweep_runs_the_rows_kernel_beside_the_stored_weights(tmp_path, monkeypatch):
    """--precisions as-loaded,rows-kernel: the same weights swept twice, the second copy's products
    routed (the CUDA kernel stood in for by its float32 reference here, and the tiny layers made
    large enough to route), its trials under MODEL@rows-kernel with their own baseline."""
    from dspark_lab.engine import rows_kernel
    from dspark_lab.tiny import build_tiny_model

    widths = []

    def stand_in(x, *args, **kwargs):
        widths.append(x.size // x.shape[-1])
        return rows_kernel.reference_rows_matmul(x, *args, **kwargs)

    monkeypatch.setattr(rows_kernel, "quantized_rows_matmul", lambda: stand_in)
    monkeypatch.setattr(rows_kernel, "MIN_WEIGHT_ROWS", 0)  # route every width MLX serves row by row
    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    head = build_tiny_dspark(tmp_path / "head", model, block_size=4)
    cfg = small_config(model, head, modes=["baseline", "dspark"], caps=["2"], prompt_sets=["code"], prompt_limit=1,
                       trials=1, max_new_tokens=8, precisions=["as-loaded", "rows-kernel"], dtype="bfloat16")
    db = tmp_path / "k.duckdb"
    run_sweep(cfg, db, progress=False)
    ids = [str(model), f"{model}@rows-kernel"]
    assert sorted(r[0] for r in rows(db, "select distinct model_id from trials")) == sorted(ids)
    for model_id in ids:
        assert rows(db, f"select count(*) from trials where model_id = '{model_id}' and mode = 'baseline'")[0][0] == 1
    # The verify's 3 rows, the draft's 2; a prompt of 8-16 tokens prefills at a chain verify's widths.
    assert widths and {3, 2} <= set(widths) <= set(rows_kernel.QMV_ROWS) | set(rows_kernel.CHAIN_VERIFY_ROWS)


def test_each_precision_runs_as_a_model_of_its_own(tmp_path):
    """precisions: a 4-bit model swept as loaded, at 8 bits and dequantized, each stored on load:
    trials carry MODEL@q8 / MODEL@dequantized, each variant has its own baseline and every arm is
    lossless against it; a resumed run finds nothing left; the grid key changes only when asked."""
    from dspark_lab.engine.names import split_variant
    from dspark_lab.lab.sweep import load_variant, model_variant
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    head = build_tiny_dspark(tmp_path / "head", model, block_size=4)
    cfg = small_config(model, head, modes=["baseline", "lookup", "dspark"], caps=["2"], prompt_sets=["code"], prompt_limit=1,
                       trials=1, max_new_tokens=8, precisions=["as-loaded", "8", "dequantized"])
    assert cfg.key() != small_config(model, head, modes=["baseline", "lookup", "dspark"], caps=["2"], prompt_sets=["code"],
                                     prompt_limit=1, trials=1, max_new_tokens=8).key()
    db = tmp_path / "v.duckdb"
    rid = run_sweep(cfg, db, progress=False)
    ids = [str(model), f"{model}@q8", f"{model}@dequantized"]
    assert [model_variant(str(model), p) for p in cfg.precisions] == ids
    assert [split_variant(i) for i in ids] == [(str(model), "as-loaded"), (str(model), "q8"), (str(model), "dequantized")]
    assert split_variant("/models/me@work/m") == ("/models/me@work/m", "as-loaded")  # an @ in a path is no label
    assert sorted(r[0] for r in rows(db, "select distinct model_id from trials")) == sorted(ids)
    for model_id in ids:
        assert rows(db, f"select count(*) from trials where model_id = '{model_id}' and mode = 'baseline'")[0][0] == 1
        assert rows(db, f"select count(*), count(*) filter (where lossless) from trials where model_id = '{model_id}' and mode != 'baseline'")[0] == (2, 2)
    import mlx.nn as nn

    q8, _ = load_variant(f"{model}@q8")
    assert {m.bits for _, m in q8.model.named_modules() if isinstance(m, nn.QuantizedLinear)} == {8}
    dq, _ = load_variant(f"{model}@dequantized")
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dq.model.named_modules())
    assert run_sweep(cfg, db, resume=rid, progress=False) == rid  # every cell of every variant found stored
    assert rows(db, "select count(*) from trials")[0][0] == 9


def test_precisions_run_prompt_by_prompt_in_turn_unless_asked_one_at_a_time(tmp_path):
    """Several precisions are held at once and each (prompt, repeat) cell runs at every precision
    before the next cell, a repeat rotating which goes first: a machine that drifts between the
    start and the end of a sweep (an H100 in the fortieth round) then lands on every precision
    alike. --one-precision-at-a-time runs one precision's cells, then the next's."""
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    head = build_tiny_dspark(tmp_path / "head", model, block_size=4)
    order = {}
    for interleave in (True, False):
        cfg = small_config(model, head, modes=["baseline", "dspark"], caps=["2"], prompt_sets=["code"], prompt_limit=2,
                           trials=2, max_new_tokens=6, precisions=["as-loaded", "8"], interleave_precisions=interleave)
        db = tmp_path / f"i{interleave}.duckdb"
        run_sweep(cfg, db, progress=False)
        order[interleave] = [(r[0].endswith("@q8"), r[1], r[2]) for r in
                             rows(db, "select model_id, prompt_id, trial_index from trials order by created_at")]
        assert len(order[interleave]) == 16
        for q8 in (False, True):  # every variant still has a baseline and lossless arms per cell
            cells = [c for c in order[interleave] if c[0] == q8]
            assert len(cells) == 8
    cells = order[True]
    # Each cell's four trials (2 variants x baseline and dspark) come together, prompt by prompt...
    assert [c[1:] for c in cells[::4]] == [("code-001", 0), ("code-001", 1), ("code-002", 0), ("code-002", 1)]
    assert all(len({c[1:] for c in cells[k:k + 4]}) == 1 and {c[0] for c in cells[k:k + 4]} == {False, True} for k in range(0, 16, 4))
    # ...and the second repeat starts with the other precision.
    assert [cells[k][0] for k in range(0, 16, 4)] == [False, True, False, True]
    one = order[False]
    assert [c[0] for c in one] == [False] * 8 + [True] * 8
    with pytest.raises(InputError, match="precision"):
        small_config(model, head, precisions=["fp8"], interleave_precisions=False)
    assert small_config(model, head, precisions=["as-loaded", "8"]).key() != small_config(
        model, head, precisions=["as-loaded", "8"], interleave_precisions=False).key()


def test_benchmark_cli_gives_a_row_per_precision(tmp_path):
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    r = runner.invoke(app, ["benchmark", "-m", str(model), "--caps", "2", "--trials", "1", "--prompts", "code", "--prompt-limit", "1",
                            "-n", "8", "--db", str(tmp_path / "b.duckdb"), "--precisions", "as-loaded,8"], terminal_width=200)
    assert r.exit_code == 0, r.output
    table = r.output[r.output.index("preci"):]  # the column, however narrow the console draws it
    assert "as-lo" in table and "q8" in table and table.count("lookup") >= 2
    # Then each precision against the model as loaded, trial by trial: baseline, lookup and mlx-lm at q8.
    paired = r.output[r.output.index("each precision against the model as loaded"):]
    assert paired.count("q8") == 3 and "baseline" in paired and "lookup" in paired and "mlx-lm" in paired
    bad = runner.invoke(app, ["benchmark", "-m", str(model), "--precisions", "fp8", "--db", str(tmp_path / "c.duckdb")])
    assert bad.exit_code != 0 and "precision 'fp8' is not one of" in bad.output


def test_mlx_lm_reference_arm_runs_beside_the_baseline(tiny_dirs, tmp_path):
    """--modes mlx-lm: mlx-lm's own decoder on every prompt, checked against our greedy's tokens,
    its speedup the ratio of its rate to our greedy's."""
    from dspark_lab.db.queries import summary

    db = tmp_path / "ref.duckdb"
    run_sweep(SweepConfig(models=[str(tiny_dirs["qwen3"])], modes=["baseline", "mlx-lm", "lookup"], caps=["2"], prompt_sets=["code"],
                          trials=1, max_new_tokens=8, prompt_limit=2), db, progress=False)
    assert rows(db, "select count(*), count(*) filter (where lossless), min(cap) from trials where mode = 'mlx-lm'")[0] == (2, 2, "0")
    engine = open_db(db)
    ref = summary(engine).filter(summary(engine)["mode"] == "mlx-lm").to_dicts()
    engine.dispose()
    assert len(ref) == 1 and ref[0]["speedup"] > 0 and ref[0]["lossless_trials"] == 2


def test_compiled_step_reference_arm_runs_beside_the_baseline(tiny_dirs, tmp_path, monkeypatch):
    """--modes compiled-step: our plain decoding through compiled one-row steps on every prompt,
    the baseline's tokens, its speedup its rate over the plain step's; no cap, never a registry
    entry. On CUDA (the kernel stood in for) its attention goes through the kernel once the
    kernel's check passes, the check noted in the run's config."""
    import dspark_lab.engine.attention_kernel as ak
    import dspark_lab.engine.kernels as kernels
    from dspark_lab.db.queries import summary
    from dspark_lab.lab.kernel_probe import ATTENTION_OFFSETS
    from dspark_lab.lab.sweep import NON_DRAFTING_MODES

    assert "compiled-step" in NON_DRAFTING_MODES
    db = tmp_path / "step.duckdb"
    cfg = SweepConfig(models=[str(tiny_dirs["qwen3"])], modes=["baseline", "compiled-step"], caps=["2"], prompt_sets=["code"],
                      trials=1, max_new_tokens=8, prompt_limit=2)
    run_sweep(cfg, db, progress=False)
    assert rows(db, "select count(*), count(*) filter (where lossless), min(cap) from trials where mode = 'compiled-step'")[0] == (2, 2, "0")
    engine = open_db(db)
    step = summary(engine).filter(summary(engine)["mode"] == "compiled-step").to_dicts()
    engine.dispose()
    assert len(step) == 1 and step[0]["speedup"] > 0
    assert "step_attention_checked" not in json.loads(rows(db, "select config from runs")[0][0])  # no CUDA here
    from dspark_lab.tiny import build_tiny_model

    calls = []
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    monkeypatch.setattr(ak, "rows_attention", lambda: lambda *a: calls.append(1) or ak.reference_rows_attention(*a))
    for model, dtype, takes in ((tiny_dirs["qwen3"], None, False),  # head dim 16: not one the kernel takes
                                (build_tiny_model(tmp_path / "hd32", "qwen3", seed=3, head_dim=32), "bfloat16", True)):
        calls.clear()
        db2 = tmp_path / f"step_{takes}.duckdb"
        run_sweep(SweepConfig(models=[str(model)], modes=["baseline", "compiled-step"], caps=["2"], prompt_sets=["code"],
                              trials=1, max_new_tokens=8, prompt_limit=2, dtype=dtype, baseline_step="plain"), db2, progress=False)
        checked = json.loads(rows(db2, "select config from runs")[0][0])["step_attention_checked"][str(model)]
        assert checked["exact"] == takes, checked["reason"]
        assert rows(db2, "select count(*) filter (where lossless or mismatch_tie) from trials where mode = 'compiled-step'")[0] == (2,)
        assert len(calls) > len(ATTENTION_OFFSETS) if takes else not calls  # decoded through it where its check passed


def test_the_baseline_steps_as_generate_does_and_a_resumed_run_keeps_its_step(tiny_dirs, tmp_path, monkeypatch):
    """The baseline arm (every speedup's denominator) decodes as `generate --mode baseline` does
    on the machine: off CUDA plainly; on CUDA through the compiled step where the greedy-step probe
    says so; or as --baseline-step forces. plain-step runs the plain step beside it, and a resumed
    run keeps the step its stored baseline trials took (plainly, for a run from before the choice
    was recorded), whatever is asked or probed now."""
    import dspark_lab.engine as engine_mod
    import dspark_lab.engine.kernels as kernels
    import dspark_lab.lab.kernel_probe as kp
    from dspark_lab.lab.kernel_probe import KernelVerdict

    steps = []  # (compiled_step, tokens) of every greedy_generate the sweep calls
    real = engine_mod.greedy_generate

    def spy(*a, **kw):
        r = real(*a, **kw)
        steps.append((kw.get("compiled_step", False), r.token_ids))
        return r

    monkeypatch.setattr(engine_mod, "greedy_generate", spy)
    model = str(tiny_dirs["qwen3"])

    def sweep(db, **kw):
        steps.clear()
        run_sweep(SweepConfig(models=[model], modes=["baseline", "plain-step"], caps=["2"], prompt_sets=["code"], trials=1,
                              max_new_tokens=8, prompt_limit=2, warmup=False, **kw), db, progress=False)
        config = json.loads(rows(db, "select config from runs order by started_at desc")[0][0])
        return config.get("baseline_step_chosen", {}).get(model), [c for c, _ in steps]

    chosen, compiled = sweep(tmp_path / "cpu.duckdb")  # no CUDA here: plainly, as generate does
    assert chosen == {"step": "plain", "asked": "auto"} and compiled == [False] * 4
    chosen, compiled = sweep(tmp_path / "forced.duckdb", baseline_step="compiled")
    assert chosen["step"] == "compiled" and compiled == [True, False, True, False]  # the baseline, then plain-step, a prompt
    assert steps[0][1] == steps[1][1]  # the same tokens either way (float32 on the CPU)
    assert rows(tmp_path / "forced.duckdb", "select count(*) filter (where lossless) from trials where mode = 'plain-step'")[0] == (2,)

    says = {"use": True}
    asked = []
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    monkeypatch.setattr(kp, "choose_greedy_step", lambda target, **kw: asked.append(kw["model_id"]) or KernelVerdict(
        "rows_attention", says["use"], "stood in", exact=says["use"]))
    import dspark_lab.engine.attention_kernel as ak
    monkeypatch.setattr(ak, "rows_attention", lambda: ak.reference_rows_attention)
    db = tmp_path / "cuda.duckdb"
    chosen, compiled = sweep(db)
    assert asked == [model] and chosen["step"] == "compiled" and chosen["probe"]["use"] and compiled[0::2] == [True, True]
    # Resumed: a run that chose the compiled step keeps it though the probe now says otherwise, and
    # one from before the choice was recorded steps plainly though the probe says compile.
    for before, now, expect in (("compiled", False, True), (None, True, False)):
        con = duckdb.connect(str(db))
        config = json.loads(con.execute("select config from runs").fetchone()[0])
        if before is None:
            del config["baseline_step_chosen"]
        con.execute("update runs set status = 'interrupted', config = ?", [json.dumps(config)])
        con.execute("delete from trials where prompt_id = (select max(prompt_id) from trials)")
        con.close()
        says["use"] = now
        steps.clear()
        asked.clear()
        run_sweep(SweepConfig(models=[model], modes=["baseline", "plain-step"], caps=["2"], prompt_sets=["code"], trials=1,
                              max_new_tokens=8, prompt_limit=2, warmup=False), db, resume=True, progress=False)
        assert not asked and [c for c, _ in steps] == [expect, False], before
        assert rows(db, "select count(*), count(distinct arm_key) from trials")[0] == (4, 4)
    with pytest.raises(InputError, match="--baseline-step 'fast'"):
        SweepConfig(models=[model], modes=["baseline"], baseline_step="fast")


def test_a_routed_copys_baseline_steps_as_its_models_does(tmp_path, monkeypatch):
    """MODEL@rows-kernel's baseline takes the step MODEL's chose in the run (at one row the routed
    layers run their own product), without probing again; a routed copy whose model was not
    measured in the run probes for itself, as any model does."""
    from sqlmodel import Session

    import dspark_lab.engine.kernels as kernels
    import dspark_lab.lab.kernel_probe as kp
    from dspark_lab.lab.kernel_probe import KernelVerdict
    from dspark_lab.lab.sweep import _baseline_step
    from dspark_lab.schemas.records import Run

    engine = open_db(tmp_path / "r.duckdb")
    with Session(engine) as s:
        s.add(Run(id="r1", dspark_lab_version="0", device_key="d", machine="m", device_stamp="{}",
                  config=json.dumps({"baseline_step_chosen": {"/m/a": {"step": "compiled", "asked": "auto"}}})))
        s.commit()
    asked = []
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    monkeypatch.setattr(kp, "choose_greedy_step", lambda target, **kw: asked.append(kw["model_id"]) or KernelVerdict(
        "rows_attention", False, "stood in", exact=True))
    said = []
    cfg = SweepConfig(models=["/m/a"], modes=["baseline"])
    assert _baseline_step(cfg, None, None, engine, "r1", "/m/a@rows-kernel", said.append) is True
    assert asked == [] and "as /m/a's does (compiled)" in said[0]
    assert _baseline_step(cfg, None, None, engine, "r1", "/m/b@rows-kernel", said.append) is False
    assert asked == ["/m/b@rows-kernel"]
    with Session(engine) as s:
        chosen = json.loads(s.get(Run, "r1").config)["baseline_step_chosen"]
    assert chosen["/m/a@rows-kernel"] == {"step": "compiled", "asked": "auto", "as": "/m/a"}
    assert chosen["/m/b@rows-kernel"]["step"] == "plain" and "as" not in chosen["/m/b@rows-kernel"]
    engine.dispose()


def test_every_trial_is_put_against_the_bandwidth_limit(tiny_dirs, tmp_path):
    """A run measures its copy bandwidth and each model's bytes a step reads, so every trial has
    its plain-decoding limit and every summary row its share of it (issue #10); a run that never
    recorded them (older, or ingested) has none rather than a made-up one."""
    from dspark_lab.db.queries import summary, trials_frame

    db = tmp_path / "bw.duckdb"
    rid = run_sweep(SweepConfig(models=[str(tiny_dirs["qwen3"])], modes=["baseline", "lookup"], caps=["2"], prompt_sets=["code"],
                                trials=1, max_new_tokens=8, prompt_limit=2), db, progress=False)
    config = json.loads(rows(db, "select config from runs")[0][0])
    bw = config["bandwidth"]
    weights = bw["models"][str(tiny_dirs["qwen3"])]
    assert bw["copy_bytes_per_s"] > 1e8 and weights["weight_bytes"] > 0 and weights["kv_bytes_per_position"] > 0
    engine = open_db(db)
    t = trials_frame(engine)
    expected = bw["copy_bytes_per_s"] / (weights["weight_bytes"] + weights["kv_bytes_per_position"] * (t["prompt_tokens"] + t["num_tokens"] / 2))
    assert (t["limit_tok_s"] - expected).abs().max() < 1e-6 * expected.max()
    s = summary(engine).to_dicts()
    for row in s:
        arm = t.filter((t["mode"] == row["mode"]) & (t["cap"] == row["cap"]))
        assert abs(row["limit_share"] - (arm["decode_tokens_per_sec"] / arm["limit_tok_s"]).median()) < 1e-9
    with engine.begin() as conn:  # as a run from before the limit was recorded
        conn.exec_driver_sql("update runs set config = ?", (json.dumps({k: v for k, v in config.items() if k != "bandwidth"}),))
    assert all(r["limit_share"] is None for r in summary(engine).to_dicts())
    assert trials_frame(engine)["limit_tok_s"].null_count() == t.height
    engine.dispose()
    assert rid


def test_later_repeats_rotate_the_arm_order(tiny_dirs, tmp_path):
    """Trial 0 of a prompt runs the baseline first (its tokens are the reference); trial 1 starts
    one arm later, so the baseline is not always the first of its cell, and every arm is still
    checked against the reference."""
    db = tmp_path / "rot.duckdb"
    run_sweep(SweepConfig(models=[str(tiny_dirs["qwen3"])], modes=["baseline", "lookup"], caps=["2", "3"], prompt_sets=["code"],
                          trials=2, max_new_tokens=6, prompt_limit=1, warmup=False), db, progress=False)
    order = [(t, m, c) for t, m, c in rows(db, "select trial_index, mode, cap from trials order by created_at")]
    assert order == [(0, "baseline", "0"), (0, "lookup", "2"), (0, "lookup", "3"),
                     (1, "lookup", "2"), (1, "lookup", "3"), (1, "baseline", "0")]
    assert rows(db, "select count(*) from trials where mode = 'lookup' and lossless is null")[0][0] == 0


def test_a_path_that_is_nothing_is_refused_before_a_run_is_created(tiny_dirs, head, tmp_path):
    db = tmp_path / "typo.duckdb"
    with pytest.raises(InputError, match="drafter '/no/such/head' not found.*nothing was run or stored"):
        run_sweep(small_config(tiny_dirs["qwen3"], "/no/such/head"), db, progress=False)
    with pytest.raises(InputError, match="model '/no/such/model' not found"):
        run_sweep(small_config("/no/such/model", head), db, progress=False)
    assert not db.exists()  # no database, no failed run in it


def test_paired_precisions_divide_each_trial_by_its_as_loaded_twin(tmp_path):
    """db.queries.paired_precisions: for each labelled precision, arm and domain, the median over
    (prompt, repeat) pairs of its decode tok/s over the same prompt and repeat as loaded."""
    import statistics

    from dspark_lab.db import open_db
    from dspark_lab.db.queries import paired_precisions
    from dspark_lab.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "q4", "qwen3", seed=4, quantize_bits=4)
    head = build_tiny_dspark(tmp_path / "head", model, block_size=4)
    cfg = small_config(model, head, modes=["baseline", "dspark"], caps=["2"], prompt_sets=["code"], prompt_limit=2,
                       trials=2, max_new_tokens=6, precisions=["as-loaded", "8"])
    db = tmp_path / "p.duckdb"
    rid = run_sweep(cfg, db, progress=False)
    engine = open_db(db)
    try:
        pairs = paired_precisions(engine, run_ids=[rid])
    finally:
        engine.dispose()
    assert pairs.height == 2 and set(pairs["mode"]) == {"baseline", "dspark"} and set(pairs["precision"]) == {"q8"}
    assert set(pairs["pairs"]) == {4} and all(lo <= r <= hi for r, lo, hi in pairs.select("ratio", "ci_lo", "ci_hi").iter_rows())
    speeds = {(m.endswith("@q8"), mode, p, i): s for m, mode, p, i, s in
              rows(db, "select model_id, mode, prompt_id, trial_index, decode_tokens_per_sec from trials")}
    for mode in ("baseline", "dspark"):
        want = statistics.median(speeds[(True, mode, p, i)] / speeds[(False, mode, p, i)] for p in ("code-001", "code-002") for i in (0, 1))
        got = pairs.filter(pairs["mode"] == mode)["ratio"][0]
        assert abs(got - want) < 1e-9


def test_the_sweeps_launch_kernels_are_probed_given_or_kept_off(tmp_path, monkeypatch):
    """SweepConfig.launch_kernels: "auto" asks the probe (as generate does), "on" uses the kernels
    without asking, "off" leaves the target alone; each noted in the run's config. "on" is refused
    without a pipelined mode or off CUDA, an unknown setting always; "auto" keeps old grids' keys."""
    from sqlmodel import Session

    import dspark_lab.engine.kernels as kernels
    import dspark_lab.lab.kernel_probe as kp
    from dspark_lab.lab.kernel_probe import KernelVerdict
    from dspark_lab.lab.sweep import _route_launch_kernels
    from dspark_lab.schemas.records import Run

    piped = dict(models=["/m/a"], drafters=["/h"], modes=["baseline", "dspark-pipe"])
    with pytest.raises(InputError, match="dspark-pipe and dspark-tree-pipe"):
        SweepConfig(models=["/m/a"], modes=["baseline"], launch_kernels="on")
    with pytest.raises(InputError, match="'sometimes'"):
        SweepConfig(**piped, launch_kernels="sometimes")
    if not kernels.cuda_available():
        with pytest.raises(InputError, match="CUDA"):
            SweepConfig(**piped, launch_kernels="on")
    assert SweepConfig(**piped).key() == SweepConfig(**piped, launch_kernels="auto").key() != SweepConfig(**piped, launch_kernels="off").key()

    class Target:
        kernels = None

        def use_launch_kernels(self, k):
            self.kernels = k

    class Head:
        dropped = 0

        def drop_traces(self):
            self.dropped += 1

    engine = open_db(tmp_path / "k.duckdb")
    with Session(engine) as s:
        s.add(Run(id="r1", dspark_lab_version="0", device_key="d", machine="m", device_stamp="{}", config="{}"))
        s.commit()
    asked = []
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    monkeypatch.setattr(kp, "launch_kernels", lambda: ("attention", "writer", "mover"))
    monkeypatch.setattr(kp, "choose_launch_kernels", lambda target, **kw: asked.append(kw["model_id"]) or KernelVerdict(
        "launch", True, "stood in", exact=True))
    said, chosen = [], {}
    for setting in ("off", "on", "auto"):
        target, head = Target(), Head()
        _route_launch_kernels(setting, target, head, None, engine, "r1", f"/m/a|/h|{setting}", said.append)
        chosen[setting] = (target.kernels, head.dropped)
    assert chosen == {"off": (None, 0), "on": (("attention", "writer", "mover"), 1), "auto": (("attention", "writer", "mover"), 1)}
    assert asked == ["/m/a|/h|auto"]
    with Session(engine) as s:
        noted = json.loads(s.get(Run, "r1").config)["launch_kernels_chosen"]
    assert set(noted) == {"/m/a|/h|off", "/m/a|/h|on", "/m/a|/h|auto"} and noted["/m/a|/h|on"]["reason"] == "--launch-kernels given"
    assert noted["/m/a|/h|off"] == {"use": False, "reason": "--no-launch-kernels given"}
    engine.dispose()


def test_benchmark_and_sweep_take_launch_kernels(tiny_dirs, head, tmp_path):
    """Off CUDA `--launch-kernels` is refused before anything runs, saying why; `--no-launch-kernels` runs."""
    from dspark_lab.engine.kernels import cuda_available

    if cuda_available():
        pytest.skip("a CUDA backend is here")
    model = str(tiny_dirs["qwen3"])
    for verb in (["benchmark", "-m", model, "-d", str(head), "--caps", "2", "--trials", "1", "-n", "4", "--prompt-limit", "1",
                  "--no-mlx-lm", "--prompts", "code"],
                 ["sweep", "-m", model, "-d", str(head), "--modes", "dspark-pipe", "--caps", "2", "--trials", "1", "-n", "4",
                  "--prompt-limit", "1", "--prompts", "code"]):
        db = tmp_path / f"{verb[0]}.duckdb"
        r = CliRunner().invoke(app, verb + ["--db", str(db), "--launch-kernels"])
        assert r.exit_code != 0 and "needs MLX's CUDA backend" in r.output and "leave it off" in r.output, r.output
        assert not db.exists()
    r = CliRunner().invoke(app, ["sweep", "-m", model, "-d", str(head), "--modes", "dspark-pipe", "--caps", "2", "--trials", "1",
                                 "-n", "4", "--prompt-limit", "1", "--prompts", "code", "--db", str(tmp_path / "off.duckdb"),
                                 "--no-launch-kernels"])
    assert r.exit_code == 0, r.output
