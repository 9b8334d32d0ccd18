"""Tree drafts (engine/tree.py): the tree forward reproduces plain forwards of each path, the
best-first tree is the likeliest paths, and generation through trees is lossless: the greedy
tokens at temperature 0, the target's distribution at temperature > 0."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from conftest import FAMILIES, PROMPTS, REPETITIVE, assert_same_token_distribution
from dspark_lab import greedy_generate, speculative_generate
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.engine.tree import TreeLayout, best_paths, tree_loop, walk_greedy, walk_sampled
from dspark_lab.engine.generate import _setup
from dspark_lab.engine.text import TextStream
from dspark_lab.errors import InputError, LoadError
from dspark_lab.tiny import build_tiny_dspark


def test_best_paths_are_the_likeliest_and_a_tree():
    rng = np.random.default_rng(0)
    depth, k = 4, 3
    logp = np.sort(np.log(rng.dirichlet(np.ones(6), size=depth))[:, :k], axis=1)[:, ::-1]
    every = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    score = {p: sum(logp[i, r] for i, r in enumerate(p)) for p in every}
    for nodes in (1, 5, 12, 30):
        got = best_paths(logp, nodes)
        assert len(got) == nodes and len(set(got)) == nodes
        assert all(len(p) == 1 or p[:-1] in got for p in got)  # every parent is in: a tree
        # no path left out is likelier than the least likely one taken
        assert max(score[p] for p in every if p not in got) <= min(score[p] for p in got) + 1e-12
    assert best_paths(logp, 0) == [] and best_paths(logp[:0], 4) == []


def test_layout_is_breadth_first_with_ancestors():
    lay = TreeLayout.from_paths([(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)])
    assert lay.depth == [0, 1, 1, 2, 2, 2, 3]
    assert lay.parent == [-1, 0, 0, 1, 1, 2, 3]
    assert lay.children()[1] == [3, 4]
    anc = lay.ancestors()
    assert anc[6].tolist() == [True, True, False, True, False, False, True]
    with pytest.raises(ValueError, match="no parent"):
        TreeLayout.from_paths([(0, 1)])


def test_walk_greedy_follows_the_targets_argmax():
    lay = TreeLayout.from_paths([(0,), (1,), (0, 0), (1, 0)])  # root; a=1, b=2; a's child 3, b's child 4
    tokens = [9, 5, 6, 7, 8]
    assert walk_greedy(lay, tokens, [6, 0, 8, 0, 0]) == ([0, 2, 4], 0)  # b, then b's child, then the target's 0
    assert walk_greedy(lay, tokens, [4, 0, 0, 0, 0]) == ([0], 4)  # nothing agrees: the target's own token


def test_walk_sampled_gives_the_targets_distribution():
    """One node with three candidate children: the token leaving it follows p exactly."""
    p = np.array([0.1, 0.3, 0.2, 0.4])  # tokens 0..3; children draft tokens 3, 1, 0 in that order
    lay = TreeLayout.from_paths([(0,), (1,), (2,)])
    tokens = [9, 3, 1, 0]
    child_p = [0.0, p[3], p[1], p[0]]
    rng = np.random.default_rng(1)
    counts = np.zeros(4)
    n = 40000
    for _ in range(n):
        path, nxt = walk_sampled(lay, child_p, rng.uniform(size=4).tolist(), [2, 0, 0, 0])  # the residual: token 2 only
        counts[tokens[path[1]] if len(path) > 1 else nxt] += 1
    from scipy import stats

    assert stats.chisquare(counts, p * n).pvalue > 1e-3


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_reproduces_each_path(tiny_models, family, compiled):
    """Both tree forwards: the compiled trace (padding rows, device-built mask) and op by op."""
    target, _ = tiny_models[family]
    target.tree_compiled = compiled
    try:
        assert target.check_tree_forward() <= 1e-5  # float32: rounding at most
    finally:
        target.tree_compiled = True


@pytest.mark.parametrize("claimed_rounding", [0.0, 1.0])
def test_tree_check_refuses_rows_at_wrong_depths(tiny_models, monkeypatch, claimed_rounding):
    """A tree fed with every row at depth 0 is refused, also where the chain's rounding is claimed
    huge (the limit never rises above TREE_RTOL_CEILING); the chain's own rounding here is tiny."""
    from dspark_lab.engine.target import TREE_RTOL_CEILING

    target, _ = tiny_models[FAMILIES[0]]
    assert target.chain_rounding([3, 5, 7, 9, 11, 13]) <= 1e-5  # float32 on the CPU
    real = target.forward_tree
    monkeypatch.setattr(target, "forward_tree", lambda ids, depth, *a, **k: real(ids, [0] * len(depth), *a, **k))
    monkeypatch.setattr(target, "chain_rounding", lambda *a: claimed_rounding)
    monkeypatch.setattr(target, "_tree_checked", {})
    with pytest.raises(LoadError, match=f"limit {max(1e-3, min(4 * claimed_rounding, TREE_RTOL_CEILING)):.1e}"):
        target.check_tree_forward()


class OracleSource:
    """Tree candidates from the target itself along its greedy path, their ranks shuffled among
    the first three (so kept paths run through second and third candidates too): deep trees get
    accepted, partly, on a random tiny target."""

    def __init__(self, target, seed: int = 0, shuffle: bool = True):
        self.target, self.rng, self.shuffle = target, np.random.default_rng(seed), shuffle
        self.taps, self.max_depth, self.history = (), 4, []
        self.graft_rows = 0

    def start(self, prompt_ids, prompt_taps):
        self.history = list(prompt_ids)

    def extra_paths(self, depth):
        return []

    def candidates(self, pending, depth, k):
        ctx = list(self.history)  # the pending token is the last committed one
        assert ctx[-1] == pending
        logits = self.target.forward(mx.array(ctx, dtype=mx.uint32), self.target.make_cache()).logits
        tops = []
        for _ in range(depth):
            row = np.array(logits[-1].astype(mx.float32))
            top = list(np.argsort(-row)[:k])
            ctx.append(int(top[0]))
            if self.shuffle:
                head = top[:3]
                self.rng.shuffle(head)
                top[:3] = head
            tops.append(top)
            logits = self.target.forward(mx.array(ctx, dtype=mx.uint32), self.target.make_cache()).logits
        logp = np.log(np.linspace(0.5, 0.05, k))[None].repeat(depth, axis=0)
        return mx.array(np.array(tops, dtype=np.uint32)), mx.array(logp.astype(np.float32))

    def commit(self, tokens, taps):
        self.history += tokens


def oracle_generate(target, tok, prompt, *, nodes, seed=0, max_new_tokens=24):
    """The tree loop with OracleSource on a chat-templated prompt, greedy."""
    params, ids = _setup(target, tok, prompt, max_new_tokens, 0.0, 1.0, 0, None, True)
    return tree_loop(target, ids, params, OracleSource(target, seed), nodes=nodes, max_new_tokens=max_new_tokens,
                     cap=4, stream=TextStream(tok, None, None))


@pytest.mark.parametrize("nodes,compiled", [(1, True), (3, True), (8, True), (20, True), (8, False)])
def test_tree_generation_is_lossless_greedy(qwen3, greedy_refs, nodes, compiled):
    """Trees of the target's own candidates, shuffled: many rounds keep several tokens, some
    through second or third candidates, and the output is the greedy tokens, through the
    compiled tree forward and the op-by-op one alike (the same rounds)."""
    target, tok = qwen3
    kept_past_first = 0
    target.tree_compiled = compiled
    try:
        for i, p in enumerate(PROMPTS[:6]):
            r = oracle_generate(target, tok, p, nodes=nodes, seed=i)
            assert r.token_ids == greedy_refs[p], p
            kept_past_first += sum(a > 2 for a in r.accept_lengths)
            assert r.mode == "dspark-tree" and len(r.accept_lengths) == r.num_rounds
    finally:
        target.tree_compiled = True
    if nodes >= 8:
        assert kept_past_first > 10


def test_tree_generation_with_a_real_head(qwen3, greedy_refs, tiny_dirs, tmp_path):
    target, tok = qwen3
    drafter = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0), target)
    for p in PROMPTS[:6]:
        r = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, tree_nodes=12, lookup_drafts=False)
        assert r.token_ids == greedy_refs[p]
        assert max(r.draft_lengths) == 12


def test_lookup_paths_join_the_tree(qwen3, greedy_refs, tiny_dirs, tmp_path):
    """With lookup drafts (the default), a long n-gram match's continuation is grafted onto the
    random head's tree: on repetitive prompts it carries most of what is accepted, losslessly."""
    target, tok = qwen3
    drafter = load_dspark(build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0), target)
    with_lookup = without = 0
    for p in REPETITIVE:
        on = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, tree_nodes=6)
        off = speculative_generate(target, tok, drafter, p, max_new_tokens=24, max_draft_tokens=4, tree_nodes=6, lookup_drafts=False)
        assert on.token_ids == off.token_ids == greedy_refs[p], p
        assert max(off.draft_lengths) <= 6 and max(on.draft_lengths) <= 6 + 4
        with_lookup += on.num_tokens / on.num_rounds
        without += off.num_tokens / off.num_rounds
    assert with_lookup > without


def test_graft_shares_the_nodes_it_agrees_with():
    lay = TreeLayout.from_paths([(0,), (1,), (0, 0)])  # root 9; children 5, 6; 5's child 7
    tokens = [9, 5, 6, 7]
    lay.graft(tokens, [5, 8, 4])
    assert tokens == [9, 5, 6, 7, 8, 4] and lay.parent == [-1, 0, 0, 1, 1, 4] and lay.depth[-2:] == [2, 3]
    lay.graft(tokens, [5, 7])  # wholly in the tree already
    assert len(lay) == 6
    assert lay.ancestors()[5].tolist() == [True, True, False, False, True, True]


def test_tree_sampling_is_exact(qwen3):
    """Tokens 2-4 sampled through trees follow plain sampling's distribution (chi-square, ALPHA)."""
    target, tok = qwen3
    prompt, n = REPETITIVE[1], 300
    params = dict(max_new_tokens=4, temperature=1.0, top_k=3, apply_chat_template=False)
    plain = [greedy_generate(target, tok, prompt, seed=s, **params).token_ids for s in range(n)]
    runs = []
    for s in range(n):
        mx.random.seed(7000 + s)
        p, ids = _setup(target, tok, prompt, 4, 1.0, 1.0, 3, None, False)
        runs.append(tree_loop(target, ids, p, OracleSource(target, s), nodes=8, max_new_tokens=4, cap=3,
                              stream=TextStream(tok, None, None)))
    assert sum(sum(a - 1 for a in r.accept_lengths) for r in runs) > n  # drafts were accepted
    assert_same_token_distribution(plain, [r.token_ids for r in runs], (1, 2, 3))


def test_tree_refuses_what_it_cannot_do(qwen3, heads):
    target, tok = qwen3
    markov = load_dspark(heads["qwen3"], target)
    with pytest.raises(InputError, match="Markov term"):
        speculative_generate(target, tok, markov, "hi", tree_nodes=8, max_draft_tokens=3)
    with pytest.raises(InputError, match="Markov term"):  # pipelined or not
        speculative_generate(target, tok, markov, "hi", tree_nodes=8, max_draft_tokens=3, pipeline=True)
    with pytest.raises(InputError, match="cannot be combined with confidence_threshold"):
        speculative_generate(target, tok, markov, "hi", tree_nodes=8, max_draft_tokens=3, confidence_threshold=0.5)
    with pytest.raises(InputError, match="tree_nodes must be >= 0"):
        speculative_generate(target, tok, markov, "hi", tree_nodes=-1, max_draft_tokens=3)


def test_tree_accept_counts_what_the_engine_decodes(qwen3, tiny_dirs, tmp_path):
    """benchmarks/tree_accept.py on the tiny pair: `measure` + `trees` count the chain as the
    engine's chain, and `decode` finds every tree round's accepted drafts equal to the
    teacher-forced count at its anchor, with the greedy tokens."""
    import gzip
    import json
    import subprocess
    import sys

    from scripts import BENCHMARKS

    target, tok = qwen3
    head = build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0, block_size=5)
    rows = tmp_path / "rows.jsonl.gz"
    with gzip.open(rows, "wt") as f:
        for i, p in enumerate(PROMPTS[:3]):
            ids = tok.encode(p)
            out = greedy_generate(target, tok, ids, max_new_tokens=20).token_ids
            f.write(json.dumps({"ids": ids + out, "prompt_len": len(ids), "set": "code", "prompt_id": f"p{i}"}) + "\n")
    common = ["--model", str(tiny_dirs["qwen3"]), "--head", str(head), "--data", str(rows), "--cap", "4", "--drafter-bits", "16"]
    run = lambda *a: subprocess.run([sys.executable, str(BENCHMARKS / "tree_accept.py"), *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300)
    r = run("measure", *common, "--out", str(tmp_path / "r.npz"))
    assert r.returncode == 0, r.stderr
    r = run("trees", str(tmp_path / "r.npz"), "--budgets", "4,8", "--json", str(tmp_path / "t.json"), "--chart", str(tmp_path / "c.json"))
    assert r.returncode == 0, r.stderr
    spec = json.loads((tmp_path / "c.json").read_text())
    points = [v for layer in spec["layer"] for v in layer["data"].get("values", [])] if "layer" in spec else []
    points = points or [v for d in spec.get("datasets", {}).values() for v in d]
    assert {p["tree"] for p in points if "tree" in p} == {"chain", "static tree", "dynamic tree"}
    got = json.loads((tmp_path / "t.json").read_text())["results"]
    assert set(got) == {"chain (top-1)", "static tree 4", "static tree 8", "dynamic tree 4", "dynamic tree 8"}
    assert got["dynamic tree 8"]["every_anchor"] >= got["chain (top-1)"]["every_anchor"] >= 1.0
    r = run("decode", *common, "--nodes", "8", "--ranks", str(tmp_path / "r.npz"), "--json", str(tmp_path / "d.json"))
    assert r.returncode == 0, r.stderr
    decoded = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert len(decoded) == 3 and all(d["same_tokens"] and d["equal"] for d in decoded)


def test_lossless_check_runs_tree_arms(tiny_dirs, tmp_path):
    import json
    import subprocess
    import sys

    from scripts import BENCHMARKS

    head = build_tiny_dspark(tmp_path / "h", tiny_dirs["qwen3"], markov_rank=0, block_size=5)
    r = subprocess.run([sys.executable, str(BENCHMARKS / "lossless_check.py"), "--model", str(tiny_dirs["qwen3"]), "--head", str(head),
                        "--cap", "4", "--tree-nodes", "3,9", "--tree-plain", "9", "--tree-pipe", "9", "--pipe-arm", "--prompts", "code", "--limit", "2",
                        "--max-new-tokens", "16", "--no-lookup-arm", "--out", str(tmp_path / "o.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert sorted({x["arm"] for x in rows}) == ["dspark", "dspark-pipe", "dspark-tree3", "dspark-tree9", "dspark-tree9-pipe", "dspark-tree9-plain"]
    assert all(x["identical"] for x in rows) and "12/12 identical" in r.stdout
    by_arm = {(x["prompt"], x["arm"]): x for x in rows}  # compiled or not, the same rounds
    assert all(by_arm[(p, "dspark-tree9")]["accept_lengths"] == by_arm[(p, "dspark-tree9-plain")]["accept_lengths"] for p, _ in by_arm)
    # with --lookup-drafts both pipelined arms match n-grams on the device: still the greedy text
    r = subprocess.run([sys.executable, str(BENCHMARKS / "lossless_check.py"), "--model", str(tiny_dirs["qwen3"]), "--head", str(head),
                        "--cap", "4", "--tree-pipe", "9", "--pipe-arm", "--lookup-drafts", "--prompts", "copy", "--limit", "1",
                        "--max-new-tokens", "16", "--no-lookup-arm", "--out", str(tmp_path / "l.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "l.json").read_text())["rows"]
    assert {x["arm"] for x in rows} == {"dspark", "dspark-pipe", "dspark-tree9-pipe"} and all(x["identical"] for x in rows)


def test_the_device_script_evaluates_then_sweeps_each_model(tmp_path):
    """benchmarks/h200_trees.sh with python3 stubbed: per model the tree check, the evaluation (chain
    and trees, cap 7, 8 prompts a set) then the sweep (tree arms beside the chain's), into OUT/NAME."""
    import os
    import subprocess

    from scripts import BENCHMARKS

    bin_dir, heads, out = tmp_path / "bin", tmp_path / "heads", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/usr/bin/env bash\necho "$*" >> "$CALLS"\n')
    (bin_dir / "python3").chmod(0o755)
    for name in ("qwen15", "qwen05"):
        (heads / name).mkdir(parents=True)
        (heads / name / "config.json").write_text("{}")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"), "HEADS": str(heads),
           "OUT": str(out), "TREES": "16,32"}
    r = subprocess.run(["bash", str(BENCHMARKS / "h200_trees.sh"), "qwen15", "qwen05"], env=env, capture_output=True, text=True,
                       cwd=BENCHMARKS.parent)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 6 and all("tree_check.py /root/ship/" in calls[i] for i in (0, 3))  # the tree check first, per model
    calls = [c for c in calls if "tree_check.py" not in c]
    assert "lossless_check.py" in calls[0] and "-m dspark_lab sweep" in calls[1]
    assert f"--head {heads}/qwen15 " in calls[0] and "--tree-nodes 16,32" in calls[0] and "--cap 7" in calls[0]
    assert "--tree-plain 16 " in calls[0] and "--tree-pipe 16,32 " in calls[0] and "--pipe-arm" in calls[0]
    assert "--modes dspark,dspark-pipe,dspark-tree,dspark-tree-pipe " in calls[1] and "--tree-nodes 16 " in calls[1] and f"{out}/qwen15/sweep.json" in calls[1]
    assert "qwen2.5-coder-0.5b" in calls[2] and (out / "qwen05").is_dir()
    # The round's parts timed first, then both evaluations, on the stored weights and on their bf16 copy
    (tmp_path / "calls").unlink()
    r = subprocess.run(["bash", str(BENCHMARKS / "h200_trees.sh"), "qwen05"], env={**env, "PARTS": "1", "PRECISIONS": "stored,dequantized",
                       "SWEEP": "0", "PARTS_NODES": "7,16"}, capture_output=True, text=True, cwd=BENCHMARKS.parent)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()[1:]  # after the tree check
    assert [c.split()[0] for c in calls] == ["benchmarks/tree_round_parts.py", "benchmarks/lossless_check.py"] * 2
    assert "--dequantize" not in calls[0] + calls[1] and all("--dequantize" in c for c in calls[2:])
    assert "--nodes 7,16 " in calls[0] and f"{out}/qwen05/parts_dequantized.json" in calls[2]
    assert f"{out}/qwen05/eval_trees.json" in calls[1] and f"{out}/qwen05/eval_trees_dequantized.json" in calls[3]
    odd = subprocess.run(["bash", str(BENCHMARKS / "h200_trees.sh"), "qwen05"], env={**env, "PRECISIONS": "float8"},
                         capture_output=True, text=True, cwd=BENCHMARKS.parent)
    assert odd.returncode == 2 and "unknown precision float8" in odd.stdout
    bad = subprocess.run(["bash", str(BENCHMARKS / "h200_trees.sh"), "qwen7"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown model qwen7" in bad.stdout
    env["HEADS"] = str(tmp_path / "none")
    missing = subprocess.run(["bash", str(BENCHMARKS / "h200_trees.sh"), "qwen15"], env=env, capture_output=True, text=True)
    assert missing.returncode == 2 and "no head at" in missing.stdout


def test_the_classifier_gets_each_tree_arms_verify_rows():
    """lab/sweep.tree_verify_rows: the rows the arm's forward really feeds, padding included, so
    the mismatch classifier's tree forward rounds as the arm's did: the plain tree loop's graft
    rows with lookup, the pipelined one's tree (capped by its superset) plus a cap-deep lookup
    chain with lookup; sweep_tree_rows as the sweep runs them (plain trees always with lookup)."""
    from dspark_lab.engine.tree_pipeline import DeviceTree
    from dspark_lab.lab.sweep import sweep_tree_rows, tree_verify_rows

    assert tree_verify_rows(False, 16, 7, 7, True) == 16 + 1 + 7
    assert tree_verify_rows(False, 16, 7, 7, False) == 17
    assert tree_verify_rows(True, 16, 7, 7, False) == 17
    assert tree_verify_rows(True, 16, 7, 7, True) == 17 + 7
    assert tree_verify_rows(True, 16, 4, 7, True) == 17 + 4
    assert tree_verify_rows(True, 16, 1, 7, False) == DeviceTree(16, 1).width == 9  # one position: its 8 candidates
    assert sweep_tree_rows("dspark-tree", 16, "7", 7, False) == 24 and sweep_tree_rows("dspark-tree-pipe", 16, "7", 7, False) == 17
    assert sweep_tree_rows("dspark-pipe", 16, "7", 7, True) == 0
