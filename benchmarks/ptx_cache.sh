#!/usr/bin/env bash
# Keep MLX's compiled CUDA kernels from one GPU session to the next.
# Why: a fresh GPU machine compiles (NVRTC) every kernel shape on first use; the fifty-first and
# fifty-second rounds (docs/performance.md) lost 200-300 s of a 1,800 s session to those warm-ups.
# MLX keeps what it compiles for its own kernels (not for mx.fast.cuda_kernel's, which it compiles
# in each process) as files in MLX_PTX_CACHE_DIR and reads them back instead of compiling again.
# Those files depend on MLX's version and the GPU's architecture (H100 and H200 are both sm_90),
# so the cache is kept per MLX version and is only a cache: a missing or stale one costs the
# warm-ups again, never a wrong result (MLX names each file by the kernel it compiled).
#
# On the GPU machine, after `source /root/ship/mlx/activate`:
#   source benchmarks/ptx_cache.sh use      sets MLX_PTX_CACHE_DIR (under /root/ptx), seeded from /root/ship/data/ptx
#                                            (what prepare_device_session.sh trees shipped) once
#   bash benchmarks/ptx_cache.sh save       packs the cache into $OUT/ptx_cache.tgz (last call)
# On this machine:
#   bash benchmarks/ptx_cache.sh keep FILE  keeps a returned ptx_cache.tgz for the next session
#                                            (prepare_device_session.sh trees ships it in the data part)
# (No `set -u`: `use` is sourced into the caller's shell.)
keep_dir=${PTX_KEEP:-$HOME/.cache/dspark-lab/ptx}
ship=${SHIP_ROOT:-/root/ship}  # where the device's recv.sh unpacks what was shipped
version() {  # MLX's version from the shipped wheel's name (no import: this runs before any Python)
  local whl; whl=$(ls "$ship"/mlx/mlx-[0-9]*.whl 2>/dev/null | head -1)
  basename "${whl:-mlx-unknown-}" | cut -d- -f2
}
ver=$(version)
ptx_dir=${MLX_PTX_CACHE_DIR:-${PTX_ROOT:-/root/ptx}/$ver}  # (MLX's own default, under /tmp, would not say which cache it is)
case ${1:-} in
  use)
    export MLX_PTX_CACHE_DIR=$ptx_dir
    mkdir -p "$MLX_PTX_CACHE_DIR"
    if [ ! -e "$MLX_PTX_CACHE_DIR/.seeded" ] && [ -f "$ship/data/ptx/ptx_cache-$ver.tgz" ]; then
      tar xzf "$ship/data/ptx/ptx_cache-$ver.tgz" -C "$MLX_PTX_CACHE_DIR" && touch "$MLX_PTX_CACHE_DIR/.seeded"
      echo "ptx cache: $(ls "$MLX_PTX_CACHE_DIR" | grep -c '\.ptx$') kernels seeded into $MLX_PTX_CACHE_DIR"
    fi
    ;;
  save)
    [ -d "$ptx_dir" ] || { echo "no ptx cache at $ptx_dir (was 'source benchmarks/ptx_cache.sh use' run?)" >&2; exit 1; }
    tar czf "${OUT:?set OUT}/ptx_cache-$ver.tgz" -C "$ptx_dir" --exclude=.seeded .
    echo "ptx cache: $(ls "$ptx_dir" | grep -c '\.ptx$') kernels, $(du -k "$OUT/ptx_cache-$ver.tgz" | cut -f1) kB packed"
    ;;
  keep)
    f=${2:?usage: ptx_cache.sh keep FILE (a ptx_cache-VERSION.tgz a device call returned)}
    mkdir -p "$keep_dir" && cp "$f" "$keep_dir/" && chmod u+w "$keep_dir/$(basename "$f")"
    echo "kept $(basename "$f") in $keep_dir: prepare_device_session.sh trees ships it"
    ;;
  *) echo "usage: source ptx_cache.sh use | bash ptx_cache.sh save | bash ptx_cache.sh keep FILE" >&2; return 2 2>/dev/null || exit 2 ;;
esac
