"""The README's "strategy in your own Lightning project" snippet, run as written.

The code block is taken from README.md and executed (its ``__main__`` part excepted); its
``MyModule`` then trains on a plain DataLoader (``shuffle=False``, uneven -100 masks).
The reference is what a user runs first: a plain ``Trainer(devices=1)`` (no strategy; the
samples carry ``position_ids``). Against it, with the strategy's defaults and samples
without ``position_ids`` (the strategy adds them, also at cp == 1):
* ``ContextParallelStrategy(context_parallel_size=1)`` on one device;
* CP=2, dp=1 (world 2) and CP=2, dp=2 (world 4, half the batch per dp rank).
Logged losses and final parameters must agree: same global batches in the same order
(the strategy's dp-only sampler; Lightning's own would shuffle them) and the exact global
token mean (``causal_lm_loss``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from helpers.dist_harness import run_distributed

README = Path(__file__).resolve().parents[2] / "README.md"
SEQ, N_SAMPLES, GLOBAL_BATCH, STEPS = 32, 8, 4, 2


def readme_code(section_title: str) -> str:
    """The first python code block under a README section title."""
    section = README.read_text().split(section_title, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"README section {section_title!r} has no python code block"
    return match.group(1)


def readme_snippet() -> str:
    return readme_code("## The strategy in your own Lightning project")


def _samples(vocab: int, with_positions: bool) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(N_SAMPLES):
        t = torch.randint(0, vocab, (SEQ + 1,), generator=g)
        labels = t[1:].clone()
        labels[torch.rand(SEQ, generator=g) < (i % 4) * 0.2] = -100  # 0..60% ignored
        out.append({"input_ids": t[:-1], "labels": labels})
        if with_positions:
            out[-1]["position_ids"] = torch.arange(SEQ)
    return out


def _train(rank: int, world: int, cp: int | None) -> dict:
    """cp None: the plain one-device reference (this process); else the strategy's rank."""
    import lightning as L

    from longctx import ContextParallelStrategy

    if cp is not None:
        os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", PL_GLOBAL_SEED="0")
    namespace = {"__name__": "readme_snippet"}
    exec(compile(readme_snippet(), str(README), "exec"), namespace)
    torch.manual_seed(0)
    module = namespace["MyModule"]()
    start = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(trainer.callback_metrics["train_loss"].item())

    dp = 1 if cp is None else world // cp
    data = _samples(module.head.out_features, with_positions=cp is None)
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // dp)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        strategy="auto" if cp is None else ContextParallelStrategy(context_parallel_size=cp),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Record()],
    )
    trainer.fit(module, loader)
    params = torch.cat([p.detach().flatten() for p in module.parameters()])
    return {"losses": losses, "params": params.tolist(), "start": start.tolist()}


@pytest.fixture(scope="module")
def one_device() -> dict:
    return _train(0, 1, None)


def _rel(a: list, b: list) -> float:
    a, b = torch.tensor(a), torch.tensor(b)
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("world,cp", [(1, 1), (2, 2), (4, 2)], ids=["cp1", "cp2-dp1", "cp2-dp2"])
def test_readme_snippet_matches_one_device(one_device, world, cp):
    ref = one_device["losses"]
    assert len(ref) == STEPS and len(set(ref)) == STEPS  # finite, and each step saw new data
    assert _rel(one_device["params"], one_device["start"]) > 1e-3  # it trained
    for rank, out in enumerate(run_distributed(_train, world, cp)):
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref), rtol=1e-5, atol=0)
        err = _rel(out["params"], one_device["params"])
        assert err < 1e-5, f"rank {rank}: parameters differ from one device by {err:.2e}"


def test_readme_fsdp_snippet_trains():
    """The configure_model pattern as written: a tiny preset, one CPU process, FSDP2."""
    import lightning as L

    namespace: dict = {}
    exec(compile(readme_code("## Sharded models (FSDP2) and `parallelize`"), str(README), "exec"), namespace)
    assert namespace["strategy"].data_parallel == "fsdp"
    torch.manual_seed(0)
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in torch.randint(0, 4096, (4, 65))]
    module = namespace["LlamaModule"]("tiny")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=namespace["longctx"].ContextParallelStrategy(data_parallel="fsdp"),
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    from torch.distributed.tensor import DTensor

    assert trainer.global_step == 2
    assert all(isinstance(p, DTensor) for p in module.parameters())
    assert module.model.blocks[0].activation_checkpointing == "full"
    if torch.distributed.is_initialized():  # the one-process group lives in pytest's process
        torch.distributed.destroy_process_group()
