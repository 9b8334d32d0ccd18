#!/usr/bin/env bash
# Train the reference heads on the H200 (issue #9), all at once: each run is launch-bound, so
# several processes share the GPU at little cost to each. Run from the checkout on the device
# after `source /root/ship/mlx/activate`; models under /root/ship (see shared/device/README.md).
#   SMOL=DIR QWEN=DIR [QWEN15=DIR] PROMPTS=humaneval:HumanEval.jsonl.gz,sharegpt.jsonl OUT=DIR \
#     [SMOL_DATA=data.jsonl.gz] [MINUTES=4] [DATA_MINUTES=2] [GPUS=1] [EVAL=1] \
#     [CORPUS=sharegpt:ShareGPT.json CORPUS_TOKENS=3000000] bash benchmarks/h200_train_refs.sh
# CORPUS: conversations each target reads (one forward per sequence) on top of what it generates;
# the runs below label every position with the target's own greedy prediction either way.
# GPUS=4 (a 4-GPU machine): each run gets a GPU of its own, and a fourth trains a second SmolLM2
# head with a larger batch and learning rate. EVAL=0 skips the evaluation (h200_campaign.sh does it).
# Each head: its target's greedy continuations of PROMPTS (generated for DATA_MINUTES, or
# topped up from SMOL_DATA), then MINUTES of training with 8 (4 for the 1.5B) sequences per step
# and all of a sequence's blocks in one attention call. The built-in code, math and chat sets stay
# out of the data: they are the held-out evaluation that follows each run (benchmarks/lossless_check.py:
# the head drafting alone, greedy, 8 prompts per set, token identity and mean accept length).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=${MINUTES:-4}
DM=${DATA_MINUTES:-2}
train() {  # gpu name model block layers markov-rank seqs anchors eval-cap [distill options]
  export CUDA_VISIBLE_DEVICES=$(( $1 % ${GPUS:-1} ))
  local name=$2 model=$3 block=$4 layers=$5 rank=$6 seqs=$7 anchors=$8 cap=$9
  shift 9
  mkdir -p "/tmp/$name"
  [ -n "${SMOL_DATA:-}" ] && [ "$model" = "$SMOL" ] && gunzip -c "$SMOL_DATA" | grep -v '"set": "\(math\|chat\|code\)"' > "/tmp/$name/data.jsonl"
  timeout 570 python3 -m dspark_lab distill -m "$model" --out "/tmp/$name" --block "$block" --layers "$layers" \
    --markov-rank "$rank" --prompts "$PROMPTS" --tokens 3000000 --max-new-tokens 256 --batch 256 --data-minutes "$DM" \
    --steps 200000 --seqs "$seqs" --anchors "$anchors" --lr 1e-3 --warmup 200 --minutes "$M" --eval-every 1000000 \
    --checkpoint-every 1000000 ${CORPUS:+--corpus "$CORPUS" --corpus-tokens "${CORPUS_TOKENS:-3000000}"} "$@" \
    > "$OUT/${name}_distill.log" 2>&1
  echo "$name distill rc=$? at ${SECONDS}s"
  [ "${EVAL:-1}" = 0 ] && return
  timeout $((585 - SECONDS)) python3 benchmarks/lossless_check.py --model "$model" --head "/tmp/$name" --drafter-bits 16 \
    --prompts code,math,chat --limit 8 --max-new-tokens 128 --cap "$cap" --no-lookup-arm --out "$OUT/${name}_eval.json" \
    > "$OUT/${name}_eval.log" 2>&1
  echo "$name eval rc=$? at ${SECONDS}s"; grep "mean accept\|identical" "$OUT/${name}_eval.log"
}
# SMOL_DATA: an earlier run's data, without the built-in sets (held out here), to start from.
train 0 smolhead "$SMOL" 5 1 32 8 1024 4 &
train 1 qwenhead "$QWEN" 8 2 64 8 512 7 &
[ -n "${QWEN15:-}" ] && train 2 qwen15head "$QWEN15" 8 2 64 4 256 7 &
[ "${GPUS:-1}" -ge 4 ] && train 3 smolhead2 "$SMOL" 5 1 32 16 2048 4 --lr 2e-3 &
wait
for h in smolhead smolhead2 qwenhead qwen15head; do
  [ -f "$OUT/${h}_distill.log" ] && grep -v "distill loss" "$OUT/${h}_distill.log" | grep -v Warning | tail -6
done
# What comes back: the SmolLM2 head (the CI fixture), and one archive of logs and data.
cp /tmp/smolhead/model.safetensors "$OUT/smol_model.safetensors" 2>/dev/null
cp /tmp/smolhead2/model.safetensors "$OUT/smol2_model.safetensors" 2>/dev/null
(cd /tmp && tar czf "$OUT/runs.tgz" --exclude='*.safetensors' --exclude=checkpoint smolhead smolhead2 qwenhead qwen15head 2>/dev/null)
ls -la "$OUT"
