#!/usr/bin/env bash
# One device-tool call's worth of GPU benchmarks; results land in $OUT (JSON + logs).
#   bash benchmarks/device_suite.sh ring    # ring.py: correctness, scaling, peers, breakdown
#   bash benchmarks/device_suite.sh train [--set k=v ...]  # train_throughput.py, profiled
# Each part has its own time limit (LIMIT seconds, default 560) so one slow part cannot
# eat the whole call.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
source benchmarks/device_env.sh
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
case "${1:-ring}" in
  ring)
    timeout "${LIMIT:-560}" torchrun --nproc-per-node="$N" benchmarks/ring.py \
      --sections "${SECTIONS:-check,priority,breakdown,d64,speed,peer}" \
      --seqs "${SEQS:-32768,131072}" --backends "${BACKENDS:-cudnn,triton}" \
      --out "$OUT" --tag "${TAG:-}" 2>&1 | grep -v "^W1\|Warning" | tee "$OUT/ring.log" | tail -60
    ;;
  train)
    timeout "${LIMIT:-560}" torchrun --nproc-per-node="$N" benchmarks/train_throughput.py \
      --seqs "${SEQS:-131072,32768}" --sizes "${SIZES:-$N}" --steps 3 --profile \
      --out "$OUT" --tag "${TAG:-}" "${@:2}" 2>&1 | grep -v "^W1\|Warning\|_warn_once" \
      | tee "$OUT/train.log" | tail -40
    ;;
esac
