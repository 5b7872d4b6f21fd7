"""FSDP2 x CP checkpoints: a sharded checkpoint (a folder of per-rank shards) resumes
bit-exactly, and what it holds is sharded, not gathered."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from helpers.dist_harness import run_distributed
from torch.utils.data import DataLoader

from longctx.lightning.strategy import ContextParallelStrategy

VOCAB, SEQ, N_SAMPLES, BATCH = 64, 32, 8, 4  # 2 optimizer steps per epoch
MODEL = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)
PLAN = dict(attention_backend="torch", loss_chunk_size=48)


def _samples() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ + 1), generator=g)
    return [{"input_ids": t[:-1].clone(), "labels": t[1:].clone()} for t in tokens]


def _fit(max_steps: int, ckpt_dir: str, resume: str | None = None, save_every: int = 0):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.tensor import DTensor

    from longctx.lightning.module import CausalLMModule

    torch.manual_seed(0)
    module = CausalLMModule(MODEL, parallel=PLAN, lr=3e-3, warmup_steps=1, decay_steps=4)
    callbacks = []
    if save_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir,
                filename="step{step}",
                every_n_train_steps=save_every,
                save_top_k=-1,
                auto_insert_metric_name=False,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ContextParallelStrategy(context_parallel_size=2, data_parallel="fsdp"),
        max_steps=max_steps,
        precision="32-true",
        logger=False,
        enable_checkpointing=bool(save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(_samples(), batch_size=BATCH), ckpt_path=resume)
    params = {
        k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for k, p in module.named_parameters()
    }
    opt = trainer.optimizers[0]
    moments = {k: opt.state[p]["exp_avg"].full_tensor().clone() for k, p in module.named_parameters()}
    return params, moments, trainer.global_step


def _worker(rank: int, world: int, ckpt_dir: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", PL_GLOBAL_SEED="0")
    straight, straight_m, _ = _fit(4, ckpt_dir, save_every=2)  # saves step2 on the way
    saved = os.path.join(ckpt_dir, "step2.ckpt")
    resumed, resumed_m, step = _fit(4, ckpt_dir, resume=saved)
    return {
        "step": step,
        "is_folder": os.path.isdir(saved),
        "param_diff": max((straight[k] - resumed[k]).abs().max().item() for k in straight),
        "moment_diff": max((straight_m[k] - resumed_m[k]).abs().max().item() for k in straight_m),
        "moved": max((straight[k].norm() for k in straight)).item(),
    }


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_exactly(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path))
    for out in results:
        assert out["step"] == 4 and out["is_folder"], out
        assert out["param_diff"] == 0.0 and out["moment_diff"] == 0.0, out
    files = os.listdir(tmp_path / "step2.ckpt")
    assert sum(f.endswith(".distcp") for f in files) == 2, files  # one shard file per rank
