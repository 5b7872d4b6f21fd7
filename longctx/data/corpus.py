"""What every corpus source produces: a ``Corpus`` (cheap fingerprint, memoised ``load()``)
and its ``SourceStats``; UTF-8 decoding with counted replacements, and the stats report.

Shared by ``sources`` (files, tables, saved datasets) and ``stdlib_corpus`` (the embedded
default corpus), which ``sources`` dispatches to: kept here so neither imports the other.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

logger = logging.getLogger("longctx.data")

_REPLACEMENT = "\ufffd"
_REPLACEMENT_UTF8 = _REPLACEMENT.encode("utf-8")


@dataclass
class SourceStats:
    documents: int = 0
    files: int = 0
    skipped_empty: int = 0
    skipped_binary: int = 0
    decode_replacements: int = 0
    files_with_replacements: int = 0
    ignored_files: list = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ignored_files"] = len(self.ignored_files)
        return d


@dataclass
class Corpus:
    """A document source: a cheap ``fingerprint`` and an expensive, memoised ``load()``.

    ``load()`` returns ``(datasets.Dataset with a "text" column, SourceStats)``; the
    first call reads the source, later ones reuse the result until ``release()``.
    """

    name: str
    fingerprint: str
    loader: Callable[[], "tuple[object, SourceStats]"] = field(repr=False)
    _loaded: Optional[tuple] = field(default=None, repr=False, compare=False)

    def load(self) -> "tuple[object, SourceStats]":
        if self._loaded is None:
            self._loaded = self.loader()
        return self._loaded  # type: ignore[return-value]

    def release(self) -> None:
        self._loaded = None


def decode_utf8(raw: bytes) -> tuple[str, int]:
    """``raw`` decoded as UTF-8 with invalid bytes replaced by U+FFFD, and how many were replaced."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        # Genuine U+FFFD characters already in the file are not replacements.
        return text, text.count(_REPLACEMENT) - raw.count(_REPLACEMENT_UTF8)


def report_stats(stats: SourceStats, where: str) -> None:
    if stats.documents == 0:
        raise ValueError(
            f"corpus {where!r} holds no text: {stats.files} files read, {stats.skipped_empty} empty, "
            f"{stats.skipped_binary} binary"
        )
    if stats.skipped_empty or stats.skipped_binary:
        logger.warning(
            "corpus %s: skipped %d empty and %d binary documents/files",
            where,
            stats.skipped_empty,
            stats.skipped_binary,
        )
    if stats.decode_replacements:
        logger.warning(
            "corpus %s: %d invalid UTF-8 sequences in %d files were replaced by U+FFFD",
            where,
            stats.decode_replacements,
            stats.files_with_replacements,
        )
