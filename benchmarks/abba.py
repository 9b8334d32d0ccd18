"""Time checkouts of the engine side by side: one benchmark, each checkout in its own processes,
in a mirrored order (A B C C B A), so that drift over the run (the machine's clocks, the host's
caches; the fifty-third round saw a step drift 15% within one process) falls on every arm alike.

    python benchmarks/abba.py --out DIR --arm old=ab/old --arm new=. [--env new:MLX_MAX_OPS_PER_BUFFER=2000]
        [--script benchmarks/round_host_time.py] -- ARGS...

Each arm is a checkout root holding `dspark_lab/` and `benchmarks/` (an older commit's:
`mkdir -p ab/old && git archive COMMIT dspark_lab benchmarks | tar -x -C ab/old`); two arms may
share a root and differ in their environment (`--env ARM:VAR=VALUE`, repeated). Its copy of the
script runs with ARGS and `--json` (the script puts its own root first on sys.path, so each arm
imports its own engine). All processes' output goes to DIR/abba.log. After each process, for
round_host_time.py's rows: each arm's medians over all its processes' rows (round, its build
and hand-over, the read, the greedy step and its hand-over, the ratio over greedy, acceptance),
its primitive counts, each arm's medians set against the first arm's, and every process's rows,
in DIR/summary.json (two files in all: a device call brings back at most eight).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMED = ("round_ms", "build_ms", "launch_ms", "read_ms", "greedy_ms_per_token", "greedy_launch_ms", "over_greedy", "accept")


def order(arms: list[str]) -> list[str]:
    """A B C C B A: each arm once forward, once back."""
    return arms + arms[::-1]


def run_arms(out: Path, arms: dict[str, Path], envs: dict[str, dict], script: str, args: list[str], report) -> list[tuple[str, dict]]:
    """Each arm's processes in mirrored order; after each, `report(runs so far)`."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(order(list(arms))):
            path = Path(tmp) / f"{i}_{name}.json"
            cmd = [sys.executable, str(arms[name] / script), *args, "--json", str(path)]
            t = time.perf_counter()
            with open(out / "abba.log", "a") as log:
                log.write(f"\n=== process {i} ({name}, env {envs.get(name, {})}): {' '.join(cmd)}\n")
                log.flush()
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **envs.get(name, {})}).returncode
            print(f"process {i} ({name}): exit {rc}, {time.perf_counter() - t:.0f} s", flush=True)
            if rc == 0 and path.exists():
                data = json.loads(path.read_text())  # round_host_time writes its rows alone without --primitives
                runs.append((name, data if isinstance(data, dict) else {"rows": data}))
                report(runs)
    return runs


def summarize(runs: list[tuple[str, dict]]) -> dict:
    """runs: (arm, {"rows": [...], "primitives"?: {...}}) a process. Per arm and (cap, nodes): the medians of TIMED over its processes' rows, and the primitives."""
    by_arm: dict[str, dict] = {}
    for name, data in runs:
        arm = by_arm.setdefault(name, {"rows": [], "primitives": {}})
        arm["rows"] += data["rows"]
        if data.get("primitives"):
            arm["primitives"] = {k: sum(v.values()) for k, v in data["primitives"].items()}
    summary = {}
    for name, arm in by_arm.items():
        keys = sorted({(r["cap"], r["nodes"]) for r in arm["rows"]})
        summary[name] = {"primitives": arm["primitives"], "arms": {
            f"cap {c} {'chain' if not n else f'tree {n}'}": {
                k: statistics.median(r.get(k, float("nan")) for r in arm["rows"] if (r["cap"], r["nodes"]) == (c, n)) for k in TIMED}
            for c, n in keys}}
    return summary


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--arm", action="append", required=True, help="NAME=ROOT, in the order A B C")
    ap.add_argument("--env", action="append", default=[], help="ARM:VAR=VALUE, that arm's processes run with it set")
    ap.add_argument("--script", default="benchmarks/round_host_time.py")
    a = ap.parse_args(argv[:split])
    arms = {}
    for spec in a.arm:
        name, _, root = spec.partition("=")
        if not root or not (Path(root) / a.script).exists():
            ap.error(f"--arm {spec!r}: give NAME=ROOT, a checkout root holding {a.script}")
        arms[name] = Path(root).resolve()
    envs: dict[str, dict] = {}
    for spec in a.env:
        name, _, assignment = spec.partition(":")
        var, eq, value = assignment.partition("=")
        if name not in arms or not var or not eq:
            ap.error(f"--env {spec!r}: give ARM:VAR=VALUE for one of the arms {list(arms)}")
        envs.setdefault(name, {})[var] = value
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def report(runs):
        summary = summarize(runs)
        (out / "summary.json").write_text(json.dumps({"arms": summary, "env": envs,
                                                      "processes": [{"arm": name, **data} for name, data in runs]}, indent=1))
        return summary

    summary = report(run_arms(out, arms, envs, a.script, argv[split + 1:], report))
    for name, s in summary.items():
        print(f"{name}: primitives {s['primitives']}")
        for arm, m in s["arms"].items():
            print(f"  {arm}: round {m['round_ms']:.3f} ms (build {m['build_ms']:.3f}, hand-over {m['launch_ms']:.3f}, read {m['read_ms']:.3f}), "
                  f"greedy step {m['greedy_ms_per_token']:.3f} (hand-over {m['greedy_launch_ms']:.3f}), {m['over_greedy']:.2f}x greedy, "
                  f"accept {m['accept']:.2f}")
    first = next(iter(summary), None)
    for name in list(summary)[1:]:
        for arm, m in summary[name]["arms"].items():
            base = summary[first]["arms"].get(arm)
            if base:
                print(f"{name} / {first}, {arm}: round {m['round_ms'] / base['round_ms']:.3f}, "
                      f"greedy step {m['greedy_ms_per_token'] / base['greedy_ms_per_token']:.3f}")
    return summary


if __name__ == "__main__":
    main()
