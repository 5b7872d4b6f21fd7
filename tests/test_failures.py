"""What the strategy's failure handling sets up before the process group exists: NCCL's wait
before it tears down a rank whose collective timed out is shortened to fit the watchdog's
failure timeout, only under NCCL, only below torch's default, never over a user's value."""

from __future__ import annotations

import os

import pytest

from longctx.lightning import failures
from longctx.lightning.failures import NCCL_DUMP_WAIT_ENV, RankFailures, nccl_env


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
