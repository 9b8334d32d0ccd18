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
from dspark_lab import LoadError, greedy_generate, load_target, speculative_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.target import Target
from dspark_lab.tiny import build_tiny_dspark, build_tiny_model
from rollback import assert_lookup_lossless_at_every_cap, assert_rollback_equals_plain_decoding

FAMILIES = {"qwen3_next": 4, "nemotron_h": 4, "lfm2": 2, "gemma3_text": 4}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    path = build_tiny_model(tmp_path_factory.mktemp(name) / "m", name, num_layers=FAMILIES[name])
    target, tok = load_target(path, taps=list(range(FAMILIES[name])))  # the probe: the tap reproduces this family
    return name, path, target, tok


def test_lookup_is_lossless_at_every_cap(family):
    name, _, target, tok = family
    assert_lookup_lossless_at_every_cap(name, target, tok)


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
    assert_rollback_equals_plain_decoding(family[2], flat_state)


def test_a_family_without_a_tappable_layout_is_refused():
    class Odd(nn.Module):
        model_type = "oddformer"

        def __init__(self):
            super().__init__()
            self.blocks = [nn.Linear(4, 4)]

    with pytest.raises(LoadError, match="model_type 'oddformer' does not have a decoder layout"):
        Target(Odd(), {"model_type": "oddformer"})


def test_the_launch_probe_restores_the_cache_of_every_family(family):
    """--launch-every auto's probe runs verify forwards over one warm cache and rewinds each, as a
    rejected round does: caches that cannot trim restore their state, so every setting meets the
    same cache and the logits stay exactly equal."""
    from dspark_lab.lab.launch_probe import measure_launch_every

    _, _, target, _ = family
    v = measure_launch_every(target, width=3, context=12, repeats=2, candidates=(1,))
    assert v.exact == {0: True, 1: True} and v.every in (0, 1)
