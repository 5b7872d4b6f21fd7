"""A regular (non-editable) install, as the README's ``pip install ".[gguf]"`` makes it: the
wheel holds every subpackage (longctx.models and longctx.kernels come from the top-level
folders), and ``python train.py`` still runs from the checkout's root, where the checkout's
``longctx/`` comes first on the path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "longctx", "models", "kernels")
SUBPACKAGES = ("longctx", "longctx.models", "longctx.kernels", "longctx.data", "longctx.lightning", "longctx.bench")


def _run(cmd: list, cwd: Path, **env) -> subprocess.CompletedProcess:
    """``cmd`` without the caller's PYTHONPATH (a worktree's run sets one to its own longctx) or
    the distributed variables an earlier in-process fit may have left (its MASTER_PORT can be
    taken by then)."""
    drop = {"PYTHONPATH", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"}
    env = {**{k: v for k, v in os.environ.items() if k not in drop}, **env}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _files(python: Path, cwd: Path) -> dict:
    """Where each subpackage is imported from, seen from ``cwd``."""
    code = f"import importlib; print('\\n'.join(importlib.import_module(m).__file__ for m in {SUBPACKAGES!r}))"
    return dict(zip(SUBPACKAGES, _run([str(python), "-c", code], cwd).stdout.split()))


@pytest.fixture
def venv(tmp_path):
    """A fresh venv over the system's packages (torch and the other dependencies) without pip
    of its own: the system's pip and setuptools build and install the wheel."""
    folder = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(folder)], tmp_path)
    python = folder / "bin" / "python"
    check = "from setuptools.command.bdist_wheel import bdist_wheel; import torch, lightning, jsonargparse, pip"
    if subprocess.run([str(python), "-c", check], capture_output=True).returncode != 0:
        shutil.rmtree(folder)
        pytest.skip("the system's Python lacks the dependencies or setuptools>=70.1 (pip install -e '.[test]')")
    yield python
    shutil.rmtree(folder)


@pytest.mark.slow
def test_wheel_installs_every_subpackage_and_train_py_runs_from_the_checkout(venv, tmp_path):
    src, wheels = tmp_path / "src", tmp_path / "wheels"
    for name in SOURCES:  # a copy: building in place would leave build/ in the checkout
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    _run([str(venv), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), "."], src)
    shutil.rmtree(src)
    (wheel,) = wheels.glob("longctx-*.whl")
    # --force-reinstall: an editable install of the same version may be visible from the system.
    _run([str(venv), "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", str(wheel)], tmp_path)

    installed = _files(venv, tmp_path)
    prefix = str(venv.parent.parent)
    assert all(path.startswith(prefix) for path in installed.values()), installed

    # From the checkout's root its own longctx/ is imported; models/ and kernels/ beside it.
    checkout = _files(venv, REPO)
    assert all(Path(path).is_relative_to(REPO) for path in checkout.values()), checkout
    out = tmp_path / "run"
    # Small data (two stdlib packages, a 512-token vocabulary): the install is what is tested,
    # not the default corpus, whose tokenizer this fresh cache would train from scratch.
    small = ["--data", "stdlib:json,email", "--model.model.vocab_size", "512", "--seq-len", "64"]
    _run(
        [str(venv), "train.py", *small, "--max-steps", "1", "--output-dir", str(out)],
        REPO,
        LONGCTX_CACHE_DIR=str(tmp_path),
    )
    assert (out / "metrics.csv").is_file()
