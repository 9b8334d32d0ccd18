"""Greedy decoding of one model as stored and cast to float32, side by side in one run: on MLX's
CPU backend half-precision arithmetic is slow, and this says how much `--dtype float32` gains.

    python benchmarks/cpu_dtype.py --model DIR [--tokens 8] [--repeats 2]

The same prompt, no chat template, each arm warmed up once and then timed alternately. The
token ids may differ between the arms: they are two precisions of the model, not one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from dspark_lab import greedy_generate, load_target


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    arms = {"as stored": load_target(a.model), "float32": load_target(a.model, dtype="float32")}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(a.repeats + 1):  # round 0 warms every arm up and is not timed
        for name, (target, tok) in arms.items():
            start = time.perf_counter()
            greedy_generate(target, tok, a.prompt, max_new_tokens=a.tokens, apply_chat_template=False)
            if r:
                times[name].append(time.perf_counter() - start)
    print(f"{a.model} on {mx.default_device()}: {a.tokens} tokens after a {a.prompt!r} prompt, median of {a.repeats}")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in med.items():
        print(f"  {name:10s} {t:7.2f} s  {a.tokens / t:7.2f} tok/s  {med['as stored'] / t:5.2f}x as stored")
    return med


if __name__ == "__main__":
    main()
