"""The FlashAttention-4 backend ("fa4", kernels/fa4.py).

CPU (always): the document -> varlen segment planner, emulated segment by segment with the
float64 reference and compared against the reference's own document mask on the id patterns
of test_document_kernels.py (longctx.data.document_mixes.document_id_pattern); the refusals
("fa4" asked for where it cannot run gives one line; "auto" never picks it there). GPU (where
FA4 is installed on an sm90/sm100 GPU): the kernels through the library's seam vs float64,
dense and document-masked.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers.run_if import requires_cuda

from longctx.data.document_mixes import document_id_pattern
from longctx.kernels import attention_backward, attention_forward, fa4, resolve_backend

PATTERNS = [  # (ids kind, causal, B, Sq, Sk)
    ("one", True, 1, 45, 45),
    ("short", True, 2, 50, 50),
    ("len1", True, 1, 37, 37),
    ("mix", True, 1, 70, 70),
    ("halves", True, 1, 64, 64),
    ("repeat", True, 1, 48, 48),
    ("short", False, 2, 29, 45),
    ("disjoint", False, 1, 40, 33),
    ("repeat", False, 1, 37, 53),
    ("halves", False, 1, 64, 64),
    ("straddle", False, 1, 40, 36),
    ("gaps", False, 2, 50, 44),
]


def _ids(kind, B, Sq, Sk, gen):
    """The document tests' patterns, plus ring-like off-diagonal blocks: "straddle" (one
    document crosses from the key chunk into the query chunk) and "gaps" (documents on one
    side only, between shared ones)."""
    if kind == "straddle":
        return (torch.tensor([[4] * 15 + [5] * (Sq - 15)] * B), torch.tensor([[3] * (Sk - 9) + [4] * 9] * B))
    if kind == "gaps":
        q = [0] * 10 + [1] * 12 + [3] * 8 + [4] * 10 + [6] * (Sq - 40)
        k = [1] * 5 + [2] * 9 + [3] * 10 + [5] * 7 + [6] * (Sk - 31)
        return torch.tensor([q] * B), torch.tensor([k] * B)
    return document_id_pattern(kind, B, Sq, Sk, gen)


def _expressible(ids):
    """Every id of every row in one run: what FA4's varlen segments can take."""
    for row in ids.tolist():
        runs = [a for i, a in enumerate(row) if i == 0 or row[i - 1] != a]
        if len(runs) != len(set(runs)):
            return False
    return True


def _emulate(plan, q, k, v, dout, causal, scale):
    """What FA4 computes for `plan`: each segment as its own (causal or full) attention, rows
    outside every segment out=0 / lse=-inf / zero gradients."""
    B, Sq, Hq, D = q.shape
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    qf, kf, vf, df = flat(q), flat(k), flat(v), flat(dout)
    out = torch.zeros_like(qf)
    lse = torch.full((qf.shape[0], Hq), float("-inf"), dtype=q.dtype)
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    for q0, ql, k0, kl in plan.segments:
        if ql == 0 or kl == 0:
            continue
        args = [t[None, a : a + n] for t, a, n in ((qf, q0, ql), (kf, k0, kl), (vf, k0, kl), (df, q0, ql))]
        o, l_ = attention_forward(*args[:3], causal=plan.causal, softmax_scale=scale, backend="torch")
        g = attention_backward(args[3], *args[:3], o, l_, causal=plan.causal, softmax_scale=scale, backend="torch")
        out[q0 : q0 + ql], lse[q0 : q0 + ql] = o[0], l_[0].T
        dq[q0 : q0 + ql] += g[0][0]
        dk[k0 : k0 + kl] += g[1][0]
        dv[k0 : k0 + kl] += g[2][0]
    return (
        out.view(q.shape),
        lse.view(B, Sq, Hq).transpose(1, 2),
        dq.view(q.shape),
        dk.view(k.shape),
        dv.view(v.shape),
    )


@pytest.mark.parametrize("kind,causal,B,Sq,Sk", PATTERNS)
def test_varlen_plan_equals_document_mask(kind, causal, B, Sq, Sk):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{causal}{Sq}".encode()))
    q_ids, k_ids = _ids(kind, B, Sq, Sk, gen)
    if causal:
        k_ids = q_ids
    plan = fa4.plan_documents(q_ids, k_ids, causal)
    if not (_expressible(q_ids) and _expressible(k_ids)):  # one id in separate runs
        assert plan is None
        return
    assert plan is not None
    q, dout = (torch.randn(B, Sq, 4, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Sk, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    docs = dict(q_document_ids=q_ids, k_document_ids=k_ids)
    want_out, want_lse = attention_forward(q, k, v, causal=causal, softmax_scale=0.25, backend="torch", **docs)
    want = (
        want_out,
        want_lse,
        *attention_backward(
            dout, q, k, v, want_out, want_lse, causal=causal, softmax_scale=0.25, backend="torch", **docs
        ),
    )
    got = _emulate(plan, q, k, v, dout, causal, 0.25)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12, equal_nan=False), name
    # Coverage marks exactly the rows that see (or are seen by) some key of their document.
    seen = q_ids[:, :, None] == k_ids[:, None, :]
    if plan.q_covered is not None:
        assert torch.equal(torch.from_numpy(plan.q_covered), seen.any(2).flatten())
    else:
        assert seen.any(2).all()


def test_plan_of_blocks_sharing_nothing_is_empty():
    plan = fa4.plan_documents(torch.full((1, 8), 2), torch.full((1, 6), 1), False)
    assert plan.empty and plan.segments == [] and not plan.q_covered.any()


def test_plan_refuses_causal_blocks_with_different_ids():
    ids = torch.tensor([[0, 0, 1, 1]])
    assert fa4.plan_documents(ids, ids.flip(1), True) is None


def test_plan_refuses_shared_documents_in_another_order():
    q_ids, k_ids = torch.tensor([[1, 1, 2, 2]]), torch.tensor([[2, 2, 1, 1]])
    assert fa4.plan_documents(q_ids, k_ids, False) is None


def test_explicit_fa4_where_it_cannot_run_is_one_line():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="attention backend 'fa4' cannot run here: .*CUDA") as info:
        resolve_backend("fa4", q, q, True)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="'fa4' cannot run here"):
        attention_forward(q, q, q, causal=True, backend="fa4")


def test_auto_never_picks_fa4_where_it_cannot_run():
    q = torch.randn(1, 8, 2, 16)
    assert resolve_backend("auto", q, q, True) == "torch"
    assert resolve_backend("auto", q, q, True, documents=True) == "torch"


def test_unsupported_shapes_are_named():
    assert "float16/bfloat16" in fa4.unsupported_shape("cpu", torch.float32, 128)
    assert "head dims" in fa4.unsupported_shape("cpu", torch.bfloat16, 100)
    assert fa4.unsupported_shape("cpu", torch.bfloat16, 128) is None


def test_compiled_kernels_are_cached_on_disk_by_default():
    """Importing the backend switches FA4's on-disk kernel cache on (unless the user chose)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_ATTENTION_CUTE_DSL_CACHE")}
    code = "from longctx.kernels import fa4; print(fa4.cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith(os.path.join(".cache", "longctx", "fa4"))
    env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"  # the user's choice stands
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("shipped, expected", [(256, fa4.VARLEN_LOOKUP_FROM_SEGMENTS - 1), (100, 100)])
def test_varlen_lookup_aid_starts_at_256_segments_unless_set_by_the_user(monkeypatch, shipped, expected):
    import sys
    import types

    interface = types.SimpleNamespace(BIN_BATCH_SEARCH_THRESH=shipped)
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    fa4._interface.cache_clear()
    try:
        assert fa4._interface() is interface
    finally:
        fa4._interface.cache_clear()  # the next test imports the real one (or fails to)
    # FA4 takes the aid for ``batch_size > BIN_BATCH_SEARCH_THRESH``: 256 segments do, 255 do not.
    assert interface.BIN_BATCH_SEARCH_THRESH == expected


def test_parallel_plan_takes_fa4_and_checks_it_against_the_device():
    from longctx import ParallelPlan

    assert ParallelPlan(attention_backend="fa4").attention_backend == "fa4"
    with pytest.raises(ValueError, match="^parallel.attention_backend 'fa4' cannot run on cpu: .*CUDA"):
        ParallelPlan(attention_backend="fa4").check_device("cpu")
    ParallelPlan(attention_backend="auto").check_device("cpu")  # auto picks what runs
    ParallelPlan(attention_backend="torch").check_device("cpu")


# ----------------------------------------------------------------------------- GPU


def _rel(got, want):
    """Norm-relative error; absolute where the true value is zero up to float64 rounding
    (e.g. dQ of one-token documents: one visible key, so the softmax gradient vanishes)."""
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all()
    if want.norm() < 1e-9 * want.numel() ** 0.5:
        return (got - want).abs().max().item()
    return ((got - want).norm() / want.norm()).item()


@requires_cuda(fa4=True)
@pytest.mark.parametrize(
    "Sq,Sk,Hq,Hkv,D,causal", [(777, 777, 4, 4, 128, True), (300, 650, 8, 2, 64, False), (512, 512, 32, 8, 64, True)]
)
def test_fa4_dense_vs_float64(Sq, Sk, Hq, Hkv, D, causal):
    g = torch.Generator(device="cuda").manual_seed(Sq + Sk)
    q, dout = (torch.randn(2, Sq, Hq, D, device="cuda", generator=g) for _ in range(2))
    k, v = (torch.randn(2, Sk, Hkv, D, device="cuda", generator=g) for _ in range(2))
    ref = dict(causal=causal, backend="torch")
    out64, lse64 = attention_forward(q.double(), k.double(), v.double(), **ref)
    want = (out64, lse64, *attention_backward(dout.double(), q.double(), k.double(), v.double(), out64, lse64, **ref))
    bf = [t.bfloat16() for t in (q, k, v, dout)]
    out, lse = attention_forward(*bf[:3], causal=causal, backend="fa4")
    got = (out, lse, *attention_backward(bf[3], *bf[:3], out, lse, causal=causal, backend="fa4"))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert _rel(a, b) < 2e-2, name
    assert got[3].shape == k.shape  # GQA: dK reduced to the KV heads


@requires_cuda(fa4=True)
@pytest.mark.parametrize("kind,causal,B,Sq,Sk", PATTERNS)
def test_fa4_documents_vs_float64(kind, causal, B, Sq, Sk):
    """Through the seam: varlen where the ids allow it, the Triton fallback elsewhere."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"gpu{kind}{causal}{Sq}".encode()))
    if kind != "mix":  # GPU-sized blocks (the "mix" ids are a fixed list of 70)
        Sq, Sk = Sq * 8, Sk * 8
    q_ids, k_ids = _ids(kind, B, Sq, Sk, gen)
    if causal:
        k_ids = q_ids
    q_ids, k_ids = q_ids.cuda(), k_ids.cuda()
    q, dout = (torch.randn(B, Sq, 4, 64, generator=gen).cuda() for _ in range(2))
    k, v = (torch.randn(B, Sk, 2, 64, generator=gen).cuda() for _ in range(2))
    docs = dict(q_document_ids=q_ids, k_document_ids=k_ids, causal=causal)
    out64, lse64 = attention_forward(q.double(), k.double(), v.double(), backend="torch", **docs)
    want = (
        out64,
        *attention_backward(dout.double(), q.double(), k.double(), v.double(), out64, lse64, backend="torch", **docs),
    )
    bf = [t.bfloat16() for t in (q, k, v, dout)]
    out, lse = attention_forward(*bf[:3], backend="fa4", **docs)
    got = (out, *attention_backward(bf[3], *bf[:3], out, lse, backend="fa4", **docs))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(a, b) < 2e-2, name
    empty = ~torch.isfinite(lse64)
    assert (lse[empty] == float("-inf")).all() and (out.transpose(1, 2)[empty] == 0).all()


@requires_cuda(fa4=True)
def test_fa4_nan_in_q_shows_in_its_row():
    """The kernel's max may drop a NaN score row as "no key"; the backend marks it NaN."""
    q, k, v = (torch.randn(1, 256, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q[0, 17, 1, 5] = float("nan")
    out, lse = attention_forward(q, k, v, causal=True, backend="fa4")
    assert torch.isnan(out[0, 17, 1]).all() and torch.isnan(lse[0, 1, 17])
    assert torch.isfinite(out[0, :17]).all() and torch.isfinite(lse[0, 0]).all()


class _FakeJit:
    def __init__(self):
        self.compile_cache = type("Cache", (), {})()
        self.compile_cache.cache = {}


def test_a_compile_after_warm_up_is_logged_and_counted(monkeypatch, caplog):
    """FA4's own compile caches are watched after the warm-up: a new key (a kernel variant
    the warm-up did not cover) is named in a warning and counted, once."""
    iface = type("Interface", (), {name: _FakeJit() for name in fa4._JIT_FUNCTIONS})()
    monkeypatch.setattr(fa4, "_interface", lambda: iface)
    monkeypatch.setattr(fa4, "late_compiles", [])
    iface._flash_attn_fwd.compile_cache.cache[("fwd", "warm")] = object()
    watch = fa4._Watch(fa4._jit_keys(), [cache for _, cache in fa4._jit_caches()], set())  # as warm_up leaves it
    monkeypatch.setattr(fa4, "_watch", watch)
    monkeypatch.setitem(fa4.compile_seconds, "variant", 0.0)
    fa4._timed_first_call("variant", lambda: None)
    assert fa4.late_compiles == []

    def compiles():
        iface._flash_attn_bwd.compile_cache.cache[("bwd", "over 256 segments")] = object()

    with caplog.at_level("WARNING", logger=fa4.log.name):
        fa4._timed_first_call("variant", compiles)
        fa4._timed_first_call("variant", lambda: None)  # the same key again: not counted twice
    assert fa4.late_compiles == [("variant", "_flash_attn_bwd", ("bwd", "over 256 segments"))]
    assert len([r for r in caplog.records if "after the warm-up" in r.message]) == 1


def test_step_one_reports_only_first_calls_since_the_warm_up(monkeypatch):
    """The line after step 1 counts the variants first called after the warm-up (the warm-up's
    own were reported before step 1: one count, not two)."""
    monkeypatch.setattr(fa4, "compile_seconds", {"warm": 4.0})
    monkeypatch.setattr(fa4, "_watch", None)
    assert fa4.first_calls_since_warm_up() == {"warm": 4.0}  # no warm-up ran: every first call
    fa4._watch = fa4._Watch(set(), [], set(fa4.compile_seconds))  # what warm_up records
    assert fa4.first_calls_since_warm_up() == {}
    fa4.compile_seconds["late"] = 2.5
    assert fa4.first_calls_since_warm_up() == {"late": 2.5}


def test_warm_up_parts_split_its_calls_between_processes(monkeypatch):
    """``warm_up(part=(i, n))`` makes every n-th call from the i-th: the n parts share no call
    and together make exactly the full warm-up's (the processes of a host each compile one
    part into the disk cache). Kernels replaced by recorders: which calls, not what they do."""
    made = []

    def record(kind):
        def call(*args, **kwargs):
            q, k = args[0], args[1]
            causal = args[3]
            segments = args[6] if kind == "forward_segments" else None
            key = (kind, causal, q.shape[1], k.shape[1], None if segments is None else segments.max_seqlen_q)
            made.append(key)
            return q.new_zeros(q.shape), q.new_zeros((q.shape[0], q.shape[2], q.shape[1]))

        return call

    for kind in ("forward", "forward_segments"):
        monkeypatch.setattr(fa4, kind, record(kind))
    for kind in ("backward", "backward_segments"):
        monkeypatch.setattr(fa4, kind, lambda *args, **kwargs: None)
    monkeypatch.setattr(fa4, "_watch", None)
    cpu = torch.device("cpu")
    for full_blocks in (False, True):
        made.clear()
        fa4.warm_up(cpu, torch.float32, 8, 2, 1, documents=True, full_blocks=full_blocks)
        full = list(made)
        assert len(full) == len(set(full)) == (5 if not full_blocks else 14)
        for n in (2, 3, 4):
            parts = []
            for i in range(n):
                made.clear()
                fa4.warm_up(cpu, torch.float32, 8, 2, 1, documents=True, full_blocks=full_blocks, part=(i, n))
                parts.append(set(made))
            assert sorted(k for p in parts for k in p) == sorted(full)
            assert sum(len(p) for p in parts) == len(full)  # no call twice
    with pytest.raises(ValueError, match="part must be"):
        fa4.warm_up(cpu, torch.float32, 8, 2, 1, documents=True, part=(2, 2))


@requires_cuda(fa4=True)
@pytest.mark.parametrize("full_blocks", [False, True])  # causal-only first: before anything compiled the rest
def test_no_fa4_compile_after_warm_up_over_random_document_layouts(full_blocks):
    """After ``warm_up`` (the model's head shape), document blocks of any segment count and
    length, causal and (``full_blocks``: with context parallelism) full, query and key
    segments of unrelated lengths, compile nothing new: FA4 compiles apart above 256
    segments, where every query segment fits one tile, and (backward) where either side's
    longest segment fits one block."""
    fa4.warm_up(torch.device("cuda"), torch.bfloat16, 64, 32, 8, documents=True, full_blocks=full_blocks)
    assert fa4._watch is not None
    gen = torch.Generator().manual_seed(7)
    from longctx.kernels import Segments

    def lengths(count, longest):
        n = torch.randint(1, longest + 1, (count,), generator=gen)
        cu = torch.zeros(count + 1, dtype=torch.int32)
        cu[1:] = n.cumsum(0)
        return cu.cuda(), int(n.max())

    layouts = [(1, 9000, 9000), (40, 3000, 60), (40, 60, 3000), (257, 40, 40), (400, 300, 20), (600, 3, 3)]
    for count, q_longest, k_longest in layouts:
        for causal in (True, False) if full_blocks else (True,):
            cu_q, max_q = lengths(count, q_longest)
            cu_k, max_k = (cu_q, max_q) if causal else lengths(count, k_longest)
            n_q, n_k = int(cu_q[-1]), int(cu_k[-1])
            q, dout = (torch.randn(1, n_q, 32, 64, generator=gen).bfloat16().cuda() for _ in range(2))
            k, v = (torch.randn(1, n_k, 8, 64, generator=gen).bfloat16().cuda() for _ in range(2))
            segments = Segments(cu_q, cu_k, max_q, max_k)
            out, lse = fa4.forward_segments(q, k, v, causal, 0.125, None, segments)
            fa4.backward_segments(dout, q, k, v, out, lse, causal, 0.125, None, segments)
    torch.cuda.synchronize()
    assert fa4.late_compiles == []
