"""Tokenizing, packing and windowing documents into training sequences.

Three stages, each cached under ``cache_dir`` by a hash of its inputs:

1. ``tokenize_corpus``: ``datasets.map`` over the documents (batched; threads or
   ``num_proc`` processes), saved as Arrow (``save_to_disk``) under
   ``tokenized/<hash(corpus, tokenizer)>``.
2. ``pack_corpus``: splits train/validation by whole documents (seeded) and writes each
   split as one token stream, ``[BOS] doc [EOS] [BOS] doc [EOS] ...`` (BOS only when the
   tokenizer has one), with a parallel stream of document ids, as ``.npy`` files under
   ``packed/<hash(tokenized, separators, split)>``. Memory-mapped by every rank.
3. ``PackedSequenceDataset``: window ``i`` is tokens ``[i*S, i*S + S + 1)`` of a stream
   (consecutive windows share one token, so every next-token pair is trained exactly
   once). ``seq_len`` is not part of any cache key: changing it costs nothing.

A cached result is checked before it is reused (``meta.json`` records what it holds: the
tokenized corpus's file sizes and documents, the packed streams' token counts); a damaged one
(a truncated file, one that no longer loads) is rebuilt with a warning naming the file, or,
where it cannot be removed, refused in one line that says how to clear it.

Labels are shifted on the full window (``labels[t] = tokens[t+1]``) before any
context-parallel sharding. By default a label whose token belongs to another document
than its input position is ignored (-100): the last token of a document does not
learn to predict the first token of an unrelated one.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from .cache import PathLike, publish, read_json, stable_hash, tmp_sibling, write_json
from .sources import Corpus
from .tokenizer import TextTokenizer, tokenizer_fingerprint

logger = logging.getLogger("longctx.data")

_TOKENIZE_VERSION = 1
_PACK_VERSION = 1
IGNORE_INDEX = -100
SPLITS = ("train", "val")


class _TokenizeBatch:
    """The ``datasets.map`` function; a class (not a closure) so it pickles for ``num_proc``."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer

    def __call__(self, batch: dict) -> dict:
        texts = batch["text"]
        encode_batch = getattr(self.tokenizer, "encode_batch", None)
        ids = encode_batch(texts) if encode_batch is not None else [self.tokenizer.encode(t) for t in texts]
        return {"input_ids": ids, "num_tokens": [len(x) for x in ids]}


def tokenized_key(corpus: Corpus, tokenizer: TextTokenizer) -> str:
    return stable_hash(corpus.fingerprint, tokenizer_fingerprint(tokenizer), _TOKENIZE_VERSION, length=24)


def tokenize_corpus(
    corpus: Corpus,
    tokenizer: TextTokenizer,
    *,
    cache_dir: PathLike,
    num_proc: Optional[int] = None,
) -> Path:
    """Tokenize ``corpus`` once; returns the ``save_to_disk`` directory (holds ``meta.json``)."""
    from datasets import Features, Sequence, Value

    key = tokenized_key(corpus, tokenizer)
    final = Path(cache_dir) / "tokenized" / key
    if (final / "meta.json").is_file() and _reusable(final, _tokenized_problem):
        logger.debug("data: reusing tokenized corpus %s", final)
        return final
    documents, stats = corpus.load()
    cpus = os.cpu_count() or 1
    if num_proc is None:
        # A tokenizer with encode_batch parallelises inside one process (C++/Rust threads);
        # others get processes once there are enough documents to amortise starting them.
        num_proc = 1 if hasattr(tokenizer, "encode_batch") or len(documents) < 64 else min(cpus, 8)
    num_proc = max(1, min(num_proc, len(documents)))
    if num_proc > 1:
        try:
            import pickle

            pickle.dumps(tokenizer)
        except Exception:  # noqa: BLE001
            logger.info("data: tokenizer %r does not pickle; tokenizing in one process", tokenizer)
            num_proc = 1
    work, out = tmp_sibling(final), tmp_sibling(final)
    work.mkdir()
    try:
        tokenized = documents.map(
            _TokenizeBatch(tokenizer),
            batched=True,
            batch_size=32,  # documents can be megabytes each: small batches bound memory
            writer_batch_size=32,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=documents.column_names,
            features=Features({"input_ids": Sequence(Value("int32")), "num_tokens": Value("int64")}),
            # Our key already names the result; writing it into our cache (not next to the
            # user's data) and not hashing the tokenizer object again.
            cache_file_name=str(work / "map.arrow"),
            new_fingerprint=key,
            load_from_cache_file=False,
            desc="tokenizing",
        )
        _check_ids(tokenized, tokenizer)
        tokenized.save_to_disk(str(out))
        n_tokens = int(np.asarray(tokenized["num_tokens"]).sum()) if len(tokenized) else 0
        write_json(
            out / "meta.json",
            {
                "files": {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()},
                "corpus": corpus.name,
                "corpus_fingerprint": corpus.fingerprint,
                "tokenizer": repr(tokenizer),
                "vocab_size": tokenizer.vocab_size,
                "documents": len(tokenized),
                "tokens": n_tokens,
                "source_stats": stats.as_dict(),
            },
        )
        del tokenized
        publish(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)  # only left behind when something failed
    logger.info("data: tokenized %s -> %s", corpus.name, final)
    return final


def _check_ids(tokenized, tokenizer: TextTokenizer) -> None:
    # An id outside the vocabulary would surface much later as an opaque device-side
    # assert in the embedding; catch it here, naming the tokenizer.
    import pyarrow.compute as pc

    values = pc.list_flatten(tokenized.data.column("input_ids"))
    if len(values) == 0:
        return
    lo, hi = pc.min_max(values).values()
    if lo.as_py() < 0 or hi.as_py() >= tokenizer.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer!r} produced ids in [{lo.as_py()}, {hi.as_py()}], outside its "
            f"vocab_size {tokenizer.vocab_size}"
        )


def split_documents(lengths: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Whole-document train/val split holding about ``val_fraction`` of the tokens in val.

    Seeded: documents are visited in a random order and added to val while they fit the
    token budget; when none fits, the smallest goes to val. Train always keeps at least
    one document; zero-token documents go nowhere.
    """
    nonempty = np.flatnonzero(lengths > 0)
    if val_fraction <= 0 or len(nonempty) < 2:
        return nonempty, nonempty[:0]
    order = np.random.default_rng(seed).permutation(nonempty)
    target = val_fraction * float(lengths[nonempty].sum())
    val, acc = [], 0
    for d in order:
        if acc + lengths[d] <= target:
            val.append(d)
            acc += int(lengths[d])
            if acc >= 0.999 * target:
                break
    if not val:
        val = [int(order[np.argmin(lengths[order])])]
    if len(val) == len(nonempty):
        val = val[:-1]
    val_arr = np.sort(np.asarray(val, dtype=np.int64))
    return np.setdiff1d(nonempty, val_arr), val_arr


def packed_key(tokenized_dir: Path, *, bos_id: Optional[int], eos_id: int, val_fraction: float, seed: int) -> str:
    return stable_hash(tokenized_dir.name, bos_id, eos_id, float(val_fraction), seed, _PACK_VERSION, length=24)


def pack_corpus(
    tokenized_dir: Path,
    *,
    bos_id: Optional[int],
    eos_id: int,
    val_fraction: float,
    seed: int,
    cache_dir: PathLike,
) -> Path:
    """Write the train/val token streams for ``tokenized_dir``; returns their directory."""
    from datasets import load_from_disk

    key = packed_key(tokenized_dir, bos_id=bos_id, eos_id=eos_id, val_fraction=val_fraction, seed=seed)
    final = Path(cache_dir) / "packed" / key
    if (final / "meta.json").is_file() and _reusable(final, _packed_problem):
        return final
    ds = load_from_disk(str(tokenized_dir))
    lengths = np.asarray(ds.data.column("num_tokens").to_numpy(), dtype=np.int64)
    docs = _DocumentValues(ds)
    train_docs, val_docs = split_documents(lengths, val_fraction, seed)
    out = tmp_sibling(final)
    out.mkdir()
    try:
        meta: dict = {
            "bos_id": bos_id,
            "eos_id": eos_id,
            "val_fraction": val_fraction,
            "seed": seed,
            "zero_token_documents": int((lengths == 0).sum()),
            "tokenized": tokenized_dir.name,
        }
        for split, members in zip(SPLITS, (train_docs, val_docs)):
            total = _write_stream(out, split, members, docs, lengths, bos_id=bos_id, eos_id=eos_id)
            meta[split] = {"documents": len(members), "tokens": total}
        write_json(out / "meta.json", meta)
        publish(out, final)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # only left behind when something failed
    return final


def _tokenized_problem(folder: Path) -> Optional[str]:
    """Why a cached tokenized corpus cannot be reused (a file of another size than written,
    or, for caches that recorded no sizes, one that does not load), or None."""
    meta = read_json(folder / "meta.json")
    files = meta.get("files")
    if isinstance(files, dict):
        for name, size in files.items():
            path = folder / name
            if not path.is_file():
                return f"{path} is missing"
            if path.stat().st_size != size:
                return f"{path} has {path.stat().st_size} bytes, {size} were written"
        return None
    from datasets import load_from_disk

    try:
        documents = len(load_from_disk(str(folder)))
    except Exception as exc:  # noqa: BLE001 - every way a damaged Arrow cache fails to load
        return f"{folder} does not load ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    if documents != meta.get("documents"):
        return f"{folder} holds {documents} documents, {meta.get('documents')} were written"
    return None


def _packed_problem(folder: Path) -> Optional[str]:
    """Why cached token streams cannot be reused (a file that does not memory-map, or holds
    another number of tokens than written), or None."""
    meta = read_json(folder / "meta.json")
    for split in SPLITS:
        for stream in ("tokens", "documents"):
            path = folder / f"{split}.{stream}.npy"
            try:
                n = len(np.load(path, mmap_mode="r"))
            except (OSError, ValueError) as exc:  # "mmap length is greater than file size"
                return f"{path} does not load ({exc})"
            if n != meta[split]["tokens"]:
                return f"{path} holds {n} tokens, {meta[split]['tokens']} were written"
    return None


def _reusable(folder: Path, problem_of) -> bool:
    """Whether a cached result can be reused; a damaged one is removed (so that it is built
    again), with a warning naming what is wrong; one that cannot be removed: one line saying
    how to clear it."""
    try:
        problem = problem_of(folder)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # meta.json itself damaged
        problem = f"{folder / 'meta.json'} is unreadable ({type(exc).__name__}: {exc})"
    if problem is None:
        return True
    logger.warning("data: the cache is damaged (%s); building it again", problem)
    try:
        aside = tmp_sibling(folder)
        os.rename(folder, aside)  # at once: no process picks a half-removed cache
        shutil.rmtree(aside)
    except FileNotFoundError:
        pass  # another process moved it aside first
    except OSError as exc:
        raise ValueError(
            f"data cache {folder} is damaged ({problem}) and cannot be removed ({exc}); remove it "
            f"(rm -r {folder}) and run again"
        ) from None
    return False


def _write_stream(
    out: Path,
    split: str,
    members: np.ndarray,
    docs: "_DocumentValues",
    lengths: np.ndarray,
    *,
    bos_id: Optional[int],
    eos_id: int,
) -> int:
    """Write ``[BOS] doc [EOS]`` for each member document, and its ids, as two ``.npy`` files."""
    total = int(lengths[members].sum()) + (1 + (bos_id is not None)) * len(members)
    tokens = np.lib.format.open_memmap(out / f"{split}.tokens.npy", mode="w+", dtype=np.int32, shape=(total,))
    doc_ids = np.lib.format.open_memmap(out / f"{split}.documents.npy", mode="w+", dtype=np.int32, shape=(total,))
    pos = 0
    for d in members:
        start = pos
        if bos_id is not None:
            tokens[pos] = bos_id
            pos += 1
        values = docs[int(d)]
        tokens[pos : pos + len(values)] = values
        pos += len(values)
        tokens[pos] = eos_id
        pos += 1
        doc_ids[start:pos] = d
    assert pos == total
    tokens.flush()
    doc_ids.flush()
    return total


class _DocumentValues:
    """Zero-copy access to one document's token ids in a memory-mapped tokenized dataset."""

    def __init__(self, ds):
        self.chunks = []
        starts = [0]
        for chunk in ds.data.column("input_ids").chunks:
            # A sliced chunk's offsets index its unsliced child array, which .values returns.
            offsets = chunk.offsets.to_numpy()
            values = chunk.values.to_numpy()
            self.chunks.append((offsets, values))
            starts.append(starts[-1] + len(chunk))
        self.starts = np.asarray(starts)

    def __getitem__(self, d: int) -> np.ndarray:
        c = int(np.searchsorted(self.starts, d, side="right") - 1)
        offsets, values = self.chunks[c]
        i = d - self.starts[c]
        return values[offsets[i] : offsets[i + 1]]


class PackedSequenceDataset(torch.utils.data.Dataset):
    """Windows of ``seq_len + 1`` tokens over a packed stream, as full-length samples.

    ``dataset[i]`` is a dict of ``(seq_len,)`` int64 tensors: ``input_ids``, ``labels``
    (next token, -100 = ignore), ``position_ids`` (0..seq_len-1 within the window) and
    ``document_ids``. Backed by ``.npy`` files opened lazily with ``mmap``, so worker
    processes share the page cache instead of each holding a copy.
    """

    def __init__(
        self,
        tokens: Union[PathLike, np.ndarray],
        document_ids: Union[PathLike, np.ndarray],
        seq_len: int,
        *,
        mask_cross_document_labels: bool = True,
    ):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.seq_len = seq_len
        self.mask_cross_document_labels = mask_cross_document_labels
        self._sources = (tokens, document_ids)
        self._arrays: Optional[tuple[np.ndarray, np.ndarray]] = None
        t, d = self._open()
        if len(t) != len(d):
            raise ValueError(f"token stream ({len(t)}) and document-id stream ({len(d)}) differ in length")
        self.num_tokens = len(t)

    def _open(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            self._arrays = tuple(  # type: ignore[assignment]
                src if isinstance(src, np.ndarray) else np.load(src, mmap_mode="r") for src in self._sources
            )
        return self._arrays  # type: ignore[return-value]

    def streams(self) -> tuple[np.ndarray, np.ndarray]:
        """The packed token and document-id streams the windows are cut from."""
        return self._open()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if not all(isinstance(s, np.ndarray) for s in self._sources):
            state["_arrays"] = None  # reopen the memory map in the worker, do not copy it
        return state

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        i %= n
        tokens, docs = self._open()
        lo, hi = i * self.seq_len, i * self.seq_len + self.seq_len + 1
        window = torch.from_numpy(np.asarray(tokens[lo:hi], dtype=np.int64))
        window_docs = torch.from_numpy(np.asarray(docs[lo:hi], dtype=np.int64))
        labels = window[1:].clone()
        if self.mask_cross_document_labels:
            labels[window_docs[1:] != window_docs[:-1]] = IGNORE_INDEX
        return {
            "input_ids": window[:-1],
            "labels": labels,
            "position_ids": torch.arange(self.seq_len, dtype=torch.int64),
            "document_ids": window_docs[:-1],
        }


def load_split(packed_dir: Path, split: str, seq_len: int, **kwargs) -> PackedSequenceDataset:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return PackedSequenceDataset(
        packed_dir / f"{split}.tokens.npy", packed_dir / f"{split}.documents.npy", seq_len, **kwargs
    )


def packed_meta(packed_dir: Path) -> dict:
    return read_json(packed_dir / "meta.json")
