"""What one MLX primitive costs the host to hand to the device, by kind.

    python benchmarks/primitive_cost.py [--count 256] [--repeats 20] [--json OUT]

The pipelined rounds are bound by the host (docs/performance.md, forty-eighth and fifty-second
rounds): the round's `mx.async_eval` takes most of it, and MLX's CUDA backend spends that time per
primitive it evaluates (allocating outputs, recording a kernel node, tracking buffers), kernel or
not. Which primitives cost most decides what to cut from a round. This builds, for each kind, a
chain of --count primitives of that kind on a small array (nothing else in the graph), and times
building the chain (Python), `mx.async_eval` of its end (the host's hand-over), and the wait for
the device after it (whatever the device has left). Per primitive, median of --repeats, after
warm-ups. Kinds: an elementwise add (one kernel), a dtype conversion (a copy kernel), reshapes
and transposes (views, no kernel), a compiled function of four elementwise operations (one fused
kernel), MLX's fast RMS norm, 4-bit products of one row and of eight (MLX's kernels), and on CUDA
custom kernels through mx.fast.cuda_kernel with one and four inputs and with a long source (the
engine's kernels go through the same path), and the engine's rows kernel at eight rows (what a
chain verify's products run instead of MLX's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the engine's rows kernel, from this checkout

import mlx.core as mx  # noqa: E402


def _copy_link(name: str, body: str, extra: tuple[mx.array, ...] = ()):
    """A chain link through mx.fast.cuda_kernel: an elementwise kernel over a 2-D `a` (then the
    scalars `extra`, inputs b, c, d) whose `body` writes o[i]."""
    names = ["a", "b", "c", "d"][: 1 + len(extra)]
    kernel = mx.fast.cuda_kernel(name=name, input_names=names, output_names=["o"],
                                 source="auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < a_shape[0] * a_shape[1]) " + body)

    def link(a):
        return kernel(inputs=[a, *extra], output_shapes=[a.shape], output_dtypes=[a.dtype], grid=(a.size, 1, 1),
                      threadgroup=(256, 1, 1))[0]

    return link


def _chains() -> dict:
    """kind -> (start array, one link: array -> array)."""
    x = mx.random.normal((8, 128)).astype(mx.bfloat16)
    w, scales, biases = mx.quantize(mx.random.normal((128, 128)).astype(mx.bfloat16), group_size=64, bits=4)
    row = x[:1]
    norm = mx.ones((128,), dtype=mx.bfloat16)
    fused = mx.compile(lambda a: ((a + 1) * 2 - 1) * 0.5)  # four elementwise operations, one fused kernel
    chains = {
        "add": (x, lambda a: a + 1),
        "astype (a copy)": (x, lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a.astype(mx.bfloat16)),
        "reshape": (x, lambda a: a.reshape(16, 64) if a.shape[0] == 8 else a.reshape(8, 128)),
        "transpose": (x, lambda a: a.T),
        "compiled, 4 ops fused": (x, fused),
        "rms_norm (fast)": (x, lambda a: mx.fast.rms_norm(a, norm, 1e-6)),
        "qmv (1 row, 4-bit)": (row, lambda a: mx.quantized_matmul(a, w, scales, biases, transpose=True, group_size=64, bits=4)),
        "qmm (8 rows, 4-bit)": (x, lambda a: mx.quantized_matmul(a, w, scales, biases, transpose=True, group_size=64, bits=4)),
    }
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        extra = tuple(mx.zeros((1,), dtype=mx.bfloat16) for _ in range(3))
        mx.eval(extra)
        chains["custom kernel"] = (x, _copy_link("primitive_cost_copy", "o[i] = a[i];"))
        chains["custom kernel, 4 inputs"] = (x, _copy_link("primitive_cost_copy4", "o[i] = a[i] + b[0] + c[0] + d[0];", extra))
        # The same copy with 6 KB of comments: MLX hashes a custom kernel's whole source at every
        # launch (to find its compiled module), and the engine's kernels run 2-7 KB.
        chains["custom kernel, 6 KB source"] = (x, _copy_link("primitive_cost_copy_long", "o[i] = a[i];\n"
                                                              + "// a comment that only makes the source longer\n" * 128))
        from dspark_lab.engine.rows_kernel import quantized_rows_matmul

        rows_matmul = quantized_rows_matmul()
        chains["rows kernel (8 rows, 4-bit)"] = (x, lambda a: rows_matmul(a, w, scales, biases, group_size=64, bits=4))
    mx.eval([w, scales, biases, x])
    return chains


def time_chain(start: mx.array, link, n: int) -> tuple[float, float, float]:
    """(build, async_eval, wait) seconds for a chain of n links after `start`."""
    t0 = time.perf_counter()
    a = start
    for _ in range(n):
        a = link(a)
    t1 = time.perf_counter()
    mx.async_eval(a)
    t2 = time.perf_counter()
    mx.eval(a)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=256, help="primitives in each chain")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    report = {}
    for kind, (start, link) in _chains().items():
        for _ in range(3):
            time_chain(start, link, a.count)  # warm-ups: kernels compiled, buffers cached
        runs = [time_chain(start, link, a.count) for _ in range(a.repeats)]
        build, launch, wait = (statistics.median(r[i] for r in runs) / a.count * 1e6 for i in range(3))
        report[kind] = {"build_us": build, "async_eval_us": launch, "wait_us": wait}
        print(f"{kind:>20}: build {build:6.2f} us, async_eval {launch:6.2f} us, then waiting {wait:6.2f} us a primitive", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
