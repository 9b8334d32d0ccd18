"""How MLX's CUDA backend launches a forward, by width: graph commits, nodes by kind, kernels.

    python benchmarks/cuda_graphs.py --model DIR [--widths 1,2,4,8] [--prefill 200] [--repeats 30]
        [--dot DIR] [--json F]

Why: a 4-bit Qwen 0.5B's compiled verify forward costs 4.1 ms at 2 rows and 5.5 at 8 on an H100,
yet its products, attention, norms, rope, cache writes and elementwise work, each timed alone,
cost no more at 8 rows than at 2 (forward_parts.py, docs/performance.md, fortieth round). At
this size the device is launch-bound, so what a width changes may be how the work is launched.
MLX on CUDA records an evaluation's kernels into CUDA graphs of at most MLX_MAX_OPS_PER_BUFFER
operations (100 on an H100), launches each, and keeps each executable graph keyed by its nodes'
kinds: a later commit with the same kinds updates it in place, while a graph holding a node MLX
cannot update (a memory copy, a kernel launched in a cluster taller than one block) is
instantiated anew every time (mlx/backend/cuda/device.cpp).

Arms, at each width after a prefill of --prefill tokens (median of --repeats, milliseconds):
  forward_at           the compiled forward at an array offset (the pipelined loops' verify);
  forward              the plain forward at the cache's host offset, trimmed back after it
                       (uncompiled; at width 1 plain decoding's step);
  forward_at, attention kernel  at width 1 on CUDA: the compiled forward with its one-row
                       attention through engine/attention_kernel.py (draft-pipe's draft model).
With --dot DIR (CUDA), nothing is timed: MLX_SAVE_CUDA_GRAPHS_DOT_FILE is set before MLX loads
(MLX writes a file at every commit from then on, which slows them), each arm is warmed up and
one more evaluation recorded, and the graphs it committed are summarized (commits, nodes by
kind, kernels by name), the raw files kept in DIR. Time under MLX_USE_CUDA_GRAPHS=0 or
MLX_MAX_OPS_PER_BUFFER=N to compare launch strategies, each in its own process. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

NODE_KINDS = ("KERNEL", "MEMCPY", "MEMSET", "HOST", "GRAPH", "EMPTY", "WAIT_EVENT", "EVENT_RECORD",
              "MEM_ALLOC", "MEM_FREE", "CONDITIONAL", "BATCH_MEM_OP", "EXT_SEMAS_SIGNAL", "EXT_SEMAS_WAIT")


def kernel_name(mangled: str) -> str:
    """A kernel's function name from its mangled symbol (_ZN3mlx4core2cu10qmv_kernelI... ->
    qmv_kernel); a fused kernel MLX compiled at run time keeps its generated name, shortened."""
    m = re.match(r"_ZN((?:\d+[A-Za-z_]\w*?)+?)(?=I|E|$)", mangled)
    if not m:
        return mangled[:48]
    parts, rest = [], m.group(1)
    while rest:
        n = re.match(r"(\d+)", rest)
        if not n:
            break
        k = int(n.group(1))
        parts.append(rest[len(n.group(1)):len(n.group(1)) + k])
        rest = rest[len(n.group(1)) + k:]
    name = parts[-1] if parts else mangled[:48]
    return name if len(name) <= 48 else name[:40] + "..."


def summarize_dot(text: str) -> dict:
    """Nodes by kind and kernels by name in one cudaGraphDebugDotPrint file: a kernel node is
    drawn as an octagon labelled with its index and mangled symbol; a child graph as a
    rectangle naming the graph (its own nodes are printed as a cluster of the same file)."""
    kinds, kernels = Counter(), Counter()
    for shape, label in re.findall(r'shape="(\w+)"\s+label="(.*?)"\s*\]', text, flags=re.S):
        lines = [ln.strip() for ln in label.split("\n") if ln.strip()]
        body = lines[1] if len(lines) > 1 else ""
        if shape == "octagon":
            kinds["KERNEL"] += 1
            kernels[kernel_name(body)] += 1
        elif body.startswith("graph_"):
            kinds["GRAPH"] += 1
        else:
            kind = next((w for w in re.findall(r"[A-Z_]{4,}", label) if w in NODE_KINDS), shape)
            kinds[kind] += 1
    return {"nodes": dict(kinds), "kernels": dict(kernels)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--prefill", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default=None, help="load the target in this precision (float32 on a CPU)")
    ap.add_argument("--dot", default=None, help="folder for MLX's CUDA graph files (CUDA only)")
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    dot_dir = Path(args.dot) if args.dot else None
    if dot_dir is not None:
        dot_dir.mkdir(parents=True, exist_ok=True)
        # MLX reads this once, at its first commit: it must be set before MLX runs anything.
        os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = str(dot_dir / "graph")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mlx.core as mx

    from dspark_lab.engine import attention_kernel, load_target
    from dspark_lab.engine.kernels import cuda_available
    from tree_round_parts import timed  # median seconds of a call evaluated alone, after warm-up

    env = {k: os.environ[k] for k in ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER") if k in os.environ}
    target, _ = load_target(args.model, dtype=args.dtype)
    ids = mx.array([(i * 7919 + 100) % target.vocab_size for i in range(args.prefill + 16)], dtype=mx.uint32)
    cache = target.make_cache()
    target.forward(ids[:args.prefill], cache, last_only=True)
    widths = [int(x) for x in args.widths.split(",") if x.strip()]
    bound = args.prefill + max(widths) + 16
    for c in cache:
        c.ensure(bound)
    mx.eval([c.state for c in cache])
    offset = mx.array(args.prefill, dtype=mx.int32)
    on_cuda = cuda_available()
    print(f"{args.model}: {target.num_layers} layers; prefill {args.prefill}; CUDA {on_cuda}; env {env or 'default'}", flush=True)

    def arms(w: int) -> dict:
        feed = ids[args.prefill:args.prefill + w]

        def forward_at():
            return target.forward_at(feed, cache, offset, capacity=bound).logits

        def forward_plain():
            out = target.forward(feed, cache).logits
            target.trim(cache, w)  # the host offset back; the rows written stay behind, hidden as a rejected draft's
            return out

        out = {"forward_at": (forward_at, False), "forward": (forward_plain, False)}
        if w == 1 and on_cuda:
            out["forward_at, attention kernel"] = (forward_at, True)  # the same call, attention routed around it
        return out

    report = {"model": args.model, "prefill": args.prefill, "env": env, "cuda": on_cuda, "widths": {}}
    for w in widths:
        row = {}
        for name, (fn, routed) in arms(w).items():
            if routed:
                target.route_attention(attention_kernel.rows_attention())
            try:
                if dot_dir is None or not on_cuda:
                    row[name] = {"ms": timed(fn, args.repeats) * 1e3}
                else:
                    for _ in range(3):  # traces compiled, graphs cached: what a warm forward commits
                        mx.eval(fn())
                    mx.synchronize()
                    before = set(dot_dir.glob("graph_*.dot"))
                    mx.eval(fn())
                    mx.synchronize()
                    files = sorted(set(dot_dir.glob("graph_*.dot")) - before, key=lambda p: int(p.stem.split("_")[-1]))
                    nodes, kernels = Counter(), Counter()
                    for f in files:
                        s = summarize_dot(f.read_text(errors="replace"))
                        nodes.update(s["nodes"])
                        kernels.update(s["kernels"])
                    row[name] = dict(commits=len(files), nodes=dict(nodes), kernels=dict(kernels.most_common()),
                                     files=[f.name for f in files])
            finally:
                if routed:
                    target.route_attention(None)
        report["widths"][w] = row
        for name, r in row.items():
            if "commits" in r:
                print(f"width {w:2d} {name:30s} {r['commits']} commits, nodes {r['nodes']}, "
                      f"{sum(r['kernels'].values())} kernels of {len(r['kernels'])} kinds", flush=True)
            else:
                print(f"width {w:2d} {name:30s} {r['ms']:7.3f} ms", flush=True)
    if dot_dir is not None and on_cuda:
        # Each arm's kernels by name across the widths: which kinds appear or multiply with the rows.
        for arm in ("forward_at", "forward"):
            counts = {w: report["widths"][w][arm].get("kernels", {}) for w in widths}
            names = sorted({n for c in counts.values() for n in c}, key=lambda n: -max(c.get(n, 0) for c in counts.values()))
            print(f"{arm}: kernels by name at widths " + " ".join(f"{w:>5d}" for w in widths))
            for n in names:
                print("  " + " ".join(f"{counts[w].get(n, 0):5d}" for w in widths) + f"  {n}")
    elif dot_dir is not None:
        print("no graphs recorded: MLX launches CUDA graphs on CUDA only")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
