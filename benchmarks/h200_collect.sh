#!/usr/bin/env bash
# Copy what a device run of h200_corpus_heads.sh has so far into $OUT, so it comes back with the call.
#   bash benchmarks/h200_collect.sh NAME      (on the device, any call while the run goes on)
# Call it in every polling call: a lent machine is given back after about 30 s without a call,
# and everything on it is lost then (in one session a 17-minute run went that way, at step 20,831).
# distill leaves a loadable head in /tmp/NAME at each checkpoint (CKPT steps): config.json and the
# bfloat16 model.safetensors (15 MB for the SmolLM2 head; the device returns files up to 16 MiB).
set -u
run=/tmp/$1
out=${OUT:?run this on the device, where OUT is set}
for f in config.json model.safetensors README.md eval.json pipeline.json overlap.json; do
  [ -f "$run/$f" ] && cp "$run/$f" "$out/"
done
for f in train_log.jsonl distill.log eval.log timing.log; do
  [ -f "$run/$f" ] && gzip -c "$run/$f" > "$out/$f.gz"
done
[ -f "$run/checkpoint/state.json" ] && echo "checkpoint: $(cat "$run/checkpoint/state.json")"
ls -la "$out"
