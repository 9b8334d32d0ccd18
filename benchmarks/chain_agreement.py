"""How often the text of distillation data follows the target's own greedy path.

    python benchmarks/chain_agreement.py --model DIR --data OUT/data.jsonl [--rows 4] [--max-len 384] [--block 5]

For each kind of row (generated continuations, each corpus) it reads a few rows, runs the target
once over each, and counts, over the answer positions, the share where the stored next token is
the target's greedy prediction, and the share of block slots k = 0..block-1 whose slots before
them all follow that path (what `distill --chain-slots` trains; slot 0 always counts). On the
target's own greedy output both are 1; on text it only reads, a slot k > 0 with a departure
before it is labelled for a prefix inference never verifies.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rows", type=int, default=4, help="rows per kind")
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import mlx.core as mx

    from dspark_lab import load_target

    by_kind = defaultdict(list)
    for line in Path(args.data).read_text().splitlines():
        row = json.loads(line)
        by_kind[row["set"] if row.get("generation") == "corpus" else "generated"].append(row)
    target, _ = load_target(args.model)
    rng = random.Random(args.seed)
    report = {}
    for kind, rows in sorted(by_kind.items()):
        follow, slots = [], [[] for _ in range(args.block)]
        for row in rng.sample(rows, min(args.rows, len(rows))):
            ids = row["ids"][: args.max_len]
            start = min(row["prompt_len"], len(ids) - 2)
            logits = target.forward(mx.array(ids, dtype=mx.uint32), target.make_cache()).logits
            preds = mx.argmax(logits, axis=-1).tolist()
            ok = [ids[p + 1] == preds[p] for p in range(len(ids) - 1)]
            follow += ok[start - 1 :]
            for a in range(start - 1, len(ids) - args.block):
                on_path = True
                for k in range(args.block):
                    slots[k].append(on_path)
                    on_path = on_path and ok[a + k]
        report[kind] = {"rows": min(args.rows, len(rows)), "positions": len(follow),
                        "text_follows_target": round(sum(follow) / max(len(follow), 1), 3),
                        "slots_kept": [round(sum(s) / max(len(s), 1), 3) for s in slots]}
        print(f"{kind:18s} positions {len(follow):6d}  text = target's greedy token {report[kind]['text_follows_target']:.3f}  "
              f"slots kept by --chain-slots {report[kind]['slots_kept']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "data": args.data, "kinds": report}, indent=2))
    return report


if __name__ == "__main__":
    main()
