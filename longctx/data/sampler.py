"""Sampling for context parallelism: one sample per CP group, disjoint across DP ranks, resumable.

With context parallelism the world is a grid ``dp x cp``: the ``cp`` ranks of a group
share ONE sample (each later keeps its slice of the sequence, see ``longctx.sharding``),
and the ``dp`` groups train on different samples. So the sampler only needs the
data-parallel coordinates, ``num_replicas = dp size`` and ``rank = dp rank`` (what a
context-parallel strategy reports in ``distributed_sampler_kwargs``); every CP rank of a
group constructs it with the same dp rank and draws the same indices.

Order: epoch ``e`` is a permutation ``perm`` of the dataset drawn from ``seed + e``
(as ``DistributedSampler``); DP rank ``r`` takes ``perm[start + r :: dp]``. After ``t``
global steps of batch ``B`` the samples consumed are exactly ``perm[:t*B*dp]``, so the
position in an epoch is one number, ``consumed`` (global samples), and a resumed run
continues with ``perm[consumed:]``: the same samples, in the same order, as the run
that was not interrupted (even with a different dp size, as far as that is possible).

Counting what was consumed must happen where batches reach the training loop, not in
the sampler (DataLoader workers run ahead of training): ``ResumableDataLoader`` does
that and is a Lightning "stateful" dataloader, so Lightning saves its state in
checkpoints and restores it when resuming mid-epoch.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Iterator, Optional, Sized

import torch
from torch.utils.data import DataLoader, DistributedSampler

logger = logging.getLogger("longctx.data")


def dp_coordinates(global_rank: int, world_size: int, context_parallel_size: int) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` for a rank, when CP groups are blocks of consecutive ranks.

    ``global_rank = dp_rank * cp + cp_rank`` (CP innermost, as in torchtitan's mesh
    ``[dp, cp]``): the CP ranks of a group sit on the same node, where the ring's
    traffic is cheapest. A strategy that lays out groups differently passes its own
    ``num_replicas``/``rank`` instead.
    """
    if context_parallel_size < 1 or world_size % context_parallel_size != 0:
        raise ValueError(f"world size {world_size} is not divisible by context_parallel_size {context_parallel_size}")
    if not 0 <= global_rank < world_size:
        raise ValueError(f"rank {global_rank} is outside [0, {world_size})")
    return global_rank // context_parallel_size, world_size // context_parallel_size


class ContextParallelSampler(DistributedSampler):
    """Deterministic, resumable sampler over data-parallel replicas (CP ranks share samples).

    A ``DistributedSampler`` subclass, so Lightning keeps it instead of injecting its own;
    ``set_epoch`` is called by Lightning every epoch. ``drop_last=True`` (the default)
    drops the tail of an epoch so every DP rank gets the same number of samples;
    ``drop_last=False`` pads it by wrapping around (some samples then repeat).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas (the data-parallel size) must be a positive int, got {num_replicas!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank (the data-parallel rank) {rank!r} is outside [0, {num_replicas})")
        # Explicit num_replicas/rank: the parent never queries torch.distributed.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._resume_from = 0  # global offset into the epoch for the next __iter__
        self._consumed = 0  # global samples of this epoch delivered to the training loop

    def __len__(self) -> int:
        """Samples per replica in a FULL epoch (also when resuming: progress bars count from it)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return n // self.num_replicas if self.drop_last else -(-n // self.num_replicas)

    def epoch_order(self) -> list[int]:
        """The global order of this epoch's samples, before splitting across replicas."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order()
        start, self._resume_from = self._resume_from, 0
        self._consumed = start
        remaining = order[start:]
        if self.drop_last:
            remaining = remaining[: len(remaining) - len(remaining) % self.num_replicas]
        elif remaining and len(remaining) % self.num_replicas:
            pad = self.num_replicas - len(remaining) % self.num_replicas
            remaining = remaining + (order * (pad // len(order) + 1))[:pad]
        return iter(remaining[self.rank :: self.num_replicas])

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            # A new epoch starts from its beginning; a restored position belongs to the
            # restored epoch only (Lightning re-sends that same epoch when resuming mid-epoch).
            self._resume_from = 0
            self._consumed = 0
        super().set_epoch(epoch)

    def mark_consumed(self, local_samples: int) -> None:
        """Record that this replica's training loop received ``local_samples`` more samples."""
        self._consumed += local_samples * self.num_replicas

    @property
    def consumed(self) -> int:
        """Global samples of the current epoch handed to training so far."""
        return self._consumed

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self._consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = len(self.dataset)  # type: ignore[arg-type]
        mismatch = [
            f"{k}: checkpoint {state.get(k)!r} vs now {v!r}"
            for k, v in (("dataset_len", n), ("seed", self.seed), ("shuffle", self.shuffle))
            if state.get(k) != v
        ]
        self.epoch = int(state["epoch"])
        if mismatch:
            if _is_rank_zero():  # every rank restores the same state: one notice is enough
                warnings.warn(
                    "sampler state does not match this dataset (" + "; ".join(mismatch) + "): the resumed run "
                    f"restarts epoch {self.epoch} from its beginning and will not see the same samples",
                    stacklevel=2,
                )
            self._resume_from = self._consumed = 0
            return
        consumed = int(state["consumed"])
        if state.get("num_replicas") != self.num_replicas and _is_rank_zero():
            logger.info(
                "sampler: resuming with %d data-parallel replicas (checkpoint had %s) at sample %d of epoch %d",
                self.num_replicas,
                state.get("num_replicas"),
                consumed,
                self.epoch,
            )
        self._resume_from = self._consumed = min(consumed, n)


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _batch_size_of(batch: Any, default: Optional[int]) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    if default is None:
        raise TypeError(f"cannot tell how many samples a batch of type {type(batch).__name__} holds")
    return default


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that tells its ``ContextParallelSampler`` which batches training received.

    It implements ``state_dict``/``load_state_dict``, which makes it "stateful" for
    Lightning: the fit loop saves its state in every checkpoint and loads it back when
    resuming mid-epoch, so training continues with the first batch it had not seen.
    Lightning does not pre-fetch from loaders that have a length, so "yielded here" is
    "received by the training step" at the moment a checkpoint is written.
    """

    def _resumable_sampler(self) -> Optional[ContextParallelSampler]:
        return self.sampler if isinstance(self.sampler, ContextParallelSampler) else None

    def __iter__(self):
        sampler = self._resumable_sampler()
        for batch in super().__iter__():
            if sampler is not None:
                sampler.mark_consumed(_batch_size_of(batch, self.batch_size))
            yield batch

    def state_dict(self) -> dict[str, Any]:
        sampler = self._resumable_sampler()
        return {} if sampler is None else {"sampler": sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self._resumable_sampler()
        if sampler is not None and state.get("sampler"):
            sampler.load_state_dict(state["sampler"])
