#!/usr/bin/env bash
# The long-context fine-tuning recipe (issue 42) in one call: a small GPT trained from scratch at a
# short context on the project's default corpus, then extended (RoPE position interpolation) and
# fine-tuned on its long documents with context parallelism from that checkpoint (--init-from), with
# evaluate.py before and after (passkey lengths x depths, loss by position), both over CP=2.
#
#   bash benchmarks/device/device_recipe.sh           # 2 GPUs, ~4 min (carry .carry/wheels, .carry/tok)
#   bash benchmarks/device/device_recipe.sh --tiny    # CPU toy scale (TINY=1 alike): tests/bench/test_recipe.py
#   STAGES=short STAGE_LIMIT=540 bash ...; then STAGES=long ..., then STAGES=eval ...  # a call each, one warm machine
#
# GPU: gpt-125m (vocab 8192) at 4,096 tokens, dp 2, SHORT_STEPS; then 32,768 tokens, linear RoPE
# scaling x8, CP=2, LONG_STEPS, evaluated during the fine-tune every EVAL_EVERY steps (train.py
# --eval-every). CPU toy: the tiny preset at 64 -> 256 tokens on two stdlib packages, a few steps.
# Into $OUT (at most 8 files come back from a device call): recipe_short.json and recipe_long.json
# (evaluate.py's records: the passkey table, the loss buckets, the model), their _passkey.png
# heatmaps and _loss_by_position.png plots, and recipe_runs.tar.gz (each run's log, config.yaml,
# metrics.csv, loss.png and the fine-tune's eval/ JSONs). Runs live under $WORK (default /tmp/recipe).
set -u -o pipefail
[ "${1:-}" = --tiny ] && TINY=1
TINY=${TINY:-0}
OUT=${OUT:-benchmarks/results}
WORK=${WORK:-/tmp/recipe}
PY=${PYTHON:-python}
mkdir -p "$OUT" "$WORK/logs"
OUT=$(cd "$OUT" && pwd) WORK=$(cd "$WORK" && pwd)
if [ "$TINY" = 1 ]; then
  MODEL=(--preset tiny --model.model.vocab_size 512)
  DATA=(--data stdlib:json,email)
  SHORT=(--seq-len 64 --model.model.max_seq_len 64 --batch-size 2 --context-parallel 1 --devices 1 --accelerator cpu)
  LONG=(--seq-len 256 --model.model.max_seq_len 256 --batch-size 1 --context-parallel 2 --devices 2 --accelerator cpu)
  SHORT_STEPS=${SHORT_STEPS:-4} LONG_STEPS=${LONG_STEPS:-2} EVAL_EVERY=${EVAL_EVERY:-2} FACTOR=4
  EVAL=(--lengths 128,256 --depths 0,0.5,1 --trials 1 --data stdlib:json --max-sequences 2 --base-context 64)
  EVAL_DURING=(--eval.trials 1 --eval.max_sequences 1)
  NPROC=1 LIMIT=300
else
  source benchmarks/device/device_env.sh || exit 3
  # Dense causal attention over the packed windows (the corpus' documents are mostly longer than a
  # window): the document kernels' FA4 variants take minutes to compile on a fresh machine.
  MODEL=(--preset gpt-125m --model.model.vocab_size 8192 --model.parallel.fuse_pointwise false --model.attention causal)
  DATA=()  # the default corpus: the standard library grouped per package (documents of 100K+ tokens)
  SHORT=(--seq-len 4096 --model.model.max_seq_len 4096 --batch-size 4 --context-parallel 1 --devices 2 --accelerator gpu
    --lr 1e-3)
  LONG=(--seq-len 32768 --model.model.max_seq_len 32768 --batch-size 1 --context-parallel 2 --devices 2 --accelerator gpu
    --lr 3e-4)
  SHORT_STEPS=${SHORT_STEPS:-300} LONG_STEPS=${LONG_STEPS:-100} EVAL_EVERY=${EVAL_EVERY:-50} FACTOR=8
  EVAL=(--lengths 1K,2K,4K,8K,16K,32K --depths 0,0.25,0.5,0.75,1 --trials 4 --data auto --max-sequences 8 --base-context 4K)
  EVAL_DURING=()
  NPROC=2 LIMIT=${STAGE_LIMIT:-240}
fi
# STAGES: a subset of "short long eval" (e.g. training in one device call, evaluation in the next on
# the same warm machine: the runs stay under $WORK).
STAGES=" ${STAGES:-short long eval} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
COMMON=(--val-every 0 --trainer.enable_progress_bar false)
start=$(date +%s)
stage() {  # stage NAME COMMAND...: its output in $WORK/logs/NAME.log, the tail and the time printed
  local name=$1 t=$(date +%s)
  shift
  timeout "$LIMIT" "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  grep -v "Warning\|warn(" "$WORK/logs/$name.log" | tail -12
  echo "[recipe] $name: rc $rc in $(( $(date +%s) - t )) s"
  return $rc
}
# 1. The short-context model, from scratch.
if want short; then
  rm -rf "$WORK/short"
  stage short "$PY" train.py "${MODEL[@]}" "${DATA[@]}" "${SHORT[@]}" "${COMMON[@]}" --max-steps "$SHORT_STEPS" \
    --warmup-steps $(( SHORT_STEPS / 10 )) --checkpoint-every "$SHORT_STEPS" --output-dir "$WORK/short" || exit 1
fi
# 2. Extended: its weights and tokenizer, RoPE positions divided by FACTOR, the long length over CP=2,
#    evaluated as it trains.
if want long; then
  rm -rf "$WORK/long"
  stage long "$PY" train.py "${MODEL[@]}" "${DATA[@]}" "${LONG[@]}" "${COMMON[@]}" --init-from "$WORK/short" \
    --model.model.rope_scaling "{type: linear, factor: $FACTOR}" --max-steps "$LONG_STEPS" \
    --warmup-steps $(( LONG_STEPS / 10 )) --checkpoint-every "$LONG_STEPS" --eval-every "$EVAL_EVERY" \
    "${EVAL_DURING[@]}" --output-dir "$WORK/long" || exit 1
fi
# 3. Before and after: the same evaluation of both checkpoints (each run's own RoPE), over NPROC ranks
#    (one CP group; one process needs no launcher).
want eval || exit 0
launch=("$PY")
[ "$NPROC" -gt 1 ] && launch=("$PY" -m torch.distributed.run --nproc-per-node "$NPROC")
for name in short long; do
  stage "eval_$name" "${launch[@]}" evaluate.py --checkpoint "$WORK/$name" "${EVAL[@]}" --out "$OUT" \
    --tag "recipe_$name" || exit 1
done
for name in short long; do
  for f in config.yaml metrics.csv loss.png; do cp "$WORK/$name/$f" "$WORK/logs/${name}_$f"; done
done
rm -rf "$WORK/logs/long_eval" && cp -r "$WORK/long/eval" "$WORK/logs/long_eval"
tar czf "$OUT/recipe_runs.tar.gz" -C "$WORK" logs
echo "[recipe] done in $(( $(date +%s) - start )) s: $(cd "$OUT" && ls recipe_* | tr '\n' ' ')"
