"""One rank of a gloo job (3 ranks in most tests) in which one rank fails inside ring attention.

Run: python failure_worker.py RANK WORLD PORT MODE [FAILING_RANK]
MODE: raise | kill (SIGKILL) | stop (SIGSTOP: the process freezes) | stall (sleeps 10 minutes
in Python, alive: the watchdog's collective timeout is 6 s); FAILING_RANK default 1.
Rank 0 hosts the rendezvous store (a plain launch, no torchrun agent), so a failing rank 0
takes the store down with it.
The process group timeout is 10 minutes on purpose: only the watchdog can end the job fast
(a stalled peer leaves the others blocked in gloo's C++ wait, as NCCL leaves them in CUDA).
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import longctx.ring as ring
from longctx.watchdog import RankWatchdog

rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
failing_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 1
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
# Imports come first: a rank still importing when its watcher starts the clock would
# look dead after the short timeout below on a busy machine.
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
# Margins for a busy machine (the tests check who is named): a live rank or the store may go
# unanswered for seconds there; rank 0, which hosts the store, waits after a failure until
# every rank has read it (at most 10 polls, 10 s).
TIMEOUT, INTERVAL, COLLECTIVE_TIMEOUT = 10.0, 1.0, 6.0
watchdog = RankWatchdog(
    rank, world, timeout=TIMEOUT, interval=INTERVAL, collective_timeout=COLLECTIVE_TIMEOUT if mode == "stall" else None
).start()
real_forward = ring.attention_forward
calls = [0]


def failing_forward(*args, **kwargs):
    calls[0] += 1
    if rank == failing_rank and calls[0] == 2:  # mid-ring: after the first hop was posted
        print(f"failing at {time.time()}", file=sys.stderr, flush=True)
        if mode == "raise":
            raise RuntimeError("injected failure inside ring attention")
        if mode == "stall":
            time.sleep(600)
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    return real_forward(*args, **kwargs)


ring.attention_forward = failing_forward
q = torch.randn(1, 8, 2, 4, requires_grad=True)
try:
    for _ in range(3):
        ring.ring_attention(q, q, q, group=dist.group.WORLD).sum().backward()
except BaseException as exc:
    watchdog.report_failure(exc)
    raise
watchdog.stop()
print("finished")
