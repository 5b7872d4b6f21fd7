"""``LongDocumentDataModule``: long documents -> packed full-length sequences for Lightning.

Batches are dicts of FULL-LENGTH ``(batch_size, seq_len)`` int64 tensors:
``input_ids``, ``labels`` (shifted on the full sequence, -100 = ignore),
``position_ids`` (0..seq_len-1) and ``document_ids``. A context-parallel strategy
slices them per rank with ``longctx.sharding.shard_batch``; the module itself never
shards. ``batch_size`` is per data-parallel rank: the ranks of a context-parallel group
receive the same samples (see ``ContextParallelSampler``).

Work happens in ``prepare_data`` (once per node: train the tokenizer if needed,
tokenize, pack; all cached) and ``setup`` (every rank: memory-map the cached streams).
All arguments are checked before any of that starts; problems only the data can
reveal (a corpus smaller than one global batch) are reported after tokenizing, and
since the tokenized corpus is cached (independently of ``seq_len``), a corrected rerun
starts in seconds.

Resume: the training dataloader is a ``ResumableDataLoader`` whose state Lightning keeps
in checkpoints; ``state_dict``/``load_state_dict`` of the module carry it too, for loops
that checkpoint the data module themselves.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union, get_args

import lightning as L
import torch
from torch.utils.data import DataLoader

from ..layouts import Layout, check_layout, check_seq_len
from ..validation import ArgumentPathError, ArgumentValueError, check_choice
from .cache import PathLike, default_cache_dir, read_json
from .packing import PackedSequenceDataset, load_split, pack_corpus, packed_meta, tokenize_corpus
from .sampler import ContextParallelSampler, ResumableDataLoader
from .sources import Corpus, resolve_corpus
from .tokenizer import MIN_SPM_VOCAB, SentencePieceTokenizer, TextTokenizer, as_text_tokenizer

logger = logging.getLogger("longctx.data")

_STATE_VERSION = 1
TokenizerModelType = Literal["bpe", "unigram"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentValueError(name, f"must be a positive int, got {value!r}")
    return value


def _training_texts(documents: Any, max_chars: int, seed: int) -> list[str]:
    """Texts to sample a tokenizer's training lines from, without reading a huge corpus whole.

    A seeded subset of documents holding roughly 8x the character budget (judged from the
    mean length of 64 random documents); the tokenizer then takes windows from each.
    """
    import numpy as np

    n = len(documents)
    rng = np.random.default_rng(seed)
    probe = np.sort(rng.choice(n, size=min(n, 64), replace=False))
    mean_chars = max(1.0, float(np.mean([len(t) for t in documents.select(probe, keep_in_memory=True)["text"]])))
    want = int(min(n, max(64, 8 * max_chars / mean_chars)))
    if want >= n:
        return list(documents["text"])
    chosen = np.sort(rng.choice(n, size=want, replace=False))
    return list(documents.select(chosen, keep_in_memory=True)["text"])


class LongDocumentDataModule(L.LightningDataModule):
    """Long-document language-modelling data for (context-parallel) Lightning training.

    Args:
        data_path: the corpus (see ``longctx.data.sources``): a directory of text files,
            a ``.txt``/``.jsonl``/``.parquet``/``.arrow`` file or directory of them, a
            ``save_to_disk`` directory; ``None``/``"stdlib"``/``"stdlib:json,email"`` for the
            embedded Python-stdlib corpus.
        text_column: column holding the text in table sources.
        tokenizer: ``None`` (train a SentencePiece model on the corpus, cached), a path (a
            SentencePiece ``.model`` or a Hugging Face tokenizer directory), or an object
            meeting ``TextTokenizer`` (or a Hugging Face tokenizer).
        vocab_size: vocabulary of the tokenizer trained on the corpus.
        tokenizer_model_type: ``"bpe"`` or ``"unigram"``, for the trained tokenizer.
        tokenizer_train_chars: characters of the corpus the tokenizer is trained on.
        seq_len: tokens per sample (model input length); windows hold ``seq_len + 1``.
        batch_size: samples per data-parallel rank and step.
        val_fraction: share of tokens (whole documents, seeded) held out for validation.
        seed: split and shuffling seed; shuffling also depends on the epoch.
        cache_dir: where tokenizers, tokenized and packed corpora are cached
            (default ``$LONGCTX_CACHE_DIR`` or ``~/.cache/longctx``).
        num_workers: ``DataLoader`` worker processes. None: 1 where the run is on a GPU (each
            batch is then prepared for its rank — document balance, shard, document plan — while
            the GPUs run the previous step), else 0 (a CPU run, also on a GPU host).
        pin_memory: ``DataLoader`` setting; None: whether the run is on a GPU.
        max_documents: use only the first N documents (tests, quick runs).
        context_parallel_size: to check ``seq_len`` splits over the CP group; ``None`` reads
            it from the trainer's strategy.
        layout: the CP group's sequence layout (``"zigzag"`` or ``"contiguous"``), for that check.
        mask_cross_document_labels: ignore labels that cross into another document.
        include_tests: include the stdlib's test packages in the default corpus.
        stdlib_documents: what one document of the default corpus is: ``"package"`` (a
            whole stdlib package, often over 100K tokens) or ``"file"`` (one ``.py`` file, a
            few thousand tokens: packed sequences of many documents).
        num_proc: tokenizing processes (``None``: automatic).
    """

    def __init__(
        self,
        data_path: Union[None, PathLike, Sequence[PathLike]] = None,
        *,
        text_column: str = "text",
        tokenizer: Union[None, PathLike, TextTokenizer, Any] = None,
        vocab_size: int = 8192,
        seq_len: int = 2048,
        batch_size: int = 1,
        val_fraction: float = 0.01,
        seed: int = 1234,
        cache_dir: Optional[PathLike] = None,
        num_workers: Optional[int] = None,
        max_documents: Optional[int] = None,
        context_parallel_size: Optional[int] = None,
        layout: Layout = "zigzag",
        tokenizer_model_type: TokenizerModelType = "bpe",
        tokenizer_train_chars: int = 4_000_000,
        mask_cross_document_labels: bool = True,
        include_tests: bool = False,
        stdlib_documents: Literal["package", "file"] = "package",
        num_proc: Optional[int] = None,
        pin_memory: Optional[bool] = None,
    ):
        super().__init__()
        # Every argument is checked here, before anything slow can start.
        self.seq_len = _positive_int("seq_len", seq_len)
        self.batch_size = _positive_int("batch_size", batch_size)
        if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
            raise ArgumentValueError("val_fraction", f"must be in [0, 1), got {val_fraction!r}")
        if num_workers is not None and (
            isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
        ):
            raise ArgumentValueError("num_workers", f"must be an int >= 0 or null, got {num_workers!r}")
        if not isinstance(text_column, str) or not text_column:
            raise ArgumentValueError("text_column", f"must be a non-empty string, got {text_column!r}")
        if max_documents is not None:
            _positive_int("max_documents", max_documents)
        if num_proc is not None:
            _positive_int("num_proc", num_proc)
        check_layout(layout)
        if context_parallel_size is not None and _positive_int("context_parallel_size", context_parallel_size) > 1:
            check_seq_len(self.seq_len, context_parallel_size, layout)
        if tokenizer is None:
            if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_SPM_VOCAB:
                raise ArgumentValueError(
                    "vocab_size", f"must be an int >= {MIN_SPM_VOCAB} to train a tokenizer, got {vocab_size!r}"
                )
            check_choice("tokenizer_model_type", tokenizer_model_type, get_args(TokenizerModelType))
            _positive_int("tokenizer_train_chars", tokenizer_train_chars)
        elif isinstance(tokenizer, (str, os.PathLike)) and not Path(tokenizer).exists():
            raise ArgumentPathError("tokenizer", f"path {str(tokenizer)!r} does not exist")
        elif not isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = as_text_tokenizer(tokenizer)  # TypeError now rather than after loading data
        self.data_path = data_path
        self.text_column = text_column
        self.vocab_size = vocab_size
        self.val_fraction = float(val_fraction)
        self.seed = int(seed)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.num_workers = num_workers  # None: decided by the run's device (property below)
        self.max_documents = max_documents
        self.context_parallel_size = context_parallel_size
        self.layout = layout
        self.tokenizer_model_type = tokenizer_model_type
        self.tokenizer_train_chars = tokenizer_train_chars
        self.mask_cross_document_labels = mask_cross_document_labels
        self.include_tests = include_tests
        self.stdlib_documents = stdlib_documents
        self.num_proc = num_proc
        self.pin_memory = pin_memory
        self._tokenizer_arg = tokenizer
        # Resolving the corpus lists its files and validates names: cheap, so do it now.
        self._corpus: Corpus = resolve_corpus(
            data_path,
            text_column=text_column,
            max_documents=max_documents,
            cache_dir=self.cache_dir,
            include_tests=include_tests,
            stdlib_documents=stdlib_documents,
        )
        self._tokenizer: Optional[TextTokenizer] = None
        self._packed_dir: Optional[Path] = None
        self.train_dataset: Optional[PackedSequenceDataset] = None
        self.val_dataset: Optional[PackedSequenceDataset] = None
        self._train_loader: Optional[ResumableDataLoader] = None
        self._pending_loader_state: Optional[dict] = None
        self.stats: dict[str, Any] = {}

    # ------------------------------------------------------------------ topology
    def _dp(self) -> tuple[int, int]:
        """(dp size, dp rank): from the trainer's strategy (which knows the CP layout), else (1, 0)."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if kwargs:
            return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))
        return 1, 0

    def _cp(self) -> int:
        if self.context_parallel_size is not None:
            return self.context_parallel_size
        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        return int(getattr(strategy, "context_parallel_size", 1) or 1)

    def _check_topology(self) -> None:
        cp = self._cp()
        if cp > 1:  # one rank splits nothing: any length works
            # The strategy shards the batches, so its layout is the one that must fit.
            strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
            check_seq_len(self.seq_len, cp, getattr(strategy, "layout", None) or self.layout)

    def _is_global_zero(self) -> bool:
        return self.trainer is None or self.trainer.is_global_zero

    # ------------------------------------------------------------------ building
    def get_tokenizer(self) -> TextTokenizer:
        """The tokenizer (trained and cached on first use when none was given).

        Call before building a model to size its vocabulary (``.vocab_size``).
        """
        if self._tokenizer is None:
            arg = self._tokenizer_arg
            if arg is None:
                corpus = self._corpus
                chars, seed = self.tokenizer_train_chars, self.seed
                self._tokenizer = SentencePieceTokenizer.train_or_load(
                    lambda: _training_texts(corpus.load()[0], chars, seed),
                    corpus_fingerprint=corpus.fingerprint,
                    cache_dir=self.cache_dir,
                    vocab_size=self.vocab_size,
                    model_type=self.tokenizer_model_type,
                    max_chars=self.tokenizer_train_chars,
                    seed=self.seed,
                )
            else:
                self._tokenizer = as_text_tokenizer(arg)
        return self._tokenizer

    def _build(self) -> Path:
        tokenizer = self.get_tokenizer()
        tokenized = tokenize_corpus(self._corpus, tokenizer, cache_dir=self.cache_dir, num_proc=self.num_proc)
        packed = pack_corpus(
            tokenized,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            val_fraction=self.val_fraction,
            seed=self.seed,
            cache_dir=self.cache_dir,
        )
        self._corpus.release()  # the raw text is no longer needed
        return packed

    def prepare_data(self) -> None:
        """Once per node (Lightning): tokenizer, tokenized and packed corpus, all cached."""
        self._check_topology()
        self._build()

    def setup(self, stage: Optional[str] = None) -> None:
        self._check_topology()
        if self.train_dataset is not None:
            return  # Lightning calls setup once per stage; the data does not change
        if self._packed_dir is None:
            self._packed_dir = self._build()  # a cache hit when prepare_data ran
        kwargs = {"mask_cross_document_labels": self.mask_cross_document_labels}
        train = load_split(self._packed_dir, "train", self.seq_len, **kwargs)
        val = load_split(self._packed_dir, "val", self.seq_len, **kwargs)
        self._collect_stats(train, val)
        dp_size, _ = self._dp()
        self._check_one_batch(train, dp_size)
        if self.val_fraction > 0 and len(val) < dp_size and self._is_global_zero():
            logger.warning(
                "data: the validation split has %d sequences of %d tokens for %d data-parallel ranks; "
                "validation is skipped (raise val_fraction or lower seq_len)",
                len(val),
                self.seq_len + 1,
                dp_size,
            )
        self.train_dataset, self.val_dataset = train, val

    def check_one_batch(self, data_parallel_size: int = 1) -> None:
        """After ``prepare_data``, before any process starts: a training split smaller than one
        global batch (``batch_size`` x ``data_parallel_size``) is a ``ValueError`` now, not one in
        every rank's ``setup``."""
        packed = self._build()  # the caches prepare_data wrote: memory-mapped, not rebuilt
        self._check_one_batch(load_split(packed, "train", self.seq_len), data_parallel_size)

    def _check_one_batch(self, train: PackedSequenceDataset, dp_size: int) -> None:
        global_batch = self.batch_size * dp_size
        n_train = len(train)
        if n_train < global_batch:
            raise ValueError(
                f"the training split is smaller than one global batch: {train.num_tokens} tokens "
                f"make {n_train} sequences of seq_len+1={self.seq_len + 1} tokens, but one step needs "
                f"batch_size {self.batch_size} x data-parallel size {dp_size} = {global_batch}. Use a larger "
                "corpus, a smaller seq_len or batch_size, or a smaller val_fraction "
                "(the tokenized corpus is cached, so retrying is fast)."
            )

    def _collect_stats(self, train: PackedSequenceDataset, val: PackedSequenceDataset) -> None:
        assert self._packed_dir is not None
        packed = packed_meta(self._packed_dir)
        tokenized = read_json(self.cache_dir / "tokenized" / packed["tokenized"] / "meta.json")
        src = tokenized["source_stats"]
        self.stats = {
            "corpus": tokenized["corpus"],
            "documents": tokenized["documents"],
            "tokens": tokenized["tokens"],
            "skipped_empty": src["skipped_empty"],
            "skipped_binary": src["skipped_binary"],
            "decode_replacements": src["decode_replacements"],
            "files_with_replacements": src["files_with_replacements"],
            "zero_token_documents": packed["zero_token_documents"],
            "train_documents": packed["train"]["documents"],
            "val_documents": packed["val"]["documents"],
            "train_tokens": packed["train"]["tokens"],
            "val_tokens": packed["val"]["tokens"],
            "train_sequences": len(train),
            "val_sequences": len(val),
            "seq_len": self.seq_len,
            "vocab_size": self.get_tokenizer().vocab_size,
        }
        if self._is_global_zero():
            s = self.stats
            logger.info(
                "data: %s: %d documents, %d tokens (%d empty and %d binary skipped, %d non-UTF-8 "
                "replacements in %d files); train %d docs / %d tokens / %d sequences, val %d docs / "
                "%d tokens / %d sequences of %d+1 tokens; vocab %d",
                s["corpus"],
                s["documents"],
                s["tokens"],
                s["skipped_empty"],
                s["skipped_binary"],
                s["decode_replacements"],
                s["files_with_replacements"],
                s["train_documents"],
                s["train_tokens"],
                s["train_sequences"],
                s["val_documents"],
                s["val_tokens"],
                s["val_sequences"],
                self.seq_len,
                s["vocab_size"],
            )

    # ------------------------------------------------------------------ loaders
    def _require_setup(self) -> None:
        if self.train_dataset is None:
            raise RuntimeError("call setup() before asking for dataloaders")

    def _on_gpu(self) -> bool:
        """Whether the batches go to a GPU: the trainer's device where one is attached."""
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return device.type == "cuda" if device is not None else torch.cuda.is_available()

    # Read when the loaders are built (the trainer's device is known by then); assignable, as
    # plain attributes were: None goes back to the device's default.
    @property
    def num_workers(self) -> int:
        return (1 if self._on_gpu() else 0) if self._num_workers_arg is None else self._num_workers_arg

    @num_workers.setter
    def num_workers(self, value: Optional[int]) -> None:
        self._num_workers_arg = value

    @property
    def pin_memory(self) -> bool:
        return self._on_gpu() if self._pin_memory_arg is None else self._pin_memory_arg

    @pin_memory.setter
    def pin_memory(self, value: Optional[bool]) -> None:
        self._pin_memory_arg = None if value is None else bool(value)

    def train_dataloader(self) -> ResumableDataLoader:
        self._require_setup()
        dp_size, dp_rank = self._dp()
        sampler = ContextParallelSampler(
            self.train_dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=self.seed, drop_last=True
        )
        loader = ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )
        if self._pending_loader_state is not None:
            loader.load_state_dict(self._pending_loader_state)
            self._pending_loader_state = None
        if self.trainer is not None:
            # The epoch Lightning will announce with set_epoch, announced now: with worker
            # processes the loader draws its first indices before Lightning's call arrives.
            progress = getattr(getattr(self.trainer, "fit_loop", None), "epoch_progress", None)
            if progress is not None:
                sampler.set_epoch(progress.current.processed)
        self._train_loader = loader
        return loader

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        dp_size, dp_rank = self._dp()
        sampler = ContextParallelSampler(
            self.val_dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False, seed=self.seed, drop_last=True
        )
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    # ------------------------------------------------------------------ checkpoints
    def _identity(self) -> dict[str, Any]:
        return {
            "packed": None if self._packed_dir is None else self._packed_dir.name,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }

    def state_dict(self) -> dict[str, Any]:
        loader = self._train_loader
        loader_state = loader.state_dict() if loader is not None else self._pending_loader_state
        return {"version": _STATE_VERSION, "identity": self._identity(), "train_loader": loader_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        saved, now = state_dict.get("identity", {}), self._identity()
        changed = [k for k in ("packed", "seq_len", "seed") if saved.get(k) != now.get(k) and now.get(k) is not None]
        if changed and self._is_global_zero():
            logger.warning(
                "data: resuming with changed %s (checkpoint %s, now %s); the sampler checks "
                "whether the saved position still applies",
                changed,
                {k: saved.get(k) for k in changed},
                {k: now[k] for k in changed},
            )
        loader_state = state_dict.get("train_loader")
        if loader_state:
            if self._train_loader is not None:
                self._train_loader.load_state_dict(loader_state)
            else:
                self._pending_loader_state = loader_state
