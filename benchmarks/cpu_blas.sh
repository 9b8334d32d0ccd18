#!/usr/bin/env bash
# Make MLX's CPU backend multiply float32 matrices with numpy's OpenBLAS instead of the reference
# BLAS its Linux wheel bundles (25x to 40x faster on this project's 2-core machine), for research
# runs on a Linux CPU:
#   eval "$(bash benchmarks/cpu_blas.sh)"      # builds, checks, and exports LD_PRELOAD in this shell
#   python benchmarks/block_accept.py ... --dtype float32 --dequantize
# It compiles benchmarks/cpu_blas/mlx_openblas.c (three forwarding functions) against the OpenBLAS
# in numpy's wheel, checks in a fresh process that MLX's matmul now gives numpy's result bit for
# bit (the same library ran it), prints the speed, and prints the export line on stdout.
# Only float32 gains: MLX's bfloat16 and quantized CPU kernels do not call BLAS, so load a model
# with --dtype float32 (and --dequantize for a quantized one: 6 GB for the 1.5B).
# Not for the test suite or a lossless check: OpenBLAS picks its kernels by shape, so a position's
# logits can differ in the last bits between a one-token decode step and an eight-token verify
# (near-ties may then order differently, as on a GPU), where the reference BLAS sums every dot
# product in one order whatever the shape.
# Needs a C compiler (CC, default cc) and numpy >= 2 (its numpy.libs/libscipy_openblas64_*.so).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py=${PYTHON:-$root/.venv/bin/python}
out=${CPU_BLAS_DIR:-$HOME/.cache/dspark-lab/cpu_blas}
cc=${CC:-cc}
command -v "$cc" >/dev/null || { echo "cpu_blas: no C compiler '$cc': install gcc (apt install gcc) or set CC" >&2; exit 2; }
openblas=$("$py" -c 'import glob, os, numpy; print(*glob.glob(os.path.dirname(numpy.__file__) + ".libs/libscipy_openblas64_*.so")[:1])')
[ -n "$openblas" ] || { echo "cpu_blas: $py's numpy carries no OpenBLAS (numpy.libs/libscipy_openblas64_*.so): pip install 'numpy>=2' from a wheel" >&2; exit 2; }
mkdir -p "$out"
lib=$out/libmlx_openblas.so
# --no-undefined: a numpy whose OpenBLAS lacks one of the three names fails here, not at MLX's first matmul
"$cc" -O2 -shared -fPIC -Wl,--no-undefined "$root/benchmarks/cpu_blas/mlx_openblas.c" -o "$lib" "$openblas" \
  -Wl,-rpath,"$(dirname "$openblas")"
LD_PRELOAD=$lib "$py" "$root/benchmarks/cpu_blas/check.py" >&2
echo "export LD_PRELOAD=$lib"
