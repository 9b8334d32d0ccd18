"""Whether the pipelined loop's rounds wait on the host or on the device.

    python benchmarks/round_host_time.py --model DIR --head DIR [--caps 7] [--tree-nodes 0,15] [--prompts 2] [--max-new-tokens 128]
        [--launch-kernels] [--head-bits 4] [--mlx-products] [--primitives]

The pipelined loops (engine/pipeline.py, engine/tree_pipeline.py) build round r+1 while the device
computes round r, then read round r's verdict. If building a round takes the host longer than the
device takes to compute one, the device idles between rounds and the round costs the host's time,
whatever its kernels cost. This times, per round, the host's building (InFlight.drive's `build`)
and its reading (InFlight.read: mostly waiting for the verdict, then streaming the text): a read
that hardly waits says the host bounds the loop. Within a build, `mx.async_eval` (the lazy graph
handed to the device: its kernels encoded and launched) is timed apart from the Python that builds
the graph. Beside them, plain decoding's rate in the same process (its step built while the
previous one computes) and each arm's rate. The target goes through the rows kernel where the
engine routes it (rows_kernel.worth_routing) when it runs on CUDA. Measured on an H100 in the
forty-eighth round (docs/performance.md): the host bounds the loop, mostly in mx.async_eval.
With --launch-kernels (CUDA) the target takes the three launch-saving kernels the engine's probe
chooses there (Target.use_launch_kernels), and plain decoding is the compiled one-row step that uses
them too, as `generate --mode baseline` runs it; its own hand-over is timed a step (fifty-first round:
a chain round launches 1.16x that step's kernels yet costs about 1.5x its time). --head-bits: the
head's products at 4 bits (the engine's default) or 16 (float; what this script loaded before).
--primitives: after the warm-ups and before the timing, count the MLX primitives (graph nodes, views
included) in what each step and round hands to mx.async_eval, by name: MLX's CUDA backend spends its
host time per primitive evaluated, kernel or not (fifty-second round: on an H200 the 0.5B's chain
round's async_eval took 1.48x a compiled step's; the 1.5B's census counted 1.16x the kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from dspark_lab.engine import greedy_generate, load_target, speculative_generate  # noqa: E402
from dspark_lab.engine import pipeline  # noqa: E402
from dspark_lab.engine.drafters.load import load_dspark  # noqa: E402
from dspark_lab.engine.kernels import cuda_available  # noqa: E402
from dspark_lab.engine.text import encode_prompt  # noqa: E402
from dspark_lab.lab.prompts import load_prompt_sets  # noqa: E402
from op_count import count_ops  # noqa: E402  (the primitives behind arrays, by name)

TIMES: dict[str, list[float]] = {"build": [], "read": [], "launch": []}
GRAPHS: list[Counter] | None = None  # while counting: each async_eval's graph, primitives by name


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        TIMES[name].append(time.perf_counter() - t)
        return out
    return wrapper


def instrument() -> None:
    """Time every build and read of every pipelined loop from now on."""
    drive, read = pipeline.InFlight.drive, pipeline.InFlight.read

    def timed_drive(self, build, prompt_tokens, mode):
        return drive(self, _timed("build", build), prompt_tokens, mode)

    pipeline.InFlight.drive = timed_drive
    pipeline.InFlight.read = _timed("read", read)
    # Inside a build, the lazy graph's hand-over to the device (encoding and launching its kernels),
    # apart from the Python that builds the graph.
    launch = _timed("launch", mx.async_eval)

    def counted(*outputs):
        if GRAPHS is not None:
            GRAPHS.append(count_ops(*outputs))
        return launch(*outputs)

    mx.async_eval = counted


def census(fn) -> Counter:
    """The median graph fn's steps or rounds hand to async_eval (the prefill's and the first
    build's left out), primitives by name."""
    global GRAPHS
    GRAPHS = []
    try:
        fn()
        graphs = GRAPHS[2:]
    finally:
        GRAPHS = None
    return sorted(graphs, key=lambda c: sum(c.values()))[len(graphs) // 2]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--caps", default="7")
    ap.add_argument("--tree-nodes", default="0,15", help="0: the chain; N: trees of N nodes as deep as the cap")
    ap.add_argument("--prompts", type=int, default=2, help="the first N prompts of each built-in set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="load the target in this precision (float32 on a CPU)")
    ap.add_argument("--launch-kernels", action="store_true", help="the three launch kernels and the compiled one-row step (CUDA)")
    ap.add_argument("--head-bits", type=int, default=4, choices=(4, 16))
    ap.add_argument("--mlx-products", action="store_true",
                    help="keep MLX's own 4-bit products at every width (default on CUDA: the engine's rows kernel where it routes)")
    ap.add_argument("--primitives", action="store_true", help="count each step's and round's primitives by name (before the timing)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    target, tok = load_target(a.model, dtype=a.dtype)
    if cuda_available() and not a.mlx_products:
        from dspark_lab.engine.rows_kernel import quantized_rows_matmul

        print(f"rows kernel: {target.route_quantized_rows(quantized_rows_matmul())} layers routed", flush=True)
    if a.launch_kernels:
        from dspark_lab.lab.kernel_probe import launch_kernels

        target.check_offset_forward()  # the once-a-model checks compare with MLX's own attention: before the route
        target.check_tree_forward()
        target.use_launch_kernels(launch_kernels())
    head = load_dspark(a.head, target, bits=a.head_bits)
    instrument()
    prompts = [p for s in load_prompt_sets("code,math,chat", limit=a.prompts) for p in s.prompts]
    arms = [(cap, nodes) for cap in (int(c) for c in a.caps.split(",")) for nodes in (int(n) for n in a.tree_nodes.split(","))]

    def run(ids, cap, nodes, n):
        return speculative_generate(target, tok, head, ids, max_new_tokens=n, max_draft_tokens=cap, pipeline=True,
                                    compile_draft=True, tree_nodes=nodes)

    def greedy(ids, n):
        return greedy_generate(target, tok, ids, max_new_tokens=n, compiled_step=a.launch_kernels)

    warm = encode_prompt(tok, prompts[0].as_input())
    greedy(warm, 32)
    for cap, nodes in arms:
        run(warm, cap, nodes, 32)
    counts = {}
    if a.primitives:
        ids = encode_prompt(tok, prompts[0].as_input())
        counts["greedy"] = census(lambda: greedy(ids, 24))
        for cap, nodes in arms:
            counts[f"cap {cap} {'chain' if not nodes else f'tree {nodes}'}"] = census(lambda: run(ids, cap, nodes, 48))
        names = sorted({n for c in counts.values() for n in c}, key=lambda n: -max(c[n] for c in counts.values()))
        print("primitives a step or round (median graph handed to async_eval; counted before the timing), by name:", flush=True)
        print("".join(f"{k:>18}" for k in counts) + "  primitive", flush=True)
        print("".join(f"{sum(c.values()):>18}" for c in counts.values()) + "  all", flush=True)
        for n in names:
            print("".join(f"{c[n]:>18}" for c in counts.values()) + f"  {n}", flush=True)
    report = []
    for p in prompts:
        ids = encode_prompt(tok, p.as_input())
        TIMES["launch"].clear()
        g = greedy(ids, a.max_new_tokens)
        greedy_launch = statistics.median(TIMES["launch"]) * 1e3 if TIMES["launch"] else float("nan")
        for cap, nodes in arms:
            for v in TIMES.values():
                v.clear()
            r = run(ids, cap, nodes, a.max_new_tokens)
            build, read = statistics.median(TIMES["build"]) * 1e3, statistics.median(TIMES["read"]) * 1e3
            launch = statistics.median(TIMES["launch"]) * 1e3
            row = {"prompt": p.id, "cap": cap, "nodes": nodes, "greedy_ms_per_token": 1e3 / g.decode_tokens_per_sec,
                   "greedy_launch_ms": greedy_launch,
                   "round_ms": r.mean_accept_len / r.decode_tokens_per_sec * 1e3, "build_ms": build, "launch_ms": launch, "read_ms": read,
                   "accept": r.mean_accept_len, "over_greedy": r.decode_tokens_per_sec / g.decode_tokens_per_sec}
            report.append(row)
            print(f"{p.id} cap {cap} {'chain' if not nodes else f'tree {nodes}'}: round {row['round_ms']:.2f} ms "
                  f"(greedy step {row['greedy_ms_per_token']:.2f}, launching {greedy_launch:.2f}); host builds {build:.2f} ms (launching {launch:.2f}), reads {read:.2f} ms "
                  f"(median a round); accept {r.mean_accept_len:.2f}, {row['over_greedy']:.2f}x greedy", flush=True)
    for cap, nodes in arms:
        rows = [r for r in report if r["cap"] == cap and r["nodes"] == nodes]
        print(f"cap {cap} {'chain' if not nodes else f'tree {nodes}'}: median round "
              f"{statistics.median(r['round_ms'] for r in rows):.2f} ms, build {statistics.median(r['build_ms'] for r in rows):.2f} "
              f"(launching {statistics.median(r['launch_ms'] for r in rows):.2f}), "
              f"read {statistics.median(r['read_ms'] for r in rows):.2f}; greedy step "
              f"{statistics.median(r['greedy_ms_per_token'] for r in rows):.2f} ms "
              f"(launching {statistics.median(r['greedy_launch_ms'] for r in rows):.2f})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": report, "primitives": counts} if counts else report, indent=1))
    return {"rows": report, "primitives": counts}


if __name__ == "__main__":
    main()
