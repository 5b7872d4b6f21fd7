"""Document-masked ring and Ulysses attention against the float64 block-diagonal reference.

One spawned group of 4 processes covers P = 2 (two concurrent pairs), 3 and 4; P = 1 runs
in this process. Every case is a fresh random draw (the seed is printed on failure), run
both with plain ids (planned per call) and with the step's ``DocumentPlan``.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from helpers.dist_harness import run_distributed
from test_ring_attention import run_case

from longctx import ring_attention, ulysses_attention
from longctx.documents import plan_documents

CHUNK = 4  # tokens per layout chunk: documents of 1-5 tokens cross chunk boundaries


def document_ids(pattern: str, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """(batch, seq) int64 ids; each batch row drawn separately."""
    rows = []
    for _ in range(batch):
        pos = torch.arange(seq)
        if pattern == "one":  # a single document: plain (causal) attention
            ids = torch.zeros(seq, dtype=torch.long)
        elif pattern == "short":  # packed documents of 1-5 tokens
            ids = torch.repeat_interleave(torch.arange(seq), torch.randint(1, 6, (seq,), generator=g))[:seq]
        elif pattern == "crossing":  # every chunk (so every shard) boundary inside a document
            ids = (pos + CHUNK // 2) // CHUNK
        elif pattern == "singletons":  # length-1 documents: each token sees only itself
            ids = pos.clone()
        elif pattern == "repeated":  # equal ids far apart are one document
            ids = torch.randint(0, 3, (seq,), generator=g) * 7 - 5
        elif pattern == "aligned":  # documents end exactly on chunk (shard) boundaries
            ids = pos // CHUNK
        elif pattern == "spanning":  # one document over every rank, short ones at both ends
            ids = torch.where((pos >= CHUNK // 2) & (pos < seq - CHUNK // 2), -1, pos)
        else:
            raise ValueError(pattern)
        rows.append(ids)
    return torch.stack(rows)


PATTERNS = ("one", "short", "crossing", "singletons", "repeated", "aligned", "spanning")
HEADS = ((4, 4), (4, 2), (4, 1))
RING_CASES = [
    (layout, causal, pattern, HEADS[i % len(HEADS)])
    for i, (layout, causal, pattern) in enumerate(
        [(lo, c, p) for lo in ("zigzag", "contiguous") for c in (True, False) for p in PATTERNS]
    )
]
ULYSSES_CASES = [
    (layout, causal, pattern, (8, 4))
    for layout, causal, pattern, _ in RING_CASES
    if (pattern == "repeated") == (layout == "zigzag")
]


def run_cases(attention, group, cases, seed):
    """[(case, name, error)] for ``cases`` on ``group`` (fp32, B = 2, D = 8); odd cases
    pass the DocumentPlan (ring: with two head chunks where the heads allow)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    errors = []
    for i, (layout, causal, pattern, (hq, hkv)) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + i)  # same full tensors on every rank
        seq = CHUNK * world * (2 if layout == "zigzag" else 1)
        q, k, v, dout = (torch.randn(2, seq, h, 8, generator=g) for h in (hq, hkv, hkv, hq))
        ids = document_ids(pattern, 2, seq, g)
        plan = i % 2 == 1
        extra = {"head_chunks": 2} if plan and attention is ring_attention and hkv % 2 == 0 else {}
        for name, err in run_case(
            attention, group, rank, world, layout, causal, q, k, v, dout, documents=ids, plan=plan, **extra
        ):
            errors.append(((world, layout, causal, pattern, hq, hkv, plan), name, err))
    return errors


def _all_sizes_vs_reference(rank, world, seed):
    """Ring at P = 4, 3, 2 and Ulysses at P = 4, 2, all in this one process group."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    triple = dist.new_group([0, 1, 2])
    everyone = dist.group.WORLD
    errors = run_cases(ring_attention, everyone, RING_CASES, seed)
    errors += run_cases(ulysses_attention, everyone, ULYSSES_CASES, seed)
    pair = pairs[rank // 2]
    errors += run_cases(ring_attention, pair, RING_CASES, seed + rank // 2)
    errors += run_cases(ulysses_attention, pair, ULYSSES_CASES, seed + rank // 2)
    if rank < 3:
        errors += run_cases(ring_attention, triple, RING_CASES, seed)
    return errors, _kernel_calls_and_sends(rank, world)


def _kernel_calls_and_sends(rank, world):
    """Length-1 documents: no rank sees anything of another, so the local call is the only
    kernel call, forward and backward, and nothing is sent at all."""
    import longctx.document_ring as document_ring
    from longctx import shard_sequence

    calls = {"forward": 0, "backward": 0}
    real = {
        "forward": document_ring.document_block_forward,
        "backward": document_ring.document_block_backward,
        "p2p": dist.batch_isend_irecv,
    }
    sends = []

    def counted(kind):
        def call(*args, **kwargs):
            calls[kind] += 1
            return real[kind](*args, **kwargs)

        return call

    def counting_p2p(ops):
        sends.append(sum(op.op is dist.isend for op in ops))
        return real["p2p"](ops)

    ids = shard_sequence(torch.arange(8 * world)[None], 1, rank=rank, world_size=world)
    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    document_ring.document_block_forward = counted("forward")
    document_ring.document_block_backward = counted("backward")
    dist.batch_isend_irecv = counting_p2p
    try:
        ring_attention(q, q, q, group=dist.group.WORLD, document_ids=ids, backend="torch").sum().backward()
    finally:
        document_ring.document_block_forward, document_ring.document_block_backward = real["forward"], real["backward"]
        dist.batch_isend_irecv = real["p2p"]
    return calls, sends


def _too_far(errors):
    return [f"{case} {name}: {err:.2e}" for case, name, err in errors if not err < 1e-5]


def test_documents_match_float64_reference_over_gloo():
    seed = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
    per_rank = run_distributed(_all_sizes_vs_reference, 4, seed)
    errors = per_rank[0][0] + per_rank[2][0]  # rank 2 reports its own pair
    expected = 4 * (2 * len(RING_CASES) + 2 * len(ULYSSES_CASES) + len(RING_CASES))
    assert len(per_rank[0][0]) == expected
    bad = _too_far(errors)
    assert not bad, f"seed={seed}:\n" + "\n".join(bad)
    for calls, sends in (result[1] for result in per_rank):
        assert calls == {"forward": 1, "backward": 1}, calls
        assert sends == [], sends


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_documents_single_rank(layout, causal):
    seed = random.randrange(1 << 30)
    for i, pattern in enumerate(PATTERNS):
        g = torch.Generator().manual_seed(seed + i)
        hq, hkv = HEADS[i % len(HEADS)]
        q, k, v, dout = (torch.randn(2, 10, h, 8, generator=g) for h in (hq, hkv, hkv, hq))
        ids = document_ids(pattern, 2, 10, g)
        for attention in (ring_attention, ulysses_attention):
            for name, err in run_case(attention, None, 0, 1, layout, causal, q, k, v, dout, documents=ids):
                assert err < 1e-5, (seed, pattern, attention.__name__, name, err)


def _visible_keys(full_ids, world, layout, causal, receiver, source):
    """Brute force: the source rank's key rows (shard order) that some query of the
    receiver sees, and the receiver's query rows that see some key of the source."""
    from longctx import position_ids

    pos_r = position_ids(full_ids.shape[1], rank=receiver, world_size=world, layout=layout)
    pos_s = position_ids(full_ids.shape[1], rank=source, world_size=world, layout=layout)
    ids = full_ids[0]
    see = ids[pos_r][:, None] == ids[pos_s][None, :]
    if causal:
        see &= pos_s[None, :] <= pos_r[:, None]
    return see.any(0).nonzero().flatten().tolist(), see.any(1).nonzero().flatten().tolist()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_plan_moves_exactly_the_visible_keys(layout, causal):
    """Every exchange carries exactly the key rows its receiver's queries see (none where
    the ranks share no document), and the receiver's call takes exactly its seeing rows."""
    world = 4
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    for pattern in PATTERNS:
        seq = CHUNK * world * (2 if layout == "zigzag" else 1)
        full = document_ids(pattern, 1, seq, g)
        plans = [plan_documents(full, world_size=world, rank=r, layout=layout, causal=causal) for r in range(world)]
        for rank, plan in enumerate(plans):
            for step, ex in enumerate(plan.exchanges, start=1):
                to, source = (rank + step) % world, (rank - step) % world
                sent, _ = _visible_keys(full, world, layout, causal, to, source=rank)
                wanted, seeing = _visible_keys(full, world, layout, causal, rank, source)
                assert ex.n_send == len(sent) and ex.n_recv == len(wanted), (pattern, rank, step)
                got = [] if not ex.n_send else _indices(ex.send_rows, ex.n_send)
                assert sorted(got) == sent, (pattern, rank, step)
                assert (ex.call is None) == (not wanted)
                if ex.call is not None:
                    assert sorted(_indices(ex.call.q_rows, len(ex.call.q_ids[0]))) == seeing
                    assert ex.call.k_rows is None and not ex.call.causal
        if pattern == "singletons":
            assert all(p.moved == 0 for p in plans)
        if pattern == "one":
            assert all(p.one_document for p in plans)


def _tensors(value):
    """Every tensor a plan's calls and exchanges hold (index rows, segment tables, ids)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "__dataclass_fields__"):
        for field in value.__dataclass_fields__:
            yield from _tensors(getattr(value, field))


@pytest.mark.parametrize("exchange", ["ring", "gather"])
def test_plan_tensors_start_16_byte_aligned(exchange):
    """FlashAttention-4 copies an index tensor whose pointer is not 16-byte aligned on every
    call (a launch and host time per layer): every tensor the plan ships starts aligned."""
    world = 4
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    checked = 0
    for pattern in PATTERNS:
        full = document_ids(pattern, 2, CHUNK * world * 2, g)
        for rank in range(world):
            plan = plan_documents(full, world_size=world, rank=rank, exchange=exchange)
            for t in _tensors([plan.local_calls, plan.exchanges, plan.gather]):
                assert t.data_ptr() % 16 == 0, (pattern, rank, t.dtype, t.shape)
                checked += 1
    assert checked > 100


def _indices(rows, n):
    if rows is None:
        return list(range(n))
    if isinstance(rows, slice):
        return list(range(rows.start, rows.stop))
    return rows.tolist()


def test_plan_local_calls_split_documents_in_separate_runs():
    """A document in two separate runs of a shard: the causal call over the runs, then one
    full call of the later run against the earlier; three runs need two more calls."""
    ids = torch.tensor([[0, 0, 1, 1, 0, 0, 2, 0]])
    plan = plan_documents(ids, world_size=1, rank=0)
    causal, *cross = plan.local_calls
    assert causal.causal and causal.q_rows is None and causal.segments.cu_seqlens_q.tolist() == [0, 2, 4, 6, 7, 8]
    assert [c.q_rows.tolist() if not isinstance(c.q_rows, slice) else c.q_rows for c in cross] == [
        [4, 5, 7],
        slice(7, 8),
    ]
    assert [_indices(c.k_rows, 0) for c in cross] == [[0, 1, 4, 5], [0, 1]]
    assert sum(c.pairs for c in plan.local_calls) == 3 + 3 + 3 + 1 + 1 + 6 + 2  # causal runs, then cross
    with pytest.raises(ValueError, match="rank 4 is outside"):
        plan_documents(ids, world_size=4, rank=4)
    with pytest.raises(ValueError, match="cannot be split"):
        plan_documents(ids, world_size=3, rank=0)
    with pytest.raises(TypeError, match="must hold integers"):
        plan_documents(ids.float(), world_size=1, rank=0)


def test_one_rank_of_packed_documents_is_one_causal_call():
    """Without context parallelism, packed documents (each one run of rows, as the data module
    packs them; every batch row numbering its own from 0) make one causal call and nothing
    else: why the FA4 warm-up at cp = 1 compiles no full-block variant
    (``kernels.fa4.warm_up(full_blocks=False)``)."""
    g = torch.Generator().manual_seed(0)
    for longest in (2, 40, 300):
        rows = []
        for _ in range(3):
            lengths = torch.randint(1, longest + 1, (256,), generator=g)
            rows.append(torch.repeat_interleave(torch.arange(256), lengths)[:256])
        plan = plan_documents(torch.stack(rows), world_size=1, rank=0)
        assert plan.calls == 1 and plan.local_calls[0].causal, longest


def _forward_events(plan, monkeypatch):
    """The order in which the ring's forward posts its steps' messages and runs its local
    calls, for ``plan`` on a stand-in exchange (values not checked)."""
    import longctx.document_ring as document_ring

    events = []

    class Exchange:
        def swap(self, offset, send, recv):
            events.append(("post", offset))
            return type("Posted", (), {"wait": lambda self: None})()

    real = document_ring.forward_calls

    def local(*args, **kwargs):
        events.append(("local",))
        return real(*args, **kwargs)

    monkeypatch.setattr(document_ring, "forward_calls", local)
    q, k, v = (torch.randn(1, plan.local_len, 2, 4) for _ in range(3))
    document_ring._ring_forward(q, k, v, plan, Exchange(), 0.5, "torch", keep=plan.keeps_messages)
    return events


def test_ring_forward_posts_every_step_first_where_its_messages_fit_one_shard(monkeypatch):
    """Where a rank receives at most one shard and sends at most two (the backward's receive
    buffers at P = 4), its forward posts every step's messages before its local calls (each
    transfer starts at once, not behind the step before it); else each step's after the step
    before. Both occur here."""
    world, seen = 4, set()
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    for pattern in ("crossing", "spanning", "repeated", "short"):
        full = document_ids(pattern, 1, CHUNK * world * 2, g)
        for rank in range(world):
            plan = plan_documents(full, world_size=world, rank=rank)
            if plan.one_document:
                continue
            shard = plan.batch * plan.local_len
            fits = int(plan.received[rank]) <= shard and sum(ex.n_send for ex in plan.exchanges) <= 2 * shard
            assert plan.posts_steps_first == fits, (pattern, rank)
            events = _forward_events(plan, monkeypatch)
            posts = [("post", step) for step in range(1, world)]
            want = [*posts, ("local",)] if fits else [posts[0], ("local",), *posts[1:]]
            assert events == want, (pattern, rank, events)
            seen.add(fits)
    assert seen == {True, False}  # not vacuous


def test_plan_refuses_a_call_it_was_not_built_for():
    ids = torch.zeros(1, 8, dtype=torch.long)
    ids[0, 4:] = 1
    plan = plan_documents(ids, world_size=1, rank=0)
    q = torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match=r"document plan does not fit this call: the plan is for shards"):
        ring_attention(q, q, q, document_ids=plan)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="the plan is for causal=True"):
        ring_attention(q, q, q, document_ids=plan, causal=False)


def test_document_ids_validation():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(TypeError, match="document_ids must hold integers"):
        ring_attention(q, q, q, document_ids=torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"document_ids must be \(batch, seq\) = \(1, 8\)"):
        ring_attention(q, q, q, document_ids=torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="document_ids is on meta"):
        ring_attention(q, q, q, document_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        ring_attention(q, q, q, document_ids=[0] * 8)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_document_work_per_rank_counts_visible_pairs(layout, causal):
    from helpers.attention_reference import visibility_mask

    from longctx import shard_sequence
    from longctx.layouts import document_work_per_rank

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    world, seq = 3, 36
    ids = torch.stack([document_ids("repeated", 1, seq, g)[0], document_ids("short", 1, seq, g)[0]])
    per_query = visibility_mask(seq, seq, causal, ids).sum(-1)  # (B, S) visible keys per query
    want = torch.stack(
        [shard_sequence(per_query, 1, rank=r, world_size=world, layout=layout).sum() for r in range(world)]
    )
    assert torch.equal(document_work_per_rank(ids, world, layout=layout, causal=causal), want)
    # One document, causal zigzag: the layout's purpose, equal work on every rank.
    if causal and layout == "zigzag":
        work = document_work_per_rank(torch.zeros(seq, dtype=torch.long), world)
        assert (work == work[0]).all() and int(work.sum()) == seq * (seq + 1) // 2


def test_kernel_dtype_results_merge_and_accumulate_in_fp32_on_their_rows():
    """The vendor kernels' bf16 outputs are kept as written; later partial results are merged
    (and gradients added) in fp32 on just their rows, rounding once, as a full fp32 buffer
    would (checked against it), for every kind of rows."""
    from longctx.document_ring import _Accumulator
    from longctx.kernels.merge import merge_partials_

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    n, h, d = 12, 2, 4
    for rows in (None, slice(3, 9), torch.tensor([0, 5, 7, 11])):
        m = n if rows is None else (rows.stop - rows.start if isinstance(rows, slice) else len(rows))
        out = torch.randn(1, n, h, d, generator=g).to(torch.bfloat16)
        lse = torch.randn(1, h, n, generator=g)
        out_b, lse_b = torch.randn(1, m, h, d, generator=g).to(torch.bfloat16), torch.randn(1, h, m, generator=g)
        want_out, want_lse = out.float().clone(), lse.clone()
        index = torch.arange(n) if rows is None else (torch.arange(n)[rows] if isinstance(rows, slice) else rows)
        o, l_ = want_out[:, index].clone(), want_lse[:, :, index].clone()
        merge_partials_(o, l_, out_b, lse_b)
        want_out[:, index], want_lse[:, :, index] = o, l_
        merge_partials_(out, lse, out_b, lse_b, rows=rows)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, want_out.to(torch.bfloat16)) and torch.allclose(lse, want_lse)

        first, part = torch.randn(1, n, h, d, generator=g).to(torch.bfloat16), torch.randn(1, m, h, d, generator=g)
        want = first.float()
        want[:, index] += part.to(torch.bfloat16).float()
        acc = _Accumulator(first)
        acc.add(None, first)  # kept as written (the kernel's own tensor: no copy)
        acc.add(rows, part.to(torch.bfloat16))
        assert torch.equal(acc.result(), want.to(torch.bfloat16))
