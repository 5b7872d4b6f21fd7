"""Run a function on P processes joined by a process group (gloo on CPUs; ``backend="nccl"``:
one GPU per process, ``cuda:rank``).

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in
``world_size`` processes with the default group initialised, and returns the list of per-rank
return values (which must be picklable). An exception in any rank fails the caller with that
rank's traceback; a rank that hangs past ``timeout`` fails it too, instead of hanging the test
session.

The processes are kept between calls (a session-wide pool, ``world_size`` <= ``KEEP``
of them): spawning one costs seconds (each imports torch, and the test module, often
Lightning), so a suite of many small group runs spent most of its time starting processes.
Each call still gets a fresh default group (its own port, destroyed afterwards, with every
group made from it), the environment as it was before the call, and a fresh random seed (as
a new process has); process ``i`` is always rank ``i``. Any failure or timeout ends every pooled
process (a rank may be left inside a collective), and the next call starts new ones.
``fresh=True`` runs a call in processes of its own that end with it (for tests of process
state: threads, signals, exit paths).
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Processes kept between calls; a call of more ranks starts the rest and ends them after it.
KEEP = 4


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_task(rank: int, task: tuple):
    """One call on this rank: (status, payload) with status "ok" or "error"."""
    world_size, port, fn, args, timeout, backend = task
    environ = dict(os.environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.seed()  # as a new process: a non-deterministic seed (what torch starts with)
    try:
        extra = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            extra["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout), **extra)
        return "ok", fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        return "error", traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def _pool_worker(rank: int, inbox, results):
    # Each process gets one thread: P processes share 2 cores in CI.
    torch.set_num_threads(1)
    while True:
        message = inbox.get()
        if message is None:
            return
        task_id, task = message
        results.put((task_id, rank, *_run_task(rank, task)))


def _fresh_worker(rank: int, task: tuple, results):
    torch.set_num_threads(1)
    results.put((0, rank, *_run_task(rank, task)))


class _Pool:
    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.results = None
        self.procs: list = []
        self.inboxes: list = []
        self.ids = itertools.count(1)

    def grow(self, n: int) -> None:
        if self.results is None:
            self.results = self.ctx.SimpleQueue()
        while len(self.procs) < n:
            inbox = self.ctx.SimpleQueue()
            proc = self.ctx.Process(target=_pool_worker, args=(len(self.procs), inbox, self.results), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.inboxes.append(inbox)

    def shrink(self, n: int) -> None:
        for inbox in self.inboxes[n:]:
            inbox.put(None)
        for proc in self.procs[n:]:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        del self.procs[n:], self.inboxes[n:]

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)
        self.procs, self.inboxes, self.results = [], [], None

    def run(self, world_size: int, task: tuple, timeout: float) -> dict:
        self.grow(world_size)
        task_id = next(self.ids)
        for inbox in self.inboxes[:world_size]:
            inbox.put((task_id, task))
        try:
            replies = _collect(self.results, self.procs[:world_size], timeout, task_id)
        except BaseException:  # interrupted (pytest-timeout, Ctrl-C): ranks may be mid-call
            self.close()
            raise
        if len(replies) < world_size or any(status != "ok" for status, _ in replies.values()):
            self.close()  # a rank may be stuck in a collective, or its state broken
        elif world_size > KEEP:
            self.shrink(KEEP)
        return replies


def _collect(results, procs: list, timeout: float, task_id: int) -> dict:
    """{rank: (status, payload)} of ``task_id``, until every rank answered, every process
    is gone, or the deadline passed."""
    replies: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout + 30
    while len(replies) < len(procs) and time.monotonic() < deadline:
        if results.empty():
            if not any(p.is_alive() for p in procs) and results.empty():
                break
            time.sleep(0.01)
            continue
        reply_id, rank, status, payload = results.get()
        if reply_id == task_id:
            replies[rank] = (status, payload)
    return replies


_POOL = _Pool()
atexit.register(_POOL.close)


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, backend: str = "gloo", fresh: bool = False
) -> list:
    task = (world_size, free_port(), fn, args, timeout, backend)
    if fresh or backend != "gloo":
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        procs = [ctx.Process(target=_fresh_worker, args=(r, task, results), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            replies = _collect(results, procs, timeout, 0)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    else:
        replies = _POOL.run(world_size, task, timeout)
    errors = [f"rank {r} failed:\n{payload}" for r, (status, payload) in sorted(replies.items()) if status != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    missing = [r for r in range(world_size) if r not in replies]
    if missing:
        raise AssertionError(f"ranks {missing} returned nothing (crashed or hung past {timeout}s)")
    return [replies[r][1] for r in range(world_size)]
