"""A tiny ``CausalLMModule`` fitted by a one-process CPU Trainer: what several module tests run."""

from __future__ import annotations

from typing import Any


def tiny_batches(n: int, seq: int = 64) -> list[dict]:
    """``n`` random sequences of ``seq`` tokens (vocabulary 256) with their next-token labels."""
    import torch

    return [{"input_ids": t[:-1], "labels": t[1:]} for t in torch.randint(0, 256, (n, seq + 1))]


def tiny_module(cls: Any = None, **kw: Any) -> Any:
    """The tiny preset (vocabulary 256), causal, the torch block kernel, one warm-up step, no
    memory check; ``kw`` overrides; ``cls``: a subclass of ``CausalLMModule``."""
    from longctx.lightning.module import CausalLMModule

    args = dict(parallel={"attention_backend": "torch"}, attention="causal", warmup_steps=1, memory_check=False)
    return (cls or CausalLMModule)(dict(preset="tiny", vocab_size=256), **{**args, **kw})


def cpu_trainer(**kw: Any) -> Any:
    """One CPU process, no logger, checkpoint, progress bar or summary; ``kw`` overrides."""
    import lightning as L

    args = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**args, **kw})
