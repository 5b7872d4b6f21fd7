"""Decoding over a context-parallel group: the prompt's K/V stays sharded where the ring put it.

After a prefill with ring attention every rank holds the K/V of its own shard of the prompt
(per layer). A new token's query, computed identically on every rank, attends to every
rank's shard without moving any K/V: each rank computes the partial attention ``(out, lse)``
of the query over the keys it holds, one all-gather per layer exchanges those partials
(``B x heads x (head_dim + 1)`` numbers per rank and token), and every rank merges them in
rank order with the ring's log-sum-exp merge (``kernels.merge``). The order is the same on
every rank, so every rank ends with the same result, bit for bit.

No causal mask is needed: every key a rank holds precedes the new queries. The new token's
own K/V is appended to one rank's cache (``KVShard``) before its attention, so it and every
later token see it; which rank is the caller's rule (``longctx.models.generate``: round robin).

With ``group=None`` (or a group of one) this is plain attention over the local cache.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from longctx.kernels import accumulator_dtype, attention_forward, partial_dtype, resolve_backend
from longctx.kernels.merge import merge_partials_


class KVShard:
    """One layer's keys and values held by this rank, ``(B, length, Hkv, D)``, in a buffer
    with room for appended tokens (it grows by doubling when that runs out)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, capacity: Optional[int] = None):
        if k.shape != v.shape or k.dim() != 4:
            raise ValueError(f"k and v must be equal (B, S, Hkv, D) tensors, got {tuple(k.shape)} and {tuple(v.shape)}")
        capacity = max(k.shape[1], capacity or 0)
        self._buf = torch.empty((2, k.shape[0], capacity, *k.shape[2:]), dtype=k.dtype, device=k.device)
        self._buf[0, :, : k.shape[1]] = k
        self._buf[1, :, : k.shape[1]] = v
        self.length = k.shape[1]

    @property
    def k(self) -> torch.Tensor:
        return self._buf[0, :, : self.length]

    @property
    def v(self) -> torch.Tensor:
        return self._buf[1, :, : self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add ``(B, T, Hkv, D)`` keys and values after the held ones."""
        n = k.shape[1]
        if self.length + n > self._buf.shape[2]:
            grown = torch.empty(
                (*self._buf.shape[:2], max(2 * self._buf.shape[2], self.length + n), *self._buf.shape[3:]),
                dtype=self._buf.dtype,
                device=self._buf.device,
            )
            grown[:, :, : self.length] = self._buf[:, :, : self.length]
            self._buf = grown
        self._buf[0, :, self.length : self.length + n] = k
        self._buf[1, :, self.length : self.length + n] = v
        self.length += n


def _local_partial(q, k, v, softmax_scale, backend):
    """``(out, lse)`` of ``q`` over the local keys, in the accumulator dtype; a rank holding
    no key gives ``(0, -inf)``, which the merge treats as no contribution."""
    acc = accumulator_dtype(q.dtype)
    if k.shape[1] == 0:
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        return out, lse
    name = resolve_backend(backend, q, k, False)
    out, lse = attention_forward(
        q, k, v, causal=False, softmax_scale=softmax_scale, backend=name, out_dtype=partial_dtype(name, acc)
    )
    return out.to(acc), lse.to(acc)


def sharded_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of new queries over the keys and values of every rank of ``group``.

    ``q``: ``(B, T, Hq, D)``, the same on every rank (the new tokens, which come after every
    held key: no mask); ``k``, ``v``: this rank's ``(B, S_r, Hkv, D)`` (``S_r`` may differ
    between ranks, and be 0). Returns ``(B, T, Hq, D)`` in q's dtype, the same on every rank:
    the partials are all-gathered (one collective) and merged in rank order.
    """
    out, lse = _local_partial(q, k, v, softmax_scale, backend)
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return out.to(q.dtype)
    # One message: out and lse of this rank, flattened side by side.
    mine = torch.cat([out.reshape(-1), lse.reshape(-1)])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    n_out = out.numel()
    merged_out = everyone[0][:n_out].view(out.shape).clone()
    merged_lse = everyone[0][n_out:].view(lse.shape).clone()
    for part in everyone[1:]:
        merge_partials_(merged_out, merged_lse, part[:n_out].view(out.shape), part[n_out:].view(lse.shape))
    return merged_out.to(q.dtype)
