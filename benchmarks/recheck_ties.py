"""Classify every stored mismatch of a results database again with the current tie test
(lab/recheck.py), on the machine that holds the models the trials ran on.

    python benchmarks/recheck_ties.py --db results.duckdb [--run RUN_ID ...] [--update] [--out FILE.json]

Prints, per trial that differs from its baseline, the gap of the two competing tokens at each
forward width and the old and new verdicts; --update stores the new ones (then `dspark-lab report`
and `export` show them). Exit status 1 when a real divergence remains.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark_lab.db import open_db
from dspark_lab.lab.recheck import recheck_mismatches


def show(row: dict) -> None:
    d = row["divergence"] or {}
    gaps = " ".join(f"{k}={v:+.4g}" for k, v in d.get("gaps", {}).items())
    was = {True: "tie", False: "REAL", None: "-"}[row["was_tie"]]
    now = "tie" if row["tie"] else "REAL"
    print(f"{row['arm']} {row['prompt']} #{row['trial_index']} at token {d.get('index')}: "
          f"{d.get('logit_a')} vs {d.get('logit_b')} [{gaps}] was {was}, now {now}: {d.get('why', 'lengths differ')}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--run", action="append", help="only these run ids (repeatable)")
    ap.add_argument("--update", action="store_true", help="store the new gap and verdict in the database")
    ap.add_argument("--out", help="write the rows as JSON")
    args = ap.parse_args()
    rows = recheck_mismatches(open_db(args.db), args.run, update=args.update, on_result=show)
    real = [r for r in rows if not r["tie"]]
    changed = sum(r["was_tie"] is not None and r["was_tie"] != r["tie"] for r in rows)
    print(f"{len(rows)} mismatched trials: {len(rows) - len(real)} ties, {len(real)} real; {changed} verdicts changed"
          + (" and stored" if args.update and changed else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
