"""Run by tests/lightning/test_sync_free_steps.py under torchrun (2 GPUs): whole Lightning training steps,
CP = 2, packed documents, with the training step (from the batch's arrival through the
backward, every hook between) under ``torch.cuda.set_sync_debug_mode("error")`` after two
warm-up steps. Writes {"checked": steps run under it, "losses": [...]} to argv[1]."""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from longctx import ContextParallelStrategy
from longctx.lightning.module import CausalLMModule

SEQ, STEPS, WARM_UP = 4096, 6, 2


class PackedDocuments(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        gen = torch.Generator().manual_seed(i)
        lengths = torch.randint(16, 1500, (64,), generator=gen)
        ids = torch.repeat_interleave(torch.arange(64), lengths)[:SEQ]
        tokens = torch.randint(0, 256, (SEQ + 1,), generator=gen)
        return {"input_ids": tokens[:-1], "labels": tokens[1:], "document_ids": ids}


class SyncFree(L.Callback):
    def __init__(self) -> None:
        self.checked, self.losses = 0, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= WARM_UP:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if torch.cuda.get_sync_debug_mode():
            torch.cuda.set_sync_debug_mode(0)
            self.checked += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def main(out: str) -> None:
    torch.manual_seed(0)
    module = CausalLMModule(
        # head_dim 64 and GQA 4, as the 1B shape: the same FlashAttention-4 variants
        dict(preset="tiny", vocab_size=256, n_embd=512, n_head=8, n_kv_head=2, max_seq_len=SEQ),
        attention="document",
        seq_len=SEQ,
        warmup_steps=1,
    )
    check = SyncFree()
    trainer = L.Trainer(
        strategy=ContextParallelStrategy(context_parallel_size=2),
        devices=2,
        accelerator="gpu",
        precision="bf16-mixed",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1000,
        callbacks=[check],
    )
    loader = DataLoader(PackedDocuments(), batch_size=1, num_workers=1, pin_memory=True)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"checked": check.checked, "losses": check.losses}, f)


if __name__ == "__main__":
    main(sys.argv[1])
