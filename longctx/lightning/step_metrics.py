"""The figures ``CausalLMModule`` logs per optimizer step beside the loss: ``train_ppl``, ``lr``,
``tokens``, ``tokens_per_s`` (the wall rate, from one optimizer step to the next), ``mfu`` (GPU;
against the dense bf16 peak, FP8 runs too), ``step_s`` (the step's forward and backward),
``outside_s`` (the rest of the wall time between steps) and the fullest rank's peak memory.
``CausalLMModule`` adds ``startup_s`` to the first step's (``startup.StartupClock``)."""

from __future__ import annotations

import resource
import time
from typing import Any, Optional

import torch

from longctx.hardware import peak_flops
from longctx.models.config import GPTConfig


class StepMetrics:
    """Counts a step's tokens and visible (query, key) pairs over its micro-batches and times it;
    ``finish`` turns them into the step's metrics and starts the next step's count."""

    def __init__(self) -> None:
        self.tokens = 0
        self.pairs = 0.0  # visible (query, key) pairs of the step's tokens, for MFU
        self.last_step_end: Optional[float] = None
        self.step_start: Optional[float] = None  # the step's first micro-batch began (step_s)
        self.validation_start: Optional[float] = None

    @property
    def first_step(self) -> bool:
        return self.last_step_end is None

    def micro_batch_started(self) -> None:
        if self.step_start is None:
            self.step_start = time.perf_counter()

    def count(self, input_ids: torch.Tensor, document_plan: Any, *, world_size: int, cp: int) -> None:
        """One micro-batch of this rank's shard ``input_ids`` (its ``DocumentPlan`` or None)."""
        # Every rank holds B x S/cp tokens, so the world holds (tokens here) x world in total.
        self.tokens += input_ids.numel() * world_size
        # Visible pairs: the plan's (every rank of this CP group), scaled to the data-parallel
        # replicas as the tokens are; without documents those of causal attention.
        replicas = world_size // cp
        rows, length = input_ids.shape[0], input_ids.shape[1] * cp
        pairs = float(document_plan.pairs.sum()) if document_plan is not None else rows * length * length / 2
        self.pairs += pairs * replicas

    def finish(
        self,
        mean: torch.Tensor,
        *,
        lr: float,
        device: torch.device,
        config: GPTConfig,
        seq_len: Optional[int],
        world_size: int,
    ) -> dict[str, torch.Tensor]:
        """The step's metrics (``mean``: its global token-mean loss), the same on every rank (the
        peaks are all-reduced here)."""
        now = time.perf_counter()
        metrics = {
            "train_ppl": torch.exp(mean.clamp(max=50.0)),
            "lr": torch.tensor(lr),
            "tokens": torch.tensor(float(self.tokens)),
        }
        if self.last_step_end is not None:
            tps = self.tokens / max(now - self.last_step_end, 1e-9)
            metrics["tokens_per_s"] = torch.tensor(tps)
            # The dense bf16 peak, FP8 runs too: their MFU stays comparable with bf16 runs (FP8
            # tensor cores peak twice as high; this figure says how much faster the step is).
            peak = peak_flops(device)
            if peak is not None and seq_len:
                keys = self.pairs / self.tokens if self.tokens else None
                flops = config.flops_per_token(seq_len, keys_per_token=keys) * tps
                metrics["mfu"] = torch.tensor(flops / (peak * world_size))
        if self.step_start is not None:
            metrics["step_s"] = torch.tensor(now - self.step_start)
            if self.last_step_end is not None:
                # The wall time of the step that forward and backward do not account for: data,
                # host work and waits between steps, the previous optimizer step, logging.
                metrics["outside_s"] = torch.tensor(max(self.step_start - self.last_step_end, 0.0))
            self.step_start = None
        if device.type == "cuda":
            peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)), device=device)
        else:  # ru_maxrss is KiB on Linux: the process's resident-set high-water mark
            peak = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)  # the fullest rank's
        metrics["peak_mem_gib" if device.type == "cuda" else "peak_rss_gib"] = peak / 2**30
        self.tokens = 0
        self.pairs = 0.0
        self.last_step_end = now
        return metrics

    def validation_started(self) -> None:
        self.validation_start = time.perf_counter()

    def validation_ended(self) -> None:
        if self.last_step_end is not None and self.validation_start is not None:
            # Validation time is not training time: keep it out of the next tokens_per_s.
            self.last_step_end += time.perf_counter() - self.validation_start
