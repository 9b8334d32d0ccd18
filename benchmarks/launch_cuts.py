"""Kernel launches taken out of a pipelined round, decoding side by side (CUDA only).

    python benchmarks/launch_cuts.py --model DIR --head DIR [--caps 7] [--tree-nodes 15]
        [--copies base,attn,attn+write,attn+write+move] [--prompts 3] [--max-new-tokens 128] [--json F]
    python benchmarks/launch_cuts.py ... --copies attn+write+move,attn+write+move+views

The pipelined loop is bound by the host's launching (docs/performance.md, forty-eighth round), and
benchmarks/kernel_census.py counts what a round launches. Three cuts, each a setting of the target:
`attn` sends the array-offset forwards' attention (every width, a tree's with its ancestors)
through engine/attention_kernel.py, one kernel a layer where MLX's cuDNN attention is a child
graph (and a memset) a layer; `write` writes each layer's new keys and values with
engine/cache_kernels.py's one kernel where MLX's dynamic slice updates launch four; `move` moves a
tree round's kept path with its one kernel where MLX's operations launch about eight a layer
(together: Target.use_launch_kernels). Two more words set a copy's head: `split-head` loads it with
each layer's projections apart (as before the fiftieth round; loading now stacks them,
drafters/load.stack_head_projections), `head4` at 4 bits (default: 16, the float weights; MLX's
quantized products where a float head's go through cuBLAS), `head-mlx` keeps the head off the target's
kernels (as in the fiftieth round's calls: the pipelined loops now hand the head the target's cache
writer and attention route, ContextDrafter.use_kernels_of). `views` puts back, around the engine's
kernels, the no-op primitives the fifty-third and fifty-fourth rounds took out (a reshape before and
after each rows-kernel product, an mx.contiguous around the cache's buffers at each attention and
cache write: about 300 a 0.5B chain round, 96 a step): `attn+write+move` against
`attn+write+move+views` times what those primitives cost the host, in one process (the
fifty-fourth round's separate processes of one checkout differed by up to 25%). Each copy of the
target (the engine's rows-kernel routing in all) is loaded apart with its own head; on each prompt (the first --prompts
of code, math, chat) every copy decodes greedily (the plain step, and the compiled one-row step the
cuts reach too), as the pipelined chain at each cap and as trees of each --tree-nodes as deep as the
first cap, after a warm-up of every arm, each arm run in every copy in turn before the next arm.
Reported: each arm's decode rate over greedy decoding on the prompt (the median of the copies'
greedy rates: the cuts touch only the array-offset forwards, so every copy's plain greedy runs the
same kernels, whatever its head), its rate over its own copy's compiled one-row greedy step (which
the cuts do reach: the fastest greedy that copy has), its accept, and whether its tokens equal its
own copy's greedy.
Before decoding, the kernels are checked as the engine's probe checks them
(lab/kernel_probe.measure_launch_kernels, untimed). The forty-ninth round's runs printed the
largest differences of an earlier check instead (docs/results/h100_49_cuts*_qwen05.log).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402


def apply_cuts(target, cuts: set[str]) -> None:
    """Set the target's cuts (attn, write, move) after its once-a-model checks, which compare with
    MLX's own attention (an attention route alone would be in them)."""
    from dspark_lab.engine.attention_kernel import rows_attention
    from dspark_lab.engine.cache_kernels import cache_move_kernel, cache_write_kernel

    target.check_offset_forward()
    target.check_tree_forward()
    if "attn" in cuts:
        target.route_attention(rows_attention(), policy=lambda rows: True)
    if "write" in cuts:
        target.write_cache_with(cache_write_kernel())
    if "move" in cuts:
        target.move_tree_paths_with(cache_move_kernel())


def with_no_op_views(target) -> None:
    """The `views` word: wrap the target's rows kernel, attention route and cache writer so that each
    call hands MLX the no-op primitives it used to (see the module docstring); results unchanged."""
    if target._routing is not None:
        matmul, policy = target._routing

        def reshaped(x, weight, scales, biases, **kw):
            *lead, k = x.shape
            return matmul(x.reshape(-1, k), weight, scales, biases, **kw).reshape(*lead, -1)

        target.route_quantized_rows(reshaped, policy=policy)
    route = target.attention_route
    if route is not None:
        kernel = route.kernel
        target.route_attention(lambda q, k, v, offset, scale, **kw: kernel(q, mx.contiguous(k), mx.contiguous(v), offset, scale, **kw),
                               policy=route.policy)
    writer = target.cache_writer
    if writer is not None:
        target.write_cache_with(lambda keys, values, *rest: writer(mx.contiguous(keys), mx.contiguous(values), *rest))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--caps", default="7")
    ap.add_argument("--tree-nodes", default="15")
    ap.add_argument("--copies", default="base,attn,attn+write,attn+write+move")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from dspark_lab.engine import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.rows_kernel import quantized_rows_matmul
    from dspark_lab.engine.text import encode_prompt
    from dspark_lab.lab.prompts import load_prompt_sets

    caps = [int(c) for c in a.caps.split(",")]
    trees = [int(n) for n in a.tree_nodes.split(",") if n]
    copies: dict = {}
    head_words = {"split-head", "head4", "head-mlx"}
    for name in a.copies.split(","):
        words = set(name.split("+")) - {"base"}
        unknown = words - head_words - {"attn", "write", "move", "views"}
        if unknown:
            raise SystemExit(f"unknown word(s) {sorted(unknown)} in copy {name!r}: use base, attn, write, move, views, split-head, "
                             "head4, head-mlx")
        target, tok = load_target(a.model)
        target.route_quantized_rows(quantized_rows_matmul())
        apply_cuts(target, words - head_words)
        if "views" in words:
            with_no_op_views(target)
        head = load_dspark(a.head, target, bits=4 if "head4" in words else 16, stack_projections="split-head" not in words)
        if "head-mlx" in words:
            head.use_kernels_of = lambda target: None  # the loops' handover declined: MLX's operations
        copies[name] = (target, head)
    from dspark_lab.lab.kernel_probe import measure_launch_kernels

    check = measure_launch_kernels(next(iter(copies.values()))[0])  # the engine probe's check, untimed
    checks = {"exact": check.exact, "checked": check.checked, "reason": check.reason}
    print("kernel checks:", checks, flush=True)

    def arms(name, ids, n):
        t, h = copies[name]
        yield f"greedy/{name}", lambda: greedy_generate(t, tok, ids, max_new_tokens=n)
        yield f"greedy-compiled/{name}", lambda: greedy_generate(t, tok, ids, max_new_tokens=n, compiled_step=True)
        for cap in caps:
            yield f"chain{cap}/{name}", lambda cap=cap: speculative_generate(
                t, tok, h, ids, max_new_tokens=n, max_draft_tokens=cap, pipeline=True, compile_draft=True)
            for nodes in trees:
                yield f"tree{nodes}@{cap}/{name}", lambda cap=cap, nodes=nodes: speculative_generate(
                    t, tok, h, ids, max_new_tokens=n, max_draft_tokens=cap, pipeline=True, compile_draft=True, tree_nodes=nodes)

    prompts = [p for s in load_prompt_sets("code,math,chat", limit=a.prompts) for p in s.prompts]
    warm = encode_prompt(tok, prompts[0].as_input())
    for name in copies:
        for _, run in arms(name, warm, 48):
            run()
    rows = []
    for p in prompts:
        ids = encode_prompt(tok, p.as_input())
        # Arm by arm, each in every copy in turn: a copy's arm runs beside the same arm of the others,
        # so the per-prompt comparisons between copies see the same machine (the fiftieth round's
        # runs, copy after copy, saw plain greedy move by up to half between copies).
        by_arm = zip(*(list(arms(name, ids, a.max_new_tokens)) for name in copies))
        ran = {arm: run() for same_arm in by_arm for arm, run in same_arm}
        results = {arm: ran[arm] for name in copies for arm, _ in arms(name, ids, a.max_new_tokens)}  # printed copy by copy
        base = statistics.median(r.decode_tokens_per_sec for arm, r in results.items() if arm.startswith("greedy/"))
        compiled = {arm.split("/")[1]: r.decode_tokens_per_sec for arm, r in results.items() if arm.startswith("greedy-compiled/")}
        for arm, r in results.items():
            own = results["greedy/" + arm.split("/")[1]]
            rows.append({"prompt": p.id, "set": p.domain, "arm": arm, "tok_s": round(r.decode_tokens_per_sec, 1),
                         "over_greedy": round(r.decode_tokens_per_sec / base, 3), "accept": round(r.mean_accept_len, 2),
                         # over the compiled step of its own copy: the fastest greedy that copy's kernels give
                         "over_own_compiled": round(r.decode_tokens_per_sec / compiled[arm.split("/")[1]], 3),
                         "equals_own_greedy": r.token_ids == own.token_ids})
        print(" ".join(f"{r['arm']} {r['over_greedy']:.2f}x{'' if r['equals_own_greedy'] else '*'}" for r in rows[-len(results):]),
              f"({p.id}; * = parts from its own greedy)", flush=True)
    print("\nmedian over each set's prompts, over greedy decoding [over its copy's compiled greedy step] (accept):")
    for arm in dict.fromkeys(r["arm"] for r in rows):
        cells = []
        for domain in ("code", "math", "chat"):
            picked = [r for r in rows if r["arm"] == arm and r["set"] == domain]
            if picked:
                cells.append(f"{domain} {statistics.median(r['over_greedy'] for r in picked):.2f}x "
                             f"[{statistics.median(r['over_own_compiled'] for r in picked):.2f}x] "
                             f"({statistics.median(r['accept'] for r in picked):.2f})")
        same = sum(r["equals_own_greedy"] for r in rows if r["arm"] == arm)
        print(f"  {arm:24s} " + "  ".join(cells) + f"  [{same}/{sum(r['arm'] == arm for r in rows)} equal own greedy]", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"checks": checks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
