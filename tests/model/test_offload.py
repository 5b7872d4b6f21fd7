"""Block-input offload (ParallelPlan.offload_activations = bool or a number of blocks):
exact gradients against no offload; prefetch order one block ahead; validation."""

from __future__ import annotations

import copy

import pytest
import torch

from longctx import ParallelPlan, parallelize
from longctx.models import GPT, GPTConfig
from longctx.offload import BlockOffloader, offload_count


def _model():
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=96,
            n_layer=4,
            n_head=4,
            n_kv_head=2,
            n_embd=32,
            intermediate_size=48,
            rope_theta=500.0,
            init_std=0.15,
        )
    ).double()


def _grads(model, ids, labels):
    loss, _ = model.loss(ids, labels)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", ["full", "selective", "none"])
@pytest.mark.parametrize("offload", [True, 1, 3, 9])
def test_offload_gives_exact_gradients(checkpointing, offload):
    base = _model()
    other = copy.deepcopy(base)
    common = dict(loss_chunk_size=7, attention_backend="torch", activation_checkpointing=checkpointing)
    parallelize(base, plan=ParallelPlan(**common))
    parallelize(other, plan=ParallelPlan(**common, offload_activations=offload, mlp_tile_size=5))
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 96, (2, 22), generator=g)
    ref_loss, ref = _grads(base, tokens[:, :-1], tokens[:, 1:])
    loss, got = _grads(other, tokens[:, :-1], tokens[:, 1:])
    assert torch.allclose(loss, ref_loss, rtol=1e-13)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-14)


def test_prefetch_runs_one_block_ahead_of_the_backward():
    """Full checkpointing, 3 of 4 blocks offloaded: each block's single saved input is
    registered; the backward prefetches block i-1 when it reaches block i (2, then 1, 0).

    torch < 2.13's non-reentrant checkpoint also saves, beside its inputs, a 0-element
    placeholder it makes on the CPU (``dummy`` of ``_NoopSaveInputs``): registered with the
    block too, on a CUDA run as well, but empty and never copied (seen on an H100, torch
    2.11: each block's items were that placeholder, kept on the CPU, and the block input, the
    one copy to host). So the count is of the tensors that hold data, on every version."""
    import longctx.offload as off

    seen = []
    real = off.BlockOffloader

    class Spy(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self)

    model = _model()
    parallelize(
        model, plan=ParallelPlan(activation_checkpointing="full", attention_backend="torch", offload_activations=3)
    )
    import longctx.models.gpt as gpt

    gpt.BlockOffloader, saved = Spy, gpt.BlockOffloader
    try:
        tokens = torch.randint(0, 96, (1, 17))
        loss, _ = model.loss(tokens[:, :-1], tokens[:, 1:])
        (off_,) = seen
        assert sorted(off_.groups) == [0, 1, 2]
        held = {g: [item.tensor for item in v if item.tensor.numel()] for g, v in off_.groups.items()}
        assert all(len(v) == 1 and v[0].shape == (1, 16, 32) for v in held.values()), held  # the block input
        assert all(
            item.tensor.numel() == 0 and item.host is None
            for v in off_.groups.values()
            for item in v
            if not any(item.tensor is t for t in held[item.group])
        )  # the rest: empty, not copied
        assert off_.copies_out == sum(map(len, off_.groups.values())) and off_.prefetches == []
        loss.backward()
        assert off_.prefetches == [2, 1, 0]
    finally:
        gpt.BlockOffloader = saved
    # no grad: nothing is offloaded
    with torch.no_grad():
        model(tokens[:, :-1])


def test_offload_setting_is_validated_and_counted():
    for bad in (-1, 1.5, "2", None):
        with pytest.raises(ValueError, match="offload_activations"):
            ParallelPlan(offload_activations=bad)
    assert offload_count(True, 16) == 16 and offload_count(False, 16) == 0
    assert offload_count(4, 16) == 4 and offload_count(40, 16) == 16 and offload_count(0, 16) == 0
    assert isinstance(BlockOffloader(), BlockOffloader)
