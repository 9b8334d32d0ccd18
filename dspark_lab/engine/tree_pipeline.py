"""Tree drafts in the pipelined loop: the host builds round r+1 while the device computes round r.

The plain tree loop (engine/tree.py) reads the host twice a round: the head's candidates, to
choose the tree, and the verdict. On the H200 the pipelined chain (engine/pipeline.py), which
reads nothing inside a round, ran 1.3-1.6x faster than the plain chain loop; a tree loop that
waits twice would give much of its longer accepts back. Here the whole round stays on the device:

- The tree is chosen on the device. For a head without a Markov term a path's score is the sum
  of its positions' log-probabilities, so the best N-node tree is the N best-scoring rank paths
  (a prefix never scores below its extensions, nor a path below one with smaller ranks, so the
  N best are a tree). A path can be among the N best only if the paths it cannot beat number N
  or fewer: its prefixes and the paths with smaller ranks (`superset_paths`, about 250 paths
  for N = 16 at depth 7). Each round scores that fixed superset in one matmul and takes the best
  N: the same tree as the host's best-first search (engine/tree.best_paths), up to ties.
- The verdict is found on the device: greedy, a row is kept when it and all its ancestors carry
  the target's argmax at their parents; at temperature > 0, when it and all its ancestors were
  chosen by the sampled walk (sampling.tree_sampled_choice: each row's siblings tried in turn
  against the mass the rejected ones left, as the plain tree loop's walk_sampled on the host),
  the next token drawn from the end row's residual. The deepest kept row ends the path; the
  path's keys and values move into place at an array offset (Target.tree_round_at, one compiled
  trace, the random draws inside it).
- The head's context gains the path's tapped rows at that offset, in the next round's compiled
  draft (DSparkDrafter.draft_top_at), in the same trace as the tree's choice.

The host reads each verdict one round late, to stream the text and stop. With `lookup_n`, an
n-gram match over the committed text, kept on the device (pipeline.DeviceLookup), adds its
continuation as one more chain below the root (its rows past the match never accepted; where it
repeats a sibling's token, only the first copy is tried). Fixed caps only (the shapes must not
change between rounds).
Output: the target's greedy tokens at temperature 0 (tests compare ids), an exact sample of the
target above it (tests check the distribution), as every loop.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .generate import GenResult
from .pipeline import DeviceLookup, InFlight
from .sampling import SamplingParams
from .target import Target
from .text import TextStream
from .tree import TREE_TOP_K, TreeLayout

# A path's score is lowered by this much per rank step and per depth, so that a prefix, and a path
# with smaller ranks, always score strictly higher than the path (equal log-probabilities happen:
# a head certain to float precision) and the chosen rows always form a tree. It must exceed the
# float32 rounding of a score (a sum of at most 8 terms of at most |LOGP_FLOOR|: about 1e-4).
TIE_BREAK = 1e-3
# Log-probabilities are clipped here first: -inf would make paths equal, and large magnitudes
# would round away TIE_BREAK. A candidate below e^-30 is never worth a row anyway.
LOGP_FLOOR = -30.0


def superset_paths(nodes: int, depth: int, k: int) -> list[tuple[int, ...]]:
    """Every rank path (ranks < k, at most `depth` long) that can be among a tree's `nodes` best:
    those whose prefixes and smaller-ranked variants number at most `nodes` (itself included)."""
    out: list[tuple[int, ...]] = []

    def extend(path: tuple[int, ...], beaten_by: int, variants: int) -> None:
        for r in range(k):
            v = variants * (r + 1)  # paths of this length whose ranks are all <= this one's
            if beaten_by + v > nodes:
                break  # a larger rank here only adds more
            out.append(path + (r,))
            if len(path) + 1 < depth:
                extend(path + (r,), beaten_by + v, v)

    extend((), 0, 1)
    return out


class DeviceTree:
    """A run's superset of rank paths, and each round's choice of its `nodes` best on the device."""

    def __init__(self, nodes: int, depth: int, k: int = TREE_TOP_K):
        layout = TreeLayout.from_paths(superset_paths(nodes, depth, k))
        anc = layout.ancestors()  # (S + 1, S + 1): node 0 the root, every node's ancestors, itself included
        self.nodes, self.depth, self.k = min(nodes, len(layout) - 1), depth, k
        self.width = self.nodes + 1  # the verify's rows: the pending token, then the chosen nodes
        # Constants of the trace, in the layout's numbering (the root 0, parents before children).
        # A chosen node's token is `source[flat[node]]`, source = [pending, top flattened].
        flat = [(d - 1) * k + r for d, r in zip(layout.depth[1:], layout.rank[1:])]  # each node's candidate in (depth, k) flattened
        self._candidate = mx.array(flat, dtype=mx.int32)
        self._flat = mx.array([0] + [f + 1 for f in flat], dtype=mx.int32)
        self._depth = mx.array(layout.depth, dtype=mx.int32)
        self._parent = mx.array(layout.parent, dtype=mx.int32)  # -1: the root's
        self._anc = mx.array(anc.reshape(-1))  # flattened: one gather picks the chosen rows' and columns' crossing
        self._anc_f = mx.array(anc[1:, 1:].astype(np.float32))  # the nodes' ancestors below the root
        self._penalty = mx.array(TIE_BREAK * (anc[1:, 1:].astype(np.float32) @ (np.array(layout.rank[1:], dtype=np.float32) + 1.0)))
        self._root = mx.zeros((1,), dtype=mx.int32)
        self.key = ("tree", nodes, depth, k)  # everything choose's arrays depend on (a compiled trace's key)

    @classmethod
    def for_cap(cls, nodes: int, cap: int, max_drafts: int) -> "DeviceTree":
        """The tree a pipelined run of `cap` uses: as deep as the cap, the head's max_drafts allow."""
        return cls(nodes, max(1, min(cap, max_drafts)))

    def verify_rows(self, lookup: bool) -> int:
        """The rows each round's verify feeds: the pending token and the nodes, and with `lookup` a
        chain as deep as the tree (the lab's mismatch classifier reproduces this forward's rounding)."""
        return self.width + (self.depth if lookup else 0)

    def choose(self, pending: mx.array, top: mx.array, logp: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """From the head's (depth, k) candidates and log-probabilities: the tree's rows (ids: the
        pending token, then the chosen nodes in breadth-first order), each row's depth, its
        ancestors (rows x rows, itself included) and its parent row (0 for the root). Lazy.

        Written in few operations (each is a primitive the host hands to the device, and the
        pipelined round is bound by that host work, docs/performance.md): every output is one
        gather from a constant table at the chosen rows of the layout."""
        if tuple(logp.shape) != (self.depth, self.k):
            raise ValueError(f"the tree takes ({self.depth}, {self.k}) candidates, got {tuple(logp.shape)}")

        def pick(table: mx.array, at: mx.array) -> mx.array:  # table[at] as one primitive (indexing adds views)
            if at.ndim == 1:
                return mx.take_along_axis(table, at, axis=0)
            return mx.take_along_axis(table, at.reshape(-1), axis=0).reshape(at.shape)

        node_logp = mx.maximum(pick(logp.reshape(-1), self._candidate), LOGP_FLOOR)
        score = self._anc_f @ node_logp - self._penalty
        chosen = mx.sort(mx.argsort(-score)[: self.nodes])  # ascending: parents before children
        rows = mx.concatenate([self._root, chosen + 1])  # in the layout's numbering, the root first
        source = mx.concatenate([pending.reshape(1).astype(mx.uint32), top.reshape(-1).astype(mx.uint32)])
        ids = pick(source, pick(self._flat, rows))
        width = self._depth.shape[0]
        ancestors = pick(self._anc, rows[:, None] * width + rows[None, :])
        # A node's parent row is the parent's place among the rows (sorted, and holding every
        # chosen node's parent): how many rows come before it. The root's (-1): none, row 0.
        parent = (rows[None, :] < pick(self._parent, rows)[:, None]).sum(axis=1).astype(mx.int32)
        return ids, pick(self._depth, rows), ancestors, parent

    def with_branch(self, ids: mx.array, depth: mx.array, ancestors: mx.array, parent: mx.array, tokens: mx.array,
                    usable: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
        """`choose`'s tree with one more chain of `depth` rows below the root (a lookup match's
        continuation), each row allowed only where `usable`: (ids, depth, ancestors, parent, allowed).
        It may repeat a path of the tree: greedy keeps either copy, the same tokens; sampling
        tries only the first copy of a token among siblings."""
        w, d = self.width, self.depth
        chain = np.tril(np.ones((d, d), dtype=bool))
        below = np.concatenate([np.ones((d, 1), dtype=bool), np.zeros((d, w - 1), dtype=bool), chain], axis=1)
        ancestors = mx.concatenate([mx.concatenate([ancestors, mx.zeros((w, d), dtype=mx.bool_)], axis=1), mx.array(below)], axis=0)
        ids = mx.concatenate([ids, tokens.astype(mx.uint32)])
        depth = mx.concatenate([depth, mx.arange(1, d + 1, dtype=mx.int32)])
        parent = mx.concatenate([parent, mx.array([0] + list(range(w, w + d - 1)), dtype=mx.int32)])
        allowed = mx.concatenate([mx.ones((w,), dtype=mx.bool_), usable])
        return ids, depth, ancestors, parent, allowed


def tree_pipelined_loop(
    target: Target,
    prompt_ids: list[int],
    params: SamplingParams,
    drafter,
    *,
    nodes: int,
    max_new_tokens: int,
    cap: int,
    stream: TextStream,
    compile_draft: bool = True,
    lookup_n: tuple[int, ...] = (),
    on_round=None,
) -> GenResult:
    """Tree drafts of `nodes` nodes at most `cap` deep, one round always in flight (see the module
    doc); greedy, or an exact sample of the target at temperature > 0. `compile_draft`: the head's
    context append and candidates in one compiled trace. `lookup_n`: n-gram lengths for a lookup branch matched on the device (pipeline.DeviceLookup),
    the continuation of the longest match joining each tree as one more chain below the root."""
    run = InFlight(target, prompt_ids, params, drafter, max_new_tokens=max_new_tokens, stream=stream, on_round=on_round)
    cache, taps = run.cache, drafter.target_layer_ids
    tree = DeviceTree.for_cap(nodes, cap, drafter.config.max_drafts)
    depth = tree.depth
    sampling = None if params.greedy else params
    pending = mx.array([run.first_token], dtype=mx.uint32)
    offset = mx.array(len(prompt_ids), dtype=mx.int32)  # target cache length == head context length
    rows, rows_at = None, None  # the previous round's kept path's tapped rows, and where they go in the head's context
    lookup = DeviceLookup(prompt_ids, lookup_n) if lookup_n else None
    width = tree.verify_rows(lookup is not None)

    def build() -> None:
        nonlocal pending, offset, rows, rows_at
        # Upper bound of the cache length after this round's writes: the rounds in flight keep at
        # most depth + 1 rows each, this one writes the tree's rows (and moves at most depth + 1).
        bound = run.known_len + (depth + 1) * len(run.rounds) + max(width, depth + 1)
        drafter.ensure_capacity(bound + drafter.config.block_size)
        # The tree is chosen in the draft's trace: its few dozen small ops fuse there, not one kernel each.
        ids, row_depth, ancestors, parent = drafter.draft_top_at(rows, rows_at, pending, depth, TREE_TOP_K, offset,
                                                                 compiled=compile_draft, then=tree.choose, then_key=tree.key)
        allowed = None
        if lookup is not None:
            tokens, usable = lookup.propose_after(pending, offset, depth, bound)
            ids, row_depth, ancestors, parent, allowed = tree.with_branch(ids, row_depth, ancestors, parent, tokens, usable)
        verdict, rows = target.tree_round_at(ids, row_depth, ancestors, parent, cache, offset, capacity=bound,
                                             max_depth=depth, taps=taps, allowed=allowed, sampling=sampling)
        if lookup is not None:
            lookup.record(verdict[2:], offset + 1)  # the kept path's tokens (the first past them is overwritten next round)
        rows_at = offset
        offset = offset + verdict[0] + 1
        pending = verdict[1:2].astype(mx.uint32)
        mx.async_eval(verdict, offset, pending)
        run.launch(verdict, width - 1)

    return run.drive(build, len(prompt_ids), "dspark-tree")
