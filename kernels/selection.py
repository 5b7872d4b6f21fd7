"""backend="auto": pick the attention kernel per device and shape from measurements.

The preferences are data: kernels/selection_table.py, written by
benchmarks/write_selection.py from a benchmarks/fa4_blocks.py run (re-run both whenever the
kernels or the GPU change; never edit the table by hand). Rows are scanned top to bottom;
the first row whose conditions match gives an ordered preference list, and the first backend
in it that can run the call (device, installed package, head dim) wins.

Calls with document ids do not use this table: see resolve_backend in __init__.py.
"""

from __future__ import annotations

import torch

from .selection_table import TABLE

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
        if name == "fa4":
            from . import fa4

            return fa4.is_available(device)
    except ImportError:
        return False
    return name == "torch"


def _takes_shape(name: str, device, dtype, head_dim) -> bool:
    if name != "fa4":
        return True
    from . import fa4

    return fa4.unsupported_shape(device, dtype, head_dim) is None


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
            if _available(name, device) and _takes_shape(name, device, dtype, head_dim):
                return name
    return FALLBACK
