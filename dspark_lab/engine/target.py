"""The target model as the speculative engine sees it: one forward that returns logits for the
positions asked for plus the residual stream after chosen layers (the "tap"), a cache factory
and a cache trim.

The tap is taken from the model's own forward, not from a re-implementation of each family:
every tapped decoder layer gets a subclass whose ``__call__`` records its output. What we do
re-implement is the head (final norm -> lm_head), so prefill can skip the vocabulary projection
for all but the last prompt row. A one-time probe at load checks both: the tapped forward must
reproduce the model's own logits, and the head applied to the last layer's tap must reproduce
them too (which proves the tapped value really is the residual stream). A family where either
fails is refused, naming its model_type.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import cache as cache_lib

from ..errors import InputError, LoadError
from .cache import BucketedKVCache, bucketed
from .compiled import MAX_WIDTH, OffsetForward, can_compile
from .sampling import SamplingParams
from .topk import top_k_indices

# Largest relative logit difference the probe accepts between the tapped forward and the
# model's own. Both run the same kernels on the same inputs, so on a healthy family the
# difference is 0 or rounding noise; 1e-3 of the logit scale leaves room for a reordered
# reduction in low precision and still catches a wrong tap or head (those are off by O(1)).
PROBE_RTOL = 1e-3

# A tree forward rotates its rows with per-row offsets and masks them with an array, so on a GPU
# in low precision it rounds differently from a plain forward even when it is right (an H100 in
# bfloat16: the 1.5B Qwen2's compiled tree 7.9e-3 from same-shape plain forwards, as much as the
# chain's own rounding there). check_tree_forward holds it to TREE_NOISE_FACTOR times the
# rounding the chain itself lives with on the same machine (its tokens fed one row at a time, as
# greedy decoding feeds them, against one forward, as the chain's verify does: chain_rounding),
# at least PROBE_RTOL and never above TREE_RTOL_CEILING: a tree fed at wrong depths or with a
# wrong mask is off by O(0.1-1).
TREE_NOISE_FACTOR = 4.0
TREE_RTOL_CEILING = 5e-2

# Prompt rows per prefill forward: bounds activation memory on long prompts (as mlx-lm does).
PREFILL_CHUNK = 2048

# Tap id for the embedding output (the input of layer 0), as DSpark's target_layer_ids write it.
EMBED_TAP = -1

_TAPPED_CLASSES: dict[type, type] = {}


class _TapRecorder:
    """Where tapped layers drop their outputs during one forward. A plain object (not a list
    or dict) so that MLX's Module does not adopt it into the parameter tree."""

    def __init__(self) -> None:
        self.wanted: frozenset[int] = frozenset()
        self.outputs: dict[int, mx.array] = {}
        self.launch_every = 0  # > 0: start evaluating every this many layers (Target.launch_every)
        self.positions: mx.array | None = None  # a tree forward's per-row positions (Target.forward_tree)


def _tapped_class(cls: type) -> type:
    """A subclass of a decoder-layer class whose call also records its output."""
    if cls not in _TAPPED_CLASSES:

        def __call__(self, *args, **kwargs):
            rec = self._dspark_recorder
            if self._dspark_index == 0 and EMBED_TAP in rec.wanted:
                rec.outputs[EMBED_TAP] = args[0]  # the embedding output, as layer 0 receives it
            out = cls.__call__(self, *args, **kwargs)
            # mlx-vlm's Gemma 4 layers return (hidden, shared_kv, offset): the hidden comes first.
            hidden = out[0] if isinstance(out, tuple) else out
            if self._dspark_index in rec.wanted:
                rec.outputs[self._dspark_index] = hidden
            if rec.launch_every and (self._dspark_index + 1) % rec.launch_every == 0:
                mx.async_eval(hidden)
            return out

        _TAPPED_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _TAPPED_CLASSES[cls]


_TREE_ROPE_CLASSES: dict[type, type] = {}


def _tree_rope_class(cls: type) -> type:
    """A subclass of a rotary-embedding class that, during a tree forward, rotates each row at
    its own position (its depth in the tree) instead of at consecutive ones: the rows are made the
    batch, whose offsets MLX's rope takes one per entry, so each row gets exactly the rotation a
    plain forward gives the same token at that position."""
    if cls not in _TREE_ROPE_CLASSES:

        def __call__(self, x, offset=0):
            positions = self._dspark_recorder.positions
            if positions is None:
                return cls.__call__(self, x, offset=offset)
            return cls.__call__(self, x.swapaxes(0, 2), offset=positions).swapaxes(0, 2)  # (1, H, n, D) <-> (n, H, 1, D)

        _TREE_ROPE_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _TREE_ROPE_CLASSES[cls]


class TreeKV:
    """A layer's BucketedKVCache during a tree forward: the rows are written after the cache as
    usual, and attention gets the tree's mask (the cache, then each row's ancestors and itself)."""

    def __init__(self, cache: BucketedKVCache, mask: mx.array):
        self.cache, self.mask = cache, mask

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self.cache.update_and_fetch(keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise InputError("tree drafts do not support sliding-window attention. Leave tree_nodes at 0 for this model.")
        return self.mask


# Names mlx-lm's families use for the decoder stack, its embedding and its final norm.
_INNER_NAMES = ("model", "backbone")
_EMBED_NAMES = ("embed_tokens", "embeddings", "wte")
_NORM_NAMES = ("norm", "norm_f", "final_norm", "final_layernorm", "embedding_norm")


def _inner_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, Any, float | None]:
    """The decoder stack (embedding -> layers -> final norm), its embedding and final norm,
    the vocabulary projection and the logit softcap of an mlx-lm causal LM."""
    if "language_model" in model and not any(n in model for n in _INNER_NAMES):
        model = model.language_model
    inner = next((model[n] for n in _INNER_NAMES if n in model), None)
    embed = next((inner[n] for n in _EMBED_NAMES if n in inner), None) if inner is not None else None
    norm = next((inner[n] for n in _NORM_NAMES if n in inner), None) if inner is not None else None
    if inner is None or embed is None or norm is None or "layers" not in inner:
        raise LoadError(
            f"model_type {getattr(model, 'model_type', '?')!r} does not have a decoder layout dspark-lab can tap "
            "(an embedding, a list of layers and a final norm); this family needs dedicated support. Use --mode baseline."
        )
    head = model.lm_head if "lm_head" in model else embed.as_linear
    # mlx-lm keeps it in model.args; mlx-vlm's language models (those that apply it) as an attribute.
    softcap = getattr(model, "final_logit_softcapping", None)
    if softcap is None:
        args = getattr(model, "args", None)
        softcap = getattr(args, "final_logit_softcapping", None) if args is not None else None
    return inner, embed, norm, head, softcap


def _trimmable_cache_types() -> tuple[type, ...]:
    """KV cache classes that drop their newest rows exactly: mlx-lm's, and mlx-vlm's when a
    model loaded through it (mlx-vlm's language models build their own cache classes)."""
    types: tuple[type, ...] = (cache_lib.KVCache, cache_lib.QuantizedKVCache)
    if "mlx_vlm.models.cache" in sys.modules:
        vlm_cache = sys.modules["mlx_vlm.models.cache"]
        types += (vlm_cache.KVCache, vlm_cache.QuantizedKVCache)
    return types


def _snapshot(obj):
    """A copy of a cache state that later in-place updates cannot reach: arrays are sliced
    (a new node), lists and tuples rebuilt; everything else is immutable."""
    if isinstance(obj, mx.array):
        return obj[...]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(x) for x in obj)
    return obj


def _relative_difference(got: mx.array, ref: mx.array) -> float:
    """The largest logit difference over the reference's logit scale (at least 1): what the
    load-time checks hold to PROBE_RTOL (NaN where either has one, which fails the check)."""
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return (mx.abs(got - ref).max() / mx.maximum(mx.abs(ref).max(), 1.0)).item()


@dataclass
class ForwardOut:
    """Logits for the rows asked for, shape (rows, vocab); taps: layer id -> (rows, hidden)."""

    logits: mx.array
    taps: dict[int, mx.array] = field(default_factory=dict)


class Target:
    """A loaded causal LM ready for speculative decoding.

    `forward(ids, cache, taps=(...))` feeds token ids (1-D) through the model, appending them to
    `cache`, and returns logits for every fed position (or only the last with `last_only`)
    plus the residual stream after each tapped layer. `trim(cache, n)` drops the newest n
    positions (a rejected draft)."""

    def __init__(self, model: nn.Module, config: dict, *, name: str = "", kv_bits: int | None = None):
        self.model = model
        self.config = config
        self.name = name
        self.kv_bits = kv_bits
        self.model_type = config.get("model_type", getattr(model, "model_type", "?"))
        self._inner, self._embed, self._norm, self._head, self._softcap = _inner_and_head(model)
        self.layers = self._inner.layers
        self.num_layers = len(self.layers)
        self.vocab_size = int(self._embed.weight.shape[0])
        self.hidden_size = int(config.get("hidden_size") or self._embed.weight.shape[1])
        self.head_dim = int(config.get("head_dim") or self.hidden_size // config.get("num_attention_heads", 1))
        # KV quantization groups run along head_dim: the largest group size mlx supports that divides it.
        self.kv_group_size = next((g for g in (64, 32) if self.head_dim % g == 0), None)
        if kv_bits is not None and self.kv_group_size is None:
            raise LoadError(f"kv_bits needs a head_dim divisible by 32; {self.model_type} has head_dim {self.head_dim}. Leave kv_bits unset for this model.")
        self._recorder = _TapRecorder()
        for i, layer in enumerate(self.layers):
            layer.__class__ = _tapped_class(type(layer))
            layer._dspark_recorder = self._recorder
            layer._dspark_index = i
        self.probed = False
        self._offset_checked: float | None = None  # check_offset_forward's result, once per model
        self._tree_checked: dict[bool, float] = {}  # check_tree_forward's result per tree_compiled, once per model
        self._tree_ropes: list = []  # the rope modules forward_tree rotates per row (installed at its first call)
        # forward_tree through a compiled trace (the pipelined verify's gain on the H200); off: op by op.
        self.tree_compiled = True
        self.trims_only = True  # set by make_cache
        self._compiled = False  # Target.compiled
        # forward_at: compiled for decode widths (measured faster in the pipelined loop), plain beyond.
        self._drop_offset_traces()
        self.rows_routed = False  # route_quantized_rows
        self.attention_route = None  # route_attention: compiled.AttentionRoute or None
        self.tree_path_mover = None  # move_tree_paths_with: cache_kernels.cache_move_kernel() or None
        self.cache_writer = None  # write_cache_with: cache_kernels.cache_write_kernel() or None
        self._routing = None  # (matmul, policy) while routed: check_offset_forward puts it back after its check

    @property
    def compiled(self) -> bool:
        """Whether decode-width forwards (up to compiled.MAX_WIDTH rows, after prefill) replay a
        compiled trace of the model (engine/compiled.py) instead of building the graph op by op.
        Families whose caches are not plain KV caches, and forwards with launch_every set, keep
        the uncompiled path. Off by default: on the H200 it made plain decoding 8-18% slower
        (the traced step attends over the whole buffer with a mask, where the plain width-1 step
        attends to an exact slice); the pipelined loop compiles its own verify regardless."""
        return self._compiled

    @compiled.setter
    def compiled(self, on: bool) -> None:
        self._compiled = bool(on)

    @property
    def launch_every(self) -> int:
        """0, or N: while a forward's graph is being built, hand the device the first N layers,
        then the next N, ... as soon as they are built (mx.async_eval), so the device computes
        while the host builds the rest. Plain decoding already overlaps a step's building with
        the previous step's computing; a speculative round cannot (it must read the verdict
        before it builds the next draft), so there the host's building time otherwise adds to
        the device's. The same operations run either way: outputs are bit-identical."""
        return self._recorder.launch_every

    @launch_every.setter
    def launch_every(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"launch_every must be >= 0, got {n}")
        self._recorder.launch_every = int(n)

    def _drop_offset_traces(self) -> None:
        """Fresh forward_at paths, no traces kept: keyed by "width <= MAX_WIDTH"; the compiled one
        also serves Target.compiled, one trace each. Routing a product or attention drops the old
        ones (a trace keeps what it traced)."""
        self._at_offset = {True: OffsetForward(self, compile=True), False: OffsetForward(self, compile=False)}

    def route_quantized_rows(self, matmul, *, policy=None) -> int:
        """Send the model's quantized layers (and a tied vocabulary projection) through `matmul`
        where `policy(rows, weights)` says so (default rows_kernel.worth_routing: the widths where
        MLX's kernel reads the weights again for every row, e.g. a draft's vocabulary projection;
        engine/rows_kernel.py's kernel reads them once); `None` puts MLX's own kernels back.
        Returns how many layers changed. The target's compiled traces are dropped (they would keep
        the old product); a drafter bound to the target that already drafted must drop its own
        (drafter.drop_traces())."""
        from .rows_kernel import route_quantized_rows, unroute_quantized_rows

        changed = unroute_quantized_rows(self.model)
        self._routing = None if matmul is None else (matmul, policy)
        if matmul is not None:
            changed = route_quantized_rows(self.model, matmul, **({} if policy is None else {"policy": policy}))
        self._head = _inner_and_head(self.model)[3]  # a tied projection is a bound as_linear: bind it again
        self._drop_offset_traces()
        self.rows_routed = matmul is not None and changed > 0
        return changed

    def fuse_projections(self) -> int:
        """Compute each layer's query, key and value projections as one product, and its MLP's gate
        and up projections as one (engine/fused.py): the same outputs bit for bit on MLX's kernels,
        about 5 fewer operations a layer for a step that launches one per operation. Returns how
        many groups were stacked (0 when already fused). Compiled traces are dropped, and routed
        products routed again over the stacked layers."""
        from .fused import fuse_projections

        routing = self._routing
        if routing is not None:
            self.route_quantized_rows(None)
        # The decoder layers only: a multimodal checkpoint's vision tower (never run here) may call
        # its projections on different inputs, where a stacked product would be computed thrice.
        groups = sum(fuse_projections(layer) for layer in self.layers)
        if routing is not None:
            self.route_quantized_rows(routing[0], policy=routing[1])
        self._drop_offset_traces()
        return groups

    def route_attention(self, kernel, *, policy=None) -> None:
        """Send the array-offset forwards' attention (forward_at: the pipelined loops' verify, a
        draft model's steps in draft-pipe) through `kernel(q, k, v, offset, scale)` (a tree's rows:
        `kernel(..., ancestors=)`, engine/attention_kernel.py's contract) at the widths
        `policy(rows)` takes (default: one row, where MLX's attention over a masked buffer is its
        unfused fallback: 4.2x slower than engine/attention_kernel.py's on an H100, docs/performance.md,
        thirty-ninth round); `None` puts MLX's back. Compiled traces are dropped (they would keep the
        old attention)."""
        from .compiled import AttentionRoute

        self.attention_route = None if kernel is None else AttentionRoute(kernel, policy or (lambda rows: rows == 1))
        self._drop_offset_traces()

    def move_tree_paths_with(self, mover) -> None:
        """Move a pipelined tree round's kept path in the cache with `mover(arrays, offset, path)`
        (engine/cache_kernels.py: one kernel for every layer's keys and values, where MLX's operations
        launch about eight a layer); `None` puts MLX's operations back. Compiled traces are dropped."""
        self.tree_path_mover = mover
        self._drop_offset_traces()

    def use_launch_kernels(self, kernels: tuple | None) -> None:
        """The pipelined loops' launch-saving kernels at once: `kernels` = (attention, writer, mover)
        (lab/kernel_probe.launch_kernels() builds CUDA's), or None for MLX's operations throughout.
        The attention then takes the array-offset forwards at every width it supports (a tree's
        with its ancestors), the writer every layer's new rows, the mover a tree round's kept path:
        benchmarks/launch_cuts.py, docs/performance.md, forty-ninth round."""
        attention, writer, mover = kernels or (None, None, None)
        self.route_attention(attention, policy=lambda rows: True)
        self.write_cache_with(writer)
        self.move_tree_paths_with(mover)

    def _custom_kernels_set(self) -> bool:
        """Whether an attention route, cache writer or tree mover stands in for MLX's operations."""
        return any(x is not None for x in (self.attention_route, self.cache_writer, self.tree_path_mover))

    @contextmanager
    def on_mlx_operations(self):
        """Within: the array-offset forwards on MLX's own attention, writes and moves; after: the
        route, writer and mover exactly as they were (compiled traces dropped both ways)."""
        saved = (self.attention_route, self.cache_writer, self.tree_path_mover)
        self.attention_route = self.cache_writer = self.tree_path_mover = None
        self._drop_offset_traces()
        try:
            yield
        finally:
            self.attention_route, self.cache_writer, self.tree_path_mover = saved
            self._drop_offset_traces()

    def write_cache_with(self, writer) -> None:
        """Write the array-offset forwards' new keys and values with `writer(keys, values, new_keys,
        new_values, offset)` (engine/cache_kernels.py: one kernel a layer, where MLX's dynamic slice
        updates launch four); `None` puts MLX's operations back. Compiled traces are dropped."""
        self.cache_writer = writer
        self._drop_offset_traces()

    # --- cache -------------------------------------------------------------------------------
    def make_cache(self) -> list:
        """A fresh cache: mlx-lm's, with plain KV caches made bucketed (see cache.py) so
        multi-token verify forwards do not meet a new attention shape every round; with
        `kv_bits` set, a quantized KV cache (trimmable like the plain one)."""
        cache = cache_lib.make_prompt_cache(self.model)
        cache = [BucketedKVCache() if type(c) is cache_lib.KVCache else c for c in cache]
        # Whether rejected rows can simply be trimmed; fixed per model, so decided once here,
        # not in every round's checkpoint.
        self.trims_only = all(self._rewinds_by_trim(c) for c in cache)
        if self.kv_bits is not None:
            cache = [c.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits) if hasattr(c, "to_quantized") else c for c in cache]
        return cache

    @staticmethod
    def cache_len(cache: list) -> int:
        return cache[0].offset

    # --- rollback ------------------------------------------------------------------------------
    @staticmethod
    def _rewinds_by_trim(c) -> bool:
        # Plain and quantized KV caches drop their newest rows exactly. Recurrent states
        # (ArraysCache: gated delta, Mamba, short convolutions) and rotating sliding-window
        # caches cannot: their old values are gone once newer tokens are folded in.
        return isinstance(c, _trimmable_cache_types())

    def checkpoint(self, cache: list):
        """Before a verify forward: what rewinding needs (None when every cache just trims).
        Arrays are sliced copies: MLX updates caches in place, so a bare reference would follow."""
        if self.trims_only:
            return None
        snap = []
        for c in cache:
            if self._rewinds_by_trim(c):
                snap.append(None)
            else:
                snap.append((_snapshot(c.state), getattr(c, "meta_state", None)))
        return snap

    def rewind(self, cache: list, snap, fed: mx.array, keep: int) -> None:
        """After a verify forward of `fed` rows, leave the cache holding only the first `keep`:
        trim where caches trim; otherwise restore the pre-round state and feed the kept rows
        again, so recurrent state equals that of plain decoding of the same tokens."""
        drop = fed.shape[0] - keep
        if drop <= 0:
            return
        if snap is None:
            self.trim(cache, drop)
            return
        for c, saved in zip(cache, snap):
            if saved is None:
                c.trim(fed.shape[0])
            else:
                c.state = saved[0]
                if saved[1]:
                    c.meta_state = saved[1]
        if keep:
            self.forward(fed[:keep], cache, last_only=True)

    @staticmethod
    def trim(cache: list, n: int) -> None:
        """Drop the newest `n` positions from every layer's cache."""
        if n > 0:
            trimmed = cache_lib.trim_prompt_cache(cache, n)
            if trimmed != n:
                raise RuntimeError(f"cache trimmed {trimmed} positions instead of {n}")

    # --- pieces a drafter may bind -----------------------------------------------------------
    def embed(self, ids: mx.array) -> mx.array:
        return self._embed(ids)

    def head_logits(self, hidden: mx.array) -> mx.array:
        """The target's vocabulary projection on already-normed hidden states, without the
        target's softcap (a drafter applies the softcap its own config declares)."""
        return self._head(hidden)

    # --- forward -----------------------------------------------------------------------------
    def _logits(self, hidden: mx.array) -> mx.array:
        logits = self._head(hidden)
        if self._softcap:
            logits = mx.tanh(logits / self._softcap) * self._softcap
        return logits

    def forward(
        self,
        ids: mx.array | Sequence[int],
        cache: list,
        *,
        taps: Sequence[int] = (),
        last_only: bool = False,
    ) -> ForwardOut:
        """Feed `ids` (1-D), return logits (rows, vocab) and taps {layer: (rows, hidden)}.

        Long inputs are fed in chunks of PREFILL_CHUNK rows; taps are concatenated across
        chunks, logits too unless `last_only`. Nothing is evaluated here (MLX is lazy)."""
        ids = ids if isinstance(ids, mx.array) else mx.array(list(ids), dtype=mx.uint32)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("forward needs at least one token")
        if (self._compiled and n <= MAX_WIDTH and not self.launch_every and cache[0].keys is not None
                and can_compile(cache)):
            logits, tap_rows = self._at_offset[True](ids, cache, taps, last_only)
            return ForwardOut(logits, tap_rows)
        chunks = [(s, min(s + PREFILL_CHUNK, n)) for s in range(0, n, PREFILL_CHUNK)]
        logits_parts, tap_parts = [], {t: [] for t in taps}
        for k, (s, e) in enumerate(chunks):
            self._recorder.wanted = frozenset(taps)
            self._recorder.outputs = {}
            try:
                hidden = self._inner(ids[None, s:e], cache=cache)
            finally:
                outs, self._recorder.outputs = self._recorder.outputs, {}
                self._recorder.wanted = frozenset()
            for t in taps:
                tap_parts[t].append(outs[t][0])
            is_last = k == len(chunks) - 1
            if last_only:
                if is_last:
                    logits_parts.append(self._logits(hidden[0, -1:]))
            else:
                logits_parts.append(self._logits(hidden[0]))
            if not is_last:
                # Bound the lazy graph (and memory) between prefill chunks.
                mx.eval([c.state for c in cache] + [p for parts in tap_parts.values() for p in parts])
        cat = lambda parts: parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)  # noqa: E731
        return ForwardOut(cat(logits_parts), {t: cat(p) for t, p in tap_parts.items()})

    def check_offset_forward(self) -> float:
        """Once per model: `forward_at` must reproduce the plain forward, with stale rows past
        the write position (a rejected draft's) that its mask must hide. Returns the relative
        difference; raises LoadError naming the model_type when it exceeds PROBE_RTOL."""
        if self._offset_checked is not None:
            return self._offset_checked
        if self._custom_kernels_set():  # checked apart (lab/kernel_probe.py): the check runs MLX's operations
            with self.on_mlx_operations():
                return self.check_offset_forward()
        routing = self._routing
        if routing is not None:
            # What is checked is the position handling (mask, rotation, cache writes), so both
            # sides must multiply alike: routed products differ by width (rows_kernel.worth_routing),
            # so the check runs on MLX's own and the routing is put back after it.
            self.route_quantized_rows(None)
            try:
                return self.check_offset_forward()
            finally:
                self.route_quantized_rows(routing[0], policy=routing[1])
        ids = mx.array([(5 * i + 2) % self.vocab_size for i in range(12)], dtype=mx.uint32)
        ref_cache = self.make_cache()
        self.forward(ids[:8], ref_cache)
        ref = self.forward(ids[8:], ref_cache).logits
        cache = self.make_cache()
        self.forward(mx.concatenate([ids[:8], ids[:4]]), cache)  # rows 8-11 hold other tokens...
        self.trim(cache, 4)  # ...left behind as a rejected draft leaves them
        first = self.forward_at(ids[8:10], cache, mx.array(8, dtype=mx.int32), capacity=10).logits
        second = self.forward_at(ids[10:], cache, mx.array(10, dtype=mx.int32), capacity=12).logits
        err = _relative_difference(mx.concatenate([first, second]), ref)
        if not err <= PROBE_RTOL:
            raise LoadError(f"the offset-addressed forward does not reproduce model_type {self.model_type!r} "
                            f"(relative difference {err:.2e}, limit {PROBE_RTOL:.0e}); this family cannot run mode dspark-pipe. Use mode dspark.")
        self._offset_checked = err
        return err

    def can_pipeline(self, cache: list) -> bool:
        """Whether `forward_at` can serve this cache: plain KV caches only (engine/compiled.py)."""
        return can_compile(cache)

    def forward_at(self, ids: mx.array, cache: list, offset: mx.array, *, capacity: int, taps: Sequence[int] = ()) -> ForwardOut:
        """Feed `ids` at a position the host need not know (`offset`, an int32 array, may be a
        lazy result of the previous round): keys and values go to the cache's buffers there and
        attention sees only positions before each row. The host's cache offsets are not
        touched; `capacity` is a host-known upper bound on offset + len(ids), so the buffers
        can be grown ahead. Rows past the true end of a previous write are hidden by the mask
        and overwritten later, so nothing needs trimming. Decode widths run a compiled trace
        (engine/compiled.py): on the H200 that made pipelined rounds 1.1-1.3x faster, while
        compiling plain decoding's width-1 step made it slower (docs/performance.md)."""
        for c in cache:
            c.ensure(capacity)
        fwd = self._at_offset[ids.shape[0] <= MAX_WIDTH]
        logits, tap_rows = fwd.run(ids, cache, offset, taps)
        return ForwardOut(logits, tap_rows)

    # --- tree forward (engine/tree.py) ---------------------------------------------------------
    def _rope_modules(self) -> list:
        """Each layer's rotary-embedding modules (mlx-lm names them `rope`); LoadError where a
        layer has none (the family rotates elsewhere, or not at all)."""
        found = []
        for i, layer in enumerate(self.layers):
            ropes = [m for name, m in layer.named_modules() if name.split(".")[-1] == "rope"]
            if not ropes:
                raise LoadError(f"model_type {self.model_type!r} has no rope module in layer {i} that tree drafts can "
                                "place at each row's depth. Leave tree_nodes at 0 for this model.")
            found += ropes
        return found

    def forward_tree(self, ids: mx.array, depth: Sequence[int], ancestors: np.ndarray, cache: list, *,
                     taps: Sequence[int] = (), width: int | None = None) -> ForwardOut:
        """Feed a draft tree's rows `ids` (1-D, row 0 its root, every row after its parent) after the cache:
        row i sits at position cache_len + depth[i] and attends to the cache and to the rows j with
        ancestors[i, j] (its ancestors and itself). Returns logits and taps for every row; the
        cache then holds all the rows (keep_tree_path keeps one path of them). Plain bucketed KV
        caches only (check_tree_forward).

        With `tree_compiled` (the default) the forward replays one compiled trace per tree width
        and cache bucket (engine/compiled.py), its mask built on the device from `ancestors`;
        `width` pads the rows to that many (rows no real row sees) so trees of different sizes
        share one trace. Without it the graph is built op by op each round."""
        n = ids.shape[0]
        if n == 1:
            return self.forward(ids, cache, taps=taps)
        if not can_compile(cache):
            raise InputError(f"tree drafts need plain KV caches; model_type {self.model_type!r} keeps recurrent, rotating or "
                             "quantized cache state (or kv_bits is set). Leave tree_nodes at 0 for it.")
        self._install_tree_ropes()
        start = cache[0].offset
        if self.tree_compiled:
            w = max(n, width or n)
            visible = np.eye(w, dtype=bool)  # padding rows see themselves only, and no real row sees them
            visible[:n, :n] = ancestors
            padded = ids if w == n else mx.concatenate([ids, mx.zeros((w - n,), dtype=ids.dtype)])
            logits, tap_rows = self._at_offset[True].tree(padded, mx.array(list(depth) + [0] * (w - n), dtype=mx.int32),
                                                         mx.array(visible), cache, taps)
            for c in cache:
                c.offset = start + n  # the padding rows lie past the end: masked, then overwritten
            return ForwardOut(logits[:n], {t: r[:n] for t, r in tap_rows.items()})
        visible = np.zeros((n, bucketed(start + n)), dtype=bool)
        visible[:, :start] = True
        visible[:, start : start + n] = ancestors
        mask = mx.array(visible)
        rec = self._recorder
        rec.wanted, rec.outputs = frozenset(taps), {}
        rec.positions = mx.array([start + d for d in depth], dtype=mx.int32)
        try:
            hidden = self._inner(ids[None], cache=[TreeKV(c, mask) for c in cache])
        finally:
            outs, rec.outputs, rec.wanted, rec.positions = rec.outputs, {}, frozenset(), None
        return ForwardOut(self._logits(hidden[0]), {t: outs[t][0] for t in taps})

    def _install_tree_ropes(self) -> None:
        """Once per model: each layer's rope rotates a tree's rows at their depths (a subclass)."""
        if not self._tree_ropes:
            self._tree_ropes = self._rope_modules()
            for rope in self._tree_ropes:
                if type(rope) not in _TREE_ROPE_CLASSES.values():
                    rope.__class__ = _tree_rope_class(type(rope))
                rope._dspark_recorder = self._recorder

    def tree_round_at(self, ids: mx.array, depth: mx.array, ancestors: mx.array, parent: mx.array, cache: list,
                      offset: mx.array, *, capacity: int, max_depth: int, taps: Sequence[int] = (), allowed: mx.array | None = None,
                      sampling: SamplingParams | None = None):
        """The pipelined tree loop's verify (engine/tree_pipeline.py), compiled, nothing read on the
        host: feed the tree at `offset` (an array), keep in place the path the target accepts
        (greedy; with `sampling`, its sampled walk); rows not `allowed` (default: all are) are never
        accepted. -> (verdict [n, next, path tokens], path rows' taps): compiled.OffsetForward.tree_round."""
        self._install_tree_ropes()
        allowed = mx.ones(ids.shape, dtype=mx.bool_) if allowed is None else allowed
        return self._at_offset[True].tree_round(ids, depth, ancestors, parent, allowed, cache, offset, capacity=capacity,
                                                max_depth=max_depth, taps=taps, sampling=sampling)

    @staticmethod
    def keep_tree_path(cache: list, path: Sequence[int], rows: int) -> None:
        """After forward_tree of `rows` rows: keep the rows of `path` (ascending row numbers, the
        root first), moved to follow the cache in that order, and drop the others."""
        start = cache[0].offset - rows
        keep = len(path)
        if list(path) == list(range(keep)):  # already in place (a chain, or a rejected tree)
            Target.trim(cache, rows - keep)
            return
        src = mx.array([start + i for i in path])
        for c in cache:
            c.keys[..., start : start + keep, :] = c.keys[..., src, :]
            c.values[..., start : start + keep, :] = c.values[..., src, :]
            c.offset = start + keep

    def check_tree_forward(self) -> float:
        """Once per model: a tree forward must reproduce a plain forward of each of its paths (after
        the same prefix, as many rows), and a forward after keep_tree_path the plain forward after
        that path. Returns the relative difference; LoadError naming the model_type when it exceeds
        its limit (TREE_NOISE_FACTOR). Checks the path `tree_compiled` chooses (the compiled one
        with padding rows), once for each."""
        mode = self.tree_compiled
        if mode in self._tree_checked:
            return self._tree_checked[mode]
        if self._custom_kernels_set():
            # What is checked is the tree's positions and masks, against MLX's own operations on
            # both sides; the kernels have their own checks (lab/kernel_probe.py).
            with self.on_mlx_operations():
                return self.check_tree_forward()
        if not can_compile(self.make_cache()):
            raise InputError(f"tree drafts need plain KV caches; model_type {self.model_type!r} keeps recurrent, rotating or "
                             "quantized cache state. Leave tree_nodes at 0 for it.")
        v = self.vocab_size
        prefix = [(5 * i + 2) % v for i in range(8)]
        # root r; children a, b; a's child c; b's children d, e
        r, a, b, c, d, e, nxt = ((11 * i + 7) % v for i in range(7))
        from .tree import ancestor_matrix  # here: tree.py imports this module

        parent, depth = [-1, 0, 0, 1, 2, 2], [0, 1, 1, 2, 2, 2]
        anc = ancestor_matrix(parent)
        # Every reference feeds as many rows as the tree's forward (its path, then filler tokens that
        # causal attention keeps out of the path's rows), so both sides run the same matmul shapes:
        # on the H200, references fed as one forward of prefix and path (11-12 rows) differed from
        # the tree by 1.4e-2 in bfloat16 and 3.0e-3 in float32 (thirty-fifth round); at equal
        # shapes an H100 found the 0.5B Qwen2's trees 0.0 from them in bfloat16 (thirty-sixth).
        # What is checked here is the tree's mask and rotation.
        rows = 9 if self.tree_compiled else 6
        cache = self.make_cache()
        self.forward(mx.array(prefix, dtype=mx.uint32), cache)
        got = self.forward_tree(mx.array([r, a, b, c, d, e], dtype=mx.uint32), depth, anc, cache, width=rows).logits
        self.keep_tree_path(cache, [0, 1, 3], 6)
        after = self.forward(mx.array([nxt], dtype=mx.uint32), cache).logits

        def reference(path: list[int], then: int | None = None) -> mx.array:
            ref = self.make_cache()
            self.forward(mx.array(prefix, dtype=mx.uint32), ref)
            filler = [(prefix[0] + 1) % v] * (rows - len(path))
            out = self.forward(mx.array(path + filler, dtype=mx.uint32), ref).logits[: len(path)]
            if then is None:
                return out
            self.trim(ref, len(filler))
            return self.forward(mx.array([then], dtype=mx.uint32), ref).logits

        ref_rac, ref_rb = reference([r, a, c]), reference([r, b])
        ref_d, ref_e, ref_after = reference([r, b, d]), reference([r, b, e]), reference([r, a, c], then=nxt)
        want = mx.stack([ref_rac[0], ref_rac[1], ref_rb[1], ref_rac[2], ref_d[2], ref_e[2], ref_after[0]])
        err = _relative_difference(mx.concatenate([got, after]), want)
        noise = self.chain_rounding(prefix + [r, a, c])
        limit = min(max(PROBE_RTOL, TREE_NOISE_FACTOR * noise), TREE_RTOL_CEILING)
        if not err <= limit:
            raise LoadError(f"the tree forward does not reproduce model_type {self.model_type!r} (relative difference "
                            f"{err:.2e}, limit {limit:.1e}: {TREE_NOISE_FACTOR:g} times the chain's own rounding here, "
                            f"{noise:.1e}, at least {PROBE_RTOL:.0e} and at most {TREE_RTOL_CEILING:.0e}). "
                            "Leave tree_nodes at 0 for this model.")
        self._tree_checked[mode] = err
        return err

    def chain_rounding(self, tokens: list[int]) -> float:
        """The relative difference between `tokens` fed one row at a time (as greedy decoding feeds
        them) and fed as one forward (as the chain's verify feeds its rows), over every row: the
        rounding speculative decoding already lives with on this machine and precision."""
        block = self.forward(mx.array(tokens, dtype=mx.uint32), self.make_cache()).logits
        cache = self.make_cache()
        rows = [self.forward(mx.array([t], dtype=mx.uint32), cache).logits[-1] for t in tokens]
        return _relative_difference(mx.stack(rows), block)

    def taps_batch(self, ids: mx.array, taps: Sequence[int]) -> dict[int, mx.array]:
        """Taps {layer: (B, L, hidden)} of a batch of right-padded sequences (B, L) in one
        forward without a cache (training, not generation). Causal attention keeps every real
        row's value independent of the padding after it."""
        return self._batch_forward(ids, taps)[0]

    def taps_and_predictions(self, ids: mx.array, taps: Sequence[int]) -> tuple[dict[int, mx.array], mx.array]:
        """`taps_batch` plus the model's greedy prediction at every position (B, L): the token
        it would emit after each prefix, from the same forward."""
        outs, hidden = self._batch_forward(ids, taps)
        return outs, mx.argmax(self._logits(hidden), axis=-1).astype(mx.uint32)

    def taps_predictions_and_top(self, ids: mx.array, taps: Sequence[int], k: int):
        """`taps_and_predictions` plus, at every position, the model's k most likely next tokens
        (B, L, k) and their probabilities renormalized over those k (float32, summing to 1): the
        soft labels of `distill --soft-labels k`, from the same forward. The k tokens come in no
        particular order; the greedy prediction is always among them."""
        outs, hidden = self._batch_forward(ids, taps)
        logits = self._logits(hidden)
        top = top_k_indices(logits, k)
        probs = mx.softmax(mx.take_along_axis(logits, top, axis=-1).astype(mx.float32), axis=-1)
        return outs, mx.argmax(logits, axis=-1).astype(mx.uint32), top.astype(mx.uint32), probs

    def _batch_forward(self, ids: mx.array, taps: Sequence[int]) -> tuple[dict[int, mx.array], mx.array]:
        self._recorder.wanted = frozenset(taps)
        self._recorder.outputs = {}
        try:
            hidden = self._inner(ids, cache=None)
        finally:
            outs, self._recorder.outputs = self._recorder.outputs, {}
            self._recorder.wanted = frozenset()
        return {t: outs[t] for t in taps}, hidden

    def check_taps(self, taps: Sequence[int]) -> None:
        bad = [t for t in taps if not EMBED_TAP <= t < self.num_layers]
        if bad:
            raise LoadError(f"tap layers {bad} are out of range: {self.model_type} has layers 0..{self.num_layers - 1} (-1 is the embedding output).")

    # --- probe -------------------------------------------------------------------------------
    def probe(self, taps: Sequence[int] | None = None) -> float:
        """Check that the tapped forward reproduces the model's own logits and that the head
        applied to the last layer's tap does too. Returns the worst relative difference;
        raises LoadError naming the model_type when it exceeds PROBE_RTOL."""
        taps = tuple(range(self.num_layers)) if taps is None else tuple(taps)
        probe_ids = mx.array([(7 * i + 3) % self.vocab_size for i in range(12)], dtype=mx.uint32)
        ref = self.model(probe_ids[None], cache=self.make_cache())
        ref = getattr(ref, "logits", ref)[0].astype(mx.float32)  # mlx-vlm returns an output object
        last = self.num_layers - 1
        out = self.forward(probe_ids, self.make_cache(), taps=tuple(sorted(set(taps) | {last})))
        if any(t.shape != (probe_ids.shape[0], self.hidden_size) for t in out.taps.values()):
            raise LoadError(f"the hidden-state tap of model_type {self.model_type!r} does not return one residual row per token; this family needs dedicated support in dspark-lab.")
        from_tap = self._logits(self._norm(out.taps[last][None]))[0].astype(mx.float32)
        scale = mx.maximum(mx.abs(ref).max(), 1.0)
        errs = mx.stack([mx.abs(out.logits.astype(mx.float32) - ref).max(), mx.abs(from_tap - ref).max()]) / scale
        err_forward, err_tap = errs.tolist()
        worst = max(err_forward, err_tap)
        if not worst <= PROBE_RTOL:  # also catches NaN
            raise LoadError(
                f"the hidden-state tap does not reproduce model_type {self.model_type!r}'s own logits "
                f"(relative difference: forward {err_forward:.2e}, last-layer tap {err_tap:.2e}; "
                f"limit {PROBE_RTOL:.0e}). This family needs dedicated support in dspark-lab; "
                "use --mode baseline meanwhile."
            )
        self.probed = True
        return worst
