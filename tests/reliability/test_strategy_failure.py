"""Under the strategy, a rank that raises ends the whole Lightning job fast, naming itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from helpers.train_script import launch_env

HERE = os.path.dirname(__file__)


@pytest.mark.slow
def test_raising_rank_ends_the_job_and_is_named():
    env = launch_env()
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "strategy_failure_script.py")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=HERE,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "finished" not in proc.stdout
    # The second process's stderr is inherited, so both ranks' messages are here. Rank 0
    # either is stopped by its watchdog thread ("rank 0 stopping: ...") or first hits the
    # closed connection and reports the job's first failure ("rank 0: first failure ...");
    # either way its message names rank 1 and the cause.
    named = re.search(
        r"\[longctx watchdog\] rank 0(:| stopping:).*rank 1 failed: RuntimeError: "
        r"injected failure in training_step",
        proc.stderr,
    )
    assert named, proc.stderr[-4000:]
    assert elapsed < 120, f"the job took {elapsed:.0f}s to end"
