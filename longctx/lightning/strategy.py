"""Lightning strategy for context parallelism (ring attention) combined with data parallelism.

``ContextParallelStrategy`` is Lightning's ``DDPStrategy`` plus a 2-D ``(dp, cp)`` device
mesh. The world of ``dp * cp`` processes is split into ``dp`` context-parallel groups of
``cp`` *consecutive* ranks (cp innermost, so on a node with 8 GPUs and ``cp=8`` the ring
stays on NVLink); every CP group works on the same samples, each rank holding ``1/cp`` of
every sequence.

What the strategy does, so that a plain LightningModule and DataLoader work unchanged:

* builds the mesh right after the default process group exists (``setup_environment``);
* hands the CP group to every module that defines
  ``set_context_parallel_group(group, layout)`` before DDP wraps the model
  (``group=None`` when ``cp == 1``);
* makes the distributed sampler split data over the ``dp`` dimension only;
* shards every batch for this rank's CP position in ``batch_to_device`` (via
  ``longctx.sharding.shard_batch``, after the LightningModule's transfer hooks so they see
  full sequences);
* lets DDP average gradients over the whole ``dp x cp`` world (its default): with the loss
  normalised by ``longctx.loss`` this gives exactly the single-device gradient.

Checkpoints are written atomically by default (``AtomicCheckpointIO``: temp file in the same
directory, fsync, rename), so a crash while saving never leaves a truncated ``last.ckpt``;
``find_resume_checkpoint`` picks the newest complete checkpoint of a run.

Process-group timeout: ``timeout`` (default 5 minutes, instead of torch's 10 min NCCL /
30 min gloo) applies to the default group *and* to the dp/cp subgroups, so a rank that died
makes every other rank fail within that time instead of hanging a job for half an hour.
"""
from __future__ import annotations

import os
import warnings
import zipfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.distributed.device_mesh import DeviceMesh

from ..layouts import check_layout
from ..ring_comm import new_ring_group
from ..watchdog import RankWatchdog

DEFAULT_TIMEOUT = timedelta(minutes=5)

# The mesh of the strategy that set up last in this process, for code that cannot reach
# the Trainer (e.g. a model built outside Lightning's hooks). One training job per process.
_ACTIVE: Optional["ContextParallelStrategy"] = None


def get_context_parallel_group() -> Optional[dist.ProcessGroup]:
    """The CP group of the active ``ContextParallelStrategy`` (``None``: no CP or no strategy)."""
    if _ACTIVE is None or _ACTIVE.cp_size == 1:
        return None
    return _ACTIVE.cp_group


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temp file beside the target, fsync, then ``os.replace``.

    Readers see either the previous complete file or the new complete file, never a partial
    one (POSIX rename is atomic within a filesystem). Remote URLs fall back to Lightning.
    """

    def save_checkpoint(self, checkpoint: dict, path: Union[str, Path], storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:  # make the rename itself durable
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass


def is_complete_checkpoint(path: Union[str, Path]) -> bool:
    """True when ``path`` is a whole ``torch.save`` archive (its zip directory is readable)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("data.pkl") for n in z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def find_resume_checkpoint(path: Union[str, Path]) -> Path:
    """The checkpoint to resume from: ``path`` itself if complete, else the newest complete one.

    ``path`` may be a ``.ckpt`` file, a checkpoint directory or a run directory (searched
    with its ``checkpoints/`` subdirectory). Temp files of interrupted saves are ignored.
    """
    path = Path(path)
    if path.is_file():
        if is_complete_checkpoint(path):
            return path
        warnings.warn(f"checkpoint {path} is incomplete or corrupt; looking for the newest complete one beside it")
        search = [path.parent]
    elif path.is_dir():
        search = [path, path / "checkpoints"]
    else:
        raise FileNotFoundError(f"--resume path {path} does not exist")
    candidates = [p for d in search if d.is_dir() for p in d.glob("*.ckpt") if not p.name.startswith(".")]
    complete = [p for p in candidates if is_complete_checkpoint(p)]
    if not complete:
        raise FileNotFoundError(
            f"no complete checkpoint under {path} (found {len(candidates)} .ckpt file(s), none readable)"
        )
    return max(complete, key=lambda p: (p.stat().st_mtime_ns, p.name == "last.ckpt"))


def _check_cp_size(context_parallel_size: Optional[int]) -> None:
    if context_parallel_size is None:
        return
    if isinstance(context_parallel_size, bool) or not isinstance(context_parallel_size, int):
        raise TypeError(
            f"context_parallel_size must be an int, got {type(context_parallel_size).__name__} "
            f"{context_parallel_size!r}"
        )
    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {context_parallel_size}")


def _check_divisible(world_size: int, cp_size: int) -> None:
    if world_size % cp_size != 0:
        raise ValueError(
            f"world size {world_size} (devices x nodes) is not divisible by "
            f"context_parallel_size {cp_size}; use a CP size that divides it "
            f"(data-parallel size = world size / CP size)"
        )


class ContextParallelStrategy(DDPStrategy):
    """DDP over a ``(dp, cp)`` mesh: ring attention inside each CP group, DDP across all ranks.

    Args:
        context_parallel_size: ranks per context-parallel group (``>= 1``, must divide the
            world size). ``None`` puts the whole world into one CP group (``dp = 1``).
        layout: sequence layout of the shards, ``"zigzag"`` (balanced causal work) or
            ``"contiguous"``; handed to the modules together with the group.
        timeout: process-group timeout for the default group and the mesh subgroups.
            Default 5 minutes: a failed rank ends the job in bounded time.
        failure_timeout: seconds without a heartbeat after which a rank is declared dead
            and every rank exits, naming it (``longctx.watchdog``); a rank that raises
            tells the others at once. ``None`` disables the watchdog.
        **kwargs: everything ``DDPStrategy`` accepts (``find_unused_parameters``,
            ``static_graph``, ``process_group_backend``, ``start_method``, ...).
    """

    strategy_name = "context_parallel"

    def __init__(
        self,
        context_parallel_size: Optional[int] = None,
        layout: str = "zigzag",
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        failure_timeout: Optional[float] = 120.0,
        **kwargs: Any,
    ) -> None:
        if failure_timeout is not None and failure_timeout <= 0:
            raise ValueError(f"failure_timeout must be positive seconds or None, got {failure_timeout}")
        _check_cp_size(context_parallel_size)
        check_layout(layout)
        if kwargs.get("checkpoint_io") is None:
            kwargs["checkpoint_io"] = AtomicCheckpointIO()
        super().__init__(timeout=timeout, **kwargs)
        self._cp_size_arg = context_parallel_size
        self.layout = layout
        self._device_mesh: Optional[DeviceMesh] = None
        self._cp_group: Optional[dist.ProcessGroup] = None
        self.failure_timeout = failure_timeout
        self._watchdog: Optional[RankWatchdog] = None
        self._failed = False

    # -- sizes and ranks ---------------------------------------------------------------
    # Derived from the global rank (cp innermost: rank = dp_rank * cp + cp_rank), so they are
    # valid before the mesh exists, e.g. when Lightning builds the sampler.

    @property
    def cp_size(self) -> int:
        return self._cp_size_arg if self._cp_size_arg is not None else self.world_size

    @property
    def context_parallel_size(self) -> int:
        return self.cp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.global_rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.cp_size

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists only after the Trainer set up the strategy")
        return self._device_mesh

    @property
    def cp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's context-parallel group (exists once the mesh is built)."""
        return self._cp_group

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return None if self._device_mesh is None else self._device_mesh.get_group("dp")

    # -- setup -------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        # Runs in the Trainer constructor, before any process is launched: a bad CP size
        # fails here once, in the launching process, instead of in every worker.
        if self._cp_size_arg is not None and self.parallel_devices is not None:
            _check_divisible(self.num_nodes * self.num_processes, self._cp_size_arg)
        super()._configure_launcher()

    def setup_environment(self) -> None:
        super().setup_environment()  # creates the default process group
        self._build_mesh()
        if self.failure_timeout is not None and self.world_size > 1:
            interval = min(1.0, self.failure_timeout / 4)
            self._watchdog = RankWatchdog(
                self.global_rank, self.world_size, timeout=self.failure_timeout, interval=interval
            ).start()

    def _build_mesh(self) -> None:
        global _ACTIVE
        world, cp = self.world_size, self.cp_size
        if dist.get_world_size() != world:
            raise RuntimeError(
                f"the process group has {dist.get_world_size()} ranks but the strategy expects {world}"
            )
        _check_divisible(world, cp)
        dp = world // cp
        ranks = torch.arange(world).view(dp, cp)
        # The subgroups are created by hand (not init_device_mesh) so they get our timeout:
        # new_group without one falls back to torch's 10/30-minute defaults. Every rank must
        # create every group, in the same order.
        cp_groups = [new_ring_group(r.tolist(), timeout=self._timeout) for r in ranks]
        dp_groups = [dist.new_group(c.tolist(), timeout=self._timeout) for c in ranks.t()]
        cp_group = cp_groups[self.dp_rank]
        dp_group = dp_groups[self.cp_rank]
        self._device_mesh = DeviceMesh.from_group(
            [dp_group, cp_group], self.root_device.type, mesh=ranks, mesh_dim_names=("dp", "cp")
        )
        self._cp_group = cp_group
        _ACTIVE = self

    def setup(self, trainer: Any) -> None:
        # Before super().setup wraps the model in DDP, so modules keep a plain reference.
        self.hand_over_group(self.lightning_module)
        super().setup(trainer)

    def hand_over_group(self, module: Optional[torch.nn.Module]) -> int:
        """Call ``set_context_parallel_group(group, layout)`` on every submodule defining it.

        Returns how many modules received the group. ``group`` is ``None`` when ``cp == 1``
        (plain local attention).
        """
        if module is None:
            return 0
        group = self._cp_group if self.cp_size > 1 else None
        count = 0
        for m in module.modules():
            setter = getattr(m, "set_context_parallel_group", None)
            if callable(setter):
                setter(group, self.layout)
                count += 1
        return count

    # -- data ----------------------------------------------------------------------------

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All ranks of a CP group read the same samples; only dp splits the data.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # Shard after the LightningModule's transfer hooks, which may expect full sequences
        # (e.g. to shift labels). shard_batch is idempotent, so an already sharded batch passes.
        # With cp == 1 nothing is split: any batch (not only token dicts) passes untouched.
        from ..sharding import shard_batch

        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.cp_size == 1:
            return batch
        return shard_batch(batch, rank=self.cp_rank, world_size=self.cp_size, layout=self.layout)

    # -- teardown / registration -----------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        # Tell the other ranks now, instead of leaving them blocked in the next collective.
        self._failed = True
        if self._watchdog is not None:
            self._watchdog.report_failure(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        if self._watchdog is not None:
            if not self._failed and dist.is_initialized():
                # No rank stops watching (and exits, maybe taking rank 0's store with it)
                # while another is still working.
                dist.barrier()
            self._watchdog.stop()
            self._watchdog = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP over a (dp, cp) mesh with ring-attention context parallelism "
            "(whole world = one CP group; pass ContextParallelStrategy(context_parallel_size=N) "
            "for dp x cp)",
            override=True,
        )


def _register(registry: Any = StrategyRegistry) -> None:
    if ContextParallelStrategy.strategy_name not in registry:
        ContextParallelStrategy.register_strategies(registry)


# Lightning only scans its own modules for register_strategies; register on import.
_register()
