"""Fixtures shared by the train.py end-to-end tests of this folder: one corpus cache and one
short CP=2 run for the session (test_train_cli.py's outputs, resume and kill tests read the
run; test_run_defaults.py reads its config.yaml and run plan), each launch costing seconds of
imports per process."""

from __future__ import annotations

import subprocess
from pathlib import Path

# Lightning's log handler keeps the stderr it finds at import: imported here, outside any test's
# capture (a capturing test would close that stream, and later in-process runs log errors).
import lightning.pytorch  # noqa: F401
import pytest
from helpers.train_script import SMALL, launch_env, run_train


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory) -> dict:
    return launch_env(tmp_path_factory.mktemp("longctx-cache"))


@pytest.fixture(scope="session")
def full_run(tmp_path_factory, cache_env) -> tuple[Path, subprocess.CompletedProcess]:
    """``train.py SMALL``: 6 steps of the tiny preset, CP=2 over gloo, checkpoints at 3 and 6."""
    out = tmp_path_factory.mktemp("run-full")
    proc = run_train([*SMALL, "--output-dir", str(out)], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc
