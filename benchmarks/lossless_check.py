"""Lookup (and optionally a DSpark/DFlash head) against plain greedy decoding on real weights:
token identity per prompt, and for every difference where it starts and how close the target's
top two logits were there.

    python benchmarks/lossless_check.py --model DIR [--head DIR --mode dspark|dflash --cap 4 [--lookup-drafts]]
        [--tree-nodes 8,16 [--tree-plain 16] [--tree-pipe 16]] [--pipe-arm] [--prompts copy,code] [--limit 6] [--only code-005,...] [--max-new-tokens 512] [--no-lookup-arm]
        [--dtype float32 [--dequantize]]

The head drafts on its own unless --lookup-drafts (then a long n-gram match is verified instead),
so its mean accept length is the head's. `--tree-nodes 8,16` adds an arm per size with the same head
drafting trees (mode dspark-tree, at most --cap deep; with --lookup-drafts a match's continuation
joins each tree as one more path), beside the chain on the same prompts; the tree forward runs
compiled (Target.tree_compiled), and `--tree-plain 16` adds arms whose tree forward is built op by op
(`dspark-tree16-plain`), to time what compiling gains; `--tree-pipe 16` arms run the pipelined tree
loop (`dspark-tree16-pipe`: the tree chosen and verified on the device, its draft compiled, greedy;
engine/tree_pipeline.py). `--pipe-arm` adds the pipelined chain with its compiled draft
(`dspark-pipe`, mode dspark-pipe --compile-draft). With --lookup-drafts both pipelined arms match
n-grams on the device too (the chain's slots overlaid, the tree's one more chain). Per set it also prints, for each draft position, the share
of the rounds that drafted it which accepted it (and every draft before it); the --out JSON keeps
each prompt's per-round accept and draft lengths.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

from dspark_lab.engine import greedy_generate, load_target, lookup_generate, speculative_generate
from dspark_lab.engine.generate import position_acceptance
from dspark_lab.engine.text import encode_prompt
from dspark_lab.lab.lossless import first_divergence
from dspark_lab.lab.prompts import load_prompt_sets
from dspark_lab.lab.sweep import tree_verify_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_prompts import math_without_twin  # noqa: E402  (leaves out the math prompts a training template copies)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--prompts", default="copy,code")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--only", help="comma-separated prompt ids: just these (e.g. one that parted from greedy on the GPU)")
    ap.add_argument("--dtype", help="load the target in this dtype (float32: where a bf16 run parted at a near-tie, is it rounding?)")
    ap.add_argument("--dequantize", action="store_true", help="a quantized target's layers as float matrices (with --dtype float32: the CPU's fast path)")
    ap.add_argument("--rows-kernel", action="store_true", help="the quantized target's products through the rows kernel (engine/rows_kernel.py, CUDA) where the engine routes them (rows_kernel.worth_routing), every arm alike")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--cap", type=int, default=4)
    ap.add_argument("--lookup-drafts", action="store_true")
    ap.add_argument("--no-lookup-arm", action="store_true")
    ap.add_argument("--tree-nodes", default="", help="comma-separated tree sizes: an arm each, the head drafting trees (dspark-tree)")
    ap.add_argument("--tree-plain", default="", help="comma-separated tree sizes: an arm each with the tree forward built op by op, not compiled")
    ap.add_argument("--tree-pipe", default="", help="comma-separated tree sizes: an arm each through the pipelined tree loop")
    ap.add_argument("--pipe-arm", action="store_true", help="an arm for the pipelined chain with its compiled draft (dspark-pipe)")
    ap.add_argument("--drafter-bits", type=int, default=4, help="head weight bits (16 = as saved)")
    ap.add_argument("--out")
    args = ap.parse_args()
    trees = [int(n) for n in args.tree_nodes.split(",") if n.strip()]
    plain_trees = [int(n) for n in args.tree_plain.split(",") if n.strip()]
    pipe_trees = [int(n) for n in args.tree_pipe.split(",") if n.strip()]
    if (trees or plain_trees or pipe_trees or args.pipe_arm) and not args.head:
        raise SystemExit("--tree-nodes, --tree-plain, --tree-pipe and --pipe-arm need --head (trees: a DSpark head without a Markov term)")
    target, tok = load_target(args.model, dtype=args.dtype, dequantize=args.dequantize)
    if args.rows_kernel:
        from dspark_lab.engine.rows_kernel import quantized_rows_matmul

        print(f"rows kernel: {target.route_quantized_rows(quantized_rows_matmul())} layers routed", flush=True)
    head = None
    if args.head:
        from dspark_lab.engine.drafters.load import load_dflash, load_dspark

        head = (load_dflash if args.mode == "dflash" else load_dspark)(args.head, target, bits=args.drafter_bits)
    prompts = [p for s in load_prompt_sets(args.prompts, limit=None if args.only else args.limit) for p in s.prompts]
    if args.only:
        wanted = args.only.split(",")
        prompts = [p for p in prompts if p.id in wanted]
        if len(prompts) != len(wanted):
            raise SystemExit(f"--only: no prompt {sorted(set(wanted) - {p.id for p in prompts})} in --prompts {args.prompts}")
    t0 = time.perf_counter()
    first = encode_prompt(tok, prompts[0].as_input())
    greedy_generate(target, tok, first, max_new_tokens=32)  # warm-up (kernel compiles)
    lookup_generate(target, tok, first, max_new_tokens=32)
    def tree(ids, n, compiled, max_new_tokens):
        target.tree_compiled = compiled
        try:
            return speculative_generate(target, tok, head, ids, max_new_tokens=max_new_tokens, max_draft_tokens=args.cap,
                                        tree_nodes=n, lookup_drafts=args.lookup_drafts)
        finally:
            target.tree_compiled = True

    def pipe(ids, max_new_tokens, tree_nodes=0):
        return speculative_generate(target, tok, head, ids, max_new_tokens=max_new_tokens, max_draft_tokens=args.cap,
                                    pipeline=True, compile_draft=True, tree_nodes=tree_nodes, lookup_drafts=args.lookup_drafts)

    for n in trees:  # the tree forward's first widths compile too
        tree(first, n, True, 32)
    for n in plain_trees:
        tree(first, n, False, 32)
    if args.pipe_arm:
        pipe(first, 32)
    for n in pipe_trees:
        pipe(first, 32, n)
    rows = []
    for p in prompts:
        ids = encode_prompt(tok, p.as_input())
        base = greedy_generate(target, tok, ids, max_new_tokens=args.max_new_tokens)
        arms = {} if args.no_lookup_arm else {"lookup": lookup_generate(target, tok, ids, max_new_tokens=args.max_new_tokens)}
        if head is not None:
            arms[args.mode] = speculative_generate(target, tok, head, ids, max_new_tokens=args.max_new_tokens, max_draft_tokens=args.cap,
                                                   lookup_drafts=args.lookup_drafts)
        if args.pipe_arm:
            arms["dspark-pipe"] = pipe(ids, args.max_new_tokens)
        for n in trees:
            arms[f"dspark-tree{n}"] = tree(ids, n, True, args.max_new_tokens)
        for n in plain_trees:
            arms[f"dspark-tree{n}-plain"] = tree(ids, n, False, args.max_new_tokens)
        for n in pipe_trees:
            arms[f"dspark-tree{n}-pipe"] = pipe(ids, args.max_new_tokens, n)
        for name, r in arms.items():
            nodes = re.match(r"dspark-tree(\d+)", name)  # a tree arm: a tree forward of its rows among the divergence's widths
            rows_fed = tree_verify_rows(name.endswith("-pipe"), int(nodes.group(1)), args.cap, head.config.max_drafts,
                                        args.lookup_drafts) if nodes else 0
            div = first_divergence(target, ids, base.token_ids, r.token_ids, tree_width=rows_fed)
            rows.append({"prompt": p.id, "set": p.domain, "arm": name, "context": len(ids) + base.num_tokens, "identical": div is None,
                         "divergence": div, "mean_accept": round(r.mean_accept_len, 2),
                         "speedup": round(r.decode_tokens_per_sec / base.decode_tokens_per_sec, 3) if base.decode_tokens_per_sec else None,
                         "accept_lengths": r.accept_lengths, "draft_lengths": r.draft_lengths})
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("accept_lengths", "draft_lengths")}), flush=True)  # a CPU run takes minutes a prompt
    same = sum(r["identical"] for r in rows)
    print(f"{same}/{len(rows)} identical; {time.perf_counter() - t0:.0f} s in all")
    for arm in sorted({r["arm"] for r in rows}):
        for domain in sorted({r["set"] for r in rows}) + [None]:
            picked = [r for r in rows if r["arm"] == arm and domain in (None, r["set"])]
            acc = [r["mean_accept"] for r in picked]
            print(f"{arm} {domain or 'all'}: mean accept length {sum(acc) / len(acc):.3f} over {len(acc)} prompts (per-prompt mean)")
            rates = sorted(r["speedup"] for r in picked if r["speedup"])
            if rates:  # measured side by side with greedy on each prompt, after the warm-up
                print(f"{arm} {domain or 'all'}: decode speedup over greedy, median {statistics.median(rates):.3f}, geometric mean "
                      f"{statistics.geometric_mean(rates):.3f} (range {rates[0]:.2f}-{rates[-1]:.2f}) over {len(rates)} prompts")
            # Where the drafts fail: of the rounds that drafted position i, the share accepted up to it
            # (pooled over the prompts' rounds). A steep fall after position 1 says the chain is weak,
            # a low first value that the head's first guess is.
            by_position = position_acceptance(sum((r["accept_lengths"] for r in picked), []), sum((r["draft_lengths"] for r in picked), []))
            if by_position:
                print(f"{arm} {domain or 'all'}: accepted through draft position 1..{len(by_position)}: {' '.join(f'{x:.2f}' for x in by_position)}")
        clean = [r["mean_accept"] for r in rows if r["arm"] == arm and math_without_twin(r)]
        if clean:  # docs/performance.md, tenth round: templates that copy held-out prompts inflate the math figure
            print(f"{arm} math without a training twin: mean accept length {sum(clean) / len(clean):.3f} over {len(clean)} prompts")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
