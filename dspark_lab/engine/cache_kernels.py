"""The array-offset KV cache's writes as single kernels (CUDA): a forward's new rows, a tree's kept path.

Both exist because the pipelined loops are bound by the host's launching (docs/performance.md,
forty-eighth round): what a kernel computes costs little beside launching it.

Writing a forward's new keys and values at an array offset (compiled.ArrayOffsetKV) is, in MLX's
operations, a dynamic slice update each: on CUDA two kernels each (the offset computed, then the
copy), four a layer. `cache_write_kernel` writes both in one: it writes the layer's buffers anew,
each position from the new rows or the old buffer. That copies the buffers (a few hundred
kilobytes a layer at these lengths: well under a microsecond of bandwidth each) to launch once.
The copy grows with the context: the 1.5B's buffers at 32k tokens hold about 0.9 GB, read and
written each forward (some 0.7 ms on an H100), where MLX's updates write in place (an MLX custom
kernel cannot write into its input). So both kernels leave an array larger than `COPY_LIMIT` to
MLX's operations: at 8 MiB (16k positions of the 1.5B's, 32k of the 0.5B's) a layer's write
copies about 32 MB, some 10 us of an H100's bandwidth, about what the three launches it saves
cost the host; a tree's move saves about eight a layer. An estimate, not a measurement: only
short contexts were timed (docs/performance.md, forty-ninth round).

Moving a tree's kept path: after a pipelined tree round (compiled.OffsetForward.tree_round) the rows of the path the
target kept must follow the cache in path order. With MLX's operations that is a gather and a
write for each layer's keys and for its values; on CUDA the write at an array offset is two
kernels and the gathered rows need a copy, so about 190 launches a round for Qwen2.5 0.5B
(benchmarks/kernel_census.py, docs/performance.md, forty-ninth round). The pipelined loop is bound
by the host's launching, so those launches cost the round about what they would cost if they
computed something. Here one kernel writes every array anew: position offset + j takes row
offset + path[j] (j <= the path's last depth), every other position itself. It copies the whole
buffers (a few megabytes a round at these lengths: microseconds of bandwidth) to launch once.

`written_by_operations` and `moved_by_operations` are the same in MLX operations: the engine's
default, and the CPU's stand-ins for the kernels (tests compare them).
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from .kernels import cuda_available, source_digest

# One thread an element of one array; {cases} picks the array (inputs a0.., outputs o0..).
_MOVE = """
    const int L = a0_shape[2];
    const int D = a0_shape[3];
    const size_t per = (size_t)a0_shape[0] * a0_shape[1] * L * D;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= per * {count}) return;
    const int which = (int)(i / per);
    const size_t e = i - (size_t)which * per;
    const int d = (int)(e % D);
    const size_t row = e / D;
    const int t = (int)(row % L);
    const size_t head = row / L;
    const int first = offset[0];
    int from = t;
    if (t >= first && t - first < path_shape[0]) from = first + path[t - first];
    const size_t src = (head * L + from) * D + d;
    switch (which) {{
{cases}
    }}
"""

# One thread a position and dimension of one key/value head: the key and the value there. Every
# input is read through its strides: the buffers are row-contiguous already, and an mx.contiguous
# around each would cost the host a primitive to hand over (two a layer) with nothing to copy.
_WRITE = """
    const int T = keys_shape[2];
    const int D = keys_shape[3];
    const int n = new_keys_shape[2];
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)keys_shape[1] * T * D) return;
    const int d = (int)(i % D);
    const int t = (int)((i / D) % T);
    const int h = (int)(i / ((size_t)D * T));
    const int row = t - offset[0];
    if (row >= 0 && row < n) {
        out_keys[i] = new_keys[h * new_keys_strides[1] + row * new_keys_strides[2] + d * new_keys_strides[3]];
        out_values[i] = new_values[h * new_values_strides[1] + row * new_values_strides[2] + d * new_values_strides[3]];
    } else {
        out_keys[i] = keys[h * keys_strides[1] + t * keys_strides[2] + d * keys_strides[3]];
        out_values[i] = values[h * values_strides[1] + t * values_strides[2] + d * values_strides[3]];
    }
"""

_built: dict = {}
SOURCE_DIGEST = source_digest(_MOVE, _WRITE)  # what a stored verdict was measured on (lab/kernel_probe.py)

# Bytes of one (1, heads, positions, dim) buffer above which a kernel that writes it anew leaves it
# to MLX's in-place operations (see the module docstring).
COPY_LIMIT = 8 << 20


def copies_too_much(array: mx.array) -> bool:
    return array.nbytes > COPY_LIMIT


def written_by_operations(keys: mx.array, values: mx.array, new_keys: mx.array, new_values: mx.array,
                          offset: mx.array) -> tuple[mx.array, mx.array]:
    """The (1, heads, positions, dim) buffers with the new rows written at `offset`, in MLX operations."""
    at = offset.reshape(1)
    return (mx.slice_update(keys, new_keys.astype(keys.dtype), at, axes=(2,)),
            mx.slice_update(values, new_values.astype(values.dtype), at, axes=(2,)))


def cache_write_kernel() -> Callable[..., tuple[mx.array, mx.array]]:
    """write(keys, values, new_keys, new_values, offset) -> written_by_operations' result from one
    kernel launch (the new rows read through their strides); buffers of more than one batch, or
    larger than COPY_LIMIT, are written by operations. Raises RuntimeError off CUDA."""
    if not cuda_available():
        raise RuntimeError("no CUDA backend on this device (the cache write kernel is written for MLX's CUDA backend)")
    if "write" not in _built:
        _built["write"] = mx.fast.cuda_kernel(name="dspark_cache_write", input_names=["keys", "values", "new_keys", "new_values", "offset"],
                                              output_names=["out_keys", "out_values"], source=_WRITE, ensure_row_contiguous=False)
    kernel = _built["write"]

    def write(keys, values, new_keys, new_values, offset):
        if keys.shape[0] != 1 or keys.shape != values.shape or new_keys.shape != new_values.shape or copies_too_much(keys):
            return written_by_operations(keys, values, new_keys, new_values, offset)
        return tuple(kernel(inputs=[keys, values, new_keys.astype(keys.dtype),
                                    new_values.astype(values.dtype), offset.reshape(1).astype(mx.int32)],
                            grid=(keys.size, 1, 1), threadgroup=(256, 1, 1),
                            output_shapes=[keys.shape, values.shape], output_dtypes=[keys.dtype, values.dtype]))

    return write


def cache_writer_here() -> Callable[..., tuple[mx.array, mx.array]] | None:
    """The cache write kernel where this machine can build it, else None (MLX's operations): for the
    compiled one-row greedy step, whose writes it takes wherever its attention takes the attention
    kernel (the step's own probe times them together)."""
    try:
        return cache_write_kernel()
    except RuntimeError:
        return None


def moved_by_operations(arrays: Sequence[mx.array], offset: mx.array, path: mx.array) -> list[mx.array]:
    """Each (1, heads, positions, dim) array with positions offset + j holding what row
    offset + path[j] held (j over path's length), in MLX operations."""
    rows, at = offset + path, offset.reshape(1)
    return [mx.slice_update(a, mx.take(a, rows, axis=2), at, axes=(2,)) for a in arrays]


def same_layout(arrays: Sequence[mx.array]) -> bool:
    """The kernel takes arrays of one shape and dtype, (1, heads, positions, dim)."""
    return bool(arrays) and all(a.ndim == 4 and a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays)


def cache_move_kernel() -> Callable[[Sequence[mx.array], mx.array, mx.array], list[mx.array]]:
    """move(arrays, offset, path) -> moved_by_operations' result from one kernel launch; arrays not
    of one layout (same_layout), or larger than COPY_LIMIT, move by operations. Raises RuntimeError
    off CUDA."""
    if not cuda_available():
        raise RuntimeError("no CUDA backend on this device (the cache move kernel is written for MLX's CUDA backend)")

    def move(arrays: Sequence[mx.array], offset: mx.array, path: mx.array) -> list[mx.array]:
        if not same_layout(arrays) or copies_too_much(arrays[0]):
            return moved_by_operations(arrays, offset, path)
        n = len(arrays)
        if n not in _built:  # one kernel for each number of arrays
            cases = "\n".join(f"        case {j}: o{j}[e] = a{j}[src]; break;" for j in range(n))
            _built[n] = mx.fast.cuda_kernel(name=f"dspark_cache_move_{n}", input_names=[f"a{j}" for j in range(n)] + ["offset", "path"],
                                            output_names=[f"o{j}" for j in range(n)], source=_MOVE.format(count=n, cases=cases))
        total = n * arrays[0].size
        return _built[n](inputs=[*arrays, offset.reshape(1).astype(mx.int32), path.astype(mx.int32)],
                         grid=(total, 1, 1), threadgroup=(256, 1, 1),
                         output_shapes=[arrays[0].shape] * n, output_dtypes=[arrays[0].dtype] * n)

    return move
