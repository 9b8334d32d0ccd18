"""Custom GPU kernels, each a stand-in for a chain of MLX operations that gives the same result.

On a launch-bound device (small models on an H200: docs/performance.md) a round's time follows
the number of kernels it launches, so one hand-written kernel for a chain of small ones can pay.
Whether it does, and whether it is exact on this machine, is measured, not assumed:
lab/kernel_probe.py times each kernel against the chain it replaces and compares every output,
and stores that verdict like calibration; the engine runs a kernel only when it is handed one.

- `ngram_lookup_kernel`: DeviceLookup.propose (the pipelined loop's device-side n-gram match,
  26 MLX kernels a round) as one CUDA kernel. Metal is left out: no Apple GPU was at hand to
  probe it on.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import mlx.core as mx


def source_digest(*sources: str) -> str:
    """A short digest of kernel sources. The probe (lab/kernel_probe.py) keys its stored verdicts by
    it: a verdict measured on other sources (an older kernel) is measured again instead of trusted."""
    return hashlib.sha256("".join(sources).encode()).hexdigest()[:12]


THREADS = 512  # one thread block scans the token buffer, each thread every THREADS-th window

# Inputs: tokens (size,) uint32, the committed tokens with the pending one at `at`; at (1,) int32.
# Outputs: out_tokens (K,) uint32 and usable (K,) bool, as DeviceLookup.propose returns them.
# Every window end e before `at` counts how many tokens ending at e equal the newest ones ending
# at `at` (at most N_MAX); each n-gram length N_MIN..N_MAX keeps the latest e + 1 (where the
# continuation starts) whose run reaches it; the longest length with a match wins.
_NGRAM_SOURCE = """
    const int size = tokens_shape[0];
    const int a = at[0];
    __shared__ int latest[N_MAX - N_MIN + 1];
    const int tid = threadIdx.x;
    if (tid <= N_MAX - N_MIN) {
        latest[tid] = -1;
    }
    __syncthreads();
    for (int e = tid; e < size && e + 1 <= a; e += blockDim.x) {
        int run = 0;
        while (run < N_MAX && e - run >= 0 && tokens[e - run] == tokens[a - run]) {
            ++run;
        }
        for (int n = N_MAX; n >= N_MIN; --n) {
            if (run >= n) {
                atomicMax(&latest[N_MAX - n], e + 1);
            }
        }
    }
    __syncthreads();
    if (tid < K) {
        int start = -1;
        for (int i = 0; i <= N_MAX - N_MIN && start < 0; ++i) {
            start = latest[i];
        }
        const int pos = start + tid;
        const int clipped = pos < 0 ? 0 : (pos > size - 1 ? size - 1 : pos);
        out_tokens[tid] = tokens[clipped];
        usable[tid] = start >= 0 && pos <= a;
    }
"""
SOURCE_DIGEST = source_digest(_NGRAM_SOURCE)  # what a stored lookup verdict was measured on

_built: dict[str, object] = {}


def cuda_available() -> bool:
    """MLX's CUDA backend is present and the default device is its GPU."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device().type == mx.DeviceType.gpu)


def ngram_lookup_kernel(ns: tuple[int, ...]) -> Callable[[mx.array, mx.array, int], tuple[mx.array, mx.array]]:
    """propose(tokens, at, k) -> (tokens (k,), usable (k,)) for n-gram lengths `ns` (a run of
    consecutive lengths, as the engine uses: 4 and 3). Raises RuntimeError off CUDA or for
    lengths with gaps; the kernel source is compiled on its first call."""
    if not cuda_available():
        raise RuntimeError("no CUDA backend on this device (the n-gram kernel is written for MLX's CUDA backend)")
    n_max, n_min = max(ns), min(ns)
    if sorted(ns) != list(range(n_min, n_max + 1)):
        raise RuntimeError(f"the n-gram kernel takes consecutive lengths, got {sorted(ns)}")
    if "ngram" not in _built:
        _built["ngram"] = mx.fast.cuda_kernel(name="dspark_ngram_lookup", input_names=["tokens", "at"],
                                              output_names=["out_tokens", "usable"], source=_NGRAM_SOURCE)
    kernel = _built["ngram"]

    def propose(tokens: mx.array, at: mx.array, k: int) -> tuple[mx.array, mx.array]:
        out, usable = kernel(inputs=[tokens, at.reshape(1).astype(mx.int32)],
                             template=[("N_MAX", n_max), ("N_MIN", n_min), ("K", k)],
                             grid=(THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                             output_shapes=[(k,), (k,)], output_dtypes=[mx.uint32, mx.bool_])
        return out, usable

    return propose
