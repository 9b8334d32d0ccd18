"""The indices of the k largest entries of each row, in two small partitions instead of one large
one (distill --soft-labels: the target's top 32 of 151,936 logits at every training position).

A row's top k all lie in the k chunks of `chunk` entries whose maxima are largest: were an entry
of the top k in any other chunk, each of those k chunks would hold an entry larger than it, and it
would not be in the top k. So partition the chunk maxima (V / chunk of them), gather those k
chunks (k * chunk candidates) and partition the candidates. On the H200 a direct
`mx.argpartition` over 8,192 rows of 151,936 logits took 41 ms of a 111 ms training step
(docs/performance.md, twenty-ninth round); this reads the logits once for the maxima and
partitions about 3% as many entries.
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 128


def top_k_indices(x: mx.array, k: int, chunk: int = CHUNK) -> mx.array:
    """(..., k) indices of the k largest entries along x's last axis, in no particular order (the
    same set as a direct partition's wherever the k-th largest value is not tied)."""
    vocab = x.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be between 1 and the vocabulary size ({vocab}), got {k}")
    n = -(-vocab // chunk)
    if 4 * k > n:  # the k best chunks would hold over a quarter of the row: partition it directly
        return mx.argpartition(x, kth=vocab - k, axis=-1)[..., vocab - k :]
    lead = x.shape[:-1]
    if n * chunk != vocab:  # the last chunk padded with -inf, which no top k of a real row holds
        x = mx.concatenate([x, mx.full((*lead, n * chunk - vocab), -mx.inf, dtype=x.dtype)], axis=-1)
    blocks = x.reshape(*lead, n, chunk)
    best = mx.argpartition(blocks.max(axis=-1), kth=n - k, axis=-1)[..., n - k :]  # (..., k) chunk numbers
    cand = mx.take_along_axis(blocks, mx.broadcast_to(best[..., None], (*lead, k, chunk)), axis=-2)
    pick = mx.argpartition(cand.reshape(*lead, k * chunk), kth=k * chunk - k, axis=-1)[..., k * chunk - k :]
    return mx.take_along_axis(best, pick // chunk, axis=-1) * chunk + pick % chunk


def top_k_logprobs(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest entries of each row best first, with their log-probabilities under the row's
    softmax: ((..., k) indices, (..., k) float32). A DSpark head's candidates per draft position
    (tree drafts: DSparkDrafter.draft_top, benchmarks/tree_accept.py)."""
    logits = logits.astype(mx.float32)
    top = top_k_indices(logits, k)
    order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
    top = mx.take_along_axis(top, order, axis=-1)
    return top, mx.take_along_axis(logits, top, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
