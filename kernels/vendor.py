"""Vendor attention kernels through PyTorch's SDPA ops that also return the LSE.

  "flash": aten._scaled_dot_product_flash_attention(+_backward)  (FlashAttention-2)
  "cudnn": aten._scaled_dot_product_cudnn_attention(+_backward)  (cuDNN fused attention)

The ops take (B, H, S, D); our (B, S, H, D) tensors are passed as transposed *views*
(no copies: both kernels read arbitrary batch/seq/head strides with a unit last stride).
Both return the log-sum-exp in natural log, fp32: flash as (B, H, Sq), cuDNN as
(B, H, Sq, 1). GPU-only; tests/kernels/test_vendor_kernels.py checks them against float64.

Limits (why the ring prefers "triton" where it measures as fast):
  * outputs come in the input dtype only; out_dtype / grad_dtype = fp32 are casts of a
    bf16/fp16 result, not extra precision.
  * backward recomputes delta = rowsum(dO * O) itself and so needs `out`.
"""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten

# GQA: FlashAttention-2 handles Hq = g * Hkv natively (it reduces dK/dV over the group
# itself). For cuDNN we expand K/V to Hq heads and sum dK/dV over each group afterwards:
# extra memory traffic, acceptable for a vendor fallback. benchmarks/attention.py probes
# whether this torch build takes Hkv < Hq through cuDNN directly and records it.
NATIVE_GQA = {"flash": True, "cudnn": False}
_WHICH = ("flash", "cudnn")


def _check_which(which: str) -> None:
    if which not in _WHICH:
        raise ValueError(f"vendor backend must be one of {_WHICH}, got {which!r}")


@functools.lru_cache(maxsize=None)
def _probe(device_index: int, which: str) -> bool:
    """Run the op once on a tiny input: the only reliable test that this build, GPU and
    library version support it (flash needs sm80+, cuDNN attention needs cuDNN 9)."""
    try:
        x = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16, device=torch.device("cuda", device_index))
        out, lse = forward(x, x, x, True, 0.125, None, which=which)
        torch.cuda.synchronize(device_index)
        return bool(torch.isfinite(lse).all())
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False


def is_available(device, which: str) -> bool:
    _check_which(which)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if which == "cudnn" and (torch.version.hip is not None or not torch.backends.cudnn.is_available()):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _probe(index, which)


def _check(q, k, v, which):
    _check_which(which)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the {which!r} backend needs float16/bfloat16 inputs, got {q.dtype}")
    if not q.is_cuda:
        raise ValueError(f"the {which!r} backend runs on CUDA devices only, got {q.device}")


def _unit_last(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _expand_kv(k, group):
    # (B, S, Hkv, D) -> (B, S, Hkv*group, D) with q head h reading kv head h // group.
    return k if group == 1 else k.repeat_interleave(group, dim=2)


def _reduce_group(dk, group):
    if group == 1:
        return dk
    B, S, H, D = dk.shape
    return dk.reshape(B, S, H // group, group, D).sum(dim=3)


def _bhsd(t):
    return _unit_last(t).transpose(1, 2)


def forward(q, k, v, causal, softmax_scale, out_dtype=None, *, which):
    """(out (B, Sq, Hq, D), lse fp32 (B, Hq, Sq) natural log) from the vendor kernel."""
    _check(q, k, v, which)
    Sq = q.shape[1]
    group = q.shape[2] // k.shape[2]
    if not NATIVE_GQA[which]:
        k, v = _expand_kv(k, group), _expand_kv(v, group)
    with torch.cuda.device(q.device):
        if which == "flash":
            out, lse = aten._scaled_dot_product_flash_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, bool(causal), False, scale=float(softmax_scale)
            )[:2]
        else:
            out, lse = aten._scaled_dot_product_cudnn_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, bool(causal), False, scale=float(softmax_scale)
            )[:2]
    out = out.transpose(1, 2)  # back to (B, Sq, Hq, D); a view
    if out_dtype is not None and out_dtype != out.dtype:
        out = out.to(out_dtype)  # vendor kernels write the input dtype only
    # flash: (B, H, Sq) (older builds padded Sq); cuDNN: (B, H, Sq, 1).
    lse = lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :Sq].float()
    return out, lse


def backward(dout, q, k, v, out, lse, causal, softmax_scale, delta=None, grad_dtype=None, *, which):
    """(dq, dk, dv); `delta` is ignored (the kernels recompute it from `out`)."""
    _check(q, k, v, which)
    if out is None:
        raise ValueError(f"the {which!r} backend needs `out` in backward (it computes delta itself)")
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    group = Hq // k.shape[2]
    k_in, v_in = (k, v) if NATIVE_GQA[which] else (_expand_kv(k, group), _expand_kv(v, group))
    out = out.to(q.dtype)  # the ring may hand over an fp32 merged output
    dout = dout.to(q.dtype)
    # The kernels index lse densely; a strided view gives wrong results (PyTorch's own
    # context-parallel code makes it contiguous for the same reason).
    lse = lse.float().contiguous()
    scale = float(softmax_scale)
    with torch.cuda.device(q.device):
        if which == "flash":
            # Dense (not varlen) call: cum_seq_* undefined (None); philox tensors are only
            # read when dropout_p > 0.
            empty = torch.empty((), dtype=torch.int64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                _bhsd(dout),
                _bhsd(q),
                _bhsd(k_in),
                _bhsd(v_in),
                _bhsd(out),
                lse,
                None,
                None,
                Sq,
                Sk,
                0.0,
                bool(causal),
                empty,
                empty,
                scale=scale,
            )
        else:
            empty = torch.empty((), dtype=torch.int64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                _bhsd(dout),
                _bhsd(q),
                _bhsd(k_in),
                _bhsd(v_in),
                _bhsd(out),
                lse.unsqueeze(-1),
                empty,
                empty,
                None,
                None,
                None,
                Sq,
                Sk,
                0.0,
                bool(causal),
                scale=scale,
            )
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if not NATIVE_GQA[which]:
        dk, dv = _reduce_group(dk.float(), group), _reduce_group(dv.float(), group)
    grad_dtype = grad_dtype or q.dtype
    return dq.to(grad_dtype), dk.to(grad_dtype), dv.to(grad_dtype)
