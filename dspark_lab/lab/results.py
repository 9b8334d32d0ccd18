"""Result JSON: a run exported as one self-describing, schema-versioned, device-stamped file that
other machines send to the maintainers, and `ingest`, which validates such files and merges
them into a database (de-duplicated by run id). Also Parquet export of the tables.

A file written before schema 4 has no prompt_digest on its trials; ingest fills it wherever a
built-in set version fixes the prompt (lab/prompt_identity.py), so its prompts pool with other
runs' whatever --prompt-limit each run used.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError
from sqlmodel import Session, select

from ..errors import DsparkError
from ..schemas.records import SCHEMA_VERSION, CalibrationRecord, Run, Trial
from .prompt_identity import backfill_prompt_digests, fill_prompt_digests

FORMAT = "dspark-lab-result"
MAX_BYTES = 64 * 1024 * 1024  # a result of tens of thousands of trials is a few MB; more is not a result file
MAX_TRIALS = 200_000


def _row(model) -> dict:
    d = model.model_dump()
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in d.items()}


def export_run(engine, run_id: str, path: str | Path) -> Path:
    with Session(engine) as s:
        run = s.get(Run, run_id)
        if run is None:
            raise DsparkError(f"no run {run_id!r} in this database; `dspark-lab export --list` shows the runs.")
        trials = s.exec(select(Trial).where(Trial.run_id == run_id)).all()
        curves = s.exec(select(CalibrationRecord).where(CalibrationRecord.device_key == run.device_key)).all()
        doc = {
            "format": FORMAT, "schema_version": SCHEMA_VERSION,
            "fields": {"run": sorted(Run.model_fields), "trial": sorted(Trial.model_fields)},
            "run": _row(run), "trials": [_row(t) for t in trials], "calibration": [_row(c) for c in curves],
        }
    path = Path(path)
    path.write_text(json.dumps(doc, indent=1))
    return path


def _validate(doc, name: str) -> tuple[Run, list[Trial], list[CalibrationRecord]]:
    def fail(why: str):
        raise DsparkError(f"{name}: {why}")

    if not isinstance(doc, dict):
        fail("not a result file (expected a JSON object).")
    if doc.get("format") != FORMAT:
        fail(f"not a dspark-lab result file (format is {doc.get('format')!r}, expected {FORMAT!r}).")
    version = doc.get("schema_version")
    if not isinstance(version, int) or version < 1:
        fail("missing or invalid schema_version.")
    if version > SCHEMA_VERSION:
        fail(f"schema_version {version} is newer than this dspark-lab reads ({SCHEMA_VERSION}); upgrade dspark-lab.")
    for key, kind in (("run", dict), ("trials", list)):
        if not isinstance(doc.get(key), kind):
            fail(f"field {key!r} is missing or not a {kind.__name__}.")
    if len(doc["trials"]) > MAX_TRIALS:
        fail(f"{len(doc['trials'])} trials is more than the {MAX_TRIALS} a result file may hold.")
    try:
        run = Run.model_validate(doc["run"])
    except ValidationError as e:
        fail(f"run record is invalid: {_first_error(e)}")
    trials = []
    for i, t in enumerate(doc["trials"]):
        try:
            trial = Trial.model_validate(t)
        except ValidationError as e:
            fail(f"trial {i} is invalid: {_first_error(e)}")
        if trial.run_id != run.id:
            fail(f"trial {i} belongs to run {trial.run_id!r}, not to this file's run {run.id!r}.")
        for field in ("accept_lengths", "draft_lengths", "per_position_acceptance", "output_ids"):
            try:
                if not isinstance(json.loads(getattr(trial, field)), list):
                    raise ValueError
            except ValueError:
                fail(f"trial {i}: field {field!r} is not a JSON list.")
        trials.append(trial)
    curves = []
    for i, c in enumerate(doc.get("calibration") or []):
        try:
            curves.append(CalibrationRecord.model_validate(c))
        except ValidationError as e:
            fail(f"calibration record {i} is invalid: {_first_error(e)}")
    return run, trials, curves


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"field {'.'.join(str(p) for p in err['loc'])!r}: {err['msg']}"


def read_result(path: str | Path) -> tuple[Run, list[Trial], list[CalibrationRecord]]:
    """Parse and validate one result file; DsparkError naming the file and the problem if bad."""
    path = Path(path)
    if not path.exists():
        raise DsparkError(f"{path}: no such file.")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise DsparkError(f"{path.name}: {size / 1e6:.0f} MB is larger than the {MAX_BYTES // (1024 * 1024)} MB a result file may be.")
    if size == 0:
        raise DsparkError(f"{path.name}: the file is empty.")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DsparkError(f"{path.name}: not valid JSON ({e}).") from None
    return _validate(doc, path.name)


def ingest(engine, paths: list[str | Path]) -> list[tuple[str, str]]:
    """Merge result files into the database. Returns (file, outcome) per file; a bad file is
    reported and skipped, never half-merged; a run already present is skipped. Trials without a
    prompt digest (files from before schema 4) get the one their built-in set fixes, and so do
    such trials already in the database, so old and new runs pool by prompt alike."""
    backfill_prompt_digests(engine)
    outcomes = []
    for p in paths:
        try:
            run, trials, curves = read_result(p)
        except DsparkError as e:
            outcomes.append((str(p), f"rejected: {e}"))
            continue
        run_id, n = run.id, len(trials)
        with Session(engine) as s:
            if s.get(Run, run_id) is not None:
                outcomes.append((str(p), f"skipped: run {run_id} is already in the database"))
                continue
            run.source = f"ingested:{Path(p).name}"
            fill_prompt_digests(trials)
            s.add(run)
            s.add_all(trials)
            known = {c.id for c in s.exec(select(CalibrationRecord)).all()}
            s.add_all(c for c in curves if c.id not in known)
            s.commit()  # the whole file in one transaction
        outcomes.append((str(p), f"ingested run {run_id}: {n} trials"))
    return outcomes


def export_parquet(engine, out_dir: str | Path) -> list[Path]:
    """Every table as a Parquet file (DuckDB writes them directly)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    raw = engine.raw_connection()
    try:
        con = raw.driver_connection
        for table in ("runs", "trials", "calibration"):
            path = out / f"{table}.parquet"
            con.execute(f"COPY {table} TO '{path.as_posix()}' (FORMAT parquet)")
            written.append(path)
    finally:
        raw.close()
    return written
