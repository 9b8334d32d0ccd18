"""For each held-out built-in prompt, the training prompt most like it: does a head's gain on a set
come from a training request that copies one of its prompts?

    python benchmarks/prompt_twins.py --sets code,math --limit 8 self_code_s2.jsonl.gz math_synth4.jsonl.gz ...

Likeness is the Jaccard index of the two texts' word sets (lower-cased letters, digits and
underscores): 1.0 for the same words, near 0 for unrelated ones. A pair at or above --flag is
printed as a TWIN. The tenth round found its math twins by reading the templates; this finds
copies that no template shows, such as requests the target wrote itself (self_instruct.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark_lab.lab.prompts import Prompt, load_prompt_sets  # noqa: E402


def words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9_]+", text.lower()))


def prompt_text(p: Prompt) -> str:
    return " ".join(m["content"] for m in p.messages) if p.messages else (p.text or "")


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 0.0


def nearest(held_out: list[Prompt], training: list[tuple[str, Prompt]]) -> list[dict]:
    """One row per held-out prompt: its most alike training prompt, the set (file) it is in, and the likeness."""
    pool = [(name, p, words(prompt_text(p))) for name, p in training]
    rows = []
    for h in held_out:
        w = words(prompt_text(h))
        name, best, score = max(((n, p, jaccard(w, pw)) for n, p, pw in pool), key=lambda t: t[2], default=(None, None, 0.0))
        rows.append({"prompt": h.id, "likeness": round(score, 3), "set": name, "nearest": best and best.id,
                     "held_out_text": prompt_text(h), "nearest_text": best and prompt_text(best)})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="the training prompt files (JSONL, .gz or not)")
    ap.add_argument("--sets", default="code,math,chat", help="the held-out built-in sets")
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts of each set (a round evaluates 8)")
    ap.add_argument("--flag", type=float, default=0.5, help="likeness from which a pair is called a twin")
    a = ap.parse_args(argv)
    training = [(s.name, p) for s in load_prompt_sets(a.files) for p in s.prompts]
    held = [p for s in load_prompt_sets(a.sets, limit=a.limit) for p in s.prompts]
    rows = nearest(held, training)
    for r in rows:
        mark = "TWIN " if r["likeness"] >= a.flag else ""
        print(f"{mark}{r['prompt']}  {r['likeness']:.2f}  {r['set']}:{r['nearest']}  "
              f"{r['held_out_text'][-60:]!r} ~ {(r['nearest_text'] or '')[:80]!r}")
    twins = sum(r["likeness"] >= a.flag for r in rows)
    print(f"{twins} of {len(rows)} held-out prompts have a training prompt at likeness >= {a.flag} "
          f"(the most alike: {max((r['likeness'] for r in rows), default=0):.2f}); {len(training)} training prompts")
    return rows


if __name__ == "__main__":
    main()
