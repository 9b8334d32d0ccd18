"""Where in an answer a head's drafts fail: its teacher-forced accept length split by the kind of
text each anchor drafts into (prose, a fence line, or code in a fenced block of a given
language), per prompt set.

    python benchmarks/accept_by_segment.py --model MODEL --rows ROWS.jsonl(.gz) --anchors ANCHORS.jsonl.gz \
        [--head NAME] [--min-share 0.01] [--json OUT.json]

ROWS are the rows a `block_accept.py --anchors-out` run measured (its --data file, or the
--rows-out of an --against-decode run) and ANCHORS that file; MODEL gives the tokenizer only (no
weights are read). An anchor at answer position o drafts the tokens from o + 1 on; it is counted
under the kind of text token o + 1 starts in. Per set and kind: the anchors, their share of the
set's, the mean accept length over them, and over the rounds of the decode's path starting
there. A kind under --min-share of its set's anchors is folded into "other".
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plot_accept_by_position import head_anchors, path_rounds  # noqa: E402
from plot_held_accept import base_set  # noqa: E402
from unanswered_prompts import read_jsonl  # noqa: E402

LANG_NAMES = {"py": "python", "python3": "python", "js": "javascript", "jsx": "javascript", "ts": "typescript",
              "tsx": "typescript", "sh": "bash", "shell": "bash", "zsh": "bash", "console": "bash", "c++": "cpp",
              "golang": "go", "rs": "rust", "postgresql": "sql", "psql": "sql", "yml": "yaml", "docker": "dockerfile"}


def line_kinds(text: str) -> list[tuple[int, str]]:
    """(start offset, kind) of every line: 'fence' for a ``` line, 'code:LANG' inside a fenced
    block (LANG its opening fence's tag, lower-cased and common aliases joined; '?' untagged),
    'prose' elsewhere."""
    out, at, lang = [], 0, None
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            if lang is None:
                tag = line.strip()[3:].strip().lower().split(" ")[0]
                lang = LANG_NAMES.get(tag, tag) or "?"
            else:
                lang = None
            out.append((at, "fence"))
        else:
            out.append((at, "prose" if lang is None else f"code:{lang}"))
        at += len(line) + 1
    return out


def token_kinds(pieces: list[str]) -> list[str]:
    """The kind of text (line_kinds) each token starts in, from the tokens' text pieces; a token
    that starts with line breaks counts from its first character after them."""
    text = "".join(pieces)
    lines = line_kinds(text)
    starts = [s for s, _ in lines]
    out, at = [], 0
    for piece in pieces:
        first = at + (len(piece) - len(piece.lstrip("\n")) if piece.strip("\n") else 0)
        i = max(0, bisect.bisect_right(starts, first) - 1)  # the last line starting at or before it
        out.append(lines[i][1])
        at += len(piece)
    return out


def by_segment(rows: list[dict], anchors: list[dict], tokenizer, min_share: float = 0.01) -> list[dict]:
    """One line per (set, kind of text): anchors, share, mean accept over them and over the
    decode's rounds starting in that kind."""
    texts = {(r.get("set", ""), r.get("prompt_id", "")): r for r in rows}
    acc = defaultdict(lambda: [0, 0, 0, 0])  # anchors, accepted, rounds, accepted on the path
    for a in anchors:
        row = texts.get((a["set"], a["prompt_id"]))
        if row is None:
            raise SystemExit(f"the anchors name a row ({a['set']}, {a['prompt_id']}) the rows file does not hold: "
                             "give the --data (or --rows-out) file the anchors were measured on")
        answer = row["ids"][row["prompt_len"]:]
        kinds = token_kinds([tokenizer.decode([t]) for t in answer])
        kind_of = lambda o: kinds[min(o + 1, len(kinds) - 1)]  # noqa: E731: the first drafted token's
        name = base_set(a["set"])
        for o, n in zip(a["offsets"], a["accepted"]):
            k = acc[(name, kind_of(o))]
            k[0] += 1
            k[1] += n
        for o, n in path_rounds(a["offsets"], a["accepted"]):
            k = acc[(name, kind_of(o))]
            k[2] += 1
            k[3] += n
    totals = defaultdict(int)
    for (name, _), v in acc.items():
        totals[name] += v[0]
    folded = defaultdict(lambda: [0, 0, 0, 0])
    for (name, kind), v in acc.items():
        key = (name, kind if v[0] >= min_share * totals[name] else "other")
        folded[key] = [x + y for x, y in zip(folded[key], v)]
    table = [{"set": name, "kind": kind, "anchors": v[0], "share": round(v[0] / totals[name], 3),
              "mean_accept": round(1 + v[1] / v[0], 3) if v[0] else None,
              "path_rounds": v[2], "path_mean_accept": round(1 + v[3] / v[2], 3) if v[2] else None}
             for (name, kind), v in folded.items()]
    return sorted(table, key=lambda r: (r["set"], -r["anchors"]))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the target (its tokenizer only)")
    ap.add_argument("--rows", type=Path, required=True, help="the rows the anchors were measured on")
    ap.add_argument("--anchors", type=Path, required=True, help="a block_accept.py --anchors-out file")
    ap.add_argument("--head", help="which head of the anchors file (its path or the end of it); the first by default")
    ap.add_argument("--min-share", type=float, default=0.01)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    for path in (a.rows, a.anchors):
        if not path.is_file():
            ap.error(f"{path}: no such file")
    from dspark_lab.engine.loading import load_tokenizer

    head, anchors = head_anchors(a.anchors, a.head)
    table = by_segment(read_jsonl(a.rows), anchors, load_tokenizer(a.model), a.min_share)
    for r in table:
        print(f"{r['set']:<6} {r['kind']:<18} {r['anchors']:>7} anchors ({r['share']:>5.1%})  every anchor {r['mean_accept']:.3f}"
              f"  path {r['path_mean_accept'] or float('nan'):.3f} over {r['path_rounds']} rounds")
    if a.json:
        a.json.write_text(json.dumps({"head": head, "rows": str(a.rows), "table": table}, indent=2))
    return table


if __name__ == "__main__":
    main()
