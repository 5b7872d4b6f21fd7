"""The float64 attention reference shared by the kernel, ring and Ulysses tests (CPU and GPU)."""

from __future__ import annotations

import torch


def visibility_mask(q_len, k_len, causal, document_ids=None, device=None):
    """Bool ``(B or 1, Sq, Sk)``: True where query i sees key j (same document, j <= i if
    causal). ``document_ids`` (B, S) needs Sq == Sk."""
    mask = torch.ones(1, q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask = mask.tril()
    if document_ids is not None:
        mask = mask & (document_ids[:, :, None] == document_ids[:, None, :])
    return mask


def reference(q, k, v, dout, causal, scale, document_ids=None):
    """Plain softmax attention in float64; GQA by repeating K/V; ``document_ids`` (B, S) as
    in ``ring_attention`` (the explicit block-diagonal mask). Returns out, lse, grads."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    mask = visibility_mask(q.shape[1], k.shape[1], causal, document_ids, s.device)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)
    out.backward(dout.double())
    return out.detach(), s.logsumexp(-1).detach(), q.grad, k.grad, v.grad
