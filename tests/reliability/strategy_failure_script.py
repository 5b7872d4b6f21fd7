"""A 2-process Lightning run (CP=2, gloo) in which rank 1 raises at its third training step.

Run: python strategy_failure_script.py   (Lightning launches the second process itself)
"""

import lightning as L
import torch
from torch.utils.data import DataLoader

from longctx import ContextParallelStrategy
from longctx.models import GPTConfig, TransformerBlock


class Failing(L.LightningModule):
    def __init__(self):
        super().__init__()
        cfg = GPTConfig.from_preset("tiny", vocab_size=64)
        self.embed = torch.nn.Embedding(64, cfg.n_embd)
        self.block = TransformerBlock(cfg)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("injected failure in training_step")
        return self.block(self.embed(batch["input_ids"]), batch["position_ids"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = [{"input_ids": torch.randint(0, 64, (16,))} for _ in range(32)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=ContextParallelStrategy(context_parallel_size=2, failure_timeout=5.0),
    )
    trainer.fit(Failing(), DataLoader(data, batch_size=2))
    print("finished")
