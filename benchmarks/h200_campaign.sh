#!/usr/bin/env bash
# Issue #10's campaign on the H200, one call: the peer side by side (benchmarks/peer_vs_ours.py)
# and lab sweeps whose result JSON comes back for `dspark-lab ingest` + `report`.
# Run on the device after `source /root/ship/mlx/activate`, with the heads of h200_train_refs.sh:
#   SMOL=DIR SMOL_HEAD=DIR QWEN=DIR QWEN_HEAD=DIR OUT=DIR bash benchmarks/h200_campaign.sh
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then  # the peer, mlx-dspark 0.20.3 (benchmarks/ship_peer.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
run() { echo "== $*"; "$@"; echo "rc=$?"; }
run timeout 170 python3 benchmarks/peer_vs_ours.py --model "$SMOL" --drafter "$SMOL_HEAD" --caps 2,4 --repeats 2 \
  --max-new-tokens 192 --json "$OUT/peer_smollm2.json" 2>&1 | grep -v Warning | tail -22
run timeout 170 python3 benchmarks/peer_vs_ours.py --model "$QWEN" --drafter "$QWEN_HEAD" --caps 4,7 --repeats 2 \
  --max-new-tokens 192 --json "$OUT/peer_qwen05.json" 2>&1 | grep -v Warning | tail -22
for pair in "smollm2 $SMOL $SMOL_HEAD 2,4" "qwen05 $QWEN $QWEN_HEAD 4,7"; do
  set -- $pair
  run timeout 150 python3 -m dspark_lab sweep -m "$2" -d "$3" --modes lookup,dspark --caps "$4" --prompts code,math,chat \
    --prompt-limit 5 --trials 1 -n 128 --db /tmp/campaign.duckdb --json "$OUT/sweep_$1.json" 2>&1 | grep -v "━" | tail -6
done
