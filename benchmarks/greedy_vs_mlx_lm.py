"""Side by side, in one process and one warm state: mlx-lm's own generation, our pipelined
greedy decoding, and our lookup decoding, on the same model and prompts.

    python benchmarks/greedy_vs_mlx_lm.py --model DIR [--max-tokens 200] [--repeats 5] [--out result.json]

Arms run interleaved (A B C, A B C, ...) so clock drift and thermal state hit all of them alike.
Reported: median decode tok/s per arm and prompt, and ratios to mlx-lm measured in the same run.
Decode tok/s counts tokens after the first over the time after the first token, for every arm.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import stream_generate

from dspark_lab import greedy_generate, load_target, lookup_generate
from dspark_lab.engine.fused import as_stored
from dspark_lab.engine.text import encode_prompt
from dspark_lab.lab.lossless import first_divergence as divergence

PROMPTS = {
    "code": "Write a Python function that checks whether a string is a palindrome, with a docstring and three doctest examples.",
    "chat": "What are three good habits for getting better sleep? Explain each one in two sentences.",
    "math": "A train travels 180 km in 2.5 hours. What is its average speed in km/h and in m/s? Show your steps.",
    "copy": "Rewrite this code with type hints and keep everything else unchanged:\n\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\ndef sub(a, b):\n    return a - b\n",
}


def mlx_lm_arm(target, tokenizer, ids, max_tokens):
    """mlx-lm's stream_generate, timed the same way as our arms."""
    start = time.perf_counter()
    first = None
    tokens = []
    with as_stored(target.model):  # as mlx-lm loads it: each projection its own layer
        for resp in stream_generate(target.model, tokenizer, ids, max_tokens=max_tokens):
            if first is None:
                first = time.perf_counter()
            tokens.append(resp.token)
    end = time.perf_counter()
    eos = set(tokenizer.eos_token_ids)
    tokens = [t for t in tokens if t not in eos]
    return tokens, (len(tokens) - 1) / (end - first), end - start


def our_arm(fn, target, tokenizer, ids, max_tokens):
    r = fn(target, tokenizer, ids, max_new_tokens=max_tokens)
    return r.token_ids, r.decode_tokens_per_sec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()

    target, tok = load_target(args.model)
    arms = {
        "mlx_lm": lambda ids: mlx_lm_arm(target, tok, ids, args.max_tokens),
        "greedy": lambda ids: our_arm(greedy_generate, target, tok, ids, args.max_tokens),
        "lookup": lambda ids: our_arm(lookup_generate, target, tok, ids, args.max_tokens),
    }
    encoded = {k: encode_prompt(tok, p) for k, p in PROMPTS.items()}
    # Warm-up: the first use of each kernel shape compiles (NVRTC on CUDA); run every arm on
    # every prompt once, untimed.
    t0 = time.perf_counter()
    for ids in encoded.values():
        for arm in arms.values():
            arm(ids)
    warmup_s = time.perf_counter() - t0

    rows = []
    for name, ids in encoded.items():
        speeds = {a: [] for a in arms}
        outputs = {}
        for _ in range(args.repeats):
            for a, arm in arms.items():
                toks, tps = arm(ids)[:2]
                speeds[a].append(tps)
                outputs[a] = toks
        lk = lookup_generate(target, tok, ids, max_new_tokens=args.max_tokens)
        med = {a: statistics.median(v) for a, v in speeds.items()}
        rows.append({
            "prompt": name, "tokens": len(outputs["greedy"]),
            **{f"{a}_tok_s": round(med[a], 1) for a in arms},
            **{f"{a}_spread": round(max(v) - min(v), 1) for a, v in speeds.items()},
            "greedy_vs_mlx_lm": round(med["greedy"] / med["mlx_lm"], 3),
            "lookup_vs_greedy": round(med["lookup"] / med["greedy"], 3),
            "lookup_mean_accept": round(lk.mean_accept_len, 2),
            "identical_greedy_mlx_lm": outputs["greedy"] == outputs["mlx_lm"],
            "identical_lookup_greedy": outputs["lookup"] == outputs["greedy"],
            "divergence_greedy_mlx_lm": divergence(target, ids, outputs["greedy"], outputs["mlx_lm"]),
            "divergence_lookup_greedy": divergence(target, ids, outputs["greedy"], outputs["lookup"]),
        })
    result = {
        "model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "device": str(mx.default_device()), "device_info": _device_info(), "platform": platform.platform(),
        "mlx": mx.__version__, "warmup_seconds": round(warmup_s, 1), "rows": rows,
    }
    hdr = f"{'prompt':6} {'tok':>4} {'mlx_lm':>8} {'greedy':>8} {'lookup':>8} {'g/mlx':>6} {'l/g':>6} {'acc':>5} same"
    print(hdr)
    for r in rows:
        print(f"{r['prompt']:6} {r['tokens']:4d} {r['mlx_lm_tok_s']:8.1f} {r['greedy_tok_s']:8.1f} {r['lookup_tok_s']:8.1f} "
              f"{r['greedy_vs_mlx_lm']:6.3f} {r['lookup_vs_greedy']:6.3f} {r['lookup_mean_accept']:5.2f} "
              f"{r['identical_greedy_mlx_lm']}/{r['identical_lookup_greedy']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def _device_info() -> dict:
    try:
        return {k: str(v) for k, v in mx.device_info().items()}
    except Exception:  # older mlx, or a backend without it
        return {}


if __name__ == "__main__":
    main()
