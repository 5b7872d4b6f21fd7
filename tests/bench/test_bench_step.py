"""longctx.bench.step: the training step the benchmarks time by hand, on the CPU."""

from __future__ import annotations

import pytest
import torch

from longctx.bench.step import LossModule, mean_step_seconds, train_step
from longctx.models import GPT, GPTConfig


def test_train_step_is_forward_backward_and_one_optimizer_step():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", vocab_size=64, n_layer=1))
    net = LossModule(model)
    ids = torch.randint(0, 64, (1, 33))
    inp, lab, pos = ids[:, :-1], ids[:, 1:], torch.arange(32)[None]
    expected = model.loss(inp, lab, pos)[0].detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    parts = []
    loss_sum, n = train_step(lambda: net(inp, lab, pos), opt, lambda loss, n: loss / 32, mark=parts.append)
    assert parts == ["forward", "backward", "optimizer step"]
    assert torch.equal(loss_sum.detach(), expected)  # the loss of the weights before the step
    assert all(p.grad is None for p in model.parameters())  # zeroed (set to None) after the step
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # the objective is what is differentiated: a zero objective leaves SGD's weights alone
    after = [p.detach().clone() for p in model.parameters()]
    train_step(lambda: net(inp, lab, pos), opt, lambda loss, n: loss * 0.0)
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters()))


def test_mean_step_seconds_calls_and_returns_the_last_result():
    calls, events = [], []
    dt, last = mean_step_seconds(
        lambda: calls.append(len(calls)) or len(calls),
        3,
        sync=lambda: events.append("sync"),
        start=lambda: events.append("start"),
    )
    assert last == 3 and len(calls) == 3 and dt >= 0
    assert events == ["sync", "start", "sync"]
    with pytest.raises(ValueError, match="steps must be >= 1"):
        mean_step_seconds(lambda: None, 0, sync=lambda: None)
