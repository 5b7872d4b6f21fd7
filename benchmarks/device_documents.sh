#!/usr/bin/env bash
# Packed documents under CP on a 2-GPU machine, one call (after fa4_carry.sh's first half):
#   carry [".carry/fa4-2", ".carry/wheels"]:  bash benchmarks/device_documents.sh
# GPU tests of the document path (the no-host-sync step), then benchmarks/document_attention.py
# part B at 131,072 tokens (five mixes, one-GPU baselines and a bf16-vs-float64 check first)
# and at 524,288 tokens (long-tailed, mean 16K). JSON and logs under $OUT.
set -u
source benchmarks/device_env.sh
nvidia-smi -L
python -m pytest -q -x -p no:cacheprovider tests/test_document_gpu.py 2>&1 | tail -15 | tee "$OUT/document_gpu_tests.log"
torchrun --nproc-per-node=2 benchmarks/document_attention.py --part ring --check \
  --mixes mean4k,mean16k,longtail,mean1k,docs256 --out "$OUT" --tag _plan 2>&1 | grep -v Warning | tail -40
torchrun --nproc-per-node=2 benchmarks/document_attention.py --part ring --seq 524288 \
  --mixes longtail,mean16k --out "$OUT" --tag _plan_512k 2>&1 | grep -v Warning | tail -20
