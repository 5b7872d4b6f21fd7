"""The run plan of a ``CausalLMModule`` on a Trainer: the Trainer's world, device and memory
handed to ``longctx.run_plan.resolve_run``, before the model is built (``setup``) or before any
process starts (``CausalLMModule.check_fit``, train.py), and the memory check of a first batch
whose shape was unknown before the fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

from longctx.models.config import GPTConfig
from longctx.parallel import ParallelPlan


def memory_totals(device: torch.device) -> dict:
    """The GPU's and the host's total memory for the memory model (the host's only off CUDA)."""
    from longctx.memory_fit import host_memory_bytes

    if device.type != "cuda":
        return dict(host_total=host_memory_bytes())
    return dict(gpu_total=torch.cuda.mem_get_info(device)[1], host_total=host_memory_bytes())


def plan_run(
    config: GPTConfig,
    trainer: Optional["L.Trainer"],
    *,
    requested: ParallelPlan,
    seq_len: Optional[int],
    batch_size: Optional[int],
    attention: str,
    load_balance: Optional[bool],
    rope_positions: Optional[str],
    n_params: int,
    memory_check: bool,
    hf_modules: bool,
    gpu_total: Optional[int] = None,
    host_total: Optional[int] = None,
    host_check: Optional[int] = None,
):
    """The run plan (``longctx.run_plan.resolve_run``) of a module of ``config`` on ``trainer``'s
    world and device, for data of ``seq_len`` x ``batch_size`` (None: unknown); on a CPU, with
    a note where the step is of a GPU's size (``CPU_SLOW_FACTOR``)."""
    from longctx.run_plan import World, resolve_run

    strategy = getattr(trainer, "strategy", None)
    device = getattr(strategy, "root_device", None) or torch.device("cpu")
    world = getattr(strategy, "run_world", None)
    if world is None:  # not the longctx strategy: one CP rank, data parallelism is not ours
        cp = cp_size(trainer) if trainer is not None else 1
        world = World(
            cp=cp,
            dp=max(int(getattr(trainer, "world_size", 1)) // cp, 1),
            layout=getattr(strategy, "layout", "zigzag"),
        )
    # The host holds every local rank's share (pinned offload buffers, offloaded state; a CPU's step).
    world = dataclasses.replace(world, local_ranks=max(int(getattr(trainer, "num_devices", 1)), 1))
    run = resolve_run(
        config,
        world,
        device,
        requested=requested,
        precision=str(getattr(trainer, "precision", "32-true")),
        seq_len=int(seq_len) if seq_len else None,
        batch_size=int(batch_size) if batch_size else None,
        documents=attention == "document",
        load_balance=load_balance,
        rope_positions=rope_positions,
        n_params=n_params,
        memory_check=memory_check,
        hf_modules=hf_modules,
        gpu_total=gpu_total,
        host_total=host_total,
        host_check=host_check,
    )
    if device.type == "cpu" and seq_len and batch_size:
        flops = config.flops_per_token(int(seq_len)) * int(seq_len) * int(batch_size) / world.cp
        if flops > CPU_SLOW_FACTOR * DEFAULT_RUN_STEP_FLOPS:
            run = dataclasses.replace(run, notes=(*run.notes, slow_on_cpu(flops, seq_len, world.cp)))
    return run


# The default run's (configs/tiny-cpu.yaml) training FLOPs per rank and step (a few seconds on
# two cores; a test keeps the two equal). A CPU run of more than CPU_SLOW_FACTOR times that is
# said to be sized for GPUs, once, before its first step.
DEFAULT_RUN_STEP_FLOPS = 1.26e10
CPU_SLOW_FACTOR = 10


def slow_on_cpu(flops: float, seq_len: int, cp: int) -> str:
    return (
        f"warning: this run is sized for GPUs: {flops / 1e12:.2f} TFLOP per rank and step on CPU, "
        f"{flops / DEFAULT_RUN_STEP_FLOPS:.0f}x the default tiny run's (minutes per step on a few cores); "
        f"a shorter --seq-len (now {seq_len:,} over {cp} ranks), --batch-size or a smaller --preset scales it "
        "down, --accelerator gpu runs it where it belongs"
    )


def model_config(model: Any, init_from: Optional[str], hf_model: Optional[str]) -> Optional[GPTConfig]:
    """The sizes of the model ``CausalLMModule(model, init_from=..., hf_model=...)`` builds, read
    without building it or reading its tensors: ``model`` (a preset and overrides), a checkpoint's
    own config, a Hugging Face directory's ``config.json``; None where they cannot be read yet."""
    import json

    from longctx.models.checkpoint_import import config_from_hf, pretrained_config

    try:
        if hf_model is not None:
            return config_from_hf(json.loads((Path(hf_model) / "config.json").read_text()))
        if init_from is not None:
            return pretrained_config(init_from, **dict(model or {}))
        return model if isinstance(model, GPTConfig) else GPTConfig.from_dict(dict(model or {}))
    except (ValueError, KeyError, OSError, TypeError):
        return None


def cp_size(trainer: "L.Trainer") -> int:
    return int(getattr(trainer.strategy, "cp_size", 1))


def check_batch_memory(
    config: GPTConfig, run_plan: Any, trainer: "L.Trainer", batch: Any, *, documents: bool, hf_modules: bool
) -> None:
    """The memory check of the first batch of data whose sequence length was unknown before the
    fit (not planned: the model is built by then); the prediction printed on rank 0."""
    from longctx.run_plan import check_memory

    ids = batch["input_ids"]  # sharded by now
    device = trainer.strategy.root_device
    est = check_memory(
        config,
        run_plan,
        int(ids.shape[1]) * cp_size(trainer),
        batch_size=int(ids.shape[0]),
        precision=str(trainer.precision),
        documents=documents,
        device=device,
        local_ranks=max(int(trainer.num_devices), 1),
        hf_modules=hf_modules,
        **memory_totals(device),
    )
    if est is not None and trainer.global_rank == 0:
        print(est.summary(), flush=True)
