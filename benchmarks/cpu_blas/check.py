"""Check, in a process started with benchmarks/cpu_blas.sh's library preloaded, that MLX's CPU
float32 matmul runs in numpy's OpenBLAS: the same product bit for bit (the reference BLAS MLX
bundles sums in another order, so it differs in the last bits), and how fast."""

import sys
import time

import mlx.core as mx
import numpy as np

mx.set_default_device(mx.cpu)
m, k, n = 300, 1536, 8960  # a 300-token row through the 1.5B's MLP up-projection
a = mx.random.normal((m, k), key=mx.random.key(0))
b = mx.random.normal((k, n), key=mx.random.key(1))
ours = np.array(a @ b)
if not np.array_equal(ours, np.array(a) @ np.array(b)):
    sys.exit("cpu_blas: MLX's matmul does not match numpy's OpenBLAS bit for bit: the library did not take "
             "(was mlx imported through another BLAS, or LD_PRELOAD dropped by a wrapper?)")
start = time.perf_counter()
for _ in range(3):
    mx.eval(a @ b)
seconds = (time.perf_counter() - start) / 3
print(f"cpu_blas: MLX's float32 matmul runs in numpy's OpenBLAS: {2 * m * k * n / seconds / 1e9:.0f} GFLOP/s "
      f"({m} x {k} x {n})")
