"""engine/cache_move.py off CUDA: the tree path's move in MLX operations (the kernel's stand-in and
reference) and the tree loop's use of whatever mover the target is given."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import numpy as np
import pytest

from dspark_lab.engine import cache_move


def test_the_move_puts_the_paths_rows_after_the_offset_in_path_order_and_leaves_the_rest():
    rng = np.random.default_rng(0)
    arrays = [mx.array(rng.standard_normal((1, 2, 24, 8)).astype(np.float32)) for _ in range(3)]
    path = np.array([0, 3, 4, 6])  # the root, then the kept rows at depths 1..3
    got = cache_move.moved_by_operations(arrays, mx.array(10, dtype=mx.int32), mx.array(path))
    for a, g in zip(arrays, got):
        want = np.array(a)
        want[:, :, 10:14] = np.array(a)[:, :, 10 + path]
        assert np.array_equal(np.array(g), want)


def test_the_kernel_takes_one_layout_only_and_says_it_needs_cuda():
    assert cache_move.same_layout([mx.zeros((1, 2, 8, 4))] * 3)
    assert not cache_move.same_layout([mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 16, 4))])
    assert not cache_move.same_layout([mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 8, 4), dtype=mx.bfloat16)])
    assert not cache_move.same_layout([])
    if cache_move.cuda_available():
        pytest.skip("a CUDA backend is here")
    with pytest.raises(RuntimeError, match="CUDA"):
        cache_move.cache_move_kernel()


def test_a_pipelined_tree_moves_its_paths_with_the_targets_mover_and_stays_lossless(tmp_path):
    """The tree round calls the mover it is given (once a trace: one call moves every layer) and
    the tokens stay the greedy ones; putting MLX's operations back drops the traces that kept it."""
    from conftest import PROMPTS
    from dspark_lab import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "qwen3", "qwen3", seed=5)
    target, tok = load_target(model)
    head = load_dspark(build_tiny_dspark(tmp_path / "h", model, markov_rank=0), target)
    calls = []

    def mover(arrays, offset, path):
        calls.append(len(arrays))
        return cache_move.moved_by_operations(arrays, offset, path)

    target.move_tree_paths_with(mover)
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        want = greedy_generate(target, tok, ids, max_new_tokens=16).token_ids
        got = speculative_generate(target, tok, head, ids, max_new_tokens=16, max_draft_tokens=4, tree_nodes=8, pipeline=True)
        assert got.token_ids == want, prompt
    layers = len(target.make_cache())
    assert calls and set(calls) == {2 * layers}
    target.move_tree_paths_with(None)
    calls.clear()
    speculative_generate(target, tok, head, tok.encode(PROMPTS[0]), max_new_tokens=8, max_draft_tokens=4, tree_nodes=8, pipeline=True)
    assert calls == []
