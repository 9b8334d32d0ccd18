"""mlx-lm's own decoder as the sweep's reference arm: same tokens as our greedy, timed like it."""

from dspark_lab import greedy_generate, load_target
from dspark_lab.engine import mlx_lm_generate


def test_mlx_lm_reference_matches_our_greedy(tiny_dirs):
    target, tok = load_target(tiny_dirs["qwen3"])
    for prompt in ("def add(a, b):", "Explain recursion."):
        ours = greedy_generate(target, tok, prompt, max_new_tokens=12)
        ref = mlx_lm_generate(target, tok, prompt, max_new_tokens=12)
        assert ref.token_ids == ours.token_ids and ref.mode == "mlx-lm"
        assert ref.num_tokens == 12 and ref.finish_reason == "length"
        assert ref.num_rounds == 11 and ref.accept_lengths == [1] * 11 and ref.decode_tokens_per_sec > 0


def test_mlx_lm_reference_stops_at_eos_like_ours(tiny_dirs):
    target, tok = load_target(tiny_dirs["qwen3"])
    prompt = "Explain recursion."
    first = greedy_generate(target, tok, prompt, max_new_tokens=16).token_ids
    j = next(i for i in range(1, len(first)) if first[i] not in first[:i])  # a token not seen before it
    tok.eos_token_ids = set(tok.eos_token_ids) | {first[j]}  # make it an end of text
    ours, ref = greedy_generate(target, tok, prompt, max_new_tokens=16), mlx_lm_generate(target, tok, prompt, max_new_tokens=16)
    assert ref.token_ids == first[:j] and ours.token_ids == first[:j]
    assert ref.finish_reason == ours.finish_reason == "stop"
