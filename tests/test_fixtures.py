"""The committed DSpark heads (distilled on the H200): small enough to commit, documented, and
their tensors exactly the ones their config describes, loaded the strict way the engine loads
them (quantized exactly where the file has scales). The SmolLM2 head's behaviour on the real
model is checked in test_real_smollm2.py; the Qwen2.5-Coder heads' targets are 300 MB and 900 MB
imports CI does not make, so their accept lengths are the cards' measurements."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from dspark_lab.engine.drafters.dspark import DSparkHead
from dspark_lab.engine.drafters.dspark_config import detect_packaging, parse_dspark_config
from dspark_lab.engine.drafters.load import load_into, native_weights, stored_quantization

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# name: (block size, layers, Markov rank, hidden size, stored bits or None for float)
HEADS = {
    "smollm2-135m-dspark": (5, 1, 32, 576, None),
    "qwen2.5-coder-0.5b-dspark": (8, 2, 0, 896, 4),
    "qwen2.5-coder-1.5b-dspark": (8, 2, 0, 1536, 4),
}


def read_fixture(name):
    """The fixture's config.json, its tensors under the native names, and the parsed config."""
    fixture = FIXTURES / name
    cfg = json.loads((fixture / "config.json").read_text())
    tensors = native_weights(mx.load(str(fixture / "model.safetensors")))
    return cfg, tensors, parse_dspark_config(cfg, set(tensors))


@pytest.mark.parametrize("name", HEADS)
def test_fixture_head_is_small_and_documented(name):
    fixture = FIXTURES / name
    assert (fixture / "model.safetensors").stat().st_size <= 20 * 1024 * 1024
    card = (fixture / "README.md").read_text()
    assert "dspark-lab distill" in card and "Held-out mean accept length" in card


@pytest.mark.parametrize("name", HEADS)
def test_fixture_tensors_match_its_config_one_to_one(name):
    block, layers, markov, hidden, bits = HEADS[name]
    cfg, tensors, c = read_fixture(name)
    assert detect_packaging(cfg, set(tensors)) == "native"
    assert (c.block_size, c.num_hidden_layers, c.markov_rank, c.hidden_size) == (block, layers, markov, hidden)
    stored = stored_quantization(cfg, set(tensors))
    assert (stored[1] if stored else None) == bits
    head = DSparkHead(c, c.hidden_size)
    load_into(head, tensors, stored, bits or 16)  # strict: every tensor has its place, none is missing
    loaded = dict(tree_flatten(head.parameters()))
    assert loaded.keys() == tensors.keys() and all(loaded[k].shape == v.shape for k, v in tensors.items())
    if bits:  # every linear layer of the transformer stays quantized as stored
        quantized = [p for p, m in head.named_modules() if isinstance(m, nn.QuantizedLinear)]
        assert quantized and all(f"{p}.scales" in tensors for p in quantized)
        assert not any(isinstance(m, nn.Linear) and not isinstance(m, nn.QuantizedLinear) for _, m in head.named_modules())


@pytest.mark.parametrize("name", HEADS)
def test_distill_init_continues_from_the_committed_head(name):
    # Sessions continue these heads with `distill --init` (the Qwen one is stored at 4 bits): its
    # values, dequantized, become the fresh head's float weights.
    from dspark_lab.lab.distill import _init_from

    cfg, tensors, c = read_fixture(name)
    fresh = DSparkHead(c, c.hidden_size)
    _init_from(fresh, c, FIXTURES / name)
    stored = DSparkHead(c, c.hidden_size)
    load_into(stored, tensors, stored_quantization(cfg, set(tensors)), 16)  # 16: the stored values, dequantized
    want, got = dict(tree_flatten(stored.parameters())), dict(tree_flatten(fresh.parameters()))
    assert want.keys() == got.keys()
    assert all(got[k].dtype == mx.float32 and mx.array_equal(got[k], want[k].astype(mx.float32)) for k in want)
