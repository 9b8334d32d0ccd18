#!/usr/bin/env bash
# Tree drafts against the chain on the H200, side by side (issues #9, #10; docs/performance.md,
# thirty-fourth round). Run from the checkout on the device after `source /root/ship/mlx/activate`:
#   OUT=$OUT bash benchmarks/h200_trees.sh qwen15        (then qwen05 in a second call: each fits 600 s)
# Per model (/root/ship/NAME/..., as prepare_device_session.sh ships it) with its committed head
# (HEADS/NAME, default /root/ship/data/heads/NAME: the slim checkout leaves fixtures/ out):
#  0. tree_check.py: the tree forward's check at the stored precision and in float32, beside the
#     chain's own rounding on this machine -> OUT/NAME/tree_check.log;
#  1. lossless_check.py: greedy beside the head's chain, the pipelined chain with its compiled draft,
#     and its trees of TREES nodes (default 8,16,32; the tree forward compiled) and of TREE_PLAIN nodes
#     (default 16; the tree forward op by op) and, through the pipelined tree loop, of TREE_PIPE nodes
#     (default 16,32), at most cap 7 deep, on the first EVAL_LIMIT (default 8) built-in prompts of each set, 128 tokens, after a warm-up, in one
#     process: token identity, mean accept length, and each arm's decode rate over greedy's
#     -> OUT/NAME/eval_trees.{json,log};
#  2. SWEEP=1 (default): the lab's sweep, baseline beside dspark, dspark-pipe (compiled draft),
#     dspark-tree and dspark-tree-pipe (TREE_SWEEP nodes, default 16; the pipelined trees with the compiled
#     draft) at CAPS (default 7), SWEEP_PROMPTS (default 4)
#     prompts a set, 2 trials -> OUT/NAME/sweep.json, for `dspark-lab ingest` here.
#  PARTS=1 adds, before each evaluation, tree_round_parts.py (a round's parts timed alone, trees of
#  PARTS_NODES nodes, default 7,16,32) -> OUT/NAME/parts.{json,log}; PRECISIONS=stored,dequantized
#  repeats the parts and the evaluation on the target's bf16 copy (--dequantize: the thirty-seventh
#  round found the 4-bit verify paying for every row, which a bf16 matmul should not)
#  -> OUT/NAME/{parts,eval_trees}_dequantized.*; PRECISIONS=kernel repeats them on the stored weights
#  routed through the rows kernel where the engine routes (engine/rows_kernel.py: the products MLX
#  computes re-reading the weights per row, a draft's vocabulary projection among them)
#  -> OUT/NAME/{parts,eval_trees}_kernel.*; ROWS_CHECK=1 first runs
#  benchmarks/rows_kernel.py (the kernel against MLX's quantized matmul, layer by layer and whole
#  forwards) -> OUT/NAME/rows_kernel.{json,log}; the sweep runs on the stored weights.
# Heads unquantized (--drafter-bits 16), as every device evaluation of them. An empty TREES, TREE_PLAIN or
# TREE_PIPE leaves those arms out.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=${OUT:?set OUT, e.g. to the device call \$OUT}
[ $# -gt 0 ] || { echo "usage: OUT=DIR bash benchmarks/h200_trees.sh qwen15|qwen05 ..."; exit 2; }
for name in "$@"; do
  case $name in
    qwen05) model=/root/ship/qwen05/qwen2.5-coder-0.5b-q4-bfloat16 ;;
    qwen15) model=/root/ship/qwen15/qwen2.5-coder-1.5b-q4-bfloat16 ;;
    *) echo "unknown model $name (qwen05, qwen15)"; exit 2 ;;
  esac
  head=${HEADS:-/root/ship/data/heads}/$name
  [ -f "$head/config.json" ] || { echo "no head at $head (prepare_device_session.sh trees ships them as data/heads/NAME)"; exit 2; }
  run=$out/$name
  mkdir -p "$run"
  python3 benchmarks/tree_check.py "$model" 2>&1 | tee "$run/tree_check.log"
  if [ "${ROWS_CHECK:-0}" = 1 ]; then
    python3 benchmarks/rows_kernel.py --model "$model" --json "$run/rows_kernel.json" 2>&1 | tee "$run/rows_kernel.log"
  fi
  for precision in $(echo "${PRECISIONS:-stored}" | tr , ' '); do
    case $precision in
      stored) flag= suffix= ;;
      dequantized) flag=--dequantize suffix=_dequantized ;;
      kernel) flag=--rows-kernel suffix=_kernel ;;
      *) echo "unknown precision $precision (stored, dequantized, kernel)"; exit 2 ;;
    esac
    if [ "${PARTS:-0}" = 1 ]; then
      python3 benchmarks/tree_round_parts.py --model "$model" --head "$head" $flag --nodes "${PARTS_NODES:-7,16,32}" \
        --json "$run/parts$suffix.json" 2>&1 | tee "$run/parts$suffix.log"
    fi
    python3 benchmarks/lossless_check.py --model "$model" --head "$head" $flag --drafter-bits 16 --prompts code,math,chat --limit "${EVAL_LIMIT:-8}" \
      --max-new-tokens 128 --cap 7 --no-lookup-arm --tree-nodes "${TREES-8,16,32}" --tree-plain "${TREE_PLAIN-16}" --tree-pipe "${TREE_PIPE-16,32}" --pipe-arm \
      --out "$run/eval_trees$suffix.json" > "$run/eval_trees$suffix.log" 2>&1
    echo "$name $precision eval rc=$? at ${SECONDS}s"; grep "mean accept length\|speedup\|identical;" "$run/eval_trees$suffix.log"
  done
  if [ "${SWEEP:-1}" = 1 ]; then
    python3 -m dspark_lab sweep -m "$model" -d "$head" --drafter-bits 16 --modes dspark,dspark-pipe,dspark-tree,dspark-tree-pipe --compile-draft \
      --tree-nodes "${TREE_SWEEP:-16}" --caps "${CAPS:-7}" --prompts code,math,chat --prompt-limit "${SWEEP_PROMPTS:-4}" --trials 2 \
      -n 128 --db "$run/sweep.duckdb" --json "$run/sweep.json" > "$run/sweep.log" 2>&1
    echo "$name sweep rc=$? at ${SECONDS}s"; tail -3 "$run/sweep.log"
  fi
done
