"""Attention block kernels: the seam between the ring and the kernels.

``attention_forward`` / ``attention_backward`` compute one (Q block) x (KV block)
attention and its gradients, returning the fp32 log-sum-exp the ring needs to merge
blocks. They know nothing of process groups.

Backends (``backend=``): ``"torch"`` (reference, any device), ``"triton"`` (our
kernels; CUDA/ROCm, or the CPU under ``TRITON_INTERPRET=1``), ``"cudnn"`` and
``"flash"`` (PyTorch's SDPA ops that return the LSE), ``"fa4"`` (FlashAttention-4, the
optional ``longctx[fa4]``; sm90/sm100, fa4.py), and ``"auto"``.

Document masking: ``q_document_ids`` / ``k_document_ids`` (int tensors ``(B, Sq)`` /
``(B, Sk)``, both or neither) restrict query i to keys j with the same id (and j <= i
when ``causal``). A query row that sees no key in a block gets ``out = 0`` and
``lse = -inf`` (the ring's merge treats that as "no contribution"). Backends with ids:
"fa4" (documents as varlen runs), "triton" (triton_document*.py: tiles of no shared document
are skipped, tiles inside one document run unmasked) and "torch"; "auto" picks fa4, else
triton, on GPUs, and "cudnn"/"flash" fall back to triton with a warning (see
select_backend). fa4 hands a block whose ids are not runs it can express to triton. Callers that
resolve the backend once for several blocks (the ring) pass ``documents=True`` to ``resolve_backend``;
``select_backend`` answers the same question from shapes alone (a run's plan, before any tensor).

``segments=`` (``kernels.segments.Segments``, with the ids): the block's varlen segments,
built once by the caller (``longctx.documents``) for every layer; fa4 then reads nothing
back to the host (without them it cuts the ids into runs itself, one device-to-host copy
per call). The other backends mask with the ids.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Optional

import torch

from .segments import Segments

__all__ = [
    "Segments",
    "attention_forward",
    "attention_backward",
    "attention_delta",
    "document_block_forward",
    "document_block_backward",
    "accumulator_dtype",
    "partial_dtype",
    "check_attention_inputs",
    "check_document_ids",
    "resolve_backend",
    "select_backend",
    "backend_refusal",
    "BACKENDS",
    "VENDOR_BACKENDS",
]

BACKENDS = ("torch", "triton", "cudnn", "flash", "fa4")
# Kernels that write only the input dtype (an fp32 partial is a cast) and compute
# delta = rowsum(dO * O) inside their backward from `out` (a given delta is ignored).
VENDOR_BACKENDS = ("cudnn", "flash", "fa4")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Backend name -> module in this package. Modules are imported on first use so that a
# machine without triton (or a torch without the vendor ops) can still use the others.
_MODULES = {"torch": "reference", "triton": "triton_attention", "cudnn": "vendor", "flash": "vendor", "fa4": "fa4"}


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> None:
    """Raise TypeError/ValueError naming the problem for inputs the kernels cannot take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected one of bf16, fp16, fp32, fp64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim differs: q has {q.shape[3]}, k/v have {k.shape[3]}")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal attention needs aligned blocks (equal lengths); got q length {q.shape[1]} "
            f"and k/v length {k.shape[1]}"
        )


def check_document_ids(q: torch.Tensor, k: torch.Tensor, q_document_ids, k_document_ids):
    """Validate a block's document ids; returns them (or (None, None))."""
    if q_document_ids is None and k_document_ids is None:
        return None, None
    if q_document_ids is None or k_document_ids is None:
        raise ValueError("document masking needs both q_document_ids and k_document_ids (or neither)")
    for name, ids, t in (("q_document_ids", q_document_ids, q), ("k_document_ids", k_document_ids, k)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {ids.dtype}")
        if tuple(ids.shape) != tuple(t.shape[:2]):
            raise ValueError(f"{name} must be (batch, seq) = {tuple(t.shape[:2])}, got shape {tuple(ids.shape)}")
        if ids.device != t.device:
            raise ValueError(f"{name} is on {ids.device}, the attention inputs on {t.device}")
    return q_document_ids, k_document_ids


_LOADED: dict = {}


def _module(backend: str):
    mod = _LOADED.get(backend)
    if mod is None:
        mod = _LOADED[backend] = importlib.import_module(f".{_MODULES[backend]}", __name__)
    return mod


def backend_available(backend: str, device: torch.device) -> bool:
    try:
        mod = _module(backend)
    except ImportError:
        return False
    if backend in ("cudnn", "flash"):  # one module, two kernels
        return mod.is_available(device, backend)
    return mod.is_available(device)


def backend_refusal(backend: str, device) -> Optional[str]:
    """Why ``backend`` cannot run on ``device`` at all (install, GPU), or None. "auto" never
    refuses: it picks among what runs."""
    if backend == "auto":
        return None
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; expected 'auto' or one of {BACKENDS}"
    device = torch.device(device)
    if backend == "fa4":
        try:
            return _module("fa4").unavailable_reason(device)
        except ImportError as error:  # numpy or torch pieces missing: report, never crash
            return f"FlashAttention-4 backend does not import: {error}"
    return None if backend_available(backend, device) else f"attention backend {backend!r} is not available on {device}"


def _fa4_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why "fa4" cannot run blocks of this device, dtype and head dim (install or shape), or None."""
    return backend_refusal("fa4", device) or _module("fa4").unsupported_shape(device, dtype, head_dim)


def select_backend(
    backend: str,
    device,
    dtype: torch.dtype,
    head_dim: int,
    seq_len_q: int,
    seq_len_k: int,
    causal: bool,
    *,
    documents: bool = False,
) -> str:
    """The concrete backend for blocks of this device, dtype, head dim and lengths; ``"auto"``
    picks from recorded measurements (selection.py's table). ``resolve_backend`` asks it per
    call; ``longctx.run_plan`` once per run for each block kind, and hands the answer down.

    ``documents=True`` (the blocks carry document ids): "auto" picks "fa4" where it runs
    (varlen runs), else "triton" on GPUs; an explicit "cudnn"/"flash" falls back to "triton"
    (or "torch" where triton is not available) with a warning: PyTorch's vendor ops take no
    per-token mask. An explicit backend that cannot run here raises one line saying why.
    """
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cpu":
            return "torch"
        if documents:
            if _fa4_refusal(device, dtype, head_dim) is None:
                return "fa4"
            # Triton covers D <= 256 in fp16/bf16/fp32; anything else takes the reference.
            fits = head_dim <= 256 and dtype != torch.float64
            return "triton" if fits and backend_available("triton", device) else "torch"
        from .selection import choose_backend

        backend = choose_backend(device, dtype, head_dim, seq_len_q, seq_len_k, causal)
        return backend if backend_available(backend, device) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected 'auto' or one of {BACKENDS}")
    if backend == "fa4":
        why = _fa4_refusal(device, dtype, head_dim)
        if why is not None:
            raise ValueError(f"attention backend 'fa4' cannot run here: {why}")
        return backend
    if not backend_available(backend, device):
        raise ValueError(f"attention backend {backend!r} is not available on device {device}")
    if documents and backend in ("cudnn", "flash"):
        fallback = _document_fallback(device)
        warnings.warn(
            f"attention backend {backend!r} takes no document mask; document-masked blocks run on {fallback!r}",
            stacklevel=4,
        )
        return fallback
    return backend


def resolve_backend(backend: str, q: torch.Tensor, k: torch.Tensor, causal: bool, *, documents: bool = False) -> str:
    """``select_backend`` for these inputs (``documents=True``: the call carries document ids)."""
    return select_backend(backend, q.device, q.dtype, q.shape[-1], q.shape[1], k.shape[1], causal, documents=documents)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """What partial results of ``dtype`` inputs are merged and accumulated in (fp32, fp64 for fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def partial_dtype(backend: str, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The ``out_dtype`` / ``grad_dtype`` to ask a resolved ``backend`` for: the accumulator
    dtype from ours (written at no extra pass); None (the input dtype) from the vendor kernels,
    which only write that, and whose partials the merge/accumulate kernels upcast while
    reading (asking them for fp32 would only add a cast pass)."""
    return None if backend in VENDOR_BACKENDS else accumulator_dtype(dtype)


def _document_fallback(device: torch.device) -> str:
    return "triton" if backend_available("triton", device) else "torch"


def _check_segments(segments, docs, q, k, causal) -> None:
    if segments is None:
        return
    if not isinstance(segments, Segments):
        raise TypeError(f"segments must be a longctx.kernels.Segments, got {type(segments).__name__}")
    if docs[0] is None:
        raise ValueError(
            "segments go with q_document_ids / k_document_ids (the kernels without varlen support mask with the ids)"
        )
    segments.check(q, k, causal)


def _scale(softmax_scale: Optional[float], head_dim: int) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    out_dtype: Optional[torch.dtype] = None,
    q_document_ids: Optional[torch.Tensor] = None,
    k_document_ids: Optional[torch.Tensor] = None,
    segments: Optional[Segments] = None,
):
    """Block attention. Returns ``(out, lse)``; lse is fp32 ``(B, Hq, Sq)``, natural log.

    ``out_dtype`` (default: q's dtype) lets the ring ask for fp32 partials so merging
    many blocks loses nothing to bf16 rounding. ``q/k_document_ids``, ``segments``: see
    the module doc.
    """
    check_attention_inputs(q, k, v, causal=causal)
    docs = check_document_ids(q, k, q_document_ids, k_document_ids)
    _check_segments(segments, docs, q, k, causal)
    name = resolve_backend(backend, q, k, causal, documents=docs[0] is not None)
    scale = _scale(softmax_scale, q.shape[-1])
    mod = _module(name)
    if name == "fa4" and segments is not None:
        return mod.forward_segments(q, k, v, causal, scale, out_dtype, segments)
    if docs[0] is not None:
        result = mod.forward(q, k, v, causal, scale, out_dtype, *docs)
        if result is None:  # fa4: ids that varlen runs cannot express
            result = _module(_document_fallback(q.device)).forward(q, k, v, causal, scale, out_dtype, *docs)
        return result
    if name in ("cudnn", "flash"):
        return mod.forward(q, k, v, causal, scale, out_dtype, which=name)
    return mod.forward(q, k, v, causal, scale, out_dtype)


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: Optional[torch.Tensor],
    lse: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    delta: Optional[torch.Tensor] = None,
    grad_dtype: Optional[torch.dtype] = None,
    q_document_ids: Optional[torch.Tensor] = None,
    k_document_ids: Optional[torch.Tensor] = None,
    segments: Optional[Segments] = None,
):
    """Gradients ``(dq, dk, dv)`` of one block from the FINAL out/lse of the whole row.

    ``delta`` = rowsum(dout * out) (fp32, ``(B, Hq, Sq)``) may be passed precomputed (the
    ring computes it once per layer); then ``out`` may be None. dK/dV are summed over
    each query-head group (GQA). ``grad_dtype`` defaults to the input dtype.
    """
    check_attention_inputs(q, k, v, causal=causal)
    if dout.shape != q.shape:
        raise ValueError(f"dout shape {tuple(dout.shape)} differs from q shape {tuple(q.shape)}")
    if out is None and delta is None:
        raise ValueError("attention_backward needs `out` or a precomputed `delta`")
    docs = check_document_ids(q, k, q_document_ids, k_document_ids)
    _check_segments(segments, docs, q, k, causal)
    name = resolve_backend(backend, q, k, causal, documents=docs[0] is not None)
    scale = _scale(softmax_scale, q.shape[-1])
    mod = _module(name)
    if name == "fa4" and segments is not None:
        return mod.backward_segments(dout, q, k, v, out, lse, causal, scale, grad_dtype, segments)
    if docs[0] is not None:
        grads = mod.backward(dout, q, k, v, out, lse, causal, scale, delta, grad_dtype, *docs)
        if grads is None:  # fa4: ids that varlen runs cannot express (same test as forward)
            grads = _module(_document_fallback(q.device)).backward(
                dout, q, k, v, out, lse, causal, scale, delta, grad_dtype, *docs
            )
        return grads
    if name in ("cudnn", "flash"):
        return mod.backward(dout, q, k, v, out, lse, causal, scale, delta, grad_dtype, which=name)
    return mod.backward(dout, q, k, v, out, lse, causal, scale, delta, grad_dtype)


def document_block_forward(name: str, q, k, v, causal: bool, scale: float, out_dtype, q_ids, k_ids, segments):
    """``attention_forward`` of one call of a document plan, for a backend ``name`` that
    ``resolve_backend`` already gave for these inputs: the plan built the call's rows, ids and
    segments together, so nothing is checked again (the layer's host time is per call)."""
    scale = _scale(scale, q.shape[-1])
    if name == "fa4":
        return _module("fa4").forward_segments(q, k, v, causal, scale, out_dtype, segments)
    return _module(name).forward(q, k, v, causal, scale, out_dtype, q_ids, k_ids)


def document_block_backward(
    name: str, dout, q, k, v, out, lse, causal: bool, scale: float, grad_dtype, q_ids, k_ids, segments
):
    """``attention_backward`` of one call of a document plan (see ``document_block_forward``)."""
    scale = _scale(scale, q.shape[-1])
    if name == "fa4":
        return _module("fa4").backward_segments(dout, q, k, v, out, lse, causal, scale, grad_dtype, segments)
    return _module(name).backward(dout, q, k, v, out, lse, causal, scale, None, grad_dtype, q_ids, k_ids)


def attention_delta(out: torch.Tensor, dout: torch.Tensor, *, backend: str) -> Optional[torch.Tensor]:
    """``rowsum(dout * out)`` as fp32 ``(B, Hq, Sq)`` for ``attention_backward(delta=...)``,
    or None where ``backend`` (already resolved) recomputes it inside its own kernel.

    The ring computes delta once per layer instead of once per block. The vendor kernels
    (VENDOR_BACKENDS) take ``out`` and ignore a given delta, so for them the (fp32,
    several passes) computation would be pure memory traffic: it is skipped. Triton: one
    fused pass; "torch": the reference expression.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (resolved), got {backend!r}")
    if out.shape != dout.shape:
        raise ValueError(f"out shape {tuple(out.shape)} differs from dout shape {tuple(dout.shape)}")
    if backend in VENDOR_BACKENDS:
        return None
    if backend == "triton":
        return _module("triton").compute_delta(out, dout)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()
