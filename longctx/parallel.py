"""How a model runs in parallel, as values: the CP context, the parallel layout, the plan,
and ``parallelize``, which applies them to an architecture-only model from outside.

* ``CPContext(group, layout)``: the context-parallel group and sequence layout, one object.
* ``ContextParallelAttention``: the attention core a model puts where ``softmax(QK^T)V``
  goes. It holds the ``CPContext`` (handed over once, by ``parallelize``) and calls
  ``ring_attention`` or ``ulysses_attention``. A model built from it knows nothing of
  process groups.
* ``ParallelDims``: the layout of the world for one model: CP context, data-parallel mode
  (``"fsdp"``, ``"ddp"`` or ``"none"``), the mesh FSDP2 shards over (every rank of dp x cp:
  CP ranks hold other tokens of the same samples, so they shard parameters too),
  FSDP2's compute dtype and CPU offload. The strategy builds it.
* ``ParallelPlan``: the runtime policy of one model: activation checkpointing, pointwise
  fusion, ring or Ulysses, kernel backends, loss chunk size, memory settings, FP8 linears. A
  run resolves its "auto"s and the settings it leaves unset (``defaults_for``: per device) once
  (``longctx.run_plan.resolve_run``): the resolved plan's ``model`` is what ``parallelize`` gets.
* ``parallelize(model, dims, plan)``: applies both, FSDP2 last (per block, an untied input
  embedding, then the root).

Blocks are the modules named in the model's ``_no_split_modules`` (Hugging Face's
convention, which ``longctx.models.GPT`` follows too). Activation checkpointing, fusion
and the loss chunk go through the model's own setters (``set_activation_checkpointing``,
``set_pointwise_fusion``, ``loss_chunk_size``; ``longctx.models.HFCausalLM`` maps them to
transformers' checkpointing for Hugging Face models).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .head_groups import check_head_chunks
from .layouts import check_layout
from .ring import ring_attention
from .ulysses import ulysses_attention
from .validation import ArgumentValueError, check_choice, check_number

CP_ATTENTION = ("ring", "ulysses")
DOCUMENT_EXCHANGES = ("ring", "gather", "auto")  # "auto": longctx.exchange_cost chooses per batch
DATA_PARALLEL = ("fsdp", "ddp", "none")
CHECKPOINTING = ("none", "selective", "full")  # what a model applies
PLAN_CHECKPOINTING = (*CHECKPOINTING, "auto")  # what a plan may ask for (run_plan decides "auto")


@dataclass(frozen=True)
class CPContext:
    """A context-parallel group and the layout its shards follow (``group=None``: no CP)."""

    group: Optional[dist.ProcessGroup] = None
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        check_layout(self.layout)

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)


class ContextParallelAttention(nn.Module):
    """Exact causal attention of this rank's shard over its CP group (no parameters).

    ``forward(q, k, v, document_ids=None)`` on ``(B, S_local, heads, head_dim)`` tensors.
    ``kind`` is ``"ring"`` or ``"ulysses"``; ``backend`` goes to the block kernels, and
    ``document_backend`` (None: ``backend``) for document-masked calls.
    """

    def __init__(
        self,
        n_head: int,
        n_kv_head: int,
        *,
        kind: str = "ring",
        backend: str = "auto",
        head_chunks: int = 1,
        document_backend: Optional[str] = None,
    ):
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.cp = CPContext()
        self.kind, self.backend, self.document_backend, self.head_chunks = "ring", backend, document_backend, 1
        self.configure(kind=kind, head_chunks=head_chunks)

    def configure(
        self,
        *,
        cp: Optional[CPContext] = None,
        kind: Optional[str] = None,
        backend: Optional[str] = None,
        head_chunks: Optional[int] = None,
        document_backend: Optional[str] = None,
    ) -> None:
        cp = self.cp if cp is None else cp
        kind = self.kind if kind is None else kind
        head_chunks = self.head_chunks if head_chunks is None else head_chunks
        if kind not in CP_ATTENTION:
            raise ValueError(f"cp_attention must be one of {CP_ATTENTION}, got {kind!r}")
        check_head_chunks(head_chunks, self.n_kv_head)
        if kind == "ulysses" and head_chunks != 1:
            raise ValueError(
                "attention_head_chunks applies to cp_attention='ring'; Ulysses already runs its "
                "heads in groups (longctx.ulysses.PIPELINE_CHUNKS)"
            )
        if kind == "ulysses" and self.n_kv_head % cp.size != 0:
            # Fail at hand-over, not at the first step on every rank.
            raise ValueError(
                f"cp_attention='ulysses' splits heads over the context-parallel group: "
                f"n_kv_head={self.n_kv_head} is not a multiple of its size {cp.size}; "
                "use cp_attention='ring' or a CP size dividing n_kv_head"
            )
        self.cp, self.kind, self.head_chunks = cp, kind, head_chunks
        if backend is not None:
            self.backend = backend
        if document_backend is not None:
            self.document_backend = document_backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        attention = ulysses_attention if self.kind == "ulysses" else ring_attention
        extra = {} if document_ids is None else {"document_ids": document_ids}
        if self.head_chunks != 1:
            extra["head_chunks"] = self.head_chunks
        # A step's plan of one document per row runs as the plain ring: the plain blocks' kernel.
        masked = document_ids is not None and not getattr(document_ids, "one_document", False)
        backend = (self.document_backend or self.backend) if masked else self.backend
        return attention(q, k, v, group=self.cp.group, causal=True, layout=self.cp.layout, backend=backend, **extra)

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind!r}, backend={self.backend!r}, cp_size={self.cp.size}, layout={self.cp.layout!r}"
            + (f", document_backend={self.document_backend!r}" if self.document_backend else "")
            + (f", head_chunks={self.head_chunks}" if self.head_chunks != 1 else "")
        )


@dataclass(frozen=True)
class ParallelPlan:
    """How one model runs (never its sizes). Frozen: a run's plan is decided once
    (``longctx.run_plan.resolve_run``) and applied once (``parallelize``).

    Args:
        activation_checkpointing: ``"none"``; ``"full"`` (keep each block's input, recompute
            the whole block, ring included); ``"selective"`` (keep attention's inputs and
            output too: norms, projections, RoPE and MLP are recomputed, never the ring);
            ``"auto"``: the least recompute the memory model predicts to fit the GPU (none or
            selective, each untiled or with the MLP tiled where ``mlp_tile_size`` is unset,
            ranked by ``longctx.memory_fit.recomputed_flops_per_token``; else full, then the
            rest of ``longctx.memory_fit.fitting_plan``'s ladder), decided once before the
            model is built (``longctx.run_plan.resolve_run``); "full" where it cannot be
            checked (no GPU, or the sequence length not known yet).
            None (default): left to the run (``defaults_for``): "auto" on a CUDA GPU, "none"
            elsewhere.
        fuse_pointwise: RMSNorm, RoPE and the SwiGLU gate through ``torch.compile`` (the same
            math as the eager chains, in one or two kernels; fp32 inside). None (default): left
            to the run (``defaults_for``): on on a CUDA GPU for models that fuse (``GPT``; not
            transformers' modules), off elsewhere (a CPU machine may have no compiler).
        cp_attention: ``"ring"`` (any head count) or ``"ulysses"`` (``n_kv_head % cp == 0``).
        attention_backend: block kernels: ``"auto"`` (measured fastest: FlashAttention-4
            where installed on sm90/sm100), ``"fa4"``, ``"cudnn"``, ``"flash"``, ``"triton"``,
            ``"torch"``. For blocks without document ids.
        document_backend: block kernels for document-masked blocks (same names). None
            (default): as ``attention_backend`` gives them ("auto": FlashAttention-4 where it
            runs, else "triton"; "cudnn"/"flash" take no mask: "triton"). A run's resolved plan
            names both (``longctx.run_plan``), so its config.yaml reproduces the kernels.
        loss_chunk_size: tokens per chunk of the chunked cross-entropy (fp32 logits of at
            most this many tokens exist at once).
        offload_activations: keep the tensors blocks save for the backward in pinned host
            memory instead of on the GPU (``longctx.offload``: copied out on a side stream,
            prefetched one block ahead in the backward). ``False``/0: none; ``True``: every
            block; an int n: the first n blocks only (choose it from
            ``longctx.memory.estimate``: just what does not fit). With
            ``activation_checkpointing="full"`` a block saves only its input.
        mlp_tile_size: tokens per tile of the sequence-tiled MLP (``longctx.tiled``): no
            (tokens x ffn) intermediate larger than ``mlp_tile_size x ffn`` exists, forward or
            backward; the norms and the q/k/v projections run over the same tiles (their
            normalised inputs are never saved at full length); exact. None (default): untiled.
            ``longctx.memory.estimate`` says when the untiled MLP does not fit (it names this setting).
        attention_head_chunks: ring attention runs over ``n_kv_head / attention_head_chunks``
            key/value heads (with their query heads) at a time, forward and backward: the
            same result, with the block kernels' and the ring's fp32 accumulators and
            messages that many times smaller (a full ring pass per chunk). Must divide
            ``n_kv_head``; 1 (default): all heads at once. For very long shards per rank,
            where ``longctx.memory.estimate`` shows the attention backward's buffers.
        document_exchange: how packed documents' key/value rows reach the ranks that see them
            (``longctx.documents.plan_documents``): ``"ring"``, P - 1 point-to-point steps
            with one kernel call each; ``"gather"``, one all-to-all and one kernel call per
            direction, whatever P; ``"auto"``, per batch the exchange and (where the batch is
            balanced) the token order, packed or balanced, that ``longctx.exchange_cost``
            predicts fastest. None (default): left to the run (``defaults_for``): "auto" on a
            CUDA GPU, "ring" elsewhere.
        checkpointed_blocks: how many blocks, from the first, ``activation_checkpointing``
            ("selective" or "full") applies to; the later ones keep everything (as "none").
            None (default): every block. What "auto" sets where memory is left over after the
            lighter mode: the fewest checkpointed blocks predicted to fit, so the recompute
            falls with the spare memory. Not with ``offload_activations`` (both act on the
            blocks' saved tensors; offload is the ladder past full checkpointing).
        float8: FP8 training (torchao's float8 linear layers, dynamic tensorwise scales) of the
            block projections and MLP (q/k/v/o, gate/up/down; never attention itself or the LM
            head), with FSDP2's float8 all-gather under ``data_parallel="fsdp"``
            (``longctx.float8``). Needs an sm89+ GPU and ``pip install 'longctx[float8]'``
            (``check_device`` says which is missing, in one line). Weights stay fp32/bf16
            parameters: checkpoints load with or without it.
    """

    activation_checkpointing: Optional[str] = None
    fuse_pointwise: Optional[bool] = None
    cp_attention: str = "ring"
    attention_backend: str = "auto"
    document_backend: Optional[str] = None
    loss_chunk_size: int = 4096
    offload_activations: Union[bool, int] = False
    mlp_tile_size: Optional[int] = None
    attention_head_chunks: int = 1
    document_exchange: Optional[str] = None
    float8: bool = False
    checkpointed_blocks: Optional[int] = None

    def __post_init__(self) -> None:
        ac = self.activation_checkpointing
        if ac is not None and (not isinstance(ac, str) or ac not in PLAN_CHECKPOINTING):
            choices = f"{PLAN_CHECKPOINTING} (or null: the run's default)"
            raise ArgumentValueError("activation_checkpointing", f"must be one of {choices}, got {ac!r}")
        for name in ("fuse_pointwise", "float8"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "fuse_pointwise" and value is None):
                raise ArgumentValueError(name, f"must be true or false, got {value!r}")
        if self.cp_attention not in CP_ATTENTION:
            raise ArgumentValueError("cp_attention", f"must be one of {CP_ATTENTION}, got {self.cp_attention!r}")
        from longctx.kernels import BACKENDS

        for name in ("attention_backend", "document_backend"):
            value = getattr(self, name)
            if value not in ("auto", *BACKENDS) and not (name == "document_backend" and value is None):
                raise ArgumentValueError(name, f"must be 'auto' or one of {BACKENDS}, got {value!r}")
        n = self.loss_chunk_size
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ArgumentValueError("loss_chunk_size", f"must be a positive int, got {n!r}")
        from .offload import check_offload_setting

        check_offload_setting(self.offload_activations)
        from .tiled import check_tile_size

        check_tile_size(self.mlp_tile_size)
        check_head_chunks(self.attention_head_chunks)
        self._check_checkpointed_blocks()
        if self.document_exchange is not None:
            check_choice("document_exchange", self.document_exchange, DOCUMENT_EXCHANGES)

    def _check_checkpointed_blocks(self) -> None:
        n = self.checkpointed_blocks
        if n is None:
            return
        check_number("checkpointed_blocks", n, low=0, integer=True, optional=True, hint=" (None: every block)")
        ac = self.activation_checkpointing
        if ac not in ("selective", "full"):
            why = ": 'auto' chooses the count itself" if ac == "auto" else ""
            raise ArgumentValueError(
                "checkpointed_blocks",
                f"needs activation_checkpointing 'selective' or 'full' (the mode of those blocks), got {ac!r}{why}",
            )
        if self.offload_activations:
            raise ArgumentValueError(
                "checkpointed_blocks", "cannot be set with offload_activations (offload keeps every block checkpointed)"
            )

    def defaults_for(self, device_type: Optional[str], *, fusable: bool = True) -> "ParallelPlan":
        """This plan with the settings it leaves to the run (None) decided: the one place of
        the run's defaults. On a CUDA GPU (``device_type="cuda"``) the fastest plan the memory
        model predicts to fit: activation checkpointing "auto" (``longctx.run_plan.resolve_run``
        decides it), pointwise fusion on where the model fuses (``fusable``) and the document
        exchange chosen per batch ("auto"). Elsewhere (a CPU; None: no device, e.g. ``estimate``
        or ``parallelize`` called directly) "none", off and "ring", the plain model. A value
        the plan names is kept."""
        gpu = device_type == "cuda"
        ac = self.activation_checkpointing
        fuse = self.fuse_pointwise
        exchange = self.document_exchange
        return dataclasses.replace(
            self,
            activation_checkpointing=("auto" if gpu else "none") if ac is None else ac,
            fuse_pointwise=(gpu and fusable) if fuse is None else fuse,
            document_exchange=("auto" if gpu else "ring") if exchange is None else exchange,
        )

    def check_decided(self, user: str) -> None:
        """Raise ``ValueError`` (one line) where activation checkpointing is still "auto": what
        ``user`` (``parallelize``, the memory model) applies or counts is one decided mode, and
        "auto" is decided before the model is built (``longctx.run_plan.resolve_run``)."""
        if self.activation_checkpointing == "auto":
            raise ValueError(
                f"{user} needs a decided activation_checkpointing ({', '.join(map(repr, CHECKPOINTING))}), got "
                "'auto': 'auto' is decided before the model is built (longctx.run_plan.resolve_run; "
                "CausalLMModule does it)"
            )

    def check_device(self, device) -> None:
        """Raise ``ValueError`` (one line) where ``attention_backend`` cannot run on ``device``
        (e.g. "fa4" without FlashAttention-4 or off an sm90/sm100 GPU), or ``float8`` (no sm89+
        GPU, or torchao not installed), before any step."""
        from longctx.kernels import backend_refusal

        for name in ("attention_backend", "document_backend"):
            backend = getattr(self, name)
            why = None if backend is None else backend_refusal(backend, device)
            if why is not None:
                raise ArgumentValueError(f"parallel.{name}", f"{backend!r} cannot run on {device}: {why}")
        if self.float8:
            from .float8 import float8_refusal

            why = float8_refusal(device)
            if why is not None:
                raise ArgumentValueError("parallel.float8", f"cannot run on {device}: {why}")

    @classmethod
    def from_dict(cls, d: Union["ParallelPlan", Mapping[str, Any], None]) -> "ParallelPlan":
        if d is None:
            return cls()
        if isinstance(d, cls):
            return d
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ParallelPlan key(s) {unknown}; valid keys: {', '.join(sorted(names))}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ParallelDims:
    """The parallel layout one model is run under (built by the strategy).

    ``data_parallel="fsdp"`` shards parameters, gradients and optimizer state over
    ``fsdp_mesh`` (FSDP2 ``fully_shard``); ``"ddp"`` replicates them (the strategy wraps the
    module); ``"none"``: one process. ``param_dtype`` (e.g. ``torch.bfloat16``) is FSDP2's
    compute dtype: parameters stay fp32 (master weights) and gradients are reduced in fp32.
    ``cpu_offload`` keeps sharded parameters, gradients and optimizer state in host memory.
    """

    cp: CPContext = CPContext()
    data_parallel: str = "none"
    fsdp_mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh
    param_dtype: Optional[torch.dtype] = None
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {self.data_parallel!r}")
        if self.data_parallel == "fsdp" and self.fsdp_mesh is None:
            raise ValueError("data_parallel='fsdp' needs fsdp_mesh (the DeviceMesh to shard over)")
        if self.cpu_offload and self.data_parallel != "fsdp":
            raise ValueError("cpu_offload needs data_parallel='fsdp' (FSDP2 offloads the shards)")


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: instances of the classes its ``_no_split_modules`` names."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def parallelize(
    model: nn.Module, dims: Optional[ParallelDims] = None, plan: Optional[ParallelPlan] = None
) -> nn.Module:
    """Apply the parallel layout and the runtime plan to ``model`` (in place; returns it).

    Order: CP hand-over, runtime policy (checkpointing, fusion, loss chunk), float8 linears
    (``plan.float8``), then FSDP2 (per block, an untied input embedding, then the root, as
    torchtitan does). Call it once,
    from the LightningModule's ``configure_model`` (the strategy calls it for modules that
    don't).
    """
    dims = ParallelDims() if dims is None else dims
    # Settings left to the run (None) that no run resolved: the plain model (defaults_for).
    plan = ParallelPlan.from_dict(plan).defaults_for(None)
    if getattr(model, "_longctx_parallelized", False):
        raise RuntimeError(f"{type(model).__name__} was already parallelized; parallelize() runs once per model")

    cores = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
    for core in cores:
        core.configure(
            cp=dims.cp, kind=plan.cp_attention, backend=plan.attention_backend, document_backend=plan.document_backend
        )
    if not cores:
        _hand_over_to_hf(model, dims.cp, plan)

    _apply_run_settings(model, plan)
    if plan.float8:  # before FSDP2: the float8 weights' all-gather hooks are set up by fully_shard
        from .float8 import convert_to_float8

        convert_to_float8(model, fsdp_all_gather=dims.data_parallel == "fsdp")
    if dims.data_parallel == "fsdp":
        _apply_fsdp(model, dims)
    model._longctx_parallelized = True
    return model


def _hand_over_to_hf(model: nn.Module, cp: CPContext, plan: ParallelPlan) -> None:
    """A Hugging Face model (or a wrapper holding one) loaded with a longctx attention
    implementation gets the CP context through ``longctx.hf``."""
    for m in model.modules():
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if isinstance(impl, str) and impl.startswith("longctx_"):
            if impl != f"longctx_{plan.cp_attention}":
                raise ValueError(
                    f"{type(m).__name__} was loaded with attn_implementation={impl!r} but the plan asks for "
                    f"cp_attention={plan.cp_attention!r}"
                )
            if plan.attention_head_chunks != 1:
                raise ValueError(
                    f"attention_head_chunks={plan.attention_head_chunks} is not supported for "
                    f"Hugging Face models ({type(m).__name__}); leave it at 1"
                )
            from . import hf

            hf.set_context_parallel_group(
                m, cp.group, layout=cp.layout, backend=plan.attention_backend, document_backend=plan.document_backend
            )
            return
    if cp.size > 1:
        raise ValueError(
            f"{type(model).__name__} has no ContextParallelAttention module and no Hugging Face model "
            "loaded with attn_implementation='longctx_ring': nothing in it would run context-parallel"
        )


def _apply_run_settings(model: nn.Module, plan: ParallelPlan) -> None:
    """The plan's settings that change how the model runs, not its layout (checkpointing,
    fusion, loss chunk, offload, MLP tiling, attention head chunks), through the model's setters."""
    plan.check_decided("parallelize")
    ac = plan.activation_checkpointing
    blocks = plan.checkpointed_blocks
    setter = getattr(model, "set_activation_checkpointing", None)
    if blocks is not None and (setter is None or "blocks" not in inspect.signature(setter).parameters):
        raise ValueError(f"{type(model).__name__} does not support checkpointed_blocks")
    if setter is not None:
        setter(ac, **({} if blocks is None else {"blocks": blocks}))
    elif ac != "none":
        raise ValueError(f"{type(model).__name__} does not support activation_checkpointing={ac!r}")
    if hasattr(model, "set_pointwise_fusion"):
        model.set_pointwise_fusion(plan.fuse_pointwise)
    elif plan.fuse_pointwise:
        raise ValueError(f"{type(model).__name__} does not support fuse_pointwise")
    if hasattr(model, "loss_chunk_size"):
        model.loss_chunk_size = plan.loss_chunk_size
    elif plan.loss_chunk_size != ParallelPlan.loss_chunk_size:
        raise ValueError(f"{type(model).__name__} does not support loss_chunk_size (it has no chunked loss)")
    if hasattr(model, "offload_activations"):
        model.offload_activations = plan.offload_activations
    elif plan.offload_activations:
        raise ValueError(f"{type(model).__name__} does not support offload_activations")
    if hasattr(model, "set_mlp_tile_size"):
        model.set_mlp_tile_size(plan.mlp_tile_size)
    elif plan.mlp_tile_size is not None:
        raise ValueError(f"{type(model).__name__} does not support mlp_tile_size")
    cores = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
    if not cores and plan.attention_head_chunks != 1 and not _loaded_for_longctx(model):
        raise ValueError(
            f"{type(model).__name__} does not support attention_head_chunks (it has no ContextParallelAttention)"
        )
    for core in cores:
        core.configure(head_chunks=plan.attention_head_chunks)


def _loaded_for_longctx(model: nn.Module) -> bool:
    """A Hugging Face model (or a wrapper of one) on a longctx attention implementation,
    which ``parallelize`` checks itself."""
    return any(
        isinstance(getattr(getattr(m, "config", None), "_attn_implementation", None), str)
        and m.config._attn_implementation.startswith("longctx_")
        for m in model.modules()
    )


def _apply_fsdp(model: nn.Module, dims: ParallelDims) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": dims.fsdp_mesh}
    if dims.param_dtype is not None:
        # cast_forward_inputs=False: the fp32 RoPE tables handed to every block must stay fp32
        # (bf16 cos/sin lose the positions of long sequences); activations come out of bf16
        # parameters in bf16 anyway.
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=dims.param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    if dims.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(
            f"data_parallel='fsdp' shards {type(model).__name__} per block, but it names no block classes "
            "in `_no_split_modules`"
        )
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by the backward: keep them.
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kwargs)
    embedding = _untied_embedding(model)
    if embedding is not None:
        # Used first and differentiated last: resharded in between, so no block's backward
        # holds the unsharded (vocab x n_embd) table. A tied one is the head too: it stays
        # with the root. (The head stays with the root: as a unit of its own its fp32
        # reduce-scatter input would stay alive through the last block's backward, the peak.)
        fully_shard(embedding, **kwargs)
    fully_shard(model, **kwargs)


def _untied_embedding(model: nn.Module) -> Optional[nn.Module]:
    """The input embedding (``get_input_embeddings()``, as Hugging Face models and ``GPT``
    name it) where its weight is not the output head's; else None."""

    def call(name):
        getter = getattr(model, name, None)
        try:
            return getter() if callable(getter) else None
        except NotImplementedError:  # transformers' base class, for models without one
            return None

    embedding, head = call("get_input_embeddings"), call("get_output_embeddings")
    if embedding is None or head is None or getattr(embedding, "weight", None) is getattr(head, "weight", None):
        return None  # no head (GPT's tied embedding) or a tied one
    return embedding
