"""Run a function on P processes joined by a process group (gloo on CPUs; ``backend="nccl"``:
one GPU per process, ``cuda:rank``).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, calls
``fn(rank, world_size, *args)`` in each with the default group initialised, and returns
the list of per-rank return values (which must be picklable). An exception in any rank
fails the caller with that rank's traceback; a rank that hangs past ``timeout`` fails it
too, instead of hanging the test session.
"""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, timeout: float, backend: str):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Each process gets one thread: P processes share 2 cores in CI.
    torch.set_num_threads(1)
    try:
        extra = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            extra["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout), **extra)
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, backend: str = "gloo") -> list:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, timeout, backend), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout + 30
    while len(outputs) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if results.empty():
            if not any(p.is_alive() for p in procs) and results.empty():
                break
            time.sleep(0.05)
            continue
        rank, status, payload = results.get()
        if status == "ok":
            outputs[rank] = payload
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    missing = [r for r in range(world_size) if r not in outputs]
    if missing:
        raise AssertionError(f"ranks {missing} returned nothing (crashed or hung past {timeout}s)")
    return [outputs[r] for r in range(world_size)]
