"""engine/attention_kernel.py off CUDA: its float32 reference (the CPU's stand-in, and what the
kernel is checked against on the GPU) and which attentions the kernel takes."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import numpy as np
import pytest

from dspark_lab.engine import attention_kernel


def _numpy_attention(q, k, v, offset, scale):
    heads, rows, d = q.shape[1:]
    groups = heads // k.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for h in range(heads):
        for r in range(rows):
            keys, values = k[0, h // groups, : offset + r + 1], v[0, h // groups, : offset + r + 1]
            s = keys @ q[0, h, r] * scale
            p = np.exp(s - s.max())
            out[0, h, r] = (p / p.sum()) @ values
    return out


def test_the_reference_lets_each_row_see_the_positions_up_to_its_own():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 6, 5, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)
    k[:, :, 20:] = 1e3  # past the last row's position: garbage the mask must hide
    got = attention_kernel.reference_rows_attention(mx.array(q), mx.array(k), mx.array(v), mx.array(15, dtype=mx.int32), 0.3)
    np.testing.assert_allclose(np.array(got), _numpy_attention(q, k, v, 15, 0.3), rtol=1e-5, atol=1e-5)


def test_the_reference_is_the_engine_masks_attention():
    """The reference equals MLX's own attention under the compiled forward's boolean mask."""
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((1, 4, 8, 64), (1, 2, 64, 64), (1, 2, 64, 64)))
    offset = mx.array(30, dtype=mx.int32)
    mask = mx.arange(64)[None] <= offset + mx.arange(8)[:, None]
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = attention_kernel.reference_rows_attention(q, k, v, offset, 0.125)
    assert mx.abs(got - fused).max().item() < 1e-5


@pytest.mark.parametrize("shape, why", [((1, 6, 33, 64), "33 rows"), ((1, 6, 4, 48), "head dim 48"), ((1, 5, 4, 64), "5 query heads"),
                                         ((2, 6, 4, 64), "one sequence")])
def test_the_kernel_names_what_it_does_not_take(shape, why):
    q = mx.zeros(shape, dtype=mx.bfloat16)
    k = mx.zeros((shape[0], 2, 16, 64), dtype=mx.bfloat16)
    assert why in attention_kernel.supports(q, k, k)
    assert attention_kernel.supports(mx.zeros((1, 6, 8, 64), dtype=mx.bfloat16), k[:1], k[:1]) is None
    assert "bfloat16" in attention_kernel.supports(mx.zeros((1, 6, 8, 64)), k[:1].astype(mx.float32), k[:1].astype(mx.float32))


def test_off_cuda_the_kernel_says_so():
    if attention_kernel.cuda_available():
        pytest.skip("a CUDA backend is here")
    with pytest.raises(RuntimeError, match="CUDA"):
        attention_kernel.rows_attention()
