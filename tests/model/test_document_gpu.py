"""GPU: a document-masked training step of the model with the step's DocumentPlan reads
nothing back to the host inside the layer loop (torch.cuda.set_sync_debug_mode("error")),
and its loss and gradients equal those of the same step with plain ids."""

from __future__ import annotations

import torch
from helpers.run_if import requires_cuda

pytestmark = requires_cuda()


def _step(model, input_ids, labels, positions, documents):
    model.zero_grad(set_to_none=True)
    loss_sum, n_tokens = model(input_ids, positions, labels=labels, document_ids=documents)
    loss_sum.backward()
    return loss_sum.detach(), [p.grad.detach().clone() for p in model.parameters()]


def test_document_masked_step_never_syncs_the_host():
    from longctx.documents import plan_documents
    from longctx.models import GPT, GPTConfig
    from longctx.sharding import document_position_ids

    torch.manual_seed(0)
    config = GPTConfig.from_dict(dict(preset="tiny", n_embd=256, n_head=4, n_kv_head=2, max_seq_len=4096))
    model = GPT(config).cuda().to(torch.bfloat16)
    S = 4096
    lengths = torch.tensor([1, 255, 700, 1, 1139, 2000])
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None].cuda()
    input_ids = torch.randint(0, config.vocab_size, (1, S), device="cuda")
    labels = torch.roll(input_ids, -1, 1)
    positions = document_position_ids(ids)
    plan = plan_documents(ids, world_size=1, rank=0)  # once per step, outside the layers
    _step(model, input_ids, labels, positions, plan)  # warm-up: kernels compile here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, grads = _step(model, input_ids, labels, positions, plan)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want_loss, want_grads = _step(model, input_ids, labels, positions, ids)
    assert torch.isfinite(loss) and torch.allclose(loss.float(), want_loss.float(), rtol=1e-3)
    for got, want in zip(grads, want_grads):
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-3)
