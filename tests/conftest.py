"""Markers by what a test needs, so one selection runs every test that needs the device:

    python -m pytest -m gpu tests          # every test that needs CUDA (1 GPU or more)
    python -m pytest -m multigpu tests     # those that need 2+ GPUs / NCCL (a subset of gpu)
    bash benchmarks/device/device_suite.sh tests  # the gpu selection in one device call (log in $OUT)

A test needs CUDA when it carries the ``gpu`` marker, or a ``skipif`` whose reason names
CUDA, a GPU or NCCL (how this suite skips device tests on CPU: ``reason="needs CUDA"``), or
its name says gpu/cuda/nccl; it needs several GPUs when that reason or name says 2 (or more,
several) GPUs, multi-GPU or NCCL. Nothing is skipped or added here: a CPU machine still skips them
by their own conditions.
"""

from __future__ import annotations

import re

import pytest

CUDA = re.compile(r"\b(cuda|gpus?|nccl|sm\d+)\b", re.I)
MULTI = re.compile(
    r"\b(multi-?gpu|nccl)\b|\b(2|two|[2-9]\+?|several|multiple)\s*(x\s*)?(cuda\s+)?(gpus|devices)\b", re.I
)
NAME = re.compile(r"(^|_)(gpu|cuda|nccl)(_|$)")
MULTI_NAME = re.compile(r"(^|_)(multi_?gpu|gpus|2gpu|two_gpus|nccl)(_|$)")


def _reasons(item) -> list[str]:
    reasons = []
    for mark in item.iter_markers("skipif"):
        reason = mark.kwargs.get("reason")
        if reason is None and len(mark.args) > 1:
            reason = mark.args[1]
        reasons += [str(reason)] if reason else []
    return reasons


def needs(item) -> tuple[bool, bool]:
    """(needs CUDA, needs several GPUs) of a collected test."""
    name = getattr(item, "originalname", None) or item.name
    reasons = _reasons(item)
    multi = (
        item.get_closest_marker("multigpu") is not None
        or any(MULTI.search(r) for r in reasons)
        or bool(MULTI_NAME.search(name))
    )
    gpu = (
        multi
        or item.get_closest_marker("gpu") is not None
        or any(CUDA.search(r) for r in reasons)
        or bool(NAME.search(name))
    )
    return gpu, multi


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        gpu, multi = needs(item)
        if gpu and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if multi and item.get_closest_marker("multigpu") is None:
            item.add_marker(pytest.mark.multigpu)
