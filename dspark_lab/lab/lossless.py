"""Where two outputs of the same prompt part ways, and whether that is a numerical near-tie.

On a GPU in low precision, a multi-token verify forward and a one-token decode step round
differently; where the target's top two logits are within that rounding, argmax can flip and
speculative and plain decoding part ways although the algorithm is exact. This reports the
first differing position and the logit gap of the two competing tokens there.

How far "within that rounding" reaches is measured, not assumed: the gap is computed again by
forwards of other widths (the whole prefix at once, one token after a cached prefix, a verify-wide
block that ends at the position, one that starts there, and for a tree arm a tree forward of its
width: rows rotated one by one and masked by an array, which round differently again). Through a deep model in bfloat16 the
per-layer roundings add up to more than one rounding step of the logits, so one step alone would
call some ties real (seen on Qwen2.5-Coder-0.5B on the H200: 10.75 vs 10.625, two steps apart).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..engine.compiled import can_compile
from ..engine.target import Target


# Explicit mantissa bits of the logit dtypes: one rounding step at |x| is 2**(floor(log2|x|) - bits).
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}

VERIFY_WIDTH = 8  # the block width the width test re-forwards: a cap-7 verify


def verify_width(cap: str) -> int:
    """The width a verify forward of an arm at `cap` has (the pending token and cap drafts);
    VERIFY_WIDTH for arms that draft no fixed number (auto, or 0: the baseline, mlx-lm)."""
    cap = str(cap)
    return int(cap) + 1 if cap.isdigit() and int(cap) > 0 else VERIFY_WIDTH


def rounding_step(x: float, dtype: str) -> float:
    """The spacing of representable numbers of `dtype` ("mlx.core.bfloat16" or "bfloat16") at |x|."""
    bits = MANTISSA_BITS.get(dtype.rsplit(".", 1)[-1], 23)
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0**-14))) - bits)


def is_tie_across_widths(gaps: dict[str, float], scale: float, dtype: str) -> tuple[bool, str]:
    """(tie, why) from the gap logit(a) - logit(b) of the two tokens, where `a` is the plain
    decode's token and `b` the other output's, as forwards of several widths compute it.

    A tie when the smallest gap is within one rounding step at `scale` plus the spread of the
    gaps across widths: the target itself moves the gap by that much with the kernel's width, so a
    verify forward (yet another width, over a cache its own forwards built) may order the two
    tokens either way. A difference outside that is one no rounding of these forwards explains."""
    step = rounding_step(scale, dtype)
    lo, hi = min(gaps.values()), max(gaps.values())
    if lo <= 0:
        flipped = ", ".join(k for k, g in gaps.items() if g <= 0)
        return True, f"a forward of another width ({flipped}) orders the two tokens the other way"
    if lo <= step:
        return True, f"the gap is within one rounding step ({step:g})"
    if lo <= step + (hi - lo):
        return True, f"the gap is within one rounding step ({step:g}) plus its spread across widths ({hi - lo:g})"
    return False, f"the gap ({lo:g} at least) exceeds one rounding step ({step:g}) plus its spread across widths ({hi - lo:g})"


def _next_logits(target: Target, fed: list[list[int]], row: int) -> mx.array:
    """The logits row `row` of the last forward, after feeding each block of `fed` in turn into
    a fresh cache (the earlier blocks build the cache the last one reads)."""
    cache = target.make_cache()
    for block in fed[:-1]:
        target.forward(mx.array(block, dtype=mx.uint32), cache)
    return target.forward(mx.array(fed[-1], dtype=mx.uint32), cache, last_only=row == -1).logits[row]


def _tree_root_logits(target: Target, context: list[int], follow: list[int], width: int) -> mx.array | None:
    """The position's logits from a tree forward (Target.forward_tree) of `width` rows: the context
    but its last token fed plainly, then that token as the tree's root with `follow` as a chain
    below it, padded to `width`. None for a target whose caches cannot take trees."""
    cache = target.make_cache()
    if not can_compile(cache):
        return None
    target.forward(mx.array(context[:-1], dtype=mx.uint32), cache)
    rows = context[-1:] + follow[: width - 1]
    return target.forward_tree(mx.array(rows, dtype=mx.uint32), list(range(len(rows))), np.tril(np.ones((len(rows),) * 2, dtype=bool)),
                               cache, width=width).logits[0]


def width_gaps(target: Target, context: list[int], a_tok: int, b_tok: int, follow: list[int],
               width: int = VERIFY_WIDTH, prefill: mx.array | None = None, tree_width: int = 0) -> dict[str, float]:
    """The gap logit(a_tok) - logit(b_tok) at the position after `context`, computed by forwards of
    several widths: "prefill" (the whole context at once), "step" (one token after the rest),
    "verify_last" (a block of `width` ending at the position) and "verify_first" (a block of
    `width` starting there, its other rows `follow`: the other output's tokens from the position
    on, as the drafts of a verify there would be). Rows after the position do not reach its logits
    (causal attention); only the block's width does. `prefill`: that position's logits from a
    whole-context forward already made, so it is not made again. `tree_width` > 1 adds "tree": a tree
    forward of that many rows whose root is the position (_tree_root_logits), as a tree arm verifies."""
    n = len(context)
    plans = {"prefill": ([context], -1)}
    if n > 1:
        plans["step"] = ([context[:-1], context[-1:]], -1)
        w = min(width, n - 1)
        if w > 1:
            plans["verify_last"] = ([context[:-w], context[-w:]], -1)
        drafts = (follow + [b_tok] * width)[: width - 1]
        plans["verify_first"] = ([context[:-1], context[-1:] + drafts], 0)
    gaps = {}
    for name, (fed, row) in plans.items():
        logits = (prefill if name == "prefill" and prefill is not None else _next_logits(target, fed, row)).astype(mx.float32)
        gaps[name] = round(logits[a_tok].item() - logits[b_tok].item(), 5)
    if tree_width > 1 and n > 1:
        logits = _tree_root_logits(target, context, follow, tree_width)
        if logits is not None:
            logits = logits.astype(mx.float32)
            gaps["tree"] = round(logits[a_tok].item() - logits[b_tok].item(), 5)
    return gaps


def first_divergence(target: Target, prompt_ids: list[int], a: list[int], b: list[int],
                     width: int = VERIFY_WIDTH, tree_width: int = 0) -> dict | None:
    """None when `a == b`; else the first differing index and the logits of both tokens there,
    from a fresh prefill of the common prefix (in the model's own logit dtype), and which of the
    two that prefill's argmax picks ("a", "b" or "other"): where it picks the token of the output
    that was not decoded step by step, the step-by-step path is the one that rounded away from it.
    `a` is the plain decode's output. "gap" is |logit_a - logit_b| from that prefill, "gaps" the
    signed gap at each forward width (width_gaps; a tree forward of `tree_width` rows too, for a
    tree arm's output), "tie" whether the difference is a numerical tie across them and "why" says so."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None if len(a) == len(b) else {"index": min(len(a), len(b)), "length_differs": True}
    context = prompt_ids + a[:i]
    out = target.forward(mx.array(context, dtype=mx.uint32), target.make_cache(), last_only=True).logits[0]
    logits = out.astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    la, lb = logits[a[i]].item(), logits[b[i]].item()
    best = int(mx.argmax(logits).item())
    picks = "a" if best == a[i] else "b" if best == b[i] else "other"
    gaps = width_gaps(target, context, a[i], b[i], b[i:], width, prefill=out, tree_width=tree_width)
    tie, why = is_tie_across_widths(gaps, max(abs(la), abs(lb)), str(out.dtype))
    la, lb = round(la, 4), round(lb, 4)
    return {"index": i, "logit_a": la, "logit_b": lb, "gap": abs(la - lb), "top2_margin": round(top[1] - top[0], 4),
            "logit_dtype": str(out.dtype), "tie": tie, "why": why, "gaps": gaps,
            "gap_spread": round(max(gaps.values()) - min(gaps.values()), 5), "prefill_picks": picks}
