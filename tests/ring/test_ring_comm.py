"""The ring's point-to-point layer: every pair of a group connected up front (gloo here; the
strategy does it on NCCL), and shifts to any offset after that."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers.dist_harness import run_distributed

from longctx.ring_comm import RingExchange, connect_peers


def _connect_then_swap(rank: int, world: int):
    group = dist.new_group(list(range(world)))
    connect_peers(group)
    received = {}
    exchange = RingExchange(group)
    for offset in range(1, world):
        send = torch.full((3,), float(rank))
        recv = torch.empty(3)
        exchange.swap(offset, send, recv).wait()
        received[offset] = recv.tolist()
    return received


def test_connect_peers_then_every_offset_delivers_on_three_ranks():
    results = run_distributed(_connect_then_swap, 3)
    for rank, received in enumerate(results):
        for offset, values in received.items():
            assert values == [float((rank - offset) % 3)] * 3
