"""A Hugging Face causal LM behind the same training interface as ``GPT``.

``HFCausalLM.from_pretrained(path)`` loads a Llama/Qwen2/Mistral-style checkpoint with
``attn_implementation="longctx_ring"`` (or ``"longctx_ulysses"``; see ``longctx.hf``), or
builds the model from its ``config.json`` with random weights when the directory holds no
weights. The wrapper gives the training module what it gives a ``GPT``:

* ``forward(input_ids, position_ids, labels=..., document_ids=...)`` -> ``(loss_sum,
  n_tokens)`` from the decoder's hidden states and the chunked cross-entropy (the full
  ``(tokens x vocab)`` logits of a 128K sequence never exist), or logits without labels;
* ``_no_split_modules`` (the decoder layer class), so ``longctx.parallelize`` shards per
  layer with FSDP2, and ``set_activation_checkpointing`` (``"full"`` through transformers'
  gradient checkpointing);
* ``config``: a ``GPTConfig`` with the same sizes, for FLOPs/MFU.

The CP context reaches the attention through ``longctx.parallelize``, which calls
``longctx.hf.set_context_parallel_group`` on the wrapped model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from .config import GPTConfig
from .gpt import chunked_cross_entropy

WEIGHT_SUFFIXES = (".safetensors", ".bin")


def sizes_config(hf_config) -> GPTConfig:
    """A ``GPTConfig`` with the sizes of a Llama-family Hugging Face config (FLOPs, banners)."""
    n_head = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_head
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        n_layer=hf_config.num_hidden_layers,
        n_head=n_head,
        n_kv_head=getattr(hf_config, "num_key_value_heads", None) or n_head,
        n_embd=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        head_dim=head_dim,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_seq_len=getattr(hf_config, "max_position_embeddings", 2048) or 2048,
    )


def _enable_checkpointing(model: nn.Module) -> None:
    # Non-reentrant (autocast, kwargs); transformers 5 renamed gradient_checkpointing_enable.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class HFCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self._no_split_modules = tuple(getattr(hf_model, "_no_split_modules", None) or ())
        self.config = sizes_config(hf_model.config)
        self.loss_chunk_size = 4096

    @classmethod
    def from_pretrained(
        cls, path: Union[str, "os.PathLike[str]"], *, cp_attention: str = "ring", dtype: Optional[torch.dtype] = None
    ) -> "HFCausalLM":
        """Weights from ``path`` (a local directory: no downloads), or a random init from its
        ``config.json`` when it holds no weight files."""
        from transformers import AutoConfig, AutoModelForCausalLM

        import longctx.hf  # noqa: F401 - registers the attention implementations

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--hf-model {path}: no config.json there (a local Hugging Face model directory)")
        implementation = f"longctx_{cp_attention}"
        kwargs = {"attn_implementation": implementation, "dtype": dtype or torch.float32}
        if any(p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir()):
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
        else:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        return cls(model)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def set_activation_checkpointing(self, mode: str) -> None:
        if mode == "full":
            _enable_checkpointing(self.hf)
        elif mode == "none":
            (getattr(self.hf, "activation_checkpointing_disable", None) or self.hf.gradient_checkpointing_disable)()
        else:
            raise ValueError(
                f"activation_checkpointing={mode!r} is not available for Hugging Face models "
                f"({type(self.hf).__name__}); use 'full' or 'none'"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ):
        extra = {} if document_ids is None else {"document_ids": document_ids}
        out = self.hf.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        hidden = out.last_hidden_state
        head = self.hf.get_output_embeddings()
        if labels is None:
            return head(hidden)
        if head.bias is not None:
            raise ValueError(f"{type(self.hf).__name__}: an LM head with a bias is not supported by the chunked loss")
        return chunked_cross_entropy(hidden, head.weight, labels, self.loss_chunk_size)

    def get_input_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def get_output_embeddings(self) -> Optional[nn.Module]:
        return self.hf.get_output_embeddings()
