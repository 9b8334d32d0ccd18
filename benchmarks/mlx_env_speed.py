"""benchmarks/pipeline_speed.py under several settings of MLX's environment, side by side.

    python benchmarks/mlx_env_speed.py --env "" --env MLX_MAX_OPS_PER_BUFFER=100 [--rounds 2]
        [--timeout 600] [--json OUT] -- --model DIR --head DIR --caps 7 --limit 2 --arms pipe+lk+cd ...

MLX reads its tuning settings once, when it first uses the device, so each setting needs a
process of its own: this runs pipeline_speed.py (its arguments after `--`) once per setting and
round, rounds rotating the order (A B, then B A) so that drift on the machine does not always
favour the same setting. A setting is "" (MLX's defaults) or KEY=VALUE pairs separated by spaces;
the MLX_* variables of this shell are cleared in every child first, so a setting is exactly what
it says. On CUDA, MLX puts at most MLX_MAX_OPS_PER_BUFFER operations (20 by default) in one CUDA
graph and keeps MLX_CUDA_GRAPH_CACHE_SIZE graphs (400): a one-token decode step of a 24-layer
model is hundreds of operations, so it is launched as many graphs, and the question this answers
is what fewer, larger ones are worth, for plain decoding and for a speculative round alike.

Prints, per arm, the median tok/s over rounds under each setting and its ratio to the first
setting's, and each setting's speculative speedup over its own greedy. The JSON keeps every
process's rows and the MLX environment the child reported (pipeline_speed.py's `mlx_env`).
A setting whose process fails or runs out of time is reported with its last lines, and the others
still run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PIPELINE_SPEED = Path(__file__).resolve().parent / "pipeline_speed.py"
_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def parse_setting(text: str) -> dict[str, str]:
    """ "MLX_A=1 MLX_B=2" -> {"MLX_A": "1", "MLX_B": "2"}; "" -> {} (MLX's defaults)."""
    env = {}
    for pair in text.split():
        key, sep, value = pair.partition("=")
        if not sep or not _NAME.fullmatch(key) or not value:
            raise SystemExit(f"--env {text!r}: {pair!r} is not KEY=VALUE (e.g. MLX_MAX_OPS_PER_BUFFER=100; \"\" for MLX's defaults)")
        env[key] = value
    return env


def child_environment(setting: dict[str, str], base=None) -> dict[str, str]:
    """This process's environment without its MLX_* settings (the ones a device stamp records), plus the setting's."""
    from dspark_lab.lab.device import mlx_env

    base = os.environ if base is None else base
    ours = mlx_env(base)
    return {**{k: v for k, v in base.items() if k not in ours}, **setting}


def run_once(setting: dict[str, str], speed_args: list[str], timeout: float) -> dict:
    """One pipeline_speed.py process under `setting`: its result JSON, or an error and its last lines."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speed.json"
        try:
            p = subprocess.run([sys.executable, str(PIPELINE_SPEED), *speed_args, "--json", str(out)], env=child_environment(setting),
                               capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return {"error": f"ran past {timeout:.0f} s (a fresh CUDA machine compiles every kernel on first use: "
                             f"raise --timeout)", "tail": tail[-2000:]}
        if p.returncode != 0 or not out.exists():
            return {"error": f"pipeline_speed.py exited with status {p.returncode}", "tail": (p.stdout + p.stderr)[-2000:]}
        return json.loads(out.read_text())


def label(setting: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items()) or "defaults"


def summarize(settings: list[dict[str, str]], runs: list[dict]) -> list[dict]:
    """Per arm and setting: the median tok/s over that setting's successful processes, its ratio to
    the first setting's, and its ratio to the same setting's greedy."""
    rates: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        for row in run["result"].get("rows", []):
            rates.setdefault((row["arm"], run["setting_index"]), []).append(row["tok_s"])
    arms = list(dict.fromkeys(arm for arm, _ in rates))
    med = {key: statistics.median(v) for key, v in rates.items()}
    table = []
    for arm in arms:
        for i, setting in enumerate(settings):
            if (arm, i) not in med:
                continue
            first, greedy = med.get((arm, 0)), med.get(("greedy", i))
            table.append({"arm": arm, "setting": label(setting), "tok_s": round(med[(arm, i)], 1), "processes": len(rates[(arm, i)]),
                          "vs_first_setting": round(med[(arm, i)] / first, 3) if first else None,
                          "vs_own_greedy": round(med[(arm, i)] / greedy, 3) if greedy else None})
    return table


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    speed_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Arguments after -- go to pipeline_speed.py (it needs --model and --head).")
    ap.add_argument("--env", action="append", required=True, help='a setting: "" (defaults) or "KEY=VALUE KEY=VALUE" (repeatable)')
    ap.add_argument("--rounds", type=int, default=2, help="processes per setting, the order rotated each round")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per process")
    ap.add_argument("--json")
    args = ap.parse_args(ours)
    if not speed_args:
        raise SystemExit("give pipeline_speed.py's arguments after --, e.g. -- --model DIR --head DIR --caps 7")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    settings = [parse_setting(s) for s in args.env]
    runs = []
    for r in range(args.rounds):
        for k in range(len(settings)):
            i = (k + r) % len(settings)
            result = run_once(settings[i], speed_args, args.timeout)
            runs.append({"round": r, "setting_index": i, "setting": settings[i], "result": result})
            status = result["error"] if "error" in result else (
                f"greedy {next((row['tok_s'] for row in result['rows'] if row['arm'] == 'greedy'), '-')} tok/s; "
                f"MLX environment seen by the child: {label(result.get('mlx_env') or {})}")
            print(f"round {r + 1}, {label(settings[i])}: {status}", flush=True)
            if "error" in result:
                print(result["tail"], flush=True)
    table = summarize(settings, runs)
    print(f"\n{'arm':16} {'setting':36} {'tok/s':>8} {'/first':>7} {'/greedy':>8}  processes")
    for row in table:
        print(f"{row['arm']:16} {row['setting'][:36]:36} {row['tok_s']:8.1f} {row['vs_first_setting'] or '-':>7} "
              f"{row['vs_own_greedy'] or '-':>8}  {row['processes']}")
    result = {"settings": [label(s) for s in settings], "rounds": args.rounds, "pipeline_speed_args": speed_args,
              "table": table, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
