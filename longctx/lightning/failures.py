"""A failed rank ends the job on every rank, in bounded time, naming it.

``RankFailures`` runs the strategy's ``longctx.watchdog.RankWatchdog`` for one fit: a rank
that raises tells the others at once (instead of leaving them blocked in their next
collective until the process-group timeout), a rank silent for ``failure_timeout`` seconds
is declared dead, and every rank exits naming it. An out-of-memory error also says what to
try first. At the end of a fit no rank stops watching (and exits, maybe taking rank 0's
store with it) while another is still working.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..watchdog import RankWatchdog


def out_of_memory_hint(data_parallel: str) -> str:
    """What to try first when a rank runs out of GPU memory under ``data_parallel``."""
    if data_parallel == "ddp":
        return "data_parallel='fsdp' (--data-parallel fsdp) shards weights, gradients and optimizer state"
    return ("activation_checkpointing (--model.parallel.activation_checkpointing full), a larger "
            "--context-parallel, or cpu_offload=True (--strategy.cpu_offload true)")


class RankFailures:
    """``failure_timeout``: seconds without a heartbeat before a rank counts as dead (None: no
    watchdog); ``on_failure(message)``: how this rank ends when another failed."""

    def __init__(self, failure_timeout: Optional[float], on_failure: Callable[[str], None]) -> None:
        self.failure_timeout = failure_timeout
        self._on_failure = on_failure
        self._watchdog: Optional[RankWatchdog] = None
        self._failed = False

    def start(self, rank: int, world_size: int) -> None:
        if self.failure_timeout is not None and world_size > 1:
            interval = min(1.0, self.failure_timeout / 4)
            self._watchdog = RankWatchdog(rank, world_size, timeout=self.failure_timeout, interval=interval,
                                          on_failure=self._on_failure).start()

    def failed(self, exception: BaseException, *, rank: int, data_parallel: str, tell_others: bool = True) -> None:
        """This rank raised ``exception``; ``tell_others=False`` where a stop by signal is under
        way (a peer that left then is no failure)."""
        self._failed = True
        if not tell_others:
            return
        if isinstance(exception, torch.OutOfMemoryError):
            print(f"[longctx] rank {rank}: out of GPU memory; try {out_of_memory_hint(data_parallel)}", flush=True)
        if self._watchdog is not None:
            self._watchdog.report_failure(exception)

    def stop(self) -> None:
        if self._watchdog is not None:
            if not self._failed and dist.is_initialized():
                dist.barrier()  # every rank finished its work before any stops watching
            self._watchdog.stop()
            self._watchdog = None
