"""Multimodal (mlx-vlm) targets: Gemma 4 and Gemma 3 vision-language checkpoints load through
mlx-vlm's model classes and run as their language model. Speculative output is token-identical
to greedy decoding, and a rollback after a partial accept leaves the state of plain decoding
(their sliding-window layers sit in rotating caches, window 8, so it wraps)."""

import json
import sys

import mlx.core as mx
import numpy as np
import pytest

from conftest import PROMPTS
from dspark_lab import LoadError, greedy_generate, load_target, speculative_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.loading import choose_loader
from dspark_lab.tiny import build_tiny_dspark, build_tiny_model
from rollback import assert_lookup_lossless_at_every_cap, assert_rollback_equals_plain_decoding, rejected_rounds

FAMILIES = {"gemma4": 4, "gemma3": 4}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    pytest.importorskip("mlx_vlm", reason='mlx-vlm is not installed (pip install "dspark-lab[vlm]")')
    name = request.param
    path = build_tiny_model(tmp_path_factory.mktemp(name) / "m", name, num_layers=FAMILIES[name])
    target, tok = load_target(path, taps=[-1, *range(FAMILIES[name])])  # the probe: the tap reproduces this family
    return name, path, target, tok


def test_loads_through_mlx_vlm_as_its_language_model(family):
    name, path, target, _ = family
    assert type(target.model).__module__ == f"mlx_vlm.models.{name}.language"
    assert target.model_type == name and target.probed
    assert choose_loader(json.loads((path / "config.json").read_text())) == "mlx-vlm"
    assert not target.trims_only  # sliding-window layers: rollback restores and replays


def test_lookup_is_lossless_at_every_cap(family):
    name, _, target, tok = family
    assert_lookup_lossless_at_every_cap(name, target, tok)


def test_dspark_head_on_the_family_is_lossless_at_every_cap(family, tmp_path):
    name, path, target, tok = family
    head = load_dspark(build_tiny_dspark(tmp_path / "h", path, markov_rank=target.vocab_size, repeat_bias=20.0, block_size=7), target)
    rejected = 0
    for p in PROMPTS[:20]:
        ref = greedy_generate(target, tok, p, max_new_tokens=16).token_ids
        for cap in range(1, 8):
            r = speculative_generate(target, tok, head, p, max_new_tokens=16, max_draft_tokens=cap)
            assert r.token_ids == ref, (name, cap, p)
            rejected += rejected_rounds(r)
    assert rejected > 20


def flat_state(cache):
    """Every array of every layer's cache state (KV caches give only their filled rows; a
    rotating cache's buffer layout depends on how many rows each update fed, so its contents
    are compared through the logits of the steps that follow)."""
    from mlx_vlm.models.cache import KVCache, RotatingKVCache

    out = []
    for c in cache:
        if isinstance(c, KVCache):
            out += [np.array(c.keys[..., : c.offset, :].astype(mx.float32)), np.array(c.values[..., : c.offset, :].astype(mx.float32))]
        else:
            assert isinstance(c, RotatingKVCache)
            out.append(np.array([c.offset]))
    return out


def test_rollback_after_a_partial_accept_equals_plain_decoding(family):
    assert_rollback_equals_plain_decoding(family[2], flat_state)


def _write_config(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_multimodal_family_without_mlx_vlm_is_refused_naming_it_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, "mlx_vlm.utils", None)
    path = _write_config(tmp_path, {"model_type": "paligemma", "text_config": {"model_type": "gemma"}, "vision_config": {}})
    with pytest.raises(LoadError, match=r"model_type 'paligemma' .*multimodal.*mlx-vlm.*not installed.*dspark-lab\[vlm\]"):
        load_target(path)
    # A multimodal family mlx-lm has itself still loads through mlx-lm's text path.
    assert choose_loader({"model_type": "gemma3", "text_config": {}, "vision_config": {}}) == "mlx-lm"


def test_a_multimodal_family_neither_library_has_is_refused(tmp_path):
    pytest.importorskip("mlx_vlm", reason='mlx-vlm is not installed (pip install "dspark-lab[vlm]")')
    path = _write_config(tmp_path, {"model_type": "oddvlm", "text_config": {}, "vision_config": {}})
    with pytest.raises(LoadError, match="unknown model_type 'oddvlm' .*neither mlx-lm .* nor mlx-vlm"):
        load_target(path)
