"""A quantized matmul for the few rows a speculative round feeds (CUDA), and its routing.

Why: a DSpark draft projects its cap's rows onto the vocabulary, a verify feeds cap + 1 rows, a
tree's verify its nodes + 1. On MLX's CUDA backend a 4-bit product of fewer than 8 rows runs a
matrix-vector kernel that reads the weights again for every row (the 0.5B's vocabulary
projection: 87 us at one row, 566 at 7 on an H100); from 8 rows its tensor-core kernel reads them
once. This kernel reads each weight once for all of 1-32 rows. Measured (docs/performance.md,
thirty-eighth and forty-first rounds), product by product it beats MLX's only where MLX re-reads a
large matrix (a call costs about 2.5 us more than one of MLX's in a compiled forward, 10 us more
built from Python, whatever the layer); but a whole compiled forward of 8-16 rows, a chain's verify,
ran 1.3-1.8x faster with every product through it (forty-fifth round). The engine routes both
(worth_routing).

How: one thread block per C output columns; its warps split the K dimension, each lane takes
every 32nd packed word of its share, dequantizes the word's 8 (4-bit) or 4 (8-bit) weights once
(scale * q + bias, as mx.quantize lays them out) and multiplies them into every row's float32
sum. The warps' sums are reduced by shuffles, then across warps in a fixed order, and rounded to
the activation dtype once. Every output element goes through the same operations in the same
order whatever the number of rows or columns a block takes, so a row's result does not depend on
how many rows came with it: a verify's rows equal, bit for bit, what a one-row step through the
kernel computes. (MLX's own kernels differ there: bfloat16 sums below 8 rows, float32 from 8.)
That is the "words" layout (LAYOUTS); "wide" loads 16 bytes a lane, and "mma", the default since
the forty-seventh round, puts the rows through the tensor cores (_SOURCE_MMA) for 4-bit weights in
groups of a multiple of 64 (the words layout computes the rest), so its cost barely grows with
them: on an H100 the 1.5B's vocabulary projection cost 82 us at one row and 86 at 8 (words 105 and
233, MLX 134 and 99), as exact as the words layout. DSPARK_LAB_ROWS_LAYOUT names another layout.

Whether it is exact enough and faster on a machine is measured (benchmarks/rows_kernel.py;
per machine and pair by lab/kernel_probe.choose_rows_kernel), not assumed; the engine routes
through it only when asked (Target.route_quantized_rows).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .compiled import MAX_WIDTH
from .kernels import cuda_available, source_digest

MAX_ROWS = 32  # the most rows the kernel takes (a tree's verify); more is a prefill

# Where the engine routes a product through the kernel (worth_routing), from the H100 measurements
# (docs/performance.md, thirty-eighth round). MLX's own kernels: fewer than 8 rows run its
# matrix-vector kernel, which reads the weights again for every row; from 8 rows its tensor-core
# kernel reads them once and beats this one. A call of this kernel costs about 5 us more than one
# of MLX's (9.5 against 4.5 us for a small layer, whatever the rows), so it pays only where MLX's
# re-reads cost more: the vocabulary projection from 2 rows (7 rows: 128 against 566 us, the
# DSpark draft's projection at cap 7), an MLP matrix from 4 rows (7 rows: 13 against 22 us), never
# a small attention matrix (a one-row forward ran 0.90x through the kernel). Compiled, as a forward
# replays them, a call of this kernel costs about 2.5 us more than one of MLX's (forty-first round).
# From 8 rows MLX's tensor-core kernel, timed alone, costs what one row does (the Qwen 1.5B's
# products at 8-9 rows 1.65 ms a forward, as at one row); yet inside the compiled forward that the
# pipelined chain's verify replays, a forward of 8-9 rows through it cost 8.8 ms where the same
# forward with every product through this kernel cost 5.0 (the 1.5B; the 0.5B 5.1 against 3.7, and
# 1.26-1.39x at 16 rows), on an H200 (docs/performance.md, forty-fifth round): so a verify's widths
# go through this kernel too, every layer, up to a compiled forward's widest. (On an H100 in the
# fortieth round, before the projections were stacked, routing a verify's 16-17 rows lost; whether
# routing pays on a machine is the probe's to say: lab/kernel_probe.choose_rows_kernel times the
# chain at cap 7 both ways.) A tree's verify of 17 rows and more goes through it only where the mma
# layout takes the layer: the words layout's cost grows with the rows (17 rows of the vocabulary
# projection 468 us against MLX's 164 on an H100), the mma layout's barely (224).
QMV_ROWS = range(2, 8)  # the widths MLX serves with its per-row matrix-vector kernel
MIN_WEIGHT_ROWS = 12_000_000  # weights x rows below which MLX's re-reads cost less than this kernel's launch
CHAIN_VERIFY_ROWS = range(QMV_ROWS.stop, MAX_WIDTH + 1)  # a chain's verify at caps 7-15, compiled forwards; a prompt of 8-16 tokens too


TREE_VERIFY_ROWS = range(MAX_WIDTH + 1, MAX_ROWS + 1)  # a tree's verify of 17 nodes and more (a 16-node tree and its root)


def worth_routing(rows: int, weights: int, tensor_cores: bool = False) -> bool:
    """Whether a product of `rows` rows with a layer of `weights` weights should go through the
    kernel (the engine's default policy; route_quantized_rows takes another): where MLX re-reads a
    large matrix for every row, every product of a chain verify's widths, and, where the layer's
    product goes through the tensor cores (`tensor_cores`: the mma layout takes it), a tree
    verify's 17-32 rows too: on an H100 (forty-seventh round) a compiled forward of 17 rows ran
    6.6 ms that way against 11.2 through MLX's kernels and 11.3 through the words layout."""
    return ((rows in QMV_ROWS and rows * weights >= MIN_WEIGHT_ROWS) or rows in CHAIN_VERIFY_ROWS
            or (tensor_cores and rows in TREE_VERIFY_ROWS))


VERIFY_ROWS = range(8, MAX_ROWS + 1)  # a pipelined verify's widths (cap + 1 rows, a tree's nodes)


def with_verifies(rows: int, weights: int, tensor_cores: bool = False) -> bool:
    """worth_routing's products, and every product of a verify's width (8 to MAX_ROWS rows, a
    tree's of 17 and more too) whatever the layout: a candidate, not the engine's policy, which
    matches it wherever the mma layout takes the layer. Measured alone, MLX's tensor-core kernel
    beats the words layout from 8 rows (thirty-eighth round); inside the 0.5B's compiled forward on
    an H100 (fortieth round, before the projections were stacked) this policy made the forward of 8
    rows 1.05x faster and of 16 and 17 rows slower (0.88x, 0.72x); on an H200 (forty-fifth round)
    1.35-1.77x faster at 8-9 rows and 1.26-1.39x at 16, both Qwen models (benchmarks/rows_kernel.py
    --copies)."""
    return worth_routing(rows, weights, tensor_cores) or rows in VERIFY_ROWS


def multi_row(rows: int, weights: int, tensor_cores: bool = False) -> bool:
    """A candidate policy: every product of 2 or more rows (a verify's, a draft's), never a one-row
    decode step's, whatever the layer's size (benchmarks/rows_kernel.py --copies). On an H100 it
    made the 0.5B's compiled forward slower at every width (forty-first round): each small layer
    pays the kernel's extra 2.5 us a call."""
    return rows >= 2


def every_width(rows: int, weights: int, tensor_cores: bool = False) -> bool:
    """A policy routing every product the kernel takes: one-row steps compute what a verify's rows
    do, bit for bit (the lossless check of the kernel's own arithmetic)."""
    return True


WARP = 32
QUANTIZED_LAYERS = (nn.QuantizedLinear, nn.QuantizedEmbedding)  # the layers whose products can be routed

# Helpers the kernel body calls: activation words to floats. A bfloat16 is the top half of a
# float32, so widening is a shift (exact, no rounding).
_HEADER = """
__device__ __forceinline__ void dspark_widen2(unsigned u, float* v) {
    v[0] = __uint_as_float(u << 16);
    v[1] = __uint_as_float(u & 0xffff0000u);
}
template <int PER_WORD>
__device__ __forceinline__ void dspark_load_x(const __nv_bfloat16* p, float* v);
template <>
__device__ __forceinline__ void dspark_load_x<8>(const __nv_bfloat16* p, float* v) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    dspark_widen2(u.x, v); dspark_widen2(u.y, v + 2); dspark_widen2(u.z, v + 4); dspark_widen2(u.w, v + 6);
}
template <>
__device__ __forceinline__ void dspark_load_x<4>(const __nv_bfloat16* p, float* v) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    dspark_widen2(u.x, v); dspark_widen2(u.y, v + 2);
}
// The mma layout's helpers. Two 4-bit weights of a packed word, nibbles i and i + 4 of v >> 4i, as
// the bfloat16 pair (q_i, q_i+4): OR-ing 0x4300 into a nibble makes the bfloat16 128 + q (the
// spacing there is 1), and subtracting 128 leaves q; both exact.
__device__ __forceinline__ unsigned dspark_nibble_pair(unsigned v) {
    unsigned r = (v & 0x000F000Fu) | 0x43004300u;
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&r);
    unsigned o = 0x43004300u;
    h = __hsub2(h, *reinterpret_cast<__nv_bfloat162*>(&o));
    return *reinterpret_cast<unsigned*>(&h);
}
// d += A (16 x 16 bfloat16) * B (16 x 8 bfloat16), float32 sums: one warp-wide tensor-core step.
__device__ __forceinline__ void dspark_mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                           unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""

# Template: M rows, C columns a block, BITS (4 or 8), GROUP (the quantization group), KSPLIT warps
# a block (each a share of K). Inputs: x (..., K) bfloat16 of M rows, row-contiguous; w (N, K * BITS / 32)
# uint32; scales and biases (N, K / GROUP) bfloat16. Output: out (..., N) bfloat16 (M rows). A kernel body is
# _OPENING, a layout's loop over its share of K into acc, and _CLOSING (the fixed-order reduction).
_OPENING = """
    constexpr int PER_WORD = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const int K = x_shape[x_ndim - 1];
    const int N = w_shape[0];
    const int words = K / PER_WORD;
    const int groups = K / GROUP;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int col0 = blockIdx.x * C;
    __shared__ float part[KSPLIT][C * M];

    float acc[C][M];
    #pragma unroll
    for (int c = 0; c < C; ++c) {
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;
    }
"""

_CLOSING = """
    #pragma unroll
    for (int c = 0; c < C; ++c) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[c][m];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) part[warp][c * M + m] = v;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < C * M; i += blockDim.x) {  // a block of one warp has fewer threads than outputs
        const int c = i / M;
        const int m = i % M;
        float sum = part[0][i];
        #pragma unroll
        for (int k = 1; k < KSPLIT; ++k) sum += part[k][i];
        if (col0 + c < N) out[(size_t)m * N + col0 + c] = __float2bfloat16(sum);
    }
"""

# The word layout: each lane takes every 32 * KSPLIT-th packed word of its columns, one at a time.
_SOURCE = _OPENING + """
    for (int word = warp * 32 + lane; word < words; word += 32 * KSPLIT) {
        const int g = (word * PER_WORD) / GROUP;
        float wv[C][PER_WORD];
        #pragma unroll
        for (int c = 0; c < C; ++c) {
            const int col = min(col0 + c, N - 1);  // past the last column: computed, never written
            const unsigned q = w[(size_t)col * words + word];
            const float s = __bfloat162float(scales[(size_t)col * groups + g]);
            const float b = __bfloat162float(biases[(size_t)col * groups + g]);
            #pragma unroll
            for (int j = 0; j < PER_WORD; ++j) wv[c][j] = fmaf(s, (float)((q >> (BITS * j)) & MASK), b);
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float xv[PER_WORD];
            dspark_load_x<PER_WORD>(x + (size_t)m * K + (size_t)word * PER_WORD, xv);
            #pragma unroll
            for (int c = 0; c < C; ++c) {
                #pragma unroll
                for (int j = 0; j < PER_WORD; ++j) acc[c][m] = fmaf(wv[c][j], xv[j], acc[c][m]);
            }
        }
    }
""" + _CLOSING

# The same product with 16-byte weight loads (a candidate layout, benchmarks/rows_kernel.py --copies P:wide):
# each lane takes CHUNK = 4 consecutive packed words of a column (32 weights at 4 bits) in one load,
# and the warps split K so that a lane takes as few chunks as can be (a K of 896 at 4 bits: 28 chunks,
# one warp, one load each). Why: the layout above is latency-bound on the small layers a verify runs
# (a lane walks 3-4 words of K one dependent load after another, 4 bytes a load) and draws about a
# quarter of the memory bandwidth on the vocabulary projection; here every lane has its whole share
# of the weights in flight at once. Each output's sum still runs in an order fixed by K alone.
# Measured on an H100 (forty-first round), compiled: the vocabulary projection at 1 and 2 rows 60.5
# and 71.3 us against the word layout's 82.6 and 78.0; elsewhere within 1-2 us of it, slower from 8
# rows; in decoding no difference outside the noise. The engine keeps the word layout.
_SOURCE_WIDE = _OPENING + """
    constexpr int CHUNK = 4;  // packed words a lane loads at once (16 bytes)
    const int chunks = words / CHUNK;
    for (int chunk = warp * 32 + lane; chunk < chunks; chunk += 32 * KSPLIT) {
        uint4 q[C];
        #pragma unroll
        for (int c = 0; c < C; ++c) {
            const int col = min(col0 + c, N - 1);  // past the last column: computed, never written
            q[c] = *reinterpret_cast<const uint4*>(w + (size_t)col * words + (size_t)chunk * CHUNK);
        }
        #pragma unroll
        for (int j = 0; j < CHUNK; ++j) {
            const int word = chunk * CHUNK + j;
            const int g = (word * PER_WORD) / GROUP;
            float wv[C][PER_WORD];
            #pragma unroll
            for (int c = 0; c < C; ++c) {
                const int col = min(col0 + c, N - 1);
                const unsigned u = j == 0 ? q[c].x : j == 1 ? q[c].y : j == 2 ? q[c].z : q[c].w;
                const float s = __bfloat162float(scales[(size_t)col * groups + g]);
                const float b = __bfloat162float(biases[(size_t)col * groups + g]);
                #pragma unroll
                for (int i = 0; i < PER_WORD; ++i) wv[c][i] = fmaf(s, (float)((u >> (BITS * i)) & MASK), b);
            }
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                float xv[PER_WORD];
                dspark_load_x<PER_WORD>(x + (size_t)m * K + (size_t)word * PER_WORD, xv);
                #pragma unroll
                for (int c = 0; c < C; ++c) {
                    #pragma unroll
                    for (int i = 0; i < PER_WORD; ++i) acc[c][m] = fmaf(wv[c][i], xv[i], acc[c][m]);
                }
            }
        }
    }
""" + _CLOSING

# The tensor-core layout (4-bit weights, groups of a multiple of 64): the rows go through mma.sync
# (m16n8k16, bfloat16 in, float32 sums) as its 8-wide side, 16 columns a warp as its 16-wide side.
# Why: the layouts above multiply in float32 on the CUDA cores, a multiply-add per weight and row,
# so their cost grows with the rows (the Qwen 1.5B's vocabulary projection 113 us at one row, 242
# at 8 on an H200, forty-fifth round) where the weights' bytes do not. Here the tensor cores take
# the rows, and a weight costs the same few integer operations at any width up to 32.
# What goes in is exact: the weights as their integers q (0-15, exact in bfloat16), the activations
# as they are; each 64 weights of a column (one quantization group, or part of one) give float32
# sums q . x and, through the same step with all-ones weights, sum x, and the output is
# sum over the slices of scale * (q . x) + bias * (sum x): the grouped form of scale * q + bias, without
# rounding a dequantized weight to bfloat16.
# Who does what: lane = 4 * g + t. Each 64 weights of a column are 8 packed words; lane t takes
# words 2t and 2t + 1 of columns g and g + 8 (one 8-byte load each; the 4 lanes of g read 32
# contiguous bytes). The sum over K does not care in which order the 16 k of one mma step are
# listed, so each step lists them as the lanes hold them: word j's pair of nibbles (i, i + 4) sits
# where the mma wants a lane's pair of k, and the activations are permuted the same way (byte_perm).
# Rows g, g + 8, g + 16, g + 24 are this lane's activations (tiles of 8 rows, zeros past M); its sums
# are columns g, g + 8 at rows 2t, 2t + 1 of each tile. Warps split the 64-k slices of K (a split
# that depends on K alone) and are reduced in a fixed order, so a row's result does not depend on
# the rows beside it.
_SOURCE_MMA = """
    constexpr int NT = (M + 7) / 8;  // tiles of 8 rows
    const int K = x_shape[x_ndim - 1];
    const int N = w_shape[0];
    const int words = K / 8;
    const int groups = K / GROUP;
    const int slices = K / 64;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int col0 = blockIdx.x * C;
    const int colA = min(col0 + g, N - 1);  // past the last column: computed, never written
    const int colB = min(col0 + g + 8, N - 1);
    const unsigned* wA = w + (size_t)colA * words + 2 * t;
    const unsigned* wB = w + (size_t)colB * words + 2 * t;
    constexpr unsigned ONES = 0x3F803F80u;  // the bfloat16 pair (1, 1)
    __shared__ float part[KSPLIT][NT * 8 * 16];

    float total[NT][4];
    #pragma unroll
    for (int n = 0; n < NT; ++n) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) total[n][i] = 0.0f;
    }
    #pragma unroll 2
    for (int slice = warp; slice < slices; slice += KSPLIT) {
        const int k0 = slice * 64;
        const uint2 qa = *reinterpret_cast<const uint2*>(wA + slice * 8);
        const uint2 qb = *reinterpret_cast<const uint2*>(wB + slice * 8);
        unsigned xr[NT][2][4];  // per row tile and word: the activations' pairs (x_i, x_i+4)
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int row = g + 8 * n;
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                uint4 u = make_uint4(0u, 0u, 0u, 0u);
                if (row < M) u = *reinterpret_cast<const uint4*>(x + (size_t)row * K + k0 + 16 * t + 8 * j);
                xr[n][j][0] = __byte_perm(u.x, u.z, 0x5410);
                xr[n][j][1] = __byte_perm(u.x, u.z, 0x7632);
                xr[n][j][2] = __byte_perm(u.y, u.w, 0x5410);
                xr[n][j][3] = __byte_perm(u.y, u.w, 0x7632);
            }
        }
        float qx[NT][4], sx[NT][4];
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) { qx[n][i] = 0.0f; sx[n][i] = 0.0f; }
        }
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            const unsigned wa = j ? qa.y : qa.x;
            const unsigned wb = j ? qb.y : qb.x;
            unsigned ra[4], rb[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i) { ra[i] = dspark_nibble_pair(wa >> (4 * i)); rb[i] = dspark_nibble_pair(wb >> (4 * i)); }
            #pragma unroll
            for (int s = 0; s < 2; ++s) {
                #pragma unroll
                for (int n = 0; n < NT; ++n) {
                    dspark_mma(qx[n], ra[2 * s], rb[2 * s], ra[2 * s + 1], rb[2 * s + 1], xr[n][j][2 * s], xr[n][j][2 * s + 1]);
                    dspark_mma(sx[n], ONES, ONES, ONES, ONES, xr[n][j][2 * s], xr[n][j][2 * s + 1]);
                }
            }
        }
        const int grp = k0 / GROUP;
        const float sa = __bfloat162float(scales[(size_t)colA * groups + grp]);
        const float ba = __bfloat162float(biases[(size_t)colA * groups + grp]);
        const float sb = __bfloat162float(scales[(size_t)colB * groups + grp]);
        const float bb = __bfloat162float(biases[(size_t)colB * groups + grp]);
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            total[n][0] += fmaf(sa, qx[n][0], ba * sx[n][0]);
            total[n][1] += fmaf(sa, qx[n][1], ba * sx[n][1]);
            total[n][2] += fmaf(sb, qx[n][2], bb * sx[n][2]);
            total[n][3] += fmaf(sb, qx[n][3], bb * sx[n][3]);
        }
    }
    #pragma unroll
    for (int n = 0; n < NT; ++n) {  // [row][column] of this block's outputs
        const int r = 8 * n + 2 * t;
        part[warp][r * 16 + g] = total[n][0];
        part[warp][(r + 1) * 16 + g] = total[n][1];
        part[warp][r * 16 + g + 8] = total[n][2];
        part[warp][(r + 1) * 16 + g + 8] = total[n][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < M * 16; i += blockDim.x) {
        const int m = i / 16;
        const int c = i % 16;
        float sum = part[0][i];
        #pragma unroll
        for (int k = 1; k < KSPLIT; ++k) sum += part[k][i];
        if (col0 + c < N) out[(size_t)m * N + col0 + c] = __float2bfloat16(sum);
    }
"""

_built: dict[str, object] = {}


def columns_per_block(rows: int) -> int:
    """Columns a block computes: each activation load serves that many columns' weights, so the
    loads stay below the multiply-adds (a lone column is load-bound: one 16-byte load per 8
    multiply-adds), while the sums a thread keeps (columns x rows floats) stay within 64 registers."""
    return 4 if rows <= 16 else 2


def k_split(k: int, bits: int) -> int:
    """Warps a block splits K among: enough that each lane handles at least two packed words
    (so a narrow matrix with a long K, a down projection, still spreads over the GPU), at most 8.
    It depends on K alone, so it is the same for every number of rows."""
    words = k * bits // 32
    return max(1, min(8, words // (2 * WARP)))


def supports(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int,
             bits: int, mode: str = "affine") -> str | None:
    """None when the kernel computes this product, else why it does not (the caller then runs
    mx.quantized_matmul)."""
    rows = math.prod(x.shape[:-1])
    k = x.shape[-1]
    if mode != "affine" or biases is None:
        return f"mode {mode!r}: the kernel dequantizes affine weights (scale * q + bias)"
    if bits not in (4, 8):
        return f"{bits}-bit weights: the kernel unpacks 4 or 8 bits"
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows: the kernel serves 1..{MAX_ROWS} (more is a prefill)"
    if x.dtype != mx.bfloat16 or scales.dtype != mx.bfloat16 or biases.dtype != mx.bfloat16:
        return f"activations {x.dtype}, scales {scales.dtype}: the kernel reads bfloat16"
    if weight.ndim != 2 or weight.shape[1] * 32 // bits != k or k % group_size or group_size % (32 // bits):
        return f"weight {weight.shape} for K={k}, group {group_size}: not the layout of mx.quantize"
    return None


def wide_k_split(k: int, bits: int) -> int:
    """Warps a block of the wide layout splits K among: enough that a lane loads one 16-byte chunk
    where it can (at most 8 warps). It depends on K alone, as k_split does."""
    chunks = k * bits // 32 // 4
    return max(1, min(8, -(-chunks // WARP)))


MMA_COLUMNS = 16  # columns a warp of the mma layout computes: the tensor-core step's 16-wide side
MMA_SLICE = 64  # weights of a column a warp's step takes: 8 packed words, within one quantization group


def mma_k_split(k: int, bits: int) -> int:
    """Warps a block of the mma layout splits K's 64-weight slices among: at least two slices a
    warp, at most 8 warps. K alone decides it."""
    return max(1, min(8, k // MMA_SLICE // 2))


@dataclass(frozen=True)
class Layout:
    """A kernel body and how it is launched: `k_split(K, bits)` warps a block, splitting K;
    `columns(rows)` output columns a block; `takes(K, bits, group)` whether it computes that product
    (where it does not, the words layout does, at every width alike); `tensor_cores`: whether the
    products it takes run on the tensor cores (worth_routing then routes a tree's verify too)."""
    source: str
    k_split: Callable[[int, int], int]
    columns: Callable[[int], int]
    takes: Callable[[int, int, int], bool]
    tensor_cores: bool = False


LAYOUTS = {
    "words": Layout(_SOURCE, k_split, columns_per_block, lambda k, bits, group: True),
    "wide": Layout(_SOURCE_WIDE, wide_k_split, columns_per_block, lambda k, bits, group: (k * bits // 32) % 4 == 0),
    "mma": Layout(_SOURCE_MMA, mma_k_split, lambda rows: MMA_COLUMNS,
                  lambda k, bits, group: bits == 4 and group % MMA_SLICE == 0, tensor_cores=True),
}
# The mma layout since the forty-seventh round (H100): as exact as the words layout (both within a
# bfloat16 step of the float32 product at every shape and width measured), its products faster than
# the words layout's at every width from 2 rows (the 1.5B's vocabulary projection at 8 rows 86 us
# against 233, MLX 99), the 1.5B's compiled forward of 8 rows 4.31 ms against 4.84 (MLX 8.39), of
# 16 rows 4.50 against 6.01; its pipelined decoding measured no faster or slower side by side
# (launch-bound).
DEFAULT_LAYOUT = "mma"
# What the kernels are, for the probe's stored verdicts (lab/kernel_probe.choose_rows_kernel keys by
# it): a verdict was measured on these sources, and one measured on others (an older kernel) is
# measured again instead of trusted.
SOURCE_DIGEST = source_digest(_HEADER, *(spec.source for spec in LAYOUTS.values()))
LAYOUT_VARIABLE = "DSPARK_LAB_ROWS_LAYOUT"  # names another layout for quantized_rows_matmul() (measuring it through the lab)


def tensor_cores_available() -> bool:
    """Whether this device runs the mma layout's bfloat16 m16n8k16 step: compute capability 8.0 or
    more (Ampere on), as MLX's device_info reports it; a device that does not say counts as able."""
    try:
        major = (mx.device_info() if hasattr(mx, "device_info") else {}).get("compute_capability_major")
    except Exception:
        return True
    return not isinstance(major, int) or major >= 8


def layout_in_force(layout: str | None = None) -> str:
    """The layout quantized_rows_matmul(layout) builds here: `layout` or default_layout(), except
    that a tensor-core layout gives way to the words layout on a device before Ampere."""
    layout = layout or default_layout()
    spec = LAYOUTS.get(layout)
    return "words" if spec is not None and spec.tensor_cores and not tensor_cores_available() else layout


def default_layout() -> str:
    """The layout quantized_rows_matmul builds when none is named: DEFAULT_LAYOUT, unless the
    environment variable DSPARK_LAB_ROWS_LAYOUT names another (so a sweep or the probe can run one
    whose speed is being measured). A name that is no layout is refused when the kernel is built."""
    return os.environ.get(LAYOUT_VARIABLE) or DEFAULT_LAYOUT


def _kernel(layout: str):
    if layout not in _built:
        _built[layout] = mx.fast.cuda_kernel(name=f"dspark_quantized_rows_{layout}", input_names=["x", "w", "scales", "biases"],
                                             output_names=["out"], source=LAYOUTS[layout].source, header=_HEADER)
    return _built[layout]


def quantized_rows_matmul(layout: str | None = None) -> Callable[..., mx.array]:
    """matmul(x, weight, scales, biases, group_size=, bits=) -> x @ dequantize(weight).T, as
    mx.quantized_matmul(..., transpose=True) computes it, for what `supports` accepts. `layout`:
    "words" (a lane loads one packed word at a time), "wide" (16 bytes at a time, _SOURCE_WIDE) or
    "mma" (the rows through the tensor cores, _SOURCE_MMA; on a device before compute capability
    8.0 the words layout instead); a product a layout does not take (see Layout.takes) runs the
    "words" layout, at every width alike; none named: default_layout().
    Raises RuntimeError off CUDA; the kernel is compiled (NVRTC) at its first call for each shape."""
    named = layout
    layout = layout or default_layout()
    if layout not in LAYOUTS:
        where = "" if named else f" (from the environment variable {LAYOUT_VARIABLE})"
        raise ValueError(f"rows kernel layout {layout!r}{where}: choose one of {', '.join(LAYOUTS)}")
    if not cuda_available():
        raise RuntimeError("no CUDA backend on this device (the rows kernel is written for MLX's CUDA backend)")
    layout = layout_in_force(layout)  # before Ampere: no bfloat16 mma step to compile, so the words layout
    _kernel(layout)

    def matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int) -> mx.array:
        *lead, k = x.shape
        use = layout if LAYOUTS[layout].takes(k, bits, group_size) else "words"
        rows, n = math.prod(lead), weight.shape[0]
        c, split = LAYOUTS[use].columns(rows), LAYOUTS[use].k_split(k, bits)
        blocks = -(-n // c)
        # x and out keep their leading dimensions (the kernel reads K off x's last one): a reshape
        # before and after would be two more primitives for the host to hand over a product, about
        # 200 a 0.5B chain round (docs/performance.md, fifty-third round). Views cost the host little;
        # timed in separate processes the cut was neither faster nor slower (fifty-fourth round).
        (out,) = _kernel(use)(inputs=[x, weight, scales, biases],
                              template=[("M", rows), ("C", c), ("BITS", bits), ("GROUP", group_size), ("KSPLIT", split)],
                              grid=(blocks * WARP * split, 1, 1), threadgroup=(WARP * split, 1, 1),
                              output_shapes=[(*lead, n)], output_dtypes=[x.dtype])
        return out

    matmul.layout = layout
    return matmul


def dequantize_float32(weight: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int) -> mx.array:
    """The weights as the kernel dequantizes them: scale * q + bias in float32, one rounding each.
    (mx.dequantize computes in the scales' dtype, bfloat16 here, and so does MLX's own matmul; float32
    keeps the weights the quantizer meant.)"""
    n = weight.shape[0]
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    q = ((weight[..., None] >> shifts) & ((1 << bits) - 1)).reshape(n, -1, group_size).astype(mx.float32)
    w = q * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return w.reshape(n, -1)


def reference_rows_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                          bits: int) -> mx.array:
    """The kernel's product in MLX operations, on any device: the weights dequantized in float32
    (dequantize_float32), a float32 matmul, one rounding to the activation dtype. Not bit-equal to
    the kernel (the sums run in another order) but within float32 rounding of it: the yardstick
    the device check measures both the kernel and mx.quantized_matmul against, and the stand-in
    for the kernel in CPU tests of the routing."""
    w = dequantize_float32(weight, scales, biases, group_size=group_size, bits=bits)
    return (x.astype(mx.float32) @ w.T).astype(x.dtype)


def check_rows(matmul: Callable[..., mx.array], layer: nn.Module, x: mx.array) -> tuple[float, float, bool]:
    """`matmul`'s product of rows `x` with a quantized `layer`, against reference_rows_matmul's:
    (the largest difference, the largest reference output, whether each row equals, bit for bit,
    that row computed alone). What the probe and benchmarks/rows_kernel.py check."""
    args = (layer.weight, layer.scales, layer.get("biases"))
    kw = dict(group_size=layer.group_size, bits=layer.bits)
    got = matmul(x, *args, **kw)
    ref = reference_rows_matmul(x, *args, **kw).astype(mx.float32)
    alone = mx.concatenate([matmul(x[i:i + 1], *args, **kw) for i in range(x.shape[0])])
    return (mx.abs(got.astype(mx.float32) - ref).max().item(), mx.abs(ref).max().item(),
            bool(mx.array_equal(got, alone).item()))


# --- routing a model's quantized layers through it ------------------------------------------------

_ROUTED_CLASSES: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """A subclass of a quantized linear or embedding class whose product (its call, or as_linear
    for a tied embedding) goes through the module's `_dspark_rows` matmul where its policy and
    `supports` say so, and through its own class's product otherwise."""
    if cls in _ROUTED_CLASSES.values():
        return cls
    if cls not in _ROUTED_CLASSES:
        own = cls.as_linear if issubclass(cls, nn.QuantizedEmbedding) else cls.__call__

        def routed(self, x):
            # At a width the policy never takes for this layer (a one-row step, a prefill), the
            # layer's own product with as little Python before it as can be: building a one-row
            # step's graph cost 4% more on the host with a dictionary lookup and a tuple per layer
            # here, and a routed greedy step ran 0.96x the unrouted one on an H100 (fortieth round).
            rows = x.size // x.shape[-1]
            if rows not in self._dspark_widths:
                return own(self, x)
            key = (rows, x.shape[-1], x.dtype)
            route = self._dspark_decisions.by_input.get(key)
            if route is None:  # decided once per input shape and dtype
                weight = self["weight"]
                route = supports(x, weight, self["scales"], self.get("biases"), group_size=self.group_size, bits=self.bits,
                                 mode=getattr(self, "mode", "affine")) is None
                self._dspark_decisions.by_input[key] = route
            if not route:
                return own(self, x)
            y = self._dspark_rows(x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size, bits=self.bits)
            return y + self["bias"] if "bias" in self and not isinstance(self, nn.QuantizedEmbedding) else y

        members = {"as_linear": routed} if issubclass(cls, nn.QuantizedEmbedding) else {"__call__": routed}
        _ROUTED_CLASSES[cls] = type(cls.__name__, (cls,), members)
    return _ROUTED_CLASSES[cls]


def has_quantized_layers(model: nn.Module) -> bool:
    return any(isinstance(m, QUANTIZED_LAYERS) for _, m in model.named_modules())


def route_quantized_rows(model: nn.Module, matmul: Callable[..., mx.array], *,
                         policy: Callable[..., bool] = worth_routing) -> int:
    """Send every quantized linear layer of `model` (and a quantized embedding, for its tied
    vocabulary projection) through `matmul` where `policy(rows, weights, tensor_cores=)` says so
    (and `supports` does), through MLX's kernels elsewhere; `tensor_cores`: whether matmul's
    layout (its `layout` attribute) runs this layer's products on the tensor cores. A module the
    policy takes at no width keeps its own class. Returns how many modules were routed. The modules keep
    their weights; only their class changes (as the Target's taps do), so a caller holding a
    bound `as_linear` must fetch it again."""
    routed = 0
    layout = LAYOUTS.get(getattr(matmul, "layout", None))  # a stand-in product has none: the words layout's widths
    for _, module in model.named_modules():
        if not isinstance(module, QUANTIZED_LAYERS):
            continue
        weights = module.weight.size * 32 // module.bits
        k = module.weight.shape[-1] * 32 // module.bits
        tensor_cores = layout is not None and layout.tensor_cores and layout.takes(k, module.bits, module.group_size)
        widths = frozenset(rows for rows in range(1, MAX_ROWS + 1) if policy(rows, weights, tensor_cores=tensor_cores))
        if not widths:
            _unroute(module)  # never taken at any width: no detour through the routed class's Python
            continue
        module.__class__ = _routed_class(type(module))
        module._dspark_rows, module._dspark_decisions = matmul, _Decisions()
        module._dspark_widths = widths  # the rows the policy takes for this layer's size: all it says
        routed += 1
    return routed


class _Decisions:
    """A routed module's route-or-not per input (rows, K, dtype). Not a dict: an nn.Module keeps
    dict attributes among its children."""

    def __init__(self):
        self.by_input: dict = {}


def _unroute(module: nn.Module) -> bool:
    original = {routed: cls for cls, routed in _ROUTED_CLASSES.items()}.get(type(module))
    if original is None:
        return False
    module.__class__ = original
    del module._dspark_rows, module._dspark_decisions, module._dspark_widths
    return True


def unroute_quantized_rows(model: nn.Module) -> int:
    """Undo route_quantized_rows: the modules get their own classes back."""
    return sum(_unroute(module) for _, module in model.named_modules())
