#!/usr/bin/env bash
# train.py, Llama-3.2-1B shape at 131,072 tokens on packed documents: the default corpus with
# one document per .py file (--data.stdlib_documents file, mean ~16 KB of text), document
# masking on one GPU and on two (CP=2), then plain causal attention on two, same call (after
# fa4_carry.sh's stash call; carry .carry/fa4-2 and .carry/wheels). Logs and metrics under
# $OUT. Usage: bash benchmarks/device/device_documents_train.sh [STEPS]
set -u
steps=${1:-4}
source benchmarks/device/device_env.sh || exit 3  # REQUIRE_FA4=1 without FlashAttention-4, or longctx not importable
for run in "doc 1" "doc 2" "causal 2"; do
  set -- $run
  attention=$1 gpus=$2
  [ "$attention" = doc ] && mode=document || mode=causal
  bash benchmarks/device/device_train_runs.sh "llama1b_128k_files_${attention}_${gpus}gpu" 280 \
    --config configs/llama3.2-1b-128k.yaml --data.stdlib_documents file \
    --trainer.max_steps "$steps" --model.attention "$mode" --trainer.devices "$gpus" \
    --strategy.context_parallel_size "$gpus"
  rm -f "$OUT/llama1b_128k_files_${attention}_${gpus}gpu_hostmem.txt"
done
