"""backend="auto": pick the attention kernel per device and shape from measurements.

The table below is data, not logic: rows are scanned top to bottom and the first row
whose conditions match gives an ordered preference list; the first backend in it that
is available on the device wins. Refresh it from benchmarks/results/attention_*.json
(written by benchmarks/attention.py) whenever the kernels or the GPU change.

Current contents: measured on one H200 (benchmarks/results/attention_nvidia_h200.json,
torch 2.11 / triton 3.6, bf16, B=1, H=16, fwd+bwd TFLOP/s):
  S >= 4K, D in {64, 128}: cudnn 442-589 > triton 304-436 > flash 191-327 (both causal
    and full); triton is 1.3-1.5x flash, 0.71-0.98x cudnn.
  S = 1K: every kernel is launch/overhead bound (< 250 TFLOP/s); the flash wrapper was
    fastest (D=64 and 128, causal and full).
Other head dims / fp32 were not measured: flash covers D <= 256 in bf16/fp16, triton the
rest. Note for the ring: vendor kernels return bf16/fp16 partials (out_dtype=fp32 is a
cast), triton computes fp32 partials exactly.
Calls with document ids do not use this table: only triton (and the reference) take the
mask, see resolve_backend in __init__.py.
"""
from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)

# (dtypes, head_dims or None = any, min_seq_len, causal or None = either) -> preference.
# min_seq_len applies to max(seq_len_q, seq_len_k): lets a row say e.g. "triton beats
# cudnn from 4K tokens on" once measured.
TABLE = [
    (_HALF, (64, 128), 4096, None, ("cudnn", "triton", "flash")),
    (_HALF, (64, 128), 0, None, ("flash", "cudnn", "triton")),
    (_HALF, None, 0, None, ("flash", "triton")),
    ((torch.float32,), None, 0, None, ("triton",)),
]
# Nothing matched, or nothing in the row is available: the reference always works.
FALLBACK = "torch"


def _available(name: str, device: torch.device) -> bool:
    try:
        if name == "triton":
            from . import triton_attention

            return triton_attention.is_available(device)
        if name in ("cudnn", "flash"):
            from . import vendor

            return vendor.is_available(device, name)
    except ImportError:
        return False
    return name == "torch"


def choose_backend(device, dtype, head_dim, seq_len_q, seq_len_k, causal) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return "torch"
    seq = max(int(seq_len_q), int(seq_len_k))
    for dtypes, head_dims, min_seq, row_causal, preference in TABLE:
        if dtype not in dtypes or (head_dims is not None and head_dim not in head_dims):
            continue
        if seq < min_seq or (row_causal is not None and bool(causal) != row_causal):
            continue
        for name in preference:
            if _available(name, device):
                return name
    return FALLBACK
