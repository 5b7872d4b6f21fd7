"""The token stream a long-context evaluation reads: a corpus tokenized and packed exactly as
``LongDocumentDataModule`` packs it (evaluate.py's loss by position, the benchmark
benchmarks/long_context_ppl.py). ``data="auto"``: the Python standard library's own test
suite where it is installed complete, else four subpackages of the installed torch
(``tree:``), corpora the default training data never contains."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch.distributed as dist


def tree_corpus(spec: str):
    """``tree:PATH_OR_PACKAGE[:sub1,sub2]``: a source tree as package-level documents.

    Built the way the stdlib corpus is (one document per subdirectory, its ``.py`` files
    concatenated in path order with ``# file:`` headers; the top-level files form one more),
    so any installed package (``tree:torch``) gives long held-out documents the fine-tune
    on the stdlib never saw. A package name is located without importing it.
    """
    import importlib.util

    from longctx.data.cache import files_fingerprint, stable_hash
    from longctx.data.sources import Corpus
    from longctx.data.stdlib_corpus import build_default_corpus, stdlib_documents

    target, _, subs = spec[len("tree:") :].partition(":")
    root = Path(target).expanduser()
    if not root.is_dir():
        found = importlib.util.find_spec(target) if target and "/" not in target else None
        if found is None or not found.submodule_search_locations:
            raise ValueError(f"{spec!r}: {target!r} is neither a directory nor an installed package")
        root = Path(list(found.submodule_search_locations)[0])
    packages = [x for x in subs.split(",") if x] or None
    docs = stdlib_documents(packages, root=root)
    files = [f for _, group in docs for f in group]
    fp = stable_hash("tree", root.name, [n for n, _ in docs], files_fingerprint(files, root))
    return Corpus(spec, fp, lambda: build_default_corpus(packages, root=root))


# ``--data auto``: the stdlib's test suite when it is complete (CPython's is ~17 MB of .py;
# Debian/Ubuntu ship only a stub ``test`` package, the official Docker images none), else
# four torch subpackages (~14 MB, ~4M tokens: 60 windows of 64K, tokenized in seconds).
AUTO_MIN_TEST_BYTES = 8_000_000
AUTO_FALLBACK = "tree:torch:_dynamo,distributed,fx,nn"


def resolve_eval_corpus(data: Optional[str], *, include_tests: Optional[bool], cache_dir: Path):
    """(Corpus, include_tests) for ``--data``; ``"auto"`` picks as described above."""
    from longctx.data.sources import resolve_corpus
    from longctx.data.stdlib_corpus import list_stdlib_packages, stdlib_documents

    if data == "auto":
        data = AUTO_FALLBACK
        if "test" in list_stdlib_packages(include_tests=True):
            files = stdlib_documents(["test"], include_tests=True)[0][1]
            if sum(f.stat().st_size for f in files) >= AUTO_MIN_TEST_BYTES:
                data = "stdlib:test"
    if isinstance(data, str) and data.startswith("tree:"):
        return tree_corpus(data), False
    if include_tests is None:
        include_tests = data == "stdlib:test"
    return resolve_corpus(data, include_tests=include_tests, cache_dir=cache_dir), include_tests


def load_eval_stream(
    data: Optional[str],
    tokenizer,
    *,
    split: str = "all",
    val_fraction: float = 0.01,
    seed: int = 1234,
    include_tests: Optional[bool] = None,
    cache_dir: Optional[str] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """(tokens, document ids, info) of one split, packed exactly as LongDocumentDataModule packs.

    ``split="val"`` with the training run's seed and val_fraction is the training corpus's own
    held-out documents; ``"all"`` is every document of ``data`` (for a corpus the training
    never saw). Rank 0 tokenizes and packs (cached); the other ranks then read the cache.
    """
    from longctx.data.cache import default_cache_dir
    from longctx.data.packing import pack_corpus, packed_meta, tokenize_corpus

    if split not in ("all", "val", "train"):
        raise ValueError(f"split must be 'all', 'val' or 'train', got {split!r}")
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    corpus, include_tests = resolve_eval_corpus(data, include_tests=include_tests, cache_dir=cache)
    vf = 0.0 if split == "all" else float(val_fraction)

    def build() -> Path:
        tokenized = tokenize_corpus(corpus, tokenizer, cache_dir=cache)
        return pack_corpus(
            tokenized, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, val_fraction=vf, seed=seed, cache_dir=cache
        )

    distributed = group is not None and dist.get_world_size(group) > 1
    if distributed and dist.get_rank(group) != 0:
        dist.barrier(group=group)
    packed = build()
    if distributed and dist.get_rank(group) == 0:
        dist.barrier(group=group)
    stream = "train" if split == "all" else split
    meta = packed_meta(packed)
    tokens = np.load(packed / f"{stream}.tokens.npy", mmap_mode="r")
    docs = np.load(packed / f"{stream}.documents.npy", mmap_mode="r")
    if len(tokens) < 2:
        raise ValueError(f"the {split!r} split of {corpus.name} holds no tokens (val_fraction {vf}, seed {seed})")
    info = {
        "corpus": corpus.name,
        "corpus_fingerprint": corpus.fingerprint,
        "split": split,
        "val_fraction": vf,
        "seed": seed,
        "include_tests": include_tests,
        "documents": meta[stream]["documents"],
        "tokens": int(len(tokens)),
        "packed": packed.name,
    }
    return tokens, docs, info
