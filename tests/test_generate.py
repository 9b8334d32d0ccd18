"""Plain decoding matches mlx-lm; lookup decoding is lossless (token ids identical to greedy)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from conftest import FAMILIES, PROMPTS, REPETITIVE
from dspark_lab import greedy_generate, lookup_generate
from dspark_lab.engine.text import encode_prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_mlx_lm_generate(tiny_models, family):
    target, tok = tiny_models[family]
    for prompt in PROMPTS[:6]:
        ids = encode_prompt(tok, prompt)
        ref = [int(t) for t, _ in generate_step(mx.array(ids), target.model, max_tokens=24)]
        eos = set(tok.eos_token_ids)
        if any(t in eos for t in ref):
            ref = ref[: next(i for i, t in enumerate(ref) if t in eos)]
        ours = greedy_generate(target, tok, ids, max_new_tokens=24)
        assert ours.token_ids == ref, prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_lookup_is_lossless(tiny_models, family):
    target, tok = tiny_models[family]
    for prompt in PROMPTS:
        base = greedy_generate(target, tok, prompt, max_new_tokens=40)
        spec = lookup_generate(target, tok, prompt, max_new_tokens=40)
        assert spec.token_ids == base.token_ids, prompt
        assert spec.text == base.text
        assert spec.finish_reason == base.finish_reason


def test_lookup_accepts_drafts_on_repetitive_prompts(qwen3):
    target, tok = qwen3
    results = [lookup_generate(target, tok, p, max_new_tokens=48, apply_chat_template=False) for p in REPETITIVE]
    drafted = sum(sum(r.draft_lengths) for r in results)
    mean_accept = sum(sum(r.accept_lengths) for r in results) / sum(len(r.accept_lengths) for r in results)
    assert drafted > 0
    assert mean_accept > 1.3, mean_accept
    # Fewer target forwards than tokens is what speculation buys.
    assert sum(r.target_forwards for r in results) < sum(r.num_tokens for r in results)


@pytest.mark.parametrize("max_draft", [1, 2, 3, 5, 8])
def test_lookup_lossless_at_every_cap(qwen3, max_draft):
    target, tok = qwen3
    for prompt in REPETITIVE[:4]:
        base = greedy_generate(target, tok, prompt, max_new_tokens=30, apply_chat_template=False)
        spec = lookup_generate(target, tok, prompt, max_new_tokens=30, max_draft_tokens=max_draft, apply_chat_template=False)
        assert spec.token_ids == base.token_ids
        assert max(spec.draft_lengths) <= max_draft


def test_result_fields_are_consistent(qwen3):
    target, tok = qwen3
    r = lookup_generate(target, tok, REPETITIVE[1], max_new_tokens=37)
    assert r.num_tokens == len(r.token_ids) <= 37
    assert r.finish_reason in ("stop", "length")
    if r.finish_reason == "length":
        assert r.num_tokens == 37
    # The first token comes from prefill; every later one from a round.
    assert sum(r.accept_lengths) == r.num_tokens - 1
    assert r.num_rounds == len(r.accept_lengths) == len(r.draft_lengths)
    assert r.target_forwards == r.num_rounds + 1
    assert all(1 <= a <= d + 1 for a, d in zip(r.accept_lengths, r.draft_lengths))
    assert r.mean_accept_len == pytest.approx(sum(r.accept_lengths) / len(r.accept_lengths))
    assert r.tokens_per_sec > 0 and r.prefill_seconds > 0 and r.ttft_seconds > 0
    d = r.per_position_acceptance()
    assert all(0.0 <= x <= 1.0 for x in d)
    assert d == sorted(d, reverse=True)  # reaching position i+1 needs position i accepted


def test_greedy_counts(qwen3):
    target, tok = qwen3
    r = greedy_generate(target, tok, "The quick brown fox", max_new_tokens=20)
    assert r.num_tokens == 20 and r.finish_reason == "length"
    assert r.accept_lengths == [1] * 19 and r.mean_accept_len == 1.0


def test_max_new_tokens_is_exact_for_every_length(qwen3):
    target, tok = qwen3
    for n in (1, 2, 3, 7):
        for fn in (greedy_generate, lookup_generate):
            r = fn(target, tok, REPETITIVE[0], max_new_tokens=n, apply_chat_template=False)
            assert r.num_tokens == n and r.finish_reason == "length"


def test_stop_strings_and_streaming(qwen3):
    target, tok = qwen3
    full = greedy_generate(target, tok, "def fibonacci(n):", max_new_tokens=40)
    assert len(full.text) > 6
    stop = full.text[4:7]
    for fn in (greedy_generate, lookup_generate):
        chunks = []
        r = fn(target, tok, "def fibonacci(n):", max_new_tokens=40, stop=[stop], on_text=chunks.append)
        assert r.finish_reason == "stop"
        assert r.text == full.text[: full.text.index(stop)]
        assert "".join(chunks) == r.text  # only committed text, never past the stop string
        assert full.token_ids[: len(r.token_ids)] == r.token_ids


def test_streamed_text_equals_final_text(qwen3):
    target, tok = qwen3
    for fn in (greedy_generate, lookup_generate):
        chunks = []
        r = fn(target, tok, REPETITIVE[2], max_new_tokens=30, on_text=chunks.append)
        assert "".join(chunks) == r.text == tok.decode(r.token_ids)


def test_eos_stops_generation(tiny_dirs):
    # Make the model's favourite next token its EOS: generation must stop with "stop".
    from dspark_lab import load_target

    target, tok = load_target(tiny_dirs["qwen3"])
    for prompt in PROMPTS:  # one whose output has a fresh token after the first
        first = greedy_generate(target, tok, prompt, max_new_tokens=20).token_ids
        cut = next((i for i in range(1, 20) if first[i] not in first[:i]), None)
        if cut:
            break
    tok.eos_token_ids = {first[cut]}
    for fn in (greedy_generate, lookup_generate):
        r = fn(target, tok, prompt, max_new_tokens=20)
        assert r.finish_reason == "stop" and r.token_ids == first[:cut]


def test_raw_prompt_without_chat_template(qwen3):
    target, tok = qwen3
    ids = encode_prompt(tok, "hello", apply_chat_template=False)
    assert ids == tok.encode("hello")
    assert len(encode_prompt(tok, "hello")) > len(ids)  # the template adds role markers
    r = greedy_generate(target, tok, "hello", max_new_tokens=5, apply_chat_template=False)
    assert r.prompt_tokens == len(ids)


def test_quantized_kv_cache_lookup_matches_its_greedy(tmp_path):
    from dspark_lab import load_target
    from dspark_lab.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "llama32", "llama", num_attention_heads=2, num_key_value_heads=1)
    target, tok = load_target(path, kv_bits=8)
    for prompt in REPETITIVE[:3]:
        base = greedy_generate(target, tok, prompt, max_new_tokens=24)
        spec = lookup_generate(target, tok, prompt, max_new_tokens=24)
        assert spec.token_ids == base.token_ids


def test_position_acceptance_pools_rounds_of_several_generations():
    """Rounds from two generations pooled: position i counts only the rounds that drafted it."""
    from dspark_lab.engine.generate import position_acceptance

    # accepted drafts 2, 0, 1 (accept length less the target's own token); drafted 4, 4, 1
    assert position_acceptance([3, 1, 2], [4, 4, 1]) == pytest.approx([2 / 3, 1 / 2, 0.0, 0.0])
    assert position_acceptance([], []) == []
