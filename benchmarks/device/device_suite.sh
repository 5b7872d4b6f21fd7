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
    # Modules that cannot be imported here (a missing CPU-side package) are reported as errors
    # and the rc says so, but do not stop the GPU tests of the other modules.
    # GPU_SETS="0 1,2 0,1,2,3": one pytest per set of GPUs at once (CUDA_VISIBLE_DEVICES), each
    # with its own kernel caches and logs gpu_tests_<n>gpu.{log,xml} + live_<n>gpu.log; default
    # one run on every GPU. The live log (benchmarks/device/pytest_live_log.py) names each result,
    # its time and its failure text as it lands, so a run cut by LIMIT still says why.
    # Workers share the cores: each gets cores / workers intra-op threads (64 per process
    # otherwise, and the multi-process tests start several).
    export PYTHONPATH=$PWD/benchmarks/device${PYTHONPATH:+:$PYTHONPATH}
    sets=$(echo ${GPU_SETS:-all} | wc -w)
    per=$(( $(nproc) / ${XDIST:-1} / sets ))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( per > 1 ? per : 1 ))}
    suite() {  # $1: the GPU set ("all" for every GPU), $2: the file tag
      local n=$N cache=${TMPDIR:-/tmp}/suite_cache_$2
      [ "$1" = all ] || { export CUDA_VISIBLE_DEVICES=$1; n=$(echo "$1" | tr , '\n' | wc -l); }
      export TRITON_CACHE_DIR=$cache/triton FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$cache/fa4 LIVE_LOG=$OUT/live$2.log
      [ "${COLD:-0}" = 1 ] && rm -rf "$cache"  # cold kernel caches (Triton's, FA4's), as on a fresh machine
      local t0=$(date +%s)
      timeout "${LIMIT:-560}" python -m pytest -v -rfEs --durations=25 -m "${MARK-gpu}" -p no:cacheprovider \
        -p pytest_live_log ${XDIST:+-n "$XDIST" --dist loadgroup} --continue-on-collection-errors \
        --junitxml "$OUT/gpu_tests$2.xml" tests "${@:3}" > "$OUT/gpu_tests$2.log" 2>&1
      local rc=$?
      echo "[device_suite] tests -m '${MARK-gpu}': rc $rc in $(( $(date +%s) - t0 )) s on $n GPU(s), OMP_NUM_THREADS=$OMP_NUM_THREADS" \
        | tee -a "$OUT/gpu_tests$2.log"
      return $rc
    }
    if [ -z "${GPU_SETS:-}" ]; then
      suite all "" "${@:2}"; rc=$?
      tail -40 "$OUT/gpu_tests.log"
      exit $rc
    fi
    pids=()
    for set in $GPU_SETS; do
      ( suite "$set" "_$(echo "$set" | tr , '\n' | wc -l)gpu" "${@:2}" ) & pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    grep -h "^\[device_suite\]\|passed\|failed" "$OUT"/gpu_tests_*gpu.log | tail -20
    exit $rc
    ;;
esac
