#!/usr/bin/env bash
# Copy what a device run of h200_corpus_heads.sh has so far into $OUT, so it comes back with the call.
#   bash benchmarks/h200_collect.sh NAME      (on the device, any call while the run goes on)
# Call it in every polling call: a lent machine is given back after about 30 s without a call,
# and everything on it is lost then (in one session a 17-minute run went that way, at step 20,831).
# distill leaves a loadable head in /tmp/NAME at each checkpoint (CKPT steps): config.json and the
# bfloat16 model.safetensors (15 MB for the SmolLM2 head).
# A call returns at most 8 files of 16 MiB each, 64 MiB in all, so: config.json, the weights
# (whole, or in 15 MB parts, see below),
# and one results.tar.gz with the card, the evaluation and timing JSON, every log, the requests the
# target wrote itself (SELF_INSTRUCT), and the data's
# generated rows (the target's own continuations: made on the GPU's clock, lost with the machine
# otherwise; the read corpus rows are left out, they are rebuilt on any machine).
# A head over 45 MB (the 2-layer Qwen 0.5B head is 103 MB: 7 parts) comes back 3 parts a call, and
# each call brings the parts of the current weights that no earlier call brought (remembered in
# /tmp/NAME/.collect_returned, forgotten when the weights change), so keep polling until it says
# "all N parts returned". model.safetensors.parts (sha256, part count, size) comes back every call:
# join the parts here with `python benchmarks/join_parts.py DEST DIR...` (the calls' files_at
# folders), which takes the parts of one version and checks the whole file's sha256.
# PARTS="03 04" bash benchmarks/h200_collect.sh NAME returns those parts instead.
set -u
run=/tmp/$1
out=${OUT:?run this on the device, where OUT is set}
[ -f "$run/config.json" ] && cp "$run/config.json" "$out/"
weights=$run/model.safetensors
if [ -f "$weights" ]; then
  size=$(stat -c %s "$weights")
  if [ "$size" -le 16000000 ]; then
    cp "$weights" "$out/"
  else
    parts=$(mktemp -d)
    cp "$weights" "$parts/whole"  # one version: a checkpoint saved meanwhile replaces the file, not these bytes
    sum=$(sha256sum "$parts/whole" | cut -d' ' -f1)
    split -b 15000000 -d -a 2 "$parts/whole" "$parts/model.safetensors.part" && rm "$parts/whole"
    all=$(cd "$parts" && ls | sed 's/.*part//' | tr '\n' ' ')
    count=$(echo $all | wc -w)
    printf 'sha256 %s\nparts %s\nsize %s\n' "$sum" "$count" "$size" > "$out/model.safetensors.parts"
    state=$run/.collect_returned
    [ -f "$state" ] && [ "$(head -1 "$state")" = "$sum" ] || echo "$sum" > "$state"
    not_returned() { for p in $all; do grep -qx "$p" "$state" || echo "$p"; done | tr '\n' ' '; }
    if [ -n "${PARTS:-}" ]; then
      send=$PARTS
    else
      # Parts of this version not returned yet; all of them if the weights fit one call.
      send=$(not_returned)
      [ "$size" -gt 45000000 ] && send=$(echo $send | cut -d' ' -f1-3)
    fi
    for p in $send; do cp "$parts/model.safetensors.part$p" "$out/" && echo "$p" >> "$state"; done
    left=$(not_returned)
    if [ -z "$left" ]; then
      echo "weights: all $count parts returned (sha256 $sum); this call: ${send:-none}"
    else
      echo "weights: $count parts (sha256 $sum); this call: ${send:-none}; STILL TO FETCH: $left(poll again)"
    fi
    rm -rf "$parts"
  fi
fi
[ -f "$run/data.jsonl" ] && grep -v '"generation": "corpus"' "$run/data.jsonl" > "$run/generated.jsonl"
files=$(cd "$run" && ls generated.jsonl README.md eval.json pipeline.json overlap.json train_log.jsonl distill.log eval.log timing.log \
  self_instruct.log self_*.jsonl.gz 2>/dev/null)
[ -n "$files" ] && tar czf "$out/results.tar.gz" -C "$run" $files
[ -f "$run/checkpoint/state.json" ] && echo "checkpoint: $(cat "$run/checkpoint/state.json")"
ls -la "$out"
