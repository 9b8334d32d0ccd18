"""Telling a numerical tie from a real divergence: two logits within one rounding step of the
logit dtype can be ordered either way by kernels of different widths on a GPU."""

import pytest

from dspark_lab.lab.lossless import first_divergence, is_numerical_tie, rounding_step


@pytest.mark.parametrize("x, dtype, step", [
    (16.375, "mlx.core.bfloat16", 0.125),  # 2**4 with 7 mantissa bits
    (1.0, "bfloat16", 2**-7),
    (21.14, "float16", 2**-6),
    (-3.0, "float32", 2**-22),
])
def test_rounding_step(x, dtype, step):
    assert rounding_step(x, dtype) == step


@pytest.mark.parametrize("a, b, dtype, tie", [
    (16.375, 16.25, "mlx.core.bfloat16", True),  # one bf16 step: seen on Qwen2.5-Coder-0.5B
    (14.4375, 14.4375, "mlx.core.bfloat16", True),  # equal
    (21.1406, 21.1562, "mlx.core.float16", True),  # one fp16 step: seen on SmolLM2
    (16.5, 16.25, "mlx.core.bfloat16", False),  # two steps apart
    (16.375, 16.25, "mlx.core.float32", False),  # far apart in float32
])
def test_is_numerical_tie(a, b, dtype, tie):
    assert is_numerical_tie(a, b, dtype) is tie


def test_first_divergence_on_a_real_model_reports_a_real_gap(tiny_dirs):
    from dspark_lab import greedy_generate, load_target

    target, tok = load_target(tiny_dirs["qwen3"])
    prompt = tok.encode("def add(a, b):")
    ref = greedy_generate(target, tok, prompt, max_new_tokens=8).token_ids
    other = ref[:3] + [(ref[3] + 1) % 50] + ref[4:]
    assert first_divergence(target, prompt, ref, list(ref)) is None
    d = first_divergence(target, prompt, ref, other)
    assert d["index"] == 3 and d["logit_a"] > d["logit_b"] and d["tie"] is False
    assert d["prefill_picks"] == "a"  # the greedy token is the fresh prefill's argmax
    assert first_divergence(target, prompt, other, ref)["prefill_picks"] == "b"
