"""Time checkouts of the engine side by side: one benchmark, each checkout in its own processes,
in a mirrored order (A B C C B A), so that drift over the run (the machine's clocks, the host's
caches; the fifty-third round saw a step drift 15% within one process) falls on every arm alike.

    python benchmarks/abba.py --out DIR --arm old=ab/old --arm new=. [--script benchmarks/round_host_time.py] -- ARGS...

Each arm is a checkout root holding `dspark_lab/` and `benchmarks/` (an older commit's:
`mkdir -p ab/old && git archive COMMIT dspark_lab benchmarks | tar -x -C ab/old`); its copy of the
script runs with ARGS and `--json DIR/<i>_<arm>.json` (the script puts its own root first on
sys.path, so each arm imports its own engine). All processes' output goes to DIR/abba.log.
Then, for round_host_time.py's rows: each arm's medians over all its processes' rows (round,
greedy step, their hand-overs, the ratio over greedy, acceptance) and its primitive counts, each
arm's medians set against the first arm's, and all of it in DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

TIMED = ("round_ms", "launch_ms", "greedy_ms_per_token", "greedy_launch_ms", "over_greedy", "accept")


def order(arms: list[str]) -> list[str]:
    """A B C C B A: each arm once forward, once back."""
    return arms + arms[::-1]


def run_arms(out: Path, arms: dict[str, Path], script: str, args: list[str]) -> list[tuple[str, Path]]:
    runs = []
    for i, name in enumerate(order(list(arms))):
        root = arms[name]
        path = out / f"{i}_{name}.json"
        cmd = [sys.executable, str(root / script), *args, "--json", str(path)]
        t = time.perf_counter()
        with open(out / "abba.log", "a") as log:
            log.write(f"\n=== process {i}: {' '.join(cmd)}\n")
            log.flush()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"process {i} ({name}): exit {rc}, {time.perf_counter() - t:.0f} s", flush=True)
        if rc == 0 and path.exists():
            runs.append((name, path))
    return runs


def summarize(runs: list[tuple[str, Path]]) -> dict:
    """Per arm and (cap, nodes): the medians of TIMED over its processes' rows, and the primitives."""
    by_arm: dict[str, dict] = {}
    for name, path in runs:
        data = json.loads(path.read_text())
        rows = data["rows"] if isinstance(data, dict) else data
        arm = by_arm.setdefault(name, {"rows": [], "primitives": {}})
        arm["rows"] += rows
        if isinstance(data, dict) and data.get("primitives"):
            arm["primitives"] = {k: sum(v.values()) for k, v in data["primitives"].items()}
    summary = {}
    for name, arm in by_arm.items():
        keys = sorted({(r["cap"], r["nodes"]) for r in arm["rows"]})
        summary[name] = {"primitives": arm["primitives"], "arms": {
            f"cap {c} {'chain' if not n else f'tree {n}'}": {
                k: statistics.median(r[k] for r in arm["rows"] if (r["cap"], r["nodes"]) == (c, n)) for k in TIMED}
            for c, n in keys}}
    return summary


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--arm", action="append", required=True, help="NAME=ROOT, in the order A B C")
    ap.add_argument("--script", default="benchmarks/round_host_time.py")
    a = ap.parse_args(argv[:split])
    arms = {}
    for spec in a.arm:
        name, _, root = spec.partition("=")
        if not root or not (Path(root) / a.script).exists():
            ap.error(f"--arm {spec!r}: give NAME=ROOT, a checkout root holding {a.script}")
        arms[name] = Path(root).resolve()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run_arms(out, arms, a.script, argv[split + 1:]))
    for name, s in summary.items():
        print(f"{name}: primitives {s['primitives']}")
        for arm, m in s["arms"].items():
            print(f"  {arm}: round {m['round_ms']:.3f} ms (hand-over {m['launch_ms']:.3f}), greedy step {m['greedy_ms_per_token']:.3f} "
                  f"(hand-over {m['greedy_launch_ms']:.3f}), {m['over_greedy']:.2f}x greedy, accept {m['accept']:.2f}")
    first = next(iter(summary), None)
    for name in list(summary)[1:]:
        for arm, m in summary[name]["arms"].items():
            base = summary[first]["arms"].get(arm)
            if base:
                print(f"{name} / {first}, {arm}: round {m['round_ms'] / base['round_ms']:.3f}, "
                      f"greedy step {m['greedy_ms_per_token'] / base['greedy_ms_per_token']:.3f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
