"""Triton attention kernels under the CPU interpreter vs a float64 reference.

triton.jit picks interpreter or compiler when a kernel is *decorated*, i.e. when
longctx.kernels.triton_attention is first imported, so an in-process check would depend on
which test module imported it first. Instead this file re-runs itself as a worker process
with TRITON_INTERPRET=1 (`python tests/kernels/test_triton_kernels.py`, the tile set in
LONGCTX_TRITON_INTERP_TILES), which runs every case and prints one JSON line of errors;
pytest starts two workers in parallel with different tile shapes (BLOCK_M > BLOCK_N and
BLOCK_M < BLOCK_N in every kernel, so both band splits and ragged tails are covered) and
asserts per case.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers.attention_reference import reference
from helpers.interpreter_harness import interpreted_results as run_interpreted
from helpers.interpreter_harness import print_results

# name: (B, Sq, Sk, Hq, Hkv, D, causal, dtype, options)
# options: out32 (out_dtype fp32), grad32 (grad_dtype fp32), delta (precomputed delta,
# out=None), slice (q/k/v/dout are seq-dim slices of larger tensors), atomic (dQ by atomics)
CASES = {
    "causal_ragged_d16_fp32": (1, 37, 37, 2, 2, 16, True, "float32", ()),
    "causal_gqa_d64_fp32": (2, 50, 50, 4, 2, 64, True, "float32", ()),
    "full_mqa_sq_ne_sk_fp32": (1, 37, 50, 4, 1, 16, False, "float32", ()),
    "full_short_keys_fp32": (1, 29, 5, 2, 2, 16, False, "float32", ()),
    "causal_len1_fp32": (1, 1, 1, 2, 1, 16, True, "float32", ()),
    "full_pad_d24_fp32": (1, 33, 21, 2, 1, 24, False, "float32", ()),
    "causal_d128_fp32": (1, 40, 40, 1, 1, 128, True, "float32", ()),
    "full_d256_fp32": (1, 19, 23, 1, 1, 256, False, "float32", ()),
    "causal_delta_given_fp32": (1, 45, 45, 4, 2, 32, True, "float32", ("delta",)),
    "full_sliced_inputs_fp32": (2, 31, 40, 4, 2, 16, False, "float32", ("slice",)),
    "causal_sliced_inputs_fp32": (1, 48, 48, 2, 1, 16, True, "float32", ("slice",)),
    "causal_atomic_dq_fp32": (1, 37, 37, 4, 2, 16, True, "float32", ("atomic",)),
    "full_atomic_dq_fp32": (1, 29, 45, 2, 1, 32, False, "float32", ("atomic",)),
    "full_fp16": (1, 64, 48, 2, 1, 64, False, "float16", ()),
    "causal_gqa_fp16": (2, 50, 50, 4, 2, 64, True, "float16", ()),
    "causal_fp16_fp32_out_grads": (1, 37, 37, 2, 1, 16, True, "float16", ("out32", "grad32")),
}
TILE_SETS = ("32x16,16x32,32x16", "16x32,32x16,16x32")
TOL = {"float32": 1e-5, "float16": 2e-2}


def _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, sliced, gen):
    def make(S, H):
        if not sliced:
            return torch.randn(B, S, H, D, generator=gen).to(dtype)
        # A seq-dim slice of a longer buffer with padded rows (the ring passes k[:, :half]
        # and similar views): storage offset and non-packed strides.
        full = torch.randn(B, S + 7, H, D + 8, generator=gen).to(dtype)
        return full[:, 3 : 3 + S, :, :D]

    q, k, v, dout = make(Sq, Hq), make(Sk, Hkv), make(Sk, Hkv), make(Sq, Hq)
    assert not sliced or not (q.is_contiguous() or k.is_contiguous() or dout.is_contiguous())
    return q, k, v, dout


def _rel(got, want):
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    if want.norm() < 1e-12:  # exactly-zero gradient (one key per row): absolute error
        return (got - want).abs().max().item()
    return ((got - want).norm() / want.norm()).item()


def run_case(name):
    from longctx.kernels import attention_backward, attention_delta, attention_forward, triton_attention

    B, Sq, Sk, Hq, Hkv, D, causal, dtype_name, opts = CASES[name]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q, k, v, dout = _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, "slice" in opts, gen)
    scale = D**-0.5
    out_dtype = torch.float32 if "out32" in opts else None
    grad_dtype = torch.float32 if "grad32" in opts else None
    triton_attention.BWD_MODE = "atomic" if "atomic" in opts else "split"

    out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=scale, backend="triton", out_dtype=out_dtype)
    delta = None
    out_arg = out
    extra = {}
    if "delta" in opts:
        # The ring's once-per-layer delta (fused Triton pass), checked against float64.
        delta = attention_delta(out, dout, backend="triton")
        extra["delta"] = _rel(delta, (dout.double() * out.double()).sum(-1).transpose(1, 2))
        out_arg = None
    dq, dk, dv = attention_backward(
        dout,
        q,
        k,
        v,
        out_arg,
        lse,
        causal=causal,
        softmax_scale=scale,
        backend="triton",
        delta=delta,
        grad_dtype=grad_dtype,
    )
    want = reference(q, k, v, dout, causal, scale)
    got = (out, lse, dq, dk, dv)
    dtypes_ok = (
        out.dtype == (out_dtype or dtype)
        and lse.dtype == torch.float32
        and all(g.dtype == (grad_dtype or dtype) for g in (dq, dk, dv))
        and lse.shape == (B, Hq, Sq)
        and dk.shape == k.shape
        and dq.shape == q.shape
    )
    errs = {n: _rel(g, w) for n, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want)}
    errs.update(extra)
    return {"errs": errs, "dtypes_ok": bool(dtypes_ok)}


@pytest.fixture(scope="module")
def interpreted_results():
    return run_interpreted(__file__, TILE_SETS)


@pytest.mark.parametrize("tiles", TILE_SETS)
@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreted_vs_float64(interpreted_results, name, tiles):
    res = interpreted_results[tiles][name]
    assert "error" not in res, res.get("error")
    assert res["dtypes_ok"], f"{name}: wrong output dtype or shape"
    tol = TOL[CASES[name][7]]
    bad = {k: e for k, e in res["errs"].items() if not e < tol}  # NaN/inf fail too
    assert not bad, f"{name} (tiles {tiles}): norm-relative errors above {tol}: {bad}"


def test_input_validation():
    """Bad shapes are rejected with errors naming the problem (no kernel launch needed)."""
    pytest.importorskip("triton")
    from longctx.kernels import triton_attention as ta

    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 3, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ta.forward(q, k, k, False, 0.25)
    k = torch.randn(1, 6, 2, 16)
    with pytest.raises(ValueError, match="aligned block"):
        ta.forward(q, k, k, True, 0.25)
    with pytest.raises(ValueError, match="head_dim"):
        big = torch.randn(1, 8, 2, 512)
        ta.forward(big, big, big, False, 0.1)
    with pytest.raises(TypeError, match="dtype"):
        x = torch.randn(1, 8, 2, 16, dtype=torch.float64)
        ta.forward(x, x, x, False, 0.25)


def test_choose_backend_table(monkeypatch):
    """auto: CPU always gets the reference; CUDA walks the measured table by availability."""
    from longctx.kernels import selection

    assert selection.choose_backend("cpu", torch.bfloat16, 128, 4096, 4096, True) == "torch"
    available = {"fa4": False, "cudnn": False, "flash": True, "triton": True}
    monkeypatch.setattr(selection, "_available", lambda name, device: available.get(name, False))
    monkeypatch.setattr(selection, "_takes_shape", lambda name, device, dtype, d: d != 96 or name != "fa4")
    cuda = torch.device("cuda", 0)

    def first(dtype, d, seq, causal):
        """What the table's rows say for this call, before availability."""
        rows = [
            r
            for r in selection.TABLE
            if dtype in r[0] and (r[1] is None or d in r[1]) and seq >= r[2] and (r[3] is None or r[3] == causal)
        ]
        return rows[0][4]

    for args in (
        (torch.bfloat16, 128, 4096, True),
        (torch.bfloat16, 64, 131072, True),
        (torch.float16, 64, 1024, False),
        (torch.float32, 128, 4096, True),
    ):
        want = next((n for n in first(*args) if available[n]), "torch")
        assert selection.choose_backend(cuda, args[0], args[1], args[2], args[2], args[3]) == want
    available.update(fa4=True, cudnn=True)
    preference = first(torch.bfloat16, 128, 65536, True)
    assert selection.choose_backend(cuda, torch.bfloat16, 128, 65536, 65536, True) == preference[0]
    assert selection.choose_backend(cuda, torch.float64, 128, 64, 64, False) == "torch"
    available.update(fa4=False, cudnn=False, flash=False, triton=False)
    assert selection.choose_backend(cuda, torch.float16, 64, 8192, 8192, False) == "torch"


if __name__ == "__main__":
    print_results(CASES, run_case)


def test_attention_delta_dispatch():
    """The ring's once-per-layer delta: skipped (None) for the vendor kernels, which
    recompute it; the reference path equals rowsum(dout * out) in float64; bad input named."""
    from longctx.kernels import attention_delta

    g = torch.Generator().manual_seed(3)
    out, dout = torch.randn(2, 9, 4, 16, generator=g), torch.randn(2, 9, 4, 16, generator=g)
    assert attention_delta(out, dout, backend="cudnn") is None
    assert attention_delta(out, dout, backend="flash") is None
    assert attention_delta(out, dout, backend="fa4") is None
    got = attention_delta(out, dout, backend="torch")
    want = (out.double() * dout.double()).sum(-1).transpose(1, 2)
    assert got.shape == (2, 4, 9) and got.dtype == torch.float32 and got.is_contiguous()
    assert _rel(got, want) < 1e-6
    with pytest.raises(ValueError, match="backend"):
        attention_delta(out, dout, backend="auto")
    with pytest.raises(ValueError, match="differs"):
        attention_delta(out, dout[:, :8], backend="torch")
