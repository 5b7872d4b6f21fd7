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
be a multiple of P; the ring has no such limit. Transfers overlap compute by head
groups (``PIPELINE_CHUNKS``): all groups' all-to-alls are posted at once and run in
order on the communication stream while the groups' attention runs on the compute
stream, each group's output going back as soon as it is ready.
``benchmarks/ring.py`` measures both.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist

from longctx.kernels import attention_backward, attention_forward, check_attention_inputs

from .document_ring import backward_calls, flatten_batch, forward_calls
from .documents import DocumentPlan, plan_documents
from .layouts import unshard_sequence
from .ring import check_cp_inputs, ring_attention

# Head groups per rank that take turns: while one group's attention runs, the next
# group's all-to-all is in flight (and the previous group's output travels back).
PIPELINE_CHUNKS = 2


@lru_cache(maxsize=None)
def _zigzag_index(world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-shards in rank-major order (2 * rank + half) vs sequence order of the 2P chunks.

    Rank r holds chunks r and 2P-1-r. Returns (for each chunk, its rank-major index;
    for each rank-major index, its chunk)."""
    chunk_of = [r if half == 0 else 2 * world - 1 - r for r in range(world) for half in (0, 1)]
    to_sequence = [chunk_of.index(c) for c in range(2 * world)]
    return (torch.tensor(to_sequence, device=device), torch.tensor(chunk_of, device=device))


def _ranks_to_sequence(parts: torch.Tensor, layout: str) -> torch.Tensor:
    """(P, B, S_local, h, D), part i = rank i's shard -> (B, S, h, D) in sequence order."""
    world, b, s_local, h, d = parts.shape
    if layout == "contiguous":
        return parts.transpose(0, 1).reshape(b, world * s_local, h, d)
    halves = parts.view(world, b, 2, s_local // 2, h, d).transpose(1, 2).reshape(2 * world, b, s_local // 2, h, d)
    chunks = halves.index_select(0, _zigzag_index(world, parts.device)[0])  # one copy (B = 1)
    return chunks.transpose(0, 1).reshape(b, world * s_local, h, d)


def _sequence_to_ranks(full: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    """Inverse of ``_ranks_to_sequence``: (B, S, h, D) -> contiguous (P, B, S_local, h, D)."""
    b, s, h, d = full.shape
    if layout == "contiguous":
        return full.view(b, world, s // world, h, d).transpose(0, 1).contiguous()
    chunks = full.view(b, 2 * world, s // (2 * world), h, d).transpose(0, 1)
    halves = chunks.index_select(0, _zigzag_index(world, full.device)[1])  # rank-major
    return (
        halves.view(world, 2, b, s // (2 * world), h, d)
        .transpose(1, 2)
        .reshape(world, b, s // world, h, d)
        .contiguous()
    )


def _heads_for_everyone(t: torch.Tensor, world: int, chunks: int, g: int) -> torch.Tensor:
    """(B, S_local, H, D) -> (P, B, S_local, H / (P * chunks), D): slot j holds rank j's
    heads of head group g."""
    b, s_local, heads, d = t.shape
    return t.reshape(b, s_local, world, chunks, heads // (world * chunks), d)[:, :, :, g].permute(2, 0, 1, 3, 4)


def _start_all_to_all(send: torch.Tensor, group):
    send = send.contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return recv, _Pending(work, send)


class _Pending:
    """An async all-to-all and its send buffer, kept alive until the transfer is waited on."""

    def __init__(self, work, send: torch.Tensor):
        self._work, self._send = work, send

    def wait(self) -> None:
        self._work.wait()
        self._send = None


def _to_shard(dst: torch.Tensor, parts: torch.Tensor, world: int, chunks: int, g: int) -> None:
    """Write (P, B, S_local, h, D), slot j = rank j's heads of group g, into dst's heads."""
    b, s_local, heads, d = dst.shape
    dst.view(b, s_local, world, chunks, heads // (world * chunks), d)[:, :, :, g].copy_(parts.permute(1, 2, 0, 3, 4))


def _attend(qf, kf, vf, calls, causal, scale, backend):
    """Attention over the full sequence for this rank's heads: plain, or by the plan's calls."""
    if calls is None:
        return attention_forward(qf, kf, vf, causal=causal, softmax_scale=scale, backend=backend)
    out, lse = forward_calls(*(flatten_batch(t) for t in (qf, kf, vf)), calls, scale, backend, only=True)
    return out.to(qf.dtype).view(*qf.shape[:3], -1), lse


def _attend_backward(dout_f, qf, kf, vf, out_f, lse, calls, causal, scale, backend):
    if calls is None:
        return attention_backward(dout_f, qf, kf, vf, out_f, lse, causal=causal, softmax_scale=scale, backend=backend)
    flat = [flatten_batch(t) for t in (dout_f, qf, kf, vf, out_f)]
    grads = backward_calls(*flat, lse, calls, scale, backend)
    return tuple(g.result().view(t.shape) for g, t in zip(grads, (qf, kf, vf)))


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, group, causal, layout, scale, backend):
        world = dist.get_world_size(group)
        calls = None
        if plan is not None:
            calls, backend = plan.sequence_calls(), plan.backend(backend, q, k)
        hkv = k.shape[2] // world
        chunks = PIPELINE_CHUNKS if hkv % PIPELINE_CHUNKS == 0 else 1
        widths = [t.shape[2] // (world * chunks) for t in (q, k, v)]
        # Post every group's all-to-all (q, k, v packed): they run back to back on the
        # communication stream while the groups' attention runs on the compute stream.
        inbound = [
            _start_all_to_all(torch.cat([_heads_for_everyone(t, world, chunks, g) for t in (q, k, v)], dim=3), group)
            for g in range(chunks)
        ]
        out = torch.empty_like(q)
        outbound, saved = [], []
        for g, (recv, work) in enumerate(inbound):
            work.wait()
            qf, kf, vf = _ranks_to_sequence(recv, layout).split(widths, dim=2)
            out_f, lse = _attend(qf, kf, vf, calls, causal, scale, backend)
            outbound.append(_start_all_to_all(_sequence_to_ranks(out_f, world, layout), group))
            saved += [qf, kf, vf, out_f, lse]
        for g, (recv, work) in enumerate(outbound):
            work.wait()
            _to_shard(out, recv, world, chunks, g)
        ctx.save_for_backward(*saved)
        ctx.args = (group, causal, layout, scale, backend, chunks, widths, calls)
        return out

    @staticmethod
    def backward(ctx, dout):
        group, causal, layout, scale, backend, chunks, widths, calls = ctx.args
        saved = ctx.saved_tensors
        world = dist.get_world_size(group)
        dout = dout.contiguous()
        inbound = [_start_all_to_all(_heads_for_everyone(dout, world, chunks, g), group) for g in range(chunks)]
        outbound = []
        for g, (recv, work) in enumerate(inbound):
            work.wait()
            qf, kf, vf, out_f, lse = saved[5 * g : 5 * g + 5]
            grads = _attend_backward(
                _ranks_to_sequence(recv, layout), qf, kf, vf, out_f, lse, calls, causal, scale, backend
            )
            outbound.append(_start_all_to_all(_sequence_to_ranks(torch.cat(grads, dim=2), world, layout), group))
        b, s_local, _, d = dout.shape
        dq, dk, dv = (
            torch.empty(b, s_local, w * world * chunks, d, dtype=dout.dtype, device=dout.device) for w in widths
        )
        for g, (recv, work) in enumerate(outbound):
            work.wait()
            for dst, part in zip((dq, dk, dv), recv.split(widths, dim=3)):
                _to_shard(dst, part, world, chunks, g)
        return dq, dk, dv, None, None, None, None, None, None


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
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact attention of this rank's shard over the whole sharded sequence, head-parallel.

    Arguments as ``ring_attention``; additionally ``Hkv`` (and so ``Hq``) must be a
    multiple of the group size. ``group=None`` or size 1 is plain local attention.
    ``document_ids`` as in ``ring_attention`` (ids, or the step's ``DocumentPlan``): every
    rank attends over the whole sequence for its heads, so documents need no exchange of
    their own; their segments come from the plan (plain ids: gathered and planned per call).
    """

    def heads_split(world: int) -> None:
        if k.shape[2] % world != 0:
            raise ValueError(
                f"ulysses_attention splits heads over the group: the {k.shape[2]} key/value "
                f"heads are not a multiple of the group size {world}; use ring_attention"
            )

    if isinstance(document_ids, DocumentPlan):
        plan = document_ids
        check_attention_inputs(q, k, v, causal=False)
        plan.check_call(q, group, layout, causal, "ulysses_attention")
        world = plan.world_size
        heads_split(world)
    else:
        world = check_cp_inputs(
            q,
            k,
            v,
            group,
            layout,
            name="ulysses_attention",
            causal=causal,
            document_ids=document_ids,
            extra=heads_split,
        )
        plan = None
        if document_ids is not None and world > 1:
            plan = plan_documents(
                unshard_sequence(document_ids, 1, group=group, layout=layout),
                world_size=world,
                rank=dist.get_rank(group),
                layout=layout,
                causal=causal,
                device=q.device,
            )
    if world == 1:  # the ring's local path: plain attention through the same kernels
        return ring_attention(
            q, k, v, group=None, causal=causal, softmax_scale=softmax_scale, backend=backend, document_ids=document_ids
        )
    if plan is not None and plan.one_document:
        plan = None
    return _UlyssesAttention.apply(q, k, v, plan, group, causal, layout, softmax_scale, backend)
