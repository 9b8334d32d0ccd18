"""Sampling and speculative verification.

Greedy (temperature 0) verification keeps the longest prefix of the draft that equals the
target's argmax, then the target's own next token. At temperature > 0 the speculative-sampling
rule (Leviathan et al. 2023; Chen et al. 2023) keeps the output an exact sample of the target:
accept draft token x at row i with probability min(1, p_i(x) / q_i(x)); at the first rejection
sample from the residual max(p_i - q_i, 0) renormalized; when every draft is accepted, sample a
bonus token from the last row. A drafter without a distribution (lookup) is one-hot: q_i(x)=1.

Everything here stays on the device and lazy, so a round needs a single host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise InputError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (1 disables nucleus sampling), got {self.top_p}.")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 disables top-k), got {self.top_k}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution we sample from, row-wise: softmax(logits / T), restricted to the top_k
    tokens and to the smallest nucleus holding top_p of the mass, renormalized."""
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = mx.sort(logits, axis=-1)[..., vocab - params.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        # Keep a token when the mass strictly before it is < top_p: the top token always stays.
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = before < params.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def sample_rows(probs: mx.array) -> mx.array:
    """One categorical sample per row of a probability matrix."""
    return mx.random.categorical(mx.log(probs), axis=-1)


def renormalized(residual: mx.array, fallback: mx.array) -> mx.array:
    """Each row of a residual (a distribution with mass taken out) scaled back to sum to 1; a row
    with no mass left (it could not be reached) is the fallback's row instead, to stay finite."""
    mass = residual.sum(axis=-1, keepdims=True)
    return mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), fallback)


def pick_token(logits: mx.array, params: SamplingParams) -> mx.array:
    """Next token from one row of logits (argmax when greedy)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return sample_rows(target_probs(logits, params))


def verify(
    logits: mx.array,
    drafts: mx.array,
    params: SamplingParams,
    draft_probs: mx.array | None = None,
) -> mx.array:
    """Verify k drafted tokens against the target's k+1 rows of logits (row i scored the token
    after position i, so row i judges drafts[i] and row k yields the bonus token).

    Returns a lazy int32 array [n_accepted, next_token]: read it with one `.tolist()`.
    `draft_probs` (k, vocab) is the drafter's distribution; None means one-hot drafts."""
    k = drafts.shape[0]
    if params.greedy:
        best = mx.argmax(logits, axis=-1).astype(mx.int32)
        if k == 0:
            return mx.stack([mx.array(0, mx.int32), best[0]])
        agree = (best[:k] == drafts.astype(mx.int32)).astype(mx.int32)
        n = mx.cumprod(agree).sum()
        return mx.stack([n, best[n]])

    p = target_probs(logits, params)  # (k+1, vocab)
    if k == 0:
        return mx.stack([mx.array(0, mx.int32), sample_rows(p[:1])[0].astype(mx.int32)])
    rows = mx.arange(k)
    p_x = p[rows, drafts]
    if draft_probs is None:
        ratio = p_x
        q = mx.zeros_like(p[:k])
        q = mx.put_along_axis(q, drafts[:, None].astype(mx.int32), mx.ones((k, 1), p.dtype), axis=-1)
    else:
        q = draft_probs.astype(mx.float32)
        ratio = p_x / mx.maximum(q[rows, drafts], 1e-30)
    u = mx.random.uniform(shape=(k,))
    accepted = (u < ratio).astype(mx.int32)
    n = mx.cumprod(accepted).sum()
    # Residual rows for every position (only row n is used when n < k); the bonus row is p[k].
    # Where p == q exactly the rejection had probability 0; fall back to p to stay finite.
    residual = renormalized(mx.maximum(p[:k] - q, 0.0), p[:k])
    choices = mx.concatenate([residual, p[k:]], axis=0)
    nxt = sample_rows(choices[n][None])[0].astype(mx.int32)
    return mx.stack([n, nxt])


def tree_sampled_choice(p: mx.array, ids: mx.array, parent: mx.array, allowed: mx.array, uniform: mx.array):
    """The sampled walk over a draft tree (engine/tree.walk_sampled) for every row at once, on the
    device. p: the target's distribution at each row (rows, vocab); row 0 is the root, `parent` each
    row's parent row. A row is tried where `allowed` and its token is not an earlier sibling's (a
    rejected token has no mass left in its parent's residual); siblings are tried in row order, row
    c accepted with probability p(c at its parent) / (the mass its earlier siblings left), the
    first accepted one chosen. -> (chosen: rows accepted at their parents, tried)."""
    row = mx.arange(ids.shape[0])
    tok = ids.astype(mx.int32)
    real = row > 0
    sibling = (parent[:, None] == parent[None, :]) & (row[None, :] < row[:, None]) & real[None, :] & real[:, None]  # [c, s]: s before c
    tried = allowed & real & ~mx.any(sibling & (tok[:, None] == tok[None, :]) & allowed[None, :], axis=1)
    q = mx.where(tried, p[parent, tok], 0.0)
    before = sibling.astype(mx.float32)
    left = 1.0 - before @ q
    accept = tried & (left > 0) & (uniform * left < q)
    chosen = accept & ((before @ accept.astype(mx.float32)) == 0)
    return chosen, tried


def residual_sample(p: mx.array, ids: mx.array, taken: mx.array) -> mx.array:
    """One sample from distribution p (vocab,) with the tokens ids[taken] removed, renormalized (p
    itself where nothing is left): the next token after a tree node whose tried children were all
    rejected."""
    removed = mx.zeros(p.shape, dtype=mx.float32).at[ids.astype(mx.int32)].add(taken.astype(mx.float32))
    residual = renormalized(mx.where(removed > 0, 0.0, p)[None], p[None])[0]
    return mx.random.categorical(mx.log(residual))
