"""What the GPUs can do, by name: the one table of peak dense bf16 FLOP/s behind every MFU
figure of the project (train.py's metrics, benchmarks/train_throughput.py, max_context.py)."""

from __future__ import annotations

from typing import Optional

import torch

# Dense bf16 tensor-core peaks (FLOP/s) by device-name substring; first match wins. The one
# table of the project: MFU here and in benchmarks/ (train_throughput.py, max_context.py).
PEAK_BF16_FLOPS = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
)


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """Peak dense bf16 FLOP/s of the GPU called ``device_name``, or None where unknown."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def peak_flops(device: torch.device) -> Optional[float]:
    """Peak dense bf16 FLOP/s of ``device``, or None where unknown (CPU, other GPUs)."""
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))
