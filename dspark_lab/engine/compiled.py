"""The target's forward at a write position held in a device array, optionally compiled.

The pipelined loop (engine/pipeline.py) builds a round before the previous verdict is read, so
it cannot know where the round's rows go: the position is an array. The same holds for a
traced forward (`mx.compile`), which would freeze a Python int. Compiling also fuses the
elementwise chains into fewer kernels; on the H200 that, not the host's building, is what made
pipelined rounds faster (docs/performance.md).

What makes the forward position-agnostic is the cache. mlx-lm's KV caches hold their write
position as a Python int; here each layer's cache is stood in for by
`ArrayOffsetKV`, whose offset is an array input: keys and values are written with
`mx.slice_update` at that offset, attention sees the whole preallocated buffer, and a causal
mask built from the offset hides every position at or past the end (padding, and rows a
rejected draft left behind). The model's own attention code runs unchanged, so any family whose
layers use a plain KV cache, take their mask from it and rope at an offset works; each model is
checked once against the plain forward before its first pipelined run
(`Target.check_offset_forward`), with stale rows past the end that the mask must hide.

Shapes stay few: the buffer grows a bucket (cache.BUCKET positions) at a time and the width is
at most MAX_WIDTH, so a generation compiles a handful of variants. Wider inputs (prefill) take
the uncompiled path, which writes the same buffers.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..errors import InputError
from .cache import BucketedKVCache
from .cache_kernels import moved_by_operations, written_by_operations
from .sampling import SamplingParams, residual_sample, target_probs, tree_sampled_choice

# Widest input the compiled path takes (pending token + drafts); prefill goes uncompiled.
MAX_WIDTH = 16


class AttentionRoute:
    """Attention through `kernel(q, k, v, offset, scale)` (engine/attention_kernel.py) in the
    array-offset forwards whose width `policy(rows)` takes: the kernel reads the offset, so the
    mask the forward builds is not needed there. Where the kernel does not take the attention
    (attention_kernel.supports), MLX's runs as before."""

    def __init__(self, kernel, policy):
        self.kernel, self.policy = kernel, policy


# While a routed forward runs (trace or call): the route and the masks ArrayOffsetKV.make_mask
# built in it, each with its offset. The model's attention hands the mask to
# mx.fast.scaled_dot_product_attention unchanged (mlx_lm.models.base), so the mask's identity
# tells a call of this forward's attention from any other.
_routing: dict = {}


def _routed_attention(original):
    from .attention_kernel import supports

    def attention(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
        for m, offset, ancestors in _routing.get("masks", ()):
            if mask is m and sinks is None and not kwargs and supports(q, k, v) is None:
                if ancestors is None:
                    return _routing["route"].kernel(q, k, v, offset, scale)
                return _routing["route"].kernel(q, k, v, offset, scale, ancestors=ancestors)
        return original(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)

    return attention


class _AttentionRouted:
    """Within: mx.fast.scaled_dot_product_attention takes this forward's masked attentions
    through `route` (when its policy takes `rows`)."""

    def __init__(self, route: AttentionRoute | None, rows: int):
        self.on = route is not None and route.policy(rows)
        self.route = route

    def __enter__(self):
        if self.on:
            self.original = mx.fast.scaled_dot_product_attention
            _routing.update(route=self.route, masks=[])
            mx.fast.scaled_dot_product_attention = _routed_attention(self.original)
        return self

    def __exit__(self, *exc):
        if self.on:
            mx.fast.scaled_dot_product_attention = self.original
            _routing.clear()


class BlockAttentionRouted(_AttentionRouted):
    """Within: the attention calls given `mask` go through the route's kernel as `rows` rows that
    all see one another and every position before `offset` (the tree kernel with every ancestor
    set): a DSpark head's block drafted at an array position (drafters/dspark.DSparkDrafter.hidden),
    whose attention MLX runs as a cuDNN child graph a layer on CUDA. The caller vouches that `mask`
    hides nothing else (no causal rule, no window that binds); calls the kernel does not take
    (attention_kernel.supports, sinks) run MLX's attention as before."""

    def __init__(self, route: AttentionRoute | None, mask: mx.array, offset: mx.array, rows: int):
        super().__init__(route, rows)
        self.mask, self.offset, self.rows = mask, offset, rows

    def __enter__(self):
        super().__enter__()
        if self.on:
            _routing["masks"].append((self.mask, self.offset, mx.ones((self.rows, self.rows), dtype=mx.bool_)))
        return self


class ArrayOffsetKV:
    """A BucketedKVCache as the compiled forward sees it: whole buffers and an array offset. The
    new rows are written by `writer` (Target.write_cache_with; MLX's operations by default)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, writer=None):
        self.keys, self.values, self.offset = keys, values, offset
        self.writer = writer or written_by_operations

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys, self.values = self.writer(self.keys, self.values, keys, values, self.offset)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        q = self.offset + mx.arange(N)[:, None]
        k = mx.arange(self.keys.shape[2])[None]
        visible = k <= q
        if window_size is not None:
            visible = visible & (k > q - window_size)
        elif "masks" in _routing:
            _routing["masks"].append((visible, self.offset, None))  # a plain causal mask: the kernel's
        return visible


class TreeOffsetKV(ArrayOffsetKV):
    """ArrayOffsetKV for a draft tree's rows: row i sees every position before the offset and,
    among the rows written at the offset, those `ancestors[i]` marks (its ancestors and itself),
    never padding past them. The mask is built from arrays, so one trace serves every tree of
    the same width."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, ancestors: mx.array, writer=None):
        super().__init__(keys, values, offset, writer)
        self.ancestors = ancestors

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise InputError("tree drafts do not support sliding-window attention. Leave tree_nodes at 0 for this model.")
        rel = mx.arange(self.keys.shape[2]) - self.offset  # each key's position relative to the tree's first row
        in_tree = mx.take(self.ancestors, mx.clip(rel, 0, N - 1), axis=1) & (rel < N)[None]
        visible = (rel < 0)[None] | in_tree
        if "masks" in _routing:  # the kernel reads the ancestors instead (the mask then goes unused)
            _routing["masks"].append((visible, self.offset, self.ancestors))
        return visible


def can_compile(cache: list) -> bool:
    """The compiled path handles plain bucketed KV caches only (not quantized, rotating or
    recurrent ones: those keep other state a trace would have to carry)."""
    return all(type(c) is BucketedKVCache for c in cache)


class OffsetForward:
    """The target's forward at a write position held in an array: `run(ids, cache, offset)` ->
    (logits, {tap: rows}), writing the rows' keys and values at `offset` into the cache's
    buffers (which must already hold them: BucketedKVCache.ensure). Host offsets are left alone.
    With `compile`, each (taps, last_only, shapes) variant is traced once and replayed."""

    def __init__(self, target, *, compile: bool):
        self.target, self.compile = target, compile
        self._fns: dict[tuple, object] = {}

    def _fn(self, taps: tuple[int, ...], last_only: bool):
        key = (taps, last_only)
        if key not in self._fns:
            t = self.target

            def run(ids, keys, values, offset):
                traced = [ArrayOffsetKV(k, v, offset, t.cache_writer) for k, v in zip(keys, values)]
                rec = t._recorder
                rec.wanted, rec.outputs = frozenset(taps), {}
                try:
                    with _AttentionRouted(t.attention_route, ids.shape[0]):
                        hidden = t._inner(ids[None], cache=traced)
                finally:
                    outs, rec.outputs, rec.wanted = rec.outputs, {}, frozenset()
                rows = hidden[0, -1:] if last_only else hidden[0]
                return t._logits(rows), [outs[i][0] for i in taps], [c.keys for c in traced], [c.values for c in traced]

            self._fns[key] = mx.compile(run) if self.compile else run
        return self._fns[key]

    def _tree_forward(self, taps: tuple[int, ...], ids, keys, values, offset, depth, ancestors):
        """The tree rows' forward over traced caches: (logits, tap rows, keys, values)."""
        t = self.target
        traced = [TreeOffsetKV(k, v, offset, ancestors, t.cache_writer) for k, v in zip(keys, values)]
        rec = t._recorder
        rec.wanted, rec.outputs, rec.positions = frozenset(taps), {}, offset + depth
        try:
            with _AttentionRouted(t.attention_route, ids.shape[0]):
                hidden = t._inner(ids[None], cache=traced)
        finally:
            outs, rec.outputs, rec.wanted, rec.positions = rec.outputs, {}, frozenset(), None
        return t._logits(hidden[0]), [outs[i][0] for i in taps], [c.keys for c in traced], [c.values for c in traced]

    def _tree_fn(self, taps: tuple[int, ...]):
        key = ("tree", taps)
        if key not in self._fns:

            def run(ids, keys, values, offset, depth, ancestors):
                return self._tree_forward(taps, ids, keys, values, offset, depth, ancestors)

            self._fns[key] = mx.compile(run) if self.compile else run
        return self._fns[key]

    def _tree_round_fn(self, taps: tuple[int, ...], max_depth: int, sampling: SamplingParams | None):
        # One trace per distribution, not per seed: the seed only sets the random state it takes.
        key = ("tree-round", taps, max_depth, sampling and (sampling.temperature, sampling.top_p, sampling.top_k))
        if key not in self._fns:

            def run(ids, keys, values, offset, depth, ancestors, parent, allowed):
                logits, tap_rows, keys, values = self._tree_forward(taps, ids, keys, values, offset, depth, ancestors)
                root = mx.arange(ids.shape[0]) == 0
                if sampling is None:
                    # A row is accepted when its token is the target's choice at its parent (and it
                    # is allowed: a lookup branch's rows past its match are not).
                    best = mx.argmax(logits, axis=-1).astype(mx.uint32)
                    chosen = ((ids == best[parent]) & allowed) | root
                else:
                    p = target_probs(logits, sampling)
                    chosen, tried = tree_sampled_choice(p, ids, parent, allowed, mx.random.uniform(shape=ids.shape))
                    chosen = chosen | root
                # A row is kept when it and all its ancestors are chosen (at most one child of each
                # row is): keep the deepest such row (the root if none).
                kept = (ancestors.astype(mx.float32) @ (~chosen).astype(mx.float32)) == 0
                end = mx.argmax(mx.where(kept, depth, -1))
                if sampling is None:
                    nxt = best[end]
                else:  # every tried child of the end was rejected: its residual
                    nxt = residual_sample(p[end], ids, tried & (parent == end))
                on_path = ancestors[end][None] & (depth[None] == mx.arange(max_depth + 1)[:, None])
                path = mx.argmax(on_path.astype(mx.int32), axis=1)  # the path's row at each depth (the root past its end)
                # The kept rows move to follow the cache, in path order (Target.move_tree_paths_with).
                moved = (self.target.tree_path_mover or moved_by_operations)([*keys, *values], offset, path)
                keys, values = moved[: len(keys)], moved[len(keys):]
                verdict = mx.concatenate([depth[end][None], nxt.reshape(1).astype(mx.int32), ids[path[1:]].astype(mx.int32)])
                return verdict, [r[path] for r in tap_rows], keys, values

            if not self.compile:
                self._fns[key] = run
            elif sampling is None:
                self._fns[key] = mx.compile(run)
            else:  # the draws advance MLX's random state, an input and output of the trace
                state = [mx.random.state]
                self._fns[key] = mx.compile(run, inputs=state, outputs=state)
        return self._fns[key]

    def tree_round(self, ids: mx.array, depth: mx.array, ancestors: mx.array, parent: mx.array, allowed: mx.array, cache: list,
                   offset: mx.array, *, capacity: int, max_depth: int, taps: Sequence[int] = (),
                   sampling: SamplingParams | None = None):
        """A pipelined tree round's verify with nothing read on the host: the tree's rows (row 0
        the pending token, `parent` each row's parent row, 0 for the root; rows not `allowed` are
        never accepted) fed at `offset` (an array), the path the target keeps found (greedy: the
        longest its argmax agrees with; `sampling`: the sampled walk, sampling.tree_sampled_choice),
        its rows' keys and values moved to follow the cache at `offset`. Returns the verdict
        [accepted n, next token, the path's max_depth tokens (the first n are the accepted drafts)]
        and the taps of the path's max_depth + 1 rows, for the head's context (rows past the path
        are the root's: the next round overwrites them). `capacity` bounds offset + rows, for
        growing the buffers."""
        for c in cache:
            c.ensure(capacity)
        fn = self._tree_round_fn(tuple(taps), max_depth, sampling)
        verdict, tap_rows, keys, values = fn(ids, [c.keys for c in cache], [c.values for c in cache], offset,
                                             depth, ancestors, parent, allowed)
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values = k, v
        return verdict, dict(zip(taps, tap_rows))

    def tree(self, ids: mx.array, depth: mx.array, ancestors: mx.array, cache: list, taps: Sequence[int] = ()):
        """A draft tree's rows after the cache (Target.forward_tree's contract): row i at position
        offset + depth[i], seeing the cache and the rows ancestors[i] marks. Writes every row at
        the cache's offset and advances it by their number. The rope modules must already rotate
        per row (Target.forward_tree installs that)."""
        n, start = ids.shape[0], cache[0].offset
        for c in cache:
            c.ensure(start + n)
        fn = self._tree_fn(tuple(taps))
        logits, tap_rows, keys, values = fn(ids, [c.keys for c in cache], [c.values for c in cache],
                                            mx.array(start, dtype=mx.int32), depth, ancestors)
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values, c.offset = k, v, start + n
        return logits, dict(zip(taps, tap_rows))

    def run(self, ids: mx.array, cache: list, offset: mx.array, taps: Sequence[int] = (), last_only: bool = False):
        taps = tuple(taps)
        logits, tap_rows, keys, values = self._fn(taps, last_only)(ids, [c.keys for c in cache], [c.values for c in cache], offset)
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values = k, v
        return logits, dict(zip(taps, tap_rows))

    def __call__(self, ids: mx.array, cache: list, taps: Sequence[int] = (), last_only: bool = False):
        """The plain forward's contract: write at the cache's own offset and advance it."""
        n = ids.shape[0]
        for c in cache:
            c.ensure(c.offset + n)
        out = self.run(ids, cache, mx.array(cache[0].offset, dtype=mx.int32), taps, last_only)
        for c in cache:
            c.offset += n
        return out
