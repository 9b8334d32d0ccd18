"""The bandwidth limit of decoding, which issue #10 asks every result to be reported against.

A decoded token costs at least one read of every weight and of the KV cache up to it, so
tokens/s can never exceed (measured copy bandwidth) / (weight bytes + KV bytes per position x
context). Speculative decoding can pass that bound (one read verifies several tokens); plain
decoding cannot, and on small models it stays far below it (launch-bound, docs/performance.md).
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx.utils import tree_flatten


def copy_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second moved by `y = x + 1` on a `mib`-MiB float32 array (read + write), the
    best of `repeats` after one warm-up."""
    n = mib * (1 << 20) // 4
    x = mx.zeros((n,), dtype=mx.float32)
    mx.eval(x)
    mx.eval(x + 1)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        y = x + 1
        mx.eval(y)
        best = min(best, time.perf_counter() - t)
        del y
    return 2 * n * 4 / best


def kv_bytes_per_position(config: dict, dtype_bytes: int, num_layers: int) -> int:
    """Bytes of keys and values one position adds to the cache of every layer."""
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * num_layers * kv_heads * head_dim * dtype_bytes


def decode_bytes(target) -> tuple[int, int]:
    """(weight bytes, KV bytes per position) of a Target: what one decode step reads."""
    params = tree_flatten(target.model.parameters())
    weights = sum(v.nbytes for _, v in params)
    floats = [v.dtype for _, v in params if mx.issubdtype(v.dtype, mx.floating)]
    activation = (mx.bfloat16 if mx.bfloat16 in floats else floats[0] if floats else mx.float16).size
    return weights, kv_bytes_per_position(target.config, activation, target.num_layers)


def limit_tokens_per_second(bandwidth: float, weight_bytes: int, kv_per_position: int, context: float) -> float:
    """The most tokens a second a plain decode can reach at this mean context length."""
    return bandwidth / (weight_bytes + kv_per_position * context)
