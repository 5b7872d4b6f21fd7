"""The gather exchange of the document plan (``plan_documents(exchange="gather")``): one
all-to-all and one varlen call per direction instead of the ring's P - 1 steps.

One spawned group of 4 processes covers P = 4, 3 and 2 (two concurrent pairs), both
layouts, causal and not, random document layouts and balanced sequences, in float64 with
the "torch" backend: out, dq, dk, dv against the explicit-mask float64 reference and
against the ring exchange; NaN in q or k shows; and the collectives a layer issues are
counted. The host-side plan (rows per link, kernel calls, segments) is checked here too.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers.attention_reference import reference
from helpers.dist_harness import run_distributed
from test_ring_attention import rel_err
from test_ring_documents import CHUNK, _visible_keys, document_ids

from longctx import balance_documents, ring_attention, shard_sequence, unshard_sequence
from longctx.documents import plan_documents
from longctx.gather_plan import gather_segments

TOL = 1e-10
HEADS = ((4, 4), (4, 2), (4, 1))


def mixed_ids(pattern: str, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """``document_ids`` patterns, plus "lengths" (random lengths 1..2*CHUNK+1: 1-token
    documents, documents over several ranks) and "one_row" (row 0 one document, row 1
    packed: one-document rows in a plan that needs the mask)."""
    if pattern == "lengths":
        lengths = torch.randint(1, 2 * CHUNK + 2, (seq,), generator=g)
        return torch.stack([torch.repeat_interleave(torch.arange(seq), lengths.roll(b))[:seq] for b in range(batch)])
    if pattern == "one_row":
        ids = document_ids("short", batch, seq, g)
        ids[0] = 3
        return ids
    return document_ids(pattern, batch, seq, g)


PATTERNS = ("lengths", "spanning", "singletons", "one_row", "crossing", "repeated")
CASES = [(lo, c, p) for lo in ("zigzag", "contiguous") for c in (True, False) for p in PATTERNS]


def _run(plan, ql, kl, vl, dout, group, causal, layout, chunks):
    q, k, v = (t.detach().clone().requires_grad_() for t in (ql, kl, vl))
    out = ring_attention(
        q, k, v, group=group, causal=causal, layout=layout, backend="torch", document_ids=plan, head_chunks=chunks
    )
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _compare(group, layout, causal, q, k, v, dout, ids, chunks=1):
    """Gather vs the float64 reference and vs the ring, on gathered full tensors:
    [(name, error vs reference, error vs ring)], and whether the forward's rows were kept."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = lambda t: shard_sequence(t, 1, rank=rank, world_size=world, layout=layout)  # noqa: E731
    full = lambda t: unshard_sequence(t, 1, group=group, layout=layout)  # noqa: E731
    plans = {
        mode: plan_documents(ids, world_size=world, rank=rank, layout=layout, causal=causal, exchange=mode)
        for mode in ("gather", "ring")
    }
    local = [shard(t) for t in (q, k, v, dout)]
    got = {mode: [full(t) for t in _run(plan, *local, group, causal, layout, chunks)] for mode, plan in plans.items()}
    ref_out, _, *ref_grads = reference(q, k, v, dout, causal, q.shape[-1] ** -0.5, ids)
    errors = [
        (name, rel_err(a, w), rel_err(a, r))
        for name, a, r, w in zip(("out", "dq", "dk", "dv"), got["gather"], got["ring"], [ref_out, *ref_grads])
    ]
    plan = plans["gather"]
    kept = int(plan.received.max()) <= plan.batch * plan.local_len
    return errors, (kept, plan.gather is not None, plan.one_document)


def _group_cases(group, seed, cases=CASES):
    world = dist.get_world_size(group)
    results = []
    for i, (layout, causal, pattern) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + i)  # the same full tensors on every rank
        hq, hkv = HEADS[i % len(HEADS)]
        seq = CHUNK * world * (2 if layout == "zigzag" else 1)
        q, k, v, dout = (torch.randn(2, seq, h, 8, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
        ids = mixed_ids(pattern, 2, seq, g)
        chunks = 2 if i % 4 == 1 and hkv % 2 == 0 else 1
        errors, info = _compare(group, layout, causal, q, k, v, dout, ids, chunks)
        results.append(((world, layout, causal, pattern, hq, hkv, chunks), errors, info))
    return results


def _balanced_cases(group, seed):
    """Balanced (reordered, documents cut head-tail) zigzag sequences: the same checks."""
    import longctx.balance as balance

    world = dist.get_world_size(group)
    dust, balance.DUST = balance.DUST, 1  # tiny documents placed and cut as long ones would be
    results = []
    try:
        for i, causal in enumerate((True, False, True)):
            g = torch.Generator().manual_seed(seed + 100 + i)
            seq = 3 * 2 * world
            q, k, v, dout = (torch.randn(2, seq, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
            ids = mixed_ids("lengths", 2, seq, g)
            ids[1, : seq // 2] = 7  # one long document, cut over every rank
            batch = balance_documents(dict(document_ids=ids, q=q, k=k, v=v, dout=dout), world_size=world)
            moved = not torch.equal(batch["position_ids"], torch.arange(seq).expand(2, seq))
            errors, info = _compare(
                group, "zigzag", causal, *(batch[n] for n in ("q", "k", "v", "dout", "document_ids"))
            )
            results.append(((world, "balanced", causal, moved), errors, info))
        # Documents of 1/16 to 3/16 of the sequence (mean 16K at 128K, scaled): the balance cuts
        # them into contiguous pieces (balance._contiguous_cuts), not head-tail.
        g = torch.Generator().manual_seed(seed + 200)
        seq = 2 * world * 16
        lengths = [12, 4, 6, 10, 11, 10, 11] if world == 2 else [9, 8, 7, 9, 18, 10, 9, 18, 8]
        lengths = lengths if world < 4 else [15, 11, 20, 24, 10, 8, 24, 16]
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(2, seq)
        q, k, v, dout = (torch.randn(2, seq, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
        batch = balance_documents(dict(document_ids=ids, q=q, k=k, v=v, dout=dout), world_size=world)
        errors, info = _compare(group, "zigzag", True, *(batch[n] for n in ("q", "k", "v", "dout", "document_ids")))
        results.append(((world, "contiguous cuts", True, True), errors, info))
    finally:
        balance.DUST = dust
    return results


def _nan_cases(group):
    """NaN in one q / one k element: out is NaN exactly where the float64 reference's is,
    and the gradients carry NaN."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(5)
    seq = CHUNK * world * 2
    results = []
    for where in ("q", "k"):
        q, k, v, dout = (torch.randn(1, seq, h, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1, 2))
        ids = document_ids("spanning", 1, seq, g)
        (q if where == "q" else k)[0, seq // 2 - 1, 0, 0] = float("nan")  # a token read from other ranks
        shard = lambda t: shard_sequence(t, 1, rank=rank, world_size=world)  # noqa: E731
        plan = plan_documents(ids, world_size=world, rank=rank, exchange="gather")
        got = _run(plan, *(shard(t) for t in (q, k, v, dout)), group, True, "zigzag", 1)
        out = unshard_sequence(got[0], 1, group=group)
        grads_nan = torch.tensor([float(any(bool(t.isnan().any()) for t in got[1:]))], dtype=torch.float64)
        dist.all_reduce(grads_nan, op=dist.ReduceOp.MAX, group=group)
        ref = reference(q, k, v, dout, True, 0.5, ids)[0]
        results.append((where, int(ref.isnan().any(-1).sum()), torch.equal(out.isnan(), ref.isnan()), bool(grads_nan)))
    return results


def _collectives(rank, world):
    """Collectives and kernel calls of one layer (forward + backward) under the gather
    exchange: one all_to_all_single per direction (two in the backward where the forward's
    rows are re-gathered), nothing else."""
    import longctx.document_ring as document_ring

    names = [
        "all_gather",
        "all_gather_into_tensor",
        "all_reduce",
        "broadcast",
        "all_to_all",
        "reduce_scatter",
        "batch_isend_irecv",
        "isend",
        "irecv",
        "send",
        "recv",
        "barrier",
    ]
    saved = {n: getattr(dist, n) for n in names + ["all_to_all_single"]}
    kernels = {"forward": document_ring.document_block_forward, "backward": document_ring.document_block_backward}
    counts = {}

    def forbidden(*args, **kwargs):
        raise AssertionError("the gather exchange issued another collective")

    def counting(name, real):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)

        return call

    results = []
    for pattern in ("crossing", "spanning"):  # crossing: kept for the backward; spanning: re-gathered
        seq = CHUNK * world * 2
        g = torch.Generator().manual_seed(3)
        ids = document_ids(pattern, 1, seq, g)
        plans = {m: plan_documents(ids, world_size=world, rank=rank, exchange=m) for m in ("gather", "ring")}
        plan = plans["gather"]
        q, k, v = (
            shard_sequence(torch.randn(1, seq, 2, 4, generator=g), 1, rank=rank, world_size=world).requires_grad_()
            for _ in range(3)
        )
        counts.clear()
        try:
            for n in names:
                setattr(dist, n, forbidden)
            dist.all_to_all_single = counting("a2a", saved["all_to_all_single"])
            document_ring.document_block_forward = counting("forward", kernels["forward"])
            document_ring.document_block_backward = counting("backward", kernels["backward"])
            out = ring_attention(q, k, v, group=dist.group.WORLD, backend="torch", document_ids=plan)
            forward = dict(counts)
            out.sum().backward()
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)
            document_ring.document_block_forward, document_ring.document_block_backward = (
                kernels["forward"],
                kernels["backward"],
            )
        kept = int(plan.received.max()) <= plan.batch * plan.local_len
        launches = {m: int(p.launches[m][rank]) for m, p in plans.items()}
        results.append((pattern, kept, forward, dict(counts), plan.calls, launches))
    return results


def _everything(rank, world, seed):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    triple = dist.new_group([0, 1, 2])
    results = _group_cases(dist.group.WORLD, seed) + _balanced_cases(dist.group.WORLD, seed)
    # P = 2 and 3 take every other case each (every layout and causality, half the patterns).
    results += _group_cases(pairs[rank // 2], seed + 1000 * (rank // 2), CASES[::2])
    results += _balanced_cases(pairs[rank // 2], seed + 1000 * (rank // 2))
    if rank < 3:
        results += _group_cases(triple, seed + 7, CASES[1::2]) + _balanced_cases(triple, seed + 7)
    return results, _nan_cases(dist.group.WORLD), _collectives(rank, world)


@pytest.fixture(scope="module")
def spawned():
    seed = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
    return seed, run_distributed(_everything, 4, seed)


def test_gather_matches_float64_reference_and_ring(spawned):
    seed, per_rank = spawned
    results = per_rank[0][0] + per_rank[2][0]  # rank 2 reports its own pair
    worlds = {case[0] for case, _, _ in results}
    assert worlds == {2, 3, 4}, worlds
    bad = [
        f"{case} {name}: vs reference {ref:.2e}, vs ring {ring:.2e}"
        for case, errors, _ in results
        for name, ref, ring in errors
        if not (ref < TOL and ring < TOL)
    ]
    assert not bad, f"seed={seed}:\n" + "\n".join(bad)
    worst = max(max(ref, ring) for _, errors, _ in results for _, ref, ring in errors)
    print(f"worst relative error: {worst:.1e} ({len(results)} cases)")
    infos = {info for _, _, info in results}
    # Both backward paths ran (forward's rows kept, and gathered again), with the exchange.
    assert (True, True, False) in infos and (False, True, False) in infos, infos
    reordered = {case[0] for case, _, _ in results if case[1] == "balanced" and case[3]}
    assert reordered == worlds, reordered  # the balance did reorder the sequence at every P


def test_gather_nan_in_q_or_k_shows(spawned):
    for where, nan_rows, same, grads_nan in spawned[1][0][1]:
        assert nan_rows > 0 and same and grads_nan, (where, nan_rows, same, grads_nan)


def test_gather_issues_one_all_to_all_per_direction(spawned):
    for rank, (_, _, results) in enumerate(spawned[1]):
        seen_kept = set()
        for pattern, kept, forward, total, calls, launches in results:
            case = (rank, pattern, forward, total)
            assert forward == {"a2a": 1, "forward": calls}, case
            assert total == {"a2a": 2 + (not kept), "forward": calls, "backward": calls}, case
            assert calls == launches["gather"] <= launches["ring"], (case, launches)
            seen_kept.add(kept)
        assert seen_kept == {True, False}, seen_kept
        # A document over every rank: the ring calls a kernel per step, the gather once.
        spanning = [r for r in results if r[0] == "spanning"][0][-1]
        assert spanning["ring"] - spanning["gather"] == len(spawned[1]) - 2, spanning


# ------------------------------------------------------------------------ host side


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_gather_plan_counts(layout, causal):
    """rows_between is what each rank's queries see of each other rank (brute force); the
    gather call covers the ring steps' pairs; kernel calls per mode; the exchange is
    validated and part of the fingerprint."""
    world = 4
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    for pattern in PATTERNS:
        seq = CHUNK * world * (2 if layout == "zigzag" else 1)
        full = mixed_ids(pattern, 1, seq, g)
        for rank in range(world):
            kw = dict(world_size=world, rank=rank, layout=layout, causal=causal)
            ring, gather = plan_documents(full, **kw), plan_documents(full, exchange="gather", **kw)
            assert (ring.exchange, gather.exchange) == ("ring", "gather")
            assert np.array_equal(ring.rows_between, gather.rows_between)
            for source in range(world):
                if source != rank:
                    wanted, _ = _visible_keys(full, world, layout, causal, rank, source)
                    assert gather.rows_between[source, rank] == len(wanted), (pattern, rank, source)
            assert np.array_equal(gather.received, gather.rows_between.sum(0)) and gather.moved == ring.moved
            assert ring.calls == len(ring.local_calls) + sum(ex.call is not None for ex in ring.exchanges)
            ex = gather.gather
            remote = sum(e.call.pairs for e in ring.exchanges if e.call is not None)
            assert (0 if ex is None or ex.call is None else ex.call.pairs) == remote, (pattern, rank)
            assert gather.calls == len(gather.local_calls) + (remote > 0)
            assert gather.exchanges == [] and ring.gather is None
            if ex is not None:
                assert ex.n_recv == gather.received[rank] and sum(ex.recv_splits) == ex.n_recv
                assert list(ex.send_splits) == gather.rows_between[rank].tolist()
                if ex.call is not None:  # no query row twice
                    q_rows = ex.call.q_rows
                    n = q_rows.numel() if isinstance(q_rows, torch.Tensor) else None
                    assert n is None or len(set(q_rows.tolist())) == n
            assert ring.fingerprint != gather.fingerprint
    with pytest.raises(ValueError, match="exchange must be 'ring' or 'gather', got 'p2p'"):
        plan_documents(full, world_size=world, rank=0, layout=layout, exchange="p2p")


def test_gather_segments_per_chunk_and_refuses_split_key_sets():
    # Document 0's queries in two local chunks (positions 8, 9 and 12, 13); received keys
    # at 1 and 5 (before both) and 10 (between them): the first chunk's segment sees
    # {1, 5}, the second's {1, 5, 10}.
    q_doc, q_pos, q_chunk = np.zeros(4, np.int64), np.array([8, 9, 12, 13]), np.array([0, 0, 1, 1])
    k_doc, k_pos = np.zeros(3, np.int64), np.array([10, 5, 1])
    q_rows, k_rows, q_lens, k_lens = gather_segments(q_doc, q_pos, q_chunk, k_doc, k_pos, True, 16)
    assert q_rows.tolist() == [0, 1, 2, 3] and q_lens.tolist() == [2, 2]
    assert k_rows.tolist() == [2, 1, 2, 1, 0] and k_lens.tolist() == [2, 3]  # keys repeat, by position
    _, k_rows, q_lens, k_lens = gather_segments(q_doc, q_pos, q_chunk, k_doc, k_pos, False, 16)
    assert q_lens.tolist() == [4] and k_lens.tolist() == [3]
    # A received key inside a chunk's queries (9 < 10 < 12 in one chunk): refused.
    with pytest.raises(RuntimeError, match="see different received keys"):
        gather_segments(q_doc, np.array([8, 9, 11, 12]), np.zeros(4, np.int64), k_doc, k_pos, True, 16)


def test_received_rows_read_once_go_home_without_a_sum():
    """Where the gather call reads every received row exactly once in another order
    (``keys_permuted``), its dK/dV partials go home by one copy in the message dtype: the
    same bits as the fp32 sum the repeated case needs. Documents of 8, 35, 25, 20 and 40
    tokens at P = 4 give both cases (rank 0: a reordering; rank 3: rows read twice)."""
    from longctx.document_ring import _to_sources

    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([8, 35, 25, 20, 40]))[None]
    exchanges = [plan_documents(ids, world_size=4, rank=r, exchange="gather").gather for r in range(4)]
    permuted, repeated = exchanges[0], exchanges[3]
    assert permuted.keys_permuted and torch.equal(permuted.key_rows.sort().values, torch.arange(permuted.n_recv))
    assert not repeated.keys_permuted and repeated.key_rows.numel() > repeated.key_rows.unique().numel()
    g = torch.Generator().manual_seed(7)
    for ex in (permuted, repeated):
        n = ex.key_rows.numel()
        for grad_dtype, part_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32)):
            dk, dv = (torch.randn(1, n, 2, 16, generator=g, dtype=part_dtype) for _ in range(2))
            dk[0, 0, 0, 0] = float("nan")  # NaN goes home too
            summed = torch.zeros((ex.n_recv, 2, 2, 16), dtype=torch.float32)
            summed.index_add_(0, ex.key_rows, torch.stack([dk[0], dv[0]], dim=1))
            got = _to_sources(ex, dk, dv, grad_dtype)
            assert got.dtype == grad_dtype
            assert torch.equal(got.isnan(), summed.to(grad_dtype).isnan()) and got.isnan().any()
            assert torch.equal(got.nan_to_num(), summed.to(grad_dtype).nan_to_num())
