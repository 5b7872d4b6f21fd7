"""A rank that raises or is SIGKILLed inside ring attention ends the whole job quickly,
and every surviving rank's message names the failed rank."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dist_harness import free_port

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_rank_failure_ends_every_rank(mode):
    world, port = 3, str(free_port())
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, "failure_worker.py"), str(r), str(world), port, mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=90))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.monotonic() - start
    # process start + torch import + 3 s heartbeat timeout: far under the 10-minute PG timeout
    assert elapsed < 60, f"job took {elapsed:.0f}s to end"
    for r, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode != 0, f"rank {r} exited 0:\n{err[-2000:]}"
        assert "finished" not in out
        if r != 1:
            assert "rank 1" in err, f"rank {r} did not name the failed rank:\n{err[-3000:]}"
    if mode == "raise":
        assert "injected failure" in outputs[1][1]
    else:
        assert procs[1].returncode == -9
