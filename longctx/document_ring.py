"""Document-masked context-parallel attention, driven by a ``DocumentPlan``.

The plain ring passes every K/V shard around; with packed documents most of that is
wasted, since a query sees only its own document. Here rank r, at step s, receives from
rank r - s exactly the key/value rows its queries see of that rank (the plan's
``Exchange``: gathered on the sender, grouped by document) and sends rank r + s what that
rank's queries see of its own shard - point to point, nothing forwarded. A step where
neither side sees anything of the other posts nothing and launches nothing, so ranks that
share no document exchange nothing at all, and the time follows the visible work.

Forward: every step's exchange is posted before the local calls where the rank's messages
fit the memory they are counted in (``DocumentPlan.posts_steps_first``), else the next
step's before the current one is computed (a post waits for the kernels queued before it,
so posting early lets every transfer run under the local calls); each step is one varlen
kernel call (the local step one causal call, plus one per extra run of a document split
inside the shard), partial results merged in fp32 through the log-sum-exp. Backward: steps
in the same order, then the local step, while the dK/dV of every received block go
straight back to their owner (bf16 partials where the kernels write bf16, summed there in
fp32). The forward's messages are kept for the backward where they add up to at most one
shard (always at P = 2, like the plain ring's kept shard); otherwise the backward exchanges
them again.

The gather exchange (a plan built with ``exchange="gather"``, ``longctx.gather_plan``)
moves the same rows without P - 1 steps: one all-to-all brings every rank all the rows its
queries see of every other rank (posted before the local calls, which run while it
travels) and one full varlen call attends to them, merged like a ring step. Backward: that
call's dK/dV are summed per received row (a key row serves several segments) and one
reverse all-to-all takes them home while the local calls' backward runs. Kernel calls and
messages per layer do not grow with P.

``forward_calls`` / ``backward_calls`` run a list of the plan's calls on one device;
Ulysses uses them over the whole sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from longctx.kernels import (
    accumulator_dtype,
    document_block_backward,
    document_block_forward,
    partial_dtype,
)
from longctx.kernels.merge import merge_partials_
from longctx.kernels.rows import Rows, add_rows_, count_rows, rows_of, sum_rows_

from .documents import BlockCall, DocumentPlan, GatherExchange
from .head_groups import by_head_groups, grads_by_head_groups
from .ring_comm import RingExchange


def flatten_batch(t: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (1, B * S, H, D): the plan's rows are the flattened shard's."""
    return t if t.shape[0] == 1 else t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def _as(t: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """``t.to(dtype).view(shape)``, with no call where it would change nothing."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.shape == shape else t.view(shape)


class _Accumulator:
    """A gradient of the shard's rows, allocated by its first contribution: where that covers
    every row it is kept as the kernel wrote it (fp32 from ours; the input dtype from the
    vendor kernels: no zero fill, no copy), else zeros in fp32. Later contributions add in
    fp32 on just their rows (``add_rows_``: one pass), stored in the buffer's dtype."""

    def __init__(self, like: torch.Tensor):
        self.like, self.value = like, None

    def add(self, rows: Rows, grad: torch.Tensor) -> None:
        if self.value is None:
            if rows is None:
                self.value = grad.contiguous()
                return
            self.value = torch.zeros(self.like.shape, dtype=accumulator_dtype(self.like.dtype), device=self.like.device)
        elif rows is None and self.value.dtype != accumulator_dtype(self.like.dtype):
            self.value = self.value.to(accumulator_dtype(self.like.dtype))  # a second full contribution
        add_rows_(self.value, rows, grad)

    def result(self) -> torch.Tensor:
        value = self.value if self.value is not None else torch.zeros_like(self.like)
        return value.to(self.like.dtype)


def call_forward(call: BlockCall, q, k, v, out, lse, scale, backend, only: bool = False):
    """Runs ``call`` and merges it into ``(out, lse)``; ``only``: the plan's one call, whose
    output is final as the kernel writes it (no fp32 accumulator, no casts)."""
    out_b, lse_b = document_block_forward(
        backend,
        rows_of(q, call.q_rows),
        rows_of(k, call.k_rows),
        rows_of(v, call.k_rows),
        call.causal,
        scale,
        None if only else partial_dtype(backend, q.dtype),
        call.q_ids,
        call.k_ids,
        call.segments,
    )
    if only:
        return out_b, lse_b
    if out is None:  # the first call of a plan covers every row: kept as the kernel wrote it
        return out_b.contiguous(), lse_b.to(accumulator_dtype(q.dtype))
    # In fp32, in one pass, into ``out`` as it is: fp32, or the first call's output kept in
    # the kernel's dtype and rounded once (vendor partials are in that dtype anyway, so this
    # rounds exactly as a full fp32 buffer would).
    merge_partials_(out, lse, out_b, lse_b, rows=call.q_rows)
    return out, lse


def _call_backward(call: BlockCall, dout, q, k, v, out, lse, scale, backend):
    rows = call.q_rows
    return document_block_backward(
        backend,
        rows_of(dout, rows),
        rows_of(q, rows),
        rows_of(k, call.k_rows),
        rows_of(v, call.k_rows),
        rows_of(out, rows),
        rows_of(lse, rows, dim=2).contiguous(),
        call.causal,
        scale,
        partial_dtype(backend, q.dtype),
        call.q_ids,
        call.k_ids,
        call.segments,
    )


def forward_calls(q, k, v, calls: list, scale, backend: str, only: bool = False):
    """``(out, lse)`` of flattened ``q, k, v`` (``(1, N, H, D)`` / ``(1, H, N)``) over
    ``calls`` (the first covering every row): fp32 accumulators, or, with ``only`` (one call
    and nothing else to merge), the kernel's own output."""
    out = lse = None
    for call in calls:
        out, lse = call_forward(call, q, k, v, out, lse, scale, backend, only and len(calls) == 1)
    return out, lse


def backward_calls(dout, q, k, v, out, lse, calls: list, scale, backend: str, grads=None):
    """Adds every call's gradients into ``grads`` (``_Accumulator`` for dq, dk, dv; new ones
    if None); returns them."""
    grads = grads or tuple(_Accumulator(t) for t in (q, k, v))
    dq, dk, dv = grads
    for call in calls:
        dq_b, dk_b, dv_b = _call_backward(call, dout, q, k, v, out, lse, scale, backend)
        dq.add(call.q_rows, dq_b)
        dk.add(call.k_rows, dk_b)
        dv.add(call.k_rows, dv_b)
    return grads


def _post_kv(plan: DocumentPlan, comm, step: int, k, v):
    """Start step ``step``'s exchange: returns (receive buffer or None, pending, send buffer)."""
    ex = plan.exchanges[step - 1]
    send = torch.stack([rows_of(k, ex.send_rows), rows_of(v, ex.send_rows)]) if ex.n_send else None
    recv = k.new_empty((2, 1, ex.n_recv, *k.shape[2:])) if ex.n_recv else None
    return recv, comm.swap(step, send, recv), send


def _ring_forward(q, k, v, plan: DocumentPlan, comm, scale, backend, keep: bool):
    shape = q.shape
    q, k, v = flatten_batch(q), flatten_batch(k), flatten_batch(v)
    world = plan.world_size
    # Every step's messages posted before the local calls where the plan allows it (see
    # DocumentPlan.posts_steps_first), else each step's after the step before it.
    first = world if plan.posts_steps_first else min(world, 2)
    posted = [_post_kv(plan, comm, step, k, v) for step in range(1, first)]
    only = plan.calls == 1
    out, lse = forward_calls(q, k, v, plan.local_calls, scale, backend, only=only)
    kept = []
    for step in range(1, world):
        recv, work, _ = posted[step - 1]
        posted[step - 1] = None  # its buffers go with the step (or into `kept`)
        work.wait()
        if len(posted) < world - 1:
            posted.append(_post_kv(plan, comm, step + 1, k, v))
        call = plan.exchanges[step - 1].call
        if call is not None:
            out, lse = call_forward(call, q, recv[0], recv[1], out, lse, scale, backend)
        if keep:
            kept.append(recv if recv is not None else k.new_empty(0))
    return _as(out, q.dtype, (*shape[:3], out.shape[-1])), lse, kept


def _ring_backward(dout, q, k, v, out, lse, kept: Optional[list], plan: DocumentPlan, comm, scale, backend):
    shapes = (q.shape, k.shape, v.shape)
    dout, q, k, v, out = (flatten_batch(t) for t in (dout, q, k, v, out))
    dq, dk, dv = grads = tuple(_Accumulator(t) for t in (q, k, v))
    grad_dtype = partial_dtype(backend, q.dtype) or q.dtype
    world = plan.world_size
    pending = _post_kv(plan, comm, 1, k, v) if world > 1 and kept is None else None
    # dQ of the steps, added after the local step's (which then allocates dq as a copy)
    # where they hold at most one shard's rows; else added as they come.
    gathered = sum(ex.call.q_ids.shape[1] for ex in plan.exchanges if ex.call is not None)
    later_dq = [] if gathered <= q.shape[1] else None
    returning = []
    for step in range(1, world):
        ex = plan.exchanges[step - 1]
        if kept is not None:
            recv = kept[step - 1]
        else:
            recv, work, _ = pending
            work.wait()
            pending = _post_kv(plan, comm, step + 1, k, v) if step + 1 < world else None
        message = None
        if ex.call is not None:
            dq_b, dk_b, dv_b = _call_backward(ex.call, dout, q, recv[0], recv[1], out, lse, scale, backend)
            if later_dq is None:
                dq.add(ex.call.q_rows, dq_b)
            else:
                later_dq.append((ex.call.q_rows, dq_b))
            message = torch.stack([dk_b.to(grad_dtype), dv_b.to(grad_dtype)])
        # This block's dK/dV go home to rank - step; rank + step's for my rows come back.
        back = torch.empty((2, 1, ex.n_send, *k.shape[2:]), dtype=grad_dtype, device=k.device) if ex.n_send else None
        returning.append((back, comm.swap(-step, message, back), message, ex.send_rows))
    # The local step last: it runs while the dK/dV partials travel home.
    if plan.calls == 1 and not any(ex.n_send for ex in plan.exchanges):
        # One call, nothing coming back: its gradients are the result as the kernel writes them.
        grads = _call_backward(plan.local_calls[0], dout, q, k, v, out, lse, scale, backend)
        return tuple(_as(g, t.dtype, shape) for g, t, shape in zip(grads, (q, k, v), shapes))
    backward_calls(dout, q, k, v, out, lse, plan.local_calls, scale, backend, grads=grads)
    for rows, dq_b in later_dq or ():
        dq.add(rows, dq_b)
    for back, work, _, rows in returning:
        work.wait()
        if back is not None:
            dk.add(rows, back[0])
            dv.add(rows, back[1])
    return tuple(g.result().view(shape) for g, shape in zip(grads, shapes))


def _post_gather(ex: GatherExchange, group, k, v):
    """Start the gather exchange: returns (receive buffer ``(n_recv, 2, H, D)``: K and V of
    every row, by source rank; pending; send buffer)."""
    if ex.n_send:
        send = torch.stack([rows_of(k, ex.send_rows)[0], rows_of(v, ex.send_rows)[0]], dim=1)
    else:
        send = k.new_empty((0, 2, *k.shape[2:]))
    recv = k.new_empty((ex.n_recv, 2, *k.shape[2:]))
    work = dist.all_to_all_single(recv, send, list(ex.recv_splits), list(ex.send_splits), group=group, async_op=True)
    return recv, work, send


def _gathered_keys(ex: GatherExchange, recv: torch.Tensor):
    """K and V ``(1, n, H, D)`` of the gather call: the received rows it reads, in its order."""
    k, v = recv[:, 0].unsqueeze(0), recv[:, 1].unsqueeze(0)
    if ex.key_rows is None:
        return k.contiguous(), v.contiguous()
    return k.index_select(1, ex.key_rows), v.index_select(1, ex.key_rows)


def _gather_forward(q, k, v, plan: DocumentPlan, group, scale, backend, keep: bool):
    shape = q.shape
    q, k, v = flatten_batch(q), flatten_batch(k), flatten_batch(v)
    ex = plan.gather
    pending = _post_gather(ex, group, k, v) if ex is not None else None
    # The local calls run while the rows travel.
    out, lse = forward_calls(q, k, v, plan.local_calls, scale, backend, only=plan.calls == 1)
    kept = []
    if pending is not None:
        recv, work, _ = pending
        work.wait()
        if ex.call is not None:
            k_g, v_g = _gathered_keys(ex, recv)
            out, lse = call_forward(ex.call, q, k_g, v_g, out, lse, scale, backend)
        if keep:
            kept.append(recv)
    return _as(out, q.dtype, (*shape[:3], out.shape[-1])), lse, kept


def _to_sources(ex: GatherExchange, dk, dv, grad_dtype) -> torch.Tensor:
    """The gather call's dK/dV ``(1, n, H, D)`` as the message home ``(n_recv, 2, H, D)``: per
    received row, summed in fp32 (fp64 for fp64) over the segments that read it and rounded
    once (``key_sums``: one pass per tensor, a copy where each row is read once)."""
    if ex.key_rows is None:
        return torch.stack([dk[0], dv[0]], dim=1).to(grad_dtype)
    message = torch.empty((ex.n_recv, 2, *dk.shape[2:]), dtype=grad_dtype, device=dk.device)
    for j, g in enumerate((dk, dv)):
        sum_rows_(message[:, j].unsqueeze(0), g, *ex.key_sums)
    return message


def _gather_backward(dout, q, k, v, out, lse, kept: Optional[list], plan: DocumentPlan, group, scale, backend):
    shapes = (q.shape, k.shape, v.shape)
    dout, q, k, v, out = (flatten_batch(t) for t in (dout, q, k, v, out))
    ex = plan.gather
    grad_dtype = partial_dtype(backend, q.dtype) or q.dtype
    if ex is None and plan.calls == 1:  # one call, nothing moves: its gradients as written
        grads = _call_backward(plan.local_calls[0], dout, q, k, v, out, lse, scale, backend)
        return tuple(_as(g, t.dtype, shape) for g, t, shape in zip(grads, (q, k, v), shapes))
    dq, dk, dv = grads = tuple(_Accumulator(t) for t in (q, k, v))
    pending = later_dq = None
    if ex is not None:
        if kept:
            recv = kept[0]
        else:
            recv, work, _ = _post_gather(ex, group, k, v)
            work.wait()
        message = k.new_empty((0, 2, *k.shape[2:]), dtype=grad_dtype)
        if ex.call is not None:
            k_g, v_g = _gathered_keys(ex, recv)
            dq_b, dk_b, dv_b = _call_backward(ex.call, dout, q, k_g, v_g, out, lse, scale, backend)
            later_dq = dq_b  # added after the local calls' (the first allocates dq as a copy)
            message = _to_sources(ex, dk_b, dv_b, grad_dtype)
        back = torch.empty((ex.n_send, 2, *k.shape[2:]), dtype=grad_dtype, device=k.device)
        work = dist.all_to_all_single(
            back, message, list(ex.send_splits), list(ex.recv_splits), group=group, async_op=True
        )
        pending = (back, work, message)
    # The local calls run while the dK/dV partials travel home.
    backward_calls(dout, q, k, v, out, lse, plan.local_calls, scale, backend, grads=grads)
    if later_dq is not None:
        dq.add(ex.call.q_rows, later_dq)
    if pending is not None:
        back, work, _ = pending
        work.wait()
        if ex.n_send:
            if ex.home_slot is not None:  # a row sent to several ranks: its partials summed first
                acc = accumulator_dtype(back.dtype)
                summed = torch.zeros((count_rows(k, ex.home_rows), *back.shape[1:]), dtype=acc, device=back.device)
                back = summed.index_add_(0, ex.home_slot, back.to(acc))
            dk.add(ex.home_rows, back[:, 0].unsqueeze(0))
            dv.add(ex.home_rows, back[:, 1].unsqueeze(0))
    return tuple(g.result().view(shape) for g, shape in zip(grads, shapes))


class _DocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, group, scale, backend, chunks):
        gather = plan.exchange == "gather"
        comm = RingExchange(group) if plan.world_size > 1 and not gather else None
        name = plan.backend(backend, q, k)
        keep = plan.keeps_messages

        def run(q_h, k_h, v_h, g):
            if gather:
                return _gather_forward(q_h, k_h, v_h, plan, group, scale, name, keep)
            return _ring_forward(q_h, k_h, v_h, plan, comm, scale, name, keep)

        out, lse, kept = by_head_groups(q, k, v, chunks, run)
        messages = [m for group_kept in kept for m in group_kept[0]]
        ctx.save_for_backward(q, k, v, out, lse, *messages)
        ctx.args = (plan, group, comm, scale, name, chunks, keep)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *messages = ctx.saved_tensors
        plan, group, comm, scale, name, chunks, keep = ctx.args
        steps = len(messages) // chunks  # messages kept per head group

        def run(dout_h, q_h, k_h, v_h, out_h, lse_h, g):
            kept = messages[g * steps : (g + 1) * steps] if keep else None
            if plan.exchange == "gather":
                return _gather_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, kept, plan, group, scale, name)
            return _ring_backward(dout_h, q_h, k_h, v_h, out_h, lse_h, kept, plan, comm, scale, name)

        dq, dk, dv = grads_by_head_groups(dout.contiguous(), q, k, v, out, lse, chunks, run)
        return dq, dk, dv, None, None, None, None, None


def document_attention(
    q, k, v, plan: DocumentPlan, group, softmax_scale, backend: str, head_chunks: int = 1
) -> torch.Tensor:
    """Exact document-masked attention of this rank's shard by ``plan`` (checked by the caller)."""
    return _DocumentAttention.apply(q, k, v, plan, group, softmax_scale, backend, head_chunks)
