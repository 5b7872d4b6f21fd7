"""One run plan, decided once: every "auto" of a training run resolved before the model is built.

``resolve_run(config, world, device, ...)`` is a pure function of the model's shape, the world
the launcher and the strategy fixed (``World``), the device and the run's shapes. It returns a
frozen ``RunPlan`` of two parts kept apart:

* ``parallel`` (``ParallelChoices``): data-parallel mode (FSDP2 or DDP; ``resolve_data_parallel``),
  CP size and layout, ring or Ulysses, the block kernel for each block kind (plain and
  document-masked, by ``longctx.kernels.select_backend``: the rule the kernels apply per call),
  pointwise fusion, FP8 linears, document balancing, RoPE positions;
* ``memory`` (``MemoryChoices``): activation checkpointing, MLP tiling, attention head chunks,
  offloaded blocks, loss chunk: the requested settings, escalated where the memory model
  (``longctx.memory``; one ladder: ``longctx.memory_fit.fitting_plan``) predicts they do not fit the GPU.

``RunPlan.model`` is the ``ParallelPlan`` ``parallelize`` applies, made once
with the plan (kernels named, activation checkpointing decided: the layers run what the plan
says, nothing re-resolves "auto"); ``config_entries()`` the options that reproduce the run when
written to its config.yaml; ``line()`` the line printed at start. A plan resolved again from its
own entries is the same plan.

Who reads what (``CausalLMModule`` resolves the plan in ``setup``, through
``longctx.lightning.planning.plan_run``, or takes the one train.py resolved before the model was
built, ``CausalLMModule.check_fit`` / ``use_run_plan``, and hands it down once): the strategy its data-parallel
mode (``ContextParallelStrategy.use_run_plan``), ``parallelize`` its ``model``, the batch pipeline
the document balance, exchange and RoPE positions (``longctx.lightning.batches``), train.py's
config.yaml ``config_entries()``.

Defaults: what the run leaves unset (None) is decided here, by device, in one place
(``ParallelPlan.defaults_for``): on a CUDA GPU the fastest plan the memory model predicts to
fit (activation checkpointing "auto", pointwise fusion on for models that fuse); on a CPU the
plain model ("none", no fusion). Every value it takes is in the plan: printed, recorded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from .layouts import check_layout
from .parallel import ParallelPlan

# "auto" data parallelism shards once the replicated training state would fill this share of a GPU.
AUTO_FSDP_MEMORY_SHARE = 0.25
BYTES_PER_PARAMETER = 16  # fp32 weights + gradients + AdamW's two moments
DDP_BUCKET_BYTES = 4  # DDP's flat fp32 gradient buckets (a second copy of the gradients)
REQUESTED_DATA_PARALLEL = ("auto", "fsdp", "ddp", "none")


@dataclass(frozen=True)
class World:
    """What the launcher and the strategy fixed: CP and dp sizes, the layout, the data-parallel
    mode asked for (``"auto"``, ``"fsdp"``, ``"ddp"``; ``"none"``: no longctx strategy) and
    FSDP2's CPU offload; ``local_ranks``: the ranks sharing this host's memory."""

    cp: int = 1
    dp: int = 1
    layout: str = "zigzag"
    data_parallel: str = "none"
    cpu_offload: bool = False
    local_ranks: int = 1

    def __post_init__(self) -> None:
        for name in ("cp", "dp", "local_ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"World.{name} must be an int >= 1, got {value!r}")
        check_layout(self.layout)
        if self.data_parallel not in REQUESTED_DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {REQUESTED_DATA_PARALLEL}, got {self.data_parallel!r}")


@dataclass(frozen=True)
class ParallelChoices:
    """How the world splits the work, which kernels run it and in what precision (every value resolved)."""

    data_parallel: str  # "fsdp", "ddp" or "none" (no longctx strategy)
    cp: int
    dp: int
    layout: str
    cpu_offload: bool
    cp_attention: str
    attention_backend: str  # blocks without document ids ("auto" only where the shapes were unknown)
    document_backend: str  # document-masked blocks
    fuse_pointwise: bool
    float8: bool  # the block projections and MLP in FP8 (longctx.float8)
    balance_documents: bool
    document_exchange: str  # "ring" or "gather" (longctx.documents.plan_documents)
    rope_positions: str  # "document" (restart per document) or "global"
    precision: str  # the Trainer's (train.py: given, else bf16-mixed on a GPU, 32-true on a CPU)


@dataclass(frozen=True)
class MemoryChoices:
    """What the backward keeps, recomputes, tiles, chunks and offloads."""

    activation_checkpointing: str
    checkpointed_blocks: Optional[int]
    mlp_tile_size: Optional[int]
    attention_head_chunks: int
    offload_activations: Union[bool, int]
    loss_chunk_size: int


@dataclass(frozen=True)
class RunPlan:
    """A run's decisions: ``parallel`` and ``memory``. ``model``: the ``ParallelPlan`` that
    ``parallelize`` applies (and ``hparams["parallel"]`` records), made from them once, here.
    ``estimate`` (the memory model's prediction, None where not checked) and ``notes`` (what was
    changed to fit) are reports, not decisions: they do not take part in equality."""

    parallel: ParallelChoices
    memory: MemoryChoices
    estimate: Any = dataclasses.field(default=None, compare=False)
    notes: tuple = dataclasses.field(default=(), compare=False)
    model: ParallelPlan = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.parallel
        model = ParallelPlan(
            cp_attention=p.cp_attention,
            attention_backend=p.attention_backend,
            document_backend=p.document_backend,
            fuse_pointwise=p.fuse_pointwise,
            document_exchange=p.document_exchange,
            float8=p.float8,
            **dataclasses.asdict(self.memory),
        )
        model.check_decided("a run plan")
        object.__setattr__(self, "model", model)  # frozen: made once, here

    def to_dict(self) -> dict:
        return {"parallel": dataclasses.asdict(self.parallel), "memory": dataclasses.asdict(self.memory)}

    def config_entries(self) -> dict:
        """Dotted config keys (train.py's sections) -> the values that reproduce this plan:
        the model's ``parallel`` section, its document balance and RoPE positions, the
        Trainer's precision and, under the longctx strategy, its data-parallel mode."""
        entries: dict = {
            "model.parallel": self.model.to_dict(),
            "model.load_balance": self.parallel.balance_documents,
            "model.rope_positions": self.parallel.rope_positions,
            "trainer.precision": self.parallel.precision,
        }
        if self.parallel.data_parallel != "none":
            entries["strategy.data_parallel"] = self.parallel.data_parallel
        return entries

    def line(self) -> str:
        """The plan in one line, as printed at the start of a fit."""

        def fields(d):
            return ", ".join(f"{k}={v}" for k, v in d.items())

        d = self.to_dict()
        return f"run plan: parallel({fields(d['parallel'])}); memory({fields(d['memory'])})"


def resolve_data_parallel(
    requested: str, *, n_params: int, device_type: str, gpu_total: Optional[int], parallelizes: bool
) -> str:
    """ "fsdp" or "ddp" for ``requested`` ("auto": FSDP2 when the replicated training state,
    16 bytes a parameter, would take more than a quarter of the GPU; always DDP on CPU and for
    modules that do not apply ``longctx.parallelize`` themselves)."""
    if requested != "auto":
        return requested
    big = gpu_total is not None and n_params * BYTES_PER_PARAMETER > AUTO_FSDP_MEMORY_SHARE * gpu_total
    return "fsdp" if device_type == "cuda" and parallelizes and big else "ddp"


def check_replica_fits(n_params: int, *, world_size: int, gpu_total: int, device_name: str) -> None:
    """DDP keeps the whole training state on every GPU: raise ``MemoryError`` (one line, naming
    the fix) where that alone exceeds ``gpu_total``, before any activation."""
    per_param = BYTES_PER_PARAMETER + (DDP_BUCKET_BYTES if world_size > 1 else 0)
    need = n_params * per_param
    if need > gpu_total:
        raise MemoryError(
            f"data_parallel='ddp' keeps the whole model on every GPU: {n_params / 1e9:.2f}B parameters x "
            f"{per_param} bytes (fp32 weights, gradients, AdamW moments, DDP buckets) = "
            f"{need / 2**30:.0f} GiB > {gpu_total / 2**30:.0f} GiB on {device_name}, "
            "before any activation. Use data_parallel='fsdp' (train.py --data-parallel fsdp) to shard it "
            "over the ranks"
        )


def balances_documents(
    load_balance: Optional[bool], *, documents: bool, cp: int, layout: str, cp_attention: str
) -> bool:
    """Whether batches are reordered for balanced document work (``longctx.balance_documents``):
    ``load_balance`` True: wherever there is CP and document attention; None: also only under
    the ring and the zigzag layout; False: never."""
    if not load_balance and load_balance is not None or not documents or cp == 1:
        return False
    return bool(load_balance) or (layout == "zigzag" and cp_attention == "ring")


def resolve_rope_positions(requested: Optional[str], *, documents: bool) -> str:
    """RoPE positions: as ``requested``, else "document" (restarting at every document) with
    document attention and "global" (positions in the packed sequence) without."""
    if requested is not None:
        return requested
    return "document" if documents else "global"


def compute_dtype(precision: str):
    """The dtype attention blocks see under a Lightning ``precision`` string."""
    import torch

    precision = str(precision)
    if "bf16" in precision:
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32


def resolve_run(
    config: Any,
    world: World,
    device: Any,
    *,
    requested: Union[ParallelPlan, Mapping[str, Any], None] = None,
    precision: str = "32-true",
    seq_len: Optional[int] = None,
    batch_size: Optional[int] = None,
    documents: bool = True,
    load_balance: Optional[bool] = None,
    rope_positions: Optional[str] = None,
    n_params: int = 0,
    parallelizes: bool = True,
    memory_check: bool = True,
    gpu_total: Optional[int] = None,
    host_total: Optional[int] = None,
    host_check: Optional[int] = None,
    hf_modules: bool = False,
) -> RunPlan:
    """Every "auto" of the run, resolved once (see the module doc).

    ``config``: the model's shape (``GPTConfig`` or a Hugging Face config; read duck-typed).
    ``device``: this rank's device; ``gpu_total`` / ``host_total``: its GPU's and the host's
    bytes (None: unknown, nothing escalated); ``host_check``: the host memory the run is refused
    against where that is not the one it is planned for (train.py's launching process: what is
    available now; None: ``host_total``), so that every process plans alike. ``requested``: the
    run's ``ParallelPlan`` as given. ``seq_len`` / ``batch_size``: the full training sequence and the per-rank batch
    (None: unknown before the first batch: the plain blocks' kernel stays "auto", chosen per
    call by the kernels, and the memory is not planned). ``documents``: document-masked
    attention; ``load_balance`` / ``rope_positions``: as the module was given them (None:
    ``balances_documents`` / ``resolve_rope_positions`` decide). ``n_params`` / ``parallelizes``:
    for ``resolve_data_parallel``. The plan's settings left at None are this device's
    defaults (``ParallelPlan.defaults_for``; transformers' modules do not fuse).
    ``memory_check``: on a GPU, escalate the memory settings the plan leaves at their
    defaults to the cheapest that fit (``longctx.memory_fit.fitting_plan``) and raise
    ``PredictedOutOfMemory`` (one line) where nothing does. ``hf_modules``: the model is
    transformers' (``--hf-model``), whose eager blocks keep more (``longctx.memory.estimate``).
    """
    import torch

    from . import memory

    device = torch.device(device)
    asked = ParallelPlan.from_dict(requested)
    plan = asked.defaults_for(device.type, fusable=not hf_modules)
    plan.check_device(device)  # a named kernel (or FP8) that cannot run here: one line naming the option
    mode = (
        world.data_parallel
        if world.data_parallel == "none"
        else resolve_data_parallel(
            world.data_parallel,
            n_params=n_params,
            device_type=device.type,
            gpu_total=gpu_total,
            parallelizes=parallelizes,
        )
    )
    if world.cpu_offload and mode != "fsdp":
        raise ValueError("cpu_offload=True needs data_parallel='fsdp' (FSDP2 offloads the shards)")
    try:
        head_dim = memory.model_shape(config).hd
    except (ValueError, AttributeError, TypeError):
        head_dim = None  # a model shape this cannot read: the kernels choose per call, no memory plan

    plan = _resolve_kernels(plan, device, precision=precision, head_dim=head_dim, seq_len=seq_len, cp=world.cp)
    memory_kw = None
    if memory_check and seq_len and batch_size and head_dim is not None:
        memory_kw = _memory_kw(
            mode,
            world,
            plan,
            precision=precision,
            batch_size=batch_size,
            documents=documents,
            hf_modules=hf_modules,
            device=device,
        )
        try:
            memory.estimate(config, seq_len, plan=_decided(plan), **memory_kw)
        except (ValueError, AttributeError, TypeError):
            memory_kw = None  # a model shape the memory model cannot read: no prediction, no check
    gpu_total = gpu_total if device.type == "cuda" else None  # a CPU's memory is checked, not planned
    default = asked.activation_checkpointing is None
    plan, estimate, notes = _plan_memory(
        config,
        seq_len,
        plan,
        world,
        memory_kw,
        default=default,
        gpu_total=gpu_total,
        host_total=host_total,
        host_check=host_total if host_check is None else host_check,
    )

    parallel = ParallelChoices(
        data_parallel=mode,
        cp=world.cp,
        dp=world.dp,
        layout=world.layout,
        cpu_offload=world.cpu_offload,
        cp_attention=plan.cp_attention,
        attention_backend=plan.attention_backend,
        document_backend=plan.document_backend,
        fuse_pointwise=plan.fuse_pointwise,
        float8=plan.float8,
        balance_documents=balances_documents(
            load_balance, documents=documents, cp=world.cp, layout=world.layout, cp_attention=plan.cp_attention
        ),
        document_exchange=plan.document_exchange,
        rope_positions=resolve_rope_positions(rope_positions, documents=documents),
        precision=str(precision),
    )
    if plan.float8 and plan.mlp_tile_size is not None:
        notes += (
            "float8: with mlp_tile_size the tiled q/k/v projections and MLP use their weights directly "
            "and run in bf16; only o_proj runs in FP8, in the blocks that checkpoint nothing",
        )
    mem = MemoryChoices(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(MemoryChoices)})
    return RunPlan(parallel, mem, estimate=estimate, notes=notes)


def _resolve_kernels(plan: ParallelPlan, device, *, precision: str, head_dim, seq_len, cp: int) -> ParallelPlan:
    """``plan`` with its block kernels named, per block kind, by the kernels' own rule."""
    from longctx.kernels import select_backend

    # The ring's blocks are this rank's shard; Ulysses' the whole sequence.
    dtype = compute_dtype(precision)
    block = None if seq_len is None else (-(-seq_len // cp) if plan.cp_attention == "ring" else seq_len)
    plain, document = plan.attention_backend, plan.document_backend or plan.attention_backend
    if head_dim is not None:
        if plain != "auto" or block is not None or device.type != "cuda":
            plain = select_backend(plain, device, dtype, head_dim, block or 1, block or 1, True)
        # Document-masked blocks take their kernel from the plain one's request where none is named.
        document = select_backend(document, device, dtype, head_dim, block or 1, block or 1, True, documents=True)
    return dataclasses.replace(plan, attention_backend=plain, document_backend=document)


def _plan_memory(config, seq_len, plan, world: World, memory_kw, *, default: bool, gpu_total, host_total, host_check):
    """(plan, estimate, notes): activation checkpointing "auto" decided (the least recompute
    predicted to fit, the MLP tiled where that recomputes less; "full" where nothing is
    checked: no GPU memory, no shapes), the fitting ladder where the plan does not fit (in
    ``host_total``), the check (against ``host_check``).
    ``memory_kw``: ``estimate``'s arguments (None: no prediction); ``default``: "auto" came from
    the device's defaults, not the user."""
    from . import memory, memory_fit

    estimate, notes = None, ()
    fits_checked = memory_kw is not None and gpu_total is not None
    host = None if host_total is None else host_total // world.local_ranks
    if plan.activation_checkpointing == "auto":
        auto = "auto (the GPU default)" if default else "auto"
        if fits_checked:
            requested_tile = plan.mlp_tile_size
            plan = memory_fit.least_recompute(
                config, seq_len, plan=plan, gpu_total=gpu_total, host_total=host, **memory_kw
            )
            chose = memory.estimate(config, seq_len, plan=plan, **memory_kw).gpu_bytes
            tiled = "" if plan.mlp_tile_size == requested_tile else f" with mlp_tile_size={plan.mlp_tile_size}"
            n = plan.checkpointed_blocks
            blocks = "" if n is None else f" on the first {n} of {memory.model_shape(config).L} blocks"
            notes = (
                f"memory: activation_checkpointing {auto} -> {plan.activation_checkpointing}{blocks}{tiled} "
                f"({chose / memory.GiB:.1f} GiB predicted, {gpu_total / memory.GiB:.1f} GiB on the GPU)",
            )
        else:
            plan = _decided(plan)
            notes = (
                f"memory: activation_checkpointing {auto} -> full (no GPU memory to check a lighter mode against)",
            )
    if memory_kw is not None and memory_kw["device"] == "cpu" and host_check is not None:
        # A CPU run's step is host memory: checked (never escalated: the CPU runs the plain model).
        estimate = memory_fit.check_fits(
            config, seq_len, plan=plan, **memory_kw, host_total=host_check, host_ranks=world.local_ranks
        )
    elif memory_kw is not None:
        estimate = memory.estimate(config, seq_len, plan=plan, **memory_kw)
    if fits_checked:
        fitted = memory_fit.fitting_plan(config, seq_len, plan=plan, gpu_total=gpu_total, host_total=host, **memory_kw)
        if fitted is not None and fitted != plan:
            notes += (
                f"memory: {estimate.gpu_bytes / memory.GiB:.1f} GiB predicted does not fit; running with "
                f"mlp_tile_size={fitted.mlp_tile_size}, attention_head_chunks={fitted.attention_head_chunks}, "
                f"offload_activations={fitted.offload_activations}",
            )
            plan = fitted
        estimate = memory_fit.check_fits(
            config,
            seq_len,
            plan=plan,
            **memory_kw,
            gpu_total=gpu_total,
            host_total=host_check,
            host_ranks=world.local_ranks,
        )
    return plan, estimate, notes


def _decided(plan: ParallelPlan) -> ParallelPlan:
    """``plan`` with activation checkpointing "auto" taken as "full" (where fitting is not checked)."""
    if plan.activation_checkpointing != "auto":
        return plan
    return dataclasses.replace(plan, activation_checkpointing="full")


def _memory_kw(
    data_parallel: str,
    world: World,
    plan: ParallelPlan,
    *,
    precision: str,
    batch_size: int,
    documents: bool,
    hf_modules: bool = False,
    device: Any,
) -> dict:
    """``longctx.memory.estimate``'s arguments for a resolved plan on ``device``: the memory model
    counts the kernel the layers run (the document-masked one with documents)."""
    import torch

    from . import memory

    kernel = plan.document_backend if documents else plan.attention_backend
    return dict(
        cp=world.cp,
        dp=world.dp,
        data_parallel=data_parallel,
        cpu_offload=world.cpu_offload,
        batch_size=batch_size,
        precision="32-true" if str(precision)[:2] in ("32", "64") else "bf16-mixed",
        attention_kernel="auto" if kernel in (None, "auto") else memory.kernel_family(kernel),
        hf_modules=hf_modules,
        device="cuda" if torch.device(device).type == "cuda" else "cpu",
        documents=documents,
    )


def check_memory(
    config: Any,
    run: RunPlan,
    seq_len: int,
    *,
    batch_size: int,
    precision: str,
    documents: bool,
    device: Any,
    local_ranks: int = 1,
    gpu_total: Optional[int] = None,
    host_total: Optional[int] = None,
    hf_modules: bool = False,
):
    """The memory model's prediction for a resolved ``run`` (which it does not change) on
    ``device``: for data whose shapes were unknown when the plan was made, checked on the first batch. Raises
    ``PredictedOutOfMemory`` (one line, naming the change) where it exceeds ``gpu_total`` /
    ``host_total`` (None: not checked); None where the model's shape cannot be read."""
    from . import memory, memory_fit

    p = run.parallel
    world = World(
        cp=p.cp,
        dp=p.dp,
        layout=p.layout,
        data_parallel=p.data_parallel,
        cpu_offload=p.cpu_offload,
        local_ranks=local_ranks,
    )
    plan = run.model
    kw = _memory_kw(
        p.data_parallel,
        world,
        plan,
        precision=precision,
        batch_size=batch_size,
        documents=documents,
        hf_modules=hf_modules,
        device=device,
    )
    try:
        memory.estimate(config, seq_len, plan=plan, **kw)
    except (ValueError, AttributeError, TypeError):
        return None
    return memory_fit.check_fits(
        config, seq_len, plan=plan, **kw, gpu_total=gpu_total, host_total=host_total, host_ranks=local_ranks
    )
