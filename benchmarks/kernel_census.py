"""Which kernels a plain step and a pipelined round launch on CUDA, by name, and what launching
them costs the host.

    python benchmarks/kernel_census.py --model DIR --head DIR [--caps 7] [--tree-nodes 0,15] [--dots OUT_DIR]
        [--cuts attn,write,move] [--head-bits 16] [--split-head]

The pipelined loop is bound by the host's launching (docs/performance.md, forty-eighth round), so
a round costs about what its kernels cost to launch. MLX's CUDA backend records every kernel it
launches into CUDA graphs; with MLX_SAVE_CUDA_GRAPHS_DOT_FILE set it writes each graph it
launches as a dot file. This script sets it (before MLX loads), runs each arm at two lengths and
counts the kernel nodes of the graphs written in between: the difference over the difference in
steps (plain decoding) or rounds (speculative arms) is the kernels of one step or round, by name,
without the prefill's. With --launch-time it writes no dot files (writing them slows the host) and
times instead the host's `mx.async_eval` per step or round (its kernels encoded and launched), to
set beside a census run's counts. A CUDA machine only.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A node of a graph in cudaGraphDebugDotPrint's output and its label (over lines); a subgraph
# cluster's own label (label="graph_N" graph[...]) is not a node.
NODE_LABEL = re.compile(r'"graph_\d+_node_\d+"\[[^\[]*?label="((?:[^"\\]|\\.)*)"', re.S)


def kernel_name(label: str) -> str:
    """The short name of what a node label ("INDEX\nNAME...") launches: a kernel's name
    (mlx::core::cu::rope<...> -> rope), "child graph" for a child graph's node (cuDNN's and
    cuBLAS's work; its own nodes are listed in its cluster and counted too), "memset"."""
    lines = [s.strip() for s in label.splitlines() if s.strip()]
    name = lines[1] if len(lines) > 1 else (lines[0] if lines else "")
    if name.startswith("graph_"):
        return "child graph"
    if name == "MEMSET":
        return "memset"
    if not name.startswith("_Z"):
        return name[:60]  # an unmangled kernel (cuDNN's generated ones)
    # Itanium mangling: _ZN <len><id> <len><id> ... ; the kernel is the last identifier before a
    # template's arguments (I) or the name's end (E).
    parts, i = [], 3 if name.startswith("_ZN") else 2
    while i < len(name) and name[i].isdigit():
        j = i
        while name[j].isdigit():
            j += 1
        n = int(name[i:j])
        parts.append(name[j:j + n])
        i = j + n
    short = parts[-1] if parts else name
    return re.sub(r"_\d{12,}", "", short)  # a fused kernel's name ends in its graph's hash


def census(files: list[Path]) -> Counter:
    names: Counter = Counter()
    for f in files:
        for label in NODE_LABEL.findall(f.read_text(errors="replace")):
            names[kernel_name(label)] += 1
    return names


def written(dots: Path) -> list[Path]:
    return sorted(dots.glob("g_*.dot"), key=lambda p: int(p.stem.split("_")[-1]))


def counted(dots: Path, run) -> tuple[Counter, object]:
    """Kernels launched by run() (its graphs written as dot files into `dots`), and its result."""
    import mlx.core as mx

    mx.synchronize()
    before = len(written(dots))
    out = run()
    mx.synchronize()
    return census(written(dots)[before:]), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--caps", default="7")
    ap.add_argument("--tree-nodes", default="0,15", help="0: the chain; N: a tree of N nodes as deep as the cap")
    ap.add_argument("--short", type=int, default=24, help="tokens of the shorter run of each pair")
    ap.add_argument("--long", type=int, default=88, help="tokens of the longer run")
    ap.add_argument("--unrouted", action="store_true", help="leave the products unrouted (the rows kernel off)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--keep", type=int, default=3, help="raw dot files of the last run copied to --dots")
    ap.add_argument("--dots", default=None, help="folder for a few raw dot files (review the parser)")
    ap.add_argument("--launch-time", action="store_true", help="no census: time mx.async_eval a step or round")
    ap.add_argument("--cuts", default="", help="attn, write, move (benchmarks/launch_cuts.py): the target so set")
    ap.add_argument("--head-bits", type=int, default=16, help="the head's weights: 16 (float: its products through cuBLAS), 8 or 4")
    ap.add_argument("--split-head", action="store_true", help="the head's q/k/v and gate/up apart (loading stacks them)")
    a = ap.parse_args()
    dots = None  # --launch-time: no dot files
    if not a.launch_time:
        dots = Path(os.environ.get("CENSUS_DOTS") or tempfile.mkdtemp(prefix="census-"))
        dots.mkdir(parents=True, exist_ok=True)
        os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = str(dots / "g")  # read once, when MLX's CUDA backend starts

    import mlx.core as mx

    from dspark_lab.engine import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.engine.kernels import cuda_available
    from dspark_lab.engine.text import encode_prompt
    from dspark_lab.lab.prompts import load_prompt_sets

    if not cuda_available():
        sys.exit("kernel_census.py counts the CUDA graphs MLX launches: run it on a CUDA machine.")
    target, tok = load_target(a.model)
    if not a.unrouted:
        from dspark_lab.engine.rows_kernel import quantized_rows_matmul

        print(f"rows kernel: {target.route_quantized_rows(quantized_rows_matmul())} layers routed", flush=True)
    cuts = set(filter(None, a.cuts.split(",")))
    if cuts:
        from launch_cuts import apply_cuts  # this folder's, beside this script

        apply_cuts(target, cuts)
    head = load_dspark(a.head, target, bits=a.head_bits, stack_projections=not a.split_head)
    prompt = load_prompt_sets("code", limit=1)[0].prompts[0]
    ids = encode_prompt(tok, prompt.as_input())
    # greedy-compiled: the compiled one-row step, the lab's baseline on CUDA (with the cuts, through them)
    arms = [("greedy", None, None), ("greedy-compiled", None, "compiled")] + [
        (f"{'chain' if not n else f'tree{n}'}@{c}", c, n)
        for c in (int(x) for x in a.caps.split(",")) for n in (int(x) for x in a.tree_nodes.split(","))]

    def go(cap, nodes, n):
        if cap is None:
            return greedy_generate(target, tok, ids, max_new_tokens=n, compiled_step=nodes == "compiled")
        return speculative_generate(target, tok, head, ids, max_new_tokens=n, max_draft_tokens=cap, pipeline=True,
                                    compile_draft=True, tree_nodes=nodes)

    for _, cap, nodes in arms:  # warm up: every kernel JIT-compiled, every trace made
        go(cap, nodes, a.long)
    real_async_eval = mx.async_eval
    if a.launch_time:
        from round_host_time import TIMES, _timed  # this folder's, beside this script

        timed_async_eval, launch_time = _timed("launch", real_async_eval), TIMES["launch"]
    for name, cap, nodes in arms:
        unit = "step" if cap is None else "round"
        if a.launch_time:
            mx.async_eval = timed_async_eval
            launch_time.clear()
            r = go(cap, nodes, a.long)
            mx.async_eval = real_async_eval
            ms = sorted(launch_time)[len(launch_time) // 2] * 1e3
            per_token, accept = 1e3 / r.decode_tokens_per_sec, (r.mean_accept_len if cap else 1.0)
            print(f"{name}: mx.async_eval median {ms:.2f} ms a call; {per_token * accept:.2f} ms a {unit}"
                  f" ({per_token:.2f} a token, accept {accept:.2f})", flush=True)
            continue
        short, r_short = counted(dots, lambda: go(cap, nodes, a.short))
        long, r_long = counted(dots, lambda: go(cap, nodes, a.long))
        steps = (r_long.num_tokens - r_short.num_tokens) if cap is None else (r_long.num_rounds - r_short.num_rounds)
        per = Counter({k: (long[k] - short[k]) / steps for k in long | short})
        extra = "" if cap is None else f", accept {r_long.mean_accept_len:.2f}"
        print(f"\n{name}: {sum(per.values()):.1f} kernels a {unit} ({steps} {unit}s apart{extra})", flush=True)
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[: a.top]:
            if abs(v) >= 0.05:
                print(f"  {v:7.2f}  {k}")
    if a.dots and dots is not None:
        out = Path(a.dots)
        out.mkdir(parents=True, exist_ok=True)
        for f in written(dots)[-a.keep:]:
            (out / f.name).write_bytes(f.read_bytes())


if __name__ == "__main__":
    main()
