"""A user's DataLoader under context parallelism: split over the dp ranks only, in its own order.

Every rank of a CP group reads the same samples (each keeps 1/cp of every sequence), so only
the data-parallel dimension splits the data. Lightning's own injection would also shuffle
every training loader, even one with ``shuffle=False``, so a CP or dp run would not see the
batches one device sees. ``DpSampling`` turns it off while fitting and injects the sampler
itself. The two private Lightning seams this needs (the trainer's ``_accelerator_connector``
and ``lightning.pytorch.utilities.data._update_dataloader``) are used here and nowhere else.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn


class DpSampling:
    """Takes over the distributed sampler of a fit (``take_over`` when the strategy connects the
    module, ``restore`` at teardown); ``split`` is the strategy's ``process_dataloader``."""

    def __init__(self) -> None:
        self._lightning_injects: Optional[bool] = None  # Lightning's own setting, while taken over

    def take_over(self, trainer: Any) -> None:
        connector = getattr(trainer, "_accelerator_connector", None)
        if connector is not None and trainer.state.fn == TrainerFn.FITTING:
            self._lightning_injects = connector.use_distributed_sampler
            connector.use_distributed_sampler = False

    def restore(self, trainer: Any) -> None:
        if self._lightning_injects is not None and trainer is not None:
            trainer._accelerator_connector.use_distributed_sampler = self._lightning_injects
            self._lightning_injects = None

    def split(self, dataloader: object, *, num_replicas: int, rank: int) -> object:
        """Split a user's DataLoader over dp only, in the loader's own order.

        Sequential (``shuffle=False``) and custom samplers keep their order, strided over the
        dp ranks: the global batch of step k is the one device's batch k. A ``RandomSampler``
        becomes one permutation shared by all ranks (seed ``PL_GLOBAL_SEED``, as Lightning).
        Loaders with a ``DistributedSampler`` of their own and iterable datasets pass as they are,
        and so does every loader where Lightning's injection was not taken over (not fitting,
        or ``use_distributed_sampler=False``).
        """
        from lightning.fabric.utilities.data import has_iterable_dataset
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
        from lightning.pytorch.utilities.data import _update_dataloader
        from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

        if (
            not self._lightning_injects
            or not isinstance(dataloader, DataLoader)
            or isinstance(dataloader.sampler, DistributedSampler)
            or has_iterable_dataset(dataloader)
        ):
            return dataloader
        kwargs = {"num_replicas": num_replicas, "rank": rank, "seed": int(os.getenv("PL_GLOBAL_SEED", 0))}
        sampler = dataloader.sampler
        if isinstance(sampler, (RandomSampler, SequentialSampler)):
            sampler = DistributedSampler(dataloader.dataset, shuffle=isinstance(sampler, RandomSampler), **kwargs)
        else:
            sampler = DistributedSamplerWrapper(sampler, shuffle=False, **kwargs)
        return _update_dataloader(dataloader, sampler)
