"""Sequence layouts: which tokens of a full sequence each context-parallel rank holds.

Two layouts, both splitting the sequence into equal chunks:

* ``"zigzag"`` (default): 2P chunks; rank r holds chunks r and 2P-1-r, in that order.
  Under a causal mask every rank then does the same amount of attention work, and
  the local shard stays position-sorted, so its diagonal block is plain causal.
* ``"contiguous"``: P chunks; rank r holds chunk r. Simple, but under a causal mask
  the last rank does P times the work of the first.

Everything here is pure index arithmetic and slicing, except ``unshard_sequence``,
which gathers over a process group.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

import torch
import torch.distributed as dist

from .validation import check_choice

# The type of every ``layout`` argument (LightningCLI lists the choices in --help).
Layout = Literal["zigzag", "contiguous"]
LAYOUTS = get_args(Layout)


def check_layout(layout: str) -> None:
    check_choice("layout", layout, LAYOUTS)


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def required_multiple(world_size: int, layout: str) -> int:
    """The sequence length must be a multiple of this for ``layout`` over ``world_size`` ranks."""
    return world_size * chunks_per_rank(layout)


def check_seq_len(seq_len: int, world_size: int, layout: str) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    multiple = required_multiple(world_size, layout)
    if seq_len <= 0 or seq_len % multiple != 0:
        below = seq_len // multiple * multiple
        nearest = " or ".join(str(n) for n in (below, below + multiple) if n > 0)
        raise ValueError(
            f"sequence length {seq_len} cannot be split by layout {layout!r} over "
            f"P={world_size} ranks: it must be a positive multiple of {multiple}"
            + (" (2 x P)" if layout == "zigzag" and world_size > 1 else "")
            + f"; nearest valid: {nearest}"
        )


def rank_chunks(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """Indices of the chunks (of ``required_multiple`` equal chunks) that ``rank`` holds, in local order."""
    check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def shard_sequence(x: torch.Tensor, dim: int, *, rank: int, world_size: int, layout: str = "zigzag") -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication).

    Differentiable (slicing + cat), so it can shard tensors that carry gradients.
    """
    check_seq_len(x.shape[dim], world_size, layout)
    if world_size == 1:
        return x
    chunk = x.shape[dim] // required_multiple(world_size, layout)
    pieces = [x.narrow(dim, c * chunk, chunk) for c in rank_chunks(rank, world_size, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(
    x_local: torch.Tensor, dim: int, *, group: Optional[dist.ProcessGroup], layout: str = "zigzag"
) -> torch.Tensor:
    """Gather every rank's shard over ``group`` and restore the original token order.

    ``group=None`` means a single rank (as in ``ring_attention``): ``x_local`` is returned.
    Not differentiable; meant for evaluation, tests and checkpoint-free inspection.
    """
    check_layout(layout)
    world_size = 1 if group is None else dist.get_world_size(group)
    if world_size == 1:
        return x_local
    per_rank = chunks_per_rank(layout)
    if x_local.shape[dim] % per_rank != 0:
        raise ValueError(
            f"local length {x_local.shape[dim]} along dim {dim} is not a multiple of {per_rank} (layout {layout!r})"
        )
    x_local = x_local.contiguous()
    gathered = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(gathered, x_local, group=group)
    chunk = x_local.shape[dim] // per_rank
    ordered: list[Optional[torch.Tensor]] = [None] * (world_size * per_rank)
    for r, shard in enumerate(gathered):
        for i, c in enumerate(rank_chunks(r, world_size, layout)):
            ordered[c] = shard.narrow(dim, i * chunk, chunk)
    return torch.cat(ordered, dim=dim)  # type: ignore[arg-type]


def position_ids(
    seq_len: int,
    *,
    rank: int,
    world_size: int,
    layout: str = "zigzag",
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Global positions (int64, shape ``(seq_len // world_size,)``) of the tokens ``rank`` holds."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, rank=rank, world_size=world_size, layout=layout)


def document_work_per_rank(
    document_ids: torch.Tensor, world_size: int, *, layout: str = "zigzag", causal: bool = True
) -> torch.Tensor:
    """Attention work of each rank for a document-masked sequence: the number of visible
    (query, key) pairs of the queries the rank holds under ``layout``, as int64 ``(P,)``.

    ``document_ids``: the full sequence's ids, ``(S,)`` or ``(B, S)`` (summed over the
    batch); query i sees key j iff their ids are equal (and j <= i when ``causal``), as in
    ``ring_attention(document_ids=...)``. Each rank computes attention for its own queries
    over every key, so this is what a kernel that skips fully masked tiles approaches;
    ``work.max() / work.mean()`` is the load imbalance (1.0: balanced).
    """
    ids = document_ids.reshape(-1, document_ids.shape[-1]).cpu()
    check_seq_len(ids.shape[1], world_size, layout)
    visible = torch.empty(ids.shape, dtype=torch.int64)
    for row, row_ids in zip(visible, ids):
        # Sorting by id (stable: positions ascending within a document) puts each
        # document's tokens together; a token's causal count is its place in its group.
        order = torch.argsort(row_ids, stable=True)
        sorted_ids = row_ids[order]
        first = torch.ones_like(sorted_ids, dtype=torch.bool)
        first[1:] = sorted_ids[1:] != sorted_ids[:-1]
        group = torch.cumsum(first, 0) - 1
        starts = first.nonzero().squeeze(1)
        if causal:
            count = torch.arange(len(row_ids)) - starts[group] + 1
        else:
            sizes = torch.diff(starts, append=torch.tensor([len(row_ids)]))
            count = sizes[group]
        row[order] = count
    return torch.stack(
        [shard_sequence(visible, 1, rank=r, world_size=world_size, layout=layout).sum() for r in range(world_size)]
    )
