"""A Hugging Face Llama trained through the strategy: FSDP2 per decoder layer x CP=2 ring
attention (longctx.hf) equals the same model trained on one device."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
from helpers.dist_harness import run_distributed  # noqa: E402

from longctx.lightning.strategy import ContextParallelStrategy  # noqa: E402

VOCAB, SEQ, N_SAMPLES, STEPS = 64, 32, 8, 3
PLAN = dict(attention_backend="torch", loss_chunk_size=40, activation_checkpointing="full")


def _hf_dir(path: str) -> str:
    import transformers

    transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=500.0,
        tie_word_embeddings=False,
    ).save_pretrained(path)
    return path


def _samples() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ + 1), generator=g)
    out = []
    for i, t in enumerate(tokens):
        labels = t[1:].clone()
        labels[: i % 3 * 5] = -100  # uneven label counts: only the exact global mean matches
        out.append({"input_ids": t[:-1].clone(), "labels": labels})
    return out


def _fit(strategy, devices: int, hf_dir: str) -> dict:
    from torch.distributed.tensor import DTensor

    from longctx.lightning.module import CausalLMModule

    torch.manual_seed(0)
    module = CausalLMModule(hf_model=hf_dir, parallel=PLAN, lr=3e-3, warmup_steps=1, decay_steps=STEPS)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=devices > 1,
    )
    trainer.fit(module, DataLoader(_samples(), batch_size=4))
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in module.parameters()]
    sharded = [isinstance(p, DTensor) for p in module.parameters()]
    return {
        "params": torch.cat([p.detach().flatten() for p in full]).tolist(),
        "sharded": sharded,
        "loss": float(trainer.callback_metrics["train_loss"]),
    }


def _worker(rank: int, world: int, hf_dir: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", PL_GLOBAL_SEED="0")
    return _fit(ContextParallelStrategy(context_parallel_size=2, data_parallel="fsdp"), 2, hf_dir)


@pytest.mark.slow
def test_hf_llama_fsdp_cp2_equals_one_device(tmp_path):
    hf_dir = _hf_dir(str(tmp_path / "llama"))
    results = run_distributed(_worker, 2, hf_dir)
    # One device, the same global batches in the same order (no sampler at all).
    ref = _fit("auto", 1, hf_dir)
    ref_params = torch.tensor(ref["params"], dtype=torch.float64)
    for out in results:
        assert all(out["sharded"])
        err = ((torch.tensor(out["params"], dtype=torch.float64) - ref_params).norm() / ref_params.norm()).item()
        assert err < 1e-5, err
        assert abs(out["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert torch.isfinite(ref_params).all()
