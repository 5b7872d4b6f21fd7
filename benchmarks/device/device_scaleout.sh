#!/usr/bin/env bash
# The scale-out table (issue 40) on one 4-GPU machine, baselines in the same call: train.py,
# Llama-3.2-1B shape, 131,072-token sequences, STEPS steps per run, same batches in every run.
#   WORKLOADS="docs" (packed files, document masking) and/or "dense" (plain causal attention)
#   GPUS="1 2 4"; BEFORE=DIR also runs DIR's train.py at the largest GPU count: an older tree
#   staged with models/ and kernels/ copied into its longctx/ (git archive REV, then cp -r).
# After fa4_carry.sh's stash call; carry .carry/fa4-2 and .carry/wheels. Metrics under $OUT/runs,
# the table in $OUT/scaleout.json. Usage: bash benchmarks/device/device_scaleout.sh
set -u
config=${CONFIG:-configs/llama3.2-1b-128k.yaml}
steps=${STEPS:-20} limit=${LIMIT:-200}
source benchmarks/device/device_env.sh || exit 3
here=$(pwd)
mkdir -p "$OUT/runs"
run() {  # run NAME GPUS ATTENTION [DIR]
  local name=$1 gpus=$2 attention=$3 dir=${4:-$here} path=$PYTHONPATH
  [ "$dir" != "$here" ] && path="$dir:$PYTHONPATH"  # the older tree's longctx first (staged layout)
  (cd "$dir" && PYTHONPATH=$path timeout "$limit" python train.py --config "$config" \
    --data.stdlib_documents file --model.attention "$attention" --trainer.max_steps "$steps" \
    --trainer.devices "$gpus" --strategy.context_parallel_size "$gpus" \
    --output-dir "/tmp/runs/${name}_${gpus}gpu" --trainer.enable_progress_bar false $PLAN $EXTRA \
    > "$OUT/runs/${name}_${gpus}gpu.log" 2>&1)
  echo "${name} ${gpus} GPUs: rc=$?"
  cp "/tmp/runs/${name}_${gpus}gpu/metrics.csv" "$OUT/runs/${name}_${gpus}gpu_metrics.csv" 2>/dev/null
  grep -h "run plan\|documents:\|FlashAttention-4\|Error\|error" "$OUT/runs/${name}_${gpus}gpu.log" | head -6
}
EXTRA=${EXTRA:-}
# The plan of the committed table (scaleout_h200x4.json): full recompute, no pointwise fusion,
# as configs/llama3.2-1b-128k.yaml pinned then; PLAN="" takes today's GPU defaults instead.
PLAN=${PLAN---model.parallel.activation_checkpointing full --model.parallel.fuse_pointwise false}
for w in ${WORKLOADS:-docs dense}; do
  [ "$w" = docs ] && attention=document || attention=causal
  for g in ${GPUS:-1 2 4}; do run "${NAME:-$w}" "$g" "$attention"; done
  if [ -n "${BEFORE:-}" ]; then
    g=$(echo ${GPUS:-1 2 4} | awk '{print $NF}')
    run "${w}_before" "$g" "$attention" "$BEFORE"
  fi
done
python benchmarks/scaleout_table.py --runs "$OUT/runs" --gpu "${GPU_NAME:-gpu}" --out "$OUT/scaleout.json"
(cd "$OUT" && tar czf runs.tar.gz runs && rm -rf runs)
