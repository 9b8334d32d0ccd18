#!/usr/bin/env bash
# Copy what a device run of h200_corpus_heads.sh has so far into $OUT, so it comes back with the call.
#   bash benchmarks/h200_collect.sh NAME      (on the device, any call while the run goes on)
# Call it in every polling call: a lent machine is given back after about 30 s without a call,
# and everything on it is lost then (in one session a 17-minute run went that way, at step 20,831).
# distill leaves a loadable head in /tmp/NAME at each checkpoint (CKPT steps): config.json and the
# bfloat16 model.safetensors (15 MB for the SmolLM2 head).
# A call returns at most 8 files of 16 MiB each, 64 MiB in all, so: config.json, the weights
# (whole, or in 15 MB parts joined here with `cat model.safetensors.part* > model.safetensors`),
# and one results.tar.gz with the card, the evaluation and timing JSON, every log, and the data's
# generated rows (the target's own continuations: made on the GPU's clock, lost with the machine
# otherwise; the read corpus rows are left out, they are rebuilt on any machine).
# A head over 45 MB (a 2-layer Qwen head is about 70 MB) comes back 3 parts a call:
# PARTS="03 04" bash benchmarks/h200_collect.sh NAME for the rest.
set -u
run=/tmp/$1
out=${OUT:?run this on the device, where OUT is set}
[ -f "$run/config.json" ] && cp "$run/config.json" "$out/"
weights=$run/model.safetensors
if [ -f "$weights" ]; then
  if [ "$(stat -c %s "$weights")" -le 16000000 ]; then
    cp "$weights" "$out/"
  else
    parts=$(mktemp -d)
    split -b 15000000 -d -a 2 "$weights" "$parts/model.safetensors.part"
    all=$(cd "$parts" && ls | sed 's/.*part//' | tr '\n' ' ')
    if [ -z "${PARTS:-}" ] && [ "$(stat -c %s "$weights")" -gt 45000000 ]; then PARTS=$(echo $all | cut -d' ' -f1-3); fi
    for p in ${PARTS:-$all}; do cp "$parts/model.safetensors.part$p" "$out/"; done
    echo "weights in parts: $all; returned: ${PARTS:-$all}"
    rm -rf "$parts"
  fi
fi
[ -f "$run/data.jsonl" ] && grep -v '"generation": "corpus"' "$run/data.jsonl" > "$run/generated.jsonl"
files=$(cd "$run" && ls generated.jsonl README.md eval.json pipeline.json overlap.json train_log.jsonl distill.log eval.log timing.log 2>/dev/null)
[ -n "$files" ] && tar czf "$out/results.tar.gz" -C "$run" $files
[ -f "$run/checkpoint/state.json" ] && echo "checkpoint: $(cat "$run/checkpoint/state.json")"
ls -la "$out"
