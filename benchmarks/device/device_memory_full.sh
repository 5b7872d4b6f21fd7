#!/usr/bin/env bash
# The memory model on full-depth models, 2 GPUs, FSDP2 over both, CP=2 (issue 32): train.py as a
# user runs it, each case under its own time limit, then one JSON of predicted vs measured
# (benchmarks/memory_full_table.py: $OUT/memory_full.json) and one tarball of every case's log,
# config.yaml and metrics.csv ($OUT/memory_full_logs.tar.gz).
#   CASES=8b_128k bash benchmarks/device/device_memory_full.sh              # one 8B case per call
#   CASES=8b_512k bash benchmarks/device/device_memory_full.sh
#   CASES="hf_1b_128k 1b_1m" bash benchmarks/device/device_memory_full.sh   # the 1B cases together
# The cases (name, time limit, train.py arguments), those that run when CASES is unset, and
# the budget are data in longctx/bench/memory_cases.py; cases run in the order CASES gives,
# each limit cut to what is left of BUDGET seconds (default: BUDGET_S there).
# FlashAttention-4 as for the other device scripts: after fa4_carry.sh's stash call, carry
# .carry/fa4-2 and .carry/wheels (device_env.sh installs them; idempotent).
# metrics.csv reaches the disk after every step, so a run killed at its limit keeps its steps.
# Each case runs under torchrun (both ranks build their model at once; Lightning's own
# launcher starts rank 1 only after rank 0 has built an 8B model on the host).
# PREPARE_ONLY=1: only build every case's tokenizer and corpus caches (no GPU work), e.g. in
# the FlashAttention-4 stash call, so that the timed calls start from a warm data cache.
set -u
start=$(date +%s)
OUT=${OUT:-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: device_env.sh may move to a staged copy
source benchmarks/device/device_env.sh || exit 3  # REQUIRE_FA4=1 without FlashAttention-4, or longctx not importable
settings=$(python -m longctx.bench.memory_cases) || exit 3  # CASE_<name>="LIMIT_S args", BUDGET_S, ...
eval "$settings"
STEPS=${STEPS:-3}
CASES=${CASES:-$DEFAULT_CASES}
BUDGET=${BUDGET:-$BUDGET_S}
if [ "${PREPARE_ONLY:-0}" = 1 ]; then
  for name in $CASES; do
    var=CASE_$name
    read -r _ args <<< "${!var}"
    t0=$(date +%s)
    # shellcheck disable=SC2086
    python -c "import sys; from train import prepare; prepare(sys.argv[1:], device_checks=False).datamodule.prepare_data()" \
      ${args//STEPS/1} 2>&1 | grep -v "Warning\|warn(" | tail -2
    echo "[prepare] $name: data caches ready in $(( $(date +%s) - t0 )) s"
  done
  return 0 2>/dev/null || exit 0
fi
RUNS=/tmp/memory_full_runs
rm -rf "$RUNS" && mkdir -p "$RUNS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$RUNS/gpus.txt" 2>&1
for name in $CASES; do
  var=CASE_$name
  if [ -z "${!var:-}" ]; then echo "unknown case $name"; continue; fi
  read -r limit args <<< "${!var}"
  left=$(( BUDGET - RESERVE_S - ($(date +%s) - start) ))  # kept for the table and the tarball
  (( left < limit )) && limit=$left
  mkdir -p "$RUNS/$name"
  if (( limit < 30 )); then
    echo "not run: ${left} s of the budget left" > "$RUNS/$name/train.log"; echo 124 > "$RUNS/$name/rc"; continue
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086  # the arguments are words
  timeout -k 10 "$limit" torchrun --standalone --nproc-per-node 2 train.py ${args//STEPS/$STEPS} --output-dir "$RUNS/$name/run" \
    --checkpoint-every 0 --trainer.enable_progress_bar false > "$RUNS/$name/train.log" 2>&1
  echo $? > "$RUNS/$name/rc"
  echo $(( $(date +%s) - t0 )) > "$RUNS/$name/wall_s"
  echo "[$(( $(date +%s) - start )) s] $name: rc $(cat "$RUNS/$name/rc") in $(cat "$RUNS/$name/wall_s") s (limit $limit)"
  grep -v "Warning\|warn(" "$RUNS/$name/train.log" | grep "memory\|run plan\|error\|Error\|done:" | cut -c1-400
done
python benchmarks/memory_full_table.py "$RUNS" --cases "$CASES" --out "$OUT/memory_full.json" --readme
tar czf "$OUT/memory_full_logs.tar.gz" -C "$RUNS" --exclude checkpoints .
echo "total $(( $(date +%s) - start )) s"
