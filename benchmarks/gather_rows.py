"""Rebuild a device run's training data from what git keeps: every round's generated rows.

Neither a head nor a data file outlives a session (the machine here and the GPU machine both
start bare), but each round's generated rows are committed under docs/results. This joins them,
drops rows whose token ids repeat, and appends any read-corpus rows made here (distill
--data-only --corpus ..., a few minutes on this machine's CPU), into one gzipped data.jsonl for
benchmarks/ship_parts.sh and h200_corpus_heads.sh's DATA:

    python benchmarks/gather_rows.py /tmp/data/rows.jsonl.gz --extra /tmp/sgrows/data.jsonl
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
# The model folder that wrote a committed file's rows, by the short name in the file's name
# (distill12_qwen05_generated...). Rounds 9-12 wrote rows before each row named its model; a
# row without one would pass for the training target's own, and distill counts only a target's
# own rows as answering a prompt.
WRITERS = {"qwen05": "qwen2.5-coder-0.5b-q4-bfloat16", "qwen15": "qwen2.5-coder-1.5b-q4-bfloat16"}


def writer_of(path: Path) -> str | None:
    m = re.match(r"distill\d+_([a-z0-9]+)_generated", path.name)
    return WRITERS.get(m.group(1)) if m else None


def _lines(path: Path):
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        yield from (line for line in f if line.strip())


def gather(out: Path, sources: list[Path], extra: list[Path]) -> collections.Counter:
    """Write the rows of `sources` then `extra` to `out` (gzipped), each distinct token-id
    sequence once; returns how many rows each set gave."""
    seen, sets = set(), collections.Counter()
    with gzip.open(out, "wt") as f:
        for path in [*sources, *extra]:
            writer = writer_of(path)
            for line in _lines(path):
                row = json.loads(line)
                if writer and "model" not in row:
                    row["model"] = writer
                key = hashlib.sha1(json.dumps(row["ids"]).encode()).digest()
                if key in seen:
                    continue
                seen.add(key)
                f.write(json.dumps(row) + "\n")
                sets[row.get("set", "?")] += 1
    return sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--glob", default="distill*_generated.jsonl.gz", help="which committed rows (under docs/results)")
    ap.add_argument("--extra", type=Path, nargs="*", default=[], help="more data.jsonl files (e.g. read-corpus rows)")
    args = ap.parse_args()
    # Round order (distill9 before distill10): a repeated sequence keeps its first round's provenance.
    sources = sorted(RESULTS.glob(args.glob), key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
    if not sources:
        raise SystemExit(f"no files match docs/results/{args.glob}")
    sets = gather(args.out, sources, args.extra)
    print(f"{sum(sets.values())} rows from {len(sources)} committed files and {len(args.extra)} more into {args.out}")
    for name, n in sets.most_common():
        print(f"  {name}: {n}")


if __name__ == "__main__":
    main()
