"""The eager RMSNorm's autograd Function (``lean_rms_norm``): the same forward as ``rms_norm``
bit for bit, its gradients against plain autograd (float64) and a float64 reference (bf16,
CPU autocast), broadcast gains, frozen inputs, NaN propagation, and that it saves only the
input and one fp32 value per token."""

from __future__ import annotations

import pytest
import torch

from longctx.models import RMSNorm
from longctx.models.pointwise import lean_rms_norm, rms_norm

EPS = 1e-5


def _inputs(x_shape, w_shape, x_dtype, w_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(x_shape, dtype=torch.float64, generator=g)).to(x_dtype)
    w = (1 + 0.5 * torch.randn(w_shape, dtype=torch.float64, generator=g)).to(w_dtype)
    out_shape = torch.broadcast_shapes(x_shape, w_shape)
    dy = torch.randn(out_shape, dtype=torch.float64, generator=g)
    return x, w, dy


def _run(fn, x, w, dy, want=(True, True)):
    x = x.detach().requires_grad_(want[0])
    w = w.detach().requires_grad_(want[1])
    y = fn(x, w, EPS)
    inputs = [t for t, need in zip((x, w), want) if need]
    grads = torch.autograd.grad(y, inputs, dy.to(y.dtype))
    return (y, *grads)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "x_shape,w_shape",
    [
        ((4, 9, 16), (16,)),
        ((4, 9, 16), (1, 1, 16)),
        ((9, 16), (3, 1, 16)),  # the gain broadcasts x: dx sums over the extra dim
        ((2, 5, 16), (5, 16)),  # a per-position gain: dweight sums over the batch only
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float64_equals_plain_autograd(x_shape, w_shape, seed):
    x, w, dy = _inputs(x_shape, w_shape, torch.float64, torch.float64, seed)
    want = _run(rms_norm, x, w, dy)
    got = _run(lean_rms_norm, x, w, dy)
    assert torch.equal(got[0], want[0])
    for a, b, name in zip(got[1:], want[1:], ("dx", "dweight")):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < 1e-12, name
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: lean_rms_norm(a, b, EPS), (xs, ws))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_low_precision_against_float64(x_dtype, w_dtype, autocast):
    """Same output as ``rms_norm`` bit for bit (dtype promotion included, autocast or not);
    gradients in the inputs' dtypes, close to the float64 gradient of the same inputs."""
    x, w, dy = _inputs((4, 9, 64), (64,), x_dtype, w_dtype, seed=3)
    ref = _run(rms_norm, x.double(), w.double(), dy)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain = _run(rms_norm, x, w, dy)
        got = _run(lean_rms_norm, x, w, dy)
    assert got[0].dtype == plain[0].dtype and torch.equal(got[0], plain[0])
    assert (got[1].dtype, got[2].dtype) == (x_dtype, w_dtype)
    for a, b, name in zip(got, ref, ("y", "dx", "dweight")):
        assert _rel(a, b) < 1e-2, name


def test_frozen_inputs():
    x, w, dy = _inputs((3, 7, 16), (16,), torch.float64, torch.float64, seed=4)
    _, dx, dw = _run(rms_norm, x, w, dy)
    (gx,) = _run(lean_rms_norm, x, w, dy, want=(True, False))[1:]
    (gw,) = _run(lean_rms_norm, x, w, dy, want=(False, True))[1:]
    assert _rel(gx, dx) < 1e-12 and _rel(gw, dw) < 1e-12


def test_nan_propagates_to_its_token():
    x, w, dy = _inputs((2, 5, 16), (16,), torch.bfloat16, torch.float32, seed=5)
    x[0, 2, 3] = float("nan")
    y, dx, dw = _run(lean_rms_norm, x, w, dy)
    bad = torch.zeros(2, 5, dtype=torch.bool)
    bad[0, 2] = True
    assert y[bad].isnan().all() and dx[bad].isnan().all()
    assert torch.isfinite(y[~bad]).all() and torch.isfinite(dx[~bad]).all()
    assert dw.isnan().all()  # every gain saw the NaN token


def _saved_bytes(fn, *args):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved


def test_saves_only_the_input_and_rstd():
    norm = RMSNorm(32)
    x = torch.randn(4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    tokens = 4 * 64
    saved = _saved_bytes(norm, x)
    act = sum(t.numel() * t.element_size() for t in saved if t is not norm.weight)
    assert any(t is norm.weight for t in saved)  # the parameter, which exists anyway
    assert act <= x.numel() * x.element_size() + 4 * tokens, act
    plain = _saved_bytes(rms_norm, x, norm.weight, norm.eps)
    assert sum(t.numel() * t.element_size() for t in plain if t is not norm.weight) > act
