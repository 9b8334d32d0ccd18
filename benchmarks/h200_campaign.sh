#!/usr/bin/env bash
# Issue #10's campaign on the H200, in two calls (each fits the device's 10-minute limit):
#   PHASE=peer   our DSpark against the peer mlx-dspark (Qwen heads; the peer cannot load the
#                SmolLM2 head's rank-32 Markov table) and our greedy against mlx_lm, and on the 1.5B
#                target mlx-lm's draft-model speculation against ours (benchmarks/peer_vs_ours.py)
#   PHASE=sweep  lab sweeps (lookup, DSpark, draft model) whose result JSON comes back for
#                `dspark-lab ingest` + `dspark-lab report`
# Run on the device after `source /root/ship/mlx/activate`, with the heads of h200_train_refs.sh:
#   PHASE=peer|sweep SMOL=DIR SMOL_HEAD=DIR QWEN=DIR QWEN_HEAD=DIR [QWEN15=DIR QWEN15_HEAD=DIR] [WHL=DIR] OUT=DIR \
#     bash benchmarks/h200_campaign.sh
#   PHASE=all GPUS=4  both at once on a 4-GPU machine, each timed job alone on its GPU, plus the
#                held-out evaluation of every head (benchmarks/lossless_check.py, the head alone)
# SWEEP_EXTRA: more sweep flags for every sweep, e.g. "--compile-draft --pipe-lookup" (the
# dspark-pipe arms' options; the tenth round's fastest arm was dspark-pipe with --compile-draft).
# Heads run unquantized (--drafter-bits 16): they are small, and 4 bits costs acceptance.
# Timed work never shares a GPU: one process at a time per GPU.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
run() { echo "== $*"; "$@"; echo "rc=$?"; }
quiet() { grep -v "Warning\|━\|incorrect regex\|fix_mistral_regex"; }
on() { CUDA_VISIBLE_DEVICES=$1; export CUDA_VISIBLE_DEVICES; shift; "$@"; }
if [ "${PHASE:-}" = peer ] || [ "${PHASE:-}" = all ]; then
  WHL=${WHL:-.whl}
  if ls "$WHL"/*.whl >/dev/null 2>&1; then  # the peer, mlx-dspark 0.20.3 (benchmarks/ship_peer.sh)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
      && export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
fi
peer15() {
  if [ -n "${QWEN15:-}" ]; then
    run timeout 290 python3 benchmarks/peer_vs_ours.py --model "$QWEN15" --drafter "$QWEN15_HEAD" --draft-model "$QWEN" \
      --caps 3,5,7 --peer-caps 7 --repeats 2 --drafter-bits 16 --max-new-tokens 160 --json "$OUT/peer_qwen15.json" 2>&1 | quiet | tail -30
  fi
}
peer05() {
  run timeout 170 python3 benchmarks/peer_vs_ours.py --model "$QWEN" --drafter "$QWEN_HEAD" --caps 4,7 --peer-caps 7 --repeats 2 \
    --drafter-bits 16 --max-new-tokens 160 --json "$OUT/peer_qwen05.json" 2>&1 | quiet | tail -22
}
sweep() {  # name model head caps extra...; each sweep its own database (parallel sweeps)
  local name=$1 model=$2 head=$3 caps=$4; shift 4
  run timeout "${SWEEP_TIMEOUT:-170}" python3 -m dspark_lab sweep -m "$model" -d "$head" --caps "$caps" --prompts code,math,chat \
    --prompt-limit 4 --trials 1 -n 128 --drafter-bits 16 --db "/tmp/campaign_$name.duckdb" --json "$OUT/sweep_$name.json" "$@" \
    ${SWEEP_EXTRA:-} 2>&1 | quiet | tail -8
}
sweep_smol() { sweep smollm2 "$SMOL" "$SMOL_HEAD" 2,4 --modes lookup,dspark,dspark-pipe; }
sweep_qwen05() { sweep qwen05 "$QWEN" "$QWEN_HEAD" 4,7 --modes lookup,dspark,dspark-pipe; }
sweep_qwen15() { [ -z "${QWEN15:-}" ] || sweep qwen15 "$QWEN15" "$QWEN15_HEAD" 3,7 --modes lookup,dspark,dspark-pipe,draft --draft-model "$QWEN"; }
evaluate() {  # name model head cap: the head alone on the held-out built-in sets
  run timeout "${EVAL_TIMEOUT:-120}" python3 benchmarks/lossless_check.py --model "$2" --head "$3" --drafter-bits 16 --prompts code,math,chat \
    --limit 8 --max-new-tokens 128 --cap "$4" --no-lookup-arm --out "$OUT/eval_$1.json" 2>&1 | grep "mean accept length\|identical;\|^rc=\|^== \|Error"
}
case "${PHASE:-}" in
  peer) peer15; peer05 ;;
  sweep) sweep_smol; sweep_qwen05; sweep_qwen15 ;;
  all)
    (on 0 peer15 > "$OUT/gpu0.log" 2>&1) &
    (on 1 peer05 > "$OUT/gpu1.log" 2>&1; on 1 sweep_smol >> "$OUT/gpu1.log" 2>&1) &
    (on 2 sweep_qwen05 > "$OUT/gpu2.log" 2>&1; on 2 evaluate smollm2 "$SMOL" "$SMOL_HEAD" 4 >> "$OUT/gpu2.log" 2>&1
     on 2 evaluate qwen05 "$QWEN" "$QWEN_HEAD" 7 >> "$OUT/gpu2.log" 2>&1
     [ -z "${QWEN15:-}" ] || on 2 evaluate qwen15 "$QWEN15" "$QWEN15_HEAD" 7 >> "$OUT/gpu2.log" 2>&1) &
    (on 3 sweep_qwen15 > "$OUT/gpu3.log" 2>&1; [ -z "${SMOL_HEAD2:-}" ] || on 3 evaluate smollm2_b "$SMOL" "$SMOL_HEAD2" 4 >> "$OUT/gpu3.log" 2>&1) &
    wait
    tail -n 40 "$OUT"/gpu*.log ;;
  *) echo "PHASE must be peer, sweep or all"; exit 2 ;;
esac
# The device hands back at most 8 files a call, and a call's OUT is empty at the next: keep the
# logs, pack every result JSON into one archive.
(cd "$OUT" && tar czf results.tgz ./*.json && rm -f ./*.json)
ls -la "$OUT"
