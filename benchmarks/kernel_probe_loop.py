"""Run the n-gram kernel probe (lab/kernel_probe.py) on one pair and print its verdict: the
exactness check, the match's own timing, and the pipelined loop's timing through the kernel
and through the MLX operations, which decides.

    python benchmarks/kernel_probe_loop.py --model DIR --head DIR [--tokens 64] [--passes 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--drafter-bits", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    from dspark_lab import load_target
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.lab.kernel_probe import measure_lookup_kernel

    target, tok = load_target(args.model)
    head = load_dspark(args.head, target, bits=args.drafter_bits)
    v = measure_lookup_kernel(loop=(target, head, tok), loop_tokens=args.tokens, loop_passes=args.passes)
    print(v.describe())
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "head": args.head, "verdict": v.to_dict()}, indent=1))


if __name__ == "__main__":
    main()
