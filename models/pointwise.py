"""The per-token elementwise chains of the GPT: RMSNorm (``rms_norm``, and ``lean_rms_norm``
whose backward keeps only its input and one fp32 ``rstd`` per token), rotary embeddings
(``rope_cos_sin``, ``apply_rope``) and the SwiGLU gate; and their fusion (``fused``: one
torch.compile per chain, what ``fuse_pointwise`` turns on). gpt.py builds the blocks from
them."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---- fusion -----------------------------------------------------------------------------
# Eager RMSNorm, RoPE and the SwiGLU gate are chains of small elementwise kernels, each a
# full pass over the activations (profiled on H200: ~30% of a 350M step at 32K tokens).
# With fusion on, each chain runs through torch.compile as one or two kernels, forward
# and backward. Attention (with its ring communication) is never compiled.
COMPILE_BACKEND = "inductor"
_compiled: dict = {}


def fused(fn):
    """``fn`` through torch.compile, compiled once per (function, backend)."""
    key = (fn, COMPILE_BACKEND)
    if key not in _compiled:
        _compiled[key] = _explain_compile_failure(torch.compile(fn, backend=COMPILE_BACKEND))
    return _compiled[key]


def _explain_compile_failure(compiled):
    """A compiler that cannot run here (no C++/CUDA toolchain, ...) fails on the first call
    deep inside torch.compile; say which setting asked for it and how to turn it off."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    def call(*args):
        try:
            return compiled(*args)
        except (BackendCompilerFailed, InductorError) as e:
            raise RuntimeError(
                "fuse_pointwise=True compiles RMSNorm/RoPE/SwiGLU with torch.compile, which "
                f"failed on this machine ({type(e).__name__}); set fuse_pointwise: false "
                "(--model.parallel.fuse_pointwise false) to run them eagerly"
            ) from e

    return call


# ---- RMSNorm and the SwiGLU gate ---------------------------------------------------------


def _norm_dtype(x: torch.Tensor) -> torch.dtype:
    # At least fp32 (bf16 squares lose too much); fp64 stays fp64, so float64 runs are exact.
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 or wider, then return to the input dtype before the gain, as Llama does.
    xf = x.to(_norm_dtype(x))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class _LeanRMSNorm(torch.autograd.Function):
    """``rms_norm`` with the same forward ops (bit-identical output) whose backward needs only
    ``x`` and the per-token ``rstd``, where plain autograd keeps an fp32 copy of ``x`` (``x``
    itself when fp32) and the normalised tensor. The backward recomputes the normalised
    tensor and computes in fp32 (fp64 for fp64 inputs)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(_norm_dtype(x))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        xhat = x.to(rstd.dtype) * rstd  # the forward's normalised values, recomputed
        c = torch.promote_types(rstd.dtype, dy.dtype)  # an fp64 gain makes dy fp64
        dy = dy.to(c)
        dx = dw = None
        if want_w:
            # The gain multiplied the normalised tensor rounded to x's dtype: differentiate that.
            dw = (dy * xhat.to(x.dtype).to(c)).sum_to_size(weight.shape).to(weight.dtype)
        if want_x:
            g = dy * weight.to(c)
            dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
            dx = dx.sum_to_size(x.shape).to(x.dtype)  # a gain with more dims broadcast x
        return dx, dw, None


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` saving only ``x`` and one fp32 value per token for the backward."""
    return _LeanRMSNorm.apply(x, weight, eps)


def swiglu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fuse_pointwise = False

    def function(self):
        """``fn(x, weight, eps)``: compiled with fusion on, else the memory-lean Function."""
        return fused(rms_norm) if self.fuse_pointwise else lean_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function()(x, self.weight, self.eps)


# ---- rotary embeddings ------------------------------------------------------------------


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Optional[dict] = None, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Per-pair inverse frequencies (fp32, ``head_dim // 2``), scaling applied."""
    if scaling is not None and scaling["type"] == "ntk":
        theta = theta * scaling["factor"] ** (head_dim / (head_dim - 2))
    # Same expression as Hugging Face's Llama, so imported checkpoints match bit for bit.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is not None and scaling["type"] == "linear":
        inv_freq = inv_freq / scaling["factor"]
    return inv_freq


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, scaling: Optional[dict] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (fp32, ``(B or 1, S, 1, head_dim // 2)``) for the given global positions only."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (S,) or (B, S), got shape {tuple(position_ids.shape)}")
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=position_ids.device)
    # fp32 angles: positions up to 2**24 are exact, far beyond any sequence here.
    angles = position_ids.float()[..., None] * inv_freq
    return angles.cos().unsqueeze(2), angles.sin().unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, S, H, D) in Llama/HF's half-split layout (pairs are i and i + D/2)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
