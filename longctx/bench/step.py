"""The training step the benchmarks time by hand (benchmarks/train_throughput.py,
max_context.py, memory_validate.py), one copy: forward under bf16 autocast, backward of the
loss as the caller scales it, optimizer step; and the mean seconds of steps between device
syncs. Written out rather than run through Lightning's loop (``CausalLMModule.training_step``)
so that what is timed is the step alone: no logging, callbacks or data loading."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Optional

import torch


class LossModule(torch.nn.Module):
    """forward() = the GPT's ``loss()``, so DDP (which hooks forward) can wrap the training path."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, position_ids):
        return self.model.loss(input_ids, labels, position_ids)


def train_step(
    forward: Callable[[], tuple[torch.Tensor, Any]],
    optimizer: torch.optim.Optimizer,
    objective: Callable[[torch.Tensor, Any], torch.Tensor],
    *,
    autocast: Optional[str] = None,
    watch: Optional[ContextManager] = None,
    mark: Optional[Callable[[str], None]] = None,
) -> tuple[torch.Tensor, Any]:
    """One optimizer step: ``forward()`` -> ``(loss_sum, n)``, ``objective(loss_sum, n).backward()``,
    ``optimizer.step()``, gradients set to None. Returns ``(loss_sum, n)`` as forward gave them.

    Args:
        autocast: device type to run the forward under bf16 autocast on ("cuda"); None: none.
        watch: a context around the forward (outside the autocast), e.g. saved-tensor hooks.
        mark: called with "forward", "backward", "optimizer step" as each part ends (memory
            readings per part).
    """
    amp = torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with watch or contextlib.nullcontext(), amp:
        loss_sum, n = forward()
    if mark:
        mark("forward")
    objective(loss_sum, n).backward()
    if mark:
        mark("backward")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if mark:
        mark("optimizer step")
    return loss_sum, n


def mean_step_seconds(
    step: Callable[[], Any], steps: int, sync: Callable[[], None], start: Optional[Callable[[], None]] = None
) -> tuple[float, Any]:
    """``(mean seconds per call, the last call's result)`` of ``steps`` calls of ``step``,
    timed from a synced device (then ``start()``: reset peak counters, a barrier) to a synced one."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sync()
    if start:
        start()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step()
    sync()
    return (time.perf_counter() - t0) / steps, out
