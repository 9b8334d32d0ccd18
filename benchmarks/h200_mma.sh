#!/usr/bin/env bash
# The rows kernel's mma layout on the device, then the lab's sweep with the faster layout
# (docs/performance.md, forty-sixth round). From the checkout on the device, after
# `source /root/ship/mlx/activate` (models and heads shipped as prepare_device_session.sh does):
#   OUT=$OUT bash benchmarks/h200_mma.sh products          random layers of both Qwen models' shapes,
#       every layout beside MLX's product -> OUT/products.{json,log} (MLX alone needs shipping)
#   OUT=$OUT bash benchmarks/h200_mma.sh bench qwen15      the model's forwards and decoding, the words
#       layout (the engine's policy) beside the mma layout under three policies -> OUT/NAME.{json,log},
#       kept in KEEP (default /root) for the sweep's choice; then the sweep for what is left of 580 s
#   OUT=$OUT bash benchmarks/h200_mma.sh sweep qwen15 [--resume]   the lab's sweep (as loaded and routed,
#       caps 3,7,auto, 8 prompts a set, 2 trials) with DSPARK_LAB_ROWS_LAYOUT set to the layout whose chain
#       at cap 7 decoded faster in KEEP/NAME.json (pick_layout.py; words without one), stopped at 580 s
#       into the call (a sweep keeps every finished trial: --resume in the next call goes on)
#       -> OUT/sweep_NAME.{json,log,duckdb}
# NAME is qwen15 or qwen05 (/root/ship/NAME/...; HEADS overrides /root/ship/data/heads).
set -o pipefail
step=${1:?usage: h200_mma.sh products | bench NAME | sweep NAME [--resume]}
name=${2:-}
out=${OUT:?set OUT to the folder whose files come back}
heads=${HEADS:-/root/ship/data/heads}
keep=${KEEP:-/root}  # what later calls on the same machine read: the bench report, the sweep's database and log
export PYTHONUNBUFFERED=1
model_of() {
  case $1 in
    qwen15) echo /root/ship/qwen15/qwen2.5-coder-1.5b-q4-bfloat16 ;;
    qwen05) echo /root/ship/qwen05/qwen2.5-coder-0.5b-q4-bfloat16 ;;
    *) echo "unknown model $1 (qwen15, qwen05)" >&2; return 2 ;;
  esac
}
sweep() {
  local model=$1 left=$((580 - SECONDS)); shift
  [ "$left" -gt 30 ] || { echo "sweep: ${left}s left in this call, too few; run the sweep step next"; return 0; }  # timeout 0 would never stop it
  local layout; layout=$(python3 benchmarks/pick_layout.py "$keep/$name.json")
  echo "sweep: DSPARK_LAB_ROWS_LAYOUT=$layout, ${left}s" | tee -a "$keep/sweep_$name.log"
  DSPARK_LAB_ROWS_LAYOUT=$layout timeout "$left" python3 -m dspark_lab sweep -m "$model" -d "$heads/$name" --drafter-bits 16 \
    --modes dspark-pipe --compile-draft --caps 3,7,auto --precisions as-loaded,rows-kernel --prompt-limit 8 \
    --trials 2 -n 128 --db "$keep/sweep_$name.duckdb" --json "$out/sweep_$name.json" "$@" 2>&1 | tee -a "$keep/sweep_$name.log"
  cp "$keep/sweep_$name.log" "$out/"; cp "$keep/sweep_$name.duckdb" "$out/" 2>/dev/null; true
}
case $step in
  products)
    python3 benchmarks/rows_kernel.py --shapes 2048x1536,1536x1536,17920x1536,1536x8960,151936x1536,9728x896,151936x896 \
      --rows 1,2,4,8,9,16,17,32 --repeats 10 --json "$out/products.json" 2>&1 | tee "$out/products.log" ;;
  bench)
    model=$(model_of "$name") || exit 2
    timeout 300 python3 benchmarks/rows_kernel.py --model "$model" --head "$heads/$name" --rows "" --widths 1,2,4,8,9,16,17,32 \
      --caps 3,7,8 --tree-pipe 16 --prompts 2 --max-new-tokens 128 --repeats 15 \
      --copies worth_routing,with_verifies:mma,multi_row:mma,every_width:mma --json "$out/$name.json" 2>&1 | tee "$out/$name.log"
    cp "$out/$name.json" "$keep/$name.json" 2>/dev/null
    sweep "$model" ;;
  sweep)
    model=$(model_of "$name") || exit 2
    shift 2
    sweep "$model" "$@" ;;
  *) echo "unknown step $step (products, bench NAME, sweep NAME)"; exit 2 ;;
esac
