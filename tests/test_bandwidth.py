"""lab/bandwidth.py: the bytes a decode step reads and the tokens/s limit they set."""

import pytest

from dspark_lab import load_target
from dspark_lab.lab.bandwidth import copy_bandwidth, decode_bytes, kv_bytes_per_position, limit_tokens_per_second


def test_decode_bytes_count_every_weight_and_each_layers_keys_and_values(tiny_dirs):
    from mlx.utils import tree_flatten

    target, _ = load_target(tiny_dirs["qwen3"])
    weights, kv = decode_bytes(target)
    assert weights == sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))
    cfg = target.config
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = next(v.dtype for _, v in tree_flatten(target.model.parameters())).size
    assert kv == 2 * target.num_layers * cfg["num_key_value_heads"] * head_dim * dtype


def test_the_limit_falls_with_context_and_the_copy_bandwidth_is_measured():
    assert kv_bytes_per_position({"num_attention_heads": 8, "hidden_size": 512}, 2, 4) == 2 * 4 * 8 * 64 * 2
    assert limit_tokens_per_second(1e12, 10**9, 10**5, 0) == pytest.approx(1000.0)
    assert limit_tokens_per_second(1e12, 10**9, 10**5, 1000) == pytest.approx(1e12 / (1.1e9))
    assert copy_bandwidth(8, repeats=2) > 0
