"""Calibrate a small pair twice in one process (the first run warms up every kernel shape),
report how long the warm calibration takes, then validate the curves at every cap.

    python benchmarks/calibrate_h200.py --model DIR [--head DIR | --random-head] [--mode dspark|lookup] --out r.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from dspark_lab.engine import load_target
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.lab.calibrate import CalibrationPlan, calibrate, validate
from dspark_lab.lab.controller import static_cap
from dspark_lab.lab.prompts import load_prompt_set


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head")
    ap.add_argument("--random-head", action="store_true", help="a random 2-layer head (block 8): cost only, acceptance ~0")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--max-cap", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    target, tok = load_target(args.model)
    head = None
    if args.mode == "dspark":
        path = args.head
        if args.random_head:
            from dspark_lab.tiny import build_tiny_dspark

            path = build_tiny_dspark(tempfile.mkdtemp(), args.model, num_layers=2, block_size=8)
        head = load_dspark(path, target)
    plan = CalibrationPlan(max_cap=args.max_cap)
    t = time.perf_counter()
    calibrate(target, head, mode=args.mode, max_cap=args.max_cap, plan=plan)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    ctrl = calibrate(target, head, mode=args.mode, max_cap=args.max_cap, plan=plan, recalibrate=True)
    curves = ctrl.curves
    warm = time.perf_counter() - t
    prompts = [p.as_input() for p in load_prompt_set("code").prompts[:4]] + [p.as_input() for p in load_prompt_set("copy").prompts[:4]]
    validate(target, tok, head, curves, prompts=prompts[:2], max_cap=args.max_cap, mode=args.mode, max_new_tokens=32)  # warm-up
    report = validate(target, tok, head, curves, prompts=prompts, max_cap=args.max_cap, mode=args.mode, max_new_tokens=128)
    result = {"model": args.model, "mode": args.mode, "cold_seconds": round(cold, 2), "warm_seconds": round(warm, 2),
              "curves": curves.to_dict(), "static_cap_at_prior": static_cap(curves, ctrl.prior, args.max_cap), "validation": report}
    print(f"calibration: cold {cold:.1f} s, warm {warm:.1f} s; fit knee {curves.fit.knee}, worst fit error {100 * curves.fit.max_rel_error:.1f}%")
    print(f"overhead {curves.overhead.median_ms:.3f} ms, depth slope {curves.depth_slope_ms * 1000:.3f} us/token")
    for r in report["rows"]:
        err = f"{100 * r['rel_error']:.1f}%" if r["rel_error"] is not None else "-"
        print(f"cap {r['cap']}: predicted {r['predicted_round_ms']:.2f} ms, measured {r['measured_round_ms']:.2f} ms ({err}), {r['tokens_per_sec']:.1f} tok/s")
    print(f"acceptance profile {[round(x, 2) for x in report['acceptance_profile']]}; controller cap {report['controller_cap']}, "
          f"best measured {report['best_measured_cap']}, within 5%: {report['within_5_percent']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
