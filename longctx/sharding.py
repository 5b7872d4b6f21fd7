"""Shift, then shard: a full-sequence batch -> this context-parallel rank's slice of it.

``shard_batch(batch, rank=r, world_size=P)`` slices every per-token tensor of a batch
along the sequence dimension with ``shard_sequence`` (default layout zigzag), so all
of a sample's tensors (input_ids, labels, position_ids, document_ids, masks, ...) keep
the same tokens. Labels must already be shifted on the full sequence: the last input
token of a chunk then keeps its label, the first token of the NEXT chunk, which lives
on another rank. Shifting after sharding would lose those labels and pair tokens with
the wrong targets.

Accepted batches:

* a mapping (the data module's dict): tensors whose size along ``seq_dim`` equals the
  sequence length of ``input_ids`` (or ``seq_len=``) are sharded; anything else
  (per-sample tensors, strings, numbers) passes through. ``position_ids`` (global
  positions from the layout) are added when absent, so RoPE sees true positions.
* a tuple or list of tensors (e.g. ``(x, y)``): each per-token tensor is sharded;
  nothing is added (no place for positions).
* a plain tensor of token ids ``(B, S + 1)``: shifted here into ``input_ids`` and
  ``labels`` of length ``S`` (the nanoGPT convention), then sharded; returns a dict.

The result is marked (``ShardedBatch``, ``ShardedTuple``, ``ShardedList``; see
``is_sharded``), and sharding a marked batch again returns it unchanged, so a strategy
can call ``shard_batch`` on whatever reaches it without double-slicing a batch the
user already sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from .layouts import check_seq_len, shard_sequence
from .layouts import position_ids as layout_position_ids

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ShardInfo:
    rank: int
    world_size: int
    layout: str
    seq_len: int  # the full (global) sequence length


class ShardedBatch(dict):
    """A dict batch already sharded for one CP rank; ``sharding`` says how (None if unknown).

    Rebuilt as ``ShardedBatch(mapping)`` (as Lightning's ``apply_to_collection`` does when
    moving a batch to a device) it stays marked, with ``sharding`` reset to None.
    """

    def __init__(self, *args: Any, sharding: Optional[ShardInfo] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sharding = sharding


class ShardedTuple(tuple):
    sharding: Optional[ShardInfo] = None


class ShardedList(list):
    sharding: Optional[ShardInfo] = None


def is_sharded(batch: Any) -> bool:
    return isinstance(batch, (ShardedBatch, ShardedTuple, ShardedList))


def _check_length(seq_len: int, world_size: int, layout: str, what: str) -> None:
    if world_size == 1:
        return  # nothing is split, any length works
    try:
        check_seq_len(seq_len, world_size, layout)
    except ValueError as e:
        raise ValueError(
            f"cannot shard {what} over the context-parallel group: {e}. Choose a seq_len that is a "
            f"multiple of {'2 x ' if layout == 'zigzag' else ''}the context-parallel size."
        ) from None


def _shard(x: torch.Tensor, seq_len: int, seq_dim: int, rank: int, world_size: int, layout: str) -> Any:
    if world_size > 1 and isinstance(x, torch.Tensor) and x.dim() > seq_dim and x.shape[seq_dim] == seq_len:
        return shard_sequence(x, seq_dim, rank=rank, world_size=world_size, layout=layout)
    return x


def shard_batch(
    batch: Any,
    *,
    rank: int,
    world_size: int,
    layout: str = "zigzag",
    seq_dim: int = 1,
    seq_len: Optional[int] = None,
) -> Any:
    """This CP rank's slice of a full-length ``batch`` (see the module docstring).

    ``seq_len`` names the full sequence length when a mapping has no ``input_ids`` (or
    a tuple's first tensor is not per-token). ``world_size == 1`` shards nothing but still
    adds ``position_ids`` and the marker.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is outside [0, {world_size})")
    if is_sharded(batch):
        done = batch.sharding
        if done is not None and (done.rank, done.world_size, done.layout) != (rank, world_size, layout):
            raise ValueError(
                f"batch is already sharded for rank {done.rank} of {done.world_size} ({done.layout!r}); "
                f"refusing to shard it again for rank {rank} of {world_size} ({layout!r})"
            )
        return batch

    if isinstance(batch, torch.Tensor):
        if batch.dim() <= seq_dim:
            raise ValueError(
                f"a plain tensor batch must be token ids (B, S+1) with the sequence along dim {seq_dim}; "
                f"got shape {tuple(batch.shape)}"
            )
        full = batch.shape[seq_dim] - 1
        _check_length(full, world_size, layout, f"a token tensor of length {full + 1} (read as S+1 tokens, S={full})")
        batch = {
            "input_ids": batch.narrow(seq_dim, 0, full),
            "labels": batch.narrow(seq_dim, 1, full),
        }

    if isinstance(batch, Mapping):
        if seq_len is None:
            ref = batch.get("input_ids")
            if not isinstance(ref, torch.Tensor):
                raise ValueError(
                    f"cannot tell the sequence length of a batch without an 'input_ids' tensor (keys "
                    f"{list(batch)}); pass seq_len="
                )
            if ref.dim() <= seq_dim:
                raise ValueError(f"'input_ids' has shape {tuple(ref.shape)}: no sequence dim {seq_dim}")
            seq_len = ref.shape[seq_dim]
        _check_length(seq_len, world_size, layout, f"a batch with sequence length {seq_len}")
        out = ShardedBatch(
            {k: _shard(v, seq_len, seq_dim, rank, world_size, layout) for k, v in batch.items()},
            sharding=ShardInfo(rank, world_size, layout, seq_len),
        )
        if "position_ids" not in out and isinstance(batch.get("input_ids"), torch.Tensor):
            ids = batch["input_ids"]
            if world_size == 1:
                local = torch.arange(seq_len, device=ids.device)
            else:
                local = layout_position_ids(seq_len, rank=rank, world_size=world_size, layout=layout, device=ids.device)
            shape = [1] * seq_dim + [local.shape[0]]
            out["position_ids"] = local.view(shape).expand(*ids.shape[:seq_dim], -1).contiguous()
        return out

    if isinstance(batch, (tuple, list)) and type(batch) in (tuple, list):
        if seq_len is None:
            first = next((t for t in batch if isinstance(t, torch.Tensor) and t.dim() > seq_dim), None)
            if first is None:
                raise ValueError(f"no tensor with a sequence dim {seq_dim} in the {type(batch).__name__} batch")
            seq_len = first.shape[seq_dim]
        _check_length(seq_len, world_size, layout, f"a batch with sequence length {seq_len}")
        items = [_shard(v, seq_len, seq_dim, rank, world_size, layout) for v in batch]
        out_seq = ShardedTuple(items) if type(batch) is tuple else ShardedList(items)
        out_seq.sharding = ShardInfo(rank, world_size, layout, seq_len)
        return out_seq

    raise TypeError(
        f"shard_batch takes a mapping, a tuple/list of tensors or a token tensor, not {type(batch).__name__}"
    )


def document_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 wherever the document id changes, on FULL sequences.

    ``document_ids`` ``(B, S)`` (or ``(S,)``) of unsharded sequences -> int64 positions of
    the same shape: the index of each token within its run of equal ids. RoPE then sees
    every packed document as if it started the sequence (``rope_positions="document"``).
    Shard the result like every other per-token tensor.
    """
    if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must hold integers, got dtype {document_ids.dtype}")
    squeeze = document_ids.dim() == 1
    ids = document_ids.unsqueeze(0) if squeeze else document_ids
    if ids.dim() != 2:
        raise ValueError(f"document_ids must be (S,) or (B, S), got shape {tuple(document_ids.shape)}")
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    pos = index - run_start
    return pos[0] if squeeze else pos
