"""The embedded default corpus: the Python standard library, as repository-level documents.

Zero download and present on every machine with Python: each top-level package of the
standard library (``asyncio``, ``email``, ``json``, ...) with all its subpackages
becomes one document, its ``.py`` files concatenated in path order, each preceded by a
``# file: <path>`` header line, the way repository-level code corpora are built. The
modules directly in the stdlib directory form one more document, ``<toplevel>``.
Several documents exceed 100K tokens (``<toplevel>`` alone is over a million), which is
what long-context training needs.

With ``unit="file"`` each ``.py`` file is a document of its own instead (a few thousand
tokens on average): packed sequences of many short documents, what document masking is for.

Test directories (``test``, ``tests``, ``idle_test``) are left out by default: they
double the size with repetitive code. ``site-packages``, ``lib-dynload``, build
configuration and ``__pycache__`` are never included.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import Optional, Sequence

from .cache import files_fingerprint, stable_hash
from .corpus import Corpus, SourceStats, decode_utf8, report_stats

TOPLEVEL = "<toplevel>"
UNITS = ("package", "file")  # what one document of the default corpus is
_TEST_DIRS = {"test", "tests", "idle_test"}
_NEVER = {"site-packages", "dist-packages", "lib-dynload", "__pycache__", "__phello__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _package_files(root: Path, package: str, include_tests: bool) -> list[Path]:
    if package == TOPLEVEL:
        return sorted(p for p in root.glob("*.py") if p.is_file())
    files = []
    for dirpath, dirnames, filenames in os.walk(root / package):
        dirnames[:] = sorted(d for d in dirnames if d not in _NEVER and (include_tests or d not in _TEST_DIRS))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def list_stdlib_packages(*, include_tests: bool = False, root: Optional[Path] = None) -> list[str]:
    """Names of the documents of the default corpus (sorted), ``<toplevel>`` first."""
    root = root or stdlib_root()
    names = [TOPLEVEL]
    for d in sorted(root.iterdir()):
        if (
            not d.is_dir()
            or d.name in _NEVER
            or d.name.startswith((".", "config-"))
            or (not include_tests and d.name in _TEST_DIRS)
        ):
            continue
        if _package_files(root, d.name, include_tests):
            names.append(d.name)
    return names


def stdlib_documents(
    packages: Optional[Sequence[str]] = None,
    *,
    include_tests: bool = False,
    root: Optional[Path] = None,
    unit: str = "package",
) -> list[tuple[str, list[Path]]]:
    """``(name, files)`` per document; ``packages`` picks a subset (e.g. for tests); ``unit``:
    a whole package per document, or one ``.py`` file per document."""
    if unit not in UNITS:
        raise ValueError(f"stdlib document unit must be one of {UNITS}, got {unit!r}")
    root = root or stdlib_root()
    available = list_stdlib_packages(include_tests=include_tests, root=root)
    if packages is None:
        chosen = available
    else:
        unknown = [p for p in packages if p not in available]
        if unknown:
            raise ValueError(
                f"unknown stdlib package(s) {unknown}; available: {', '.join(available)}"
                + ("" if include_tests else " (test packages need include_tests=True)")
            )
        chosen = list(dict.fromkeys(packages))
    docs = [(name, _package_files(root, name, include_tests)) for name in chosen]
    if unit == "file":
        docs = [(f.relative_to(root).as_posix(), [f]) for _, files in docs for f in files]
    return docs


def build_default_corpus(
    packages: Optional[Sequence[str]] = None,
    *,
    include_tests: bool = False,
    max_documents: Optional[int] = None,
    root: Optional[Path] = None,
    unit: str = "package",
):
    """The default corpus as a ``datasets.Dataset`` (columns ``text``, ``name``) and its ``SourceStats``."""
    from datasets import Dataset

    root = root or stdlib_root()
    docs = stdlib_documents(packages, include_tests=include_tests, root=root, unit=unit)
    if max_documents is not None:
        docs = docs[:max_documents]
    stats = SourceStats()
    names, texts = [], []
    for name, files in docs:
        parts = []
        for f in files:
            # A few stdlib files are not UTF-8 on purpose (encoding tests): count, do not fail.
            text, n_bad = decode_utf8(f.read_bytes())
            stats.files += 1
            stats.decode_replacements += n_bad
            stats.files_with_replacements += bool(n_bad)
            if not text.strip():
                continue  # e.g. an empty __init__.py: part of a package, not a skipped document
            parts.append(f"# file: {f.relative_to(root).as_posix()}\n{text.rstrip()}\n")
        if parts:
            names.append(name)
            texts.append("\n".join(parts))
    stats.documents = len(texts)
    report_stats(stats, f"stdlib {root}")
    return Dataset.from_dict({"text": texts, "name": names}), stats


def stdlib_corpus(
    packages: Optional[Sequence[str]] = None,
    *,
    include_tests: bool = False,
    max_documents: Optional[int] = None,
    unit: str = "package",
):
    """The default corpus as a ``Corpus`` (cheap fingerprint from file metadata)."""
    root = stdlib_root()
    docs = stdlib_documents(packages, include_tests=include_tests, root=root, unit=unit)  # validates now
    if max_documents is not None:
        docs = docs[:max_documents]
    files = [f for _, group in docs for f in group]
    fp = stable_hash("stdlib", sys.version_info[:3], [n for n, _ in docs], files_fingerprint(files, root))
    label = ("stdlib" if packages is None else "stdlib:" + ",".join(packages)) + (
        "" if unit == "package" else f" ({unit} documents)"
    )
    return Corpus(
        label,
        fp,
        lambda: build_default_corpus(
            packages, include_tests=include_tests, max_documents=max_documents, root=root, unit=unit
        ),
    )
