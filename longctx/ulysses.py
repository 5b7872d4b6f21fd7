"""Head-parallel ("Ulysses") context-parallel attention: all-to-all instead of a ring.

Same contract as ``ring_attention``: this rank's shard ``(B, S_local, H, D)`` of a
sequence laid out by ``layout`` goes in, exact attention over the whole sequence for
those tokens comes out. How: one all-to-all turns "my tokens, all heads" into "all
tokens, my H/P heads" (q, k and v packed into one message), each rank runs ordinary
attention over the full sequence for its heads, and a second all-to-all returns the
output to the token shards. The backward is the mirror image (dO in; dQ, dK, dV packed
out). No partial results, no merges: the numerics are those of single-device attention.

Why have it beside the ring: its communication per layer is four all-to-alls of the
local activations, independent of P's effect on block sizes, and every kernel call is a
full-length one (the ring splits the work into P block calls of (S/P)^2 each, which run
below the kernel's large-block rate when S/P is small). It needs the K/V head count to
be a multiple of P, and it does not overlap its transfers with compute; the ring
has neither limit. ``benchmarks/ring.py`` measures both.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from longctx.kernels import attention_backward, attention_forward, check_attention_inputs

from .layouts import check_layout, check_seq_len, chunks_per_rank
from .ring import check_same_shapes_across_ranks, ring_attention


def _ranks_to_sequence(parts: torch.Tensor, layout: str) -> torch.Tensor:
    """(P, B, S_local, h, D), part i = rank i's shard -> (B, S, h, D) in sequence order."""
    world, b, s_local, h, d = parts.shape
    if layout == "contiguous":
        return parts.permute(1, 0, 2, 3, 4).reshape(b, world * s_local, h, d)
    # zigzag: rank i holds chunks i and 2P-1-i, so the first halves in rank order are
    # chunks 0..P-1 and the second halves in reverse rank order are chunks P..2P-1.
    halves = parts.view(world, b, 2, s_local // 2, h, d)
    chunks = torch.cat((halves[:, :, 0], halves[:, :, 1].flip(0)))  # (2P, B, c, h, D)
    return chunks.permute(1, 0, 2, 3, 4).reshape(b, world * s_local, h, d)


def _sequence_to_ranks(full: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    """Inverse of ``_ranks_to_sequence``: (B, S, h, D) -> contiguous (P, B, S_local, h, D)."""
    b, s, h, d = full.shape
    if layout == "contiguous":
        return full.view(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).contiguous()
    chunks = full.view(b, 2 * world, s // (2 * world), h, d).transpose(0, 1)
    return torch.stack((chunks[:world], chunks[world:].flip(0)), dim=2).reshape(
        world, b, s // world, h, d)


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _scatter_heads(tensors, group, world: int, layout: str) -> list:
    """Token shards with all heads -> the whole sequence with this rank's heads.

    ``tensors``: (B, S_local, H_t, D) each; returns (B, S, H_t / P, D) views of one
    all-to-all's result."""
    b, s_local, _, d = tensors[0].shape
    widths = [t.shape[2] // world for t in tensors]
    # (P, B, S_local, sum(h_t), D): slot j holds the heads destined for rank j.
    send = torch.cat([t.reshape(b, s_local, world, w, d).permute(2, 0, 1, 3, 4)
                      for t, w in zip(tensors, widths)], dim=3)
    full = _ranks_to_sequence(_all_to_all(send.contiguous(), group), layout)
    return list(full.split(widths, dim=2))


def _gather_heads(tensors, group, world: int, layout: str) -> list:
    """Inverse of ``_scatter_heads``: (B, S, h_t, D) each -> (B, S_local, h_t * P, D)."""
    widths = [t.shape[2] for t in tensors]
    send = _sequence_to_ranks(torch.cat(tensors, dim=2), world, layout)
    recv = _all_to_all(send, group)  # slot j: my tokens, rank j's heads
    p, b, s_local, _, d = recv.shape
    return [part.permute(1, 2, 0, 3, 4).reshape(b, s_local, p * w, d)
            for part, w in zip(recv.split(widths, dim=3), widths)]


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, backend):
        world = dist.get_world_size(group)
        qf, kf, vf = _scatter_heads((q, k, v), group, world, layout)
        out_f, lse = attention_forward(qf, kf, vf, causal=causal, softmax_scale=scale, backend=backend)
        (out,) = _gather_heads((out_f,), group, world, layout)
        ctx.save_for_backward(qf, kf, vf, out_f, lse)
        ctx.args = (group, causal, layout, scale, backend, q.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        qf, kf, vf, out_f, lse = ctx.saved_tensors
        group, causal, layout, scale, backend, dtype = ctx.args
        world = dist.get_world_size(group)
        (dout_f,) = _scatter_heads((dout.to(dtype),), group, world, layout)
        dq_f, dk_f, dv_f = attention_backward(dout_f, qf, kf, vf, out_f, lse, causal=causal,
                                              softmax_scale=scale, backend=backend)
        dq, dk, dv = _gather_heads((dq_f, dk_f, dv_f), group, world, layout)
        return dq, dk, dv, None, None, None, None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention of this rank's shard over the whole sharded sequence, head-parallel.

    Arguments as ``ring_attention``; additionally ``Hkv`` (and so ``Hq``) must be a
    multiple of the group size. ``group=None`` or size 1 is plain local attention.
    """
    check_layout(layout)
    check_attention_inputs(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and k/v must hold the same tokens: local lengths {q.shape[1]} and {k.shape[1]}"
        )
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:  # the ring's local path: plain attention through the same kernels
        return ring_attention(q, k, v, group=None, causal=causal, softmax_scale=softmax_scale,
                              backend=backend)
    if k.shape[2] % world != 0:
        raise ValueError(
            f"ulysses_attention splits heads over the group: the {k.shape[2]} key/value heads "
            f"are not a multiple of the group size {world}; use ring_attention"
        )
    if q.shape[1] % chunks_per_rank(layout) != 0:
        check_seq_len(q.shape[1] * world, world, layout)  # raises, naming the multiple needed
    check_same_shapes_across_ranks(group, q, k)
    return _UlyssesAttention.apply(q, k, v, group, causal, layout, softmax_scale, backend)
