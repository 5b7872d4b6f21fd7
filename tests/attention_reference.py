"""The float64 attention reference shared by the kernel tests (CPU and GPU)."""
from __future__ import annotations

import torch


def reference(q, k, v, dout, causal, scale):
    """Plain softmax attention in float64; GQA by repeating K/V. Returns out, lse, grads."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)
    out.backward(dout.double())
    return out.detach(), s.logsumexp(-1).detach(), q.grad, k.grad, v.grad
