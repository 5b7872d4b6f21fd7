"""Triton flash-attention kernels (FlashAttention-2 structure) for one ring step.

Layout (B, S, H, D) with arbitrary strides (the ring hands in seq-dim slices and reads
partials back through views), GQA by index arithmetic (kv head = q head // group; K/V are
never repeated), causal = aligned diagonal block (Sq == Sk, q_i sees k_j for j <= i).

  forward:  one program per (query tile, batch*q-head). Off-diagonal key tiles run
            unmasked; the diagonal band (and ragged key tail) runs masked; nothing above
            the diagonal is touched. Online softmax in base 2 (scores pre-scaled by
            log2(e)), lse returned in natural log, fp32 (B, Hq, Sq).
  backward: delta = rowsum(dO * O) by a small preprocess kernel (unless given), then
            "split" mode (default, deterministic): a dK/dV kernel, one program per
            (key tile, batch*kv-head) looping over the group's query heads and query
            tiles (the GQA reduction happens in registers), and a dQ kernel, one program
            per (query tile, batch*q-head) looping over key tiles. "atomic" mode computes
            dQ inside the dK/dV kernel and adds it with fp32 atomics (5 instead of 7
            matmuls per tile pair, not bitwise deterministic). Select with the environment
            variable LONGCTX_TRITON_BWD=split|atomic or by setting `BWD_MODE`; the
            benchmark measures both.

This module is the Python side: the checks, allocations and launches (forward(),
backward(), compute_delta()). The kernels it launches are in triton_attention_fwd.py,
triton_attention_dkdv.py (delta and dK/dV) and triton_attention_dq.py; a launch here and
its kernel's signature share argument order, constexpr names and tile conventions, so
change them together.

Document masking (q/k document ids): the same tile helpers and configs (triton_tiles.py,
shared by both), kernels that visit only the tiles a block map lists: the maps in
triton_document.py, the kernels in triton_document_{fwd,dkdv,dq}.py, their launches in
triton_document_launch.py (forward()/backward() below hand over to it).

LONGCTX_TRITON_AUTOTUNE=0 restricts every kernel to the first config of its list (GPU tests:
one compile per variant instead of one per candidate).

Under TRITON_INTERPRET=1 (read when triton_tiles.py is imported: triton.jit picks
interpreter or compiler at decoration time) the kernels run on CPU tensors with one small
fixed config, which is what the CPU tests exercise.
"""

import contextlib
import os

import torch

from .triton_attention_dkdv import delta_kernel, dkdv_atomic, dkdv_atomic_tma, dkdv_split
from .triton_attention_dq import dq_tuned
from .triton_attention_fwd import fwd_kernel
from .triton_tiles import INTERPRET, LOG2E, block_d, length_bucket, tl, triton

try:  # host-side TMA descriptors (triton >= 3.4); used for dQ reduce-adds on Hopper+
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # noqa: BLE001 - older triton or no triton
    TensorDescriptor = None

# Backward flavour: "split" (dK/dV kernel + dQ kernel, deterministic) or "atomic".
BWD_MODE = os.environ.get("LONGCTX_TRITON_BWD", "split")

# ----------------------------------------------------------------------------- python API

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_available(device) -> bool:
    """True where these kernels can run: CUDA/ROCm devices, or CPU in interpreter mode."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        # The interpreter is chosen when the kernels are decorated (module import).
        return INTERPRET
    return False


def tma_available(device: torch.device) -> bool:
    """TMA reduce-add for dQ: Hopper+ CUDA, a triton with host tensor descriptors and
    descriptor atomics, compiled mode. Elsewhere the atomic mode uses pointer atomics."""
    return (
        TensorDescriptor is not None
        and not INTERPRET
        and device.type == "cuda"
        and torch.version.hip is None
        and hasattr(tl, "tensor_descriptor")
        and hasattr(tl.tensor_descriptor, "atomic_add")
        and torch.cuda.get_device_capability(device)[0] >= 9
        and os.environ.get("LONGCTX_TRITON_TMA", "1") != "0"
    )


def _device_guard(t: torch.Tensor):
    # Triton launches on the *current* CUDA device; make it the tensors' device.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    # Any strides work except a non-unit stride on head_dim (it would defeat vector loads).
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_qkv(q, k, v, causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} not supported (float16, bfloat16, float32)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if D > 256:
        raise ValueError(f"head_dim {D} > 256 is not supported by the triton backend")
    if causal and Sq != k.shape[1]:
        raise ValueError(f"causal attention needs an aligned block (Sq == Sk), got Sq={Sq}, Sk={k.shape[1]}")
    if B * Hq >= 65536:
        raise ValueError(f"batch*heads = {B * Hq} exceeds the CUDA grid limit (65535)")
    if not is_available(q.device):
        raise RuntimeError(
            f"triton attention is not available on {q.device}"
            + (" (set TRITON_INTERPRET=1 before import for CPU)" if q.device.type == "cpu" else "")
        )


def forward(q, k, v, causal, softmax_scale, out_dtype=None, q_doc=None, k_doc=None):
    """(out (B, Sq, Hq, D) in out_dtype or q.dtype, lse fp32 (B, Hq, Sq), natural log).
    q_doc / k_doc: document ids (B, Sq) / (B, Sk) (validated by the seam) or None."""
    _check_qkv(q, k, v, causal)
    if out_dtype is None:
        out_dtype = q.dtype
    if out_dtype not in _DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not supported")
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = torch.empty((B, Sq, Hq, D), dtype=out_dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if Sk == 0:  # no keys: empty softmax, the merge treats lse = -inf as "no contribution"
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    q, k, v = _last_dim_unit(q), _last_dim_unit(k), _last_dim_unit(v)
    if q_doc is not None:
        from . import triton_document_launch

        with _device_guard(q):
            triton_document_launch.launch_forward(q, k, v, out, lse, q_doc, k_doc, causal, float(softmax_scale) * LOG2E)
        return out, lse

    def grid(meta):
        return (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)

    with _device_guard(q):
        fwd_kernel[grid](
            q,
            k,
            v,
            out,
            lse,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride(),
            *lse.stride(),
            Hq,
            Hq // Hkv,
            Sq,
            Sk,
            float(softmax_scale) * LOG2E,
            length_bucket(Sq),
            length_bucket(Sk),
            HEAD_DIM=D,
            BLOCK_D=block_d(D),
            CAUSAL=bool(causal),
        )
    return out, lse


def compute_delta(out, dout):
    """rowsum(dout * out) in fp32, (B, Hq, Sq): one pass over both (any float dtypes)."""
    if out.shape != dout.shape or out.dim() != 4:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must be equal (B, S, H, D)")
    B, Sq, Hq, _ = out.shape
    if out.numel() == 0:
        return torch.zeros((B, Hq, Sq), dtype=torch.float32, device=out.device)
    with _device_guard(out):
        return _compute_delta(_last_dim_unit(out), _last_dim_unit(dout), (B, Hq, Sq))


def _compute_delta(out, dout, lse_shape):
    B, Sq, Hq, D = out.shape
    delta = torch.empty(lse_shape, dtype=torch.float32, device=out.device)
    block_m = 16 if INTERPRET else 64
    grid = (triton.cdiv(Sq, block_m), B * Hq)
    delta_kernel[grid](
        out,
        dout,
        delta,
        *out.stride(),
        *dout.stride(),
        *delta.stride(),
        Hq,
        Sq,
        HEAD_DIM=D,
        BLOCK_D=block_d(D),
        BLOCK_M=block_m,
    )
    return delta


def backward(dout, q, k, v, out, lse, causal, softmax_scale, delta=None, grad_dtype=None, q_doc=None, k_doc=None):
    """(dq, dk, dv) in grad_dtype (None -> q.dtype). dK/dV are reduced over GQA groups.
    q_doc / k_doc: document ids as in forward()."""
    grad_dtype = _check_backward(dout, q, k, v, out, lse, causal, delta, grad_dtype)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    dk = torch.empty((B, Sk, Hkv, D), dtype=grad_dtype, device=q.device)
    dv = torch.empty_like(dk)
    if Sq == 0 or Sk == 0 or B * Hq == 0:
        return (torch.zeros((B, Sq, Hq, D), dtype=grad_dtype, device=q.device), dk.zero_(), dv.zero_())

    # The kernels multiply dO with V and Q tiles: one dtype for all (a no-op normally).
    dout = dout.to(q.dtype)
    q, k, v, dout = (_last_dim_unit(t) for t in (q, k, v, dout))
    lse = lse.float()
    with _device_guard(q):
        if delta is None:
            delta = _compute_delta(_last_dim_unit(out), dout, (B, Hq, Sq))
        else:
            delta = delta.float()
        scales = (float(softmax_scale), float(softmax_scale) * LOG2E)
        docs = None if q_doc is None else (q_doc, k_doc)
        if BWD_MODE == "atomic":
            dq = _backward_atomic(q, k, v, dout, lse, delta, dk, dv, causal, scales, docs, grad_dtype)
        else:
            dq = _backward_split(q, k, v, dout, lse, delta, dk, dv, causal, scales, docs, grad_dtype)
    return dq, dk, dv


def _check_backward(dout, q, k, v, out, lse, causal, delta, grad_dtype):
    """The arguments' checks; returns grad_dtype resolved (None -> q.dtype)."""
    _check_qkv(q, k, v, causal)
    B, Sq, Hq, D = q.shape
    if dout.shape != q.shape:
        raise ValueError(f"dout shape {tuple(dout.shape)} != q shape {tuple(q.shape)}")
    if tuple(lse.shape) != (B, Hq, Sq):
        raise ValueError(f"lse must be (B, Hq, Sq) = {(B, Hq, Sq)}, got {tuple(lse.shape)}")
    if delta is None and out is None:
        raise ValueError("backward needs `out` (or a precomputed `delta`)")
    if delta is not None and tuple(delta.shape) != (B, Hq, Sq):
        raise ValueError(f"delta must be (B, Hq, Sq) = {(B, Hq, Sq)}, got {tuple(delta.shape)}")
    if grad_dtype is None:
        grad_dtype = q.dtype
    if grad_dtype not in _DTYPES:
        raise TypeError(f"grad_dtype {grad_dtype} not supported")
    if BWD_MODE not in ("split", "atomic"):
        raise ValueError(f"BWD_MODE must be 'split' or 'atomic', got {BWD_MODE!r}")
    return grad_dtype


def _backward_atomic(q, k, v, dout, lse, delta, dk, dv, causal, scales, docs, grad_dtype):
    """ "atomic" mode: one dK/dV kernel that also adds dQ into an fp32 buffer with atomics
    (TMA reduce-adds where available); returns dq in grad_dtype."""
    B, Sq, Hq, D = q.shape
    if tma_available(q.device) and D % 4 == 0:
        # (B, Hq, Sq, D) so that each head's rows are one contiguous 2D block.
        dq_acc = torch.zeros((B, Hq, Sq, D), dtype=torch.float32, device=q.device)
        desc = TensorDescriptor(
            dq_acc.view(B * Hq * Sq, D), [B * Hq * Sq, D], [D, 1], [16, 16]
        )  # box set per config by triton_tiles.with_dq_desc_hook
        dq_view = dq_acc.transpose(1, 2)
        flavour, tma = "atomic_tma", True
    else:
        dq_acc = torch.zeros((B, Sq, Hq, D), dtype=torch.float32, device=q.device)
        desc, dq_view, tma = dq_acc, dq_acc, False
        flavour = "atomic"
    _run_dkdv(
        flavour, q, k, v, dout, lse, delta, dk, dv, dq_view, desc, causal, scales, docs, dq_atomic=True, dq_tma=tma
    )
    return dq_view.to(grad_dtype, memory_format=torch.contiguous_format)


def _backward_split(q, k, v, dout, lse, delta, dk, dv, causal, scales, docs, grad_dtype):
    """ "split" mode (deterministic): the dK/dV kernel, then the dQ kernel; returns dq."""
    B, Sq, Hq, D = q.shape
    dq = torch.empty((B, Sq, Hq, D), dtype=grad_dtype, device=q.device)
    # dq is passed as the unused DQ / DQ_DESC arguments of the split dK/dV kernel.
    _run_dkdv("split", q, k, v, dout, lse, delta, dk, dv, dq, dq, causal, scales, docs, dq_atomic=False, dq_tma=False)
    if docs is None:
        _launch_dq(q, k, v, dout, lse, delta, dq, causal, *scales)
    else:
        from . import triton_document_launch

        triton_document_launch.launch_dq(q, k, v, dout, lse, delta, dq, *docs, causal, *scales)
    return dq


def _run_dkdv(flavour, q, k, v, dout, lse, delta, dk, dv, dq, dq_desc, causal, scales, docs, *, dq_atomic, dq_tma):
    """The dK/dV kernel of this flavour ("split", "atomic", "atomic_tma"): the dense one,
    or with document ids (`docs`) the document-masked one over its block map."""
    if docs is None:
        kernel = {"split": dkdv_split, "atomic": dkdv_atomic, "atomic_tma": dkdv_atomic_tma}[flavour]
        _launch_dkdv(kernel, q, k, v, dout, lse, delta, dk, dv, dq, dq_desc, causal, *scales, dq_atomic, dq_tma)
        return
    from . import triton_document_dkdv, triton_document_launch

    kernel = {
        "split": triton_document_dkdv.document_dkdv_split,
        "atomic": triton_document_dkdv.document_dkdv_atomic,
        "atomic_tma": triton_document_dkdv.document_dkdv_atomic_tma,
    }[flavour]
    triton_document_launch.launch_dkdv(
        kernel,
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk,
        dv,
        dq,
        dq_desc,
        *docs,
        causal,
        *scales,
        dq_atomic=dq_atomic,
        dq_tma=dq_tma,
    )


def _launch_dkdv(kernel, q, k, v, dout, lse, delta, dk, dv, dq, dq_desc, causal, sm_scale, qk_scale, dq_atomic, dq_tma):
    """A dense dK/dV kernel, one program per (key tile, batch*kv-head)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]

    def grid(meta):
        return (triton.cdiv(Sk, meta["BLOCK_N"]), B * Hkv)

    kernel[grid](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk,
        dv,
        dq,
        dq_desc,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *lse.stride(),
        *delta.stride(),
        *dk.stride(),
        *dv.stride(),
        *dq.stride(),
        Hkv,
        Hq // Hkv,
        Sq,
        Sk,
        sm_scale,
        qk_scale,
        length_bucket(Sq),
        length_bucket(Sk),
        DQ_ATOMIC=dq_atomic,
        DQ_TMA=dq_tma,
        HEAD_DIM=D,
        BLOCK_D=block_d(D),
        CAUSAL=bool(causal),
    )


def _launch_dq(q, k, v, dout, lse, delta, dq, causal, sm_scale, qk_scale):
    """The dense dQ kernel of "split" mode, one program per (query tile, batch*q-head)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]

    def grid(meta):
        return (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)

    dq_tuned[grid](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *lse.stride(),
        *delta.stride(),
        *dq.stride(),
        Hq,
        Hq // Hkv,
        Sq,
        Sk,
        sm_scale,
        qk_scale,
        length_bucket(Sq),
        length_bucket(Sk),
        HEAD_DIM=D,
        BLOCK_D=block_d(D),
        CAUSAL=bool(causal),
    )
