"""Does handing the device finished layers early (Target.launch_every) make rounds faster here?

    python benchmarks/launch_overlap.py --model DIR [--head DIR] [--every 0,4,8] [--cap 4]
        [--prompts code,math] [--limit 2] [--max-new-tokens 128] [--repeats 3] [--json OUT]

A speculative round must read the previous verdict before it builds the next draft and verify,
so the host's graph building (benchmarks/op_count.py) adds to the device's time instead of
hiding behind it as it does in plain decoding. With launch_every N the verify forward goes to
the device N layers at a time while the rest is still being built. This runs greedy decoding and
speculative decoding (DSpark with --head, else lookup) at each N, arms interleaved after a
warm-up pass, and reports median decode tok/s, the ratio to N=0, and token identity (the same
operations run at every N, so outputs must be identical).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head")
    ap.add_argument("--drafter-bits", type=int, default=16)
    ap.add_argument("--every", default="0,4,8")
    ap.add_argument("--cap", type=int, default=4)
    ap.add_argument("--prompts", default="code,math")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from dspark_lab import greedy_generate, load_target, lookup_generate, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.text import encode_prompt
    from dspark_lab.lab.prompts import load_prompt_sets

    target, tok = load_target(args.model)
    head = load_dspark(args.head, target, bits=args.drafter_bits) if args.head else None
    prompts = [encode_prompt(tok, p.as_input()) for s in load_prompt_sets(args.prompts, limit=args.limit) for p in s.prompts]
    every = [int(x) for x in args.every.split(",")]

    def spec(ids):
        if head is not None:
            return speculative_generate(target, tok, head, ids, max_new_tokens=args.max_new_tokens, max_draft_tokens=args.cap,
                                        lookup_drafts=False)
        return lookup_generate(target, tok, ids, max_new_tokens=args.max_new_tokens, max_draft_tokens=args.cap)

    arms = {f"{kind}@{n}": (kind, n) for n in every for kind in ("greedy", "spec")}
    rates = {a: [] for a in arms}
    accepts = {n: [] for n in every}  # tokens committed per speculative round, at each setting
    tokens = {}
    for rep in range(args.repeats + 1):  # pass 0 warms up (kernel compiles)
        for ids_i, ids in enumerate(prompts):
            for name, (kind, n) in arms.items():
                target.launch_every = n
                r = greedy_generate(target, tok, ids, max_new_tokens=args.max_new_tokens) if kind == "greedy" else spec(ids)
                tokens.setdefault((name, ids_i), r.token_ids)
                if rep:
                    rates[name].append(r.decode_tokens_per_sec)
                    if kind == "spec":
                        accepts[n] += r.accept_lengths
    target.launch_every = 0
    med = {a: statistics.median(v) for a, v in rates.items()}
    rows = []
    for name, (kind, n) in arms.items():
        base = f"{kind}@{every[0]}"
        same = all(tokens[(name, i)] == tokens[(base, i)] for i in range(len(prompts)))
        rows.append({"arm": name, "kind": kind, "launch_every": n, "tok_s": round(med[name], 1),
                     "vs_first": round(med[name] / med[base], 3), "identical_to_first": same})
        print(f"{name:10} {med[name]:8.1f} tok/s  x{med[name] / med[base]:.3f} vs launch_every={every[0]}  identical: {same}")
    for n in every:  # the speculative speedup at each setting, both arms measured side by side
        acc = accepts[n]
        ratio = med[f"spec@{n}"] / med[f"greedy@{n}"]
        rows.append({"arm": f"speedup@{n}", "kind": "ratio", "launch_every": n, "spec_over_greedy": round(ratio, 3),
                     "mean_accept_len": round(sum(acc) / len(acc), 3) if acc else None})
        print(f"launch_every={n}: speculative x{ratio:.3f} greedy" + (f", mean accept length {sum(acc) / len(acc):.2f}" if acc else ""))
    result = {"model": args.model, "head": args.head, "cap": args.cap, "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "rows": rows}
    import mlx.core as mx

    result["device"] = str(mx.default_device())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
