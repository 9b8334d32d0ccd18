"""Append one device run's training log to a committed head's, under the run's name.

    python benchmarks/append_train_log.py fixtures/MODEL-dspark/train_log.jsonl.gz RUN_LOG.jsonl \
        --run session28 [--upto STEP]

A committed head (fixtures/*-dspark) keeps every step it was trained, each row named by its run
("run": "session26"), so its card's table can be checked against the log. Each session that
continues the head appends its run's log (results.tar.gz's train_log.jsonl, from
h200_collect.sh). --upto keeps only the steps up to the checkpoint committed: when a machine is
lost mid-run, the head is an earlier checkpoint (the twenty-eighth round's, step 4,000 of 5,856
logged), and the log must describe the head, not the run.

Refused: a run name the log has already (a session appended twice), a run log that does not start
at step 1 or skips steps (a partial copy), and --upto past the run's last step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from unanswered_prompts import read_jsonl  # noqa: E402


def append(log: Path, run_log: Path, run: str, upto: int | None = None) -> int:
    """Append run_log's steps (to `upto`) to log under `run`; returns how many were appended."""
    old = read_jsonl(log) if log.exists() else []
    if any(r.get("run") == run for r in old):
        raise SystemExit(f"{log} already holds run {run!r}: appended before? Name this run otherwise.")
    rows = read_jsonl(run_log)
    steps = [r.get("step") for r in rows]
    if steps != list(range(1, len(steps) + 1)):
        raise SystemExit(f"{run_log}: its steps do not run 1, 2, 3, ... (a partial or mixed log); bring back the whole run's log.")
    if upto is not None:
        if not 1 <= upto <= len(rows):
            raise SystemExit(f"--upto {upto}: the run logged steps 1 to {len(rows)}.")
        rows = rows[:upto]
    new = [{"run": run, **{k: v for k, v in r.items() if k != "run"}} for r in rows]
    text = "".join(json.dumps(r) + "\n" for r in old + new)
    # No name and mtime 0 in the gzip header: the same rows give the same bytes wherever written,
    # so git sees a change only when the log changed.
    with open(log, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(text.encode())
    return len(new)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path, help="the committed head's train_log.jsonl.gz")
    ap.add_argument("run_log", type=Path, help="the device run's train_log.jsonl (or .gz)")
    ap.add_argument("--run", required=True, help="the run's name in the log, e.g. session28")
    ap.add_argument("--upto", type=int, help="keep steps 1..UPTO only: the checkpoint that was committed")
    args = ap.parse_args(argv)
    n = append(args.log, args.run_log, args.run, args.upto)
    print(f"appended {n} steps of run {args.run} to {args.log}")


if __name__ == "__main__":
    main()
