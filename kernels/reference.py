"""PyTorch reference attention block kernels (backend ``"torch"``).

Runs on any device and is the ground truth the other backends are tested against.
It materialises the (Sq, Sk) score matrix, so it is meant for CPU runs, tests and
short blocks, not for long sequences on a GPU.

GQA is handled by viewing the query heads as (Hkv, group) instead of repeating K/V:
the K/V tensors are never copied per query head, and dK/dV come out already summed
over each query-head group.
"""

from __future__ import annotations

from typing import Optional

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half precision inputs are computed in fp32; fp32/fp64 keep their own precision.
    return torch.promote_types(dtype, torch.float32)


def _grouped(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    b, s, hq, d = q.shape
    return q.reshape(b, s, n_kv_heads, hq // n_kv_heads, d)


def _probabilities(
    q,
    k,
    causal: bool,
    softmax_scale: float,
    lse: Optional[torch.Tensor] = None,
    q_doc: Optional[torch.Tensor] = None,
    k_doc: Optional[torch.Tensor] = None,
):
    """Scores -> (probabilities, lse), computed in the compute dtype. Shapes: (B, Hkv, G, Sq, Sk)."""
    ct = _compute_dtype(q.dtype)
    qg = _grouped(q.to(ct), k.shape[2])
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(ct)) * softmax_scale
    if causal:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(mask, float("-inf"))
    if q_doc is not None:
        # (B, Sq, Sk): keys of another document are invisible.
        other = q_doc[:, :, None] != k_doc[:, None, :]
        scores = scores.masked_fill(other[:, None, None], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        b, hq, sq = lse.shape
        lse = lse.to(ct).reshape(b, k.shape[2], hq // k.shape[2], sq)
    # A row with no visible key has lse = -inf; its probabilities are 0, not NaN. Only
    # that row: a NaN/+inf lse (NaN/Inf in q or k) must give NaN, as plain softmax does.
    empty = lse == float("-inf")
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    probs = probs.masked_fill(empty.unsqueeze(-1), 0.0)
    return probs, lse


def forward(
    q,
    k,
    v,
    causal: bool,
    softmax_scale: float,
    out_dtype: Optional[torch.dtype],
    q_doc: Optional[torch.Tensor] = None,
    k_doc: Optional[torch.Tensor] = None,
):
    probs, lse = _probabilities(q, k, causal, softmax_scale, q_doc=q_doc, k_doc=k_doc)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(probs.dtype))
    b, sq, hq, d = q.shape
    out = out.reshape(b, sq, hq, v.shape[-1]).to(out_dtype or q.dtype)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out, lse.reshape(b, hq, sq).to(lse_dtype)


def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    softmax_scale: float,
    delta: Optional[torch.Tensor],
    grad_dtype: Optional[torch.dtype],
    q_doc: Optional[torch.Tensor] = None,
    k_doc: Optional[torch.Tensor] = None,
):
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    probs, _ = _probabilities(q, k, causal, softmax_scale, lse=lse, q_doc=q_doc, k_doc=k_doc)
    ct = probs.dtype
    if delta is None:
        delta = (dout.to(ct) * out.to(ct)).sum(-1).transpose(1, 2)  # (B, Hq, Sq)
    delta = delta.to(ct).reshape(b, hkv, hq // hkv, sq)
    dout_g = _grouped(dout.to(ct), hkv)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", probs, dout_g)
    dprobs = torch.einsum("bqhgd,bkhd->bhgqk", dout_g, v.to(ct))
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * softmax_scale
    dq = torch.einsum("bhgqk,bkhd->bqhgd", dscores, k.to(ct)).reshape(b, sq, hq, d)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", dscores, _grouped(q.to(ct), hkv))
    return (
        dq.to(grad_dtype or q.dtype),
        dk.to(grad_dtype or k.dtype),
        dv.to(grad_dtype or v.dtype),
    )


def is_available(device: torch.device) -> bool:
    return True
