"""Where two outputs of the same prompt part ways, and whether that is a numerical near-tie.

On a GPU in low precision, a multi-token verify forward and a one-token decode step round
differently; where the target's top two logits are within that rounding, argmax can flip and
speculative and plain decoding part ways although the algorithm is exact. This reports the
first differing position and the logit gap of the two competing tokens there.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..engine.target import Target


# Explicit mantissa bits of the logit dtypes: one rounding step at |x| is 2**(floor(log2|x|) - bits).
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}


def rounding_step(x: float, dtype: str) -> float:
    """The spacing of representable numbers of `dtype` ("mlx.core.bfloat16" or "bfloat16") at |x|."""
    bits = MANTISSA_BITS.get(dtype.rsplit(".", 1)[-1], 23)
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-14))) - bits)


def is_numerical_tie(logit_a: float, logit_b: float, dtype: str) -> bool:
    """Whether the two competing tokens' logits are within one rounding step of each other: then
    which of them wins argmax depends on summation order, not on the algorithm."""
    return abs(logit_a - logit_b) <= rounding_step(max(abs(logit_a), abs(logit_b)), dtype)


def first_divergence(target: Target, prompt_ids: list[int], a: list[int], b: list[int]) -> dict | None:
    """None when `a == b`; else the first differing index and the logits of both tokens there,
    from a fresh prefill of the common prefix (in the model's own logit dtype), and which of the
    two that prefill's argmax picks ("a", "b" or "other"): where it picks the token of the output
    that was not decoded step by step, the step-by-step path is the one that rounded away from it."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None if len(a) == len(b) else {"index": min(len(a), len(b)), "length_differs": True}
    out = target.forward(mx.array(prompt_ids + a[:i], dtype=mx.uint32), target.make_cache(), last_only=True).logits[0]
    logits = out.astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    la, lb = logits[a[i]].item(), logits[b[i]].item()
    best = int(mx.argmax(logits).item())
    picks = "a" if best == a[i] else "b" if best == b[i] else "other"
    return {"index": i, "logit_a": round(la, 4), "logit_b": round(lb, 4), "top2_margin": round(top[1] - top[0], 4),
            "logit_dtype": str(out.dtype), "tie": is_numerical_tie(la, lb, str(out.dtype)), "prefill_picks": picks}
