"""Where two outputs of the same prompt part ways, and whether that is a numerical near-tie.

On a GPU in low precision, a multi-token verify forward and a one-token decode step round
differently; where the target's top two logits are within that rounding, argmax can flip and
speculative and plain decoding part ways although the algorithm is exact. This reports the
first differing position and the logit gap of the two competing tokens there.
"""

from __future__ import annotations

import mlx.core as mx

from ..engine.target import Target


def first_divergence(target: Target, prompt_ids: list[int], a: list[int], b: list[int]) -> dict | None:
    """None when `a == b`; else the first differing index and the logits of both tokens there,
    from a fresh prefill of the common prefix (in the model's own logit dtype)."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None if len(a) == len(b) else {"index": min(len(a), len(b)), "length_differs": True}
    out = target.forward(mx.array(prompt_ids + a[:i], dtype=mx.uint32), target.make_cache(), last_only=True).logits[0]
    logits = out.astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    return {"index": i, "logit_a": round(logits[a[i]].item(), 4), "logit_b": round(logits[b[i]].item(), 4),
            "top2_margin": round(top[1] - top[0], 4), "logit_dtype": str(out.dtype)}
