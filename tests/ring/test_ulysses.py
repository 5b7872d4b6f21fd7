"""Head-parallel (Ulysses) attention against a float64 single-device reference, over gloo."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from helpers.dist_harness import run_distributed
from test_ring_attention import attention_vs_reference, failures, rel_err

from longctx import CPContext, ParallelDims, ParallelPlan, parallelize, shard_sequence, ulysses_attention
from longctx.models import GPT, GPTConfig

# (layout, causal, Hq, Hkv, dtype, chunk, scale); Hkv is a multiple of every P tested.
CASES = [
    ("zigzag", True, 8, 4, torch.float32, 3, None),
    ("zigzag", False, 4, 4, torch.float32, 3, None),
    ("contiguous", True, 4, 4, torch.float32, 5, 0.3),
    ("contiguous", False, 8, 4, torch.float32, 3, None),
    ("zigzag", True, 8, 4, torch.bfloat16, 5, None),
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ulysses_matches_float64_reference(world):
    seed = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
    errors = run_distributed(attention_vs_reference, world, seed, "ulysses", CASES)[0]
    bad = failures(errors)
    assert len(errors) == 4 * len(CASES) and not bad, f"seed={seed} P={world}:\n" + "\n".join(bad)


def _heads_not_divisible(rank, world):
    q = torch.randn(1, 4, 4, 8)
    kv = torch.randn(1, 4, 2, 8)  # 2 KV heads over 4 ranks
    try:
        ulysses_attention(q, kv, kv, group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def _model_heads_not_divisible(rank, world):
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48))
    try:
        parallelize(model, ParallelDims(cp=CPContext(dist.group.WORLD)), ParallelPlan(cp_attention="ulysses"))
    except ValueError as e:
        return str(e)
    return "no error"


def test_ulysses_refuses_heads_that_do_not_split():
    for message in run_distributed(_heads_not_divisible, 4):
        assert "2 key/value heads" in message and "group size 4" in message
    # The model says so when the strategy hands it the group, before any step.
    for message in run_distributed(_model_heads_not_divisible, 4):
        assert "n_kv_head=2" in message and "size 4" in message


def _model_with_ulysses(rank, world):
    """The GPT with cp_attention='ulysses' on a CP group equals the ring model (fp32)."""
    group = dist.new_group(list(range(world)))
    base = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48, init_std=0.15)
    torch.manual_seed(0)
    ring_model = GPT(GPTConfig(**base))
    ulysses_model = GPT(GPTConfig(**base))
    ulysses_model.load_state_dict(ring_model.state_dict())
    dims = ParallelDims(cp=CPContext(group))
    parallelize(ring_model, dims, ParallelPlan(attention_backend="torch"))
    parallelize(ulysses_model, dims, ParallelPlan(attention_backend="torch", cp_attention="ulysses"))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    labels = torch.randint(0, 64, (2, 16), generator=g)
    results = []
    for model in (ring_model, ulysses_model):
        loss, _ = model.loss(
            shard_sequence(ids, 1, rank=rank, world_size=world), shard_sequence(labels, 1, rank=rank, world_size=world)
        )
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = results
    return abs(l1 - l0) / abs(l0), max(rel_err(a, b) for a, b in zip(g1, g0))


def test_model_with_ulysses_equals_ring():
    for loss_err, grad_err in run_distributed(_model_with_ulysses, 2):
        assert loss_err < 1e-6 and grad_err < 1e-5, (loss_err, grad_err)
