#!/usr/bin/env bash
# Where host time goes (issue 40), one call on a 4-GPU machine after fa4_carry.sh's stash call
# (carry .carry/fa4-2 and .carry/wheels): FA4's host time per call at each level of our stack
# (benchmarks/fa4_host_overhead.py, one GPU), then train.py (1B shape, 131,072 tokens, packed
# files, documents) on GPUS (default "1 4") with steps 6-9 under cProfile on rank 0
# (benchmarks/step_profile.py). Everything under $OUT, the logs in one tarball.
set -u
source benchmarks/device/device_env.sh || exit 3
mkdir -p "$OUT/logs"
timeout 150 python benchmarks/fa4_host_overhead.py --out "$OUT" > "$OUT/logs/fa4_host_overhead.log" 2>&1
echo "fa4_host_overhead rc=$?"; tail -3 "$OUT/logs/fa4_host_overhead.log"
for g in ${GPUS:-1 4}; do
  timeout "${LIMIT:-170}" python benchmarks/step_profile.py --first-step 6 --steps 4 --out "$OUT/step_${g}gpu" -- \
    --config configs/llama3.2-1b-128k.yaml --data.stdlib_documents file --model.attention document \
    --trainer.max_steps 11 --trainer.devices "$g" --strategy.context_parallel_size "$g" \
    --output-dir "/tmp/runs/prof_${g}gpu" --trainer.enable_progress_bar false ${EXTRA:-} \
    > "$OUT/logs/train_${g}gpu.log" 2>&1
  echo "train ${g} GPUs rc=$?"; grep -h "run plan" "$OUT/logs/train_${g}gpu.log" | head -2
  cp "/tmp/runs/prof_${g}gpu/metrics.csv" "$OUT/logs/metrics_${g}gpu.csv" 2>/dev/null
  cat "$OUT/step_${g}gpu/step_phases.json" 2>/dev/null | tr -d '\n ' ; echo
done
(cd "$OUT" && tar czf logs.tar.gz logs step_* && rm -rf logs step_*)
