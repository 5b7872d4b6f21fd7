"""What the strategy's failure handling sets up before the process group exists: NCCL's wait
before it tears down a rank whose collective timed out is shortened to fit the watchdog's
failure timeout, only under NCCL, only below torch's default, never over a user's value; and
each fit's watchdog watches afresh, untouched by an earlier fit's keys over the same store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from helpers.dist_harness import free_port

from longctx.lightning import failures
from longctx.lightning.failures import NCCL_DUMP_WAIT_ENV, RankFailures, nccl_env

HERE = os.path.dirname(__file__)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(NCCL_DUMP_WAIT_ENV, raising=False)
    monkeypatch.setattr(failures, "_set_here", {})


def test_dump_wait_fits_the_failure_timeout(clean_env, monkeypatch):
    # failure timeout 10 s, polls of 1 s: NCCL tears down 10 + 5 polls = 15 s after the timeout
    assert nccl_env(10.0, "nccl") == {NCCL_DUMP_WAIT_ENV: "3750"}
    assert os.environ[NCCL_DUMP_WAIT_ENV] == "3750"
    # A later fit in the same process may change what this module set ...
    RankFailures(4.0, on_failure=print).before_process_group("nccl")
    assert os.environ[NCCL_DUMP_WAIT_ENV] == "2250"
    # ... but never a user's value.
    monkeypatch.setenv(NCCL_DUMP_WAIT_ENV, "60000")
    assert nccl_env(10.0, "nccl") == {}
    assert os.environ[NCCL_DUMP_WAIT_ENV] == "60000"


@pytest.mark.parametrize("failure_timeout, backend", [(10.0, "gloo"), (None, "nccl"), (120.0, "nccl")])
def test_dump_wait_is_left_alone(clean_env, failure_timeout, backend):
    """gloo (no NCCL watchdog), no watchdog of ours, or a failure timeout long enough that
    torch's default (4 x 15 s) already ends the job sooner."""
    assert nccl_env(failure_timeout, backend) == {}
    assert NCCL_DUMP_WAIT_ENV not in os.environ


@pytest.mark.slow
def test_a_second_fit_is_watched_afresh():
    """Two watched fits in a row in the same processes over one rendezvous store: fit 1's
    failure does not end fit 2, and fit 2 still sees its peer die (tests/reliability/refit_worker.py)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "refit_worker.py"), str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    (out0, err0), (_, err1) = outputs
    for err in (err0, err1):
        assert "fit 1 ended: ['rank " in err and "injected failure in fit 1" in err, err[-3000:]
        assert "fit 2 still running" in err, err[-3000:]
    assert procs[1].returncode == -9, err1[-3000:]
    assert procs[0].returncode == 75 and "finished" not in out0, err0[-3000:]
    assert re.search(r"\[longctx watchdog\] rank 0 stopping: rank 1 stopped responding", err0), err0[-3000:]
    elapsed = ended - float(re.search(r"failing at ([0-9.]+)", err1).group(1))
    assert elapsed < 60, f"rank 0 took {elapsed:.0f}s to end after rank 1 died (failure timeout 6 s)"
