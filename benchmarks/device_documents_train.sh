#!/usr/bin/env bash
# train.py, Llama-3.2-1B shape at 131,072 tokens with document masking on the default data:
# one GPU, then two (CP=2), same call (after fa4_carry.sh's stash call; carry .carry/fa4-2 and
# .carry/wheels). Logs and metrics under $OUT. Usage: bash benchmarks/device_documents_train.sh [STEPS]
set -u
steps=${1:-4}
source benchmarks/device_env.sh
for spec in 1 2; do
  bash benchmarks/device_train_runs.sh "llama1b_128k_doc_${spec}gpu" 280 --config configs/llama3.2-1b-128k.yaml \
    --trainer.max_steps "$steps" --model.attention document --trainer.devices "$spec" \
    --strategy.context_parallel_size "$spec"
  rm -f "$OUT/llama1b_128k_doc_${spec}gpu_hostmem.txt"
done
