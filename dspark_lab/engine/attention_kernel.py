"""Attention for the few rows a speculative round feeds, at a position held in an array (CUDA).

Why: the pipelined loops' compiled forward (engine/compiled.py) attends over the cache's whole
bucketed buffer and hides what lies at or past each row's position with a boolean mask, since the
position is a device array. MLX's CUDA attention takes an array mask only through cuDNN (2+ rows,
after turning the mask into an additive one) or its unfused fallback (1 row); its vector kernel,
which a plain one-row step runs, takes no array mask. This kernel needs no mask: it reads the
offset and lets row r see positions 0..offset + r, as the mask would. A draft tree's rows (a
second kernel, the same code but for one visibility test) see the positions before the tree and
the tree rows their ancestors matrix marks.

How: one thread block per (query head, row). Its warps take every WARPS-th visible position; a
lane holds D / 32 of the head's dimensions, so a score is one warp-wide shuffle sum. Each warp keeps
a running maximum, normalizer and value sum in float32 (the usual streaming softmax); the warps'
partial results are merged in a fixed order and rounded to the activation dtype once. A row's
result depends on its own position and keys alone, not on how many rows came with it.

Measured on an H100 (docs/performance.md, thirty-ninth round; benchmarks/forward_parts.py): equal
to cuDNN's result from 2 rows and to its float32 reference; 4.2x faster than MLX's attention over a
masked buffer at one row (MLX's unfused fallback there), slower than cuDNN from 2 rows timed alone.
But the pipelined loops are bound by launching (forty-eighth round), and cuDNN's attention is a
child graph nested in a child graph with a memset, where this is one kernel that reads the queries
through their strides and writes its output rows by heads (no copy before or after): through it at
every width, trees included, a round launches about 100 kernels fewer, and with the cache kernels
(cache_kernels.py) the 0.5B's chain decoded 1.01-1.34x faster, its trees 1.13-1.53x (forty-ninth round). Target.route_attention sends the widths a policy takes
through it; Target.use_launch_kernels takes every width.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from .kernels import cuda_available, source_digest

MAX_ROWS = 32  # a tree's verify at most; more is a prefill
WARPS = 8  # warps a block: each takes every 8th visible position

# Template: D (head dim, a multiple of 32), GROUPS (query heads per key/value head), KV (key/value
# heads), W (rows), WARPS. Inputs: q (1, H, W, D) bfloat16, read through its strides (the model's
# queries are a transposed view: no copy); k, v (1, KV, T, D) bfloat16, read through their strides
# too (the cache's buffers, row-contiguous already: an mx.contiguous around them cost a primitive
# each, two a layer, for the host to hand over and nothing to copy; timed in separate processes,
# neither faster nor slower, docs/performance.md, fifty-fourth round); offset (1,) int32, the first
# row's position; scale (1,) float32. Output: out (W, H, D) bfloat16, so that the model's transpose
# back to rows-by-heads is contiguous and its reshape for o_proj needs no copy either.
_SOURCE = """
    constexpr int PER_LANE = D / 32;
    const int T = k_shape[2];
    const int h = blockIdx.x / W;
    const int r = blockIdx.x % W;
    const int kv = h / GROUPS;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int first = offset[0];
    const int visible = min(VISIBLE_END, T);
    const float sc = scale[0];
    __shared__ float part_m[WARPS];
    __shared__ float part_l[WARPS];
    __shared__ float part_acc[WARPS][D];

    float qv[PER_LANE];
    float acc[PER_LANE];
    const __nv_bfloat16* qrow = q + h * q_strides[1] + r * q_strides[2];
    #pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        qv[j] = __bfloat162float(qrow[(lane * PER_LANE + j) * q_strides[3]]) * sc;
        acc[j] = 0.0f;
    }
    float m = __int_as_float(0xff800000);  // -inf: no position seen yet
    float l = 0.0f;
    const __nv_bfloat16* kh = k + kv * k_strides[1] + lane * PER_LANE * k_strides[3];
    const __nv_bfloat16* vh = v + kv * v_strides[1] + lane * PER_LANE * v_strides[3];
    for (int t = warp; t < visible; t += WARPS) {
        if (HIDDEN) continue;  // the same for every lane of the warp: the shuffle below stays whole
        const __nv_bfloat16* kp = kh + t * k_strides[2];
        float s = 0.0f;
        #pragma unroll
        for (int j = 0; j < PER_LANE; ++j) s = fmaf(qv[j], __bfloat162float(kp[j * k_strides[3]]), s);
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        const float m_new = fmaxf(m, s);
        const float keep = expf(m - m_new);
        const float p = expf(s - m_new);
        l = fmaf(l, keep, p);
        const __nv_bfloat16* vp = vh + t * v_strides[2];
        #pragma unroll
        for (int j = 0; j < PER_LANE; ++j) acc[j] = fmaf(acc[j], keep, p * __bfloat162float(vp[j * v_strides[3]]));
        m = m_new;
    }
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
    #pragma unroll
    for (int j = 0; j < PER_LANE; ++j) part_acc[warp][lane * PER_LANE + j] = acc[j];
    __syncthreads();
    if (threadIdx.x < D) {
        float top = part_m[0];
        #pragma unroll
        for (int w = 1; w < WARPS; ++w) top = fmaxf(top, part_m[w]);
        float norm = 0.0f;
        float sum = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = expf(part_m[w] - top);  // a warp that saw no position: exp(-inf) = 0
            norm = fmaf(part_l[w], f, norm);
            sum = fmaf(part_acc[w][threadIdx.x], f, sum);
        }
        out[((size_t)r * (GROUPS * KV) + h) * D + threadIdx.x] = __float2bfloat16(sum / norm);
    }
"""

# Row r of a chain sees every position up to its own; row r of a tree every position before the
# tree's first row and, among the tree's rows, those ancestors[r] marks (its ancestors and itself).
_CHAIN = _SOURCE.replace("VISIBLE_END", "first + r + 1").replace("HIDDEN", "false")
_TREE = _SOURCE.replace("VISIBLE_END", "first + W").replace("HIDDEN", "t >= first && !ancestors[r * W + (t - first)]")

SOURCE_DIGEST = source_digest(_CHAIN, _TREE)  # what a stored verdict was measured on (lab/kernel_probe.py)

_built: dict[str, object] = {}


def supports(q: mx.array, k: mx.array, v: mx.array) -> str | None:
    """None when the kernel computes this attention, else why not. q (1, H, W, D); k, v (1, KV, T, D)."""
    if q.ndim != 4 or q.shape[0] != 1 or k.shape[0] != 1:
        return f"query {q.shape}: the kernel takes one sequence, (1, heads, rows, head dim)"
    heads, rows, d = q.shape[1:]
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows: the kernel serves 1..{MAX_ROWS}"
    if d % 32 or d > 256 or k.shape[-1] != d or v.shape[-1] != d:
        return f"head dim {d} (values {v.shape[-1]}): the kernel takes equal query/value dims, a multiple of 32 up to 256"
    if heads % k.shape[1]:
        return f"{heads} query heads over {k.shape[1]} key/value heads: not a whole number of groups"
    if not q.dtype == k.dtype == v.dtype == mx.bfloat16:
        return f"query {q.dtype}, keys {k.dtype}: the kernel reads bfloat16"
    return None


def rows_attention() -> Callable[..., mx.array]:
    """attention(q, k, v, offset, scale) -> softmax(scale * q k^T, row r seeing positions
    0..offset + r) v, for what `supports` accepts; `offset` an int32 array (shape () or (1,)).
    With `ancestors` (rows x rows, boolean) the rows are a draft tree's, written at the offset:
    row r sees the positions before the offset and the tree rows ancestors[r] marks.
    Raises RuntimeError off CUDA."""
    if not cuda_available():
        raise RuntimeError("no CUDA backend on this device (the rows attention kernel is written for MLX's CUDA backend)")
    if "attention" not in _built:
        _built["attention"] = mx.fast.cuda_kernel(name="dspark_rows_attention",
                                                  input_names=["q", "k", "v", "offset", "scale"],
                                                  output_names=["out"], source=_CHAIN, ensure_row_contiguous=False)
        _built["tree"] = mx.fast.cuda_kernel(name="dspark_tree_attention",
                                             input_names=["q", "k", "v", "offset", "scale", "ancestors"],
                                             output_names=["out"], source=_TREE, ensure_row_contiguous=False)

    def attention(q: mx.array, k: mx.array, v: mx.array, offset: mx.array, scale: float,
                  ancestors: mx.array | None = None) -> mx.array:
        _, heads, rows, d = q.shape
        kv = k.shape[1]
        # q, k and v as they come: the kernel reads all three through their strides
        inputs = [q, k, v, offset.reshape(1).astype(mx.int32), mx.array([scale], dtype=mx.float32)]
        kernel = _built["attention"]
        if ancestors is not None:
            kernel = _built["tree"]
            inputs.append(mx.contiguous(ancestors.astype(mx.uint8)))
        (out,) = kernel(inputs=inputs, template=[("D", d), ("GROUPS", heads // kv), ("KV", kv), ("W", rows), ("WARPS", WARPS)],
                        grid=(heads * rows * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
                        output_shapes=[(1, rows, heads, d)], output_dtypes=[q.dtype])
        return out.transpose(0, 2, 1, 3)

    return attention


def reference_rows_attention(q: mx.array, k: mx.array, v: mx.array, offset: mx.array, scale: float,
                             ancestors: mx.array | None = None) -> mx.array:
    """The same attention in float32 MLX operations (the CPU's stand-in for the kernel, and what
    its results are checked against)."""
    _, heads, rows, d = q.shape
    kv, positions = k.shape[1], k.shape[2]
    qg = (q.astype(mx.float32) * scale).reshape(1, kv, heads // kv, rows, d)
    scores = qg @ k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    if ancestors is None:
        visible = mx.arange(positions)[None] <= offset.reshape(()) + mx.arange(rows)[:, None]
    else:
        rel = mx.arange(positions) - offset.reshape(())  # each key's place among the tree's rows
        visible = (rel < 0)[None] | (mx.take(ancestors, mx.clip(rel, 0, rows - 1), axis=1) & (rel < rows)[None])
    scores = mx.where(visible, scores, mx.array(-float("inf"), mx.float32))
    out = mx.softmax(scores, axis=-1) @ v.astype(mx.float32)[:, :, None]
    return out.reshape(1, heads, rows, d).astype(q.dtype)
