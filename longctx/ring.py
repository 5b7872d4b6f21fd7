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

Packed documents (``document_ids``) do not take this ring: ``longctx.document_ring`` moves
only the key/value rows each rank's queries see, by a ``longctx.documents.DocumentPlan``
built once per step (or, given plain ids, once per call here).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from longctx.kernels import (
    accumulator_dtype,
    attention_backward,
    attention_delta,
    attention_forward,
    check_attention_inputs,
    check_document_ids,
    partial_dtype,
    resolve_backend,
)
from longctx.kernels.merge import merge_partials_

from .document_ring import document_attention
from .documents import DocumentPlan, plan_documents
from .head_groups import by_head_groups, check_head_chunks, grads_by_head_groups
from .layouts import LAYOUTS, check_layout, check_seq_len, chunks_per_rank, unshard_sequence
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


def ring_blocks(rank: int, world_size: int, layout: str, causal: bool, s_local: int) -> list:
    """``(rows, cols, causal mask)`` computed at every step (None: skip)."""
    return [_block_for_step(rank, step, world_size, layout, causal, s_local) for step in range(world_size)]


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


def _finish(buf: torch.Tensor, index: slice, x: torch.Tensor, fresh: bool, dtype: torch.dtype) -> torch.Tensor:
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


# dtype <-> small integer for the cross-rank check (one table for activations and ids).
_DTYPE_CODES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
)
_NO_IDS = -1
_INT64 = torch.iinfo(torch.int64)


def check_cp_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    layout: str,
    *,
    name: str,
    causal: bool = True,
    document_ids: Optional[torch.Tensor] = None,
    extra=None,
) -> int:
    """Validate a context-parallel attention call. Returns the group size (1: run locally).

    With a real group every rank reaches the same verdict on every call: a problem found
    on one rank only (a length its layout cannot split, a shard shaped, typed or laid out
    unlike the others', ids on some ranks only, or what ``extra(world)`` rejects) is
    exchanged in one small all-gather, and every rank raises. A rank raising alone would
    leave the others waiting in a transfer that never comes. The exchange runs on every
    call, not once per shape: a per-rank cache lets a rank that has seen a shape before
    skip it while another rank, given a new shape, waits in it forever.
    """
    world = 1 if group is None else dist.get_world_size(group)
    error = None
    try:
        check_layout(layout)
        check_attention_inputs(q, k, v, causal=False)
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"q and k/v must hold the same tokens: local lengths {q.shape[1]} and {k.shape[1]}")
        if document_ids is not None:
            try:
                check_document_ids(q, k, document_ids, document_ids)
            except (ValueError, TypeError) as e:  # the kernels' check, in the caller's words
                raise type(e)(str(e).replace("q_document_ids", "document_ids")) from None
        if world > 1:
            if q.shape[1] % chunks_per_rank(layout) != 0:
                check_seq_len(q.shape[1] * world, world, layout)  # raises, naming the multiple
            if extra is not None:
                extra(world)
    except (ValueError, TypeError) as e:
        if world == 1:
            raise
        error = e
    if world == 1:
        return world
    table = _exchange_call_summary(group, q, k, layout, causal, document_ids, failed=error is not None)
    if error is not None:
        raise error
    _check_group_agrees(table, name)
    return world


def _shape_row(t: torch.Tensor) -> list:
    return list(t.shape[:4]) + [-1] * (4 - min(4, t.dim()))  # fixed width, whatever arrives


def _code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else len(_DTYPE_CODES)


def _dtype_name(code: int) -> str:
    if code == _NO_IDS:
        return "None"
    return str(_DTYPE_CODES[code]) if code < len(_DTYPE_CODES) else "another dtype"


# Columns of the exchanged table.
_Q_SHAPE, _K_SHAPE, _DTYPE, _LAYOUT, _CAUSAL, _IDS, _FAILED = (slice(0, 4), slice(4, 8), 8, 9, 10, 11, 12)
_AGREED = 12  # columns 0..11 must be equal on every rank


def _exchange_call_summary(group, q, k, layout, causal, document_ids, failed: bool) -> torch.Tensor:
    """All-gather one small int64 row per rank describing this call; returns the (P, 13)
    table on the CPU. Over NCCL it travels on the GPU, so reading it is one host sync."""
    device = q.device if dist.get_backend(group) == "nccl" and q.is_cuda else torch.device("cpu")
    ids_code = (
        _NO_IDS
        if document_ids is None
        else _code(document_ids.dtype)
        if isinstance(document_ids, torch.Tensor)
        else len(_DTYPE_CODES)
    )
    mine = torch.tensor(
        [
            *_shape_row(q),
            *_shape_row(k),
            _code(q.dtype),
            LAYOUTS.index(layout) if layout in LAYOUTS else -1,
            int(bool(causal)),
            ids_code,
            int(failed),
        ],
        dtype=torch.int64,
        device=device,
    )
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return torch.stack(everyone).cpu()


def _check_group_agrees(table: torch.Tensor, name: str) -> None:
    world = table.shape[0]
    bad = [r for r in range(world) if table[r, _FAILED]]
    if bad:
        raise ValueError(
            f"{name}: rank(s) {bad} of the context-parallel group rejected their inputs (their "
            "error says why); every rank stops here"
        )
    if bool((table[:, :_AGREED] == table[0, :_AGREED]).all()):
        return
    per_rank = lambda column, show: {r: show(table[r, column]) for r in range(world)}  # noqa: E731
    differs = lambda column: not bool((table[:, column] == table[0, column]).all())  # noqa: E731
    problems = []
    if differs(_Q_SHAPE) or differs(_K_SHAPE):
        problems.append(
            f"different shard shapes (q shape per rank: {per_rank(_Q_SHAPE, lambda t: tuple(t.tolist()))}, "
            f"k/v shape per rank: {per_rank(_K_SHAPE, lambda t: tuple(t.tolist()))})"
        )
    if differs(_DTYPE):
        problems.append(f"different dtypes (per rank: {per_rank(_DTYPE, lambda t: _dtype_name(int(t)))})")
    if differs(_LAYOUT):
        problems.append(f"different layouts (per rank: {per_rank(_LAYOUT, lambda t: LAYOUTS[int(t)])})")
    if differs(_CAUSAL):
        problems.append(f"different causal flags (per rank: {per_rank(_CAUSAL, lambda t: bool(t))})")
    if differs(_IDS):
        problems.append(f"different document_ids (dtype per rank: {per_rank(_IDS, lambda t: _dtype_name(int(t)))})")
    raise ValueError(
        f"{name}: ranks of the context-parallel group hold "
        + "; ".join(problems)
        + "; every rank must hold an equal slice of the same sequence and pass the same arguments"
    )


class _LocalAttention(torch.autograd.Function):
    """group=None or size 1: plain attention through the same block kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, chunks):
        def run(q_h, k_h, v_h, g):
            return attention_forward(q_h, k_h, v_h, causal=causal, softmax_scale=scale, backend=backend)

        out, lse, _ = by_head_groups(q, k, v, chunks, run)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, backend, chunks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, backend, chunks = ctx.args

        def run(dout_h, q_h, k_h, v_h, out_h, lse_h, g):
            return attention_backward(
                dout_h, q_h, k_h, v_h, out_h, lse_h, causal=causal, softmax_scale=scale, backend=backend
            )

        dq, dk, dv = grads_by_head_groups(dout, q, k, v, out, lse, chunks, run)
        return dq, dk, dv, None, None, None, None


def _ring_forward(q, k, v, comm, scale, backend, blocks):
    """One pass of the forward ring: ``(out, lse, kept K/V)``."""
    world = comm.world_size
    acc_dtype = accumulator_dtype(q.dtype)
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
        # Post the next hop before computing, so the transfer overlaps this block. A
        # skipped block's K/V travel on all the same: the next rank may need them.
        pending = comm.shift(current, slots[(step + 1) % 2]) if step + 1 < world else None
        if blocks[step] is not None:
            rows, cols, masked = blocks[step]
            out_b, lse_b = attention_forward(
                q[:, rows],
                current[0][:, cols],
                current[1][:, cols],
                causal=masked,
                softmax_scale=scale,
                backend=backend,
                out_dtype=partial_dtype(backend, acc_dtype),
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

    # rank+1's K/V shard (step P-1): the backward's first block, already here.
    return out.to(q.dtype), lse, slots[(world - 1) % 2]


def _ring_backward(dout, q, k, v, out, lse, last_kv, comm, scale, backend, blocks):
    """One pass of the backward ring: ``(dq, dk, dv)``."""
    world = comm.world_size
    acc_dtype = accumulator_dtype(q.dtype)

    # delta = rowsum(dO * O) once per layer, not once per block (None for vendor kernels,
    # which recompute it inside and ignore a given one).
    delta = attention_delta(out, dout, backend=backend)
    dq = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
    dq_fresh = True  # no block has written dq yet

    def block_grads(step, block_k, block_v):
        """Adds this step's dQ; returns (kv rows, dK, dV) of the block, or None. The
        last block (step 0) returns dQ finished in q's dtype as a fourth item."""
        nonlocal dq_fresh
        if blocks[step] is None:
            return None
        rows, cols, masked = blocks[step]
        dq_b, dk_b, dv_b = attention_backward(
            dout[:, rows],
            q[:, rows],
            block_k[:, cols],
            block_v[:, cols],
            out[:, rows],
            lse[:, :, rows],
            causal=masked,
            softmax_scale=scale,
            backend=backend,
            delta=None if delta is None else delta[:, :, rows],
            grad_dtype=partial_dtype(backend, acc_dtype),
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
    recv_kv = [torch.empty_like(last_kv) if world > 2 else None, torch.empty_like(last_kv) if world > 3 else None]
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
    return dq_out, dk_out, dv_out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, backend, blocks, chunks):
        comm = RingExchange(group)
        name = resolve_backend(backend, q, k, causal)

        def run(q_h, k_h, v_h, g):
            return _ring_forward(q_h, k_h, v_h, comm, scale, name, blocks)

        out, lse, kept = by_head_groups(q, k, v, chunks, run)
        ctx.save_for_backward(q, k, v, out, lse, *(kv for (kv,) in kept))
        ctx.args = (group, scale, name, blocks, chunks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *kept_kv = ctx.saved_tensors
        group, scale, name, blocks, chunks = ctx.args
        comm = RingExchange(group)

        def run(dout_h, q_h, k_h, v_h, out_h, lse_h, g):
            return _ring_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, kept_kv[g], comm, scale, name, blocks)

        dq, dk, dv = grads_by_head_groups(dout, q, k, v, out, lse, chunks, run)
        return dq, dk, dv, None, None, None, None, None, None


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
    document_ids=None,
    head_chunks: int = 1,
) -> torch.Tensor:
    """Exact attention of this rank's query shard over the whole sharded sequence.

    q: ``(B, S_local, Hq, D)``; k, v: ``(B, S_local, Hkv, D)`` with ``Hq % Hkv == 0`` (only
    the Hkv heads travel). Shards must follow ``layout`` (see ``shard_sequence``).
    ``group=None`` or a group of size 1 is plain local attention. Differentiable.

    ``document_ids``: None; an integer ``(B, S_local)`` tensor sharded like q: query i
    attends key j only where both carry the same id (and j <= i when causal, positions
    global); or the step's ``longctx.documents.DocumentPlan`` (``plan_documents`` of the
    full ids, built once per step and reused by every layer: no collective, no host sync
    in the call). Either way only the key/value rows a rank's queries see move, and ranks
    that share no document exchange nothing (``longctx.document_ring``); plain ids are
    all-gathered and planned once per call.

    ``head_chunks``: run the whole ring (forward, and backward) for ``Hkv / head_chunks``
    key/value heads (and their query heads) at a time. Same result; the kernels' and the
    ring's fp32 accumulators, the messages and their buffers shrink by that factor (a
    memory knob: each chunk is a full ring pass, P - 1 more hops of smaller messages).
    """
    if isinstance(document_ids, DocumentPlan):
        plan = document_ids
        check_attention_inputs(q, k, v, causal=False)
        plan.check_call(q, group, layout, causal, "ring_attention")
        check_head_chunks(head_chunks, k.shape[2])
        if not plan.one_document:
            return document_attention(q, k, v, plan, group, softmax_scale, backend, head_chunks)
        world = plan.world_size  # one document per row: the plain ring, checked already
    else:
        world = check_cp_inputs(q, k, v, group, layout, name="ring_attention", causal=causal, document_ids=document_ids)
        check_head_chunks(head_chunks, k.shape[2])
        if document_ids is not None:
            full = document_ids if world == 1 else unshard_sequence(document_ids, 1, group=group, layout=layout)
            plan = plan_documents(
                full,
                world_size=world,
                rank=0 if world == 1 else dist.get_rank(group),
                layout=layout,
                causal=causal,
                device=q.device,
            )
            if not plan.one_document:
                return document_attention(
                    q, k, v, plan, group if world > 1 else None, softmax_scale, backend, head_chunks
                )
    if world == 1:
        return _LocalAttention.apply(q, k, v, causal, softmax_scale, backend, head_chunks)
    blocks = ring_blocks(dist.get_rank(group), world, layout, causal, q.shape[1])
    return _RingAttention.apply(q, k, v, group, causal, softmax_scale, backend, blocks, head_chunks)
