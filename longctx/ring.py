"""Ring attention: exact attention over a sequence sharded across a context-parallel group.

Forward: each rank keeps its Q shard; K/V shards travel rank -> rank+1 for P-1 hops while
every rank merges its partial softmax results in fp32 through the log-sum-exp. The last
K/V shard a rank receives (rank+1's) is kept for the backward.

Backward: the same blocks in reverse order, K/V travelling the other way (rank -> rank-1)
together with fp32 dK/dV accumulators that collect every other rank's contribution.
Reversing the order hides both ends of the backward ring: its first block is the shard
kept from the forward (no transfer to wait for), and the local diagonal block is computed
last, while the accumulated dK/dV of the local shard make their final hop home. (With the
diagonal first, as in the forward, that final fp32 hop has nothing to overlap with.)
Per rank: at most three K/V shards (one kept), two dK/dV shards and the fp32 accumulators
are resident, so memory is O(S/P).

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

from longctx.kernels import (attention_backward, attention_delta, attention_forward,
                             check_attention_inputs, resolve_backend)
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


def _add_into(buf: torch.Tensor, index: slice, x: torch.Tensor, fresh: bool) -> None:
    """``buf[:, index] += x``; into a ``fresh`` (uninitialised) buffer, a copy instead and
    zeros outside ``index``: one pass less over the fp32 buffer than zero-fill + add."""
    if not fresh:
        buf[:, index] += x
        return
    n = buf.shape[1]
    start, stop, _ = index.indices(n)
    if start > 0:
        buf[:, :start].zero_()
    if stop < n:
        buf[:, stop:].zero_()
    buf[:, start:stop].copy_(x)


def _finish(buf: torch.Tensor, index: slice, x: torch.Tensor, fresh: bool,
            dtype: torch.dtype) -> torch.Tensor:
    """The last contribution: ``buf`` plus ``x`` at ``index``, returned as ``dtype``. Where
    ``index`` covers the whole buffer this is one pass (computed in fp32, rounded once on
    write) instead of an in-place add followed by a cast."""
    start, stop, _ = index.indices(buf.shape[1])
    if start == 0 and stop == buf.shape[1]:
        if fresh:
            return x.to(dtype)
        return torch.add(buf, x, out=torch.empty(buf.shape, dtype=dtype, device=buf.device))
    _add_into(buf, index, x, fresh)
    return buf.to(dtype)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _partial_dtype(backend: str, acc_dtype: torch.dtype):
    """dtype block kernels return partials in. Our kernels write fp32 at no extra pass;
    the vendor kernels only produce the input dtype, and the merge/accumulate kernels
    upcast those while reading, so asking them for fp32 would only add a cast pass."""
    return None if backend in ("cudnn", "flash") else acc_dtype


_verified_shapes: set = set()
_DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_cp_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: str,
                    *, name: str, extra=None) -> int:
    """Validate a context-parallel attention call; returns the group size (1: run locally).

    With a real group every rank reaches the same verdict: a problem found on one rank
    only (a length its layout cannot split, a shard shaped unlike the others', or what
    ``extra(world)`` rejects) is exchanged in the one-time cross-rank check, and every
    rank raises. A rank raising alone would leave the others waiting in a transfer that
    never comes.
    """
    world = 1 if group is None else dist.get_world_size(group)
    error = None
    try:
        check_layout(layout)
        check_attention_inputs(q, k, v, causal=False)
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"q and k/v must hold the same tokens: local lengths {q.shape[1]} and {k.shape[1]}"
            )
        if world > 1:
            if q.shape[1] % chunks_per_rank(layout) != 0:
                check_seq_len(q.shape[1] * world, world, layout)  # raises, naming the multiple
            if extra is not None:
                extra(world)
    except (ValueError, TypeError) as e:
        if world == 1:
            raise
        error = e
    if world > 1:
        _check_group_agrees(group, q, k, layout, name, failed=error is not None)
    if error is not None:
        raise error
    return world


def _shape_row(t: torch.Tensor) -> list:
    return list(t.shape[:4]) + [-1] * (4 - min(4, t.dim()))  # fixed width, whatever arrives


def _check_group_agrees(group, q: torch.Tensor, k: torch.Tensor, layout: str, name: str,
                        failed: bool) -> None:
    """One small all-gather per new (group, shapes, dtype, layout), cached afterwards so the
    ring loop never pays it again (on CUDA it costs one host sync the first time)."""
    key = (id(group), tuple(q.shape), tuple(k.shape), q.dtype, layout)
    if key in _verified_shapes and not failed:
        return
    device = q.device if dist.get_backend(group) == "nccl" and q.is_cuda else torch.device("cpu")
    code = _DTYPE_CODES.index(q.dtype) if q.dtype in _DTYPE_CODES else -1
    mine = torch.tensor([*_shape_row(q), *_shape_row(k), code, int(failed)], device=device)
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    bad = [r for r in range(world) if table[r, -1]]
    if bad:
        if failed:
            return  # the caller raises this rank's own error
        raise ValueError(
            f"{name}: rank(s) {bad} of the context-parallel group rejected their inputs (their "
            "error says why); every rank stops here"
        )
    if not bool((table[:, :-1] == table[0, :-1]).all()):
        rows = {r: tuple(table[r, :4].tolist()) for r in range(world)}
        raise ValueError(
            f"{name}: ranks of the context-parallel group hold different shard shapes or "
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

        # Double buffer, allocated once per call as two tensors, so that keeping the last
        # slot for the backward does not keep the other alive. Slot = [k, v]: one message
        # per hop.
        slots = [torch.empty((2, *k.shape), dtype=k.dtype, device=k.device) for _ in range(2)]
        slots[0][0].copy_(k)
        slots[0][1].copy_(v)
        out: Optional[torch.Tensor] = None
        lse: Optional[torch.Tensor] = None
        for step in range(world):
            current = slots[step % 2]
            # Post the next hop before computing, so the transfer overlaps this block.
            pending = comm.shift(current, slots[(step + 1) % 2]) if step + 1 < world else None
            block = _block_for_step(rank, step, world, layout, causal, s_local)
            if block is not None:
                rows, cols, masked = block
                out_b, lse_b = attention_forward(
                    q[:, rows], current[0][:, cols], current[1][:, cols],
                    causal=masked, softmax_scale=scale, backend=backend, out_dtype=partial_dtype,
                )
                if out is None:
                    # Step 0 always covers every local query row (diagonal or full block).
                    # Dense (B, S, H, D) whatever layout the kernel wrote: the merges, the
                    # model's reshape and the vendor backward (which copies a dO strided
                    # unlike O) then all see one layout. A no-op for our fp32 partials.
                    out = out_b.to(acc_dtype, memory_format=torch.contiguous_format)
                    lse = lse_b.to(acc_dtype)
                else:
                    merge_partials_(out[:, rows], lse[:, :, rows], out_b, lse_b)
            if pending is not None:
                pending.wait()

        result = out.to(q.dtype)
        # rank+1's K/V shard (step P-1): the backward's first block, already here.
        last_kv = slots[(world - 1) % 2]
        ctx.save_for_backward(q, k, v, result, lse, last_kv)
        ctx.args = (group, causal, layout, scale, backend)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, last_kv = ctx.saved_tensors
        group, causal, layout, scale, backend = ctx.args
        comm = RingExchange(group)
        world, rank = comm.world_size, comm.rank
        s_local = q.shape[1]
        acc_dtype = _accumulator_dtype(q.dtype)
        partial_dtype = _partial_dtype(backend, acc_dtype)  # backend was resolved in forward

        # delta = rowsum(dO * O) once per layer, not once per block (None for the vendor
        # kernels, which recompute it inside).
        delta = attention_delta(out, dout, backend=backend)
        dq = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
        dq_fresh = True  # no block has written dq yet

        def block_grads(step, block_k, block_v):
            """Adds this step's dQ; returns (kv rows, dK, dV) of the block, or None. The
            last block (step 0) returns dQ finished in q's dtype as a fourth item."""
            nonlocal dq_fresh
            block = _block_for_step(rank, step, world, layout, causal, s_local)
            if block is None:
                return None
            rows, cols, masked = block
            dq_b, dk_b, dv_b = attention_backward(
                dout[:, rows], q[:, rows], block_k[:, cols], block_v[:, cols],
                out[:, rows], lse[:, :, rows],
                causal=masked, softmax_scale=scale, backend=backend,
                delta=None if delta is None else delta[:, :, rows], grad_dtype=partial_dtype,
            )
            if step == 0:
                return cols, dk_b, dv_b, _finish(dq, rows, dq_b, dq_fresh, q.dtype)
            _add_into(dq, rows, dq_b, dq_fresh)
            dq_fresh = False
            return cols, dk_b, dv_b

        # Steps P-1, ..., 1 (K/V of ranks r+1, r+2, ..., r-1), then the diagonal (step 0).
        # K/V arrive from rank+1 into two receive buffers (the kept shard is never
        # overwritten: a second backward with retain_graph=True must find it intact).
        # dK/dV accumulators go to rank-1, double-buffered.
        recv_kv = [torch.empty_like(last_kv) if world > 2 else None,
                   torch.empty_like(last_kv) if world > 3 else None]
        dkv = [torch.empty((2, *k.shape), dtype=acc_dtype, device=k.device) for _ in range(2)]
        dkv_pending = None
        for i, step in enumerate(range(world - 1, 0, -1)):
            current = last_kv if i == 0 else recv_kv[(i - 1) % 2]
            # Post the next block's K/V before computing this one.
            kv_pending = comm.shift_back(current, recv_kv[i % 2]) if step > 1 else None
            grads = block_grads(step, current[0], current[1])
            acc = dkv[i % 2]
            fresh = dkv_pending is None  # this rank is the block's first contributor
            if not fresh:
                dkv_pending.wait()  # rank+1's partial sums for this block have arrived
            if grads is not None:
                cols, dk_b, dv_b = grads
                _add_into(acc[0], cols, dk_b, fresh)
                _add_into(acc[1], cols, dv_b, fresh)
            elif fresh:
                acc.zero_()
            # Pass the partial sums on; the hop after step 1 takes them to the block's owner.
            dkv_pending = comm.shift_back(acc, dkv[(i + 1) % 2])
            if kv_pending is not None:
                kv_pending.wait()
        # The diagonal block (which every rank has: step 0 is never skipped) runs while
        # this shard's accumulated dK/dV travel home.
        cols, dk_b, dv_b, dq_out = block_grads(0, k, v)
        dkv_pending.wait()
        home = dkv[(world - 1) % 2]
        dk_out = _finish(home[0], cols, dk_b, False, k.dtype)
        dv_out = _finish(home[1], cols, dv_b, False, v.dtype)
        return dq_out, dk_out, dv_out, None, None, None, None, None


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
    world = check_cp_inputs(q, k, v, group, layout, name="ring_attention")
    if world == 1:
        return _LocalAttention.apply(q, k, v, causal, softmax_scale, backend)
    return _RingAttention.apply(q, k, v, group, causal, layout, softmax_scale, backend)
