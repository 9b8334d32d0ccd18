"""The committed SmolLM2-135M DSpark head (fixtures/smollm2-135m-dspark, distilled on the H200):
small enough to commit, and its tensors are exactly the ones its config describes. Its behaviour
on the real model is checked in test_real_smollm2.py."""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dspark_lab.engine.drafters.dspark import DSparkHead
from dspark_lab.engine.drafters.dspark_config import detect_packaging, parse_dspark_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2-135m-dspark"


def test_fixture_head_is_small_and_documented():
    assert (FIXTURE / "model.safetensors").stat().st_size <= 20 * 1024 * 1024
    card = (FIXTURE / "README.md").read_text()
    assert "dspark-lab distill" in card and "Held-out mean accept length" in card


def test_fixture_tensors_match_its_config_one_to_one():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    tensors = mx.load(str(FIXTURE / "model.safetensors"))
    assert detect_packaging(cfg, set(tensors)) == "native"
    c = parse_dspark_config(cfg, set(tensors))
    assert (c.block_size, c.num_hidden_layers, c.markov_rank, c.hidden_size) == (5, 1, 32, 576)
    expected = {k: v.shape for k, v in tree_flatten(DSparkHead(c, c.hidden_size).parameters())}
    assert {k: v.shape for k, v in tensors.items()} == expected
