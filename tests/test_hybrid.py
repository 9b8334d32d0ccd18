"""Targets whose caches cannot simply be trimmed: gated-delta linear attention (qwen3_next),
Mamba-2 (nemotron_h), short convolutions (lfm2) and sliding-window attention in rotating caches
(gemma3_text, window 8 so it wraps). After a rejected round their state is restored and the
accepted rows replayed; output stays token-identical to plain decoding."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from conftest import PROMPTS
from dspark_lab import LoadError, greedy_generate, load_target, lookup_generate, speculative_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.target import Target
from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

FAMILIES = {"qwen3_next": 4, "nemotron_h": 4, "lfm2": 2, "gemma3_text": 4}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    path = build_tiny_model(tmp_path_factory.mktemp(name) / "m", name, num_layers=FAMILIES[name])
    target, tok = load_target(path, taps=list(range(FAMILIES[name])))  # the probe: the tap reproduces this family
    return name, path, target, tok


def test_lookup_is_lossless_at_every_cap(family):
    name, _, target, tok = family
    rejected = 0
    for p in PROMPTS[:20]:
        ref = greedy_generate(target, tok, p, max_new_tokens=16).token_ids
        for cap in range(1, 8):
            # min_n=1 drafts on any repeated token: most rounds reject at some (often every) position.
            r = lookup_generate(target, tok, p, max_new_tokens=16, max_draft_tokens=cap, min_n=1, max_n=2)
            assert r.token_ids == ref, (name, cap, p)
            rejected += sum(1 for a, d in zip(r.accept_lengths, r.draft_lengths) if d and a - 1 < d)
    assert rejected > 20  # the rollback path really ran


def test_dspark_head_on_the_family_is_lossless(family, tmp_path):
    name, path, target, tok = family
    head = load_dspark(build_tiny_dspark(tmp_path / "h", path, markov_rank=target.vocab_size, repeat_bias=20.0), target)
    for p in PROMPTS[:8]:
        ref = greedy_generate(target, tok, p, max_new_tokens=16).token_ids
        for cap in (2, 5):
            assert speculative_generate(target, tok, head, p, max_new_tokens=16, max_draft_tokens=cap).token_ids == ref


def flat_state(cache):
    """Every array of every layer's cache state (KV caches give only their filled rows)."""
    out = []

    def walk(x):
        if isinstance(x, mx.array):
            out.append(np.array(x.astype(mx.float32)))
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)

    for c in cache:
        if isinstance(c, KVCache):  # rows past the offset are stale scratch, not state
            walk([c.keys[..., : c.offset, :], c.values[..., : c.offset, :]])
        elif not isinstance(c, RotatingKVCache):
            # A rotating cache's buffer layout depends on how many rows each update fed (a
            # multi-row update keeps window + rows - 1); its contents are compared through the
            # logits of the steps that follow, below.
            walk(c.state)
    return out


def test_rollback_after_a_partial_accept_equals_plain_decoding(family):
    name, _, target, _ = family
    prompt = mx.array([(13 * i + 5) % target.vocab_size for i in range(12)], dtype=mx.uint32)
    kept = [7, 11, 3]  # pending + 2 accepted drafts
    # Plain decoding of the same tokens, one at a time.
    plain = target.make_cache()
    target.forward(prompt, plain)
    for t in kept:
        target.forward(mx.array([t], dtype=mx.uint32), plain)
    # A verify round of 6 rows that accepts 2 drafts, then rolls back.
    spec = target.make_cache()
    target.forward(prompt, spec)
    fed = mx.array(kept + [19, 23, 29], dtype=mx.uint32)
    snap = target.checkpoint(spec)
    assert snap is not None  # this family needs more than a trim
    target.forward(fed, spec)
    target.rewind(spec, snap, fed, len(kept))
    a, b = flat_state(plain), flat_state(spec)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-4)
    # Ten more plain steps on both: equal logits at every step (past the window's wrap too).
    for t in range(31, 41):
        nxt = mx.array([t], dtype=mx.uint32)
        np.testing.assert_allclose(np.array(target.forward(nxt, plain).logits), np.array(target.forward(nxt, spec).logits), atol=1e-4)


def test_a_family_without_a_tappable_layout_is_refused():
    class Odd(nn.Module):
        model_type = "oddformer"

        def __init__(self):
            super().__init__()
            self.blocks = [nn.Linear(4, 4)]

    with pytest.raises(LoadError, match="model_type 'oddformer' does not have a decoder layout"):
        Target(Odd(), {"model_type": "oddformer"})
