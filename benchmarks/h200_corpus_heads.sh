#!/usr/bin/env bash
# Train one reference head from a corpus-heavy data file, then measure it, on one GPU (issue #9/#10).
# Run from the checkout on the device after `source /root/ship/mlx/activate`:
#   GPU=0 DATA=/root/prev/smol.jsonl.gz MINUTES=8 bash benchmarks/h200_corpus_heads.sh smol  > /tmp/smol.log 2>&1
# NAME: smol | qwen05 | qwen15 (models under /root/ship, see shared/device/README.md).
# DATA: the run's data.jsonl (gzipped), made beforehand on any machine with
#   dspark-lab distill -m MODEL --out DIR --prompts ... --tokens N --corpus sharegpt:ShareGPT.json --corpus-tokens M \
#     --max-len 1024 --data-only
# (or rebuilt from the committed rows of earlier rounds: benchmarks/gather_rows.py OUT --extra READ_ROWS),
# so the GPU's time goes to training: the target's greedy continuations of PROMPTS plus whole
# ShareGPT conversations it only reads, every position labelled with the target's own greedy
# prediction. The built-in code, math and chat sets are not in the data: they are the held-out
# evaluation that follows (benchmarks/lossless_check.py: the head alone, greedy, 8 prompts per set,
# token identity and mean accept length), and benchmarks/launch_overlap.py then times greedy against
# speculative decoding side by side at launch_every 0 and 4.
# Results land in /tmp/NAME/ (head, logs, eval JSON); `bash benchmarks/h200_collect.sh NAME` copies them into $OUT (call it in every polling call: a machine given back loses them). Start it with
# DETACH=1 (below) and it outlives the device call (while the machine stays warm), so a
# 30-minute session can train with MINUTES=20 in one run.
# Settings (environment): MINUTES, LR, ARCH (the distill architecture and batch options),
# INIT=DIR or RESUME=1, MIX (distill --mix: how often each prompt set's rows are drawn), CKPT (checkpoint every N steps: a crash keeps the last one), CACHE_GB
# (cap MLX's buffer cache, which comes on top of what a run holds: needed when two runs share one
# GPU; uncapped, one 1.5B run's cache took 138 of the H200's 141 GB and the second run died, and
# at 48 each both did; at 4 each two 1.5B runs held 82 GB together, under the 60 GB memory limit
# each also had, MEM_GB=60 (distill --memory-gb): twenty-seventh round), PROMPTS (only the held-out evaluation during training:
# --tokens 0 generates nothing), SELF_INSTRUCT / GEN_PROMPTS / GEN_MINUTES / GEN_BATCH (above the training step), TRAIN=0
# (stop after the generation: a session that only writes rows to commit), QUANT (the head kept,
# evaluated and timed is the one stored at QUANT bits: below), TIMING, GRID and SWEEP (below).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=${GPU:-0}
# MINUTES feeds shell arithmetic (the training's timeout): a fraction would fail there only after
# the generation had spent its minutes.
case ${MINUTES:-8} in ''|*[!0-9]*) echo "MINUTES must be a whole number of minutes, got '${MINUTES:-}'"; exit 2 ;; esac
name=$1
# A suffix names another run of the same model (qwen15-wide): its own /tmp/NAME, log and
# `h200_collect.sh NAME`, so two runs can share one GPU side by side (give each CACHE_GB=4 MEM_GB=60).
case $name in
  smol|smol-*)     model=/root/ship/smollm2/smollm2-135m; arch="--block 5 --layers 1 --markov-rank 32 --seqs 8 --anchors 1024"; cap=4 ;;
  qwen05|qwen05-*) model=/root/ship/qwen05/qwen2.5-coder-0.5b-q4-bfloat16; arch="--block 8 --layers 2 --markov-rank 64 --seqs 8 --anchors 512"; cap=7 ;;
  qwen15|qwen15-*) model=/root/ship/qwen15/qwen2.5-coder-1.5b-q4-bfloat16; arch="--block 8 --layers 2 --markov-rank 64 --seqs 4 --anchors 256"; cap=7 ;;
  *) echo "unknown head $name (smol, qwen05, qwen15, or one of them with a suffix: qwen15-wide)"; exit 2 ;;
esac
arch=${ARCH:-$arch}  # e.g. ARCH="--block 5 --layers 1 --markov-rank 32 --seqs 8 --anchors 2048"
# A second run on a GPU where another is still going needs both capped (CACHE_GB=4): uncapped, the
# first one's buffer cache takes the GPU's memory and this one dies at its start, minutes of a
# session later (twenty-seventh round). Refused here, in the calling shell, before anything starts.
if [ "${CACHE_GB:-0}" = 0 ]; then
  for pidfile in "${RUNS_ROOT:-/tmp}"/*/.pid; do
    other=$(dirname "$pidfile")
    [ -f "$pidfile" ] && [ "$other" != "${RUN_DIR:-/tmp/$name}" ] && [ ! -f "$other/.run_done" ] || continue
    if kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      echo "another run is going on this GPU ($other, pid $(cat "$pidfile")): two runs need CACHE_GB=4 MEM_GB=60 each (uncapped, one takes the GPU's memory as cache); start both with it, or wait for that one"
      exit 2
    fi
  done
fi
# DETACH=1: start this run detached from the calling shell (setsid nohup, output in LOG, default
# /tmp/NAME.out), print its first lines after SETTLE seconds (default 15) and return, so it
# outlives the device call. Start it this way, with no `&` of your own: in the twenty-third round
# `recv.sh && source .../activate && ... &` sent the whole list to the background, and the call's
# end killed it before the run began. MLX's environment must be sourced first, in the foreground.
if [ "${DETACH:-0}" = 1 ]; then
  python3 -c "import mlx.core" 2>/dev/null || { echo "no MLX here: source /root/ship/mlx/activate first (in the foreground, not behind an &)"; exit 2; }
  log=${LOG:-/tmp/$name.out}
  DETACH=0 setsid nohup bash "$0" "$@" > "$log" 2>&1 < /dev/null &
  sleep "${SETTLE:-15}"
  echo "$name started detached (pid $!), its output in $log:"; tail -n 5 "$log"
  exit 0
fi
run=${RUN_DIR:-/tmp/$name}  # where h200_collect.sh NAME looks; RUN_DIR only for the tests
mkdir -p "$run"; rm -rf "$run/.distill_done" "$run/.run_done" "$run/.collect"  # a previous run's marks for h200_collect.sh
echo $$ > "$run/.pid"  # h200_collect.sh stops waiting once this process is gone
# RESUME=1: continue the checkpoint already in /tmp/NAME (a new cosine over MINUTES).
# INIT=DIR: start from a trained head's weights (e.g. the committed fixture), fresh optimizer.
# .shipped_rows: how many rows came in DATA, so h200_collect.sh brings back only the rows made here
# (a run that generates nothing, as the Qwen 1.5B's on the 0.5B's rows, then brings none).
[ "${RESUME:-0}" = 1 ] || { gunzip -c "$DATA" > "$run/data.jsonl" && wc -l < "$run/data.jsonl" > "$run/.shipped_rows"; }
# GEN_PROMPTS=FILE (a prompt JSONL, or any --prompts spec) and GEN_MINUTES=M: first add the
# target's own greedy continuations of those prompts for M minutes (mlx-lm's batched generator,
# GEN_BATCH prompts at once) to the data file. They are the only rows whose every block slot is
# on the target's path (docs/performance.md, sixth round); the GPU makes them at thousands of
# tokens a second, this 2-core machine at under 30.
# SELF_INSTRUCT=N: before that, the target writes N requests of its own (benchmarks/self_instruct.py;
# SELF_KIND code, math or both as "code,math": N of each; SELF_SEED: a later round takes another
# seed; SELF_STYLE=detailed: code requests of several parts, self_instruct.py --style), put first in
# GEN_PROMPTS and brought back by h200_collect.sh with their log. 4,000 took
# 196 s in batches of 256 (eleventh round), 105 s in batches of 1,024 (twelfth); 6,000 took 141 s.
# GRID=8,16 (issue #10's precision grid): before anything else, while the GPU is idle, time INIT's
# head (stored at INIT_BITS, default 4) on the target as loaded and on its copies at those
# precisions (pipeline_speed.py --precisions: mlx_lm, greedy and ARMS at CAPS for each), into
# precision.{json,log}, which h200_collect.sh brings back. The head the session starts from is
# the one already committed, so the grid needs no training first.
if [ -n "${GRID:-}" ]; then
  [ -n "${INIT:-}" ] || { echo "GRID times INIT's head: set INIT=DIR (e.g. /root/ship/data/head)"; exit 2; }
  python3 benchmarks/pipeline_speed.py --model "$model" --head "$INIT" --drafter-bits "${INIT_BITS:-4}" --caps "${CAPS:-$cap}" \
    --limit 2 --max-new-tokens 128 --repeats 2 --no-compile --precisions "$GRID" ${ARMS:+--arms "$ARMS"} \
    --json "$run/precision.json" > "$run/precision.log" 2>&1
  echo "$name precision grid rc=$? at ${SECONDS}s"; grep -v "Warning\|INFO" "$run/precision.log" | tail -16
fi
if [ -n "${SELF_INSTRUCT:-}" ]; then
  : > "$run/self_instruct.log"; selfs=
  for kind in $(echo "${SELF_KIND:-code}" | tr ',' ' '); do
    self=$run/self_${kind}${SELF_STYLE:+_$SELF_STYLE}${SELF_SEED:+_s$SELF_SEED}.jsonl.gz
    python3 benchmarks/self_instruct.py --model "$model" --kind "$kind" --n "$SELF_INSTRUCT" --seed "${SELF_SEED:-0}" \
      --style "${SELF_STYLE:-brief}" --out "$self" >> "$run/self_instruct.log" 2>&1
    echo "$name self-instruct $kind rc=$? at ${SECONDS}s"; tail -1 "$run/self_instruct.log"
    [ -s "$self" ] && selfs=${selfs:+$selfs,}$self
  done
  [ -n "$selfs" ] && GEN_PROMPTS=$selfs${GEN_PROMPTS:+,$GEN_PROMPTS}
fi
if [ -n "${GEN_PROMPTS:-}" ]; then
  python3 -m dspark_lab distill -m "$model" --out "$run" $arch --prompts "$GEN_PROMPTS" --tokens 100000000 \
    --max-new-tokens 256 --batch "${GEN_BATCH:-256}" --data-minutes "${GEN_MINUTES:-3}" --max-len "${MAXLEN:-1024}" \
    --data-only >> "$run/distill.log" 2>&1
  echo "$name generation rc=$? at ${SECONDS}s"; grep "data:" "$run/distill.log" | tail -1
fi
# TRAIN=0: the rows are the result (weights do not outlive a session, committed rows do);
# h200_collect.sh brings back the generated ones.
[ "${TRAIN:-1}" = 0 ] && { touch "$run/.run_done"; echo "$name done (TRAIN=0: generation only)"; exit 0; }
# --tokens 0 and --corpus-tokens 1: the data file already holds its rows, so nothing is generated or read
# (a positive --tokens would continue PROMPTS for a data file without generated rows).
timeout $((60 * ${MINUTES:-8} + 240)) python3 -m dspark_lab distill -m "$model" --out "$run" $arch \
  --prompts "${PROMPTS:-code,math,chat}" \
  --tokens 0 --corpus "sharegpt:ShareGPT_V3_unfiltered_cleaned_split.json" --corpus-tokens 1 \
  --max-len "${MAXLEN:-1024}" --steps 200000 --lr "${LR:-1e-3}" --warmup 200 --minutes "${MINUTES:-8}" --eval-every 1000000 --checkpoint-every "${CKPT:-1000000}" \
  --cache-gb "${CACHE_GB:-0}" --memory-gb "${MEM_GB:-0}" $([ "${RESUME:-0}" = 1 ] && echo --resume) $([ -n "${INIT:-}" ] && echo --init "$INIT") \
  ${MIX:+--mix "$MIX"} >> "$run/distill.log" 2>&1
echo "$name distill rc=$? at ${SECONDS}s"
touch "$run/.distill_done"  # h200_collect.sh now returns the final head first
# QUANT=4 (or 8): the head to keep is the one stored at those bits (dspark-lab quantize-head), small
# enough to commit and continue next session with INIT= (a float head is lost with the machine).
# Collect it with HEAD=q4 bash benchmarks/h200_collect.sh NAME. It is what gets evaluated and timed,
# loaded as stored; the float head's evaluation (eval_float.json) runs last, to say what the
# quantization cost, and is the first thing a session running out of time loses.
# QUANT=3 QGROUP=128: 3 bits in groups of 128, for a head 4 bits leave over the 20 MB a committed
# one may be (a 1.5B head with a 3,072-wide MLP); it loads as stored at --drafter-bits 4.
head=$run; bits=16
if [ -n "${QUANT:-}" ]; then
  head=$run/q$QUANT; bits=$(( QUANT < 4 ? 4 : QUANT ))
  rm -rf "$head.new"  # written beside and moved into place, as h200_collect.sh does with checkpoints
  python3 -m dspark_lab quantize-head "$run" --out "$head.new" --bits "$QUANT" --group-size "${QGROUP:-64}" > "$run/quantize.log" 2>&1
  rc=$?; [ $rc = 0 ] && rm -rf "$head" && mv "$head.new" "$head"
  echo "$name quantize rc=$rc at ${SECONDS}s"; tail -1 "$run/quantize.log"
fi
evaluate() {  # evaluate HEAD_DIR BITS JSON LOG: the held-out sets, greedy, token identity and accept length
  python3 benchmarks/lossless_check.py --model "$model" --head "$1" --drafter-bits "$2" --prompts code,math,chat --limit 8 \
    --max-new-tokens 128 --cap "$cap" --no-lookup-arm --out "$3" > "$4" 2>&1
  echo "$name eval ($2 bits) rc=$? at ${SECONDS}s"; grep "mean accept\|identical" "$4"
}
evaluate "$head" "$bits" "$run/eval.json" "$run/eval.log"
# HELD=FILE (rows this target wrote greedily that no head trained on: /root/ship/data/held30_qwen15.jsonl.gz
# from docs/results): the kept head's teacher-forced accept length at every answer position of
# HELD_ROWS of them (benchmarks/block_accept.py: per anchor, what a decode accepts in a round
# starting there), and INIT's head beside it on the same anchors, paired: tens of thousands of
# anchors, where the evaluation above decodes 24 prompts. Beside the whole answers, their first 128
# tokens (what the evaluation decodes), and every anchor's result (held_anchors.jsonl.gz) for
# accept_by_segment.py and plot_accept_by_position.py at home.
if [ -n "${HELD:-}" ]; then
  python3 benchmarks/block_accept.py --model "$model" ${INIT:+--head "$INIT"} --head "$head" --drafter-bits "$bits" --data "$HELD" \
    --rows "${HELD_ROWS:-0}" --cap "$cap" --cache-gb 4 --first 128 --json "$run/held.json" --anchors-out "$run/held_anchors.jsonl.gz" \
    > "$run/held.log" 2>&1
  echo "$name held-out rows rc=$? at ${SECONDS}s"; grep "mean accept\|decode's path\| - " "$run/held.log"
fi
# TIMING: overlap (launch_overlap.py at launch_every 0 and 4), pipeline (pipeline_speed.py: mlx_lm,
# greedy, the plain loop and dspark-pipe side by side, and with DQ=1, the default, the same on a
# dequantized copy of the target; ARMS=dspark,pipe+cd: only those speculative arms), or none
# (e.g. while another job shares the GPU).
case ${TIMING:-overlap} in
  none) rc= ;;
  pipeline) python3 benchmarks/pipeline_speed.py --model "$model" --head "$head" --drafter-bits "$bits" --caps "${CAPS:-$cap}" --limit 2 \
              --max-new-tokens 128 --repeats 2 --no-compile $([ "${DQ:-1}" = 1 ] && echo --dequantized) ${ARMS:+--arms "$ARMS"} \
              --json "$run/pipeline.json" > "$run/timing.log" 2>&1; rc=$? ;;
  *) python3 benchmarks/launch_overlap.py --model "$model" --head "$head" --drafter-bits "$bits" --every 0,4 --cap "$cap" --prompts code,math,chat \
       --limit 2 --max-new-tokens 128 --repeats 2 --json "$run/overlap.json" > "$run/timing.log" 2>&1; rc=$? ;;
esac
[ -n "$rc" ] && { echo "$name timing rc=$rc at ${SECONDS}s"; grep -v Warning "$run/timing.log" | tail -12; }
# SWEEP=1: the lab's own sweep of the kept head (`dspark-lab sweep`: baseline, mlx-lm's decoder beside it, lookup, and
# dspark-pipe with device-side lookup and the compiled draft, at CAPS; SWEEP_PROMPTS prompts of each
# built-in set, default 2; 2 trials after a warm-up; SWEEP_PRECISIONS=as-loaded,8,dequantized: the
# target stored each way, each its own model in the results), device-stamped, into sweep.json: the result JSON
# that `dspark-lab ingest` merges here and `dspark-lab report --png` draws (issue #10's evidence).
if [ "${SWEEP:-0}" = 1 ]; then
  python3 -m dspark_lab sweep -m "$model" -d "$head" --drafter-bits "$bits" --modes lookup,dspark-pipe,mlx-lm --pipe-lookup --compile-draft \
    --caps "${CAPS:-$cap}" --prompt-limit "${SWEEP_PROMPTS:-2}" --trials 2 -n 128 ${SWEEP_PRECISIONS:+--precisions "$SWEEP_PRECISIONS"} \
    --db "$run/sweep.duckdb" --json "$run/sweep.json" \
    > "$run/sweep.log" 2>&1
  echo "$name sweep rc=$? at ${SECONDS}s"; tail -2 "$run/sweep.log"
fi
[ -n "${QUANT:-}" ] && evaluate "$run" 16 "$run/eval_float.json" "$run/eval_float.log"
touch "$run/.run_done"  # a waiting poll (h200_collect.sh WAIT=) returns now
echo "$name done"
