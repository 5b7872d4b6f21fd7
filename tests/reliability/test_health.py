"""NonFiniteGuard: skip/stop on a non-finite loss or gradient, one decision for all ranks."""

from __future__ import annotations

import math
import os
import warnings

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.dist_harness import run_distributed
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from longctx.lightning.health import NonFiniteError, NonFiniteGuard
from longctx.models import GPT, GPTConfig

NAN = float("nan")


class Inject(L.LightningModule):
    """A tiny module whose loss or one parameter's gradient turns NaN at chosen steps."""

    def __init__(
        self, net: nn.Module, *, where: str = "none", steps=(), param: str = "", scale: bool = False, ranks=None
    ):
        super().__init__()
        self.net, self.where, self.steps, self.param, self.scale = net, where, set(steps), param, scale
        self.ranks = ranks  # None: inject on every rank
        self.snapshots = []  # flattened parameters after every optimizer step (index -1 = init)

    def loss_of(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss_of(batch)
        if self.where == "loss" and self.global_step in self.steps and self.ranks in (None, [self.global_rank]):
            # `loss + nan` leaves every gradient finite: only the loss check can catch it.
            # `loss * nan` makes every gradient NaN.
            loss = loss * NAN if self.scale else loss + NAN
        return loss

    def on_after_backward(self):
        if self.where == "grad" and self.global_step in self.steps:
            dict(self.named_parameters())[self.param].grad.view(-1)[0] = NAN

    def on_train_start(self):
        self.snapshots.append(self._flat())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.snapshots.append(self._flat())

    def _flat(self):
        return torch.cat([p.detach().flatten().clone() for p in self.parameters()])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GPTInject(Inject):
    def loss_of(self, batch):
        (ids,) = batch
        loss_sum, n = self.net.loss(ids[:, :-1], ids[:, 1:])
        return loss_sum / n


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def fit(module, guard, steps, data, devices=1, strategy="auto"):
    # Gradient clipping runs after the guard: it must cope with the gradients a skip removed.
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        callbacks=[guard],
        gradient_clip_val=1.0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer


def regression_data(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


@pytest.mark.parametrize("where,param", [("loss", ""), ("grad", "net.2.weight")])
def test_skip_leaves_parameters_unchanged_and_training_continues(where, param):
    k, steps = 2, 6
    module = Inject(mlp(), where=where, steps=[k], param=param)
    guard = NonFiniteGuard(policy="skip")
    trainer = fit(module, guard, steps, regression_data())
    snaps = module.snapshots  # snaps[i + 1] = parameters after optimizer step i
    assert len(snaps) == steps + 1
    assert all(torch.isfinite(s).all() for s in snaps)
    for i in range(steps):
        changed = not torch.equal(snaps[i + 1], snaps[i])
        assert changed == (i != k), f"step {i}: parameters {'changed' if changed else 'unchanged'}"
    assert guard.skips == 1 and guard.consecutive == 0
    assert float(trainer.callback_metrics["nonfinite_skips"]) == 1.0
    # Documented bookkeeping: global step and LR schedule count the skipped step, AdamW's
    # per-parameter step (bias correction) does not.
    assert trainer.global_step == steps
    opt = trainer.optimizers[0]
    assert all(int(opt.state[p]["step"]) == steps - 1 for p in module.parameters())
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == steps


def test_max_skips_counts_consecutive_steps_only():
    # steps 1, 3, 4 bad: 1 alone (reset by the good step 2), then 3 and 4 in a row -> stop at 4.
    module = Inject(mlp(), where="loss", steps=[1, 3, 4], scale=True)
    guard = NonFiniteGuard(policy="skip", max_skips=2)
    with pytest.raises(NonFiniteError, match=r"2 consecutive optimizer steps skipped.*step 4") as e:
        fit(module, guard, 8, regression_data())
    assert guard.skips == 3 and e.value.step == 4
    assert e.value.parameter == "net.0.weight"  # loss * NaN: every gradient NaN, first in module order


def test_stop_names_step_and_first_bad_layer_in_gpt():
    cfg = GPTConfig.from_preset(
        "tiny", n_layer=2, vocab_size=64, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 17))
    bad = "net.blocks.1.mlp.down_proj.weight"
    module = GPTInject(GPT(cfg), where="grad", steps=[3], param=bad)
    assert bad in dict(module.named_parameters())
    with pytest.raises(NonFiniteError) as e:
        fit(module, NonFiniteGuard(policy="stop"), 6, TensorDataset(ids))
    msg = str(e.value)
    assert "optimizer step 3" in msg and f"'{bad}'" in msg, msg
    assert e.value.step == 3 and e.value.parameter == bad and e.value.grad_ranks == [0]
    assert e.value.loss_ranks == []
    assert len(module.snapshots) == 4  # steps 0..2 applied, step 3 never was


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        NonFiniteGuard(policy="ignore")
    with pytest.raises(ValueError, match="max_skips"):
        NonFiniteGuard(policy="skip", max_skips=0)
    with pytest.raises(ValueError, match="max_skips"):
        NonFiniteGuard(policy="stop", max_skips=3)


# ---- two processes: only one rank sees the problem, both decide the same ------------------


def _grads(model, rank, nan_on=None):
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, 0.5 + rank)
        if nan_on is not None and name == nan_on.get(rank):
            p.grad.view(-1)[-1] = NAN


def _two_ranks(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # names 0.*, 2.*
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    guard = NonFiniteGuard(policy="skip")
    # 1. everything finite (different values per rank: no DDP here, the all-reduce decides)
    _grads(model, rank)
    guard.observe_loss(torch.tensor(1.0))
    out["finite"] = guard.check(0, model.named_parameters(), opt)
    # 2. only rank 1 has a NaN gradient
    _grads(model, rank, nan_on={1: "2.weight"})
    guard.observe_loss(torch.tensor(1.0))
    out["grad_rank1"] = guard.check(1, model.named_parameters(), opt)
    out["grads_cleared"] = all(p.grad is None for p in model.parameters())
    # 3. only rank 0 has a non-finite loss (over two micro-batches), gradients finite
    _grads(model, rank)
    guard.observe_loss(torch.tensor(1.0))
    guard.observe_loss(torch.tensor(float("inf") if rank == 0 else 2.0))
    out["loss_rank0"] = guard.check(2, model.named_parameters(), opt)
    out["skips"] = guard.skips
    # 4. stop: rank 0 NaN in 2.bias and in its loss, rank 1 NaN in the earlier 2.weight
    stop = NonFiniteGuard(policy="stop")
    _grads(model, rank, nan_on={0: "2.bias", 1: "2.weight"})
    stop.observe_loss(torch.tensor(NAN if rank == 0 else 1.0))
    try:
        stop.check(7, model.named_parameters(), opt)
        out["stop"] = None
    except NonFiniteError as e:
        out["stop"] = (str(e), e.step, e.parameter, e.grad_ranks, e.loss_ranks)
    # 4b. only rank 1's gradients (as FSDP2's shards after the reduce-scatter): the message
    # must not claim that the NaN shows on every rank
    _grads(model, rank, nan_on={1: "2.weight"})
    try:
        stop.check(7, model.named_parameters(), opt)
    except NonFiniteError as e:
        out["stop_rank1"] = str(e)
    # 5. the collectives stayed matched: a further finite check completes on both ranks
    _grads(model, rank)
    out["after"] = stop.check(8, model.named_parameters(), opt)

    # 6. a real Lightning DDP run: only rank 1's loss is NaN at step 2 (`loss + nan`: the
    # gradients stay finite, so DDP's all-reduce cannot spread it) -> both ranks skip step 2.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes exist: no launcher
    strategy = DDPStrategy(process_group_backend="gloo")
    module = Inject(mlp(), where="loss", steps=[2], ranks=[1])
    guard = NonFiniteGuard(policy="skip")
    fit(module, guard, 4, regression_data(), devices=world, strategy=strategy)
    snaps = module.snapshots
    out["ddp_changed"] = [not torch.equal(snaps[i + 1], snaps[i]) for i in range(4)]
    out["ddp_params"] = snaps[-1].tolist()
    out["ddp_skips"] = guard.skips
    # 7. ... and with policy stop, rank 1's NaN loss stops both ranks with the same error.
    module = Inject(mlp(), where="loss", steps=[1], ranks=[1])
    try:
        fit(
            module,
            NonFiniteGuard(policy="stop"),
            4,
            regression_data(),
            devices=world,
            strategy=DDPStrategy(process_group_backend="gloo"),
        )
        out["ddp_stop"] = None
    except NonFiniteError as e:
        out["ddp_stop"] = str(e)
    return out


def test_two_ranks_take_the_same_decision():
    r0, r1 = run_distributed(_two_ranks, 2)
    assert r0 == r1, (r0, r1)  # every decision and message identical on both ranks
    assert r0["finite"] is False and r0["after"] is False
    assert r0["grad_rank1"] is True and r0["grads_cleared"] is True
    assert r0["loss_rank0"] is True and r0["skips"] == 2
    msg, step, param, grad_ranks, loss_ranks = r0["stop"]
    assert step == 7 and param == "2.weight" and grad_ranks == [0, 1] and loss_ranks == [0]
    assert "optimizer step 7" in msg and "'2.weight' (on rank(s) [1]" in msg, msg
    assert "shows on every rank" in msg, msg  # every rank's gradients non-finite: as DDP's would be
    assert "ranks with any non-finite gradient: [1])" in r0["stop_rank1"], r0["stop_rank1"]
    assert "shows on every rank" not in r0["stop_rank1"], r0["stop_rank1"]
    assert r0["ddp_changed"] == [True, True, False, True] and r0["ddp_skips"] == 1
    assert all(math.isfinite(v) for v in r0["ddp_params"])
    assert r0["ddp_stop"] is not None and "optimizer step 1" in r0["ddp_stop"]
    assert "non-finite loss on rank(s) [1]" in r0["ddp_stop"], r0["ddp_stop"]
