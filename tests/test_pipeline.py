"""The pipelined loop (speculative_generate(pipeline=True)) and the array-offset forwards it
stands on: token ids equal greedy decoding in every plain-KV family (every cap, and the same
rounds as the plain loop: test_dspark.test_lossless_at_every_cap), exact sampling at
temperature > 0 (test_dspark.test_speculative_sampling_is_exact), every edge of the length limit, and clear refusals where it cannot be exact."""

import mlx.core as mx
import pytest

from conftest import FAMILIES, PROMPTS, REPETITIVE
from dspark_lab import InputError, greedy_generate, load_target
from dspark_lab.engine.drafters.load import load_dflash, load_dspark
from dspark_lab.engine.speculative import speculative_generate
from dspark_lab.tiny import build_tiny_dflash, build_tiny_dspark, build_tiny_model


def test_partial_accepts_really_happen_pipelined(qwen3, heads):
    """With the repeating head on a looping prompt, rounds accept at several depths: the
    offsets a rejected draft leaves behind are exercised, not just full rejections."""
    target, tok = qwen3
    drafter = load_dspark(heads["repeat"], target)
    r = speculative_generate(target, tok, drafter, REPETITIVE[0], max_new_tokens=40, max_draft_tokens=4, pipeline=True)
    assert r.token_ids == greedy_generate(target, tok, REPETITIVE[0], max_new_tokens=40).token_ids
    assert len({a for a in r.accept_lengths}) >= 3 and r.mean_accept_len > 2.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("compiled", [False, True])
def test_every_plain_kv_family_pipelined_and_compiled(tiny_dirs, tiny_models, tmp_path, family, compiled):
    """Pipelined (its verify forward compiled) equals greedy decoding, plain or compiled."""
    target, tok = tiny_models[family]
    head = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs[family], markov_rank=target.vocab_size, repeat_bias=20.0), target)
    try:
        for p in PROMPTS[:6] + REPETITIVE[:2]:
            target.compiled = False
            ref = greedy_generate(target, tok, p, max_new_tokens=20).token_ids
            target.compiled = compiled
            assert greedy_generate(target, tok, p, max_new_tokens=20).token_ids == ref, (family, p)
            for cap in (1, 3, 5):
                r = speculative_generate(target, tok, head, p, max_new_tokens=20, max_draft_tokens=cap, pipeline=True)
                assert r.token_ids == ref, (family, compiled, cap, p)
    finally:
        target.compiled = False


def test_compiled_forward_matches_the_plain_forward(qwen3):
    """The compiled decode forward writes the same cache and returns the same logits and taps
    (float32 on the CPU: fused kernels may reorder a reduction, nothing more)."""
    target, _ = qwen3
    prompt = mx.array([5, 9, 14, 3, 22, 7, 30, 11], dtype=mx.uint32)
    outs = {}
    for compiled in (False, True):
        target.compiled = compiled
        cache = target.make_cache()
        target.forward(prompt, cache)
        steps = [target.forward(mx.array(ids, dtype=mx.uint32), cache, taps=(0, 1)) for ids in ([4], [8, 2, 6], [1])]
        target.trim(cache, 2)
        last = target.forward(mx.array([12, 13], dtype=mx.uint32), cache, taps=(1,))
        outs[compiled] = [s.logits for s in steps] + [s.taps[1] for s in steps] + [last.logits, last.taps[1]]
        assert cache[0].offset == 8 + 1 + 3 + 1 - 2 + 2
    target.compiled = False
    for a, b in zip(outs[False], outs[True]):
        assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5])
def test_length_limit_edges(qwen3, heads, max_new_tokens):
    """The round in flight may overshoot the limit: the output is cut to it, as greedy's is."""
    target, tok = qwen3
    drafter = load_dspark(heads["repeat"], target)
    for p in (REPETITIVE[0], PROMPTS[0]):
        ref = greedy_generate(target, tok, p, max_new_tokens=max_new_tokens)
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=max_new_tokens, max_draft_tokens=5, pipeline=True)
        assert r.token_ids == ref.token_ids and r.finish_reason == ref.finish_reason
        assert sum(r.accept_lengths) + 1 == len(r.token_ids)


def test_stop_strings_and_streaming(qwen3, heads):
    target, tok = qwen3
    drafter = load_dspark(heads["repeat"], target)
    p = REPETITIVE[0]
    full = greedy_generate(target, tok, p, max_new_tokens=40)
    stop = full.text[len(full.text) // 2 :][:3]
    ref = greedy_generate(target, tok, p, max_new_tokens=40, stop=stop)
    pieces = []
    r = speculative_generate(target, tok, drafter, p, max_new_tokens=40, max_draft_tokens=4, pipeline=True, stop=stop, on_text=pieces.append)
    assert r.text == ref.text and r.finish_reason == "stop" and "".join(pieces) == r.text


class _Cycle:
    """A cap schedule that visits 0 (plain decoding), partial and full drafts, and records
    what each round reported back."""

    def __init__(self):
        self.caps, self.seen = [0, 1, 5, 3, 2], []

    def cap(self):
        return self.caps[len(self.seen) % len(self.caps)]

    def observe(self, drafted, committed, seconds):
        self.seen.append((drafted, committed))


def test_cap_controller_is_asked_and_told(qwen3, heads, greedy_refs):
    target, tok = qwen3
    drafter = load_dspark(heads["repeat"], target)
    for p in PROMPTS[:6]:
        ctrl = _Cycle()
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, cap_controller=ctrl, pipeline=True)
        assert r.token_ids == greedy_refs[p]
        assert [d for d, _ in ctrl.seen] == r.draft_lengths and [c for _, c in ctrl.seen] == r.accept_lengths
        assert 0 in r.draft_lengths and max(r.draft_lengths) <= 5


def test_refusals_say_what_to_change(qwen3, heads, tiny_dirs, tmp_path):
    target, tok = qwen3
    drafter = load_dspark(heads["qwen3"], target)
    with pytest.raises(InputError, match="confidence"):
        speculative_generate(target, tok, drafter, "hi", pipeline=True, confidence_threshold=0.5)
    dflash = load_dflash(build_tiny_dflash(tmp_path / "df", tiny_dirs["qwen3"]), target)
    with pytest.raises(InputError, match="DSpark heads"):
        speculative_generate(target, tok, dflash, "hi", pipeline=True)
    hybrid_dir = build_tiny_model(tmp_path / "lfm2", "lfm2", num_layers=2)
    hybrid, htok = load_target(hybrid_dir)
    head = load_dspark(build_tiny_dspark(tmp_path / "hh", hybrid_dir), hybrid)
    with pytest.raises(InputError, match="plain KV caches; model_type 'lfm2'"):
        speculative_generate(hybrid, htok, head, "hi", pipeline=True)


def test_the_offset_forward_is_checked_against_the_plain_one(tiny_models, monkeypatch):
    """Every plain-KV family passes; a family whose attention ignored the cache's mask (stale
    rows of a rejected draft visible) is caught and refused by name."""
    from dspark_lab import LoadError
    from dspark_lab.engine.compiled import ArrayOffsetKV

    for family, (target, _) in tiny_models.items():
        assert target.check_offset_forward() < 1e-4, family
    target, _ = tiny_models["llama"]
    target._offset_checked = None
    monkeypatch.setattr(ArrayOffsetKV, "make_mask", lambda self, N, return_array=False, window_size=None: "causal")
    for fwd in target._at_offset.values():
        fwd._fns.clear()  # trace again, with the broken mask
    try:
        with pytest.raises(LoadError, match="model_type 'llama'.*Use mode dspark"):
            target.check_offset_forward()
    finally:
        target._offset_checked = None
        for fwd in target._at_offset.values():
            fwd._fns.clear()


@pytest.mark.parametrize("family", FAMILIES)
def test_lookup_drafts_on_the_device_are_lossless_and_accepted(tiny_dirs, tiny_models, tmp_path, family):
    """pipeline with lookup_drafts=True: the device-side n-gram match replaces the head's drafts
    slot by slot; ids equal greedy decoding at every cap, and on looping prompts an untrained
    head (which drafts almost nothing right) accepts far more with the lookup than without."""
    target, tok = tiny_models[family]
    head = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs[family]), target)
    gain = []
    for p in PROMPTS[:4] + REPETITIVE[:3]:
        ref = greedy_generate(target, tok, p, max_new_tokens=32).token_ids
        for cap in (1, 3, 5):
            r = speculative_generate(target, tok, head, p, max_new_tokens=32, max_draft_tokens=cap, pipeline=True, lookup_drafts=True)
            assert r.token_ids == ref, (family, cap, p)
        if p in REPETITIVE:
            alone = speculative_generate(target, tok, head, p, max_new_tokens=32, max_draft_tokens=5, pipeline=True)
            host = speculative_generate(target, tok, head, p, max_new_tokens=32, max_draft_tokens=5, lookup_drafts=True)
            gain.append((r.mean_accept_len, alone.mean_accept_len, host.mean_accept_len))
    assert all(a > b for a, b, _ in gain), gain  # (device lookup, head alone, the plain loop's host lookup)
    assert sum(a for a, _, _ in gain) >= 0.9 * sum(c for _, _, c in gain), gain


def test_device_lookup_proposes_what_the_host_index_does():
    """DeviceLookup against NgramIndex (the plain loop's lookup, same n-gram lengths) on random
    sequences over a small alphabet (many repeats): at every length, the usable tokens are the
    host's proposal (for caps up to 6, where the host's match-scaled length is the cap)."""
    import random

    from dspark_lab.engine.drafters.lookup import LookupConfig, NgramIndex
    from dspark_lab.engine.pipeline import DeviceLookup
    from dspark_lab.engine.speculative import LOOKUP_MAX_MATCH, LOOKUP_MIN_MATCH, LOOKUP_NS

    rng = random.Random(3)
    ns = LOOKUP_NS
    checked = 0
    for _ in range(4):
        seq = [rng.randrange(4) for _ in range(60)]
        dev = DeviceLookup(seq[:5], ns)
        for length in range(6, len(seq) + 1):
            at = mx.array(length - 1, dtype=mx.int32)
            dev.overlay(mx.array([seq[length - 1]], dtype=mx.uint32), at, mx.zeros((0,), dtype=mx.uint32), None, length + 8)
            host = NgramIndex(seq[:length], LookupConfig(min_n=LOOKUP_MIN_MATCH, max_n=LOOKUP_MAX_MATCH, max_draft=8))
            for cap in (1, 4, 6):
                tokens, usable = dev.propose(at, cap)
                got = [t for t, u in zip(tokens.tolist(), usable.tolist()) if u]
                assert got == host.propose(cap), (seq[:length], cap)
                checked += bool(got)
    assert checked > 100  # matches were found and compared, not only misses


@pytest.mark.parametrize("family", FAMILIES)
def test_a_compiled_draft_step_drafts_what_the_uncompiled_one_does(tiny_dirs, tiny_models, tmp_path, family):
    """compile_draft=True (context append and draft in one compiled trace): the same tokens and
    the same accept length in every round as the uncompiled pipelined loop, so greedy decoding's
    ids, at every cap, with and without device lookup; the head repeats its input, so rounds
    accept at several depths and rejected rows are overwritten through the trace."""
    target, tok = tiny_models[family]
    head = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs[family], markov_rank=target.vocab_size, repeat_bias=20.0), target)
    depths = set()
    for p in PROMPTS[:3] + REPETITIVE[:2]:
        ref = greedy_generate(target, tok, p, max_new_tokens=24).token_ids
        for cap in (1, 3, 5):
            for lookup in (False, True):
                plain = speculative_generate(target, tok, head, p, max_new_tokens=24, max_draft_tokens=cap, pipeline=True, lookup_drafts=lookup)
                comp = speculative_generate(target, tok, head, p, max_new_tokens=24, max_draft_tokens=cap, pipeline=True,
                                            lookup_drafts=lookup, compile_draft=True)
                assert comp.token_ids == plain.token_ids == ref, (family, cap, lookup, p)
                assert comp.accept_lengths == plain.accept_lengths, (family, cap, lookup, p)
                depths.update(comp.accept_lengths)
    assert len(depths) >= 3


def test_compile_draft_needs_the_pipelined_loop_and_samples_uncompiled(qwen3, heads):
    """Refused without pipeline=True; at temperature > 0 the draft runs uncompiled (the exact
    sampler's path, test_speculative_sampling_is_exact), so a seed gives the same text."""
    target, tok = qwen3
    drafter = load_dspark(heads["qwen3"], target)
    runs = [speculative_generate(target, tok, drafter, PROMPTS[0], max_new_tokens=16, max_draft_tokens=3, pipeline=True,
                                 temperature=0.8, seed=7, compile_draft=c).token_ids for c in (False, True)]
    assert runs[0] == runs[1]
    with pytest.raises(InputError, match="pipeline=True"):
        speculative_generate(target, tok, drafter, "hi", compile_draft=True)


def test_a_greedy_rounds_end_compiled_equals_the_rule_step_by_step():
    """The chain loop's greedy verdict, next offset, pending token and payload come from one
    compiled trace (pipeline._greedy_round_end): the same as the verify rule run op by op, for
    every draft width (0: a catch-up round) and every place the drafts stop agreeing."""
    import mlx.core as mx

    from dspark_lab.engine.pipeline import _greedy_round_end, _round_end
    from dspark_lab.engine.sampling import SamplingParams

    mx.random.seed(0)
    offset = mx.array(11, dtype=mx.int32)
    for k in range(5):
        logits = mx.random.normal((k + 1, 40))
        best = mx.argmax(logits, axis=-1).astype(mx.uint32)
        for wrong_at in range(k + 1):  # drafts agree up to wrong_at (k: all agree)
            drafts = mx.where(mx.arange(k) < wrong_at, best[:k], (best[:k] + 1) % 40).astype(mx.uint32)
            got = _greedy_round_end(logits, drafts, offset)
            want = _round_end(logits, drafts, offset, SamplingParams(), None)
            assert [g.tolist() for g in got] == [w.tolist() for w in want]
            assert got[0].tolist()[0] == wrong_at
