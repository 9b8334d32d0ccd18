"""The rows kernel (engine/rows_kernel.py) on a real quantized target, beside MLX's quantized
matmul, side by side in one process (CUDA only).

    python benchmarks/rows_kernel.py --model DIR [--head DIR] [--rows 1,2,4,7,8,9,16,17,32] [--widths 1,2,8,16,17,33]
        [--repeats 30] [--prompts 4] [--tree-pipe 16] [--policies worth_routing,with_verifies] [--every-width] [--json F]

1. Exactness, for each distinct quantized layer shape of the model and each row count: the kernel
   and mx.quantized_matmul against a float32 reference (weights dequantized in float32, a float32
   matmul, one rounding: reference_rows_matmul), as the largest difference over the largest
   output; and whether the kernel's rows equal, bit for bit, the same rows computed one at a
   time (the property that makes a verify's rows match the one-row decode step's).
2. Each layer shape's product timed: 40 independent calls in one evaluation, the median over
   --repeats such batches, per call (launch included), the kernel beside MLX's.
3. The whole forward (the compiled forward_at the pipelined loops run) at each width after a
   prefill: the model loaded once more per routed copy, each routed through the kernel where its
   policy routes (--policies: rows_kernel.worth_routing, the engine's, by default; with_verifies;
   every_width; --every-width alone: every product the kernel takes), timed interleaved (widths above compiled.MAX_WIDTH run op by op, as the loops run them).
4. With --head: decoding, each copy with its own instance of the head, arm after arm on each
   prompt (the first --prompts built-in prompts of code, math, chat; 128 tokens, after a warm-up):
   greedy, the pipelined chain (compiled draft) and the pipelined trees of --tree-pipe nodes, at --cap,
   through MLX's kernels and through the rows kernel; each arm's decode rate over MLX's greedy on
   the prompt, and whether its tokens equal its own copy's greedy.
Nothing is asserted; the numbers decide whether the engine should route (docs/performance.md).
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
import mlx.nn as nn  # noqa: E402

from dspark_lab.engine import load_target  # noqa: E402
from dspark_lab.engine.rows_kernel import (QUANTIZED_LAYERS, check_rows, every_width, quantized_rows_matmul,  # noqa: E402
                                           reference_rows_matmul, supports, with_verifies, worth_routing)

BATCH = 40  # products a timed evaluation holds


def layer_shapes(model: nn.Module) -> dict[str, nn.Module]:
    """One module per distinct (kind, weight shape, bits, group): the products the forward runs."""
    seen: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if isinstance(m, QUANTIZED_LAYERS):
            kind = "embedding.as_linear" if isinstance(m, nn.QuantizedEmbedding) else name.rsplit(".", 1)[-1]
            n, words = m.weight.shape
            key = f"{kind} N={n} K={words * 32 // m.bits} {m.bits}b g{m.group_size}"
            seen.setdefault(key, m)
    return seen


def relative(a: mx.array, ref: mx.array) -> float:
    return (mx.abs(a.astype(mx.float32) - ref.astype(mx.float32)).max() / mx.maximum(mx.abs(ref.astype(mx.float32)).max(), 1e-30)).item()


def per_call_us(fn, repeats: int) -> float:
    for _ in range(3):
        mx.eval([fn() for _ in range(BATCH)])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(BATCH)])
        times.append((time.perf_counter() - t0) / BATCH)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,2,4,7,8,9,16,17,32")
    ap.add_argument("--widths", default="1,2,8,16,17,33")
    ap.add_argument("--head", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tree-pipe", default="16")
    ap.add_argument("--cap", type=int, default=7)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="cast the float weights and a quantized model's scales (bfloat16: what the kernel reads)")
    ap.add_argument("--policies", default="worth_routing",
                    help="routed copies, one per policy: worth_routing (the engine's), with_verifies, every_width")
    ap.add_argument("--every-width", action="store_true",
                    help="the routed copy sends every product the kernel takes through it (default: the engine's policy, worth_routing)")
    ap.add_argument("--reference", action="store_true",
                    help="route through reference_rows_matmul (MLX operations) instead of the kernel: a dry run of this script off CUDA")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    kernel = reference_rows_matmul if args.reference else quantized_rows_matmul()
    plain, tok = load_target(args.model, dtype=args.dtype)
    named = {"worth_routing": worth_routing, "with_verifies": with_verifies, "every_width": every_width}
    policies = [every_width] if args.every_width else [named[p.strip()] for p in args.policies.split(",") if p.strip()]
    # One routed copy per policy: "kernel" alone, else named by its policy (an arm is "pipe-<copy>").
    copies = {}
    for policy in policies:
        routed, _ = load_target(args.model, dtype=args.dtype)
        name = "kernel" if len(policies) == 1 else policy.__name__.replace("_", "")
        copies[name] = routed
        print(f"{name}: {routed.route_quantized_rows(kernel, policy=policy)} layers routed through the kernel ({policy.__name__})", flush=True)
    report: dict = {"model": args.model, "device": str(mx.default_device()), "layers": {}, "forward": {}}

    mx.random.seed(0)
    for key, m in layer_shapes(plain.model).items():
        k = m.weight.shape[1] * 32 // m.bits
        entry = report["layers"][key] = {}
        for rows in rows_list:
            x = mx.random.normal((rows, k)).astype(mx.bfloat16)
            w, s, b = m.weight, m.scales, m.biases
            why = supports(x, w, s, b, group_size=m.group_size, bits=m.bits)
            if why:
                entry[rows] = {"skipped": why}
                continue
            err, largest, alone_equal = check_rows(kernel, m, x)
            ref = reference_rows_matmul(x, w, s, b, group_size=m.group_size, bits=m.bits)
            theirs = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=m.group_size, bits=m.bits)
            entry[rows] = {"kernel_error": err / max(largest, 1e-30), "mlx_error": relative(theirs, ref),
                           "rows_alone_equal": alone_equal}
            if not args.reference:  # (a dry run: the stand-in's time says nothing)
                entry[rows]["kernel_us"] = per_call_us(lambda: kernel(x, w, s, b, group_size=m.group_size, bits=m.bits), args.repeats)
                entry[rows]["mlx_us"] = per_call_us(
                    lambda: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=m.group_size, bits=m.bits), args.repeats)
            e = entry[rows]
            timing = f", {e['kernel_us']:7.1f} us vs mlx {e['mlx_us']:7.1f} us ({e['mlx_us'] / e['kernel_us']:.2f}x)" if "mlx_us" in e else ""
            print(f"{key:42s} rows {rows:2d}: error kernel {e['kernel_error']:.2e} mlx {e['mlx_error']:.2e}, "
                  f"rows alone equal {e['rows_alone_equal']}{timing}", flush=True)

    # The whole compiled forward at each width, both copies at the same cache offset, interleaved.
    ids = mx.array(tok.encode("def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n" * 4), dtype=mx.uint32)
    bound = ids.shape[0] + 64
    caches = {}
    for name, t in (("mlx", plain), *copies.items()):
        cache = t.make_cache()
        t.forward(ids, cache, last_only=True)
        for c in cache:
            c.ensure(bound)
        caches[name] = cache
    offset = mx.array(ids.shape[0], dtype=mx.int32)
    for width in (int(w) for w in args.widths.split(",") if w.strip()):
        feed = ids[:width]
        fns = {name: (lambda t=t, c=caches[name]: t.forward_at(feed, c, offset, capacity=bound).logits)
               for name, t in (("mlx", plain), *copies.items())}
        same = all(bool(mx.array_equal(mx.argmax(fns["mlx"](), axis=-1), mx.argmax(fns[n](), axis=-1)).item()) for n in copies)
        for fn in fns.values():
            for _ in range(3):
                mx.eval(fn())
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                mx.eval(fn())
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        report["forward"][width] = {"mlx_ms": med["mlx"], **{f"{n}_ms": med[n] for n in copies}, "argmax_equal": same}
        print(f"forward of {width:2d} rows: mlx {med['mlx']:.3f} ms, " + ", ".join(
            f"{n} {med[n]:.3f} ms ({med['mlx'] / med[n]:.2f}x)" for n in copies) + f"; argmax equal {same}", flush=True)
    if args.head:
        report["decode"] = decode_side_by_side(args, {"mlx": plain, **copies}, tok)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def decode_side_by_side(args, targets: dict, tok) -> list[dict]:
    from dspark_lab.engine import greedy_generate, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.text import encode_prompt
    from dspark_lab.lab.prompts import load_prompt_sets

    heads = {name: load_dspark(args.head, t, bits=16) for name, t in targets.items()}
    trees = [int(n) for n in args.tree_pipe.split(",") if n.strip()]

    def arms(name, ids, n):
        t, h = targets[name], heads[name]
        yield f"greedy-{name}", lambda: greedy_generate(t, tok, ids, max_new_tokens=n)
        yield f"pipe-{name}", lambda: speculative_generate(t, tok, h, ids, max_new_tokens=n, max_draft_tokens=args.cap,
                                                           pipeline=True, compile_draft=True)
        for nodes in trees:
            yield f"tree{nodes}-pipe-{name}", lambda nodes=nodes: speculative_generate(
                t, tok, h, ids, max_new_tokens=n, max_draft_tokens=args.cap, pipeline=True, compile_draft=True, tree_nodes=nodes)

    prompts = [p for s in load_prompt_sets("code,math,chat", limit=args.prompts) for p in s.prompts]
    warm = encode_prompt(tok, prompts[0].as_input())
    for name in targets:  # compiles every trace and kernel shape first
        for _, run in arms(name, warm, 32):
            run()
    rows = []
    for p in prompts:
        ids = encode_prompt(tok, p.as_input())
        results = {arm: run() for name in targets for arm, run in arms(name, ids, args.max_new_tokens)}
        base = results["greedy-mlx"].decode_tokens_per_sec
        for arm, r in results.items():
            own = results["greedy-" + arm.rsplit("-", 1)[1]]
            rows.append({"prompt": p.id, "set": p.domain, "arm": arm, "tok_s": round(r.decode_tokens_per_sec, 1),
                         "over_mlx_greedy": round(r.decode_tokens_per_sec / base, 3), "mean_accept": round(r.mean_accept_len, 2),
                         "equals_own_greedy": r.token_ids == own.token_ids})
        print(" ".join(f"{r['arm']} {r['over_mlx_greedy']:.2f}x{'' if r['equals_own_greedy'] else '*'}" for r in rows[-len(results):]),
              f"({p.id}; * = parts from its own greedy)", flush=True)
    for arm in dict.fromkeys(r["arm"] for r in rows):
        for domain in ("code", "math", "chat"):
            picked = [r for r in rows if r["arm"] == arm and r["set"] == domain]
            if picked:
                print(f"{arm} {domain}: median {statistics.median(r['over_mlx_greedy'] for r in picked):.3f}x MLX greedy, "
                      f"accept {statistics.mean(r['mean_accept'] for r in picked):.2f}, "
                      f"{sum(r['equals_own_greedy'] for r in picked)}/{len(picked)} equal their own greedy", flush=True)
    return rows


if __name__ == "__main__":
    main()
