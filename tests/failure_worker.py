"""One rank of a 3-rank gloo job in which rank 1 fails inside ring attention.

Run: python failure_worker.py RANK WORLD PORT MODE   (MODE: raise | kill)
The process group timeout is 10 minutes on purpose: only the watchdog can end the job fast.
"""
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))

import longctx.ring as ring  # noqa: E402
from longctx.watchdog import RankWatchdog  # noqa: E402

watchdog = RankWatchdog(rank, world, timeout=3.0, interval=0.25).start()
real_forward = ring.attention_forward
calls = [0]


def failing_forward(*args, **kwargs):
    calls[0] += 1
    if rank == 1 and calls[0] == 2:  # mid-ring: after the first hop was posted
        if mode == "raise":
            raise RuntimeError("injected failure inside ring attention")
        os.kill(os.getpid(), signal.SIGKILL)
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
