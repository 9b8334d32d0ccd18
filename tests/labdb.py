"""Results databases for the query, report and registry tests.

`synthetic_db` writes Run / Trial / CalibrationRecord rows directly, with tok/s chosen so every
summary number can be worked out by hand (the expected values are spelled out below).
`sweep_db` runs a real tiny sweep once per test session (a few seconds) and hands out copies,
so a test may change its copy (flip a trial's `lossless`) without touching the others.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import json
import shutil
import tempfile
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pytest
from sqlmodel import Session

from dspark_lab.db.store import open_db
from dspark_lab.lab.curves import CostCurves, Point
from dspark_lab.schemas.records import CalibrationRecord, Run, Trial

# SweepConfig fields newer than its grid key: a grid that leaves them at their defaults keeps the
# key it had before they existed, so an old unfinished run still resumes. A new field goes here.
NEWER_THAN_THE_GRID_KEY = ("draft_models", "launch_every", "pipe_lookup", "compile_draft", "tree_nodes", "precisions",
                           "interleave_precisions", "baseline_step", "launch_kernels")


def rows(db, sql: str) -> list[tuple]:
    """The rows of `sql` over the database file `db`, read-only (the lab's engine may still hold it)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.sql(sql).fetchall()
    finally:
        con.close()


def as_older_schema(engine, version: int, dropped_columns: list[str]) -> None:
    """Make a database look as schema `version` left it: the trials columns added since dropped,
    the recorded version set back (DuckDB drops no column under an index, so the indexes are
    dropped around it and made again)."""
    from sqlalchemy import text

    with engine.begin() as conn:
        indexes = conn.execute(text("SELECT index_name, sql FROM duckdb_indexes() WHERE table_name = 'trials'")).fetchall()
        for name, _ in indexes:
            conn.execute(text(f"DROP INDEX {name}"))
        for column in dropped_columns:
            conn.execute(text(f"ALTER TABLE trials DROP COLUMN {column}"))
        for _, sql in indexes:
            conn.execute(text(sql))
        conn.execute(text("DELETE FROM schema_info"))
        conn.execute(text(f"INSERT INTO schema_info (version, written_by) VALUES ({version}, 'old')"))


def legacy_grid_key(cfg) -> str:
    """The key a sweep grid had before the fields in NEWER_THAN_THE_GRID_KEY existed."""
    old = {k: v for k, v in asdict(cfg).items() if k not in NEWER_THAN_THE_GRID_KEY}
    return hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]


EVIL = "<script>alert(1)</script>"

MODEL_A = "mlx-community/Qwen3-8B-4bit"  # target key qwen3-8b
MODEL_A_CUDA = "/models/Qwen3-8B-bf16"  # the same target, another quantization, another machine
MODEL_B = "Llama-3.2-1B-Instruct-bf16"
HEAD_A = "heads/qwen3-8b-dspark"
METAL, CUDA = "Apple M3 Max 64GB (metal)", "NVIDIA H200 (cuda)"

# (prompt_set, prompt_id, domain) -> tok/s of each trial.
PROMPTS = [("code", "code-001", "code"), ("code", "code-002", "code"), ("chat", "chat-001", "chat")]
BASE_A = {"code-001": [100.0, 110.0], "code-002": [50.0, 50.0], "chat-001": [80.0, 80.0]}
# dspark cap 2: per-prompt ratios 210/105 = 2.0, 75/50 = 1.5, 200/80 = 2.5.
DSPARK2_A = {"code-001": [200.0, 220.0], "code-002": [75.0, 75.0], "chat-001": [200.0, 200.0]}
# dspark auto: ratios 1.8, 1.8, 1.8 (worse than cap 2).
DSPARKAUTO_A = {"code-001": [189.0, 189.0], "code-002": [90.0, 90.0], "chat-001": [144.0, 144.0]}
# lookup cap 4: fast (ratio 3.0 everywhere) but one trial is not lossless -> refused.
LOOKUP4_A = {"code-001": [315.0, 315.0], "code-002": [150.0, 150.0], "chat-001": [240.0, 240.0]}
# Expected pooled numbers for dspark cap 2 on metal.
EXPECT_DSPARK2 = {"speedup": 2.0, "code": 1.75, "chat": 2.5, "median_tok_s": 200.0, "baseline_median_tok_s": 80.0,
                  "trials": 6, "prompts": 3}


def _stamp(machine: str, backend: str) -> dict:
    return {"backend": backend, "device_name": machine.split(" (")[0], "mlx_version": "0.32.4", "mlx_lm_version": "0.32.2",
            "dspark_lab_version": "0.1.0", "git_commit": "a" * 40, "git_dirty": False}


def _run(run_id: str, machine: str, key: str, backend: str) -> Run:
    t = datetime(2026, 11, 20, 10, 0, tzinfo=timezone.utc)
    return Run(id=run_id, started_at=t, finished_at=t.replace(hour=11), status="finished", dspark_lab_version="0.1.0",
               device_key=key, machine=machine, device_stamp=json.dumps(_stamp(machine, backend)), config="{}")


def trial(run_id: str, model: str, mode: str, cap: str, prompt: tuple, index: int, tok_s: float, *,
          drafter: str | None = None, lossless: bool | None = True, accept=(3, 2, 1, 3), draft=(2, 2, 2, 2),
          version: str = "v1", digest: str | None = None) -> Trial:
    """`version`: the prompt set's version as run; `digest`: the prompt's own (None: stored before
    schema 4, or a set the lab could not rebuild)."""
    pset, pid, domain = prompt
    if mode == "baseline":
        accept, draft, lossless = (1,) * 8, (0,) * 8, None
    n = sum(accept)
    depth = max(draft)
    profile = [sum(1 for a, d in zip(accept, draft) if d > i and a - 1 > i) / max(1, sum(1 for d in draft if d > i))
               for i in range(depth)]
    return Trial(
        id=uuid.uuid4().hex, run_id=run_id, arm_key=f"{model}|{drafter or '-'}|{mode}|{cap}|{pset}|{pid}", trial_index=index,
        model_id=model, drafter_id=drafter, mode=mode, cap=cap, prompt_set=pset, prompt_set_version=version, prompt_id=pid,
        prompt_digest=digest, domain=domain, max_new_tokens=64, output_hash="h", output_ids="[1, 2, 3]", num_tokens=n, prompt_tokens=20,
        finish_reason="length", num_rounds=len(accept), target_forwards=len(accept), accept_lengths=json.dumps(list(accept)),
        draft_lengths=json.dumps(list(draft)), per_position_acceptance=json.dumps(profile),
        caps_chosen=json.dumps([2] * len(accept)) if cap == "auto" else None,
        mean_accept_len=n / len(accept), prefill_seconds=0.01, decode_seconds=(n - 1) / tok_s, tokens_per_sec=tok_s * 0.9,
        decode_tokens_per_sec=tok_s, lossless=lossless, mismatch_index=None if lossless is not False else 3)


CURVES = CostCurves(
    verify={w: Point(ms, 0.2, 5) for w, ms in {1: 10.0, 2: 10.2, 3: 10.4, 4: 10.6, 6: 14.0, 8: 18.0}.items()},
    drafter={1: Point(1.0, 0.1, 5), 2: Point(1.5, 0.1, 5), 4: Point(2.5, 0.1, 5)},
    overhead=Point(0.5, 0.1, 5), depth_slope_ms=0.001, short_ctx=128, long_ctx=1024)


def fill_synthetic(path: Path, *, evil: bool = False) -> Path:
    """Write the synthetic database to `path`. With `evil`, model B's id and one prompt id carry
    markup, and that prompt's lookup trial is flagged not lossless (so it is listed by name)."""
    engine = open_db(path)
    model_b = f"evil/{EVIL}" if evil else MODEL_B
    rows: list = [_run("run-metal", METAL, "dk-metal", "metal"), _run("run-cuda", CUDA, "dk-cuda", "cuda")]
    for p in PROMPTS:
        pid = p[1]
        for i in range(2):
            rows.append(trial("run-metal", MODEL_A, "baseline", "0", p, i, BASE_A[pid][i]))
            rows.append(trial("run-metal", MODEL_A, "dspark", "2", p, i, DSPARK2_A[pid][i], drafter=HEAD_A))
            rows.append(trial("run-metal", MODEL_A, "dspark", "auto", p, i, DSPARKAUTO_A[pid][i], drafter=HEAD_A))
            bad = pid == "code-002" and i == 1
            rows.append(trial("run-metal", MODEL_A, "lookup", "4", p, i, LOOKUP4_A[pid][i], lossless=not bad,
                              accept=(2, 1, 1, 2), draft=(4, 0, 1, 4)))
            # The same target on another machine: dspark cap 4 at 3x.
            rows.append(trial("run-cuda", MODEL_A_CUDA, "baseline", "0", p, i, 300.0))
            rows.append(trial("run-cuda", MODEL_A_CUDA, "dspark", "4", p, i, 900.0, drafter=HEAD_A, accept=(5, 3, 4, 5),
                              draft=(4, 4, 4, 4)))
        # Model B: one trial per prompt only (3 < MIN_TRIALS), 1.5x.
        b = (p[0], EVIL, p[2]) if evil and pid == "chat-001" else p
        rows.append(trial("run-metal", model_b, "baseline", "0", b, 0, 100.0))
        rows.append(trial("run-metal", model_b, "lookup", "2", b, 0, 150.0, lossless=b is p))
    rows.append(CalibrationRecord(id="cal-1", key="k1", device_key="dk-metal", machine=METAL, device_stamp="{}",
                                  model_id=MODEL_A, drafter_id=HEAD_A, mode="dspark", options=json.dumps({"max_cap": 4}),
                                  curves=json.dumps(CURVES.to_dict())))
    rows.append(CalibrationRecord(id="cal-bad", key="k2", device_key="dk-metal", machine=METAL, device_stamp="{}",
                                  model_id=MODEL_A, mode="lookup", options="{}", curves="{not json"))
    with Session(engine) as s:
        s.add_all(rows)
        s.commit()
    engine.dispose()
    return path


def synthetic_db(tmp_path: Path, evil: bool = False):
    return open_db(fill_synthetic(tmp_path / "synthetic.duckdb", evil=evil))


def sweep_available() -> bool:
    return importlib.util.find_spec("dspark_lab.lab.sweep") is not None


@functools.cache
def _sweep_master() -> Path:
    """A real tiny sweep: qwen3 target, a random DSpark head, baseline/lookup/dspark at caps 2
    and 4 on two prompts each of code and chat, one trial each."""
    from dspark_lab.lab.sweep import SweepConfig, run_sweep
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="dspark-lab-sweep-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    model = build_tiny_model(root / "model", "qwen3")
    head = build_tiny_dspark(root / "head", model, block_size=4)
    cfg = SweepConfig(models=[str(model)], drafters=[str(head)], modes=["baseline", "lookup", "dspark"], caps=["2", "4"],
                      prompt_sets=["code", "chat"], trials=1, max_new_tokens=12, prompt_limit=2)
    db = root / "sweep.duckdb"
    run_sweep(cfg, db, progress=False)
    return db


def sweep_db(tmp_path: Path):
    """An engine on a private copy of the session's real tiny sweep (skips if sweeps do not exist yet)."""
    if not sweep_available():
        pytest.skip("dspark_lab.lab.sweep is not in this checkout yet; the real-sweep checks need run_sweep")
    copy = tmp_path / "sweep.duckdb"
    master = _sweep_master()
    shutil.copyfile(master, copy)
    wal = master.with_name(master.name + ".wal")
    if wal.exists():  # normally checkpointed when the sweep closed the file
        shutil.copyfile(wal, copy.with_name(copy.name + ".wal"))
    return open_db(copy)


def store_other_weights(head: Path) -> None:
    """The same head stored again at its path with other weights, as a training session leaves a
    fixture it continued (its first tensor moved by 1)."""
    import mlx.core as mx

    path = Path(head) / "model.safetensors"
    weights, meta = mx.load(str(path), return_metadata=True)
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1
    mx.save_safetensors(str(path), weights, metadata=meta)
