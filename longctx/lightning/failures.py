"""A failed rank ends the job on every rank, in bounded time, naming it.

``RankFailures`` runs the strategy's ``longctx.watchdog.RankWatchdog`` for one fit: a rank
that raises tells the others at once (instead of leaving them blocked in their next
collective until the process-group timeout), a rank silent for ``failure_timeout`` seconds
is declared dead, a rank that leaves the others waiting in a collective for the
process-group timeout is declared stalled, and every rank exits naming it. An
out-of-memory error also says what to try first. At the end of a fit no rank stops
watching (and exits, maybe taking rank 0's store with it) while another is still working.
Each fit's watchdog keeps its keys apart from an earlier fit's over the same rendezvous
store (a ``validate`` after ``fit``, two fits in one script): its generation is this
process's count of watched fits, which every rank agrees on without exchanging anything,
since every rank runs the same fits; a shared counter in the store would not be (a rank
that starts late could read it before or after another rank bumped it).

Under NCCL a collective that times out raises nothing in Python: NCCL's own watchdog
thread tears the process down, after sleeping 4 x ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``
(15 s by default) for its flight-recorder dump, and names no one. ``nccl_env`` shortens
that sleep, where the user has not set it, so that this backstop (for a stall the
watchdog cannot see, e.g. one between point-to-point operations) lands within
``failure_timeout`` + 5 polls of the process-group timeout, after the watchdog's own
message (about 5 polls after it).
"""

from __future__ import annotations

import itertools
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..watchdog import RankWatchdog


def out_of_memory_hint(data_parallel: str) -> str:
    """What to try first when a rank runs out of GPU memory under ``data_parallel``."""
    if data_parallel == "ddp":
        return "data_parallel='fsdp' (--data-parallel fsdp) shards weights, gradients and optimizer state"
    return (
        "activation_checkpointing (--model.parallel.activation_checkpointing full), a larger "
        "--context-parallel, or cpu_offload=True (--strategy.cpu_offload true)"
    )


NCCL_DUMP_WAIT_ENV = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
NCCL_DUMP_WAIT_DEFAULT_MS = 15_000  # torch's default: NCCL tears a timed-out rank down 60 s after the timeout
_set_here: dict[str, str] = {}  # what nccl_env set in this process (a later fit may change it, a user may not)


def nccl_env(failure_timeout: Optional[float], backend: str) -> dict[str, str]:
    """Set NCCL's dump wait for the watchdog's ``failure_timeout`` before a ``backend``
    process group is created (see the module doc): only under NCCL with a watchdog, only
    where it shortens torch's default, never over a user's value. Returns what it set."""
    if backend != "nccl" or failure_timeout is None:
        return {}
    wait_ms = round(1000 * (failure_timeout + 5 * _interval(failure_timeout)) / 4)
    current = os.environ.get(NCCL_DUMP_WAIT_ENV)
    if wait_ms >= NCCL_DUMP_WAIT_DEFAULT_MS or current not in (None, _set_here.get(NCCL_DUMP_WAIT_ENV)):
        return {}
    os.environ[NCCL_DUMP_WAIT_ENV] = _set_here[NCCL_DUMP_WAIT_ENV] = str(wait_ms)
    return {NCCL_DUMP_WAIT_ENV: str(wait_ms)}


def _interval(failure_timeout: float) -> float:
    return min(1.0, failure_timeout / 4)


_watched_fits = itertools.count(1)  # this process's watchdog generations (see the module doc)


class RankFailures:
    """``failure_timeout``: seconds without a heartbeat before a rank counts as dead (None: no
    watchdog); ``on_failure(message)``: how this rank ends when another failed."""

    def __init__(self, failure_timeout: Optional[float], on_failure: Callable[[str], None]) -> None:
        self.failure_timeout = failure_timeout
        self._on_failure = on_failure
        self._watchdog: Optional[RankWatchdog] = None
        self._failed = False

    def before_process_group(self, backend: str) -> None:
        nccl_env(self.failure_timeout, backend)

    def start(self, rank: int, world_size: int, collective_timeout: Optional[float] = None) -> None:
        """Watch the ranks; ``collective_timeout`` (the process-group timeout, seconds) also
        catches a stalled rank (the default group must exist)."""
        if self.failure_timeout is not None and world_size > 1:
            self._watchdog = RankWatchdog(
                rank,
                world_size,
                timeout=self.failure_timeout,
                interval=_interval(self.failure_timeout),
                on_failure=self._on_failure,
                collective_timeout=collective_timeout,
                generation=next(_watched_fits),
            ).start()

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
