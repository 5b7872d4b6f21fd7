"""ContextParallelStrategy in a real Lightning Trainer against single-device training.

Same tiny GPT (fp32), same global batches, a few AdamW steps, with FSDP2 (every parameter
sharded over the world) and with DDP:
* CP=2 (world 2, dp 1), batch 4                          vs single device, batch 4;
* dp2 x cp2 (world 4), batch 1 per dp rank, accumulate 2  vs single device, batch 4.
Labels are partly -100 with uneven counts per sample, so only exact global token weighting
(over ranks *and* accumulated micro-batches) reproduces the single-device run. Parameters
must agree within 1e-5 (norm-relative) and the logged train_loss at every step.

The data is a plain list of full-length dicts in a plain DataLoader: the strategy's
sampler (dp only, in the loader's order) and automatic sharding in batch_to_device are
what is tested; the reference is the same loader on one device.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from helpers.dist_harness import run_distributed
from torch.utils.data import DataLoader

from longctx.lightning.strategy import ContextParallelStrategy

VOCAB, SEQ, N_SAMPLES, STEPS, GLOBAL_BATCH = 64, 32, 16, 4, 4
MODEL = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)
PLAN = dict(attention_backend="torch", loss_chunk_size=48)
OPTIM = dict(lr=3e-3, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.1)


def _samples() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ + 1), generator=g)
    out = []
    for i in range(N_SAMPLES):
        labels = tokens[i, 1:].clone()
        labels[torch.rand(SEQ, generator=g) < (i % 4) * 0.2] = -100  # 0..60% ignored
        out.append({"input_ids": tokens[i, :-1].clone(), "labels": labels})
    return out


class _Record(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "train_loss" in trainer.callback_metrics and len(self.losses) < trainer.global_step:
            self.losses.append(trainer.callback_metrics["train_loss"].item())


def _fit(strategy, devices: int, loader: DataLoader, accumulate: int, **module_kw) -> dict:
    from longctx.lightning.module import CausalLMModule

    torch.manual_seed(0)
    module = CausalLMModule(MODEL, parallel=PLAN, **OPTIM, **module_kw)
    rec = _Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        precision="32-true",
        accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=strategy != "auto",
        callbacks=[rec],
    )
    trainer.fit(module, loader)
    from torch.distributed.tensor import DTensor, Shard

    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in module.parameters()]
    params = torch.cat([p.detach().flatten() for p in full])
    info = {"params": params.tolist(), "losses": rec.losses}
    if isinstance(trainer.strategy, ContextParallelStrategy):
        s = trainer.strategy
        info["coords"] = (s.dp_rank, s.dp_size, s.cp_rank, s.cp_size)
        info["cp_size_in_attention"] = module.model.cp.size  # the CP context reached the layers
        info["data_parallel"] = s.data_parallel
        # The run plan decided before configure_model is what the strategy and the layers run.
        run = module.run_plan
        info["run_plan"] = (run.parallel.data_parallel, run.parallel.cp, run.parallel.dp)
        from longctx.parallel import ContextParallelAttention

        info["kernels"] = {
            (c.backend, c.document_backend) for c in module.model.modules() if isinstance(c, ContextParallelAttention)
        }
        info["planned_kernels"] = (run.parallel.attention_backend, run.parallel.document_backend)
        info["sharded"] = [isinstance(p, DTensor) and p.placements == (Shard(0),) for p in module.parameters()]
        info["local_numel"] = sum(
            p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters()
        )
    return info


def _distributed(rank: int, world: int, cp: int, batch: int, accumulate: int, data_parallel: str) -> dict:
    # The harness already initialised the process group; LOCAL_RANK tells Lightning that
    # the processes exist (no launcher) and which one this is.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", PL_GLOBAL_SEED="0")
    loader = DataLoader(_samples(), batch_size=batch)
    strategy = ContextParallelStrategy(context_parallel_size=cp, data_parallel=data_parallel)
    return _fit(strategy, world, loader, accumulate)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _fit("auto", 1, DataLoader(_samples(), batch_size=GLOBAL_BATCH), 1)


def _rel(a: list, b: list) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,cp,batch,accumulate,data_parallel",
    # batch = per dp rank and micro-batch: GLOBAL_BATCH = batch * dp * accumulate.
    [
        (2, 2, GLOBAL_BATCH, 1, "fsdp"),
        (4, 2, GLOBAL_BATCH // 4, 2, "fsdp"),
        (2, 2, GLOBAL_BATCH, 1, "ddp"),
        (4, 2, GLOBAL_BATCH // 4, 2, "ddp"),
    ],
    ids=["fsdp-cp2", "fsdp-dp2xcp2-accumulate2", "ddp-cp2", "ddp-dp2xcp2-accumulate2"],
)
def test_matches_single_device(reference, world, cp, batch, accumulate, data_parallel):
    results = run_distributed(_distributed, world, cp, batch, accumulate, data_parallel)
    ref_losses = reference["losses"]
    assert len(ref_losses) == STEPS and all(map(torch.isfinite, torch.tensor(ref_losses)))
    n_params = len(reference["params"])
    for rank, out in enumerate(results):
        assert out["coords"] == (rank // cp, world // cp, rank % cp, cp)
        assert out["cp_size_in_attention"] == cp
        assert out["data_parallel"] == data_parallel
        assert out["run_plan"] == (data_parallel, cp, world // cp)
        assert out["kernels"] == {out["planned_kernels"]}
        if data_parallel == "fsdp":
            # Every parameter is a DTensor sharded on dim 0 over the whole world; each rank
            # holds about 1/world of the model (FSDP2 pads dim 0 to a multiple of world).
            assert all(out["sharded"]), out["sharded"]
            assert out["local_numel"] <= n_params / world * 1.1
        else:
            assert not any(out["sharded"]) and out["local_numel"] == n_params
        err = _rel(out["params"], reference["params"])
        assert err < 1e-5, f"rank {rank}: parameters differ from single-device training by {err:.2e}"
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    # Parameters moved (a test that cannot fail is no test).
    torch.manual_seed(0)
    from longctx.models import GPT, GPTConfig

    start = torch.cat([p.detach().flatten() for p in GPT(GPTConfig.from_dict(MODEL)).parameters()])
    assert _rel(reference["params"], start.tolist()) > 1e-3


def test_errors_and_registration():
    with pytest.raises(
        ValueError, match=r"context_parallel_size must be an integer >= 1 \(null: the whole world\), got 0"
    ):
        ContextParallelStrategy(context_parallel_size=0)
    with pytest.raises(ValueError, match="got -2"):
        ContextParallelStrategy(context_parallel_size=-2)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        ContextParallelStrategy(context_parallel_size=1.5)
    with pytest.raises(ValueError, match="layout"):
        ContextParallelStrategy(context_parallel_size=2, layout="spiral")
    # World 3 is not divisible by CP 2: refused when the Trainer is built, before launching.
    with pytest.raises(
        ValueError,
        match=r"context_parallel_size 2 does not divide the world of 3 processes "
        r"\(3 devices x 1 nodes\)",
    ):
        L.Trainer(accelerator="cpu", devices=3, strategy=ContextParallelStrategy(context_parallel_size=2), logger=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="context_parallel", logger=False)
    assert isinstance(trainer.strategy, ContextParallelStrategy)
    assert trainer.strategy.cp_size == 2 and trainer.strategy.dp_size == 1  # default: whole world
