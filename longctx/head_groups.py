"""Attention over groups of heads, one group at a time: ``attention_head_chunks``.

Ring attention (plain or document-masked) can run its whole forward and backward for
``n_kv_head / chunks`` key/value heads (with their query heads) at a time: the same
result, with the kernels' and the ring's fp32 accumulators, messages and buffers that many
times smaller. These helpers split the heads, run a pass per group and write the outputs
into full-size tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from .validation import ArgumentValueError


def check_head_chunks(chunks, n_kv_head: Optional[int] = None) -> None:
    """``attention_head_chunks``: a positive int dividing the key/value head count."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ArgumentValueError("attention_head_chunks", f"must be a positive int, got {chunks!r}")
    if n_kv_head is not None and n_kv_head % chunks:
        raise ValueError(
            f"attention_head_chunks={chunks} must divide the {n_kv_head} key/value heads "
            "(each chunk takes whole GQA groups)"
        )


def head_groups(n_head: int, n_kv_head: int, chunks: int) -> list[tuple[slice, slice]]:
    """(query heads, key/value heads) of each of ``chunks`` groups of whole GQA groups."""
    kv_per, group = n_kv_head // chunks, n_head // n_kv_head
    return [
        (slice(c * kv_per * group, (c + 1) * kv_per * group), slice(c * kv_per, (c + 1) * kv_per))
        for c in range(chunks)
    ]


def heads(t: torch.Tensor, index: slice) -> torch.Tensor:
    """``t``'s heads ``index`` (dim 2) as a dense tensor: a copy of one group's share, so
    the kernels and the ring's messages see the layout they see without chunks."""
    return t[:, :, index].contiguous()


def by_head_groups(q, k, v, chunks, run):
    """``run(q_heads, k_heads, v_heads, group_index) -> (out, lse, *kept)`` for each head
    group, one after the other; outputs written into full-size ``out``/``lse``. One
    group's buffers (the kernels' and the ring's fp32 accumulators, messages) exist at a
    time, so their peak is 1/chunks of attention over all heads at once."""
    if chunks == 1:
        out, lse, *kept = run(q, k, v, 0)
        return out, lse, [kept]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = None
    kept = []
    for g, (hs, ks) in enumerate(head_groups(q.shape[2], k.shape[2], chunks)):
        out_g, lse_g, *kept_g = run(heads(q, hs), heads(k, ks), heads(v, ks), g)
        if lse is None:
            lse = torch.empty((*lse_g.shape[:1], q.shape[2], *lse_g.shape[2:]), dtype=lse_g.dtype, device=lse_g.device)
        out[:, :, hs] = out_g
        lse[:, hs] = lse_g
        kept.append(kept_g)
        del out_g, lse_g
    return out, lse, kept


def grads_by_head_groups(dout, q, k, v, out, lse, chunks, run):
    """``run(dout_h, q_h, k_h, v_h, out_h, lse_h, group_index) -> (dq_h, dk_h, dv_h)`` per
    head group, written into full-size gradients (see ``by_head_groups``)."""
    if chunks == 1:
        return run(dout, q, k, v, out, lse, 0)
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for g, (hs, ks) in enumerate(head_groups(q.shape[2], k.shape[2], chunks)):
        grads = run(
            heads(dout, hs), heads(q, hs), heads(k, ks), heads(v, ks), heads(out, hs), lse[:, hs].contiguous(), g
        )
        for dst, index, grad in zip((dq, dk, dv), (hs, ks, ks), grads):
            dst[:, :, index] = grad
        del grads
    return dq, dk, dv
