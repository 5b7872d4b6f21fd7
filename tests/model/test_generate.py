"""Generation with context parallelism (longctx.models.generate) against one process.

One process: the KV-cached generation equals ``GPT.generate`` (a full forward per token) and
the log-probabilities of a full forward. P = 2 and 4 over gloo: the prefill logits, the
tokens (greedy and sampled) and their log-probabilities equal one process's, in float64 and
float32, for prompts the layout splits and prompts it does not (the rest fed token by token).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.dist_harness import run_distributed

from longctx import CPContext, ParallelDims, parallelize
from longctx.layouts import shard_sequence, unshard_sequence
from longctx.models import GPT, GPTConfig
from longctx.models.generate import generate, sample

VOCAB = 61


def _model(dtype: torch.dtype, group=None, layout: str = "zigzag") -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, init_std=0.3
    )
    model = GPT(config).to(dtype).eval()
    return parallelize(model, ParallelDims(cp=CPContext(group, layout)))


def _prompt(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(length))


def _full_logprobs(model: GPT, prompt: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    logits = model(torch.cat([prompt, new], dim=1)).double()
    return torch.log_softmax(logits, -1)[:, prompt.shape[1] - 1 : -1].gather(-1, new[..., None])[..., 0]


def test_one_process_equals_full_forward_generation():
    model = _model(torch.float64)
    for length in (1, 7, 12):
        prompt = _prompt(2, length)
        out = generate(model, prompt, 6)
        assert torch.equal(out.tokens, model.generate(prompt, 6)[:, length:])
        assert (out.logprobs - _full_logprobs(model, prompt, out.tokens)).abs().max() < 1e-12
    assert len(set(out.tokens.flatten().tolist())) > 2, "a degenerate model would test little"


def test_sampling_filters_and_seeds():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    draws = lambda **kw: {  # noqa: E731
        int(sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(s), **kw)) for s in range(200)
    }
    assert draws(top_k=2) == {2, 3}
    assert draws(top_p=0.5) == {3}  # p(3) = 0.64 alone reaches 0.5
    assert draws() == {0, 1, 2, 3}
    assert int(sample(logits)) == 3
    model = _model(torch.float64)
    a, b = (generate(model, _prompt(1, 5), 8, temperature=1.5, top_k=20, seed=7).tokens for _ in range(2))
    assert torch.equal(a, b)


def test_bad_arguments_are_one_line_errors():
    model = _model(torch.float64)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, _prompt(1, 4), 2, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, _prompt(1, 4), 2, temperature=1, top_p=0)
    with pytest.raises(ValueError, match="prompt"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 2)


@torch.no_grad()
def _cp_cases(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    results = {}
    for dtype, layout in ((torch.float64, "zigzag"), (torch.float32, "zigzag"), (torch.float64, "contiguous")):
        cp_model, ref = _model(dtype, group, layout), _model(dtype)
        key = f"{dtype}-{layout}"
        # Prefill logits: the model's forward on the shards equals the one-process forward.
        prompt = _prompt(2, 4 * world)
        shard = shard_sequence(prompt, 1, rank=rank, world_size=world, layout=layout)
        logits = unshard_sequence(cp_model(shard), 1, group=group, layout=layout)
        results[f"{key} prefill logits"] = float((logits - ref(prompt)).abs().max())
        for length in (4 * world, 4 * world + 3):  # split by the layout; plus a tail token by token
            prompt = _prompt(2, length)
            for kw in ({}, {"temperature": 1.0, "top_k": 30, "top_p": 0.95, "seed": 5}):
                got, want = generate(cp_model, prompt, 7, **kw), generate(ref, prompt, 7, **kw)
                name = f"{key} S={length} {'sampled' if kw else 'greedy'}"
                results[f"{name} tokens equal"] = bool(torch.equal(got.tokens, want.tokens))
                results[f"{name} logprobs"] = float((got.logprobs - want.logprobs).abs().max())
                results[f"{name} vs full forward"] = float(
                    (got.logprobs - _full_logprobs(ref, prompt, got.tokens)).abs().max()
                )
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_generation_equals_one_process(world):
    per_rank = run_distributed(_cp_cases, world)
    assert all(r == per_rank[0] for r in per_rank[1:]), "every rank reports the same"
    for name, value in per_rank[0].items():
        if name.endswith("tokens equal"):
            assert value, name
        else:
            tol = 1e-10 if "float64" in name else 2e-5
            assert value < tol, (name, value)
