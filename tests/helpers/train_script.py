"""train.py loaded as a module (it is a script, not part of the package), for tests that
call its functions in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_train(name: str):
    """A fresh module of train.py registered as ``name``."""
    spec = importlib.util.spec_from_file_location(name, REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
