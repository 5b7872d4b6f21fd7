#!/usr/bin/env bash
# Issue 41's defaults table in one call on a 4-GPU machine, after fa4_carry.sh's stash call (carry
# .carry/fa4-2 and .carry/wheels): train.py, dense causal attention, 131,072-token sequences, same
# batches in every run: the Llama-3.2-1B shape on 1 GPU and on 4 (CP = 4) with the GPU defaults
# (the memory model's plan), on 4 with `activation_checkpointing full` (the old pinned plan), and
# the Llama-3-8B shape over CP = 4 with the defaults. Table: $OUT/defaults.json (medians of steps
# 5..last: tokens/s, step_s, MFU, peak memory); logs and metrics in $OUT/defaults_runs.tar.gz.
set -u
source benchmarks/device/device_env.sh || exit 3
mkdir -p "$OUT/runs"
run() {  # run NAME GPUS STEPS LIMIT CONFIG [train.py flags...]
  local name=$1 gpus=$2 steps=$3 limit=$4 config=$5
  shift 5
  rm -rf "/tmp/runs/${name}_${gpus}gpu"  # an earlier call's run there would make train.py refuse the directory
  timeout "$limit" python train.py --config "$config" --model.attention causal --trainer.max_steps "$steps" \
    --trainer.devices "$gpus" --strategy.context_parallel_size "$gpus" --output-dir "/tmp/runs/${name}_${gpus}gpu" \
    --trainer.enable_progress_bar false "$@" > "$OUT/runs/${name}_${gpus}gpu.log" 2>&1
  echo "${name} ${gpus} GPUs: rc=$?"
  # A run killed by its limit leaves only the logger's file (flushed every step): take that one.
  cp "/tmp/runs/${name}_${gpus}gpu/metrics.csv" "$OUT/runs/${name}_${gpus}gpu_metrics.csv" 2>/dev/null \
    || cp /tmp/runs/"${name}_${gpus}"gpu/logs/version_*/metrics.csv "$OUT/runs/${name}_${gpus}gpu_metrics.csv" 2>/dev/null
  grep -h "run plan\|memory:\|memory (predicted\|Error\|error:" "$OUT/runs/${name}_${gpus}gpu.log" | cut -c1-300 | head -4
}
# Limits from the first try (4 x H200): a 1B run pays ~40 s of start-up and its step-0 compile
# besides its steps; 100 s did not see a 4-GPU run of 16 steps end. PART=1b or 8b: one call each.
# GPUS: the CP size of the multi-GPU runs (4; 2 where only 2-GPU machines are lent); PART=1gpu:
# the 1B one-GPU run alone; PART=1gpu-pair: it, then with selective on every block; PART=8b-pair:
# the 8B with the defaults, then with selective recompute.
one_b=configs/llama3.2-1b-128k.yaml gpus=${GPUS:-4}
case "${PART:-1b}" in
  1b)
    run dense 1 "${STEPS_1:-10}" 200 "$one_b" --checkpoint-every 0
    run dense "$gpus" "${STEPS:-16}" 160 "$one_b" --checkpoint-every 0
    run dense-full "$gpus" "${STEPS:-16}" 170 "$one_b" --checkpoint-every 0 --model.parallel.activation_checkpointing full ;;
  1gpu) run dense 1 "${STEPS_1:-10}" "${LIMIT_1:-200}" "$one_b" --checkpoint-every 0 ;;
  1gpu-pair)  # the defaults, then selective on every block: same batches, same call
    run dense 1 "${STEPS_1:-10}" "${LIMIT_1:-200}" "$one_b" --checkpoint-every 0
    run dense-selective 1 "${STEPS_1:-10}" "${LIMIT_1:-200}" "$one_b" --checkpoint-every 0 \
      --model.parallel.activation_checkpointing selective ;;
  *)
    run 8b "$gpus" "${STEPS_8B:-8}" "${LIMIT_8B:-400}" configs/llama3-8b-128k.yaml --checkpoint-every 0
    if [ "${PART}" = 8b-pair ]; then  # same batches, same call: does "auto"'s ranking hold on the clock
      run 8b-selective "$gpus" "${STEPS_8B:-8}" "${LIMIT_8B:-400}" configs/llama3-8b-128k.yaml --checkpoint-every 0 \
        --model.parallel.activation_checkpointing selective
    fi ;;
esac
python benchmarks/scaleout_table.py --runs "$OUT/runs" --gpu "${GPU_NAME:-gpu}" --first 5 --last 99 --out "$OUT/defaults.json"
(cd "$OUT" && tar czf defaults_runs.tar.gz runs && rm -rf runs)
