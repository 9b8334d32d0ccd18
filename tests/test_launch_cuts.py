"""benchmarks/launch_cuts.py's `views` word (CPU, MLX stand-ins for the CUDA kernels): it puts the
no-op primitives back around the engine's kernels, a reshape before and after each routed product
and an mx.contiguous around the cache's buffers at each attention and cache write, and changes no
token. What those primitives cost the host is then timed on a GPU, both copies in one process."""

from __future__ import annotations

import mlx.core as mx
from scripts import load_script

from dspark_lab import greedy_generate, load_target, speculative_generate
from dspark_lab.engine import attention_kernel, cache_kernels
from dspark_lab.engine.drafters.load import load_dspark
from dspark_lab.tiny import build_tiny_dspark, build_tiny_model

launch_cuts = load_script("launch_cuts")
op_count = load_script("op_count")


def _product(x, weight, scales, biases, *, group_size, bits):
    """The rows kernel's stand-in: MLX's own product, which takes x with its leading dimensions."""
    return mx.quantized_matmul(x, weight, scales, biases, transpose=True, group_size=group_size, bits=bits)


def _routed(model_dir):
    target, tok = load_target(model_dir, dtype="bfloat16", quantize=4)
    target.route_quantized_rows(_product, policy=lambda rows, weights, **_: True)
    target.use_launch_kernels((attention_kernel.reference_rows_attention, cache_kernels.written_by_operations,
                               cache_kernels.moved_by_operations))
    return target, tok


def _forward_primitives(target) -> dict:
    cache = target.make_cache()
    target.forward(mx.array([1, 2, 3, 4], dtype=mx.uint32), cache)
    out = target.forward_at(mx.array([5, 6, 7, 8, 9, 10, 11, 12], dtype=mx.uint32), cache, mx.array(4, dtype=mx.int32), capacity=64)
    return op_count.count_ops(out.logits)


def test_views_put_the_no_op_primitives_back_and_change_no_token(tmp_path):
    model = build_tiny_model(tmp_path / "qwen3", "qwen3", seed=3, head_dim=32)
    plain, tok = _routed(model)
    with_views, _ = _routed(model)
    launch_cuts.with_no_op_views(with_views)
    before, after = _forward_primitives(plain), _forward_primitives(with_views)
    layers = len(plain.layers)
    # Two around the attention's keys and values, two around the cache write's buffers, every layer.
    assert after["Contiguous"] - before["Contiguous"] == 4 * layers
    assert after["Reshape"] > before["Reshape"]
    head = load_dspark(build_tiny_dspark(tmp_path / "h", model, markov_rank=0), with_views)
    prompt = tok.encode("def add(a, b):")
    greedy = greedy_generate(plain, tok, prompt, max_new_tokens=24)
    chain = speculative_generate(with_views, tok, head, prompt, max_new_tokens=24, max_draft_tokens=4, pipeline=True)
    tree = speculative_generate(with_views, tok, head, prompt, max_new_tokens=24, max_draft_tokens=3, pipeline=True, tree_nodes=7)
    assert chain.token_ids == greedy.token_ids and tree.token_ids == greedy.token_ids
