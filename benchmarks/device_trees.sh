#!/usr/bin/env bash
# Trees against the chain on the device, with every verify width routed through the rows kernel's
# tensor-core layout (docs/performance.md, forty-eighth round). From the checkout on the device,
# after `source /root/ship/mlx/activate` (models and heads shipped as prepare_device_session.sh does):
#   OUT=$OUT bash benchmarks/device_trees.sh bench NAME    decoding side by side: MLX's greedy, and
#       through the engine's routing its greedy, the chain at caps 3 and 7 and trees of TREES
#       (NODES@DEPTH[+lk]; default 7@7,15@7,16@7,15@5,8@7+lk: 8, 16, 17, 16 and 16 verify rows) -> OUT/NAME_trees.{json,log}
#   OUT=$OUT bash benchmarks/device_trees.sh cuts NAME    the launch kernels (forty-ninth round) and the
#       head's stacked projections (fiftieth) side by side: COPIES (default MLX's operations with the
#       head's projections apart, the three kernels with them apart, stacked, and stacked at 4 bits),
#       greedy (plain and compiled step), the chain at cap 7, trees of NODES (default 15), PROMPTS
#       (default 3) a set -> OUT/NAME_cuts.{json,log}
#   OUT=$OUT bash benchmarks/device_trees.sh census NAME   the kernels a compiled greedy step, a chain
#       round at cap 7 and a tree round of NODES (default 15) launch, by name, with the three launch
#       kernels and the head at HEAD_BITS (default 4; its writes through the kernel since the fiftieth
#       round) -> OUT/NAME_census.log
#   OUT=$OUT bash benchmarks/device_trees.sh sweep NAME [--resume]   the lab's sweep of the routed
#       copy: the chain and trees of NODES (default 15) at caps CAPS (default 5,7), 8 prompts a set,
#       2 trials, stopped 580 s into the call (a sweep keeps every finished trial: --resume goes on);
#       the launch kernels as the engine's probe finds them (its verdict in the run's config); the
#       head at the CLI's default 4 bits (the fiftieth round ran it with --drafter-bits 16 too: the
#       same stored values through cuBLAS's float products, 5-10% slower side by side)
#       -> OUT/sweep_trees_NAME.{json,log}
# NAME is qwen15 or qwen05 (/root/ship/NAME/...; HEADS overrides /root/ship/data/heads; KEEP, default
# /root, holds what a later call on the same machine reads: the sweep's database and log).
set -o pipefail
step=${1:?usage: device_trees.sh bench NAME | cuts NAME | census NAME | sweep NAME [--resume]}
name=${2:?name the model: qwen15 or qwen05}
shift 2
out=${OUT:?set OUT to the folder whose files come back}
heads=${HEADS:-/root/ship/data/heads}
keep=${KEEP:-/root}
mkdir -p "$keep"  # (a KEEP not made yet lost the fifty-first round's 16-prompt sweep log to tee -a)
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/ptx_cache.sh" use  # MLX's kernels compiled in an earlier call or session, where kept
case $name in
  qwen15) model=/root/ship/qwen15/qwen2.5-coder-1.5b-q4-bfloat16 ;;
  qwen05) model=/root/ship/qwen05/qwen2.5-coder-0.5b-q4-bfloat16 ;;
  *) echo "unknown model $name (qwen15, qwen05)" >&2; exit 2 ;;
esac
case $step in
  bench)
    timeout 420 python3 benchmarks/rows_kernel.py --model "$model" --head "$heads/$name" --rows "" --widths "" \
      --caps 3,7 --tree-pipe "${TREES:-7@7,15@7,16@7,15@5,8@7+lk}" --prompts "${PROMPTS:-8}" --max-new-tokens 128 \
      --copies worth_routing:mma --mlx-greedy-only --json "$out/${name}_trees.json" 2>&1 | tee "$out/${name}_trees.log" ;;
  cuts)
    timeout 540 python3 benchmarks/launch_cuts.py --model "$model" --head "$heads/$name" --caps 7 --tree-nodes "${NODES:-15}" \
      --prompts "${PROMPTS:-3}" --copies "${COPIES:-base+split-head,attn+write+move+split-head,attn+write+move,attn+write+move+head4}" --json "$out/${name}_cuts.json" 2>&1 | tee "$out/${name}_cuts.log" ;;
  census)
    timeout 400 python3 benchmarks/kernel_census.py --model "$model" --head "$heads/$name" --caps 7 \
      --tree-nodes "0,${NODES:-15}" --cuts attn,write,move --head-bits "${HEAD_BITS:-4}" 2>&1 | tee "$out/${name}_census.log" ;;
  sweep)
    left=$((580 - SECONDS))
    timeout "$left" python3 -m dspark_lab sweep -m "$model" -d "$heads/$name" \
      --modes dspark-pipe,dspark-tree-pipe --compile-draft --caps "${CAPS:-5,7}" --tree-nodes "${NODES:-15}" \
      --precisions rows-kernel --prompt-limit 8 --trials 2 -n 128 --db "$keep/sweep_trees_$name.duckdb" \
      --json "$out/sweep_trees_$name.json" "$@" 2>&1 | tee -a "$keep/sweep_trees_$name.log"
    cp "$keep/sweep_trees_$name.log" "$out/" ;;
  *) echo "unknown step $step (bench NAME, cuts NAME, census NAME, sweep NAME)" >&2; exit 2 ;;
esac
