"""A KV cache whose attention shapes change once per bucket of positions, not every round.

Measured on the H200 (benchmarks/attention_shapes.py, docs/performance.md): MLX's CUDA backend
builds a new attention kernel the first time it sees a (query width > 1, KV length) pair,
about 65 ms each. Plain decoding (width 1) never pays it, but a speculative round verifies
several tokens at a KV length it has never seen before, so it would pay it every round.

This cache hands attention its keys padded to a multiple of `BUCKET` positions, with a
boolean mask that hides the padding, whenever more than one query row is fed. Widths of 1
get the exact slice and no mask, as mlx-lm's KVCache gives them (the fastest kernel).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

BUCKET = 256


def bucketed(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


class BucketedKVCache(KVCache):
    step = BUCKET

    def ensure(self, size: int, like: tuple[mx.array, mx.array] | None = None) -> None:
        """Make the buffers hold at least `size` positions, growing them to the next bucket.
        `like` gives shape and dtype for the first allocation (later ones copy the buffers').
        The whole old buffer is kept: a pipelined round may have written past `offset`."""
        if self.keys is not None and size <= self.keys.shape[2]:
            return
        keys, values = like if self.keys is None else (self.keys, self.values)
        B, H, old, Dk = keys.shape
        new = bucketed(size)
        fresh_k = mx.zeros((B, H, new, Dk), keys.dtype)
        fresh_v = mx.zeros((B, H, new, values.shape[3]), values.dtype)
        if self.keys is not None:
            fresh_k[..., :old, :] = self.keys
            fresh_v[..., :old, :] = self.values
        self.keys, self.values = fresh_k, fresh_v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev, n = self.offset, keys.shape[2]
        need = prev + n
        self.ensure(need, like=(keys, values))
        self.keys[..., prev:need, :] = keys
        self.values[..., prev:need, :] = values
        self.offset = need
        if n == 1:
            return self.keys[..., :need, :], self.values[..., :need, :]
        size = bucketed(need)
        return self.keys[..., :size, :], self.values[..., :size, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Called before this forward's update: queries sit at offset .. offset+N-1."""
        if N == 1:
            return None
        return causal_bucket_mask(self.offset, N, window_size)


def causal_bucket_mask(offset: int, n: int, window: int | None = None) -> mx.array:
    """(n, bucketed(offset+n)) booleans: query i (at offset+i) sees keys at positions <= its
    own, and within `window` of it when given; padding is never seen."""
    q = offset + mx.arange(n)[:, None]
    k = mx.arange(bucketed(offset + n))[None]
    visible = k <= q
    if window is not None:
        visible = visible & (k > q - window)
    return visible
