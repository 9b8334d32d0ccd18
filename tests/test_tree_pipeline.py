"""Pipelined tree drafts (engine/tree_pipeline.py): the tree chosen on the device is the host's
best-first tree, the on-device verdict is the host walk's, and generation is the greedy tokens."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from conftest import PROMPTS, REPETITIVE
from dspark_lab import speculative_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.tree import TreeLayout, best_paths, walk_greedy
from dspark_lab.engine.tree_pipeline import DeviceTree, superset_paths
from dspark_lab.errors import InputError
from dspark_lab.tiny import build_tiny_dspark


def test_the_superset_holds_every_tree_the_search_can_choose():
    """Over random head log-probabilities (and ties), each best-first tree lies in the superset."""
    rng = np.random.default_rng(0)
    for nodes, depth, k in ((4, 3, 3), (16, 5, 8), (9, 7, 4)):
        sup = set(superset_paths(nodes, depth, k))
        assert all(len(p) <= depth and max(p) < k for p in sup)
        assert all(len(p) == 1 or p[:-1] in sup for p in sup)  # a tree itself
        for _ in range(200):
            logp = np.sort(np.log(1e-30 + rng.dirichlet(np.full(k + 2, rng.uniform(0.05, 2.0)), size=depth))[:, :k], axis=1)[:, ::-1]
            assert set(best_paths(logp, nodes)) <= sup
    # without the bound, the count of every path is sum k^d: the superset is what keeps it small
    assert len(superset_paths(16, 7, 8)) < 300 < sum(8 ** d for d in range(1, 8))


def _chosen(tree: DeviceTree, logp: np.ndarray, top: np.ndarray):
    ids, depth, anc, parent = tree.choose(mx.array([7], dtype=mx.uint32), mx.array(top), mx.array(logp.astype(np.float32)))
    return np.array(ids), np.array(depth), np.array(anc), np.array(parent)


def test_the_device_chooses_the_best_first_tree():
    """The device's tree is a tree of N nodes, the N best paths up to its tie-break (TIE_BREAK per
    rank step and depth), and the host's best-first tree wherever the N-th and the next path differ
    by more than that."""
    from dspark_lab.engine.tree_pipeline import LOGP_FLOOR, TIE_BREAK

    rng = np.random.default_rng(1)
    depth, k, nodes = 4, 8, 16
    tree = DeviceTree(nodes, depth, k)
    sup = superset_paths(nodes, depth, k)
    top = rng.integers(100, 1000, size=(depth, k)).astype(np.uint32)
    compared = 0
    for trial in range(100):
        logp = np.sort(np.log(1e-30 + rng.dirichlet(np.full(k + 4, 0.3 if trial % 2 else 1.0), size=depth))[:, :k], axis=1)[:, ::-1]
        if trial % 10 == 0:
            logp[:, :2] = 0.0  # ties: a head certain to float precision
        if trial % 10 == 1:
            logp[2:, 3:] = -np.inf
        ids, row_depth, anc, parent = _chosen(tree, logp, top)
        got = set()
        for i in range(1, nodes + 1):
            path = [j for j in range(nodes + 1) if anc[i, j]]
            assert path[0] == 0 and row_depth[path].tolist() == list(range(len(path)))  # a chain from the root to itself
            assert parent[i] == path[-2] and anc[i, i]
            got.add(tuple(int(np.flatnonzero(top[d - 1] == ids[r])[0]) for d, r in zip(row_depth[path[1:]], path[1:])))
        assert ids[0] == 7 and row_depth[0] == 0 and anc[0].tolist() == [True] + [False] * nodes and len(got) == nodes
        clipped = np.maximum(logp, LOGP_FLOOR)
        score = {p: sum(clipped[d, r] for d, r in enumerate(p)) for p in sup}
        slack = TIE_BREAK * k * depth  # the most the tie-break can move a path
        assert min(score[p] for p in got) >= max(score[p] for p in sup if p not in got) - slack
        ranked = sorted(score.values(), reverse=True)
        if ranked[nodes - 1] - ranked[nodes] > slack:  # no near-tie at the boundary: exactly the host's tree
            assert got == set(best_paths(clipped, nodes))
            compared += 1
    assert compared > 40


def test_the_device_verdict_is_the_host_walks(qwen3):
    """Trees with the target's greedy tokens placed at random branches: tree_round_at keeps the
    same path and next token as forward_tree + walk_greedy, and leaves the cache as keep_tree_path."""
    target, tok = qwen3
    rng = np.random.default_rng(2)
    prompt = list(range(3, 40))
    greedy = []
    c = target.make_cache()
    out = target.forward(mx.array(prompt, dtype=mx.uint32), c)
    nxt = int(mx.argmax(out.logits[-1]).item())
    for _ in range(5):
        greedy.append(nxt)
        nxt = int(mx.argmax(target.forward(mx.array([nxt], dtype=mx.uint32), c).logits[-1]).item())
    greedy.append(nxt)
    depth, accepted = 4, 0
    for trial in range(12):
        tree = DeviceTree(10, depth, 3)
        top = rng.integers(0, target.vocab_size, size=(depth, 3)).astype(np.uint32)
        for d in range(depth):  # the greedy continuation at a random rank per position (not at all sometimes)
            if rng.uniform() < 0.85:
                top[d, rng.integers(0, 3)] = greedy[d + 1]
        logp = np.log(rng.dirichlet(np.ones(5), size=depth))[:, :3]
        pending = mx.array([greedy[0]], dtype=mx.uint32)
        ids, row_depth, anc, parent = tree.choose(pending, mx.array(top), mx.array(logp.astype(np.float32)))
        # the host's way
        host = target.make_cache()
        target.forward(mx.array(prompt, dtype=mx.uint32), host)
        lay = TreeLayout([-1] + [int(p) for p in np.array(parent)[1:]], np.array(row_depth).tolist(), [0] * tree.width)
        tokens = np.array(ids).tolist()
        o = target.forward_tree(ids, lay.depth, np.array(anc), host)
        path, want_next = walk_greedy(lay, tokens, mx.argmax(o.logits, axis=-1).tolist())
        target.keep_tree_path(host, path, len(lay))
        # the device's way
        dev = target.make_cache()
        target.forward(mx.array(prompt, dtype=mx.uint32), dev)
        at = mx.array(len(prompt), dtype=mx.int32)
        verdict, taps = target.tree_round_at(ids, row_depth, anc, parent, dev, at, capacity=len(prompt) + 64, max_depth=depth,
                                             taps=(0,))
        v = verdict.tolist()
        assert v[0] == len(path) - 1 and v[1] == want_next and v[2 : 2 + v[0]] == [tokens[i] for i in path[1:]], trial
        assert v[2 : 2 + v[0]] == greedy[1 : 1 + v[0]]
        kept = len(prompt) + len(path)
        for h, d in zip(host, dev):
            assert mx.array_equal(h.keys[..., :kept, :], d.keys[..., :kept, :]) and mx.array_equal(h.values[..., :kept, :], d.values[..., :kept, :])
        assert taps[0].shape[0] == depth + 1
        accepted += v[0]
    assert accepted >= 8  # the trees reached past the first draft, not only rejections


class OracleHead:
    """A real (random) head whose candidates are replaced, on the device, by the reference greedy
    text's next tokens at shuffled ranks among the first three: deep partial accepts through second
    and third candidates, with nothing read on the host. Everything else is the head's own."""

    def __init__(self, drafter, reference: list[int], seed: int):
        self.drafter, self.ref = drafter, mx.array(reference + [0] * 16, dtype=mx.uint32)
        self.rng = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft_top_at(self, rows, rows_at, pending, cap, k, at, *, compiled=False):
        top, logp = self.drafter.draft_top_at(rows, rows_at, pending, cap, k, at, compiled=compiled)
        truth = mx.take(self.ref, at + 1 + mx.arange(cap))  # the tokens after the pending one (at `at`)
        rank = mx.array(self.rng.integers(0, 3, size=cap))
        slots = mx.arange(k)[None] == rank[:, None]
        top = mx.where(slots, truth[:, None], mx.where(top == truth[:, None], (top + 1) % 64, top))
        logp = mx.broadcast_to(mx.array(np.log(np.linspace(0.5, 0.05, k)).astype(np.float32))[None], (cap, k))
        return top, logp


def test_pipelined_trees_are_lossless_greedy(qwen3, greedy_refs, tiny_dirs, tmp_path):
    from dspark_lab.engine.generate import _setup
    from dspark_lab.engine.text import TextStream
    from dspark_lab.engine.tree_pipeline import tree_pipelined_loop

    target, tok = qwen3
    drafter = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0), target)
    deep = 0
    for i, p in enumerate(PROMPTS[:6]):
        params, ids = _setup(target, tok, p, 24, 0.0, 1.0, 0, None, True)
        oracle = OracleHead(drafter, ids + greedy_refs[p], seed=i)
        for compile_draft in (True, False):
            r = tree_pipelined_loop(target, ids, params, oracle, nodes=12, max_new_tokens=24, cap=4,
                                    stream=TextStream(tok, None, None), compile_draft=compile_draft)
            assert r.token_ids == greedy_refs[p], (p, compile_draft)
            assert r.mode == "dspark-tree" and len(r.accept_lengths) == r.num_rounds and r.host_reads == r.num_rounds + 1
        deep += sum(a > 2 for a in r.accept_lengths)
    assert deep > 10
    # the real head through speculative_generate(pipeline=True): the same tokens
    for p in PROMPTS[:4] + REPETITIVE[:2]:
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, tree_nodes=8, pipeline=True)
        assert r.token_ids == greedy_refs[p]


@pytest.mark.parametrize("ask,match", [(dict(temperature=0.8), "sampling"), (dict(lookup_drafts=True, lookup_kernel=True), "lookup kernel")])
def test_pipelined_trees_refuse_what_they_cannot_do(qwen3, tiny_dirs, tmp_path, ask, match):
    target, tok = qwen3
    drafter = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0), target)
    with pytest.raises(InputError, match=match):
        speculative_generate(target, tok, drafter, PROMPTS[0], max_new_tokens=8, max_draft_tokens=4, tree_nodes=8, pipeline=True, **ask)


def test_a_lookup_branch_joins_the_pipelined_tree(qwen3, greedy_refs, tiny_dirs, tmp_path):
    """With lookup drafts the match's continuation joins each tree as a chain below the root: on
    repetitive prompts it carries most of what is accepted (the random head accepts little), and
    the output stays the greedy tokens."""
    target, tok = qwen3
    drafter = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0), target)
    with_lookup = without = 0
    for p in REPETITIVE:
        on = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, tree_nodes=6, pipeline=True,
                                  lookup_drafts=True)
        off = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, tree_nodes=6, pipeline=True)
        assert on.token_ids == off.token_ids == greedy_refs[p], p
        assert set(on.draft_lengths) == {6 + 4} and set(off.draft_lengths) == {6}
        with_lookup += on.num_tokens / on.num_rounds
        without += off.num_tokens / off.num_rounds
    assert with_lookup > without


def test_superset_sizes_grow_with_the_tree_not_the_paths():
    sizes = [len(superset_paths(n, 7, 8)) for n in (8, 16, 32)]
    assert sizes == sorted(sizes) and sizes[1] < 16 * 8 * 7
    assert superset_paths(1, 7, 8) == [(0,)]
    assert list(itertools.islice(superset_paths(3, 3, 8), 3)) == [(0,), (0, 0), (0, 0, 0)]
