"""Write the prompts of a distill round's prompt files that the round did not answer, for the next.

    python benchmarks/unanswered_prompts.py --data RUN/generated.jsonl PROMPTS.jsonl.gz ... \
        --out-dir DIR [--suffix _left12]

A generation step (`distill --data-only --data-minutes M`) stops on its clock, so it answers only
part of each prompt file it was given. Every generated row carries its prompt's `set` (the prompt
file's name, `my.jsonl.gz` -> `my`) and `prompt_id`; what a file holds beyond those ids is left for
the next round. Each prompt file gets one output, `DIR/<name><suffix>.jsonl.gz`, the prompt records
unchanged and in their order, and a line saying how many of its prompts were answered.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dspark_lab.lab.prompts import load_prompt_set  # noqa: E402
from dspark_lab.lab.prompts.public import open_text  # noqa: E402
from synthetic_prompts import write_prompt_file  # noqa: E402


def read_jsonl(path: Path) -> list[dict]:
    with open_text(path) as f:  # plain or gzipped, as the prompt loader reads them
        return [json.loads(line) for line in f if line.strip()]


def unanswered(rows: list[dict], prompts: list[dict], name: str) -> list[dict]:
    answered = {row["prompt_id"] for row in rows if row.get("set") == name}
    return [p for p in prompts if p["id"] not in answered]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt_files", nargs="+", type=Path)
    ap.add_argument("--data", type=Path, required=True, help="the round's data or generated rows (JSONL, .gz or not)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--suffix", default="_left", help="added to each prompt file's name (default _left)")
    a = ap.parse_args(argv)
    rows = read_jsonl(a.data)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for path in a.prompt_files:
        name = load_prompt_set(str(path)).name  # distill's name for the file's rows; also checks the file
        prompts = read_jsonl(path)
        left = unanswered(rows, prompts, name)
        out = a.out_dir / f"{name}{a.suffix}.jsonl.gz"
        write_prompt_file(out, left)
        print(f"{name}: {len(prompts) - len(left)} of {len(prompts)} answered, {len(left)} left -> {out}")


if __name__ == "__main__":
    main()
