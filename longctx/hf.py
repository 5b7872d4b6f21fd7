"""Hugging Face models on longctx ring (or Ulysses) attention, through transformers' own seam.

``import longctx.hf`` registers two attention implementations with transformers'
``AttentionInterface`` (and a matching entry in ``AttentionMaskInterface``):

* ``"longctx_ring"``    -> ``longctx.ring_attention``
* ``"longctx_ulysses"`` -> ``longctx.ulysses_attention``

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="longctx_ring")
    longctx.hf.set_context_parallel_group(model, group, layout="zigzag")   # None: plain
    logits = model(input_ids=ids_local, position_ids=pos_local).logits      # global positions

The mask entry returns ``None`` for "no padding" (transformers' flash-attention entry,
which never builds a 4-D mask): the kernels mask causally by themselves, and an O(S^2)
mask could not be sharded anyway. Whatever the kernels cannot honour is refused with an
error naming the model class and the feature, never dropped: sliding windows shorter than
the (global) sequence, logit soft-capping, attention sinks, additive attention biases,
non-causal modules, padding or custom masks, packed sequences described by position ids
(any that are not the layout's global positions; ``longctx.position_ids`` gives them) or
by ``cu_seq_lens_*`` (pass ``document_ids`` instead), attention dropout while training,
``output_attentions``, and a KV cache longer than the query (generation). Errors that
depend on one rank's data are agreed on across the group, so every rank raises and none
waits in the ring.

``document_ids`` (int, ``(B, S_local)``, sharded like ``input_ids``): passed as
``model(..., document_ids=...)``, transformers forwards unknown keyword arguments from the
model's ``forward`` through every decoder layer to the attention function, which hands them
to ``ring_attention(document_ids=...)``.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask
except ImportError as e:
    raise ImportError(
        "longctx.hf needs transformers >= 4.53 (AttentionInterface and "
        f"AttentionMaskInterface): pip install 'longctx[hf]' ({e})"
    ) from None

from .layouts import check_layout
from .layouts import position_ids as global_positions
from .ring import ring_attention
from .ulysses import ulysses_attention

RING = "longctx_ring"
ULYSSES = "longctx_ulysses"
_ATTENTION = {RING: ring_attention, ULYSSES: ulysses_attention}
# Attribute every submodule of a model gets from set_context_parallel_group.
_CONTEXT_ATTR = "_longctx_context_parallel"
# Keyword arguments that mean "packed sequences" in transformers' flash-attention path.
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class ContextParallelContext:
    """The CP context of one model: process group (None = plain attention), layout, backend."""

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        layout: str,
        backend: str,
        model_name: Optional[str] = None,
        document_backend: Optional[str] = None,
    ):
        self.group, self.layout, self.backend = group, layout, backend
        self.document_backend = document_backend  # None: ``backend`` for document-masked calls too
        self.model_name = model_name  # for error messages
        self.world_size = 1 if group is None else dist.get_world_size(group)
        # The position_ids tensor last checked (see _check_data).
        self.checked_positions: Callable[[], Optional[torch.Tensor]] = lambda: None

    def __deepcopy__(self, memo: dict) -> "ContextParallelContext":
        return self  # a copied model runs in the same group (process groups cannot be copied)

    def __repr__(self) -> str:
        return f"ContextParallelContext(world_size={self.world_size}, layout={self.layout!r}, backend={self.backend!r})"


_PLAIN = ContextParallelContext(None, "zigzag", "auto")


def _accepts(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def set_context_parallel_group(
    model: torch.nn.Module,
    group: Optional[dist.ProcessGroup],
    layout: str = "zigzag",
    *,
    backend: str = "auto",
    document_backend: Optional[str] = None,
) -> None:
    """Run ``model``'s attention over ``group`` with sequences sharded by ``layout``.

    ``group=None`` (or a group of size 1): plain local attention through the same kernels.
    The model must have been loaded with ``attn_implementation="longctx_ring"`` or
    ``"longctx_ulysses"``. Features the ring cannot honour that the model's config or
    modules already reveal are refused here; the rest at the first forward.
    ``backend`` is passed on to ``ring_attention(backend=...)``; ``document_backend`` (None:
    ``backend``) instead where the call carries document ids.
    """
    check_layout(layout)
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    name = type(model).__name__
    if implementation not in _ATTENTION:
        raise ValueError(
            f"{name} runs attn_implementation={implementation!r}; load it with "
            f"attn_implementation={RING!r} (or {ULYSSES!r}) after `import longctx.hf`"
        )
    if getattr(config, "is_causal", True) is False:
        raise ValueError(
            f"{name}: config.is_causal=False (bidirectional attention) is not supported "
            f"by {implementation}, which is causal only"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"{name}: attention logit soft-capping (attn_logit_softcapping={softcap}) "
            f"is not supported by {implementation}"
        )
    context = ContextParallelContext(group, layout, backend, name, document_backend)
    for module in model.modules():
        # Every submodule: which modules call the attention function is the model's business.
        setattr(module, _CONTEXT_ATTR, context)
        if getattr(module, "is_causal", True) is False:
            raise ValueError(
                f"{type(module).__name__} in {name} is not causal (is_causal=False); "
                f"{implementation} supports causal self-attention only"
            )
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise ValueError(
                f"{type(module).__name__} in {name} has attention sinks, which {implementation} does not support"
            )


def _refuse(module: torch.nn.Module, implementation: str, feature: str) -> None:
    model_name = getattr(module, _CONTEXT_ATTR, _PLAIN).model_name
    where = type(module).__name__ + (f" in {model_name}" if model_name else "")
    raise ValueError(f"{where}: {feature} is not supported by attn_implementation={implementation!r}")


def _data_problem(
    context: ContextParallelContext,
    attention_mask: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    has_documents: bool,
) -> Optional[str]:
    """What this rank's inputs ask for that the kernels cannot do, or None."""
    if attention_mask is not None:
        kind = "a padding" if attention_mask.dim() == 2 else f"a custom {attention_mask.dim()}-D"
        return f"{kind} attention_mask (an all-ones mask or none is fine; packed documents take document_ids)"
    if has_documents or position_ids is None:
        return None  # with documents, positions may restart per document: RoPE only
    # transformers reads any jump in the position ids as a packed-document boundary, and
    # the ring orders tokens by the layout: positions must be exactly that order.
    if context.world_size == 1:
        if bool((position_ids.diff(dim=-1) != 1).any()):
            return (
                "position_ids that are not consecutive (transformers reads a jump as a "
                "packed-document boundary); packed documents take document_ids"
            )
        return None
    rank = dist.get_rank(context.group)
    expected = global_positions(
        position_ids.shape[-1] * context.world_size,
        rank=rank,
        world_size=context.world_size,
        layout=context.layout,
        device=position_ids.device,
    )
    if not bool((position_ids == expected).all()):
        return (
            f"position_ids that are not this rank's global positions (rank {rank} of "
            f"{context.world_size}, layout {context.layout!r}: longctx.position_ids(seq_len, "
            "rank=, world_size=, layout=)); per-document positions need document_ids"
        )
    return None


def _check_data(
    module: torch.nn.Module,
    context: ContextParallelContext,
    implementation: str,
    attention_mask: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    has_documents: bool,
) -> None:
    """Checks that depend on this rank's data, agreed on by the whole group: a rank raising
    alone would leave the others waiting in the ring. Once per forward (every layer gets
    the same position_ids tensor), so it costs one host sync and one tiny all-reduce."""
    if attention_mask is None and position_ids is not None and context.checked_positions() is position_ids:
        return
    problem = _data_problem(context, attention_mask, position_ids, has_documents)
    if context.world_size > 1:
        device = torch.device("cpu")
        if dist.get_backend(context.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        failed = torch.tensor([problem is not None], dtype=torch.int32, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=context.group)
        if failed.item() and problem is None:
            problem = (
                "inputs another rank of the context-parallel group rejected (its error says why); every rank stops here"
            )
    if problem is not None:
        _refuse(module, implementation, problem)
    if position_ids is not None:
        context.checked_positions = weakref.ref(position_ids)


def _attention_forward(
    implementation: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[torch.Tensor] = None,
    document_ids: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (B, Hq, S, D), k/v (B, Hkv, S, D) ->
    (out (B, S, Hq, D), no weights)."""
    context: ContextParallelContext = getattr(module, _CONTEXT_ATTR, _PLAIN)
    # Features of the model and call (the same on every rank) first, then the data.
    if softcap is not None:
        _refuse(module, implementation, f"attention logit soft-capping (softcap={softcap})")
    if s_aux is not None:
        _refuse(module, implementation, "attention sinks (s_aux)")
    if kwargs.get("position_bias") is not None:
        _refuse(module, implementation, "an additive attention bias (position_bias)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal or getattr(getattr(module, "config", None), "is_causal", True) is False:
        _refuse(module, implementation, "non-causal attention (is_causal=False)")
    if dropout:
        _refuse(module, implementation, f"attention dropout ({dropout}) in training mode")
    if output_attentions:
        _refuse(module, implementation, "output_attentions=True (no attention weights are formed)")
    packing = [k for k in _PACKING_KWARGS if kwargs.get(k) is not None]
    if packing:
        _refuse(module, implementation, f"packed sequences through {packing}; pass document_ids instead")
    if key.shape[2] != query.shape[2]:
        _refuse(
            module,
            implementation,
            f"a KV cache (queries {query.shape[2]}, keys {key.shape[2]}: "
            "generation); pass use_cache=False or generate with 'sdpa'",
        )
    global_len = query.shape[2] * context.world_size
    if sliding_window is not None and sliding_window < global_len:
        _refuse(
            module,
            implementation,
            f"a sliding window of {sliding_window} tokens shorter than the sequence "
            f"({global_len} tokens); windows >= the sequence length are exact full attention",
        )
    _check_data(module, context, implementation, attention_mask, position_ids, document_ids is not None)
    attention = _ATTENTION[implementation]
    extra = {}
    if document_ids is not None:
        if not _accepts(attention, "document_ids"):
            raise NotImplementedError(
                f"{attention.__name__} in this longctx has no document_ids "
                f"parameter yet; {type(module).__name__} got document_ids"
            )
        extra["document_ids"] = document_ids
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # HF (B, H, S, D) -> (B, S, H, D)
    out = attention(
        q,
        k,
        v,
        group=context.group,
        causal=True,
        layout=context.layout,
        softmax_scale=scaling if scaling is not None else module.scaling,
        backend=(context.document_backend or context.backend) if document_ids is not None else context.backend,
        **extra,
    )
    return out, None


def _ring_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    return _attention_forward(RING, module, *args, **kwargs)


def _ulysses_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    return _attention_forward(ULYSSES, module, *args, **kwargs)


for _name, _forward in ((RING, _ring_forward), (ULYSSES, _ulysses_forward)):
    AttentionInterface.register(_name, _forward)
    # None when there is no padding, the 2-D mask otherwise (refused above): never O(S^2).
    AttentionMaskInterface.register(_name, flash_attention_mask)

__all__ = ["RING", "ULYSSES", "ContextParallelContext", "set_context_parallel_group"]
