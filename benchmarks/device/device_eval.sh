#!/usr/bin/env bash
# Issue 42's GPU evaluation in one call (2 GPUs; after fa4_carry.sh's stash call, carry .carry/fa4-2
# and .carry/wheels): a Llama-3.2-1B-shape checkpoint (train.py, 2 steps at 8,192 tokens: the
# config's 131,072-token RoPE, its own tokenizer), then evaluate.py on it at up to 131,072 tokens
# on 1 GPU and on 2 (CP = 2, ring prefill): passkey lengths x depths and loss by position. Into
# $OUT: eval_1b_{1,2}gpu.json (evaluate.py's records, with their wall seconds), pictures and the logs.
# TOKENIZER=FILE (inside the checkout, so that it travels): no training, a seeded random init of
# the shape with that tokenizer (the 1B config's: train.py writes it as
# ~/.cache/longctx/tokenizers/spm-32768-*.model).
set -u
source benchmarks/device/device_env.sh || exit 3
mkdir -p "$OUT/logs"
run=/tmp/eval_1b
rm -rf "$run"
gpus() { seq -s, "${FIRST_GPU:-0}" $(( ${FIRST_GPU:-0} + $1 - 1 )); }  # FIRST_GPU: share a machine
if [ "${EVAL_1B:-1}" = 1 ]; then  # EVAL_1B=0: the 8B prefill alone
if [ -n "${TOKENIZER:-}" ]; then  # no checkpoint: a seeded random init of the 1B shape, this tokenizer
  model=(--preset llama3.2-1b --tokenizer "$TOKENIZER")
else
  model=(--checkpoint "$run")
start=$(date +%s)
timeout "${TRAIN_LIMIT:-240}" python train.py --config configs/llama3.2-1b-128k.yaml --seq-len 8192 \
  --trainer.devices 1 --strategy.context_parallel_size 1 --trainer.max_steps 2 --checkpoint-every 2 ${TRAIN_FLAGS---strategy.data_parallel ddp} \
  --output-dir "$run" --trainer.enable_progress_bar false > "$OUT/logs/train.log" 2>&1
echo "train: rc=$? in $(( $(date +%s) - start )) s (the end's last.ckpt included)"; tail -3 "$OUT/logs/train.log"
ls -la "$run/checkpoints" 2>&1 | tail -2
fi
for n in ${GPUS:-1 2}; do
  start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$(gpus "$n") timeout "${EVAL_LIMIT:-150}" torchrun --standalone --nproc-per-node "$n" \
    evaluate.py "${model[@]}" --tasks passkey,loss --lengths "${LENGTHS:-4096,32768,131072}" \
    --depths 0,0.5,1 --trials 2 --data auto --max-sequences 2 --out "$OUT" --tag "eval_1b_${n}gpu" \
    > "$OUT/logs/eval_${n}gpu.log" 2>&1
  echo "eval ${n} GPU(s): rc=$? in $(( $(date +%s) - start )) s"; grep -v "Warning\|warn" "$OUT/logs/eval_${n}gpu.log" | tail -4
done
fi
# PREFILL_8B=TOKENIZER_FILE: prefill (loss task, one window) of a seeded random init of the 8B
# shape: on one GPU at PREFILL_1 tokens, on the largest of GPUS at PREFILL_N (PREFILL_GPUS: which
# sizes; FIRST_GPU: from which GPU, to share a machine with another job) (a short first length
# compiles the kernels before the timed ones). tokens_per_s per length in prefill_8b_{n}gpu.json.
if [ -n "${PREFILL_8B:-}" ]; then
  for n in ${PREFILL_GPUS:-1 ${GPUS##* }}; do
    lengths=${PREFILL_1:-16384,131072}; [ "$n" = 1 ] || lengths=${PREFILL_N:-16384,131072,524288}
    start=$(date +%s)
    CUDA_VISIBLE_DEVICES=$(gpus "$n") timeout "${PREFILL_LIMIT:-150}" torchrun --standalone --nproc-per-node "$n" \
      evaluate.py --preset llama3-8b --tokenizer "$PREFILL_8B" --tasks loss --lengths "$lengths" --data auto \
      --max-sequences 1 --out "$OUT" --tag "prefill_8b_${n}gpu" > "$OUT/logs/prefill_8b_${n}gpu.log" 2>&1
    echo "prefill 8B ${n} GPU(s): rc=$? in $(( $(date +%s) - start )) s"; grep "tok/s\|tokens\|Error" "$OUT/logs/prefill_8b_${n}gpu.log" | tail -4
  done
fi
(cd "$OUT" && tar czf "eval_logs${LOG_TAG:-}.tar.gz" logs && rm -rf logs)
