"""The rows kernel (engine/rows_kernel.py) on a real quantized target, beside MLX's quantized
matmul, side by side in one process (CUDA only).

    python benchmarks/rows_kernel.py --shapes NxK,... [--rows ...] [--repeats 30] [--json F]   (part 2 on random layers)
    python benchmarks/rows_kernel.py --model DIR [--head DIR] [--rows 1,2,4,7,8,9,16,17,32] [--widths 1,2,8,16,17,33]
        [--repeats 30] [--prompts 4] [--tree-pipe 16,15@7] [--caps 7] [--copies worth_routing,every_width:wide]
        [--mlx-greedy-only] [--json F]

1. Exactness, for each distinct quantized layer shape of the model and each row count: the kernel
   and mx.quantized_matmul against a float32 reference (weights dequantized in float32, a float32
   matmul, one rounding: reference_rows_matmul), as the largest difference over the largest
   output; and whether the kernel's rows equal, bit for bit, the same rows computed one at a
   time (the property that makes a verify's rows match the one-row decode step's).
2. Each layer shape's product timed: 40 independent calls in one evaluation, the median over
   --repeats such batches, per call (launch included), MLX's beside each kernel layout's (words,
   wide, mma: rows_kernel.LAYOUTS): built from Python call by call ("python": what an uncompiled
   forward pays, the kernel's source assembled on every call), and as one compiled function of 40
   products of 40 inputs ("compiled": what a compiled forward replays).
3. The whole forward (the compiled forward_at the pipelined loops run) at each width after a
   prefill: the model loaded once more per routed copy (--copies: POLICY[:LAYOUT], the policy one of
   worth_routing (the engine's), with_verifies, multi_row, every_width; the layout words (default), wide or mma;
   --policies P,Q is --copies with the words layout; --every-width alone: every_width), timed
   interleaved (widths above compiled.MAX_WIDTH run op by op, as the loops run them).
4. With --head: decoding, each copy with its own instance of the head, arm after arm on each
   prompt (the first --prompts built-in prompts of code, math, chat; 128 tokens, after a warm-up):
   greedy, the pipelined chain (compiled draft) at each of --caps, and the pipelined trees of
   --tree-pipe (NODES: that many nodes as deep as the first cap; NODES@DEPTH: that deep; a +lk
   suffix adds the device-side lookup match's chain, DEPTH more verify rows), through
   MLX's kernels (only its greedy with --mlx-greedy-only) and through each routed copy; each arm's
   decode rate over MLX's greedy on the prompt, and whether its tokens equal its own copy's greedy.
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
from dspark_lab.engine.rows_kernel import (LAYOUTS, QUANTIZED_LAYERS, check_rows, every_width, multi_row,  # noqa: E402
                                           quantized_rows_matmul, reference_rows_matmul, supports, with_verifies,
                                           worth_routing)

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


def compiled_per_call_us(product, x: mx.array, repeats: int) -> float:
    """`product(x)` 40 times in one compiled function, each on its own input (equal inputs would
    be merged by the compiler), the median over `repeats` evaluations, per call: what a compiled
    forward replays, without the Python that builds the call."""
    xs = [x + i for i in range(BATCH)]
    mx.eval(xs)
    batch = mx.compile(lambda *inputs: [product(v) for v in inputs])
    for _ in range(3):
        mx.eval(batch(*xs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(batch(*xs))
        times.append((time.perf_counter() - t0) / BATCH)
    return statistics.median(times) * 1e6


POLICIES = {p.__name__: p for p in (worth_routing, with_verifies, multi_row, every_width)}


def parse_copies(args) -> list[tuple[str, str]]:
    """(policy, layout) per routed copy, from --copies, else --policies (words layout), else --every-width."""
    if args.every_width:
        return [("every_width", "words")]
    spec = args.copies or args.policies
    copies = []
    for item in (c.strip() for c in spec.split(",") if c.strip()):
        policy, _, layout = item.partition(":")
        layout = layout or "words"
        if policy not in POLICIES or layout not in LAYOUTS:
            raise SystemExit(f"--copies {item!r}: POLICY[:LAYOUT] with POLICY one of {', '.join(POLICIES)} "
                             f"and LAYOUT one of {', '.join(LAYOUTS)}")
        copies.append((policy, layout))
    return copies


def random_layers(shapes: str) -> dict[str, nn.Module]:
    """4-bit layers of the given NxK shapes (group 64, bfloat16 scales, as fetch-model stores the
    Qwen imports) with random weights: a product's time does not depend on its values."""
    layers = {}
    mx.random.seed(0)
    for spec in (s.strip() for s in shapes.split(",") if s.strip()):
        try:
            n, k = (int(v) for v in spec.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes {spec!r}: write each shape as NxK (output columns x input width), e.g. 1536x8960") from None
        linear = nn.Linear(k, n, bias=False)
        linear.set_dtype(mx.bfloat16)
        layer = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=4)
        mx.eval(layer.parameters())
        layers[f"random N={n} K={k} 4b g64"] = layer
    return layers


def time_products(args, shapes: dict[str, nn.Module], layouts: dict, rows_list: list[int], report: dict) -> None:
    """Part 2 (and 1's exactness) for each layer of `shapes` at each row count, into report["layers"]."""
    mx.random.seed(0)
    for key, m in shapes.items():
        k = m.weight.shape[1] * 32 // m.bits
        entry = report["layers"][key] = {}
        for rows in rows_list:
            x = mx.random.normal((rows, k)).astype(mx.bfloat16)
            w, s, b = m.weight, m.scales, m.biases
            why = supports(x, w, s, b, group_size=m.group_size, bits=m.bits)
            if why:
                entry[rows] = {"skipped": why}
                continue
            ref = reference_rows_matmul(x, w, s, b, group_size=m.group_size, bits=m.bits)
            theirs = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=m.group_size, bits=m.bits)
            e = entry[rows] = {"mlx_error": relative(theirs, ref)}
            products = {"mlx": lambda v: mx.quantized_matmul(v, w, s, b, transpose=True, group_size=m.group_size, bits=m.bits)}
            for layout, kernel in layouts.items():
                err, largest, alone_equal = check_rows(kernel, m, x)
                e[f"{layout}_error"], e[f"{layout}_rows_alone_equal"] = err / max(largest, 1e-30), alone_equal
                products[layout] = lambda v, kernel=kernel: kernel(v, w, s, b, group_size=m.group_size, bits=m.bits)
            if not args.reference:  # (a dry run: the stand-in's time says nothing)
                for name, product in products.items():
                    e[f"{name}_us"] = per_call_us(lambda: product(x), args.repeats)
                    e[f"{name}_compiled_us"] = compiled_per_call_us(product, x, args.repeats)
            errors = " ".join(f"{n} {e[n + '_error']:.1e}{'' if e.get(n + '_rows_alone_equal', True) else ' (rows differ alone!)'}"
                              for n in ("mlx", *layouts))
            e["weight_bytes"] = w.nbytes + s.nbytes + b.nbytes  # what a product must read once at least
            timing = "" if "mlx_us" not in e else "; us python/compiled: " + ", ".join(
                f"{n} {e[n + '_us']:.1f}/{e[n + '_compiled_us']:.1f}" for n in products) + "; TB/s compiled: " + ", ".join(
                f"{n} {e['weight_bytes'] / e[n + '_compiled_us'] / 1e6:.2f}" for n in products)
            print(f"{key:42s} rows {rows:2d}: error {errors}{timing}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--shapes", default=None,
                    help="NxK[,NxK...]: time random 4-bit layers of these shapes (bfloat16 scales, group 64) instead of "
                         "a model's, part 2 only: no weights to ship (e.g. the Qwen 1.5B's 2048x1536,1536x1536,17920x1536,1536x8960,151936x1536)")
    ap.add_argument("--rows", default="1,2,4,7,8,9,16,17,32")
    ap.add_argument("--widths", default="1,2,8,16,17,33")
    ap.add_argument("--head", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tree-pipe", default="16", help="pipelined trees: NODES (as deep as the first cap) or NODES@DEPTH, +lk for the lookup chain, comma-separated")
    ap.add_argument("--mlx-greedy-only", action="store_true",
                    help="MLX's copy runs only its greedy (the baseline), the speculative arms only the routed copies")
    ap.add_argument("--caps", default="7", help="the pipelined chain's caps in decoding (the trees take the first)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="cast the float weights and a quantized model's scales (bfloat16: what the kernel reads)")
    ap.add_argument("--policies", default="worth_routing",
                    help="routed copies, one per policy, the words layout: worth_routing (the engine's), with_verifies, multi_row, every_width")
    ap.add_argument("--copies", default=None,
                    help="routed copies as POLICY[:LAYOUT] (layout words, wide or mma), e.g. worth_routing,with_verifies:mma")
    ap.add_argument("--every-width", action="store_true",
                    help="the routed copy sends every product the kernel takes through it (default: the engine's policy, worth_routing)")
    ap.add_argument("--reference", action="store_true",
                    help="route through reference_rows_matmul (MLX operations) instead of the kernel: a dry run of this script off CUDA")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    layouts = {name: (reference_rows_matmul if args.reference else quantized_rows_matmul(name)) for name in LAYOUTS}
    if (args.model is None) == (args.shapes is None):
        raise SystemExit("give --model DIR (a model's layers, forwards, decoding) or --shapes NxK,... (random layers' products only)")
    if args.shapes:
        report = {"shapes": args.shapes, "device": str(mx.default_device()), "layers": {}}
        time_products(args, random_layers(args.shapes), layouts, rows_list, report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return
    plain, tok = load_target(args.model, dtype=args.dtype)
    wanted = parse_copies(args)
    # One routed copy per (policy, layout): "kernel" alone, else named by both (an arm is "pipe<cap>-<copy>").
    copies = {}
    for policy, layout in wanted:
        routed, _ = load_target(args.model, dtype=args.dtype)
        name = "kernel" if len(wanted) == 1 else policy.replace("_", "") + ("" if layout == "words" else layout)
        copies[name] = routed
        n = routed.route_quantized_rows(layouts[layout], policy=POLICIES[policy])
        print(f"{name}: {n} layers routed through the kernel ({policy}, {layout} layout)", flush=True)
    report: dict = {"model": args.model, "device": str(mx.default_device()), "layers": {}, "forward": {}}
    # The heads first, so that a cap the head cannot draft stops the run before minutes of timing
    # (a forty-seventh-round call lost its decoding to --caps 11 with a head of block size 8).
    heads = load_heads(args, {"mlx": plain, **copies}) if args.head else {}

    time_products(args, layer_shapes(plain.model), layouts, rows_list, report)

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
    if args.json:  # written now too: a decoding that fails or runs out of time keeps what came before
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.head:
        report["decode"] = decode_side_by_side(args, {"mlx": plain, **copies}, heads, tok)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))


def load_heads(args, targets: dict) -> dict:
    """The DSpark head for each copy; SystemExit where a --caps value is more than it drafts."""
    from dspark_lab.engine.drafters.load import load_dspark

    heads = {name: load_dspark(args.head, t, bits=16) for name, t in targets.items()}
    limit = next(iter(heads.values())).config.max_drafts
    caps, trees = decode_arms(args)
    over = [c for c in caps + [depth for _, depth, _, _ in trees] if not 1 <= c <= limit]
    if over:
        raise SystemExit(f"--caps / --tree-pipe depths {','.join(map(str, over))}: the head at {args.head} drafts 1..{limit} tokens a round")
    return heads


def decode_arms(args) -> tuple[list[int], list[tuple[int, int, bool, str]]]:
    """--caps and --tree-pipe parsed: (the chain's caps, parse_tree's tuple for each tree)."""
    caps = [int(c) for c in args.caps.split(",") if c.strip()]
    return caps, [parse_tree(t, caps[0]) for t in args.tree_pipe.split(",") if t.strip()]


def parse_tree(spec: str, default_depth: int) -> tuple[int, int, bool, str]:
    """--tree-pipe's NODES[@DEPTH][+lk] -> (nodes, depth, with the lookup chain, the arm's name:
    tree16 for "16" as before depths were given, tree15d7 for "15@7", tree8d7lk for "8@7+lk")."""
    spec = spec.strip()
    bare, lookup = spec.removesuffix("+lk"), spec.endswith("+lk")
    nodes, _, depth = bare.partition("@")
    return int(nodes), int(depth) if depth else default_depth, lookup, "tree" + bare.replace("@", "d") + ("lk" if lookup else "")


def decode_side_by_side(args, targets: dict, heads: dict, tok) -> list[dict]:
    from dspark_lab.engine import greedy_generate, speculative_generate
    from dspark_lab.engine.text import encode_prompt
    from dspark_lab.lab.prompts import load_prompt_sets

    caps, trees = decode_arms(args)

    def arms(name, ids, n):
        t, h = targets[name], heads[name]
        yield f"greedy-{name}", lambda: greedy_generate(t, tok, ids, max_new_tokens=n)
        if name == "mlx" and args.mlx_greedy_only:
            return
        for cap in caps:
            yield f"pipe{cap}-{name}", lambda cap=cap: speculative_generate(
                t, tok, h, ids, max_new_tokens=n, max_draft_tokens=cap, pipeline=True, compile_draft=True)
        for nodes, depth, lookup, label in trees:
            yield f"{label}-pipe-{name}", lambda nodes=nodes, depth=depth, lookup=lookup: (
                speculative_generate(t, tok, h, ids, max_new_tokens=n, max_draft_tokens=depth, pipeline=True, compile_draft=True,
                                     tree_nodes=nodes, lookup_drafts=lookup))

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
