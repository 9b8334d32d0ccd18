#!/usr/bin/env bash
# Download the peer engine mlx-dspark 0.20.3 and the few wheels its import needs that the
# H200 device lacks, for Python 3.12 on x86-64 Linux, into .whl/ at the repository root
# (ignored by git). Run here, where PyPI is reachable; the device has no network.
#
#   bash benchmarks/ship_peer.sh [PIP]        # PIP defaults to "python3 -m pip"
#
# Deliberately NOT shipped: mlx and mlx-lm (the device gets mlx 0.32.4 + mlx-lm 0.32.2
# separately, and mlx-dspark only asks for mlx>=0.32.0, mlx-lm>=0.31.3), nor numpy,
# transformers, tokenizers, safetensors, huggingface_hub (preinstalled there). Every wheel is
# fetched --no-deps: mlx-vlm declares opencv, mlx-audio, datasets, fastapi ... which
# `import mlx_dspark` never touches; what the import does touch beyond the device's set is
# mlx_vlm -> PIL and requests (with urllib3, certifi, charset_normalizer, idna).
#
# On the device (from the repository root):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
PIP=${1:-python3 -m pip}
ROOT=$(git rev-parse --show-toplevel)
DEST="$ROOT/.whl"
mkdir -p "$DEST"

# .whl/ must stay out of commits: worktrees share the main repository's info/exclude.
if ! git -C "$ROOT" check-ignore -q "$DEST/x.whl"; then
  echo "/.whl/" >> "$(git -C "$ROOT" rev-parse --git-common-dir)/info/exclude"
fi

PLAT=(--python-version 3.12 --implementation cp --abi cp312
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --only-binary=:all: --no-deps -d "$DEST")
$PIP download -q "${PLAT[@]}" \
  mlx-dspark==0.20.3 mlx-vlm==0.7.10 pillow requests urllib3 certifi charset-normalizer idna

if ls "$DEST" | grep -Eiq '^mlx(_lm|_cpu|_cuda|_metal)?-[0-9]'; then
  echo "error: an mlx or mlx-lm wheel is in $DEST; the device must keep its own" >&2
  exit 1
fi
ls -l "$DEST"
du -sh "$DEST"
