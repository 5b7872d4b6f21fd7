#!/usr/bin/env bash
# train.py on one GPU with the Llama-3.2-1B shape at 131,072 tokens (configs/llama3.2-1b-128k.yaml):
# FlashAttention-4 ("auto") against the previous default kernels, plain causal and with
# document masking, in one call. Usage: bash benchmarks/device/device_fa4_train.sh STEPS
steps=${1:-4}
for spec in fa4_causal:auto:causal cudnn_causal:cudnn:causal fa4_doc:auto:document triton_doc:triton:document; do
  IFS=: read -r name backend attention <<<"$spec"
  bash benchmarks/device/device_train_runs.sh "llama1b_128k_${name}" 170 --config configs/llama3.2-1b-128k.yaml \
    --trainer.max_steps "$steps" --model.parallel.attention_backend "$backend" --model.attention "$attention"
  rm -f "$OUT/llama1b_128k_${name}_hostmem.txt"
done
