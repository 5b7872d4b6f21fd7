#!/usr/bin/env bash
# train.py runs on a device machine, each under its own time limit; logs and metrics land in
# $OUT. Usage: bash benchmarks/device/device_train_runs.sh NAME LIMIT_S [train.py args ...]
# Host memory (GiB used, every 5 s) is sampled beside each run: CPU offload lives there.
set -u
OUT=${OUT:-benchmarks/results}
name=$1 limit=$2
shift 2
mkdir -p "$OUT"
( while true; do free -g | awk -v t="$(date +%s)" 'NR==2 {print t, $3}'; sleep 5; done ) > "$OUT/${name}_hostmem.txt" &
sampler=$!
timeout "$limit" python train.py --output-dir "/tmp/runs/$name" --trainer.enable_progress_bar false "$@" \
  > "$OUT/${name}.log" 2>&1
echo "rc=$?" >> "$OUT/${name}.log"
kill $sampler
cp "/tmp/runs/$name/metrics.csv" "$OUT/${name}_metrics.csv" 2>/dev/null
grep -v "^\[rank\|Warning\|warn" "$OUT/${name}.log" | tail -15
