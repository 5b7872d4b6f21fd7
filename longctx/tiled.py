"""Sequence-tiled computation of a per-token function: no transient scales with
(tokens x hidden width).

A SwiGLU MLP on T tokens materialises gate, up, silu(gate) and their product: four
T x ffn tensors, saved for the backward (or rebuilt at once by a block's checkpoint
recompute). At 512K tokens and ffn 8192 that is 32 GiB per layer in bf16. A per-token
function needs none of its neighbours, so ``tiled_apply`` runs it over tiles of
``tile_size`` tokens:

* forward, without autograd: each tile's output is written into one output tensor; only
  the input is saved;
* backward: each tile is recomputed with autograd on and differentiated at once
  (``torch.autograd.grad``) against its slice of the incoming gradient; input gradients
  go into their slice, weight gradients are summed over tiles (in fp32 for bf16/fp16
  weights) and returned once, so autograd's ``AccumulateGrad`` (and DDP's or FSDP2's
  hooks on it) runs once per parameter as without tiling.

``tiled_sum`` does the same for a function returning one scalar per tile (the chunked
loss: head, log-softmax and cross-entropy of one chunk of tokens at a time).

Exact: the same ops on the same values (autocast state of the forward is restored for
the recompute); only the weight-gradient sums are split over tiles (float64 tests give
equality to rounding). The same idea as Arctic Long Sequence Training's TiledMLP,
written from the description.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .validation import check_number


def check_tile_size(value: Any) -> None:
    """``mlp_tile_size``: tokens per tile, a positive int, or None (untiled)."""
    check_number("mlp_tile_size", value, low=1, integer=True, optional=True, hint=" (None: untiled)")


def _autocast_state(device_type: str):
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, backward_fn, tile, n_token_args, x, *rest):
        token_args = rest[:n_token_args]
        flat = x.reshape(-1, x.shape[-1])
        args = [a.reshape(-1, *a.shape[x.dim() - 1 :]) for a in token_args]
        n = flat.shape[0]
        ctx.fn, ctx.tile, ctx.n_token_args = backward_fn, tile, n_token_args
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x, *rest)
        weights = rest[n_token_args:]
        outs = None
        with torch.no_grad():
            for start in range(0, n, tile):
                ys = fn(flat[start : start + tile], *(a[start : start + tile] for a in args), *weights)
                ys = ys if isinstance(ys, tuple) else (ys,)
                if outs is None:
                    ctx.single = len(ys) == 1
                    outs = [torch.empty((n, y.shape[-1]), dtype=y.dtype, device=y.device) for y in ys]
                for out, y in zip(outs, ys):
                    out[start : start + y.shape[0]] = y
                del ys
        outs = [out.view(*x.shape[:-1], out.shape[-1]) for out in outs]
        return outs[0] if ctx.single else tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        x, *rest = ctx.saved_tensors
        n = ctx.n_token_args
        want = ctx.needs_input_grad
        gs = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grad_outs]

        def tile_grads(start, ys):
            ys = ys if isinstance(ys, tuple) else (ys,)
            pairs = [(y, g[start : start + y.shape[0]]) for y, g in zip(ys, gs) if g is not None]
            return [y for y, _ in pairs], [g for _, g in pairs]

        dx, dargs, dw = _tiled_backward(ctx, x, rest[:n], rest[n:], want[4], want[5 : 5 + n], want[5 + n :], tile_grads)
        return (None, None, None, None, dx, *dargs, *dw)


def _tiled_backward(ctx, x, token_args, weights, want_x, want_args, want_w, tile_grads):
    """The backward both tiled Functions share: each tile recomputed with autograd on (the
    forward's autocast state restored) and differentiated at once; ``tile_grads(start,
    outputs) -> (outputs, their gradients)``. The gradients of the input and of the token
    arguments are written tile by tile, weight gradients are summed (in fp32 for bf16/fp16
    weights) and returned once. Returns ``(dx or None, [d arg or None, ...], [dw or None, ...])``."""
    fn, tile = ctx.fn, ctx.tile
    flat = x.reshape(-1, x.shape[-1])
    args = [a.reshape(-1, *a.shape[x.dim() - 1 :]) for a in token_args]
    want_args, want_w = list(want_args), list(want_w)
    dx = torch.empty_like(flat) if want_x else None
    dargs = [torch.empty_like(a) if want else None for a, want in zip(args, want_args)]
    dw = [
        torch.zeros_like(w, dtype=torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype)
        if want
        else None
        for w, want in zip(weights, want_w)
    ]
    device_type = x.device.type
    anything = want_x or any(want_args) or any(want_w)
    for start in range(0, flat.shape[0] if anything else 0, tile):
        xt = flat[start : start + tile].detach().requires_grad_(want_x)
        at = [a[start : start + tile].detach().requires_grad_(want) for a, want in zip(args, want_args)]
        wt = [w.detach().requires_grad_(want) for w, want in zip(weights, want_w)]
        with (
            torch.enable_grad(),
            torch.autocast(device_type, dtype=ctx.autocast or torch.bfloat16, enabled=ctx.autocast is not None),
        ):
            ys = fn(xt, *at, *wt)
        outputs, grads_out = tile_grads(start, ys)
        inputs = (
            ([xt] if want_x else [])
            + [a for a, want in zip(at, want_args) if want]
            + [w for w, want in zip(wt, want_w) if want]
        )
        grads = list(torch.autograd.grad(outputs, inputs, grads_out, allow_unused=True))
        for whole, this, want in ((dx, xt, want_x), *zip(dargs, at, want_args)):
            if want:
                got = grads.pop(0)
                whole[start : start + this.shape[0]] = 0 if got is None else got
        for acc, want in zip(dw, want_w):
            if want:
                got = grads.pop(0)
                if got is not None:
                    acc += got
        del ys, outputs, grads
    dargs = [None if g is None else g.view(a.shape) for g, a in zip(dargs, token_args)]
    dw = [None if acc is None else acc.to(w.dtype) for acc, w in zip(dw, weights)]
    return (None if dx is None else dx.view(x.shape)), dargs, dw


def tiled_apply(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    tile_size: int,
    token_args: Sequence[torch.Tensor] = (),
    backward_fn: Optional[Callable[..., torch.Tensor]] = None,
) -> torch.Tensor:
    """``fn(x, *token_args, *weights)`` computed over tiles of ``tile_size`` tokens (all
    leading dims of ``x`` flattened; ``token_args``, e.g. a second per-token input, sliced
    with ``x``'s tokens and differentiated like it), exact, holding one tile's intermediates
    at a time, forward and backward; saves only its arguments. ``fn`` must act on each token
    independently (an MLP, not attention); it returns one tensor or a tuple of them (e.g. the
    q, k, v projections). ``backward_fn``: ``fn`` as the backward recomputes it, where the
    outputs' values are never read, only their graph: it may end in ``grad_only_linear``
    instead of its last matmuls (None: ``fn``)."""
    check_tile_size(tile_size)
    if not spans_tiles(x, tile_size):
        return fn(x, *token_args, *weights)  # one tile: nothing to save
    return _Tiled.apply(fn, backward_fn or fn, tile_size, len(token_args), x, *token_args, *weights)


class _GradOnlyLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, w):
        ctx.save_for_backward(z, w)
        return z.new_empty((*z.shape[:-1], w.shape[0]))

    @staticmethod
    def backward(ctx, grad):
        z, w = ctx.saved_tensors
        dz = grad.matmul(w) if ctx.needs_input_grad[0] else None
        dw = grad.reshape(-1, grad.shape[-1]).t().mm(z.reshape(-1, z.shape[-1])) if ctx.needs_input_grad[1] else None
        return dz, dw


def grad_only_linear(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(z, w)`` (no bias) for a backward's recompute: the graph and the gradients
    of the linear (the same matmuls, in autocast's dtype where it is on), but a forward that
    skips the matmul and returns an uninitialised tensor of the result's shape. Only where
    nothing reads the output's values (a tiled function's last projection, which autograd
    differentiates through without them)."""
    device_type = z.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        z, w = z.to(dtype), w.to(dtype)
    return _GradOnlyLinear.apply(z, w)


def spans_tiles(x: torch.Tensor, tile_size) -> bool:
    """Whether ``tiled_apply`` runs ``x`` over more than one tile of ``tile_size`` tokens
    (else it calls the function once, and autograd saves what the function saves)."""
    return tile_size is not None and x.numel() // max(x.shape[-1], 1) > tile_size


class _TiledSum(torch.autograd.Function):
    """``sum over tiles of fn(x_tile, *token_arg_tiles, *weights)`` (a scalar per tile)."""

    @staticmethod
    def forward(ctx, fn, tile, n_token_args, x, *rest):
        token_args, weights = rest[:n_token_args], rest[n_token_args:]
        ctx.fn, ctx.tile, ctx.n_token_args = fn, tile, n_token_args
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x, *rest)
        flat = x.reshape(-1, x.shape[-1])
        args = [a.reshape(-1, *a.shape[x.dim() - 1 :]) for a in token_args]
        total = None
        with torch.no_grad():
            for start in range(0, flat.shape[0], tile):
                part = fn(flat[start : start + tile], *(a[start : start + tile] for a in args), *weights)
                total = part if total is None else total + part
        return total

    @staticmethod
    def backward(ctx, grad):
        x, *rest = ctx.saved_tensors
        n = ctx.n_token_args
        want = ctx.needs_input_grad
        dx, _, dw = _tiled_backward(
            ctx, x, rest[:n], rest[n:], want[3], [False] * n, want[4 + n :], lambda start, part: ([part], [grad])
        )
        return (None, None, None, dx, *([None] * n), *dw)


def tiled_sum(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    token_args: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    tile_size: int,
) -> torch.Tensor:
    """``sum(fn(x_t, *token_args_t, *weights))`` over tiles of ``tile_size`` tokens, where
    ``fn`` returns a scalar per tile (a loss) and ``token_args`` (e.g. labels) are sliced
    with ``x``'s tokens. Holds one tile's intermediates at a time, forward and backward;
    the input gradient is written tile by tile into one tensor (slicing under autograd
    would allocate a full-size zero gradient per tile)."""
    check_tile_size(tile_size)
    return _TiledSum.apply(fn, tile_size, len(token_args), x, *token_args, *weights)
