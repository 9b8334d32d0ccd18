"""The DSpark draft head in MLX (qwen3 and gemma4 backbones).

Context: the target's residual stream at `target_layer_ids` is concatenated per position and
fused, `ctx = hidden_norm(fc(concat(taps)))`. Every drafter layer projects the fused rows with
its own k/v (k_norm, rope at the row's absolute position) into an append-only context cache.

Drafting: the block `[pending] + [mask] * (block_size - 1)`, placed right after the context,
runs through the layers in one parallel pass; its queries see the (windowed) context and the
whole block (bidirectionally; causally for the DFlash-lineage heads). Block slot k, from
`logits_start`, predicts draft token k. A low-rank Markov head then adds a previous-token
correction slot by slot: logits_k += w2(w1[prev_k]), prev_0 = pending, prev_k = draft k-1.
A confidence head scores each slot's chance to survive verification.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from ..cache import BucketedKVCache, bucketed
from ..compiled import ArrayOffsetKV
from ..topk import top_k_logprobs
from .dspark_config import DSparkConfig


def _rope_freqs(c: DSparkConfig) -> mx.array | None:
    """Wavelengths for mx.fast.rope when only part of head_dim rotates (gemma4 "proportional":
    the first f*d/2 frequencies are theta^(-2i/d) over the full d, the rest are 0)."""
    if c.partial_rotary_factor >= 1.0:
        return None
    d = c.dim
    n_rot = int(c.partial_rotary_factor * d / 2)
    i = mx.arange(d // 2, dtype=mx.float32)
    wavelengths = mx.power(c.rope_theta, 2 * i / d)
    return mx.where(i < n_rot, wavelengths, mx.inf)


class DraftAttention(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.c = c
        H, nH, nKV, d = c.hidden_size, c.num_attention_heads, c.kv_heads, c.dim
        self.q_proj = nn.Linear(H, nH * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(H, nKV * d, bias=c.attention_bias)
        if not c.attention_k_eq_v:
            self.v_proj = nn.Linear(H, nKV * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(nH * d, H, bias=c.attention_bias)
        self.q_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        if c.attention_sink:
            self.attention_sink_bias = mx.zeros((nH,))
        self.scale = 1.0 if c.backbone == "gemma4" else d**-0.5
        self._freqs = _rope_freqs(c)

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        if self._freqs is not None:
            return mx.fast.rope(x, self.c.dim, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)
        return mx.fast.rope(x, self.c.dim, traditional=self.c.rope_interleaved, base=self.c.rope_theta, scale=1.0, offset=offset)

    def kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Keys (normed, roped at absolute positions from `offset`) and values for rows x (B, L, H)."""
        B, L, _ = x.shape
        k_raw = self.k_proj(x).reshape(B, L, self.c.kv_heads, -1)
        k = self._rope(self.k_norm(k_raw).transpose(0, 2, 1, 3), offset)
        if self.c.backbone == "gemma4":
            # gemma4 values: a weightless RMSNorm of k_proj (k_eq_v) or v_proj, never roped.
            v_src = k_raw if self.c.attention_k_eq_v else self.v_proj(x).reshape(B, L, self.c.kv_heads, -1)
            v = mx.fast.rms_norm(v_src, None, self.c.rms_norm_eps)
        else:
            v = self.v_proj(x).reshape(B, L, self.c.kv_heads, -1)
        return k, v.transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, cache: BucketedKVCache, offset: int, mask: mx.array) -> mx.array:
        B, L, _ = x.shape
        q = self._rope(self.q_norm(self.q_proj(x).reshape(B, L, self.c.num_attention_heads, -1)).transpose(0, 2, 1, 3), offset)
        k, v = self.kv(x, offset)
        keys, values = cache.update_and_fetch(k, v)  # the block is appended, trimmed after the pass
        sinks = self.attention_sink_bias if self.c.attention_sink else None
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask, sinks=sinks)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act = nn.silu if c.backbone == "qwen3" else nn.gelu_approx

    def __call__(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """qwen3: pre-norm residual blocks. gemma4: sandwich norms and a per-layer scalar."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.gemma = c.backbone == "gemma4"
        self.self_attn = DraftAttention(c)
        self.mlp = MLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if self.gemma:
            self.pre_feedforward_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.post_feedforward_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.layer_scalar = mx.ones((1,))

    def __call__(self, x, cache, offset, mask):
        if self.gemma:
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache, offset, mask))
            h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
            return h * self.layer_scalar
        h = x + self.self_attn(self.input_layernorm(x), cache, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)  # indexed by target ids
        self.markov_w2 = nn.Linear(c.markov_rank, c.out_vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        extra = c.markov_rank if (c.confidence_head_with_markov and c.markov_rank) else 0
        self.proj = nn.Linear(c.hidden_size + extra, 1, bias=True)


class DSparkHead(nn.Module):
    def __init__(self, c: DSparkConfig, target_hidden: int):
        super().__init__()
        self.config = c
        if c.has_embed_tokens:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(len(c.target_layer_ids) * target_hidden, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [DraftLayer(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.has_lm_head:
            self.lm_head = nn.Linear(c.hidden_size, c.out_vocab, bias=False)
        if c.markov_rank:
            self.markov_head = MarkovHead(c)
        if c.enable_confidence_head:
            self.confidence_head = ConfidenceHead(c)
        if c.draft_vocab_size:
            self.d2t = mx.zeros((c.out_vocab,), dtype=mx.int32)


def _token_array(token: int | mx.array) -> mx.array:
    """A token id as a (1,) uint32 array: a host int (the plain loop) or a lazy device value
    (the pipelined loop, which never reads it)."""
    if isinstance(token, mx.array):
        return token.reshape(1).astype(mx.uint32)
    return mx.array([token], dtype=mx.uint32)


@dataclass
class BlockOut:
    tokens: mx.array  # (cap,) target token ids, lazy
    probs: mx.array | None  # (cap, vocab) drafter distribution at temperature > 0
    survival: mx.array | None  # (cap,) confidence-head probabilities


class ContextDrafter:
    """What every head drafter shares: the target's embeddings and lm_head it is bound to, and
    its context cache of the target's fused tapped rows, one position per committed token."""

    kind = ""

    def __init__(self, head, embed, lm_head, *, window: int = 4096, name: str = ""):
        self.head, self.config = head, head.config
        self.embed, self.lm_head = embed, lm_head
        self.window, self.name = window, name
        self.caches: list[BucketedKVCache] = []
        self.ctx_len = 0
        self.cache_writer = None  # use_kernels_of: the target's writer in the pipelined loops
        self.attention_route = None  # use_kernels_of: the target's attention route (compiled.AttentionRoute)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.config.target_layer_ids)

    def reset(self) -> None:
        self.caches = [BucketedKVCache() for _ in self.head.layers]
        self.ctx_len = 0

    def drop_traces(self) -> None:
        """Forget compiled traces (none here): after the target's products change
        (Target.route_quantized_rows) a trace that called the target's lm_head would keep the old one."""

    def use_kernels_of(self, target) -> None:
        """Take the target's launch-saving kernels for what the pipelined loops run at an array
        position (the loops hand them over each generation): its cache writer for the rows
        append_context_at and the block write (one kernel a layer where MLX's dynamic slice updates
        launch four, engine/cache_kernels.py), and its attention route for the block's attention
        where the route takes the block's width (DSparkDrafter.hidden). None: MLX's operations. A
        compiled draft trace holds what it was traced with, so traces are dropped when they change."""
        kernels = (target.cache_writer, target.attention_route)
        if kernels[0] is not self.cache_writer or kernels[1] is not self.attention_route:
            self.cache_writer, self.attention_route = kernels
            self.drop_traces()

    def fuse(self, taps: dict[int, mx.array]) -> mx.array:
        """(rows, T*H_target) -> (rows, H): the fused context rows."""
        cat = mx.concatenate([taps[t] for t in self.config.target_layer_ids], axis=-1)
        return self.head.hidden_norm(self.head.fc(cat))

    def append_context(self, taps: dict[int, mx.array]) -> None:
        """Project the target's tapped rows for the next positions into every layer's cache."""
        ctx = self.fuse(taps)[None]
        for layer, cache in zip(self.head.layers, self.caches):
            k, v = layer.self_attn.kv(ctx, self.ctx_len)
            cache.update_and_fetch(k, v)
        self.ctx_len += ctx.shape[1]

    def ensure_capacity(self, size: int) -> None:
        """Grow every layer's context buffer to hold `size` positions (for the *_at methods)."""
        for cache in self.caches:
            cache.ensure(size)

    def append_context_at(self, taps: dict[int, mx.array], at: mx.array) -> None:
        """`append_context` at a context length the host need not know (`at`, an int32 array,
        possibly lazy): the rows' keys and values are written there; the host's ctx_len is left
        alone. Rows past the true context end are hidden by later masks and overwritten.
        The buffers must already hold them (ensure_capacity)."""
        ctx = self.fuse(taps)[None]
        for layer, cache in zip(self.head.layers, self.caches):
            k, v = layer.self_attn.kv(ctx, at)
            traced = ArrayOffsetKV(cache.keys, cache.values, at, self.cache_writer)
            traced.update_and_fetch(k, v)
            cache.keys, cache.values = traced.keys, traced.values

    def catch_up_at(self, taps: dict[int, mx.array] | None, taps_at: mx.array | None, pending: mx.array, at: mx.array) -> None:
        """A pipelined round of cap 0: take the previous round's tapped rows (if any), draft nothing."""
        if taps is not None:
            self.append_context_at(taps, taps_at)

    def _positions(self, width: int, at: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """Query and key positions of a block of `width` rows over the keys the cache hands
        attention (padded to a bucket when width > 1; the whole buffer when the block sits at
        an array position `at`), and what every row may see before any causal rule: the last
        `window` context rows and the block."""
        start = self.ctx_len if at is None else at
        need = start + width
        q = start + mx.arange(width)[:, None]
        if at is None:
            k = mx.arange(need if width == 1 else bucketed(need))[None]
        else:
            k = mx.arange(self.caches[0].keys.shape[2])[None]
        return q, k, (k < need) & (k >= start - self.window)


class DSparkDrafter(ContextDrafter):
    """A loaded DSpark head bound to its target: owns the context cache and drafts blocks.

    `embed` and `lm_head` are the head's own or the target's (bound at load when the head
    ships none)."""

    kind = "dspark"

    def __init__(self, head: DSparkHead, embed, lm_head, *, window: int = 4096, name: str = ""):
        super().__init__(head, embed, lm_head, window=window, name=name)
        self._embed_scale = math.sqrt(self.config.hidden_size) if self.config.backbone == "gemma4" else 1.0
        self._compiled_steps: dict[tuple, object] = {}

    def drop_traces(self) -> None:
        self._compiled_steps.clear()

    def _mask(self, width: int, at: mx.array | None = None) -> mx.array:
        """Which keys each block row sees: the windowed context and the block (all of it, or
        up to itself for causal heads, within their sliding window if any)."""
        c = self.config
        q_pos, k_pos, visible = self._positions(width, at)
        if c.causal:
            visible = visible & (k_pos <= q_pos)
            if c.sliding_window:
                visible = visible & (k_pos > q_pos - c.sliding_window)
        return visible

    def hidden(self, pending: int | mx.array, width: int, at: mx.array | None = None) -> mx.array:
        """Final-norm hidden states (width, H) of the block [pending] + masks, placed after the
        context (at `at` when the context length is an array: see append_context_at)."""
        c = self.config
        ids = mx.concatenate([_token_array(pending), mx.full((width - 1,), c.mask_token_id, dtype=mx.uint32)])
        h = self.embed(ids[None])
        if self._embed_scale != 1.0:
            h = h * self._embed_scale
        mask = self._mask(width, at)
        if at is None:
            for layer, cache in zip(self.head.layers, self.caches):
                h = layer(h, cache, self.ctx_len, mask)
            for cache in self.caches:
                cache.trim(width)  # the block never stays in the context
        else:
            # The block's rows are written at `at` and simply overwritten by the next append.
            with self._block_attention(mask, width, at):
                for layer, cache in zip(self.head.layers, self.caches):
                    h = layer(h, ArrayOffsetKV(cache.keys, cache.values, at, self.cache_writer), at, mask)
        return self.head.norm(h)[0]

    def _block_attention(self, mask: mx.array, width: int, at: mx.array):
        """The block's attention through the target's route where its mask is the tree kernel's
        with every row seeing every other: a head that is not causal, whose window cannot bind
        (the buffers, which hold `at` + width, no longer than it). Else MLX's, as before."""
        from ..compiled import BlockAttentionRouted

        fits = not self.config.causal and self.caches[0].keys.shape[2] <= self.window
        return BlockAttentionRouted(self.attention_route if fits else None, mask, at, width)

    def vocab_logits(self, h: mx.array) -> mx.array:
        """Block rows' hidden states -> draft logits: the bound lm_head and the head's soft cap
        (the Markov term, added slot by slot, is the caller's; lab/block_accept.py adds it too)."""
        c = self.config
        logits = self.lm_head(h)
        if c.final_logit_softcapping:
            logits = mx.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def draft(self, pending: int | mx.array, cap: int, params, at: mx.array | None = None) -> BlockOut:
        """Up to `cap` draft tokens after `pending` (lazy: nothing is read on the host); `at`:
        the context length as an array (the pipelined loop), None for the host's ctx_len."""
        from ..sampling import target_probs

        c = self.config
        cap = min(cap, c.max_drafts)
        width = c.block_size if not c.causal else c.logits_start + cap
        h = self.hidden(pending, width, at)[c.logits_start : c.logits_start + cap]
        logits = self.vocab_logits(h)
        markov = getattr(self.head, "markov_head", None)
        conf = getattr(self.head, "confidence_head", None)
        prev = _token_array(pending)
        tokens, probs, prevs = [], [], []
        if markov is None and params.greedy and cap:
            # No slot depends on the token drafted before it: one argmax over the block's rows (the
            # same tokens as slot by slot; a pipelined round launches one kernel, not cap of them).
            tokens.append(self._to_target_ids(mx.argmax(logits, axis=-1).astype(mx.uint32)))
        for k in range(0 if tokens else cap):
            row = logits[k]
            if markov is not None:
                prevs.append(markov.markov_w1(prev))
                row = row + markov.markov_w2(prevs[-1])[0]
            if params.greedy:
                tok = mx.argmax(row, axis=-1, keepdims=True)
            else:
                q = target_probs(row[None], params)
                tok = mx.random.categorical(mx.log(q), axis=-1)
                probs.append(self._to_target_vocab(q))
            tok = self._to_target_ids(tok.astype(mx.uint32))
            tokens.append(tok)
            prev = tok
        survival = None
        if conf is not None and cap:
            feats = h if not (c.confidence_head_with_markov and prevs) else mx.concatenate([h, mx.concatenate(prevs, axis=0)], axis=-1)
            survival = mx.sigmoid(conf.proj(feats)[:, 0])
        tokens_arr = mx.concatenate(tokens) if tokens else mx.zeros((0,), dtype=mx.uint32)
        return BlockOut(tokens_arr, mx.concatenate(probs, axis=0) if probs else None, survival)

    def draft_top(self, pending: int | mx.array, cap: int, k: int, at: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """The head's k best candidates at each of `cap` draft positions after `pending`, best first,
        with their log-probabilities: (cap, k) target ids and (cap, k) float32, lazy. For tree drafts
        (engine/tree.py), which need a head without a Markov term: then a position's candidates do
        not depend on the tokens drafted before it. `at`: the context length as an array (the
        pipelined tree loop), None for the host's ctx_len."""
        c = self.config
        cap = min(cap, c.max_drafts)
        h = self.hidden(pending, c.block_size, at)[c.logits_start : c.logits_start + cap]
        top, logp = top_k_logprobs(self.vocab_logits(h), k)
        return self._to_target_ids(top.astype(mx.uint32)), logp

    def draft_step_at(self, rows: dict[int, mx.array] | None, rows_at: mx.array | None, pending: mx.array, cap: int,
                      params, at: mx.array, *, compiled: bool = False) -> BlockOut:
        """The pipelined loop's drafting: `append_context_at(rows, rows_at)` (the previous
        round's tapped rows, if any), then `draft(pending, cap, params, at=at)`.

        `compiled` (greedy only) runs both as one `mx.compile` trace, replayed each round: the
        elementwise chains of the context append, the head's layer and the Markov chain fuse
        into fewer kernels, which is what a launch-bound GPU round pays for (the verify forward
        gained 1.1-1.3x that way on the H200). The trace takes the context buffers and
        positions as inputs, so it is traced once per (cap, buffer size) and gives the same
        tokens as the uncompiled steps (tests/test_pipeline.py). Sampling runs uncompiled: its
        random draws would have to be threaded through the trace."""
        if not (compiled and params.greedy):
            if rows is not None:
                self.append_context_at(rows, rows_at)
            return self.draft(pending, cap, params, at=at)
        (tokens,) = self._step_at(("chain", cap), rows, rows_at, pending, at,
                                  lambda p, a: (self.draft(p, cap, params, at=a).tokens,))
        return BlockOut(tokens, None, None)

    def draft_top_at(self, rows: dict[int, mx.array] | None, rows_at: mx.array | None, pending: mx.array, cap: int, k: int,
                     at: mx.array, *, compiled: bool = False, then=None, then_key: tuple = ()) -> tuple:
        """The pipelined tree loop's drafting: `append_context_at(rows, rows_at)`, then the head's
        k best candidates at each of `cap` positions after `pending`, the block placed at `at`
        (draft_top's result, lazy). `then(pending, top, logp)`, if given, is applied to them and its
        tuple returned instead: the tree's choice (tree_pipeline.DeviceTree.choose), so that it
        joins the same trace. `compiled`: one trace per round, as draft_step_at, kept per
        `then_key`, which must name everything `then` depends on."""
        def draw(p, a):
            top, logp = self.draft_top(p, cap, k, at=a)
            return (top, logp) if then is None else tuple(then(p, top, logp))

        if not compiled:
            if rows is not None:
                self.append_context_at(rows, rows_at)
            return draw(pending, at)
        return self._step_at(("top", cap, k, then is not None, then_key), rows, rows_at, pending, at, draw)

    def _step_at(self, key: tuple, rows: dict[int, mx.array] | None, rows_at: mx.array | None, pending: mx.array,
                 at: mx.array, draw) -> tuple:
        """`append_context_at(rows, rows_at)` then `draw(pending, at)` (-> a tuple of arrays) as one
        compiled trace, kept per `key` (which must name everything `draw` depends on) and taps."""
        taps = tuple(sorted(rows)) if rows is not None else ()
        key = (key, taps)
        if key not in self._compiled_steps:

            def step(keys, values, pending, at, rows_at, row_arrays):
                for cache, k, v in zip(self.caches, keys, values):
                    cache.keys, cache.values = k, v
                if taps:
                    self.append_context_at(dict(zip(taps, row_arrays)), rows_at)
                return list(draw(pending, at)), [c.keys for c in self.caches], [c.values for c in self.caches]

            self._compiled_steps[key] = mx.compile(step)
        no_rows = mx.array(0, dtype=mx.int32)
        out, keys, values = self._compiled_steps[key](
            [c.keys for c in self.caches], [c.values for c in self.caches], pending, at,
            rows_at if rows is not None else no_rows, [rows[t] for t in taps])
        for cache, k, v in zip(self.caches, keys, values):
            cache.keys, cache.values = k, v
        return tuple(out)

    def _to_target_ids(self, tok: mx.array) -> mx.array:
        if self.config.draft_vocab_size:
            return (tok.astype(mx.int32) + self.head.d2t[tok]).astype(mx.uint32)
        return tok

    def _to_target_vocab(self, q: mx.array) -> mx.array:
        """Spread a draft-vocab distribution over the full target vocabulary."""
        if not self.config.draft_vocab_size:
            return q
        ids = mx.arange(self.config.out_vocab) + self.head.d2t
        full = mx.zeros((q.shape[0], self.config.vocab_size), dtype=q.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(ids[None], q.shape).astype(mx.int32), q, axis=-1)
