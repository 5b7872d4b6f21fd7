"""Ring attention: exact attention over a sequence sharded across a context-parallel group.

Each rank keeps its Q shard; K/V shards travel rank -> rank+1 for P-1 hops while every
rank merges its partial softmax results in fp32 through the log-sum-exp. The backward
is a ring too: K/V travel again, together with fp32 dK/dV accumulators that collect
every rank's contribution and arrive home after P hops. Per rank, at most two K/V
shards, two dK/dV shards and the fp32 accumulators are resident: memory is O(S/P).

Zigzag layout (rank r holds chunks r and 2P-1-r of 2P), causal, step s, K/V from rank
(r - s) mod P:
  s == 0    local block, causal (the local shard is position-sorted);
  0 < s <= r  all local queries vs the first half of the K/V shard, no mask;
  s > r     the second half of the local queries vs the whole K/V shard, no mask.
Every off-diagonal step therefore computes exactly half a block on every rank.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from longctx.kernels import attention_backward, attention_forward, check_attention_inputs, resolve_backend
from longctx.kernels.merge import merge_partials_

from .layouts import check_layout, check_seq_len, chunks_per_rank
from .ring_comm import RingExchange

ALL = slice(None)


def _block_for_step(rank: int, step: int, world_size: int, layout: str, causal: bool, s_local: int):
    """(q rows, kv rows, causal mask) computed at this ring step, or None to skip."""
    if not causal:
        return ALL, ALL, False
    if step == 0:
        return ALL, ALL, True
    if layout == "contiguous":
        source = (rank - step) % world_size
        # K/V from an earlier rank are all visible; from a later rank, none are.
        return (ALL, ALL, False) if source < rank else None
    half = s_local // 2
    if step <= rank:
        return ALL, slice(0, half), False
    return slice(half, None), ALL, False


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _partial_dtype(backend: str, acc_dtype: torch.dtype):
    """dtype block kernels return partials in. Our kernels write fp32 at no extra pass;
    the vendor kernels only produce the input dtype, and the merge/accumulate kernels
    upcast those while reading, so asking them for fp32 would only add a cast pass."""
    return None if backend in ("cudnn", "flash") else acc_dtype


_verified_shapes: set = set()
_DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_same_shapes_across_ranks(group, q: torch.Tensor, k: torch.Tensor) -> None:
    """Fail on every rank, instead of hanging, when ranks hold differently shaped shards.

    One small all-gather per new (group, shapes, dtype); cached afterwards so the ring
    loop never pays it again (on CUDA it costs one host sync the first time).
    """
    key = (id(group), tuple(q.shape), tuple(k.shape), q.dtype)
    if key in _verified_shapes:
        return
    device = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([*q.shape, *k.shape, _DTYPE_CODES.index(q.dtype)], device=device)
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    if not bool((table == table[0]).all()):
        rows = {r: tuple(table[r, :4].tolist()) for r in range(world)}
        raise ValueError(
            "ring_attention: ranks of the context-parallel group hold different shard shapes or "
            f"dtypes (q shape per rank: {rows}); every rank must hold an equal slice of the same sequence"
        )
    _verified_shapes.add(key)


class _LocalAttention(torch.autograd.Function):
    """group=None or size 1: plain attention through the same block kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend):
        out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, backend = ctx.args
        dq, dk, dv = attention_backward(
            dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend=backend
        )
        return dq, dk, dv, None, None, None


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, backend):
        comm = RingExchange(group)
        world, rank = comm.world_size, comm.rank
        s_local = q.shape[1]
        acc_dtype = _accumulator_dtype(q.dtype)
        backend = resolve_backend(backend, q, k, causal)
        partial_dtype = _partial_dtype(backend, acc_dtype)

        # Double buffer, allocated once per call: [slot][k or v]. One message per hop.
        kv = torch.empty((2, 2, *k.shape), dtype=k.dtype, device=k.device)
        kv[0, 0].copy_(k)
        kv[0, 1].copy_(v)
        out: Optional[torch.Tensor] = None
        lse: Optional[torch.Tensor] = None
        for step in range(world):
            current = kv[step % 2]
            # Post the next hop before computing, so the transfer overlaps this block.
            pending = comm.shift(current, kv[(step + 1) % 2]) if step + 1 < world else None
            block = _block_for_step(rank, step, world, layout, causal, s_local)
            if block is not None:
                rows, cols, masked = block
                out_b, lse_b = attention_forward(
                    q[:, rows], current[0][:, cols], current[1][:, cols],
                    causal=masked, softmax_scale=scale, backend=backend, out_dtype=partial_dtype,
                )
                if out is None:
                    # Step 0 always covers every local query row (diagonal or full block).
                    out, lse = out_b.to(acc_dtype), lse_b.to(acc_dtype)
                else:
                    merge_partials_(out[:, rows], lse[:, :, rows], out_b, lse_b)
            if pending is not None:
                pending.wait()

        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.args = (group, causal, layout, scale, backend)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout, scale, backend = ctx.args
        comm = RingExchange(group)
        world, rank = comm.world_size, comm.rank
        s_local = q.shape[1]
        acc_dtype = _accumulator_dtype(q.dtype)
        partial_dtype = _partial_dtype(backend, acc_dtype)  # backend was resolved in forward

        # delta = rowsum(dO * O) once per layer, not once per block.
        delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1).transpose(1, 2).contiguous()
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = torch.empty((2, 2, *k.shape), dtype=k.dtype, device=k.device)
        kv[0, 0].copy_(k)
        kv[0, 1].copy_(v)
        # dK/dV accumulators travel with their K/V block: [slot][dk or dv], fp32.
        dkv = torch.empty((2, 2, *k.shape), dtype=acc_dtype, device=k.device)
        dkv[0].zero_()
        dkv_pending = None
        for step in range(world):
            current, dcurrent = kv[step % 2], dkv[step % 2]
            kv_pending = comm.shift(current, kv[(step + 1) % 2]) if step + 1 < world else None
            block = _block_for_step(rank, step, world, layout, causal, s_local)
            grads = None
            if block is not None:
                rows, cols, masked = block
                grads = attention_backward(
                    dout[:, rows], q[:, rows], current[0][:, cols], current[1][:, cols],
                    out[:, rows], lse[:, :, rows],
                    causal=masked, softmax_scale=scale, backend=backend,
                    delta=delta[:, :, rows], grad_dtype=partial_dtype,
                )
            if dkv_pending is not None:
                dkv_pending.wait()  # this block's partial dK/dV has arrived from rank-1
            if grads is not None:
                dq_b, dk_b, dv_b = grads
                dq[:, rows] += dq_b
                dcurrent[0][:, cols] += dk_b
                dcurrent[1][:, cols] += dv_b
            # Pass the partial sums on; the hop at the last step brings each block home.
            dkv_pending = comm.shift(dcurrent, dkv[(step + 1) % 2])
            if kv_pending is not None:
                kv_pending.wait()
        dkv_pending.wait()
        home = dkv[world % 2]
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None, None, None, None


def ring_attention(
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
    """Exact attention of this rank's query shard over the whole sharded sequence.

    q: ``(B, S_local, Hq, D)``; k, v: ``(B, S_local, Hkv, D)`` with ``Hq % Hkv == 0`` (only
    the Hkv heads travel). Shards must follow ``layout`` (see ``shard_sequence``).
    ``group=None`` or a group of size 1 is plain local attention. Differentiable.
    """
    check_layout(layout)
    check_attention_inputs(q, k, v, causal=False)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and k/v must hold the same tokens: local lengths {q.shape[1]} and {k.shape[1]}"
        )
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return _LocalAttention.apply(q, k, v, causal, softmax_scale, backend)
    s_local = q.shape[1]
    if s_local % chunks_per_rank(layout) != 0:
        check_seq_len(s_local * world, world, layout)  # raises, naming the multiple needed
    _check_same_shapes_across_ranks(group, q, k)
    return _RingAttention.apply(q, k, v, group, causal, layout, softmax_scale, backend)
