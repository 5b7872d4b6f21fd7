"""Point-to-point ring exchange along the ring in either direction, without blocking.

Why batched isend/irecv: ``dist.batch_isend_irecv`` posts the send and the receive
together, so every rank is sending and receiving at once and no ordering of the ranks
can deadlock, for any group size (2, odd, 8, ...). On NCCL the pair runs on
ProcessGroupNCCL's own communication stream: when posted, that stream waits for the
work already queued on the current (compute) stream, so a receive never overwrites a
buffer a queued kernel still reads; ``wait()`` only makes the current stream wait for
the transfer, it does not block the host. Compute queued after posting therefore runs
concurrently with the transfer. On gloo (CPU) ``wait()`` blocks, which is fine there.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def new_ring_group(
    ranks: Sequence[int], *, timeout: Optional[timedelta] = None, high_priority: bool = False
) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` for a context-parallel group; every rank must call it.

    On NCCL, ``high_priority`` puts the group's communication stream at the highest CUDA
    stream priority, so that a hop posted just before a block could be scheduled ahead of
    that block's attention kernel. Measured on 2 x H200 (benchmarks/ring.py --sections
    priority): no difference at 32K or 128K, hence off by default.
    """
    kwargs = {} if timeout is None else {"timeout": timeout}
    if high_priority and dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
        kwargs["pg_options"] = options
    return dist.new_group(list(ranks), **kwargs)


class RingExchange:
    """Ring neighbours of this rank within ``group`` and non-blocking shifts along the ring."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # P2P ops address peers by global rank.
        self.next_rank = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self.prev_rank = dist.get_global_rank(group, (self.rank - 1) % self.world_size)

    def shift(self, send: Tensors, recv: Tensors) -> "PendingShift":
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one.

        ``send``/``recv``: a tensor or matching sequences of tensors (e.g. a K/V shard and its
        document ids), all posted in one batch."""
        return self._post(send, recv, to=self.next_rank, source=self.prev_rank)

    def shift_back(self, send: Tensors, recv: Tensors) -> "PendingShift":
        """The reverse direction: send ``send`` to the previous rank, receive ``recv`` from the next."""
        return self._post(send, recv, to=self.prev_rank, source=self.next_rank)

    def swap(self, offset: int, send: Optional[torch.Tensor], recv: Optional[torch.Tensor]) -> "PendingShift":
        """Send ``send`` to rank + ``offset`` and receive ``recv`` from rank - ``offset`` (ranks of
        the group, modulo its size); either may be None (nothing to move that way: the peer
        knows it too and posts nothing). Nothing at all posts nothing."""
        ops = []
        if send is not None:
            to = dist.get_global_rank(self.group, (self.rank + offset) % self.world_size)
            ops.append(dist.P2POp(dist.isend, send, to, self.group))
        if recv is not None:
            source = dist.get_global_rank(self.group, (self.rank - offset) % self.world_size)
            ops.append(dist.P2POp(dist.irecv, recv, source, self.group))
        return PendingShift(dist.batch_isend_irecv(ops) if ops else None)

    def _post(self, send: Tensors, recv: Tensors, *, to: int, source: int) -> "PendingShift":
        sends = [send] if isinstance(send, torch.Tensor) else list(send)
        recvs = [recv] if isinstance(recv, torch.Tensor) else list(recv)
        if len(sends) != len(recvs):
            raise ValueError(f"shift: {len(sends)} tensors to send but {len(recvs)} to receive")
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, source, self.group) for t in recvs]
        return PendingShift(dist.batch_isend_irecv(ops))


def connect_peers(group: dist.ProcessGroup, device: Optional[torch.device] = None) -> None:
    """Exchange one value with every other rank of ``group`` (rank + s for s = 1 .. P - 1), now.

    NCCL opens a pair's point-to-point connection on its first message. The document ring
    sends rank r to rank r + s only in steps where those ranks share a document, so without
    this a batch that first needs a pair would open it (and wait for the peer to get there)
    in the middle of a run. Every rank of the group must call it, with its own device (a CUDA
    one on NCCL). Also checks the wiring: each received value must be the sender's rank."""
    exchange = RingExchange(group)
    world, rank = exchange.world_size, exchange.rank
    for offset in range(1, world):
        send = torch.tensor([rank], dtype=torch.int64, device=device)
        recv = torch.empty(1, dtype=torch.int64, device=device)
        exchange.swap(offset, send, recv).wait()
        expected = (rank - offset) % world
        if int(recv.item()) != expected:
            raise RuntimeError(
                f"ring group wiring: rank {rank} expected a message from group rank {expected}, got {int(recv.item())}"
            )


class PendingShift:
    def __init__(self, works: list):
        self._works: Optional[list] = works

    def wait(self) -> None:
        if self._works is not None:
            for w in self._works:
                w.wait()
            self._works = None
