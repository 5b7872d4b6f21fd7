"""GPU: the cudnn / flash vendor wrappers and the compiled Triton kernels vs float64.

Skipped without CUDA. Shapes are moderate (ragged lengths, GQA, causal and full, Sq != Sk)
so that multi-tile loops, masked tails and the autotuned configs are all exercised.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.attention_reference import reference
from helpers.run_if import requires_cuda

pytestmark = requires_cuda()

# name: (B, Sq, Sk, Hq, Hkv, D, causal)
SHAPES = {
    "causal_ragged_gqa_d128": (2, 1000, 1000, 8, 2, 128, True),
    "causal_d64": (1, 2048, 2048, 4, 4, 64, True),
    "full_sq_ne_sk_gqa_d64": (2, 384, 1000, 8, 2, 64, False),
    "full_mqa_d128": (1, 777, 513, 4, 1, 128, False),
}
BF16_TOL = 2e-2


@pytest.fixture(scope="module", autouse=True)
def single_triton_config():
    """One Triton config per kernel variant (the first of each list): a full autotune would
    compile every candidate for each of the ~20 variants below. benchmarks/attention.py
    checks the tuned configs' correctness before timing them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LONGCTX_TRITON_AUTOTUNE", os.environ.get("LONGCTX_TRITON_AUTOTUNE", "0"))
        yield


def rel(got, want):
    got = got.double()
    assert torch.isfinite(got).all(), "non-finite values"
    return ((got - want).norm() / want.norm()).item()


def make_inputs(B, Sq, Sk, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(B, Sq, Hq, D), mk(B, Sk, Hkv, D), mk(B, Sk, Hkv, D), mk(B, Sq, Hq, D)


def _require(backend):
    from longctx.kernels import triton_attention, vendor

    if backend == "triton":
        if not triton_attention.is_available("cuda"):
            pytest.skip("triton unavailable")
        return
    if vendor.is_available("cuda", backend):
        return
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip(f"{backend} needs sm80+")
    # Should work here: surface the real error instead of skipping it away.
    x = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16, device="cuda")
    vendor.forward(x, x, x, True, 0.125, None, which=backend)
    pytest.fail(f"{backend} reported unavailable but a direct call worked")


def check(backend, shape, dtype=torch.bfloat16, tol=BF16_TOL, out_dtype=None, grad_dtype=None, bwd_mode="split"):
    from longctx.kernels import attention_backward, attention_forward, triton_attention

    _require(backend)
    B, Sq, Sk, Hq, Hkv, D, causal = shape
    q, k, v, dout = make_inputs(B, Sq, Sk, Hq, Hkv, D, dtype)
    scale = D**-0.5
    old_mode = triton_attention.BWD_MODE
    triton_attention.BWD_MODE = bwd_mode
    try:
        out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=scale, backend=backend, out_dtype=out_dtype)
        dq, dk, dv = attention_backward(
            dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend=backend, grad_dtype=grad_dtype
        )
    finally:
        triton_attention.BWD_MODE = old_mode
    want = reference(q, k, v, dout, causal, scale)
    assert lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    assert out.dtype == (out_dtype or dtype) and dq.dtype == (grad_dtype or dtype)
    assert dk.shape == k.shape and dv.shape == v.shape
    errs = {n: rel(g, w) for n, g, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want)}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"{backend} {shape}: errors above {tol}: {bad} (all: {errs})"


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("backend", ["triton", "cudnn", "flash"])
def test_bf16_vs_float64(backend, shape):
    check(backend, SHAPES[shape])


@pytest.mark.parametrize("tma", ["1", "0"], ids=["tma_reduce", "pointer_atomics"])
@pytest.mark.parametrize("shape", ["causal_ragged_gqa_d128", "full_sq_ne_sk_gqa_d64"])
def test_triton_atomic_dq(shape, tma, monkeypatch):
    """dQ by atomics: TMA bulk reduce-add on Hopper+ (falls back to pointer atomics on
    older GPUs), and the pointer-atomic path forced with LONGCTX_TRITON_TMA=0."""
    monkeypatch.setenv("LONGCTX_TRITON_TMA", tma)
    check("triton", SHAPES[shape], bwd_mode="atomic")
    check("triton", SHAPES[shape], bwd_mode="atomic", grad_dtype=torch.float32)


@pytest.mark.parametrize("D", [16, 32, 96, 256])
def test_triton_other_head_dims(D):
    check("triton", (1, 300, 300, 4, 2, D, True))
    check("triton", (1, 200, 333, 2, 1, D, False))


def test_triton_fp32_partials_and_grads():
    check("triton", SHAPES["causal_ragged_gqa_d128"], out_dtype=torch.float32, grad_dtype=torch.float32)


def test_triton_fp32_inputs_exact():
    # fp32 dots run in IEEE fp32 (no tf32), so fp32 inputs meet the fp32 tolerance.
    check("triton", (1, 257, 257, 2, 1, 64, True), dtype=torch.float32, tol=1e-5)
    check("triton", (1, 100, 190, 2, 2, 64, False), dtype=torch.float32, tol=1e-5)


def test_triton_strided_views_and_delta():
    """Seq-dim slices of padded buffers (what the ring passes) and a precomputed delta."""
    from longctx.kernels import triton_attention as ta

    B, S, Hq, Hkv, D = 1, 640, 4, 2, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    big = lambda H: torch.randn(B, S + 64, H, D + 64, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = (big(h)[:, 32 : 32 + S, :, :D] for h in (Hq, Hkv, Hkv, Hq))
    kh, vh = k[:, : S // 2], v[:, : S // 2]  # first KV half, as in zigzag steps s <= r
    scale = D**-0.5
    out, lse = ta.forward(q, kh, vh, False, scale, torch.float32)
    delta = (dout.float() * out).sum(-1).transpose(1, 2).contiguous()
    dq, dk, dv = ta.backward(dout, q, kh, vh, None, lse, False, scale, delta, torch.float32)
    want = reference(q, kh, vh, dout, False, scale)
    for name, got, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        assert rel(got, w) < BF16_TOL, name


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_triton_every_listed_config(kernel, D, monkeypatch):
    """Each config the autotuner may pick (not only the first, which the other tests run)
    on ragged, GQA, causal and Sq != Sk shapes: a config that is fast but wrong at some
    shape would otherwise only show in training."""
    from longctx.kernels import triton_attention as ta
    from longctx.kernels import triton_tiles as tt

    _require("triton")
    table = {"fwd": tt.FWD_CONFIGS, "dkdv": tt.DKDV_CONFIGS, "dq": tt.DQ_CONFIGS}[kernel]
    monkeypatch.setenv("LONGCTX_TRITON_AUTOTUNE", "1")  # the pruner hands over the pinned list
    for cfg in list(table[D]):
        monkeypatch.setitem(table, D, [cfg])
        for tuned in (ta.fwd_kernel, ta.dkdv_split, ta.dq_tuned):
            tuned.cache.clear()
        for shape in ((2, 1000, 1000, 8, 2, D, True), (1, 384, 1000, 4, 1, D, False)):
            try:
                check("triton", shape)
            except AssertionError as e:
                raise AssertionError(f"{kernel} config {cfg}: {e}") from None
    for tuned in (ta.fwd_kernel, ta.dkdv_split, ta.dq_tuned):
        tuned.cache.clear()  # later tests autotune over the restored lists
