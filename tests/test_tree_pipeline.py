"""Pipelined tree drafts (engine/tree_pipeline.py): the tree chosen on the device is the host's
best-first tree, the on-device verdict is the host walk's, and generation is the greedy tokens at
temperature 0 and the target's distribution above it."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from conftest import PROMPTS, REPETITIVE, assert_same_token_distribution
from dspark_lab import greedy_generate, speculative_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.sampling import residual_sample, tree_sampled_choice
from dspark_lab.engine.tree import TreeLayout, best_paths, walk_greedy, walk_sampled
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

    def draft_top_at(self, rows, rows_at, pending, cap, k, at, *, compiled=False, then=None, then_key=()):
        top, logp = self.drafter.draft_top_at(rows, rows_at, pending, cap, k, at, compiled=compiled)
        truth = mx.take(self.ref, at + 1 + mx.arange(cap))  # the tokens after the pending one (at `at`)
        rank = mx.array(self.rng.integers(0, 3, size=cap))
        slots = mx.arange(k)[None] == rank[:, None]
        top = mx.where(slots, truth[:, None], mx.where(top == truth[:, None], (top + 1) % 64, top))
        logp = mx.broadcast_to(mx.array(np.log(np.linspace(0.5, 0.05, k)).astype(np.float32))[None], (cap, k))
        return (top, logp) if then is None else then(pending, top, logp)


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


class FixedCaps:  # a cap controller's interface
    def cap(self):
        return 3

    def observe(self, drafted, committed, seconds):
        pass


@pytest.mark.parametrize("ask,match", [(dict(cap_controller=FixedCaps()), "cap controller"), (dict(lookup_drafts=True, lookup_kernel=True), "lookup kernel")])
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


def test_the_device_sampled_walk_is_the_host_walks():
    """tree_sampled_choice keeps the path walk_sampled takes, over random trees, distributions and
    draws; a row not allowed, or repeating an earlier sibling's token, is never tried."""
    rng = np.random.default_rng(3)
    vocab, agree = 12, 0
    for trial in range(300):
        n = int(rng.integers(2, 12))
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parent[i]] + 1
        lay = TreeLayout(parent, depth, [0] * n)
        ids = [int(t) for t in rng.integers(0, vocab, size=n)]
        for i in range(1, n):  # distinct tokens among siblings, as the host's trees have them
            while any(ids[j] == ids[i] for j in range(1, i) if parent[j] == parent[i]):
                ids[i] = (ids[i] + 1) % vocab
        p = rng.dirichlet(np.full(vocab, 0.3), size=n).astype(np.float32)
        for i in range(1, n):  # mass on the drafted tokens, so deep accepts happen
            p[parent[i], ids[i]] += rng.uniform(0, 2)
        p /= p.sum(axis=1, keepdims=True)
        uniform = rng.uniform(size=n).astype(np.float32)
        allowed = rng.uniform(size=n) < (0.8 if trial % 3 == 0 else 1.0)
        child_p = [float(p[parent[i], ids[i]]) if i and allowed[i] else 0.0 for i in range(n)]
        want, _ = walk_sampled(lay, child_p, uniform.tolist(), [0] * n)
        par = mx.array([0] + parent[1:], dtype=mx.int32)
        chosen, tried = tree_sampled_choice(mx.array(p), mx.array(ids, dtype=mx.uint32), par, mx.array(allowed), mx.array(uniform))
        chosen = np.array(chosen)
        assert not chosen[0] and np.array(tried).tolist() == [False] + allowed[1:].tolist()
        got = [0]
        while True:
            kids = [c for c in range(1, n) if parent[c] == got[-1] and chosen[c]]
            assert len(kids) <= 1
            if not kids:
                break
            got += kids
        assert got == want, trial
        agree += len(got) > 2
    assert agree > 20  # deep paths were compared, not only rejections at the root
    # a repeated sibling token: only its first copy is tried
    p = mx.array(np.full((3, 4), 0.25, dtype=np.float32))
    chosen, tried = tree_sampled_choice(p, mx.array([0, 2, 2], dtype=mx.uint32), mx.array([0, 0, 0]), mx.ones((3,), dtype=mx.bool_),
                                        mx.array([0.0, 0.9, 0.0]))
    assert np.array(tried).tolist() == [False, True, False] and not np.array(chosen).any()


def test_the_residual_sample_leaves_the_rejected_tokens_out():
    p = mx.array([0.1, 0.2, 0.3, 0.4])
    mx.random.seed(0)
    draws = [residual_sample(p, mx.array([9, 3, 1], dtype=mx.uint32)[1:], mx.array([True, False])).item() for _ in range(2000)]
    counts = np.bincount(draws, minlength=4)
    assert counts[3] == 0 and abs(counts[2] / counts[1] - 1.5) < 0.3  # token 3 removed; the rest in proportion 0.1:0.2:0.3
    assert 0.1 < counts[0] / 2000 < 0.24


class TargetOracleHead:
    """A head whose candidates come, on the device, from the target itself: at each of `cap`
    positions after the pending token, the target's k likeliest tokens along its greedy path, read
    from a copy of the run's own cache (nothing read on the host). Sampled paths leave the greedy
    one, so deep accepts come partly, as they would from a good head."""

    def __init__(self, drafter, target, monkeypatch):
        self.drafter, self.target, self.cache = drafter, target, None
        make = target.make_cache

        def make_and_keep():  # the last cache made is the run's (InFlight makes it before the first draft)
            self.cache = make()
            return self.cache

        monkeypatch.setattr(target, "make_cache", make_and_keep)

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft_top_at(self, rows, rows_at, pending, cap, k, at, *, compiled=False, then=None, then_key=()):
        import copy

        from dspark_lab.engine.topk import top_k_indices

        copies = [copy.copy(c) for c in self.cache]  # the run's cache: its rows before `at` are committed
        for c in copies:
            c.ensure(c.keys.shape[2] + cap + 1)
        tops, logps, token = [], [], pending
        for d in range(cap):
            logits, _ = self.target._at_offset[True].run(token, copies, at + d, last_only=True)
            logp = logits[-1].astype(mx.float32) - mx.logsumexp(logits[-1].astype(mx.float32))
            top = top_k_indices(logp, k)
            top = top[mx.argsort(-logp[top])]
            tops.append(top)
            logps.append(logp[top])
            token = top[:1].astype(mx.uint32)
        top, logp = mx.stack(tops).astype(mx.uint32), mx.stack(logps)
        return (top, logp) if then is None else then(pending, top, logp)


@pytest.mark.parametrize("lookup", [False, True])
def test_pipelined_trees_sample_the_target(qwen3, tiny_dirs, tmp_path, monkeypatch, lookup):
    """Tokens 2-4 sampled through pipelined trees follow plain sampling's distribution (chi-square,
    ALPHA), with candidates good enough that most rounds accept drafts; with a lookup branch too
    (its chain widens every tree, its rows allowed only where the match reaches; repeated sibling
    tokens are covered by test_the_device_sampled_walk_is_the_host_walks)."""
    from dspark_lab.engine.generate import _setup
    from dspark_lab.engine.speculative import LOOKUP_NS
    from dspark_lab.engine.text import TextStream
    from dspark_lab.engine.tree_pipeline import tree_pipelined_loop

    target, tok = qwen3
    drafter = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0), target)
    oracle = TargetOracleHead(drafter, target, monkeypatch)
    prompt, n = REPETITIVE[1], 1000
    params = dict(max_new_tokens=4, temperature=1.0, top_k=3, apply_chat_template=False)
    plain = [greedy_generate(target, tok, prompt, seed=s, **params).token_ids for s in range(n)]
    runs = []
    for s in range(n):
        p, ids = _setup(target, tok, prompt, 4, 1.0, 1.0, 3, 7000 + s, False)
        runs.append(tree_pipelined_loop(target, ids, p, oracle, nodes=6, max_new_tokens=4, cap=3, stream=TextStream(tok, None, None),
                                        lookup_n=LOOKUP_NS if lookup else ()))
    assert sum(sum(a - 1 for a in r.accept_lengths) for r in runs) > n  # drafts were accepted
    assert set(runs[0].draft_lengths) == {6 + 3 if lookup else 6}
    assert_same_token_distribution(plain, [r.token_ids for r in runs], (1, 2, 3))
    if lookup:
        return
    # and through speculative_generate with the real head: sampled, not greedy, and seeded
    a, b = (speculative_generate(target, tok, drafter, PROMPTS[0], max_new_tokens=12, max_draft_tokens=3, tree_nodes=6,
                                 pipeline=True, temperature=1.0, seed=5).token_ids for _ in range(2))
    assert a == b
    speculative_generate(target, tok, drafter, PROMPTS[0], max_new_tokens=12, max_draft_tokens=3, tree_nodes=6, pipeline=True,
                         temperature=1.0, seed=6)
    traces = [k for k in target._at_offset[True]._fns if k[0] == "tree-round" and k[3] == (1.0, 1.0, 0)]
    assert len(traces) == 1  # one trace for every seed of a distribution
