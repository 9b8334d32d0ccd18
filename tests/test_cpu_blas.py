"""benchmarks/cpu_blas.sh: a library that routes MLX's CPU float32 matmuls to numpy's OpenBLAS,
built, checked in a fresh process and turned on with the line it prints; without it MLX's own
reference BLAS gives another product (so the check can tell whether the library took)."""

import os
import shutil
import subprocess
import sys

import pytest

from scripts import BENCHMARKS

def _numpy_openblas() -> bool:
    import glob

    import numpy

    return bool(glob.glob(os.path.dirname(numpy.__file__) + ".libs/libscipy_openblas64_*.so"))


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which(os.environ.get("CC", "cc")) is None or not _numpy_openblas(),
    reason="the library is for MLX's Linux CPU wheel and needs a C compiler and numpy's wheel (its OpenBLAS)")


def test_the_built_library_puts_mlx_matmuls_in_openblas_and_without_it_they_differ(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CPU_BLAS_DIR=str(tmp_path))
    env.pop("LD_PRELOAD", None)
    built = subprocess.run(["bash", str(BENCHMARKS / "cpu_blas.sh")], env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    lib = tmp_path / "libmlx_openblas.so"
    assert built.stdout.strip() == f"export LD_PRELOAD={lib}" and lib.is_file()
    assert "runs in numpy's OpenBLAS" in built.stderr and "GFLOP/s" in built.stderr
    # the same check without the library: MLX's bundled BLAS sums in another order
    alone = subprocess.run([sys.executable, str(BENCHMARKS / "cpu_blas" / "check.py")], env=env, capture_output=True, text=True)
    assert alone.returncode != 0 and "did not take" in alone.stderr, \
        "MLX's matmul already equals numpy's: its wheel may carry OpenBLAS now, and cpu_blas.sh is not needed"


def test_no_compiler_is_refused_by_name(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CPU_BLAS_DIR=str(tmp_path), CC="no-such-cc")
    r = subprocess.run(["bash", str(BENCHMARKS / "cpu_blas.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "no C compiler 'no-such-cc'" in r.stderr and not list(tmp_path.iterdir())
