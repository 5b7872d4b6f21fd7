#!/usr/bin/env bash
# One device-tool call's worth of GPU benchmarks; results land in $OUT (JSON + logs).
#   bash benchmarks/device/device_suite.sh ring    # ring.py: correctness, scaling, peers, breakdown
#   bash benchmarks/device/device_suite.sh train [--set k=v ...]  # train_throughput.py, profiled
#   bash benchmarks/device/device_suite.sh tests [PYTEST ARGS]   # every test that needs CUDA, NCCL or 2 GPUs
#     (pytest -m gpu: tests/helpers/run_if.py marks them; MARK=multigpu for the 2-GPU ones only;
#     MARK= (empty) for the whole suite, as `python -m pytest tests` runs it there);
#     XDIST=N: over N pytest-xdist workers (a file's GPU tests in turn on one of them); COLD=1:
#     kernel caches emptied first;
#     log (-v: a run cut by LIMIT still names each result) and JUnit XML in $OUT (gpu_tests.log,
#     gpu_tests.xml), the last line its rc and time.
#     pytest, hypothesis, pytest-timeout and pytest-xdist come with the device image.
# Each part has its own time limit (LIMIT seconds, default 560) so one slow part cannot
# eat the whole call.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
source benchmarks/device/device_env.sh || exit 3  # REQUIRE_FA4=1 without FlashAttention-4, or longctx not importable
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
  tests)
    python -c "import pytest" 2>/dev/null \
      || { echo "[device_suite] pytest is not installed here: carry its wheels in .carry/wheels"; exit 2; }
    # COLD=1: from cold kernel caches (FA4's disk cache, Triton's), as on a fresh machine.
    [ "${COLD:-0}" = 1 ] && rm -rf ~/.cache/longctx/fa4 ~/.triton/cache
    start=$(date +%s)
    # Modules that cannot be imported here (a missing CPU-side package) are reported as errors
    # and the rc says so, but do not stop the GPU tests of the other modules.
    timeout "${LIMIT:-560}" python -m pytest -v -rfEs --durations=25 -m "${MARK-gpu}" -p no:cacheprovider \
      ${XDIST:+-n "$XDIST" --dist loadgroup} --continue-on-collection-errors --junitxml "$OUT/gpu_tests.xml" tests "${@:2}" > "$OUT/gpu_tests.log" 2>&1
    rc=$?
    tail -40 "$OUT/gpu_tests.log"
    echo "[device_suite] tests -m '${MARK-gpu}': rc $rc in $(( $(date +%s) - start )) s on $N GPU(s)" \
      | tee -a "$OUT/gpu_tests.log"
    exit $rc
    ;;
esac
