"""Tree drafts: verify several of a DSpark head's candidates per position in one target forward.

A DSpark head without a Markov term drafts its block's positions independently of one another:
position j's distribution does not depend on the tokens drafted before it. So its top-k per
position costs no more to draft than its argmax, and any path through those candidates is a
draft. A round here takes the `nodes` paths the head itself thinks likeliest (the product of its
per-position probabilities, best first: EAGLE-2's rule, with no shape fitted to any data), lays
them out as a tree below the pending token, and verifies the whole tree in one target forward:
each node attends to the cache and to its own ancestors only, at the position of its depth
(Target.forward_tree). The longest path the target agrees with is kept, its rows moved into
place in the KV cache, the rest dropped. A long n-gram match's continuation (lookup drafts) joins
the tree as one more path, sharing the nodes it agrees with.

Lossless either way:
- greedy: from the root, step to the child whose token is the target's argmax at the current
  node, while there is one; that argmax after the last step is the round's own token. Every
  kept token is the target's greedy token after the kept tokens before it.
- temperature > 0: the candidates are fixed before the target is read (point masses), so at a
  node with target distribution p the children are tried in turn: child c is accepted with
  probability r(c), where r is p with the children tried before removed and renormalized;
  when none is accepted the round's token is drawn from the last r. The token leaving each node
  is then distributed exactly as p (tests/test_tree.py checks the distribution).

docs/performance.md (thirty-fourth round) measures what a tree accepts against the chain on the
Qwen 1.5B head, and benchmarks/tree_accept.py counts it teacher-forced from the same rule.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from ..errors import InputError
from .generate import GenResult, _Clock, prefill_and_start
from .sampling import SamplingParams, renormalized, sample_rows, target_probs
from .speculative import HeadSource
from .target import Target
from .text import TextStream

# Candidates per draft position the tree may branch into (the head's top-k). On the 1.5B's
# built-in rows 1.5% of a 16-node tree's nodes take the eighth candidate, 4.7% of a 64-node
# tree's (docs/performance.md, thirty-fourth round): wider would add a little to large trees only.
TREE_TOP_K = 8


def best_paths(logp: np.ndarray, nodes: int) -> list[tuple[int, ...]]:
    """The `nodes` likeliest rank-paths under independent per-position log-probabilities `logp`
    (depth, k), each sorted best first: a path (r0, r1, ..) drafts the r0-th candidate at position
    0, the r1-th at position 1, ... Best-first from the top-1 path's first node; a node's next
    sibling and first child are never likelier than it, so every path's parent comes before it
    and the result is a tree."""
    depth, k = logp.shape
    if nodes <= 0 or depth == 0:
        return []
    out: list[tuple[int, ...]] = []
    heap = [(-float(logp[0, 0]), (0,))]
    while heap and len(out) < nodes:
        neg, path = heapq.heappop(heap)
        out.append(path)
        d, last = len(path), path[-1]
        if last + 1 < k:  # next sibling: the same prefix, the next candidate at this depth
            heapq.heappush(heap, (neg + float(logp[d - 1, last] - logp[d - 1, last + 1]), path[:-1] + (last + 1,)))
        if d < depth:  # first child: the top candidate one position deeper
            heapq.heappush(heap, (neg - float(logp[d, 0]), path + (0,)))
    return out


@dataclass
class TreeLayout:
    """A draft tree; node 0 is the root (the pending token, depth 0), the head's paths follow
    breadth-first, grafted ones after them, so `parent[i] < i`. Node i > 0 drafts candidate
    `rank[i]` of position `depth[i] - 1` (-1: a grafted token, not one of the head's)."""

    parent: list[int]
    depth: list[int]
    rank: list[int]

    @classmethod
    def from_paths(cls, paths: list[tuple[int, ...]]) -> "TreeLayout":
        order = sorted(paths, key=lambda p: (len(p), p))
        index = {(): 0}
        parent, depth, rank = [-1], [0], [0]
        for p in order:
            if p[:-1] not in index:
                raise ValueError(f"path {p} has no parent in the tree")
            index[p] = len(parent)
            parent.append(index[p[:-1]])
            depth.append(len(p))
            rank.append(p[-1])
        return cls(parent, depth, rank)

    def __len__(self) -> int:
        return len(self.parent)

    def graft(self, tokens: list[int], path: list[int]) -> None:
        """Add a token path below the root (an n-gram lookup's continuation), sharing the nodes it
        agrees with: `tokens` holds each node's token and grows with the new nodes, which come after
        every existing one (so a parent still precedes its children) with rank -1 (tried first)."""
        kids = self.children()
        node = 0
        for tok in path:
            step = next((c for c in kids[node] if tokens[c] == tok), None)
            if step is None:
                step = len(self.parent)
                self.parent.append(node)
                self.depth.append(self.depth[node] + 1)
                self.rank.append(-1)
                tokens.append(tok)
                kids.append([])
                kids[node].append(step)
            node = step

    def children(self) -> list[list[int]]:
        """Each node's children, best candidate first."""
        kids: list[list[int]] = [[] for _ in self.parent]
        for i in range(1, len(self.parent)):
            kids[self.parent[i]].append(i)
        for k in kids:
            k.sort(key=lambda i: self.rank[i])
        return kids

    def ancestors(self) -> np.ndarray:
        """(n, n) booleans: node i sees node j when j is i or one of its ancestors."""
        return ancestor_matrix(self.parent)


def ancestor_matrix(parent: list[int]) -> np.ndarray:
    """(n, n) booleans for a tree given by each node's parent (parent[i] < i; the root's unread):
    row i marks i itself and every ancestor of i."""
    vis = np.eye(len(parent), dtype=bool)
    for i in range(1, len(parent)):
        vis[i] |= vis[parent[i]]
    return vis


def walk_greedy(layout: TreeLayout, tokens: list[int], best: list[int]) -> tuple[list[int], int]:
    """Greedy verdict: the kept nodes from the root (root included) and the round's own token."""
    kids = layout.children()
    path = [0]
    while True:
        step = next((c for c in kids[path[-1]] if tokens[c] == best[path[-1]]), None)
        if step is None:
            return path, best[path[-1]]
        path.append(step)


def walk_sampled(layout: TreeLayout, child_p: list[float], uniform: list[float], residual: list[int]) -> tuple[list[int], int]:
    """Sampled verdict. child_p[c]: the target's probability of node c's token at its parent;
    uniform[c]: a uniform draw for trying c; residual[u]: a draw from node u's distribution with
    all its children's tokens removed (its own distribution at a leaf)."""
    kids = layout.children()
    path = [0]
    while True:
        u, left, step = path[-1], 1.0, None
        for c in kids[u]:
            if left > 0 and uniform[c] * left < child_p[c]:  # accept c with probability child_p[c] / left
                step = c
                break
            left -= child_p[c]
        if step is None:
            return path, residual[u]
        path.append(step)


def check_tree(target: Target, drafter) -> None:
    """Refuse a tree run it cannot do exactly, saying what to change."""
    check_tree_head(drafter)
    target.check_tree_forward()


def check_tree_head(drafter) -> None:
    """Refuse a head whose top-k per position is not what it drafts: one with a causal block or a
    Markov term, whose candidates depend on the tokens drafted before them."""
    if drafter.kind != "dspark" or drafter.config.causal:
        raise InputError(f"tree drafts need a DSpark head with a bidirectional block; this is a {drafter.kind} head. "
                         "Leave tree_nodes at 0 for it.")
    if getattr(drafter.head, "markov_head", None) is not None:
        raise InputError("tree drafts need a head that drafts its positions independently (markov_rank 0); this head has "
                         "a Markov term, so its candidates depend on the path. Leave tree_nodes at 0 for it.")


class HeadTreeSource(HeadSource):
    """Where a tree round's candidates come from: a DSpark head's top-k per position, and with
    `lookup` an n-gram match's continuation over prompt and output, grafted onto the tree as one
    more path (the chain's HeadSource verifies such a match instead of the head's drafts; a tree
    holds both). Started and fed every committed row's taps as HeadSource is."""

    def __init__(self, drafter, *, lookup: bool = True):
        super().__init__(drafter, lookup=lookup)
        self.max_depth = drafter.config.max_drafts

    def candidates(self, pending: int, depth: int, k: int) -> tuple[mx.array, mx.array]:
        """(depth, k) candidate ids and their log-probabilities, best first per position (lazy)."""
        return self.drafter.draft_top(pending, depth, k)

    @property
    def graft_rows(self) -> int:
        """The most rows extra_paths can add to a tree (a lookup continuation, at most max_depth long)."""
        return self.max_depth if self.index is not None else 0

    def extra_paths(self, depth: int) -> list[list[int]]:
        """Token paths to graft onto the round's tree: the lookup's continuation, if it has one."""
        hit = self.index.propose(depth) if self.index is not None else []
        return [hit] if hit else []


def tree_loop(
    target: Target,
    prompt_ids: list[int],
    params: SamplingParams,
    source: HeadTreeSource,
    *,
    nodes: int,
    max_new_tokens: int,
    cap: int | Callable[[], int],
    stream: TextStream,
    on_round: Callable[[int, int, float], None] | None = None,
) -> GenResult:
    """The verify loop with tree drafts of up to `nodes` nodes below the pending token, at most
    `cap` deep (plus the source's extra paths). A round reads the host twice: the head's top-k
    candidates (to choose the tree) and the verdict."""
    clock = _Clock()
    cache, pending, done = prefill_and_start(target, prompt_ids, params, source, stream, clock)
    forwards, host_reads, accepts, drafted = 1, 1, [], []
    produced = 1
    # Every round's tree padded to one width (its nodes, the root, a grafted path): one compiled
    # trace per cache bucket instead of one per tree size.
    width = nodes + 1 + source.graft_rows
    while not done and produced < max_new_tokens:
        t0 = time.perf_counter()
        want = cap() if callable(cap) else cap
        depth = max(0, min(want, max_new_tokens - produced - 1, source.max_depth))
        layout, tokens = TreeLayout([-1], [0], [0]), [pending]
        if depth:
            top, logp = source.candidates(pending, depth, TREE_TOP_K)
            mx.eval(top, logp)  # the round's first host read: which tree to verify
            top, logp = np.array(top), np.array(logp)
            host_reads += 1
            layout = TreeLayout.from_paths(best_paths(logp, nodes))
            tokens += [int(top[d - 1, r]) for d, r in zip(layout.depth[1:], layout.rank[1:])]
            for extra in source.extra_paths(depth):
                layout.graft(tokens, extra)
        ids = mx.array(tokens, dtype=mx.uint32)
        out = target.forward_tree(ids, layout.depth, layout.ancestors(), cache, taps=source.taps, width=width)
        if params.greedy:
            best = mx.argmax(out.logits, axis=-1).tolist()  # the round's verdict read
            path, nxt = walk_greedy(layout, tokens, best)
        else:
            p = target_probs(out.logits, params)  # (n, vocab)
            parent = mx.array([0] + layout.parent[1:])
            child_p = p[parent, ids.astype(mx.int32)]  # node c's token at its parent (node 0's entry unused)
            removed = mx.zeros(p.shape)
            if len(layout) > 1:  # each node's children's tokens, taken out of its distribution
                removed = removed.at[parent[1:], ids[1:].astype(mx.int32)].add(1.0)
            residual = sample_rows(renormalized(mx.where(removed > 0, 0.0, p), p))
            uniform = mx.random.uniform(shape=(len(layout),))
            mx.eval(child_p, uniform, residual)  # the round's verdict read: one, not one per array
            path, nxt = walk_sampled(layout, child_p.tolist(), uniform.tolist(), residual.tolist())
        host_reads += 1
        forwards += 1
        target.keep_tree_path(cache, path, len(layout))
        new = [tokens[i] for i in path[1:]] + [nxt]
        rows = mx.array(path)
        source.commit(new, {t: r[rows] for t, r in out.taps.items()})
        accepts.append(len(new))
        drafted.append(len(layout) - 1)
        produced += len(new)
        pending = nxt
        done = stream.add(new)
        if on_round is not None:
            on_round(len(layout) - 1, len(new), time.perf_counter() - t0)
    if not done:
        stream.finish("length")
    result = clock.result(stream, prompt_tokens=len(prompt_ids), rounds=forwards - 1, forwards=forwards,
                          accepts=accepts, drafts=drafted, mode="dspark-tree")
    result.host_reads = host_reads
    return result
