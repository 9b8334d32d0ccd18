#!/usr/bin/env bash
# One 2-GPU session (issues #9 and #10): train the SmolLM2 head further on GPU 0 while GPU 1
# measures the pipelined and compiled loops side by side with the plain one.
# Run from the checkout on the device after `source /root/ship/mlx/activate`, with the models
# under /root/ship (shared/device/README.md), the fixture head copied to /root/fixhead, the
# prepared data in /root/prev and the prompt files in /root/prompts:
#   (MINUTES=14 setsid nohup bash benchmarks/h200_pipeline.sh gpu0 > /tmp/gpu0.log 2>&1 < /dev/null &)
#   (QWEN_MINUTES=9 setsid nohup bash benchmarks/h200_pipeline.sh gpu1 > /tmp/gpu1.log 2>&1 < /dev/null &)
# Results: /tmp/pipe_*.json and the heads in /tmp/smol, /tmp/qwen05 (see h200_corpus_heads.sh).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
smol=/root/ship/smollm2/smollm2-135m
qwen=/root/ship/qwen05/qwen2.5-coder-0.5b-q4-bfloat16
prompts=humaneval:/root/prompts/HumanEval.jsonl.gz,/root/prompts/sharegpt.jsonl
case ${1:-} in
  gpu0)
    # The committed fixture head, trained on from its weights (same data), then measured.
    GPU=0 DATA=/root/prev/smol.jsonl.gz MINUTES=${MINUTES:-14} LR=${LR:-5e-4} TIMING=none INIT=/root/fixhead PROMPTS=$prompts \
      bash benchmarks/h200_corpus_heads.sh smol
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/pipeline_speed.py --model $smol --head /tmp/smol --caps 4 \
      --limit 2 --max-new-tokens 128 --repeats 2 --json /tmp/pipe_smol_new.json
    ;;
  gpu1)
    # Side by side with the fixture head first (alone on this GPU), then a Qwen 0.5B head.
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/pipeline_speed.py --model $smol --head /root/fixhead --caps 2,4 \
      --limit 2 --max-new-tokens 128 --repeats 2 --json /tmp/pipe_smol.json
    while [ ! -f /root/ship/qwen05/.complete ]; do sleep 5; done
    GPU=1 DATA=/root/prev/qwen05.jsonl.gz MINUTES=${QWEN_MINUTES:-9} TIMING=none PROMPTS=$prompts \
      bash benchmarks/h200_corpus_heads.sh qwen05
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/pipeline_speed.py --model $qwen --head /tmp/qwen05 --caps 4,7 \
      --limit 2 --max-new-tokens 128 --repeats 2 --json /tmp/pipe_qwen05.json
    ;;
  *) echo "usage: h200_pipeline.sh gpu0|gpu1"; exit 2 ;;
esac
echo "${1} done at ${SECONDS}s"
