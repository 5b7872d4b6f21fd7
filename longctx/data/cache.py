"""Cache keys and atomic writes for the data pipeline.

Every expensive stage (training a tokenizer, tokenizing, packing) writes its result
under ``cache_dir`` at a path named by a hash of everything the result depends on,
so a second run with the same inputs only memory-maps files. Results are written to a
temporary name and renamed into place, so concurrent builders (several ranks, several
jobs) never see half-written files: the loser of a race just discards its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


def default_cache_dir() -> Path:
    """``$LONGCTX_CACHE_DIR``, else ``$XDG_CACHE_HOME/longctx``, else ``~/.cache/longctx``."""
    env = os.environ.get("LONGCTX_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "longctx"


def stable_hash(*parts: Any, length: int = 16) -> str:
    """Short sha256 of JSON-serialisable ``parts`` (dict keys sorted, so order-independent)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:length]


def files_fingerprint(files: list[Path], root: Optional[Path] = None) -> str:
    """Hash of (relative path, size, mtime) of ``files``: cheap, no file is read.

    Like ``make``: editing a file changes its mtime and so the key; a copy of the same
    corpus elsewhere (same relative paths) keeps the key when ``root`` is given.
    """
    entries = []
    for f in files:
        st = f.stat()
        name = str(f.relative_to(root)) if root is not None else str(f.resolve())
        entries.append((name, st.st_size, st.st_mtime_ns))
    return stable_hash(entries, length=32)


def tmp_sibling(final: Path) -> Path:
    """A unique temporary path next to ``final`` (same filesystem, so renames are atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def publish(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` file or directory to ``final``; keep an existing ``final``."""
    try:
        os.replace(tmp, final) if tmp.is_file() else os.rename(tmp, final)
    except OSError:
        if not final.exists():
            raise
        # Another process published the same result first; its copy is as good as ours.
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def write_json(path: Path, obj: Any) -> None:
    tmp = tmp_sibling(path)
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
