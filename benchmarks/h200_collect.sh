#!/usr/bin/env bash
# Copy what a device run of h200_corpus_heads.sh has so far into $OUT, so it comes back with the call.
#   bash benchmarks/h200_collect.sh NAME      (on the device, any call while the run goes on)
# Call it in every polling call: a lent machine is given back after about 30 s without a call,
# and everything on it is lost then (in one session a 17-minute run went that way, at step 20,831).
# distill leaves a loadable head in /tmp/NAME at each checkpoint (CKPT steps): config.json and the
# bfloat16 model.safetensors (15 MB for the SmolLM2 head).
# A call returns at most 8 files of 16 MiB each, 64 MiB in all, so: config.json, the weights
# (whole, or in 15 MB parts, see below),
# and one results.tar.gz with the card, the evaluation and timing JSON (precision.json: GRID; sweep.json: SWEEP; held.json: HELD), every log, the requests the
# target wrote itself (SELF_INSTRUCT), and the data's
# generated rows made on the device (the target's own continuations: made on the GPU's clock, lost
# with the machine otherwise; the shipped rows and the read corpus rows are left out, this side has them).
# A head over 16 MB (the 2-layer Qwen 0.5B head is 103 MB: 7 parts) comes back in 15 MB parts, as
# many a call as fit beside the results archive (3 with the generated rows in it, 4 without), and
# each call brings the parts of one frozen version (the snapshot in /tmp/NAME/.collect, below) that
# no earlier call brought, so keep polling until it says "all N parts returned": then a whole
# checkpoint is on this side, and the next poll starts on the newest one. Poll this way during
# training too: in the twelfth round the machine was given back while the final head was still on
# it, and the polls had brought only logs. model.safetensors.parts (sha256, part count, size) comes
# back every call: join the parts here with `python benchmarks/join_parts.py DEST DIR...` (the calls'
# files_at folders), which joins the newest version whose parts are all there and checks its sha256.
# PARTS="03 04" bash benchmarks/h200_collect.sh NAME returns those parts instead.
# WEIGHTS=0 returns no weights at all, only config, card, logs, results and rows: a head too large
# for git (the Qwen ones) is lost with this machine's session either way once evaluated and timed
# here, and its parts cost calls, and hashing and splitting 240 MB beside a timing run.
# HEAD=q4 returns the head h200_corpus_heads.sh stored quantized (QUANT=4) in /tmp/NAME/q4, small
# enough to commit: its config and weights, and its card in the archive as q4/README.md; the float
# head stays there (the session's last evaluation reads it).
# WAIT=SECONDS first waits up to that long, and stops waiting as soon as the run reaches its next
# stage (distill ends: .distill_done; the whole run ends: .run_done, both written by
# h200_corpus_heads.sh after this call began). So each poll is one call that spends its time
# waiting on the device, not a sleep plus a collect, and the run's end comes back at once:
#   source /root/ship/mlx/activate && WAIT=560 HEAD=q4 bash benchmarks/h200_collect.sh NAME
# A machine is given back 30 s after a call ends: make the next poll the moment one returns
# (the eighteenth round lost its machine to work done on this side between two polls).
# UNTIL=end waits past distill's end for the whole run's (.run_done: the head stored and evaluated),
# so a run planned to end inside a poll comes back whole in that poll, with no gap after distill's
# end in which the machine can go (the twenty-eighth round lost its run in such a gap).
set -u
run=/tmp/$1
out=${OUT:?run this on the device, where OUT is set}
case ${WAIT:-0} in ''|*[!0-9]*) echo "WAIT must be a whole number of seconds, got '${WAIT:-}'"; exit 2 ;; esac
case ${UNTIL:-stage} in stage|end) ;; *) echo "UNTIL must be 'stage' (the default: distill's end or the run's) or 'end' (the run's alone), got '${UNTIL}'"; exit 2 ;; esac
# No run directory: this is a fresh machine. The one the run started on was given back (in the
# twenty-third round between two polls), and the run went with it. Say so at once: a poll that
# waited WAIT seconds for marks that can never come spent 540 s of that session's device time.
if [ ! -d "$run" ]; then
  echo "no run $1 on this machine ($run does not exist): a fresh machine, the run was lost with the one given back;"
  echo "nothing to wait for or collect: ship MLX, the data and the model again and start the run anew"
  exit 3
fi
# The run's process (h200_corpus_heads.sh writes its pid to .pid): once it is gone no mark can come,
# so the wait ends there, saying whether the run had finished (.run_done) or ended early (a crash,
# or a stop by hand). Without a .pid (a run started before it was written) the wait is as before.
run_alive() { local pid; pid=$(cat "$run/.pid" 2>/dev/null) || return 0; kill -0 "$pid" 2>/dev/null; }
if [ "${WAIT:-0}" -gt 0 ]; then
  began=$(mktemp); waited=0; why=
  stage=$run/.distill_done; [ "${UNTIL:-stage}" = end ] && stage=$run/.run_done
  until [ "$stage" -nt "$began" ] || [ "$run/.run_done" -nt "$began" ] || [ "$waited" -ge "$WAIT" ]; do
    if ! run_alive; then  # a run that ends well writes .run_done first
      if [ "$run/.run_done" -nt "$began" ]; then break
      elif [ -f "$run/.run_done" ]; then why=": the run had finished before this call"
      else why=": the run's process ($(cat "$run/.pid")) has ended without finishing; see its logs"; fi
      break
    fi
    sleep 1; waited=$((waited + 1))
  done
  if [ -z "$why" ]; then
    if [ "$run/.run_done" -nt "$began" ]; then why=": the run has ended"
    elif [ "$waited" -lt "$WAIT" ]; then why=": the run reached its next stage"
    # The wait ran out with the run still at work: say so, and what it is writing, for the
    # thirty-third round let its machine go with the run's held-out measure unfinished.
    elif [ -f "$run/.pid" ]; then why=": the run is still going (its newest file: $(cd "$run" && ls -t | head -1)); poll again at once"
    fi
  fi
  rm -f "$began"
  echo "waited ${waited} s of ${WAIT}$why"
fi
src=$run${HEAD:+/$HEAD}  # the head directory whose config and weights come back
# HEAD=q4 (or q8, or q3 with QGROUP=128 as the run's) while distill runs: the newest checkpoint is stored at those bits here first
# (dspark-lab quantize-head, about 10 s; so poll after `source /root/ship/mlx/activate`), and every
# poll brings back the head as far as it has trained. A machine given back between two polls
# (the seventeenth round lost a 19-minute run that way) then loses only the steps since the last
# poll. Written beside and moved into place; once distill has ended, h200_corpus_heads.sh stores
# the final head itself.
case ${HEAD:-} in
  q3|q4|q8)
    if [ -f "$run/model.safetensors" ] && [ ! -f "$run/.distill_done" ] && [ "$run/model.safetensors" -nt "$src/model.safetensors" ]; then
      rm -rf "$src.poll"
      if python3 -m dspark_lab quantize-head "$run" --out "$src.poll" --bits "${HEAD#q}" --group-size "${QGROUP:-64}" > "$run/quantize_poll.log" 2>&1; then
        rm -rf "$src" && mv "$src.poll" "$src" && echo "stored the newest checkpoint at ${HEAD#q} bits: $(tail -1 "$run/quantize_poll.log")"
      else
        echo "quantize-head failed on the newest checkpoint: $(tail -1 "$run/quantize_poll.log")"
      fi
    fi ;;
esac
[ -f "$src/config.json" ] && cp "$src/config.json" "$out/"
snap=$run/.collect; mkdir -p "$snap"  # the frozen weights (below) and what this script remembers between calls
not_returned() { for p in $(cat "$snap/all" 2>/dev/null); do grep -qx "$p" "$snap/returned" || echo "$p"; done | tr '\n' ' '; }
weights=$src/model.safetensors
[ "${WEIGHTS:-1}" = 0 ] && weights=$run/.weights-not-asked-for  # never a file: every weights step below is skipped
size=$( [ -f "$weights" ] && stat -c %s "$weights" || echo 0)
sum=$( [ "$size" -gt 16000000 ] && sha256sum "$weights" | cut -d' ' -f1)  # only weights that travel in parts

# The results archive goes first, so the weights get what room it leaves. The generated rows (12 MB
# compressed by the end of a Qwen round) are left out of it while weight parts wait to be sent and
# the same rows already came back in an earlier call, except every fourth call (in case that one's
# files did not come back): after the generation they no longer change, and the room holds a
# fourth part instead (in the fourteenth round the final head took three polls, and the timing
# that followed was cut off by the session's end).
# Only the rows written after the shipped ones (h200_corpus_heads.sh counts those in .shipped_rows):
# the shipped ones are on this side already.
shipped=$(cat "$run/.shipped_rows" 2>/dev/null || echo 0)
rm -f "$run/generated.jsonl"  # and none at all when there are no such rows (grep finds nothing)
[ -f "$run/data.jsonl" ] && { tail -n +$((shipped + 1)) "$run/data.jsonl" | grep -v '"generation": "corpus"' > "$run/generated.jsonl" \
  || rm -f "$run/generated.jsonl"; }
rows_sum=$( [ -f "$run/generated.jsonl" ] && sha256sum "$run/generated.jsonl" | cut -d' ' -f1)
# Parts wait when the snapshot has some not yet returned, or the weights changed (a new version
# will be frozen below).
pending=$( [ -n "$sum" ] && { [ "$sum" != "$(cat "$snap/sha256" 2>/dev/null)" ] || [ -n "$(not_returned)" ]; } && echo 1)
calls=$(( $(cat "$snap/calls" 2>/dev/null || echo 0) + 1 )); echo "$calls" > "$snap/calls"
skip_rows=""
[ $((calls % 4)) -ne 0 ] && [ -n "$pending" ] && [ -n "$rows_sum" ] && [ "$rows_sum" = "$(cat "$snap/rows_sent" 2>/dev/null)" ] && skip_rows=1
files=$(cd "$run" && ls generated.jsonl README.md eval.json pipeline.json overlap.json train_log.jsonl distill.log eval.log timing.log \
  self_instruct.log self_*.jsonl.gz quantize.log eval_float.json eval_float.log held.json held.log held_anchors.jsonl.gz precision.json precision.log sweep.json sweep.log ${HEAD:+$HEAD/README.md} 2>/dev/null | { if [ -n "$skip_rows" ]; then grep -vx generated.jsonl; else cat; fi })
if [ -n "$files" ]; then
  tar czf "$out/results.tar.gz" -C "$run" $files
  [ -z "$skip_rows" ] && [ -n "$rows_sum" ] && echo "$rows_sum" > "$snap/rows_sent"
  [ -n "$skip_rows" ] && echo "results: the generated rows left out (unchanged since an earlier call brought them)"
fi
if [ -f "$weights" ]; then
  if [ "$size" -le 16000000 ]; then
    cp "$weights" "$out/"
  else
    # The parts come from a frozen copy of one version (the snapshot), kept until every part of it
    # has come back: a checkpoint saved every minute or two would otherwise change the weights
    # between two polls, and no version would ever come back whole. A new snapshot is taken once
    # the last one is home and the weights have changed, and at once when the run's distill has
    # ended ($run/.distill_done, written by h200_corpus_heads.sh): the final head goes first.
    have=$(cat "$snap/sha256" 2>/dev/null)
    if [ "$sum" != "$have" ] && { [ -z "$have" ] || [ -z "$(not_returned)" ] || [ -f "$run/.distill_done" ]; }; then
      rm -f "$snap"/model.safetensors.part*
      cp "$weights" "$snap/whole"  # a checkpoint saved meanwhile replaces the file, not these bytes
      sum=$(sha256sum "$snap/whole" | cut -d' ' -f1); size=$(stat -c %s "$snap/whole")
      split -b 15000000 -d -a 2 "$snap/whole" "$snap/model.safetensors.part" && rm "$snap/whole"
      (cd "$snap" && ls model.safetensors.part* | sed 's/.*part//' | tr '\n' ' ') > "$snap/all"
      printf 'sha256 %s\nparts %s\nsize %s\n' "$sum" "$(wc -w < "$snap/all")" "$size" > "$snap/manifest"
      step=$(sed -n 's/.*"step": *\([0-9]*\).*/\1/p' "$run/checkpoint/state.json" 2>/dev/null)
      echo "${step:-?}" > "$snap/step"; : > "$snap/returned"; echo "$sum" > "$snap/sha256"
    fi
    cp "$snap/manifest" "$out/model.safetensors.parts"
    sum=$(cat "$snap/sha256"); count=$(wc -w < "$snap/all"); size=$(sed -n 's/^size //p' "$snap/manifest")
    if [ -n "${PARTS:-}" ]; then
      send=$PARTS
    else
      # The parts of the snapshot not returned yet, as many as fit beside the results archive in
      # a call's 64 MiB (1 MiB kept spare), and at most 5: a call returns 8 files, and config,
      # manifest and archive are three.
      send=$(not_returned)
      used=$(stat -c %s "$out/results.tar.gz" 2>/dev/null || echo 0)
      fit=$(( (64 * 1048576 - 1048576 - used) / 15000000 )); [ "$fit" -gt 5 ] && fit=5; [ "$fit" -lt 1 ] && fit=1
      send=$(echo $send | cut -d' ' -f1-$fit)
    fi
    for p in $send; do cp "$snap/model.safetensors.part$p" "$out/" && echo "$p" >> "$snap/returned"; done
    left=$(not_returned)
    what="version ${sum:0:12}, checkpoint step $(cat "$snap/step")"
    if [ -z "$left" ]; then
      echo "weights: all $count parts returned ($what); this call: ${send:-none}"
    else
      echo "weights: $count parts ($what); this call: ${send:-none}; STILL TO FETCH: $left(poll again)"
    fi
  fi
fi
[ -f "$run/checkpoint/state.json" ] && echo "checkpoint: $(cat "$run/checkpoint/state.json")"
ls -la "$out"
