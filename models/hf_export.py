"""Save a ``GPT`` as a Hugging Face Llama checkpoint (``save_pretrained`` layout).

``save_hf_checkpoint(model, path)`` writes ``config.json`` (LlamaConfig fields, written by
the installed transformers' own ``LlamaConfig``) and ``model.safetensors`` with Hugging
Face names from the import's table (``checkpoint_import.hf_tensor_name``), so that
``LlamaForCausalLM.from_pretrained(path)`` and ``load_pretrained(path)`` both load it
with the same logits.

RoPE: plain and ``linear`` scaling map to Llama's ``default`` and ``linear`` rope types.
Static ``ntk`` scaling is a change of base only, so it is written as a ``default`` rope
with the scaled base (the same expression ``pointwise.rope_inv_freq`` uses: identical
frequencies); ``load_pretrained`` then reads ``rope_theta`` = that base and no scaling.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Optional, Union

import torch

from .checkpoint_import import hf_tensor_name
from .config import GPTConfig
from .gpt import GPT


def _rope_fields(config: GPTConfig) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling in Hugging Face's form or None)."""
    scaling = config.rope_scaling
    if scaling is None:
        return config.rope_theta, None
    if scaling["type"] == "linear":
        return config.rope_theta, {"rope_type": "linear", "factor": float(scaling["factor"])}
    if scaling["type"] == "ntk":
        d = config.head_dim
        return config.rope_theta * scaling["factor"] ** (d / (d - 2)), None
    raise ValueError(f"RoPE scaling {scaling!r} has no Hugging Face Llama equivalent")


def _llama_config(config: GPTConfig, dtype: torch.dtype):
    try:
        from transformers import LlamaConfig
    except ImportError:
        raise ImportError("saving a Hugging Face checkpoint needs transformers: pip install 'longctx[hf]'") from None
    theta, scaling = _rope_fields(config)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers 5
        rope = {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})}}
    else:
        rope = {"rope_theta": theta, "rope_scaling": scaling}
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        initializer_range=config.init_std,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
        dtype=str(dtype).removeprefix("torch."),
        **rope,
    )


def save_hf_checkpoint(
    model: GPT, path: Union[str, "os.PathLike[str]"], *, dtype: Optional[torch.dtype] = None
) -> Path:
    """Write ``model`` to directory ``path`` as a Hugging Face Llama checkpoint; returns ``path``.

    ``dtype`` casts the saved tensors (default: as the model holds them). A tied model
    stores the embedding only, as ``save_pretrained`` does.
    """
    from safetensors.torch import save_file

    if not isinstance(model, GPT):
        raise TypeError(f"save_hf_checkpoint expects a longctx.models.GPT, got {type(model).__name__}")
    state = model.state_dict()
    dtype = dtype or state["embed.weight"].dtype
    tensors = {hf_tensor_name(name): t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in state.items()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _llama_config(model.config, dtype).to_json_file(str(path / "config.json"))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
