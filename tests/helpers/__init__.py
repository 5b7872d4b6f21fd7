"""Code the test folders share, importable as ``helpers`` (pyproject's pytest ``pythonpath``)."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def pythonpath(*folders: str | Path) -> str:
    """PYTHONPATH for a subprocess that imports test modules (of ``folders``) or ``helpers``,
    keeping the caller's entries (a worktree run imports its own longctx, not the installed one)."""
    return os.pathsep.join(str(p) for p in (*folders, TESTS, os.environ.get("PYTHONPATH")) if p)
