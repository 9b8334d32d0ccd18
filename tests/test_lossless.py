"""Telling a numerical tie from a real divergence: two logits within one rounding step of the
logit dtype can be ordered either way by kernels of different widths on a GPU."""

import pytest

from dspark_lab.lab.lossless import (
    VERIFY_WIDTH, first_divergence, is_tie_across_widths, rounding_step, verify_width, width_gaps,
)


@pytest.mark.parametrize("x, dtype, step", [
    (16.375, "mlx.core.bfloat16", 0.125),  # 2**4 with 7 mantissa bits
    (1.0, "bfloat16", 2**-7),
    (21.14, "float16", 2**-6),
    (-3.0, "float32", 2**-22),
])
def test_rounding_step(x, dtype, step):
    assert rounding_step(x, dtype) == step


@pytest.mark.parametrize("gaps, tie, words", [
    # 10.75 vs 10.625 by prefill is two bf16 steps (seen on the H200), but other widths move it by two
    ({"prefill": 0.125, "step": 0.25, "verify_last": 0.1875, "verify_first": 0.125}, True, "spread across widths (0.125)"),
    ({"prefill": 0.125, "step": 0.0625, "verify_last": 0.1875}, True, "within one rounding step (0.0625)"),
    ({"prefill": 0.125, "step": 0.125, "verify_last": 0.125, "verify_first": 0.125}, False, "exceeds"),  # no width moves it
    ({"prefill": 0.0625, "step": 0.125}, True, "within one rounding step (0.0625)"),
    ({"prefill": 0.125, "step": -0.0625, "verify_first": 0.25}, True, "(step) orders the two tokens the other way"),
    ({"prefill": 1.5, "step": 1.25, "verify_last": 1.75}, False, "exceeds"),  # a swapped token: far outside the rounding
    ({"prefill": 0.125}, False, "exceeds"),  # one width alone: one step is all the slack there is
])
def test_is_tie_across_widths(gaps, tie, words):
    got, why = is_tie_across_widths(gaps, 10.75, "mlx.core.bfloat16")
    assert got is tie and words in why


def test_width_gaps_agree_in_float32(tiny_dirs):
    """Every width computes the same position's logits; in float32 they agree to rounding."""
    from dspark_lab import greedy_generate, load_target

    target, tok = load_target(tiny_dirs["qwen3"])
    prompt = tok.encode("def add(a, b):")
    ref = greedy_generate(target, tok, prompt, max_new_tokens=12).token_ids
    context, a_tok, b_tok = prompt + ref[:10], ref[10], (ref[10] + 1) % 50
    gaps = width_gaps(target, context, a_tok, b_tok, [b_tok] + ref[11:], width=4)
    assert set(gaps) == {"prefill", "step", "verify_last", "verify_first"}
    assert min(gaps.values()) > 0  # the greedy token wins at every width
    assert max(gaps.values()) - min(gaps.values()) < 1e-3
    assert set(width_gaps(target, prompt[:1], a_tok, b_tok, [])) == {"prefill"}  # nothing to cache before one token
    # a tree arm's width: a tree forward whose root is the position, padded to that many rows, agrees too
    for compiled in (True, False):
        target.tree_compiled = compiled
        with_tree = width_gaps(target, context, a_tok, b_tok, [b_tok] + ref[11:], width=4, tree_width=17)
        assert set(with_tree) == set(gaps) | {"tree"} and abs(with_tree["tree"] - gaps["prefill"]) < 1e-3
    # where the tree's rows are fed wrongly the gap moves: the check has teeth
    real = target.forward_tree
    target.forward_tree = lambda ids, depth, *a, **k: real(ids, [d + 3 for d in depth], *a, **k)
    moved = width_gaps(target, context, a_tok, b_tok, [b_tok] + ref[11:], width=4, tree_width=17)["tree"]
    assert abs(moved - gaps["prefill"]) > 1e-2


def test_first_divergence_on_a_real_model_reports_a_real_gap(tiny_dirs):
    from dspark_lab import greedy_generate, load_target

    target, tok = load_target(tiny_dirs["qwen3"])
    prompt = tok.encode("def add(a, b):")
    ref = greedy_generate(target, tok, prompt, max_new_tokens=8).token_ids
    other = ref[:3] + [(ref[3] + 1) % 50] + ref[4:]
    assert first_divergence(target, prompt, ref, list(ref)) is None
    d = first_divergence(target, prompt, ref, other)
    assert d["index"] == 3 and d["logit_a"] > d["logit_b"] and d["tie"] is False and "exceeds" in d["why"]
    assert set(d["gaps"]) == {"prefill", "step", "verify_last", "verify_first"} and d["gap_spread"] < 1e-3
    assert d["gap"] == abs(d["logit_a"] - d["logit_b"]) and abs(d["gap"] - d["gaps"]["prefill"]) < 1e-3
    assert d["prefill_picks"] == "a"  # the greedy token is the fresh prefill's argmax
    assert set(first_divergence(target, prompt, ref, other, tree_width=9)["gaps"]) == set(d["gaps"]) | {"tree"}
    assert first_divergence(target, prompt, other, ref)["prefill_picks"] == "b"


def test_verify_width_of_an_arm():
    assert verify_width("7") == 8 and verify_width(4) == 5
    assert verify_width("auto") == verify_width("0") == VERIFY_WIDTH  # no fixed draft count: a cap-7 verify
