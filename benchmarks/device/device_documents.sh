#!/usr/bin/env bash
# Packed documents under CP on a 2-GPU machine, one call (after fa4_carry.sh's first half):
#   carry [".carry/fa4-2", ".carry/wheels"]:  bash benchmarks/device/device_documents.sh
# GPU tests of the document path (the no-host-sync step, the row kernels, the NCCL exchange),
# then benchmarks/document_attention.py part B at 131,072 tokens (five mixes, one-GPU
# baselines and a bf16-vs-float64 check first), then the PyTorch-CP + flex_attention peer on
# the same mixes (PEER_BALANCERS, default ptrr: torchtitan's choice for flex), and with
# DOCS_512K=1 part B at 524,288 tokens (long-tailed, mean 16K). JSON and logs under $OUT.
set -u
source benchmarks/device/device_env.sh || exit 3  # REQUIRE_FA4=1 without FlashAttention-4, or longctx not importable
nvidia-smi -L
export PYTHONUNBUFFERED=1
mixes=mean4k,mean16k,longtail,mean1k,docs256
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/model/test_document_gpu.py tests/kernels/test_rows.py \
  tests/ring/test_nccl.py 2>&1 | tail -5 | tee "$OUT/document_gpu_tests.log"
timeout 300 torchrun --nproc-per-node=2 benchmarks/document_attention.py --part ring --check \
  --mixes "$mixes" --out "$OUT" --tag _plan 2>&1 | grep "^\[ring\|^\[check\|^\[one" | cut -c1-300
timeout 200 torchrun --nproc-per-node=2 benchmarks/document_peer_torch_cp.py --check --mixes "$mixes" \
  --balancers "${PEER_BALANCERS:-ptrr}" --out "$OUT" 2>&1 | grep "^\[cp\|^\[one\|^\[check" | cut -c1-300
if [ "${DOCS_512K:-0}" = 1 ]; then
  timeout 200 torchrun --nproc-per-node=2 benchmarks/document_attention.py --part ring --seq 524288 \
    --mixes longtail,mean16k --out "$OUT" --tag _plan_512k 2>&1 | grep "^\[ring" | cut -c1-300
fi
