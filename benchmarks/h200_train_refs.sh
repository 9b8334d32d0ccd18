#!/usr/bin/env bash
# Train the reference heads on the H200 (issue #9), all at once: each run is launch-bound, so
# several processes share the GPU at little cost to each. Run from the checkout on the device
# after `source /root/ship/mlx/activate`; models under /root/ship (see shared/device/README.md).
#   SMOL=DIR QWEN=DIR [QWEN15=DIR] PROMPTS=humaneval:HumanEval.jsonl.gz,sharegpt.jsonl OUT=DIR \
#     [SMOL_DATA=data.jsonl.gz] [MINUTES=4] [DATA_MINUTES=2] bash benchmarks/h200_train_refs.sh
# Each head: its target's greedy continuations of PROMPTS (generated for DATA_MINUTES, or
# topped up from SMOL_DATA), then MINUTES of training with 8 (4 for the 1.5B) sequences per step
# and all of a sequence's blocks in one attention call. The built-in code, math and chat sets stay
# out of the data: they are the held-out evaluation that follows each run (benchmarks/lossless_check.py:
# the head drafting alone, greedy, 8 prompts per set, token identity and mean accept length).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=${MINUTES:-4}
DM=${DATA_MINUTES:-2}
train() {  # name model block layers markov-rank seqs anchors eval-cap
  local name=$1 model=$2 block=$3 layers=$4 rank=$5 seqs=$6 anchors=$7 cap=$8
  mkdir -p "/tmp/$name"
  timeout 570 python3 -m dspark_lab distill -m "$model" --out "/tmp/$name" --block "$block" --layers "$layers" \
    --markov-rank "$rank" --prompts "$PROMPTS" --tokens 3000000 --max-new-tokens 256 --batch 256 --data-minutes "$DM" \
    --steps 200000 --seqs "$seqs" --anchors "$anchors" --lr 1e-3 --warmup 200 --minutes "$M" --eval-every 1000000 \
    --checkpoint-every 1000000 > "$OUT/${name}_distill.log" 2>&1
  echo "$name distill rc=$? at ${SECONDS}s"
  timeout $((585 - SECONDS)) python3 benchmarks/lossless_check.py --model "$model" --head "/tmp/$name" --drafter-bits 16 \
    --prompts code,math,chat --limit 8 --max-new-tokens 128 --cap "$cap" --no-lookup-arm --out "$OUT/${name}_eval.json" \
    > "$OUT/${name}_eval.log" 2>&1
  echo "$name eval rc=$? at ${SECONDS}s"; grep "mean accept\|identical" "$OUT/${name}_eval.log"
}
# An earlier run's data, without the built-in sets (held out here).
[ -n "${SMOL_DATA:-}" ] && mkdir -p /tmp/smolhead && gunzip -c "$SMOL_DATA" | grep -v '"set": "\(math\|chat\|code\)"' > /tmp/smolhead/data.jsonl
train smolhead "$SMOL" 5 1 32 8 1024 4 &
train qwenhead "$QWEN" 8 2 64 8 512 7 &
[ -n "${QWEN15:-}" ] && train qwen15head "$QWEN15" 8 2 64 4 256 7 &
wait
for h in smolhead qwenhead qwen15head; do
  [ -f "$OUT/${h}_distill.log" ] && grep -v "distill loss" "$OUT/${h}_distill.log" | grep -v Warning | tail -6
done
# What comes back: the SmolLM2 head (the CI fixture), and one archive of logs and data.
cp /tmp/smolhead/model.safetensors "$OUT/smol_model.safetensors" 2>/dev/null
(cd /tmp && tar czf "$OUT/runs.tgz" --exclude='*.safetensors' --exclude=checkpoint smolhead qwenhead qwen15head 2>/dev/null)
ls -la "$OUT"
