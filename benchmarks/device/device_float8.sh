#!/usr/bin/env bash
# FP8 against bf16 (issue 41), one call on a 4-GPU machine after fa4_carry.sh's stash call (carry
# .carry/fa4-2 and .carry/wheels, which holds torchao): train.py with CONFIG (default the Llama-3-8B
# shape at 131,072 tokens) over CP = GPUS, WORKLOAD docs (packed files, document masking) or dense,
# STEPS steps per run (no checkpoint written), same batches in every run: bf16, bf16 again (the run-to-run noise) and FP8
# (--model.parallel.float8 true). Then benchmarks/float8_table.py: $OUT/float8.json (median
# tokens/s and MFU over steps 3..STEPS, the ratio, the losses step by step, peak memory predicted
# vs measured). SMOKE=1: one GPU, the 1B shape at 16,384 tokens, 3 steps each (does FP8 run here).
set -u
source benchmarks/device/device_env.sh || exit 3
mkdir -p "$OUT/runs"
if [ "${SMOKE:-0}" = 1 ]; then
  CONFIG=configs/llama3.2-1b-128k.yaml GPUS=1 STEPS=3 EXTRA="--seq-len 16384 ${EXTRA:-}" RUNS="bf16 fp8"
fi
config=${CONFIG:-configs/llama3-8b-128k.yaml} gpus=${GPUS:-4} steps=${STEPS:-8}
[ "${WORKLOAD:-docs}" = docs ] && data=(--data.stdlib_documents file --model.attention document) || data=(--model.attention causal)
for run in ${RUNS:-bf16 bf16-repeat fp8}; do
  [ "$run" = fp8 ] && fp8=true || fp8=false
  start=$SECONDS
  rm -rf "/tmp/runs/f8_$run"  # an earlier call's run there would make train.py refuse the directory
  timeout "${LIMIT:-200}" python train.py --config "$config" "${data[@]}" --trainer.max_steps "$steps" \
    --trainer.devices "$gpus" --strategy.context_parallel_size "$gpus" --model.parallel.float8 "$fp8" \
    --output-dir "/tmp/runs/f8_$run" --trainer.enable_progress_bar false --checkpoint-every 0 ${EXTRA:-} \
    > "$OUT/runs/$run.log" 2>&1
  echo "$run: rc=$? ($((SECONDS - start)) s)"; grep -h "run plan\|memory (predicted\|Error\|error:" "$OUT/runs/$run.log" | cut -c1-400 | head -4
  # A run killed by its limit leaves only the logger's file (flushed every step): take that one.
  cp "/tmp/runs/f8_$run/metrics.csv" "$OUT/runs/${run}_metrics.csv" 2>/dev/null \
    || cp /tmp/runs/f8_"$run"/logs/version_*/metrics.csv "$OUT/runs/${run}_metrics.csv" 2>/dev/null
done
python benchmarks/float8_table.py --runs "$OUT/runs" --first 3 --out "$OUT/float8.json"
(cd "$OUT" && tar czf float8_runs.tar.gz runs && rm -rf runs)
