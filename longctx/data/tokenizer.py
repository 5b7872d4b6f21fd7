"""Tokenizers for the data pipeline.

* ``TextTokenizer``: the protocol every tokenizer meets (fixed interface):
  ``vocab_size``, ``eos_id``, ``bos_id`` (``None`` when there is none), ``encode(text)``
  (no BOS/EOS added: the packer puts separators between documents) and ``decode(ids)``.
* ``SentencePieceTokenizer``: loads a ``.model`` file, or trains one on a corpus
  sample in seconds (byte-level BPE with byte fallback, identity normalisation and
  whitespace kept as is, so ``decode(encode(t)) == t`` for any text: code indentation,
  tabs, ``\\r\\n`` and emoji included).
* ``as_text_tokenizer``: turns a path, a ``TextTokenizer``-like object or a Hugging Face
  tokenizer into a ``TextTokenizer``.
* ``tokenizer_fingerprint``: the cache key of a tokenizer (tokenized corpora are cached
  per tokenizer).

Optional extras a tokenizer may offer and the pipeline uses when present:
``encode_batch(texts) -> list[list[int]]`` (faster bulk tokenizing) and
``fingerprint: str`` (an exact cache key).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, Union, runtime_checkable

from .cache import PathLike, publish, stable_hash, tmp_sibling, write_json

logger = logging.getLogger("longctx.data")

# Bumped when the training recipe changes, so old cached models are not reused.
_SPM_RECIPE_VERSION = 1
# Byte pieces (256) + unk/bos/eos + a few characters: below this byte-fallback training fails.
MIN_SPM_VOCAB = 300


@runtime_checkable
class TextTokenizer(Protocol):
    vocab_size: int
    eos_id: int
    bos_id: Optional[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece model as a ``TextTokenizer``; picklable (for ``datasets.map(num_proc>1)``)."""

    def __init__(self, model_path: Optional[PathLike] = None, *, model_proto: Optional[bytes] = None):
        if (model_path is None) == (model_proto is None):
            raise TypeError("give exactly one of model_path or model_proto")
        if model_path is not None:
            path = Path(model_path)
            if not path.is_file():
                raise FileNotFoundError(f"SentencePiece model {str(path)!r} does not exist")
            model_proto = path.read_bytes()
        self._load(model_proto)  # type: ignore[arg-type]
        self.model_path = str(model_path) if model_path is not None else None

    def _load(self, proto: bytes) -> None:
        import sentencepiece as spm

        self._proto = proto
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(proto)
        except Exception as e:  # noqa: BLE001 - sentencepiece raises bare RuntimeError/OSError
            raise ValueError(f"not a valid SentencePiece model: {e}") from e
        self.vocab_size: int = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError("the SentencePiece model has no EOS piece (eos_id < 0); documents need one")
        self.eos_id: int = eos
        bos = self._sp.bos_id()
        self.bos_id: Optional[int] = bos if bos >= 0 else None
        self.fingerprint: str = hashlib.sha256(proto).hexdigest()[:32]

    # Pickle the model bytes: SentencePieceProcessor itself is not reliably picklable.
    def __getstate__(self) -> dict:
        return {"proto": self._proto, "model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self._load(state["proto"])
        self.model_path = state["model_path"]

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: Optional[int] = None) -> list[list[int]]:
        # SentencePiece parallelises a batch in C++ threads, no processes needed.
        return self._sp.encode(list(texts), num_threads=num_threads or os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def save(self, path: PathLike) -> None:
        Path(path).write_bytes(self._proto)

    def __repr__(self) -> str:
        src = self.model_path or "in-memory"
        return f"SentencePieceTokenizer({src!r}, vocab_size={self.vocab_size})"

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        *,
        vocab_size: int = 8192,
        model_type: str = "bpe",
        max_chars: int = 4_000_000,
        seed: int = 0,
        num_threads: Optional[int] = None,
    ) -> "SentencePieceTokenizer":
        """Train on a bounded, seeded sample of ``texts`` (at most ``max_chars`` characters)."""
        import sentencepiece as spm

        _check_spm_settings(vocab_size, model_type, max_chars)
        lines = sample_training_lines(texts, max_chars=max_chars, seed=seed)
        if not lines:
            raise ValueError("cannot train a tokenizer: the corpus sample holds no non-blank line")
        model = io.BytesIO()
        spm.set_random_generator_seed(seed)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                # Any byte round-trips: characters outside the vocabulary become byte pieces.
                byte_fallback=True,
                # Keep text exactly as written (code!): no NFKC, no whitespace collapsing,
                # no dummy leading space; runs of spaces (indentation) may become one piece.
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                character_coverage=0.9995,
                max_sentence_length=16384,
                num_threads=num_threads or max(1, min(8, os.cpu_count() or 1)),
                minloglevel=2,
            )
        except RuntimeError as e:
            hint = (
                " A vocabulary larger than the text supports needs a smaller vocab_size or more text."
                if "ocabulary size" in str(e)
                else ""
            )
            raise ValueError(
                f"SentencePiece training failed for vocab_size={vocab_size} on a sample of "
                f"{len(lines)} lines ({sum(map(len, lines))} characters): {e}.{hint}"
            ) from e
        return cls(model_proto=model.getvalue())

    @classmethod
    def train_or_load(
        cls,
        texts_fn: Callable[[], Iterable[str]],
        *,
        corpus_fingerprint: str,
        cache_dir: PathLike,
        vocab_size: int = 8192,
        model_type: str = "bpe",
        max_chars: int = 4_000_000,
        seed: int = 0,
    ) -> "SentencePieceTokenizer":
        """The cached model for (corpus, settings), training it first if absent.

        ``texts_fn`` is only called on a cache miss, so a warm start reads no corpus text.
        """
        _check_spm_settings(vocab_size, model_type, max_chars)
        path = spm_cache_path(
            cache_dir, corpus_fingerprint, vocab_size=vocab_size, model_type=model_type, max_chars=max_chars, seed=seed
        )
        if path.is_file():
            try:
                tok = cls(path)
                recorded = _recorded_fingerprint(path)
                if recorded is not None and recorded != tok.fingerprint:
                    raise ValueError(f"its sha256 {tok.fingerprint[:16]}... is not the recorded {recorded[:16]}...")
                logger.info("tokenizer: reusing cached SentencePiece model %s", path)
                return tok
            except ValueError as exc:  # a damaged file (truncated, overwritten): trained again
                logger.warning("tokenizer: the cached model %s is damaged (%s); training it again", path, exc)
        logger.info("tokenizer: training a SentencePiece %s model (vocab_size=%d) -> %s", model_type, vocab_size, path)
        tok = cls.train(texts_fn(), vocab_size=vocab_size, model_type=model_type, max_chars=max_chars, seed=seed)
        tmp = tmp_sibling(path)
        tok.save(tmp)
        publish(tmp, path)
        write_json(
            path.with_suffix(".json"),
            {
                "corpus_fingerprint": corpus_fingerprint,
                "vocab_size": vocab_size,
                "model_type": model_type,
                "max_chars": max_chars,
                "seed": seed,
                "recipe": _SPM_RECIPE_VERSION,
                "fingerprint": tok.fingerprint,  # checked when the cached file is reused
            },
        )
        return cls(path)


def _recorded_fingerprint(model_path: Path) -> Optional[str]:
    """The fingerprint (sha256 of the bytes) written beside a cached model, if any."""
    try:
        value = json.loads(model_path.with_suffix(".json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def spm_cache_path(cache_dir: PathLike, corpus_fingerprint: str, **settings: Any) -> Path:
    import sentencepiece as spm

    key = stable_hash(corpus_fingerprint, settings, _SPM_RECIPE_VERSION, spm.__version__)
    return Path(cache_dir) / "tokenizers" / f"spm-{settings.get('vocab_size')}-{key}.model"


def _check_spm_settings(vocab_size: int, model_type: str, max_chars: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < MIN_SPM_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size!r} is too small for a byte-fallback SentencePiece model: "
            f"it needs at least {MIN_SPM_VOCAB} (256 byte pieces + specials + characters)"
        )
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")


def sample_training_lines(texts: Iterable[str], *, max_chars: int, seed: int = 0) -> list[str]:
    """Non-blank lines from ``texts``, at most about ``max_chars`` characters, seeded.

    Each document contributes a contiguous window of lines proportional to its length,
    so every document is represented while training stays bounded (seconds).
    """
    docs = [t for t in texts if t]
    total = sum(len(t) for t in docs)
    rng = random.Random(seed)
    lines: list[str] = []
    for text in docs:
        if total > max_chars:
            share = max(1, int(max_chars * len(text) / total))
            start = rng.randrange(0, max(1, len(text) - share + 1))
            start = text.rfind("\n", 0, start) + 1  # begin on a line boundary
            text = text[start : start + share]
        lines.extend(line for line in text.split("\n") if line.strip())
    return lines


class _ProtocolAdapter:
    """Adds ``bos_id = None`` to an object that has everything else of ``TextTokenizer``."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.vocab_size = int(inner.vocab_size)
        self.eos_id = int(inner.eos_id)
        self.bos_id = None

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(list(ids))

    def __repr__(self) -> str:
        return f"TextTokenizer({self.inner!r})"


class HFTokenizerAdapter:
    """A Hugging Face ``transformers`` tokenizer as a ``TextTokenizer`` (no special tokens added)."""

    def __init__(self, hf: Any):
        if getattr(hf, "eos_token_id", None) is None:
            raise ValueError(f"the Hugging Face tokenizer {type(hf).__name__} has no eos_token_id")
        self.hf = hf
        self.vocab_size = len(hf)  # includes added tokens, unlike hf.vocab_size
        self.eos_id = int(hf.eos_token_id)
        self.bos_id = None if hf.bos_token_id is None else int(hf.bos_token_id)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None:
            self.fingerprint = hashlib.sha256(backend.to_str().encode()).hexdigest()[:32]

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.hf(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __repr__(self) -> str:
        return f"HFTokenizerAdapter({type(self.hf).__name__}, vocab_size={self.vocab_size})"


_REQUIRED = ("encode", "decode", "vocab_size", "eos_id")


def as_text_tokenizer(obj: Union[PathLike, Any]) -> TextTokenizer:
    """A ``TextTokenizer`` from a path or an object.

    * path to a ``.model`` file -> ``SentencePieceTokenizer``; a directory or
      ``tokenizer.json`` -> Hugging Face ``AutoTokenizer`` (local files only; needs
      ``transformers``).
    * an object with ``encode``/``decode``/``vocab_size``/``eos_id`` (``bos_id``
      optional, taken as ``None`` when missing) -> itself.
    * a Hugging Face tokenizer (``eos_token_id``, ``__call__``) -> ``HFTokenizerAdapter``.
    """
    if isinstance(obj, (str, os.PathLike)):
        return _load_tokenizer_path(Path(obj))
    if all(hasattr(obj, a) for a in _REQUIRED):
        return obj if hasattr(obj, "bos_id") else _ProtocolAdapter(obj)
    if hasattr(obj, "eos_token_id") and callable(obj) and hasattr(obj, "encode"):
        return HFTokenizerAdapter(obj)
    missing = [a for a in _REQUIRED if not hasattr(obj, a)]
    raise TypeError(
        f"{type(obj).__name__} is not a tokenizer: it lacks {missing} (a TextTokenizer needs "
        "encode, decode, vocab_size, eos_id and optionally bos_id; Hugging Face tokenizers are accepted too)"
    )


def _load_tokenizer_path(path: Path) -> TextTokenizer:
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.is_dir() or path.name == "tokenizer.json":
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(f"loading the Hugging Face tokenizer at {str(path)!r} needs 'transformers'") from None
        return HFTokenizerAdapter(
            AutoTokenizer.from_pretrained(str(path if path.is_dir() else path.parent), local_files_only=True)
        )
    raise ValueError(
        f"do not know how to load a tokenizer from {str(path)!r}: expected a SentencePiece .model file, "
        "a Hugging Face tokenizer directory or tokenizer.json"
    )


def tokenizer_fingerprint(tok: TextTokenizer) -> str:
    """A cache key for ``tok``: exact when the tokenizer can say (``fingerprint``), else best effort."""
    fp = getattr(tok, "fingerprint", None)
    if isinstance(fp, str) and fp:
        return fp
    try:
        from datasets.fingerprint import Hasher

        return "hash-" + Hasher.hash(tok)
    except Exception:  # noqa: BLE001 - unpicklable object: fall back to probing its behaviour
        pass
    logger.warning(
        "tokenizer %r has no 'fingerprint' and cannot be hashed; its cache key is a probe of its "
        "behaviour. Give it a 'fingerprint' attribute to make caching exact.",
        tok,
    )
    probe = "The quick brown fox 0123456789 jumps over\n\tthe lazy dog; déjà vu 日本語 ✓ 😀 def f(x): return x\n"
    return "probe-" + stable_hash(
        type(tok).__qualname__, tok.vocab_size, tok.eos_id, getattr(tok, "bos_id", None), tok.encode(probe), length=32
    )
