"""Reading documents from local sources, through ``datasets``, without network access.

``resolve_corpus(path)`` looks at a path cheaply (file names, sizes, mtimes; no text
read) and returns a ``Corpus``: a fingerprint for cache keys plus a ``load()`` that
reads the documents into a ``datasets.Dataset`` with one column, ``text``. Accepted:

* a directory saved with ``Dataset.save_to_disk`` (or a ``DatasetDict``: its
  ``train`` split, or its only split);
* a ``.jsonl``/``.json``/``.parquet``/``.arrow`` file, or a directory holding such
  files (searched recursively; other files in it, such as a README, are ignored);
* a ``.txt`` (or any other text) file, or a directory of text files: one file is one
  document. Files are decoded as UTF-8 with replacement and the replacements counted;
  empty and binary (NUL-containing) files are skipped and counted.
* a glob pattern (``"books/*.txt"``, ``"data/**/*.parquet"``) or a list of paths;
* ``"stdlib"`` / ``"stdlib:json,email"`` / ``None``: the embedded default corpus
  (``stdlib_corpus``).

``load()`` also returns ``SourceStats`` (documents, skipped files, decode replacements)
so the data module can report them.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Optional, Sequence, Union

# No network at run time: only local packaged builders are used below, and this keeps
# `datasets` from reaching the Hub should anything try (effective if set before import).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from .cache import PathLike, files_fingerprint, stable_hash  # noqa: E402
from .corpus import Corpus, SourceStats, decode_utf8, report_stats  # noqa: E402
from .stdlib_corpus import stdlib_corpus  # noqa: E402

logger = logging.getLogger("longctx.data")

TABLE_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_READER_VERSION = 1  # part of every corpus fingerprint: bump when reading changes


def resolve_corpus(
    path: Union[None, PathLike, Sequence[PathLike]],
    *,
    text_column: str = "text",
    max_documents: Optional[int] = None,
    cache_dir: Optional[PathLike] = None,
    include_tests: bool = False,
    stdlib_documents: str = "package",
) -> Corpus:
    """Validate ``path`` and describe the corpus there, reading no document text.
    ``stdlib_documents``: what one document of the default corpus is (``"package"``,
    ``"file"``); for other corpora every row or file is one."""
    if max_documents is not None and (not isinstance(max_documents, int) or max_documents < 1):
        raise ValueError(f"max_documents must be a positive int or None, got {max_documents!r}")
    if path is None or (isinstance(path, str) and (path == "stdlib" or path.startswith("stdlib:"))):
        packages = None
        if isinstance(path, str) and path.startswith("stdlib:"):
            packages = [p for p in path[len("stdlib:") :].split(",") if p]
        return stdlib_corpus(
            packages=packages, include_tests=include_tests, max_documents=max_documents, unit=stdlib_documents
        )
    if stdlib_documents != "package":
        raise ValueError(
            f"stdlib_documents={stdlib_documents!r} applies to the default (stdlib) corpus only; "
            f"in {path!r} every file or row is one document"
        )

    paths = []
    for p in [path] if isinstance(path, (str, os.PathLike)) else path:
        p = os.path.expanduser(os.fspath(p))
        if glob.has_magic(p) and not os.path.exists(p):
            matches = sorted(glob.glob(p, recursive=True))
            if not matches:
                raise FileNotFoundError(f"corpus pattern {p!r} matches no file")
            paths.extend(Path(m) for m in matches)
        elif not os.path.exists(p):
            raise FileNotFoundError(f"corpus path {p!r} does not exist")
        else:
            paths.append(Path(p))
    if not paths:
        raise ValueError("no corpus path given")
    hf_cache = None if cache_dir is None else str(Path(cache_dir) / "hf")
    given = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    name = os.fspath(given[0]) + (f" (+{len(given) - 1} more)" if len(given) > 1 else "")

    if len(paths) == 1 and _is_saved_dataset(paths[0]):
        root = paths[0]
        files = _list_files(root)
        fp = stable_hash("saved", files_fingerprint(files, root), text_column, max_documents, _READER_VERSION)
        return Corpus(name, fp, lambda: _load_saved(root, text_column, max_documents))

    files: list[Path] = []
    for p in paths:
        files.extend(_list_files(p) if p.is_dir() else [p])
    if not files:
        raise ValueError(f"corpus path {name!r} holds no files")
    tables = [f for f in files if f.suffix.lower() in TABLE_EXTENSIONS]
    if tables:
        ignored = [f for f in files if f.suffix.lower() not in TABLE_EXTENSIONS]
        fp = stable_hash("tables", files_fingerprint(tables), text_column, max_documents, _READER_VERSION)
        return Corpus(name, fp, lambda: _load_tables(tables, ignored, text_column, max_documents, hf_cache))
    fp = stable_hash("text", files_fingerprint(files), max_documents, _READER_VERSION)
    return Corpus(name, fp, lambda: load_text_files(files, max_documents=max_documents))


def _list_files(root: Path) -> list[Path]:
    """Regular, non-hidden files under ``root``, sorted (deterministic document order)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
    return out


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and (
        ((p / "state.json").is_file() and (p / "dataset_info.json").is_file()) or (p / "dataset_dict.json").is_file()
    )


def load_text_files(files: Sequence[Path], *, max_documents: Optional[int] = None):
    """One document per file (UTF-8 with replacement); empty and binary files skipped and counted."""
    from datasets import Dataset

    stats = SourceStats()
    texts: list[str] = []
    for f in files:
        if max_documents is not None and len(texts) >= max_documents:
            break
        raw = Path(f).read_bytes()
        stats.files += 1
        if b"\x00" in raw[:8192]:
            stats.skipped_binary += 1
            continue
        text, n_bad = decode_utf8(raw)
        if text.startswith("\ufeff"):  # a UTF-8 byte-order mark is not content
            text = text[1:]
        if not text.strip():
            stats.skipped_empty += 1
            continue
        if n_bad:
            stats.decode_replacements += n_bad
            stats.files_with_replacements += 1
        texts.append(text)
    stats.documents = len(texts)
    report_stats(stats, str(files[0]) + (f" (+{len(files) - 1} more files)" if len(files) > 1 else ""))
    return Dataset.from_dict({"text": texts}), stats


def _load_tables(tables: list[Path], ignored: list[Path], text_column: str, max_documents, hf_cache):
    from datasets import concatenate_datasets, load_dataset

    stats = SourceStats(files=len(tables), ignored_files=[str(f) for f in ignored])
    if ignored:
        logger.info("corpus: %d non-table files next to the data files are ignored (e.g. %s)", len(ignored), ignored[0])
    parts = []
    by_builder: dict[str, list[str]] = {}
    for f in tables:
        by_builder.setdefault(TABLE_EXTENSIONS[f.suffix.lower()], []).append(str(f))
    for builder, data_files in by_builder.items():
        try:
            ds = load_dataset(builder, data_files=data_files, split="train", cache_dir=hf_cache)
        except Exception as e:  # noqa: BLE001 - name the files; datasets' own errors rarely do
            raise ValueError(f"could not read {builder} data files {data_files[:3]}: {type(e).__name__}: {e}") from e
        parts.append(_text_column(ds, text_column, data_files[0]))
    ds = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    return _finish_table(ds, stats, max_documents, str(tables[0]))


def _load_saved(root: Path, text_column: str, max_documents):
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(root))
    if isinstance(ds, DatasetDict):
        if "train" in ds:
            ds = ds["train"]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise ValueError(f"saved DatasetDict {str(root)!r} has splits {list(ds)} and none is 'train'")
    stats = SourceStats(files=1)
    return _finish_table(_text_column(ds, text_column, str(root)), stats, max_documents, str(root))


def _text_column(ds, text_column: str, where: str):
    if text_column not in ds.column_names:
        raise ValueError(f"{where!r} has no column {text_column!r}; its columns are {ds.column_names}")
    feature = ds.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise TypeError(f"column {text_column!r} of {where!r} must hold strings, it holds {feature}")
    ds = ds.select_columns([text_column])
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def _finish_table(ds, stats: SourceStats, max_documents, where: str):
    import numpy as np
    import pyarrow.compute as pc

    # Arrow compute instead of ds.filter: no Python loop over documents, and no cache
    # files written next to a user's saved dataset (which may be read-only).
    if ds._indices is not None:  # a selection: make the table match the rows
        ds = ds.flatten_indices(keep_in_memory=True)
    column = ds.data.column("text")
    nonblank = pc.and_kleene(pc.is_valid(column), pc.not_equal(pc.utf8_trim_whitespace(column), ""))
    keep = np.flatnonzero(nonblank.fill_null(False).to_numpy(zero_copy_only=False))
    stats.skipped_empty = len(ds) - len(keep)
    if max_documents is not None:
        keep = keep[:max_documents]
    if len(keep) != len(ds):
        ds = ds.select(keep, keep_in_memory=True)
    stats.documents = len(ds)
    report_stats(stats, where)
    return ds, stats
