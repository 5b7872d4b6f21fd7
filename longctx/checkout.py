"""``longctx.models`` and ``longctx.kernels`` when ``longctx`` is imported from a source checkout.

There they are the top-level folders ``models/`` and ``kernels/``, mapped into the package by
pyproject's package-dir only when it is installed. A script run from the checkout's root
(``python train.py``) imports the checkout's ``longctx/`` ahead of any installed copy, so after
a regular (non-editable) install nothing else would find them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FOLDERS = {f"longctx.{name}": HERE.parent / name for name in ("models", "kernels")}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        folder = FOLDERS.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


# An installed longctx holds both folders; a checkout's has them beside it.
IN_CHECKOUT = all(not (HERE / p.name).is_dir() and (p / "__init__.py").is_file() for p in FOLDERS.values())
if IN_CHECKOUT and not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, CheckoutFinder())
