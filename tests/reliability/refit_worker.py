"""One rank of a 2-rank gloo job that runs two watched fits in a row over one rendezvous
store, as a script calling Trainer.fit twice (or fit, then validate) does through the strategy.

Run: python refit_worker.py RANK PORT
Fit 1: rank 1 reports a failure, which both ranks' watchdogs see; then both end the fit
cleanly (fit 1's done keys are set). Fit 2: both ranks stay up for over 5 polls (fit 1's
failure must not end it), then rank 1 SIGKILLs itself: rank 0's watchdog must still be
watching it (fit 1's done key must not hide it) and end rank 0, naming rank 1.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from longctx.lightning.failures import RankFailures
from longctx.watchdog import hard_exit

rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=10))
FAILURE_TIMEOUT = 6.0  # polls of 1 s; room for a busy machine, where a live rank may not beat for seconds

seen: list = []
fit1 = RankFailures(FAILURE_TIMEOUT, on_failure=seen.append)
fit1.start(rank, 2)
dist.barrier()
if rank == 1:
    fit1._watchdog.report_failure(RuntimeError("injected failure in fit 1"))
deadline = time.monotonic() + 60
while not seen and time.monotonic() < deadline:
    time.sleep(0.1)
print(f"fit 1 ended: {seen}", file=sys.stderr, flush=True)
fit1.stop()

fit2 = RankFailures(FAILURE_TIMEOUT, on_failure=hard_exit)
fit2.start(rank, 2)
dist.barrier()
time.sleep(6.0)
print("fit 2 still running", file=sys.stderr, flush=True)
dist.barrier()
if rank == 1:
    print(f"failing at {time.time()}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)  # rank 0: only its watchdog can end it now
print("finished")
