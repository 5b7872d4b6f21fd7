"""Document-masked ring and Ulysses attention against the float64 block-diagonal reference.

One spawned group of 4 processes covers P = 2 (two concurrent pairs), 3 and 4; P = 1 runs
in this process. Every case is a fresh random draw (the seed is printed on failure).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed
from longctx import ring_attention, ulysses_attention
from longctx.ring import _block_for_step, _ring_blocks
from test_ring_attention import run_case

CHUNK = 4  # tokens per layout chunk: documents of 1-5 tokens cross chunk boundaries


def document_ids(pattern: str, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """(batch, seq) int64 ids; each batch row drawn separately."""
    rows = []
    for _ in range(batch):
        pos = torch.arange(seq)
        if pattern == "one":            # a single document: plain (causal) attention
            ids = torch.zeros(seq, dtype=torch.long)
        elif pattern == "short":        # packed documents of 1-5 tokens
            ids = torch.repeat_interleave(torch.arange(seq), torch.randint(1, 6, (seq,), generator=g))[:seq]
        elif pattern == "crossing":     # every chunk (so every shard) boundary inside a document
            ids = (pos + CHUNK // 2) // CHUNK
        elif pattern == "singletons":   # length-1 documents: each token sees only itself
            ids = pos.clone()
        elif pattern == "repeated":     # equal ids far apart are one document
            ids = torch.randint(0, 3, (seq,), generator=g) * 7 - 5
        else:
            raise ValueError(pattern)
        rows.append(ids)
    return torch.stack(rows)


PATTERNS = ("one", "short", "crossing", "singletons", "repeated")
HEADS = ((4, 4), (4, 2), (4, 1))
RING_CASES = [(layout, causal, pattern, HEADS[i % len(HEADS)])
              for i, (layout, causal, pattern) in enumerate(
                  [(lo, c, p) for lo in ("zigzag", "contiguous") for c in (True, False) for p in PATTERNS])]
ULYSSES_CASES = [(layout, causal, pattern, (8, 4))
                 for layout, causal, pattern, _ in RING_CASES if (pattern == "repeated") == (layout == "zigzag")]


def run_cases(attention, group, cases, seed):
    """[(case, name, error)] for ``cases`` on ``group`` (fp32, B = 2, D = 8)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    errors = []
    for i, (layout, causal, pattern, (hq, hkv)) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + i)  # same full tensors on every rank
        seq = CHUNK * world * (2 if layout == "zigzag" else 1)
        q, k, v, dout = (torch.randn(2, seq, h, 8, generator=g) for h in (hq, hkv, hkv, hq))
        ids = document_ids(pattern, 2, seq, g)
        for name, err in run_case(attention, group, rank, world, layout, causal, q, k, v, dout, documents=ids):
            errors.append(((world, layout, causal, pattern, hq, hkv), name, err))
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
    """Length-1 documents: only the diagonal block is computed, forward and backward, while
    every K/V hop still carries the shard's ids (two tensors per send batch)."""
    import longctx.ring as ring
    from longctx import shard_sequence

    calls = {"forward": 0, "backward": 0}
    real = {"forward": ring.attention_forward, "backward": ring.attention_backward,
            "p2p": dist.batch_isend_irecv}
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
    ring.attention_forward, ring.attention_backward = counted("forward"), counted("backward")
    dist.batch_isend_irecv = counting_p2p
    try:
        ring_attention(q, q, q, group=dist.group.WORLD, document_ids=ids, backend="torch").sum().backward()
    finally:
        ring.attention_forward, ring.attention_backward = real["forward"], real["backward"]
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
        # forward P-1 and backward P-2 K/V hops with their ids, P-1 dK/dV hops alone
        assert sorted(sends) == [1] * 3 + [2] * (3 + 2), sends


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


def _ranges(ids_per_rank):
    """The (P, 4) per-half (min, max) table the input check exchanges."""
    from longctx.ring import _document_ranges

    return torch.stack([_document_ranges(ids) for ids in ids_per_rank])


def test_ring_blocks_skip_steps_without_shared_documents():
    world, s_local = 4, 6
    for layout in ("zigzag", "contiguous"):
        from longctx import shard_sequence

        seq = s_local * world
        shards = lambda ids: [shard_sequence(ids, 1, rank=r, world_size=world, layout=layout)  # noqa: E731
                              for r in range(world)]
        # One document: exactly the plain ring's blocks.
        one = _ranges(shards(torch.zeros(1, seq, dtype=torch.long)))
        # Length-1 documents: nothing but the diagonal.
        single = _ranges(shards(torch.arange(seq)[None]))
        # Documents that never decrease and cross every chunk boundary: only blocks whose
        # rows and columns hold a common id.
        crossing_ids = ((torch.arange(seq) + 1) // 3)[None]
        crossing = _ranges(shards(crossing_ids))
        for causal in (True, False):
            for rank in range(world):
                plain = [_block_for_step(rank, s, world, layout, causal, s_local) for s in range(world)]
                # Inside one document no block needs the document mask (plain kernels).
                unmasked = [None if b is None else (*b, False) for b in plain]
                assert _ring_blocks(rank, world, layout, causal, s_local, one) == unmasked
                assert _ring_blocks(rank, world, layout, causal, s_local, None) == unmasked
                diagonal = _ring_blocks(rank, world, layout, causal, s_local, single)
                assert diagonal[0] == (*plain[0], True) and diagonal[1:] == [None] * (world - 1)
                mine = shards(crossing_ids)[rank]
                for step, block in enumerate(_ring_blocks(rank, world, layout, causal, s_local, crossing)):
                    if plain[step] is None:
                        assert block is None
                        continue
                    rows, cols, _ = plain[step]
                    theirs = shards(crossing_ids)[(rank - step) % world]
                    shared = bool(torch.isin(mine[:, rows], theirs[:, cols]).any())
                    assert (block is not None) == (shared or step == 0), (layout, causal, rank, step)
                    if block is not None:  # the mask is needed unless both sides are one document
                        ids = torch.cat([mine[:, rows].flatten(), theirs[:, cols].flatten()]).unique()
                        assert block[3] == (len(ids) > 1), (layout, causal, rank, step)


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
    from longctx import shard_sequence
    from longctx.layouts import document_work_per_rank

    from attention_reference import visibility_mask

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    world, seq = 3, 36
    ids = torch.stack([document_ids("repeated", 1, seq, g)[0], document_ids("short", 1, seq, g)[0]])
    per_query = visibility_mask(seq, seq, causal, ids).sum(-1)  # (B, S) visible keys per query
    want = torch.stack([shard_sequence(per_query, 1, rank=r, world_size=world, layout=layout).sum()
                        for r in range(world)])
    assert torch.equal(document_work_per_rank(ids, world, layout=layout, causal=causal), want)
    # One document, causal zigzag: the layout's purpose, equal work on every rank.
    if causal and layout == "zigzag":
        work = document_work_per_rank(torch.zeros(seq, dtype=torch.long), world)
        assert (work == work[0]).all() and int(work.sum()) == seq * (seq + 1) // 2
