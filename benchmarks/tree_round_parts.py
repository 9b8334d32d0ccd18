"""Where a pipelined tree round's time goes, beside the pipelined chain's, part by part, on a real
pair (docs/performance.md, thirty-sixth round: on the H100 a one-node tree round cost more than
a chain round of 8 rows).

    python benchmarks/tree_round_parts.py --model DIR --head DIR [--drafter-bits 16] [--dtype float32] [--dequantize] [--cap 7] [--nodes 1,16,32] [--repeats 30]

After a prompt's prefill (InFlight, as the pipelined loops start), each part runs on its own at
the same cache offset, evaluated alone (mx.eval), its median wall time over --repeats after
warm-up; a greedy decode step (one row, argmax) is the unit. Parts:
  chain:  draft_step_at (compiled draft, argmax per position), forward_at of cap+1 rows + verify;
  tree:   draft_top_at (compiled, the k best per position and their log-probabilities), the
          top-k alone, DeviceTree.choose (alone, alone compiled, and in the draft's trace as the loop
          runs it), tree_round_at
          (verify, walk, cache move: one trace), the tree's forward alone (mask and per-row
          rope, no walk or move) and a chain forward of as many rows: their differences split
          the tree round's extra cost between the per-row rope and mask, and the walk and move.
The sums say what a round costs without the pipelining's overlap; the parts say which to cut.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from dspark_lab.engine import load_target  # noqa: E402
from dspark_lab.engine.drafters.load import load_dspark  # noqa: E402
from dspark_lab.engine.pipeline import InFlight  # noqa: E402
from dspark_lab.engine.sampling import SamplingParams, verify  # noqa: E402
from dspark_lab.engine.text import TextStream, encode_prompt  # noqa: E402
from dspark_lab.engine.topk import top_k_indices  # noqa: E402
from dspark_lab.engine.tree import TREE_TOP_K  # noqa: E402
from dspark_lab.engine.tree_pipeline import DeviceTree  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() evaluated alone, after three warm-up calls (compiles)."""
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--drafter-bits", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="load the target in this precision (float32 on a CPU)")
    ap.add_argument("--dequantize", action="store_true", help="a quantized target's layers as float matrices (the width costs of its bf16 copy)")
    ap.add_argument("--rows-kernel", action="store_true", help="the quantized target's products through the rows kernel (engine/rows_kernel.py, CUDA) where the engine routes them (rows_kernel.worth_routing), every arm alike")
    ap.add_argument("--cap", type=int, default=7)
    ap.add_argument("--nodes", default="1,16,32")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    target, tok = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    if args.rows_kernel:
        from dspark_lab.engine.rows_kernel import quantized_rows_matmul

        print(f"rows kernel: {target.route_quantized_rows(quantized_rows_matmul())} layers routed", flush=True)
    head = load_dspark(args.head, target, bits=args.drafter_bits)
    params = SamplingParams()
    ids = encode_prompt(tok, PROMPT)
    run = InFlight(target, ids, params, head, max_new_tokens=64, stream=TextStream(tok, None, None), on_round=None)
    cache, taps, cap = run.cache, head.target_layer_ids, min(args.cap, head.config.max_drafts)
    pending = mx.array([run.first_token], dtype=mx.uint32)
    offset = mx.array(len(ids), dtype=mx.int32)
    bound = len(ids) + 128
    head.ensure_capacity(bound + head.config.block_size)
    for c in cache:
        c.ensure(bound)

    def greedy_step():
        return mx.argmax(target.forward_at(pending, cache, offset, capacity=bound).logits[-1])

    def chain_draft():
        return head.draft_step_at(None, None, pending, cap, params, offset, compiled=True).tokens

    drafts = chain_draft().astype(mx.uint32)
    mx.eval(drafts)

    def chain_verify():
        out = target.forward_at(mx.concatenate([pending, drafts]), cache, offset, capacity=bound, taps=taps)
        return verify(out.logits, drafts, params, None), out.taps

    def tree_draft():
        return head.draft_top_at(None, None, pending, cap, TREE_TOP_K, offset, compiled=True)

    top, logp = tree_draft()
    mx.eval(top, logp)
    row_logits = mx.random.normal((cap, target.vocab_size))

    def topk_alone():
        return top_k_indices(row_logits, TREE_TOP_K)

    unit = timed(greedy_step, args.repeats)
    parts = {"greedy step": unit, "chain draft (compiled)": timed(chain_draft, args.repeats),
             f"chain verify ({cap + 1} rows + accept)": timed(chain_verify, args.repeats),
             "tree draft (compiled top-k)": timed(tree_draft, args.repeats),
             f"top-k alone ({cap} x vocab, k={TREE_TOP_K})": timed(topk_alone, args.repeats)}
    start = cache[0].offset
    # A round as the pipelined loops run it, its parts summed (no overlap): the chain's draft and
    # verify; a tree's draft with its choice in one trace, and its verify, walk and move.
    rounds = {"chain": parts["chain draft (compiled)"] + parts[f"chain verify ({cap + 1} rows + accept)"]}
    for n in [int(x) for x in args.nodes.split(",") if x.strip()]:
        tree = DeviceTree(n, cap)
        parts[f"tree{n} choose"] = timed(lambda: tree.choose(pending, top, logp), args.repeats)
        compiled_choose = mx.compile(tree.choose)
        parts[f"tree{n} choose (compiled)"] = timed(lambda: compiled_choose(pending, top, logp), args.repeats)
        parts[f"tree{n} draft + choose (one trace)"] = timed(
            lambda: head.draft_top_at(None, None, pending, cap, TREE_TOP_K, offset, compiled=True, then=tree.choose,
                                      then_key=tree.key), args.repeats)
        chosen = tree.choose(pending, top, logp)
        mx.eval(chosen)
        i, d, a, p = chosen
        w = tree.width
        parts[f"tree{n} verify+walk+move ({w} rows)"] = timed(
            lambda: target.tree_round_at(i, d, a, p, cache, offset, capacity=bound, max_depth=cap, taps=taps)[0], args.repeats)

        def tree_forward_only():  # the tree's rows through the compiled forward: mask and per-row rope, no walk or move
            out = target._at_offset[True].tree(i, d, a, cache, taps)
            for c in cache:
                c.offset = start
            return out[0]

        parts[f"tree{n} forward only ({w} rows)"] = timed(tree_forward_only, args.repeats)

        @mx.compile
        def move(keys, values, rows, at):  # the round's K/V move alone: a gather and a write per layer's keys and values
            return ([mx.slice_update(k, mx.take(k, rows, axis=2), at, axes=(2,)) for k in keys],
                    [mx.slice_update(v, mx.take(v, rows, axis=2), at, axes=(2,)) for v in values])

        path_rows = offset + mx.arange(cap + 1)[::-1]
        parts[f"K/V move alone ({cap + 1} rows, every layer)"] = timed(
            lambda: move([c.keys for c in cache], [c.values for c in cache], path_rows, offset.reshape(1)), args.repeats)
        same_width = mx.concatenate([pending, mx.zeros((w - 1,), dtype=mx.uint32)])
        parts[f"chain forward at the tree's width ({w} rows)"] = timed(
            lambda: target.forward_at(same_width, cache, offset, capacity=bound, taps=taps).logits, args.repeats)
        rounds[f"tree{n}"] = parts[f"tree{n} draft + choose (one trace)"] + parts[f"tree{n} verify+walk+move ({w} rows)"]
    print(f"{args.model}: a greedy step {unit * 1e3:.2f} ms")
    for name, s in parts.items():
        print(f"  {name:42s} {s * 1e3:7.2f} ms  {s / unit:5.2f} steps")
    print("a round, its parts summed:")
    for name, s in rounds.items():
        print(f"  {name:42s} {s * 1e3:7.2f} ms  {s / unit:5.2f} steps  {s / rounds['chain']:5.2f}x the chain's")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "seconds": parts, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
