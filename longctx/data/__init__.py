"""The long-document data pipeline: sources, tokenizer, packing, CP sampling, data module.

``LongDocumentDataModule`` is the entry point; the pieces are usable on their own.
Names are imported lazily (PEP 562), so ``from longctx.data import SentencePieceTokenizer``
does not import Lightning or ``datasets``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LongDocumentDataModule": "datamodule",
    "ContextParallelSampler": "sampler",
    "ResumableDataLoader": "sampler",
    "dp_coordinates": "sampler",
    "PackedSequenceDataset": "packing",
    "IGNORE_INDEX": "packing",
    "tokenize_corpus": "packing",
    "pack_corpus": "packing",
    "split_documents": "packing",
    "Corpus": "corpus",
    "SourceStats": "corpus",
    "resolve_corpus": "sources",
    "build_default_corpus": "stdlib_corpus",
    "list_stdlib_packages": "stdlib_corpus",
    "stdlib_corpus": "stdlib_corpus",
    "SentencePieceTokenizer": "tokenizer",
    "TextTokenizer": "tokenizer",
    "as_text_tokenizer": "tokenizer",
    "tokenizer_fingerprint": "tokenizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'longctx.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from .corpus import Corpus, SourceStats
    from .datamodule import LongDocumentDataModule
    from .packing import IGNORE_INDEX, PackedSequenceDataset, pack_corpus, split_documents, tokenize_corpus
    from .sampler import ContextParallelSampler, ResumableDataLoader, dp_coordinates
    from .sources import resolve_corpus
    from .stdlib_corpus import build_default_corpus, list_stdlib_packages, stdlib_corpus
    from .tokenizer import SentencePieceTokenizer, TextTokenizer, as_text_tokenizer, tokenizer_fingerprint
