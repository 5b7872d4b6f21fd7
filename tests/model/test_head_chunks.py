"""ParallelPlan(attention_head_chunks=n) through the model: the same loss and gradients as
all heads at once (float64), and the setting's errors, one line each."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.run_if import requires_cuda

from longctx import ParallelPlan, parallelize
from longctx.models import GPT, GPTConfig


def _config(**kw) -> GPTConfig:
    base = dict(vocab_size=64, n_layer=2, n_head=8, n_kv_head=4, n_embd=32, intermediate_size=48, init_std=0.15)
    base.update(kw)
    return GPTConfig(**base)


@pytest.mark.parametrize("chunks,checkpointing", [(2, "full"), (4, "none"), (4, "selective")])
def test_head_chunks_equal_all_heads_float64(chunks, checkpointing):
    torch.manual_seed(0)
    model = GPT(_config()).double()
    chunked = copy.deepcopy(model)
    plan = dict(attention_backend="torch", activation_checkpointing=checkpointing)
    parallelize(model, plan=ParallelPlan(**plan))
    parallelize(chunked, plan=ParallelPlan(**plan, attention_head_chunks=chunks))
    assert all(b.attn.core.head_chunks == chunks for b in chunked.blocks)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 19), generator=g)
    labels = torch.randint(0, 64, (2, 19), generator=g)
    docs = torch.arange(19).div(6, rounding_mode="floor").expand(2, -1)
    results = []
    for m in (model, chunked):
        loss, n = m.loss(ids, labels, document_ids=docs)
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in m.named_parameters()}))
    (ref_loss, ref), (loss, got) = results
    assert torch.isfinite(ref_loss)
    assert torch.allclose(loss, ref_loss, rtol=1e-13, atol=0)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-11, atol=1e-14), k


@pytest.mark.parametrize(
    "plan,match",
    [
        (dict(attention_head_chunks=0), "attention_head_chunks must be a positive int, got 0"),
        (dict(attention_head_chunks=True), "attention_head_chunks must be a positive int, got True"),
        (dict(attention_head_chunks=8), "attention_head_chunks=8 must divide the 4 key/value heads"),
        (dict(attention_head_chunks=2, cp_attention="ulysses"), "attention_head_chunks applies to cp_attention='ring'"),
    ],
)
def test_head_chunk_errors(plan, match):
    with pytest.raises(ValueError, match=match):
        parallelize(GPT(_config()), plan=ParallelPlan(**plan))


@requires_cuda()
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("docs", [False, True])
def test_head_chunks_on_gpu_kernels_bf16(backend, docs):
    """The GPU block kernels (FlashAttention-4 / cuDNN under "auto") per head group: bf16
    against float64, the same error as all heads at once."""
    from helpers.attention_reference import reference

    from longctx import ring_attention

    g = torch.Generator(device="cuda").manual_seed(7)
    S, Hq, Hkv, D = 1024, 8, 4, 64
    q, dout = (torch.randn(2, S, Hq, D, device="cuda", generator=g) for _ in range(2))
    k, v = (torch.randn(2, S, Hkv, D, device="cuda", generator=g) for _ in range(2))
    ids = (torch.arange(S, device="cuda") // 300).expand(2, -1).contiguous() if docs else None
    ref = reference(q, k, v, dout, True, D**-0.5, ids)
    ref = (ref[0], *ref[2:])
    for chunks in (1, 4):
        qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
        out = ring_attention(qb, kb, vb, backend=backend, document_ids=ids, head_chunks=chunks)
        out.backward(dout.bfloat16())
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, qb.grad, kb.grad, vb.grad), ref):
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < 1e-2, (chunks, name, err)
