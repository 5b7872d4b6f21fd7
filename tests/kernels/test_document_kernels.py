"""Document-masked Triton attention (kernels/triton_document*.py) under the CPU interpreter
vs the float64 "torch" backend with the same document ids, plus the block map on its own.

As in test_triton_kernels.py, the interpreter must be chosen before the kernels are
decorated, so this file re-runs itself as worker processes with TRITON_INTERPRET=1 (one per
tile set, in parallel) and the tests assert on the JSON they print.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from helpers.interpreter_harness import interpreted_results as run_interpreted
from helpers.interpreter_harness import print_results
from helpers.run_if import requires_cuda

from longctx.data.document_mixes import document_id_pattern

# name: (B, Sq, Sk, Hq, Hkv, D, causal, dtype, ids, options)
# ids: how q/k document ids are drawn (longctx.data.document_mixes.document_id_pattern);
# options: atomic (dQ by atomics), slice (q/k/v/dout and the ids are strided views), nan (a
# NaN in one q row), poison
# (K/V of document 0 are NaN: document 1's results stay exact only if the tiles pairing
# the two, all skipped (below the diagonal too), are never touched: a masked visit would
# give 0 * NaN = NaN).
CASES = {
    "causal_one_doc_equals_plain": (1, 45, 45, 2, 1, 16, True, "float32", "one", ()),
    "causal_short_docs_gqa": (2, 50, 50, 4, 2, 16, True, "float32", "short", ()),
    "causal_short_docs_atomic": (1, 50, 50, 4, 2, 16, True, "float32", "short", ("atomic",)),
    "causal_len1_docs": (1, 37, 37, 2, 2, 16, True, "float32", "len1", ()),
    "causal_long_and_len1_mix": (1, 70, 70, 2, 1, 32, True, "float32", "mix", ()),
    "causal_repeated_ids_sliced": (1, 48, 48, 2, 1, 16, True, "float32", "repeat", ("slice",)),
    "full_sq_ne_sk_repeated_ids": (1, 37, 53, 4, 1, 16, False, "float32", "repeat", ()),
    "full_sq_ne_sk_atomic": (2, 29, 45, 2, 1, 32, False, "float32", "short", ("atomic",)),
    "full_rows_without_keys": (1, 40, 33, 2, 1, 16, False, "float32", "disjoint", ()),
    "full_rows_without_keys_atomic": (1, 40, 33, 2, 1, 16, False, "float32", "disjoint", ("atomic",)),
    "causal_nan_in_q": (1, 40, 40, 2, 1, 16, True, "float32", "short", ("nan",)),
    "causal_fp16_short_docs": (1, 64, 64, 2, 1, 64, True, "float16", "short", ()),
    "causal_skipped_tiles_untouched": (1, 64, 64, 2, 1, 16, True, "float32", "halves", ("poison",)),
    "full_skipped_tiles_untouched": (1, 64, 64, 2, 2, 16, False, "float32", "halves", ("poison", "atomic")),
}
TILE_SETS = ("32x16,16x32,32x16", "16x32,32x16,16x32")
TOL = {"float32": 1e-5, "float16": 2e-2}


def _strided(x):
    """x as a seq-dim view of a longer buffer (the ring passes slices): storage offset and
    non-packed strides (the ids too: every other element)."""
    pad = (0, 8, 0, 0, 2, 3) if x.dim() == 4 else (0, 1, 2, 3)  # last dim first
    buf = torch.nn.functional.pad(x.unsqueeze(-1) if x.dim() == 2 else x, pad)
    view = buf[:, 2 : 2 + x.shape[1], ..., : x.shape[-1]] if x.dim() == 4 else buf[:, 2 : 2 + x.shape[1], 0]
    assert torch.equal(view, x) and not view.is_contiguous()
    return view


def _rel(got, want):
    got, want = got.double(), want.double()
    if want.norm() < 1e-12:  # exactly-zero reference: absolute error
        return (got - want).abs().max().item() if got.numel() else 0.0
    return ((got - want).norm() / want.norm()).item()


def run_case(name):
    from longctx.kernels import attention_backward, attention_forward, triton_attention

    B, Sq, Sk, Hq, Hkv, D, causal, dtype_name, kind, opts = CASES[name]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q, dout = (torch.randn(B, Sq, Hq, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Sk, Hkv, D, generator=gen) for _ in range(2))
    q_ids, k_ids = document_id_pattern(kind, B, Sq, Sk, gen)
    if causal:
        k_ids = q_ids
    if "nan" in opts:
        q[0, 21, 1, 3] = float("nan")
    ref = dict(causal=causal, softmax_scale=D**-0.5, backend="torch", q_document_ids=q_ids, k_document_ids=k_ids)
    want_out, want_lse = attention_forward(q.double(), k.double(), v.double(), **ref)
    want_grads = attention_backward(dout.double(), q.double(), k.double(), v.double(), want_out, want_lse, **ref)

    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    if "poison" in opts:
        # Compare document 1 only (its results do not depend on document 0's K/V).
        k[:, :32] = v[:, :32] = float("nan")
        want_out, want_lse = want_out[:, 32:], want_lse[..., 32:]
        want_grads = tuple(g[:, 32:] for g in want_grads)
    if "slice" in opts:
        q, k, v, dout, q_ids, k_ids = (_strided(t) for t in (q, k, v, dout, q_ids, k_ids))
    triton_attention.BWD_MODE = "atomic" if "atomic" in opts else "split"
    args = dict(ref, backend="triton", q_document_ids=q_ids, k_document_ids=k_ids)
    out, lse = attention_forward(q, k, v, **args)
    grads = attention_backward(dout, q, k, v, out, lse, **args)

    result = {
        "shapes_ok": bool(
            out.shape == q.shape and out.dtype == dtype and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
        )
    }
    if "nan" in opts:
        # NaN must show in its own row and stay there (other rows see no NaN key).
        nan_rows = torch.isnan(out).any(-1).any(-1)[0]
        result["nan_ok"] = bool(nan_rows[21] and nan_rows.sum() == 1)
        return result
    if "poison" in opts:
        out, lse, grads = out[:, 32:], lse[..., 32:], tuple(g[:, 32:] for g in grads)
    finite = torch.isfinite(want_lse)
    result["errs"] = {
        "out": _rel(out, want_out),
        "lse": _rel(lse[finite], want_lse[finite]),
        **{n: _rel(g, w) for n, g, w in zip(("dq", "dk", "dv"), grads, want_grads)},
    }
    # Rows that see no key: out exactly 0, lse exactly -inf, gradients 0 (never NaN).
    empty = ~finite
    result["empty_rows"] = int(empty.sum())
    result["empty_ok"] = bool(
        torch.equal(lse[empty], want_lse[empty].float())
        and (out.transpose(1, 2)[empty] == 0).all()
        and (grads[0].transpose(1, 2)[empty] == 0).all()
        and all(torch.isfinite(g).all() for g in grads)
    )
    if kind == "one":
        plain = dict(causal=causal, softmax_scale=D**-0.5, backend="triton")
        out_p, lse_p = attention_forward(q, k, v, **plain)
        grads_p = attention_backward(dout, q, k, v, out_p, lse_p, **plain)
        result["errs"]["vs_plain"] = max(_rel(a, b) for a, b in zip((out, lse, *grads), (out_p, lse_p, *grads_p)))
    return result


@pytest.fixture(scope="module")
def interpreted_results():
    return run_interpreted(__file__, TILE_SETS)


@pytest.mark.parametrize("tiles", TILE_SETS)
@pytest.mark.parametrize("name", list(CASES))
def test_document_attention_vs_float64(interpreted_results, name, tiles):
    res = interpreted_results[tiles][name]
    assert "error" not in res, res.get("error")
    assert res["shapes_ok"], f"{name}: wrong output dtype or shape"
    if "nan_ok" in res:
        assert res["nan_ok"], f"{name}: NaN in q did not show in exactly its own output row"
        return
    tol = TOL[CASES[name][7]]
    bad = {k: e for k, e in res["errs"].items() if not e < tol}  # NaN/inf fail too
    assert not bad, f"{name} (tiles {tiles}): norm-relative errors above {tol}: {bad}"
    assert res["empty_ok"], f"{name}: rows without visible keys are not out=0/lse=-inf/grad=0"
    if CASES[name][8] == "disjoint":
        assert res["empty_rows"] > 0, "the case must contain rows without visible keys"


if __name__ == "__main__":
    print_results(CASES, run_case)


# ----------------------------------------------------------------------------- block map


def _visible(q_ids, k_ids, causal):
    vis = q_ids[:, :, None] == k_ids[:, None, :]
    if causal:
        vis &= torch.ones(q_ids.shape[1], k_ids.shape[1], dtype=torch.bool).tril()
    return vis


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blocks", [(4, 8), (8, 4), (5, 3)])
def test_tile_classes_against_the_mask(causal, blocks):
    """Every pair of tiles: SKIP has no visible pair, FULL has only visible pairs and no
    ragged key tail; on sorted documents the range test is exact (MASKED has both)."""
    pytest.importorskip("triton")
    from longctx.kernels.triton_document import FULL, MASKED, SKIP, tile_classes

    gen = torch.Generator().manual_seed(11 + blocks[0] + 3 * causal)
    S = 97
    lengths = torch.randint(1, 30, (S,), generator=gen)
    ids = torch.repeat_interleave(torch.arange(S), lengths)[:S][None]
    block_q, block_k = blocks
    classes = tile_classes(ids, ids, block_q, block_k, causal)[0]
    nq, nk = classes.shape
    vis = _visible(ids, ids, causal)[0]
    # Per tile: any visible pair / all pairs visible. Rows past the end are inert in every
    # kernel (ignored); keys past the end must be masked (count as invisible).
    any_vis = torch.zeros(nq * block_q, nk * block_k, dtype=torch.bool)
    all_vis = torch.ones(nq * block_q, nk * block_k, dtype=torch.bool)
    any_vis[:S, :S] = vis
    all_vis[:S, :S] = vis
    all_vis[:, S:] = False
    any_vis = any_vis.view(nq, block_q, nk, block_k).any(3).any(1)
    all_vis = all_vis.view(nq, block_q, nk, block_k).all(3).all(1)
    assert not any_vis[classes == SKIP].any()
    assert all_vis[classes == FULL].all()
    assert (any_vis & ~all_vis)[classes == MASKED].all()  # sorted ids: the range test is exact
    counts = {c: int((classes == c).sum()) for c in (SKIP, MASKED, FULL)}
    assert all(counts.values()), counts  # the ids exercise all three classes


def test_tile_classes_repeated_ids_conservative():
    """Non-adjacent repeated ids: the range test may visit a tile with no visible pair
    (masked, still exact), but never skips one that has one."""
    pytest.importorskip("triton")
    from longctx.kernels.triton_document import SKIP, tile_classes

    gen = torch.Generator().manual_seed(5)
    q_ids = torch.randint(0, 4, (2, 40), generator=gen)
    k_ids = torch.randint(2, 7, (2, 33), generator=gen)
    classes = tile_classes(q_ids, k_ids, 8, 4, causal=False)
    vis = _visible(q_ids, k_ids, False)
    for b in range(2):
        for m in range(classes.shape[1]):
            for n in range(classes.shape[2]):
                if classes[b, m, n] == SKIP:
                    assert not vis[b, m * 8 : (m + 1) * 8, n * 4 : (n + 1) * 4].any()
    # q tiles whose ids are all < 2 see no key tile: nothing to visit.
    q_ids[0, :8] = 0
    assert (tile_classes(q_ids, k_ids, 8, 4, causal=False)[0, 0] == SKIP).all()


def test_block_map_compression():
    """Per row: full tiles first, then masked ones, each ascending; counts match; rows
    launch longest first; the key-major map is the transpose (dK/dV visits exactly the
    pairs the forward visits)."""
    pytest.importorskip("triton")
    from longctx.kernels.triton_document import FULL, SKIP, build_block_map, compress

    classes = torch.tensor([[[2, 0, 1, 2, 0], [0, 0, 0, 0, 0], [1, 1, 2, 0, 2]]], dtype=torch.int8)
    bmap = compress(classes)
    assert bmap.num_full.tolist() == [[2, 0, 2]] and bmap.num_visit.tolist() == [[3, 0, 4]]
    assert bmap.indices[0, 0, :3].tolist() == [0, 3, 2]
    assert bmap.indices[0, 2, :4].tolist() == [2, 4, 0, 1]
    assert bmap.order.tolist() == [[2, 0, 1]]  # most tiles first
    assert bmap.indices.dtype == bmap.num_full.dtype == bmap.order.dtype == torch.int32

    ids = torch.repeat_interleave(torch.arange(6), torch.tensor([9, 1, 14, 3, 20, 9]))[None]
    fwd = build_block_map(ids, ids, 8, 4, causal=True)
    bwd = build_block_map(ids, ids, 8, 4, causal=True, key_major=True)

    def pairs(bmap, transpose):
        got = set()
        for r in range(bmap.num_visit.shape[1]):
            for i in range(int(bmap.num_visit[0, r])):
                c = int(bmap.indices[0, r, i])
                full = i < int(bmap.num_full[0, r])
                got.add(((c, r) if transpose else (r, c), full))
        return got

    assert pairs(fwd, False) == pairs(bwd, True)
    skipped = (ids.shape[1] // 8 + 1) * (ids.shape[1] // 4 + 1) - len(pairs(fwd, False))
    assert skipped > 0 and any(full for _, full in pairs(fwd, False))
    assert SKIP == 0 and FULL == 2


def test_backend_resolution_with_document_ids(monkeypatch):
    """auto with ids picks fa4 on a GPU where it runs, else triton (the reference where triton
    cannot take the shape); explicit cudnn/flash fall back to triton with a warning naming
    the reason; CPU auto stays on the reference."""
    import types

    import longctx.kernels as kernels

    q = torch.empty(1, 8, 2, 16)
    assert kernels.resolve_backend("auto", q, q, True, documents=True) == "torch"
    monkeypatch.setattr(kernels, "backend_available", lambda name, device: True)

    def on_gpu(head_dim, dtype=torch.bfloat16):  # what resolve_backend reads of a tensor
        return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(1, 8, 2, head_dim))

    g = on_gpu(128)
    monkeypatch.setattr(kernels, "_fa4_refusal", lambda device, dtype, head_dim: None)
    assert kernels.resolve_backend("auto", g, g, True, documents=True) == "fa4"
    monkeypatch.setattr(kernels, "_fa4_refusal", lambda device, dtype, head_dim: "FlashAttention-4 is not installed")
    assert kernels.resolve_backend("auto", g, g, True, documents=True) == "triton"
    assert kernels.resolve_backend("auto", on_gpu(512), on_gpu(512), True, documents=True) == "torch"
    f64 = on_gpu(64, torch.float64)
    assert kernels.resolve_backend("auto", f64, f64, False, documents=True) == "torch"
    for vendor in ("cudnn", "flash"):
        with pytest.warns(UserWarning, match="no document mask"):
            assert kernels.resolve_backend(vendor, g, g, True, documents=True) == "triton"
        assert kernels.resolve_backend(vendor, g, g, True) == vendor


# ----------------------------------------------------------------------------- GPU

# name: (B, Sq, Sk, Hq, Hkv, D, causal); ids: ~8 documents per row, one id reused.
GPU_SHAPES = {
    "causal_ragged_gqa_d128": (2, 1000, 1000, 8, 2, 128, True),
    "causal_d64": (1, 2048, 2048, 4, 4, 64, True),
    "full_sq_ne_sk_gqa_d64": (2, 384, 1000, 8, 2, 64, False),
    "full_mqa_d128": (1, 777, 513, 4, 1, 128, False),
}


@requires_cuda()
@pytest.mark.parametrize("bwd_mode", ["split", "atomic"])
@pytest.mark.parametrize("shape", list(GPU_SHAPES), ids=list(GPU_SHAPES))
def test_gpu_bf16_vs_float64(shape, bwd_mode, monkeypatch):
    """Compiled kernels (first listed config of each kernel; benchmarks/document_attention.py
    checks the tuned ones): bf16 through the seam vs the float64 reference, same ids."""
    from longctx.kernels import attention_backward, attention_forward, triton_attention

    if not triton_attention.is_available("cuda"):
        pytest.skip("triton unavailable")
    monkeypatch.setenv("LONGCTX_TRITON_AUTOTUNE", os.environ.get("LONGCTX_TRITON_AUTOTUNE", "0"))
    monkeypatch.setattr(triton_attention, "BWD_MODE", bwd_mode)
    B, Sq, Sk, Hq, Hkv, D, causal = GPU_SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(Sq + D)
    mk = lambda S, H: torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv), mk(Sq, Hq)

    def ids(S):  # 8 runs of random length; run 6 reuses run 1's id
        cuts = torch.sort(torch.randint(1, S, (7,), generator=g, device="cuda")).values
        doc = torch.zeros(B, S, dtype=torch.int64, device="cuda")
        doc[:, cuts] = 1
        doc = doc.cumsum(1)
        return torch.where(doc == 6, 1, doc)

    q_ids = ids(Sq)
    k_ids = q_ids if causal else ids(Sk)
    docs = dict(causal=causal, q_document_ids=q_ids, k_document_ids=k_ids)
    out, lse = attention_forward(q, k, v, backend="triton", **docs)
    grads = attention_backward(dout, q, k, v, out, lse, backend="triton", **docs)
    q64, k64, v64 = q.double(), k.double(), v.double()
    want_out, want_lse = attention_forward(q64, k64, v64, backend="torch", **docs)
    want = (want_out, want_lse) + tuple(
        attention_backward(dout.double(), q64, k64, v64, want_out, want_lse, backend="torch", **docs)
    )
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    got = (out, lse[finite], *grads)
    want = (want[0], want[1][finite], *want[2:])
    errs = {n: _rel(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want)}
    assert all(torch.isfinite(t).all() for t in (out, *grads)), errs
    bad = {n: e for n, e in errs.items() if not e < 2e-2}
    assert not bad, f"{shape} {bwd_mode}: errors above 2e-2: {bad}"
