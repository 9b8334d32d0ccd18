#!/usr/bin/env bash
# Train the reference heads on the H200 (issue #9), both at once: each run is launch-bound, so
# two processes share the GPU at little cost to either. Run from the checkout on the device
# after `source /root/ship/mlx/activate`; models under /root/ship (see shared/device/README.md).
#   SMOL=DIR QWEN=DIR PROMPTS=humaneval:HumanEval.jsonl.gz,sharegpt.jsonl,math,chat OUT=DIR bash benchmarks/h200_train_refs.sh
# Optional SMOL_DATA: a data.jsonl.gz from an earlier run to start from (topped up to --tokens).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/smolhead /tmp/qwenhead
[ -n "${SMOL_DATA:-}" ] && gunzip -c "$SMOL_DATA" > /tmp/smolhead/data.jsonl
timeout 540 python3 -m dspark_lab distill -m "$SMOL" --out /tmp/smolhead --block 5 --layers 1 --markov-rank 32 \
  --prompts "$PROMPTS" --tokens 140000 --max-new-tokens 192 --batch 96 --steps 7000 --anchors 256 --lr 1e-3 \
  --minutes 5 --eval-every 100000 > "$OUT/smol_distill.log" 2>&1 &
timeout 540 python3 -m dspark_lab distill -m "$QWEN" --out /tmp/qwenhead --block 8 --layers 2 --markov-rank 64 \
  --prompts "$PROMPTS" --tokens 70000 --max-new-tokens 256 --batch 96 --steps 5000 --anchors 192 --lr 1e-3 \
  --minutes 4 --eval-every 100000 > "$OUT/qwen_distill.log" 2>&1 &
wait
for h in smol qwen; do grep -v "distill loss" "$OUT/${h}_distill.log" | tail -8; done
# What comes back: the SmolLM2 head (committed as a fixture) and one archive of the rest.
cp /tmp/smolhead/model.safetensors "$OUT/smol_model.safetensors"
(cd /tmp && tar czf "$OUT/runs.tgz" --exclude='*.safetensors' smolhead qwenhead)
rm -f "$OUT"/*_distill.log.tmp
ls -la /tmp/smolhead /tmp/qwenhead
