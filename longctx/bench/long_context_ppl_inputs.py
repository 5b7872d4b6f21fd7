"""What benchmarks/long_context_ppl.py evaluates: a GPT from a checkpoint (read as data
only unless trusted), its RoPE changed in place, a tokenizer, and the evaluation corpus
tokenized and packed as LongDocumentDataModule packs it (longctx.data.eval_stream)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from longctx.checkpoint_verify import read_manifest

# The data half moved to longctx.data.eval_stream (the evaluation tool reads the same stream).
from longctx.data.eval_stream import (
    AUTO_FALLBACK,
    AUTO_MIN_TEST_BYTES,
    load_eval_stream,
    resolve_eval_corpus,
    tree_corpus,
)
from longctx.models.run_checkpoint import extract_gpt_state, load_run_checkpoint, resolve_run_checkpoint
from longctx.models.run_checkpoint import torch_load_data as _torch_load

__all__ = [
    "AUTO_FALLBACK",
    "AUTO_MIN_TEST_BYTES",
    "extract_gpt_state",
    "load_checkpoint_model",
    "load_eval_stream",
    "load_tokenizer",
    "resolve_eval_corpus",
    "set_rope",
    "tree_corpus",
]

# ---- model -------------------------------------------------------------------------------


def load_checkpoint_model(
    path: str,
    overrides: dict,
    *,
    init_from: Optional[str] = None,
    preset: Optional[str] = None,
    trust_code: bool = False,
):
    """A GPT from a Lightning checkpoint (``CausalLMModule``) or a plain saved state dict.

    ``trust_code``: allow a full unpickle of the file (it can run code); off by default.
    """
    from longctx.models import GPT, GPTConfig
    from longctx.models.checkpoint_import import load_checkpoint, load_into

    p = Path(path)
    if p.is_dir():  # a run directory, its checkpoints/ directory or a sharded .ckpt folder
        p = resolve_run_checkpoint(p)
    if p.is_dir():  # sharded (an FSDP2 run's): its model tensors and saved config only
        config, gpt_state = load_run_checkpoint(p)
        model = GPT(config.replace(**overrides) if overrides else config)
        load_into(model, gpt_state, source=str(p))
        info = {
            "checkpoint": str(p),
            "config_from": "checkpoint hyper_parameters",
            "ignored_keys": 0,
            "global_step": read_manifest(p)["global_step"],
        }
        return model, info
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {path!r} does not exist (give a .ckpt file or a run directory)")
    ckpt = _torch_load(p, trust_code=trust_code)
    if not isinstance(ckpt, dict):
        raise TypeError(f"{p}: expected a checkpoint dict, got {type(ckpt).__name__}")
    state = ckpt.get("state_dict", ckpt)
    saved_cfg = (ckpt.get("hyper_parameters") or {}).get("model")
    if isinstance(saved_cfg, dict):
        config, source = GPTConfig.from_dict(dict(saved_cfg)), "checkpoint hyper_parameters"
    elif init_from is not None:
        config, source = load_checkpoint(init_from)[0], f"--init-from {init_from}"
    elif preset is not None:
        config, source = GPTConfig.from_preset(preset), f"--preset {preset}"
    else:
        raise ValueError(f"{p} carries no model config (hyper_parameters['model']); pass --init-from or --preset")
    model = GPT(config.replace(**overrides) if overrides else config)
    gpt_state, other = extract_gpt_state(state, set(model.state_dict()))
    load_into(model, gpt_state, source=str(p))  # names every missing / mis-shaped tensor
    info = {
        "checkpoint": str(p),
        "config_from": source,
        "ignored_keys": len(other),
        "global_step": ckpt.get("global_step"),
    }
    return model, info


def set_rope(model, theta: float, scaling: Optional[dict]) -> None:
    """Change the RoPE base of a built model in place (RoPE has no table: nothing to rebuild)."""
    from longctx.models import RingSelfAttention

    model.config = model.config.replace(rope_theta=float(theta), rope_scaling=scaling)
    for m in model.modules():
        if isinstance(m, RingSelfAttention):
            m.rope_theta, m.rope_scaling = float(theta), scaling


def load_tokenizer(spec: str):
    from longctx.data import as_text_tokenizer
    from longctx.models import GGUFTokenizer

    return GGUFTokenizer.from_gguf(spec) if GGUFTokenizer.accepts(spec) else as_text_tokenizer(spec)
