"""Lightning strategy for context parallelism (ring attention) with FSDP2 or DDP.

``ContextParallelStrategy`` builds on Lightning's ``ModelParallelStrategy`` (FSDP2,
``configure_model``, distributed checkpoints). The ``dp * cp`` processes form ``dp``
context-parallel groups of ``cp`` *consecutive* ranks (on an 8-GPU node with ``cp=8`` the ring
stays on NVLink); a CP group shares samples, each rank holding ``1/cp`` of every sequence.

Data parallelism (``data_parallel``) runs over the whole ``dp x cp`` world: ``"fsdp"`` shards
parameters, gradients and AdamW state with FSDP2 over every rank (as torchtitan's
``dp_shard_cp``; bf16 compute, fp32 masters and reduction under ``bf16-mixed``; checkpoints
are folders of shards); ``"ddp"`` replicates the model (single-file checkpoints, written
atomically); ``"auto"`` takes FSDP2 where the training state (16 bytes a parameter) would take
more than a quarter of the GPU, always DDP on CPU and for modules that do not apply
``longctx.parallelize``. ``CausalLMModule`` decides it once in its run plan and hands it over
(``use_run_plan``); other modules when ``parallel_dims`` is built.

So that a LightningModule and a DataLoader work unchanged, the strategy creates the CP groups
(own communicator, the strategy's timeout) and describes the layout as ``parallel_dims``
(``longctx.ParallelDims``) for ``configure_model``; splits the sampler over ``dp`` only;
shards every batch for this rank in ``batch_to_device`` (after the module's transfer hooks,
which see full sequences) with global ``position_ids``; and averages gradients over the whole
world, which with ``longctx.loss`` gives the single-device gradient.

``timeout`` (default 5 minutes) applies to the default group and the CP groups, so a dead rank
fails the others within it. Ending a job: rank 0 ends the processes it started
(``longctx.lightning.launcher``); SIGTERM stops every rank at the same step, with a checkpoint
within ``stop_grace_period`` (``longctx.lightning.preemption``); a rank that fails or stalls
ends every rank within ``failure_timeout``, named (``longctx.lightning.failures``).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, get_args

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed import constants as dist_constants
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..data.prepare import PreparingCollate
from ..layouts import Layout, check_layout
from ..parallel import CPContext, ParallelDims, parallelize
from ..ring_comm import connect_peers, new_ring_group
from ..run_plan import RunPlan, check_replica_fits, resolve_data_parallel
from ..run_plan import World as RunWorld
from ..validation import ArgumentValueError, check_choice, check_number
from .checkpoint_io import AtomicCheckpointIO, load_training_state, save_training_state
from .dataloaders import DpSampling
from .failures import RankFailures
from .launcher import ReapingScriptLauncher, exit_with_launcher
from .preemption import DEFAULT_GRACE_PERIOD, SignalStop, StoppedBySignal

DEFAULT_TIMEOUT = timedelta(minutes=5)
DataParallel = Literal["auto", "fsdp", "ddp"]
DATA_PARALLEL = get_args(DataParallel)


def check_divisible(world_size: int, cp_size: int, devices: Optional[int] = None, nodes: Optional[int] = None) -> None:
    if world_size % cp_size != 0:
        how = f" ({devices} devices x {nodes} nodes)" if devices is not None else ""
        raise ArgumentValueError(
            "context_parallel_size",
            f"{cp_size} does not divide the world of {world_size} processes{how}; use a "
            f"CP size that divides it, or a number of processes that is a multiple of {cp_size} "
            "(data-parallel size = world size / CP size)",
        )


def _is_parallelized(module: torch.nn.Module) -> bool:
    return any(getattr(m, "_longctx_parallelized", False) for m in module.modules())


class ContextParallelStrategy(ModelParallelStrategy):
    """Ring attention inside each CP group; FSDP2 or DDP across all ranks.

    Args:
        context_parallel_size: ranks per context-parallel group (``>= 1``, must divide the
            world size). ``None`` puts the whole world into one CP group (``dp = 1``).
        data_parallel: ``"fsdp"`` (shard parameters, gradients and optimizer state over
            all ranks), ``"ddp"`` (replicate them) or ``"auto"`` (see the module doc).
        layout: sequence layout of the shards, ``"zigzag"`` (balanced causal work) or
            ``"contiguous"``.
        cpu_offload: with FSDP, keep the sharded parameters, gradients and optimizer
            state in host memory (FSDP2's ``CPUOffloadPolicy``).
        timeout: process-group timeout for the default group and the CP groups.
            Default 5 minutes: a failed rank ends the job in bounded time; a rank that
            leaves the others waiting in a collective this long is named as stalled by the
            watchdog. (In a config or on the command line: ``h:mm:ss``.)
        failure_timeout: seconds without a heartbeat after which a rank is declared dead
            and every rank exits, naming it (``longctx.watchdog``); a rank that raises
            tells the others at once. ``None`` disables the watchdog.
        stop_grace_period: seconds from SIGTERM to exit: every rank stops after the current
            optimizer step, saves a checkpoint if that fits in the time, and exits with 143.
        process_group_backend: ``"nccl"``, ``"gloo"``, ... (default: by device).
        **ddp_kwargs: passed to ``DistributedDataParallel`` in DDP mode
            (``find_unused_parameters``, ``static_graph``, ...).
    """

    strategy_name = "context_parallel"

    def __init__(
        self,
        context_parallel_size: Optional[int] = None,
        data_parallel: DataParallel = "auto",
        layout: Layout = "zigzag",
        cpu_offload: bool = False,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        failure_timeout: Optional[float] = 120.0,
        stop_grace_period: float = DEFAULT_GRACE_PERIOD,
        process_group_backend: Optional[str] = None,
        **ddp_kwargs: Any,
    ) -> None:
        # Every value refused here, before the Trainer exists; the world size is checked
        # when it is known (_configure_launcher, before any process starts).
        check_number(
            "context_parallel_size",
            context_parallel_size,
            low=1,
            integer=True,
            optional=True,
            hint=" (null: the whole world)",
        )
        check_choice("data_parallel", data_parallel, DATA_PARALLEL)
        check_layout(layout)
        if timeout is not None and not timeout.total_seconds() > 0:
            raise ArgumentValueError("timeout", f"must be > 0 (h:mm:ss), got {timeout}")
        check_number(
            "failure_timeout", failure_timeout, low=0, low_open=True, optional=True, hint=" seconds (null: no watchdog)"
        )
        check_number("stop_grace_period", stop_grace_period, low=0, low_open=True, hint=" seconds")
        if cpu_offload and data_parallel == "ddp":
            raise ValueError("cpu_offload=True needs data_parallel='fsdp' (FSDP2 offloads the shards)")
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend, timeout=timeout)
        self.checkpoint_io = AtomicCheckpointIO()
        self._cp_size_arg = context_parallel_size
        self._data_parallel_arg = "fsdp" if cpu_offload and data_parallel == "auto" else data_parallel
        self._data_parallel: Optional[str] = None  # resolved once the model exists
        self.layout = layout
        self.cpu_offload = cpu_offload
        self._ddp_kwargs = ddp_kwargs
        self._dp_sampling = DpSampling()
        self._cp_group: Optional[dist.ProcessGroup] = None
        self._parallel_dims: Optional[ParallelDims] = None
        self._signal_stop = SignalStop(
            stop_grace_period, forward=self._signal_children, before_exit=lambda: self._signal_children(signal.SIGKILL)
        )
        self._failures = RankFailures(failure_timeout, on_failure=self._signal_stop.exit_now)

    # -- sizes and ranks ---------------------------------------------------------------
    # Derived from the global rank (cp innermost: rank = dp_rank * cp + cp_rank), so they are
    # valid before any group exists, e.g. when Lightning builds the sampler.

    @property
    def cp_size(self) -> int:
        return self._cp_size_arg if self._cp_size_arg is not None else self.world_size

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
    def cp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's context-parallel group (``None`` before setup and when ``cp == 1``)."""
        return self._cp_group

    @property
    def data_parallel(self) -> str:
        """``"fsdp"`` or ``"ddp"`` once resolved (``use_run_plan``, else ``parallel_dims``), else the requested mode."""
        return self._data_parallel or self._data_parallel_arg

    @property
    def parallel_dims(self) -> ParallelDims:
        """The parallel layout for ``longctx.parallelize`` (valid from ``configure_model`` on)."""
        if self._parallel_dims is None:
            if self._device_mesh is None:
                raise RuntimeError("parallel_dims exists once the Trainer has set up the processes")
            mode = self._resolve_data_parallel()
            self._parallel_dims = ParallelDims(
                cp=CPContext(self._cp_group, self.layout),
                data_parallel=mode,
                fsdp_mesh=self._device_mesh if mode == "fsdp" else None,
                param_dtype=self._compute_dtype() if mode == "fsdp" else None,
                cpu_offload=self.cpu_offload,
            )
        return self._parallel_dims

    @property
    def run_world(self) -> RunWorld:
        """What this strategy fixes of a run (``longctx.run_plan.World``): the module's
        ``resolve_run`` starts from it (valid once the processes exist)."""
        return RunWorld(
            cp=self.cp_size,
            dp=self.dp_size,
            layout=self.layout,
            data_parallel=self._data_parallel_arg,
            cpu_offload=self.cpu_offload,
        )

    def use_run_plan(self, run: RunPlan) -> None:
        """Take the run plan a module resolved from ``run_world`` (``CausalLMModule`` hands it over
        once, in ``setup``, before ``configure_model``): its data-parallel mode is the one
        ``parallel_dims`` and the wrapping use."""
        mode = run.parallel.data_parallel
        if self._parallel_dims is not None and self._parallel_dims.data_parallel != mode:
            raise RuntimeError(
                f"the run plan's data_parallel={mode!r} comes after the strategy was set up with "
                f"{self._parallel_dims.data_parallel!r}: hand it over in the module's setup"
            )
        self._data_parallel = mode

    def _resolve_data_parallel(self) -> str:
        # A module without a run plan (use_run_plan): the same rule (longctx.run_plan.resolve_data_parallel).
        if self._data_parallel is None:
            module = self.lightning_module
            on_gpu = self.root_device.type == "cuda"
            self._data_parallel = resolve_data_parallel(
                self._data_parallel_arg,
                n_params=sum(p.numel() for p in module.parameters()) if module else 0,
                device_type=self.root_device.type,
                gpu_total=torch.cuda.get_device_properties(self.root_device).total_memory if on_gpu else None,
                parallelizes=module is not None and is_overridden("configure_model", module),
            )
        return self._data_parallel

    def _compute_dtype(self) -> Optional[torch.dtype]:
        # Under "bf16-mixed"/"16-mixed" FSDP2 gathers bf16/fp16 parameters for compute and
        # keeps fp32 masters (autocast alone would all-gather fp32: twice the traffic).
        precision = getattr(self.precision_plugin, "precision", None)
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)

    # -- setup -------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        # Runs in the Trainer constructor, before any process is launched: a bad CP size
        # fails here once, in the launching process, instead of in every worker.
        if self._cp_size_arg is not None and self.parallel_devices is not None:
            check_divisible(self.num_nodes * self.num_processes, self._cp_size_arg, self.num_processes, self.num_nodes)
        exit_with_launcher()  # in a process rank 0 launched: never outlive it
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = ReapingScriptLauncher(
                self.cluster_environment,
                self.num_processes,
                self.num_nodes,
                is_stopping=lambda: self.received_signal is not None,
            )

    def setup_environment(self) -> None:
        # Every launch path (ours, torchrun, SLURM) passes here in each rank's process, before NCCL reads its env.
        self._failures.before_process_group(self._get_process_group_backend())
        self._setup_distributed()  # device, ranks, the default process group (our timeout)
        self._build_groups()
        # As ModelParallelStrategy: a user's configure_model can read the mesh.
        self.lightning_module._device_mesh = self._device_mesh
        self._failures.start(self.global_rank, self.world_size, collective_timeout=self._collective_timeout())
        self._signal_stop.install(self.lightning_module.trainer, self.global_rank)

    def _collective_timeout(self) -> float:
        """Seconds a collective may wait: ours, else torch's default for the backend."""
        if self._timeout is not None:
            return self._timeout.total_seconds()
        nccl = dist.get_backend() == "nccl"
        return (dist_constants.default_pg_nccl_timeout if nccl else dist_constants.default_pg_timeout).total_seconds()

    # -- ending the job: signals, children, failures --------------------------------------

    @property
    def received_signal(self) -> Optional[int]:
        """The signal that is stopping this job (received here or by another rank), else ``None``."""
        return self._signal_stop.signum

    def _signal_children(self, signum: int) -> None:
        if isinstance(self._launcher, ReapingScriptLauncher):
            self._launcher.kill(signum)

    def _build_groups(self) -> None:
        world, cp = self.world_size, self.cp_size
        if dist.get_world_size() != world:
            raise RuntimeError(f"the process group has {dist.get_world_size()} ranks but the strategy expects {world}")
        check_divisible(world, cp)
        # CP groups are created by hand (not init_device_mesh) so they get our timeout and a
        # communicator of their own: gradient reductions on the default group never queue
        # behind (or among) the ring's transfers. Every rank creates every group, in order.
        ranks = torch.arange(world).view(world // cp, cp)
        groups = [new_ring_group(r.tolist(), timeout=self._timeout) for r in ranks] if cp > 1 else []
        self._cp_group = groups[self.dp_rank] if groups else None
        if cp > 2 and dist.get_backend() == "nccl":  # P = 2: the one peer connects on the first shift
            connect_peers(self._cp_group, self.root_device)
        # FSDP2 shards over every rank of dp x cp: a 1-D mesh over the default group.
        self._device_mesh = DeviceMesh.from_group(dist.group.WORLD, self.root_device.type, mesh_dim_names=("dp_cp",))

    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        mode = self._resolve_data_parallel()
        if not _is_parallelized(module):
            if mode == "fsdp":
                raise ValueError(
                    "data_parallel='fsdp' shards the blocks a module names: define configure_model() "
                    "calling longctx.parallelize(self.model, self.trainer.strategy.parallel_dims, plan) "
                    "(see the README), or use data_parallel='ddp'"
                )
            parallelize(module, self.parallel_dims)  # CP hand-over to the attention layers
        if mode == "ddp":
            self._check_replica_fits(module)
        self.model = self.precision_plugin.convert_module(self.model)
        if not self.cpu_offload:  # offloaded shards stay in host memory; FSDP2 moves them per use
            self.model_to_device()
        if mode == "ddp" and self.world_size > 1:
            device_ids = None if self.root_device.type == "cpu" else [self.root_device.index]
            self.model = DistributedDataParallel(self.model, device_ids=device_ids, **self._ddp_kwargs)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_replica_fits(self, module: torch.nn.Module) -> None:
        """DDP keeps everything on every GPU: say so (and how to fix it) before the OOM."""
        if self.root_device.type == "cuda":
            check_replica_fits(
                sum(p.numel() for p in module.parameters()),
                world_size=self.world_size,
                gpu_total=torch.cuda.get_device_properties(self.root_device).total_memory,
                device_name=torch.cuda.get_device_name(self.root_device),
            )

    # -- checkpoints: sharded folders (FSDP) or single files (DDP) -----------------------

    @property
    def _sharded(self) -> bool:
        return self.data_parallel == "fsdp"

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._sharded  # sharded optimizer state is restored in load_checkpoint

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._sharded:
            return super().lightning_module_state_dict()
        return self.lightning_module.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._sharded:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer.state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._sharded:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes sharded checkpoints itself: no storage_options")
        # A folder of per-rank shards plus a verified manifest, swapped in atomically.
        save_training_state(Path(self.broadcast(str(filepath))), checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not self._sharded:
            return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)
        return load_training_state(
            Path(self.broadcast(str(checkpoint_path))),
            self.model,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._sharded:
            Strategy.load_model_state_dict(self, checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._sharded:
            Strategy.load_optimizer_state_dict(self, checkpoint)

    # -- data ----------------------------------------------------------------------------

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All ranks of a CP group read the same samples; only dp splits the data.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def connect(self, model: Any) -> None:
        super().connect(model)
        self._dp_sampling.take_over(getattr(model, "_trainer", None))  # while fitting: our sampler, in order

    def process_dataloader(self, dataloader: object) -> object:
        """Split a user's DataLoader over dp only, in the loader's own order (``DpSampling.split``);
        where the LightningModule describes a ``batch_preparation`` (longctx's does), the loader's
        collate makes each batch ready for this rank on the host (``longctx.data.prepare``)."""
        dataloader = self._dp_sampling.split(dataloader, **self.distributed_sampler_kwargs)
        describe = getattr(self.lightning_module, "batch_preparation", None)
        preparation = describe() if callable(describe) else None
        if preparation is not None and isinstance(dataloader, DataLoader):
            dataloader.collate_fn = PreparingCollate(dataloader.collate_fn, preparation)
        return dataloader

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        # Shard after the LightningModule's transfer hooks, which may expect full sequences
        # (e.g. to shift labels). shard_batch is idempotent, so an already sharded batch passes.
        # At cp == 1 a token batch still gets its position_ids; other batches pass untouched.
        from ..sharding import shard_batch

        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.cp_size == 1 and not (isinstance(batch, Mapping) and "input_ids" in batch):
            return batch
        return shard_batch(batch, rank=self.cp_rank, world_size=self.cp_size, layout=self.layout)

    # -- teardown / registration -----------------------------------------------------------

    @property
    def failure_timeout(self) -> Optional[float]:
        return self._failures.failure_timeout

    def on_exception(self, exception: BaseException) -> None:
        if not isinstance(exception, StoppedBySignal):  # every rank raises that one at the same step
            # A peer that left during a stop by signal is no failure: nothing to tell the others.
            self._failures.failed(
                exception,
                rank=self.global_rank,
                data_parallel=self.data_parallel,
                tell_others=self.received_signal is None,
            )
        super().on_exception(exception)

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        self._dp_sampling.restore(getattr(self.lightning_module, "_trainer", None))
        self._failures.stop()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Ring-attention context parallelism over a (dp, cp) layout with FSDP2 or DDP "
            "(whole world = one CP group; pass ContextParallelStrategy(context_parallel_size=N) for dp x cp)",
            override=True,
        )


def _register(registry: Any = StrategyRegistry) -> None:
    if ContextParallelStrategy.strategy_name not in registry:
        ContextParallelStrategy.register_strategies(registry)


# Lightning only scans its own modules for register_strategies; register on import.
_register()
