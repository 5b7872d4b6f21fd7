"""Ring attention against a float64 single-device reference, over gloo with P processes."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers.attention_reference import reference
from helpers.dist_harness import run_distributed

from longctx import ring_attention, shard_sequence, unshard_sequence


def rel_err(a, b):
    """Norm-relative error; absolute where the reference is exactly zero (e.g. dq when
    every token is its own document)."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    scale = b.norm()
    return ((a - b).norm() / (scale if scale > 0 else 1.0)).item()


# (layout, causal, Hq, Hkv, dtype, chunk, scale). chunk = tokens per layout chunk, so the
# total length is chunk * P * chunks_per_rank: deliberately odd, never a power of two.
CASES = [
    (layout, causal, hq, hkv, torch.float32, 3, None)
    for layout in ("zigzag", "contiguous")
    for causal in (True, False)
    for hq, hkv in ((4, 4), (4, 2), (4, 1))
] + [
    ("zigzag", True, 4, 2, torch.bfloat16, 5, None),
    ("contiguous", True, 4, 1, torch.bfloat16, 5, None),
    ("zigzag", True, 2, 2, torch.float32, 5, 0.3),
]


def run_case(
    attention, group, rank, world, layout, causal, q, k, v, dout, scale=None, documents=None, plan=False, **kwargs
):
    """Shard full-sequence inputs (and ``documents``, (B, S) ids) over ``group``, run
    ``attention`` forward and backward, and return the norm-relative errors of the
    gathered out, dq, dk, dv against the float64 reference, as [(name, error)].
    ``plan=True``: pass the step's ``DocumentPlan`` of ``documents`` instead of the ids."""
    from longctx.documents import plan_documents

    shard = lambda t: shard_sequence(t, 1, rank=rank, world_size=world, layout=layout)  # noqa: E731
    ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
    extra = dict(kwargs)
    if documents is not None:
        extra["document_ids"] = (
            plan_documents(documents, world_size=world, rank=rank, layout=layout, causal=causal)
            if plan
            else shard(documents)
        )
    out = attention(ql, kl, vl, group=group, causal=causal, layout=layout, softmax_scale=scale, **extra)
    out.backward(shard(dout))
    gather = lambda t: unshard_sequence(t.detach(), 1, group=group, layout=layout)  # noqa: E731
    got = [gather(out), gather(ql.grad), gather(kl.grad), gather(vl.grad)]
    ref_out, _, *ref_grads = reference(q, k, v, dout, causal, scale or q.shape[-1] ** -0.5, documents)
    errors = []
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, [ref_out, *ref_grads]):
        assert a.dtype == q.dtype, (name, a.dtype)
        errors.append((name, rel_err(a, w)))
    return errors


def attention_vs_reference(rank, world, seed, impl="ring", cases=CASES):
    """Per case: norm-relative error of out, dq, dk, dv (gathered) against float64."""
    from longctx import ulysses_attention

    attention = {"ring": ring_attention, "ulysses": ulysses_attention}[impl]
    errors = []
    for i, (layout, causal, hq, hkv, dtype, chunk, scale) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + i)  # same full tensors on every rank
        seq = chunk * world * (2 if layout == "zigzag" else 1)
        b, d = 2, 8
        q = torch.randn(b, seq, hq, d, generator=g).to(dtype)
        k = torch.randn(b, seq, hkv, d, generator=g).to(dtype)
        v = torch.randn(b, seq, hkv, d, generator=g).to(dtype)
        dout = torch.randn(b, seq, hq, d, generator=g).to(dtype)
        for name, err in run_case(attention, dist.group.WORLD, rank, world, layout, causal, q, k, v, dout, scale):
            errors.append(((layout, causal, hq, hkv, str(dtype), scale), name, err))
    return errors


def failures(errors) -> list:
    """Errors above tolerance: fp32 1e-5, bf16 2e-2 (NaN always fails)."""
    return [
        f"{case} {name}: {err:.2e}" for case, name, err in errors if not err < (2e-2 if "bfloat16" in case[4] else 1e-5)
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_matches_float64_reference(world):
    seed = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
    errors = run_distributed(attention_vs_reference, world, seed)[0]
    bad = failures(errors)
    assert len(errors) == 4 * len(CASES) and not bad, f"seed={seed} P={world}:\n" + "\n".join(bad)


def _ring_uses_only_point_to_point(rank, world):
    """A forward+backward issues one collective, the forward's small input check (every
    call, so no rank can skip it while another waits in it), and otherwise only
    point-to-point shifts."""
    group = dist.group.WORLD
    q, k, v = (torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(3))
    ring_attention(q, k, v, group=group).sum().backward()  # warm-up

    def forbidden(*args, **kwargs):
        raise AssertionError("ring attention issued a collective")

    names = ["all_gather_into_tensor", "all_reduce", "broadcast", "all_to_all", "reduce_scatter"]
    saved = {n: getattr(dist, n) for n in names + ["all_gather"]}
    sends, checks = [], []
    real_p2p, real_all_gather = dist.batch_isend_irecv, dist.all_gather

    def counting_p2p(ops):
        sends.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real_p2p(ops)

    def counting_all_gather(outputs, tensor, **kwargs):
        checks.append(tensor.numel())
        return real_all_gather(outputs, tensor, **kwargs)

    try:
        for n in names:
            setattr(dist, n, forbidden)
        dist.batch_isend_irecv, dist.all_gather = counting_p2p, counting_all_gather
        out = ring_attention(q, k, v, group=group)
        forward_checks = len(checks)
        out.sum().backward()
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
        dist.batch_isend_irecv = real_p2p
    return sends, checks, forward_checks


def test_ring_is_point_to_point_and_sends_one_shard_per_hop():
    world = 3
    sends, checks, forward_checks = run_distributed(_ring_uses_only_point_to_point, world)[0]
    kv_shard = 2 * 1 * 8 * 2 * 4  # k and v of one local shard
    # forward: P-1 K/V hops. Backward: its first block is the shard kept from the forward,
    # so P-2 K/V hops, plus P-1 dK/dV hops (same element count, fp32).
    assert sends == [kv_shard] * ((world - 1) + (world - 2) + (world - 1))
    assert forward_checks == 1 and len(checks) == 1 and checks[0] <= 32  # a few int64s


def _second_backward_matches_first(rank, world):
    """retain_graph=True: a second backward must reuse intact saved tensors (the backward
    receives K/V into its own buffers, never into the shard kept from the forward)."""
    torch.manual_seed(100 + rank)
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    out = ring_attention(q, k, v, group=dist.group.WORLD)
    first = torch.autograd.grad((out * w).sum(), (q, k, v), retain_graph=True)
    second = torch.autograd.grad((out * w).sum(), (q, k, v))
    return [(a - b).abs().max().item() for a, b in zip(first, second)] + [float(torch.isfinite(g).all()) for g in first]


def test_second_backward_with_retained_graph_is_identical():
    for diffs in run_distributed(_second_backward_matches_first, 4):
        assert diffs[:3] == [0.0, 0.0, 0.0] and diffs[3:] == [1.0, 1.0, 1.0], diffs


def _bad_inputs(rank, world):
    group = dist.group.WORLD
    caught = []

    def attempt(kind, q, k=None, **kwargs):
        k = q if k is None else k
        try:
            ring_attention(q, k, k, group=kwargs.pop("group", group), **kwargs)
        except ValueError as e:
            caught.append((kind, str(e)))

    # Ranks disagree on the local length: every rank must get an error, none may hang.
    attempt("mismatch", torch.randn(1, 8 if rank == 0 else 12, 2, 4))
    # Odd local length cannot be a zigzag shard.
    attempt("zigzag", torch.randn(1, 5, 2, 4))
    # Only rank 0's shard is unsplittable: rank 1 alone would pass its own checks and wait
    # for transfers forever; it must be told instead.
    attempt("one_rank", torch.randn(1, 7 if rank == 0 else 8, 2, 4))
    q = torch.randn(1, 8, 2, 4)
    attempt("layout", q, layout="zigzag" if rank == 0 else "contiguous")
    attempt("dtype", q if rank == 0 else q.bfloat16())
    attempt("causal", q, causal=rank == 0)
    attempt("ids", q, document_ids=torch.zeros(1, 8, dtype=torch.long) if rank == 0 else None)
    attempt("bad_ids", q, document_ids=torch.zeros(1, 8 if rank == 0 else 6, dtype=torch.long))
    # A shape seen before on one rank, new on the other (a per-rank cache of verified
    # shapes sent rank 0 into the transfers and left rank 1 in the check): both must
    # raise at once. A short group timeout bounds the hang this used to be.
    short = dist.new_group([0, 1], timeout=timedelta(seconds=20))
    attempt("warm-up", q, group=short)
    attempt("changed", torch.randn(1, 8 if rank == 0 else 12, 2, 4), group=short)
    # ... and through the model, whose attention layers call the ring.
    from longctx import CPContext, ParallelDims, ParallelPlan, parallelize
    from longctx.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, n_kv_head=2, n_embd=16, intermediate_size=24))
    parallelize(model, ParallelDims(cp=CPContext(short)), ParallelPlan(attention_backend="torch"))
    model(torch.zeros(1, 8, dtype=torch.long))
    try:
        model(torch.zeros(1, 8 if rank == 0 else 12, dtype=torch.long))
    except ValueError as e:
        caught.append(("model", str(e)))
    return caught


def _two_rank_checks(rank, world):
    return _bad_inputs(rank, world), _non_finite_vs_reference(rank, world)


@pytest.fixture(scope="module")
def two_rank_checks():
    """One 2-process group runs the input checks and the NaN/Inf cases (spawning is slow)."""
    return run_distributed(_two_rank_checks, 2, timeout=120)


def test_bad_inputs_fail_on_every_rank(two_rank_checks):
    for rank, (caught, _) in enumerate(two_rank_checks):
        kinds = dict(caught)
        assert "different shard shapes" in kinds["mismatch"]
        assert "multiple of 4" in kinds["zigzag"] and "10" in kinds["zigzag"]
        if rank == 0:
            assert "multiple of 4" in kinds["one_rank"], kinds["one_rank"]
        else:
            assert "rank(s) [0]" in kinds["one_rank"] and "rejected" in kinds["one_rank"]
        assert "different layouts (per rank: {0: 'zigzag', 1: 'contiguous'})" in kinds["layout"]
        assert "torch.float32" in kinds["dtype"] and "torch.bfloat16" in kinds["dtype"], kinds["dtype"]
        assert "{0: True, 1: False}" in kinds["causal"]
        assert "document_ids (dtype per rank: {0: 'torch.int64', 1: 'None'})" in kinds["ids"], kinds["ids"]
        if rank == 1:
            assert "document_ids must be (batch, seq) = (1, 8)" in kinds["bad_ids"], kinds["bad_ids"]
        else:
            assert "rank(s) [1]" in kinds["bad_ids"]
        assert "warm-up" not in kinds
        for kind in ("changed", "model"):
            assert "different shard shapes" in kinds[kind], (kind, kinds.get(kind))


def _non_finite_vs_reference(rank, world):
    """NaN / +inf in q or k: out is NaN exactly where float64 softmax attention's is, through
    the ring (both layouts) and Ulysses; gradients carry NaN too."""
    from longctx import ulysses_attention

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(7)
    seq, hq, hkv = 8 * world, 4, 2
    results = []
    for where in ("q nan", "k nan", "k inf", "q inf"):
        q, k, v, dout = (torch.randn(1, seq, h, 4, generator=g) for h in (hq, hkv, hkv, hq))
        t = q if where[0] == "q" else k
        token = 3 if where[0] == "q" else 1  # a token on another rank than most of its readers
        t[0, token, 0, 0] = float("nan") if "nan" in where else float("inf")
        if where == "q inf":
            k[0, :, 0, 0] = k[0, :, 0, 0].abs()  # every score of that row is +inf
        ref = reference(q, k, v, dout, True, 0.5)[0]
        for attention in (ring_attention, ulysses_attention):
            for layout in ("zigzag", "contiguous"):
                shard = lambda x: shard_sequence(x, 1, rank=rank, world_size=world, layout=layout)  # noqa: E731
                ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
                out = attention(ql, kl, vl, group=group, layout=layout, softmax_scale=0.5)
                out.backward(shard(dout))
                full = unshard_sequence(out.detach(), 1, group=group, layout=layout)
                grads_nan = torch.tensor([float(any(bool(x.grad.isnan().any()) for x in (ql, kl, vl)))])
                dist.all_reduce(grads_nan, op=dist.ReduceOp.MAX, group=group)
                results.append(
                    (
                        where,
                        attention.__name__,
                        layout,
                        torch.equal(full.isnan(), ref.isnan()),
                        int(ref.isnan().any(-1).sum()),
                        bool(torch.allclose(full[~ref.isnan()], ref[~ref.isnan()].float(), atol=1e-5)),
                        bool(grads_nan),
                    )
                )
    return results


def test_nan_and_inf_in_q_or_k_show_in_the_output(two_rank_checks):
    for where, impl, layout, same_nans, nan_rows, rest_close, grads_nan in two_rank_checks[0][1]:
        case = (where, impl, layout)
        assert nan_rows > 0 and same_nans and rest_close and grads_nan, (
            case,
            same_nans,
            nan_rows,
            rest_close,
            grads_nan,
        )


def test_nan_in_local_attention_shows_in_the_output():
    """group=None runs _LocalAttention: NaN in q must not be read as 'no visible key'."""
    q, k, v = (torch.randn(1, 6, 2, 4) for _ in range(3))
    q[0, 2, 1, 0] = float("nan")
    out = ring_attention(q, k, v, backend="torch")
    assert out[0, 2, 1].isnan().all() and torch.isfinite(out[0, :, 0]).all() and not out[0, 3:, 1].isnan().any()


@pytest.mark.parametrize(
    "shapes, dtypes, match",
    [
        (((1, 8, 4), (1, 8, 2, 4), (1, 8, 2, 4)), None, "4 dims"),
        (((1, 8, 3, 4), (1, 8, 2, 4), (1, 8, 2, 4)), None, "multiple of key/value heads"),
        (((1, 8, 4, 4), (1, 8, 2, 4), (1, 8, 1, 4)), None, "k and v shapes differ"),
        (((1, 8, 4, 4), (1, 8, 2, 8), (1, 8, 2, 8)), None, "head_dim"),
        (((1, 8, 4, 4), (1, 6, 2, 4), (1, 6, 2, 4)), None, "same tokens"),
        (((1, 8, 4, 4), (1, 8, 2, 4), (1, 8, 2, 4)), (torch.float32, torch.float16, torch.float16), "dtypes differ"),
        (((1, 8, 4, 4), (1, 8, 2, 4), (1, 8, 2, 4)), (torch.int64,) * 3, "dtype"),
    ],
)
def test_input_validation(shapes, dtypes, match):
    dtypes = dtypes or (torch.float32,) * 3
    q, k, v = (torch.ones(s).to(dt) for s, dt in zip(shapes, dtypes))
    with pytest.raises((ValueError, TypeError), match=match):
        ring_attention(q, k, v)


def test_tensors_on_different_devices():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="different devices"):
        ring_attention(q, q.to("meta"), q.to("meta"))


def test_unknown_layout_and_backend():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="layout must be one of zigzag, contiguous, got"):
        ring_attention(q, q, q, layout="spiral")
    with pytest.raises(ValueError, match="unknown attention backend"):
        ring_attention(q, q, q, backend="magic")


def test_ring_add_into_fresh_buffer():
    """The ring writes the first contribution into an uninitialised fp32 buffer: what the
    block does not cover must come out zero, whatever the memory held (NaN here)."""
    from longctx.ring import _add_into

    g = torch.Generator().manual_seed(4)
    for index in (slice(None), slice(0, 3), slice(3, None)):
        x = torch.randn(1, len(range(6)[index]), 2, 4, generator=g)
        buf = torch.full((1, 6, 2, 4), float("nan"))
        _add_into(buf, index, x, fresh=True)
        want = torch.zeros(1, 6, 2, 4)
        want[:, index] = x
        assert torch.equal(buf, want), index
        _add_into(buf, index, x, fresh=False)
        want[:, index] += x
        assert torch.equal(buf, want), index


def test_ring_finish_last_contribution():
    """The last contribution and the cast to the output dtype in one step: equal to an fp32
    add followed by the cast (one rounding), whole-buffer and partial indices, and a buffer
    that never got an earlier contribution (NaN garbage must not leak)."""
    from longctx.ring import _finish

    g = torch.Generator().manual_seed(5)
    for index in (slice(None), slice(0, 3), slice(3, None)):
        buf = torch.randn(1, 6, 2, 4, generator=g)
        x = torch.randn(1, len(range(6)[index]), 2, 4, generator=g).bfloat16()
        want = buf.clone()
        want[:, index] += x.float()
        got = _finish(buf.clone(), index, x, False, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16()), index
        fresh_want = torch.zeros(1, 6, 2, 4)
        fresh_want[:, index] = x.float()
        got = _finish(torch.full((1, 6, 2, 4), float("nan")), index, x, True, torch.bfloat16)
        assert torch.equal(got, fresh_want.bfloat16()), index


def _head_chunks_vs_reference(rank, world, seed):
    """attention_head_chunks: the ring runs once per group of K/V heads; out and grads
    (gathered) against float64, plain and document-masked, GQA and MHA; and each chunk
    sends its own (smaller) messages."""
    import functools

    from test_ring_documents import document_ids

    errors = []
    for i, (hq, hkv, chunks, docs) in enumerate([(4, 2, 2, False), (8, 4, 4, False), (4, 4, 2, True), (6, 2, 2, True)]):
        g = torch.Generator().manual_seed(seed + i)
        seq, b, d = 5 * 2 * world, 2, 8
        q, dout = (torch.randn(b, seq, hq, d, generator=g) for _ in range(2))
        k, v = (torch.randn(b, seq, hkv, d, generator=g) for _ in range(2))
        ids = document_ids("short", b, seq, g) if docs else None
        attention = functools.partial(ring_attention, head_chunks=chunks, backend="torch")
        for name, err in run_case(
            attention,
            dist.group.WORLD if world > 1 else None,
            rank,
            world,
            "zigzag",
            True,
            q,
            k,
            v,
            dout,
            documents=ids,
        ):
            errors.append(((hq, hkv, chunks, docs), name, err))
    sends = []
    real = dist.batch_isend_irecv

    def counting(ops):
        sends.extend(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real(ops)

    if world > 1:
        qs, ks, vs = (torch.randn(1, 8, h, 4, requires_grad=True) for h in (4, 2, 2))
        dist.batch_isend_irecv = counting
        try:
            ring_attention(qs, ks, vs, group=dist.group.WORLD, head_chunks=2).sum().backward()
        finally:
            dist.batch_isend_irecv = real
    return errors, sends


@pytest.mark.parametrize("world", [1, 3])
def test_head_chunks_match_float64_reference(world):
    seed = random.randrange(1 << 30)
    errors, sends = run_distributed(_head_chunks_vs_reference, world, seed)[0]
    bad = [f"{case} {name}: {err:.2e}" for case, name, err in errors if not err < 1e-5]
    assert len(errors) == 16 and not bad, f"seed={seed} P={world}:\n" + "\n".join(bad)
    if world > 1:
        half_shard = 2 * 1 * 8 * 1 * 4  # k and v of one local shard, one of two K/V heads
        assert sends == [half_shard] * (2 * ((world - 1) + (world - 2) + (world - 1)))


def test_head_chunks_are_validated():
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="attention_head_chunks=4 must divide the 2 key/value heads"):
        ring_attention(q, k, k, head_chunks=4)
    with pytest.raises(ValueError, match="attention_head_chunks must be a positive int, got 0"):
        ring_attention(q, k, k, head_chunks=0)
