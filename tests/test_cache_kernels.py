"""engine/cache_kernels.py off CUDA: the cache's writes and the tree path's move in MLX operations
(the kernels' stand-ins and references), and the loops' use of whatever writer and mover the
target is given."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import numpy as np
import pytest

from dspark_lab.engine import cache_kernels


def test_the_move_puts_the_paths_rows_after_the_offset_in_path_order_and_leaves_the_rest():
    rng = np.random.default_rng(0)
    arrays = [mx.array(rng.standard_normal((1, 2, 24, 8)).astype(np.float32)) for _ in range(3)]
    path = np.array([0, 3, 4, 6])  # the root, then the kept rows at depths 1..3
    got = cache_kernels.moved_by_operations(arrays, mx.array(10, dtype=mx.int32), mx.array(path))
    for a, g in zip(arrays, got):
        want = np.array(a)
        want[:, :, 10:14] = np.array(a)[:, :, 10 + path]
        assert np.array_equal(np.array(g), want)


def test_the_write_puts_the_new_rows_at_the_offset_and_leaves_the_rest():
    rng = np.random.default_rng(1)
    keys, values = (rng.standard_normal((1, 2, 16, 4)).astype(np.float32) for _ in range(2))
    new = rng.standard_normal((1, 3, 2, 4)).astype(np.float32).transpose(0, 2, 1, 3)  # strided, as a model's rows come
    k, v = cache_kernels.written_by_operations(mx.array(keys), mx.array(values), mx.array(new), mx.array(new) * 2,
                                               mx.array(5, dtype=mx.int32))
    want_k, want_v = keys.copy(), values.copy()
    want_k[:, :, 5:8], want_v[:, :, 5:8] = new, new * 2
    assert np.array_equal(np.array(k), want_k) and np.array_equal(np.array(v), want_v)


def test_the_kernels_take_one_layout_only_and_say_they_need_cuda():
    assert cache_kernels.same_layout([mx.zeros((1, 2, 8, 4))] * 3)
    assert not cache_kernels.same_layout([mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 16, 4))])
    assert not cache_kernels.same_layout([mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 8, 4), dtype=mx.bfloat16)])
    assert not cache_kernels.same_layout([])
    if cache_kernels.cuda_available():
        pytest.skip("a CUDA backend is here")
    with pytest.raises(RuntimeError, match="CUDA"):
        cache_kernels.cache_move_kernel()
    with pytest.raises(RuntimeError, match="CUDA"):
        cache_kernels.cache_write_kernel()


def test_buffers_past_the_copy_limit_are_left_to_mlxs_in_place_operations(monkeypatch):
    """Both kernels write whole buffers anew, so a buffer past COPY_LIMIT goes to MLX's updates:
    here the kernel builder is a stand-in (no CUDA), and only the small buffers reach it."""
    launched = []

    def fake_kernel(**spec):
        def run(*, inputs, output_shapes, **_):
            launched.append(spec["name"])
            return [mx.zeros(shape) for shape in output_shapes]
        return run

    monkeypatch.setattr(cache_kernels, "cuda_available", lambda: True)
    monkeypatch.setattr(cache_kernels.mx.fast, "cuda_kernel", fake_kernel)
    monkeypatch.setattr(cache_kernels, "_built", {})
    monkeypatch.setattr(cache_kernels, "COPY_LIMIT", 1024)
    write, move = cache_kernels.cache_write_kernel(), cache_kernels.cache_move_kernel()
    at, path = mx.array(2, dtype=mx.int32), mx.array([0, 1])
    small, large = mx.ones((1, 2, 16, 8)), mx.ones((1, 2, 32, 8))  # 1,024 and 2,048 bytes
    new = mx.full((1, 2, 2, 8), 5.0)
    write(small, small, new, new, at)
    move([small, small], at, path)
    assert launched == ["dspark_cache_write", "dspark_cache_move_2"]
    k, v = write(large, large, new, new, at)
    moved = move([large, large], at, path)
    assert len(launched) == 2  # no launch: MLX's operations wrote them
    want = cache_kernels.written_by_operations(large, large, new, new, at)
    assert mx.array_equal(k, want[0]).item() and mx.array_equal(v, want[1]).item()
    assert all(mx.array_equal(m, large).item() for m in moved)  # rows 0 and 1 after the offset: themselves


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
        return cache_kernels.moved_by_operations(arrays, offset, path)

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


@pytest.mark.parametrize("tree_nodes", [0, 8])
def test_the_pipelined_loops_write_with_the_targets_writer_and_stay_lossless(tmp_path, tree_nodes):
    """The chain's and the tree's verify write their rows with the writer they are given (every
    layer, every trace), the loops hand it to the head for its rows at array positions, and the
    tokens stay the greedy ones; None puts MLX's operations back on both."""
    from conftest import PROMPTS
    from dspark_lab import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "qwen3", "qwen3", seed=6)
    target, tok = load_target(model)
    head = load_dspark(build_tiny_dspark(tmp_path / "h", model, markov_rank=0), target)
    widths = []

    def writer(keys, values, new_keys, new_values, offset):
        widths.append(new_keys.shape[2])
        return cache_kernels.written_by_operations(keys, values, new_keys, new_values, offset)

    target.write_cache_with(writer)
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        want = greedy_generate(target, tok, ids, max_new_tokens=16).token_ids
        got = speculative_generate(target, tok, head, ids, max_new_tokens=16, max_draft_tokens=4, tree_nodes=tree_nodes, pipeline=True)
        assert got.token_ids == want, prompt
    assert widths and max(widths) > 1
    assert head.cache_writer is writer
    before = len(widths)
    head.append_context_at({t: mx.zeros((3, target.hidden_size)) for t in head.target_layer_ids}, mx.array(2, dtype=mx.int32))
    assert widths[before:] == [3] * len(head.head.layers)  # a head layer's new rows: one write each
    target.write_cache_with(None)
    widths.clear()
    speculative_generate(target, tok, head, tok.encode(PROMPTS[0]), max_new_tokens=8, max_draft_tokens=4, tree_nodes=tree_nodes, pipeline=True)
    assert widths == [] and head.cache_writer is None


def test_the_once_a_model_checks_run_mlxs_operations_while_launch_kernels_are_on(tmp_path):
    """Set before the first pipelined or tree run, the launch kernels stay out of the offset and tree
    checks (which compare positions and masks against plain forwards through MLX's operations; here
    the float32 attention stand-in would part from MLX's bfloat16 one), and are back after them."""
    from conftest import PROMPTS
    from dspark_lab import greedy_generate, load_target, speculative_generate
    from dspark_lab.engine import attention_kernel
    from dspark_lab.engine.drafters.load import load_dspark
    from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

    model = build_tiny_model(tmp_path / "qwen3", "qwen3", seed=3, head_dim=32)
    target, tok = load_target(model, dtype="bfloat16")
    head = load_dspark(build_tiny_dspark(tmp_path / "h", model, markov_rank=0), target)
    kernels = (attention_kernel.reference_rows_attention, cache_kernels.written_by_operations, cache_kernels.moved_by_operations)
    target.use_launch_kernels(kernels)
    ids = tok.encode(PROMPTS[0])
    want = greedy_generate(target, tok, ids, max_new_tokens=12).token_ids
    got = speculative_generate(target, tok, head, ids, max_new_tokens=12, max_draft_tokens=4, tree_nodes=8, pipeline=True)
    assert got.token_ids == want
    assert target._offset_checked is not None and target._tree_checked
    assert target.attention_route.kernel is kernels[0] and target.attention_route.policy(16)
    assert target.cache_writer is kernels[1] and target.tree_path_mover is kernels[2]


def test_the_probes_compare_a_writer_with_mlxs_updates_bit_for_bit(tmp_path):
    """lab/kernel_probe._writes_equal (the greedy-step and launch probes' check of a cache writer):
    MLX's own updates pass, a writer that puts the rows one position late does not."""
    from dspark_lab import load_target
    from dspark_lab.lab import kernel_probe
    from dspark_lab.tiny import build_tiny_model

    target, _ = load_target(build_tiny_model(tmp_path / "qwen3", "qwen3", seed=7))

    def late(keys, values, new_keys, new_values, offset):
        return cache_kernels.written_by_operations(keys, values, new_keys, new_values, offset + 1)

    assert kernel_probe._writes_equal(target, cache_kernels.written_by_operations)
    assert not kernel_probe._writes_equal(target, late)
    assert cache_kernels.cache_writer_here() is None or cache_kernels.cuda_available()
