#!/usr/bin/env bash
# Attention-level scaling (issue 40), one call on a 4-GPU machine after fa4_carry.sh's stash
# call (carry .carry/fa4-2 and .carry/wheels): benchmarks/document_attention.py part B (the
# five mixes at 131,072 tokens, the document ring with both exchanges against the best one-GPU
# path timed in the same job) on 4 and on 2 GPUs, then the peer (PyTorch CP + flex_attention,
# benchmarks/document_peer_torch_cp.py) on 4. JSON under $OUT (TAG names the device), logs
# in one tarball. LAYERS=L: L attention layers chained in one backward, ms per layer (as in a
# model; the default, one layer a backward, pays the autograd engine's per-backward cost per layer).
set -u
source benchmarks/device/device_env.sh || exit 3
tag=${TAG:-_gpu}
mixes=mean4k,mean16k,longtail,mean1k,docs256
mkdir -p "$OUT/logs"
for n in ${WORLDS:-4 2}; do
  devices=$(seq -s, 0 $((n - 1)))
  CUDA_VISIBLE_DEVICES=$devices timeout "${LIMIT:-220}" torchrun --standalone --nproc-per-node "$n" \
    benchmarks/document_attention.py --part ring --mixes "$mixes" --exchange both --providers fa4-plan \
    --check --out "$OUT" --tag "$tag" ${LAYERS:+--layers $LAYERS} > "$OUT/logs/attention_ws$n.log" 2>&1
  echo "attention ws$n rc=$?"; grep -h "speedup\|FAIL\|Error" "$OUT/logs/attention_ws$n.log" | cut -c1-300 | tail -8
done
if [ "${PEER:-1}" = 1 ]; then  # torchtitan's load balancer for flex (ptrr) only
  timeout "${PEER_LIMIT:-200}" torchrun --standalone --nproc-per-node 4 benchmarks/document_peer_torch_cp.py \
    --mixes "$mixes" --balancers ptrr --out "$OUT" --tag "$tag" > "$OUT/logs/peer_ws4.log" 2>&1
  echo "peer ws4 rc=$?"; tail -3 "$OUT/logs/peer_ws4.log" | cut -c1-300
fi
(cd "$OUT" && tar czf logs.tar.gz logs && rm -rf logs)
