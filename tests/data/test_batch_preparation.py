"""The data pipeline's batch preparation (longctx.data.prepare): what a DataLoader worker hands
the training step equals what the step used to build on the device from the full batch, and
the document plan survives pickling (worker -> training process), pinning and device moves."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from longctx.balance import balance_documents
from longctx.data.prepare import BatchPreparation, PreparedBatch, PreparingCollate
from longctx.documents import plan_documents
from longctx.sharding import document_position_ids, shard_batch


def _batch(seed: int, rows: int = 2, seq: int = 64) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(rows):
        lengths = torch.randint(1, 24, (seq,), generator=gen)
        ids.append(torch.repeat_interleave(torch.arange(seq), lengths)[:seq])
    tokens = torch.randint(0, 100, (rows, seq + 1), generator=gen)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "document_ids": torch.stack(ids)}


def _calls(plan) -> list:
    calls = list(plan.local_calls) + [ex.call for ex in plan.exchanges if ex.call is not None]
    sends = [ex.send_rows for ex in plan.exchanges]
    return calls, sends


def _same_plan(a, b) -> None:
    assert (a.world_size, a.rank, a.layout, a.batch, a.seq_len) == (b.world_size, b.rank, b.layout, b.batch, b.seq_len)
    assert a.fingerprint == b.fingerprint and a.documents == b.documents
    (calls_a, sends_a), (calls_b, sends_b) = _calls(a), _calls(b)
    assert len(calls_a) == len(calls_b)
    for x, y in zip(calls_a, calls_b):
        assert x.causal == y.causal and x.pairs == y.pairs
        for name in ("q_ids", "k_ids"):
            assert torch.equal(getattr(x, name).cpu(), getattr(y, name).cpu())
        assert torch.equal(x.segments.cu_seqlens_q.cpu(), y.segments.cu_seqlens_q.cpu())
        assert torch.equal(x.segments.cu_seqlens_k.cpu(), y.segments.cu_seqlens_k.cpu())
        for r, s in ((x.q_rows, y.q_rows), (x.k_rows, y.k_rows)):
            assert type(r) is type(s) and (not isinstance(r, torch.Tensor) or torch.equal(r.cpu(), s.cpu()))
    for r, s in zip(sends_a, sends_b):
        assert type(r) is type(s) and (not isinstance(r, torch.Tensor) or torch.equal(r.cpu(), s.cpu()))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("balance", [False, True])
def test_prepared_batch_equals_the_step_built_one(world_size, balance):
    full = _batch(world_size * 10 + balance)
    for rank in range(world_size):
        prep = BatchPreparation(cp_size=world_size, cp_rank=rank, rope_positions="document", balance=balance, plan=True)
        got = prep(dict(full))
        assert isinstance(got, PreparedBatch)
        # What the LightningModule did on the device before: positions, balance, plan, then shard.
        want = {**full, "position_ids": document_position_ids(full["document_ids"])}
        if balance and world_size > 1:
            want = balance_documents(want, world_size=world_size, layout="zigzag")
        plan = plan_documents(want["document_ids"], world_size=world_size, rank=rank)
        want = shard_batch(want, rank=rank, world_size=world_size)
        assert set(got) == set(want) | {"document_plan"}
        for key in want:
            assert torch.equal(got[key], want[key]), key
        _same_plan(got["document_plan"], plan)


def test_the_plan_survives_pickling_and_moves():
    ids = _batch(3)["document_ids"]
    for rank in range(2):
        plan = plan_documents(ids, world_size=2, rank=rank)
        again = pickle.loads(pickle.dumps(plan))
        _same_plan(plan, again)
        assert plan.to("cpu") is plan
        pinned = plan.pin_memory()
        if torch.cuda.is_available():  # pinned copies of the same plan, which reach the GPU unchanged
            assert all(t.is_pinned() for t in pinned._flats().values())
            _same_plan(plan, pinned.to("cuda"))
        else:
            assert pinned is plan  # nothing to pin without CUDA


def test_a_worker_hands_out_prepared_batches():
    samples = [{k: v[0] for k, v in _batch(i, rows=1).items()} for i in range(4)]
    prep = BatchPreparation(cp_size=2, cp_rank=1, rope_positions="document", balance=True, plan=True)
    loader = DataLoader(samples, batch_size=2, num_workers=1)
    loader.collate_fn = PreparingCollate(loader.collate_fn, prep)
    for i, got in enumerate(loader):
        assert isinstance(got, PreparedBatch) and got["input_ids"].shape == (2, 32)
        full = torch.utils.data.default_collate(samples[2 * i : 2 * i + 2])
        _same_plan(got["document_plan"], prep(full)["document_plan"])
    # Installed twice (a second fit), the preparation replaces the first instead of stacking.
    again = PreparingCollate(loader.collate_fn, prep)
    assert again.collate_fn is loader.collate_fn.collate_fn


def test_a_batch_without_documents_is_only_sharded():
    full = {k: v for k, v in _batch(5).items() if k != "document_ids"}
    got = BatchPreparation(cp_size=2, cp_rank=0, rope_positions="document", balance=True, plan=True)(full)
    want = shard_batch(full, rank=0, world_size=2)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert BatchPreparation(cp_size=2)(torch.zeros(2, 3)).shape == (2, 3)  # not a token mapping: untouched


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(cp_size=0), "cp_size"),
        (dict(cp_size=2, cp_rank=2), "cp_rank 2 is outside"),
        (dict(layout="ring"), "layout"),
        (dict(rope_positions="per-doc"), "rope_positions"),
    ],
)
def test_bad_preparation_arguments_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        BatchPreparation(**kwargs)


def _lengths_batch(lengths, seq):
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq]
    tokens = torch.randint(0, 100, (1, seq + 1), generator=torch.Generator().manual_seed(len(lengths)))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "document_ids": ids[None]}


@pytest.mark.parametrize(
    "lengths, exchange",
    [
        ([64] * 256, "gather"),  # short documents, few rows cross ranks: one all-to-all beats 3 ring steps
        ([16384], "ring"),  # one document: every rank's K/V moves, the ring's cheaper rows win
    ],
)
def test_auto_picks_per_batch_and_every_rank_agrees(lengths, exchange):
    """``exchange="auto"``: every rank of a group prices the same full ids and so picks the
    same exchange and order; the batch and plan are exactly those of that choice."""
    full, world = _lengths_batch(lengths, 16384), 4
    picks = set()
    for rank in range(world):
        prep = BatchPreparation(cp_size=world, cp_rank=rank, balance=True, plan=True, exchange="auto", heads=32)
        got = prep(dict(full))
        plan = got["document_plan"]
        picks.add((plan.exchange, tuple(plan.fingerprint)))
        balanced = balance_documents(dict(full), world_size=world, layout="zigzag")
        order = next(
            o
            for o in (balanced, full)
            if torch.equal(shard_batch(o, rank=rank, world_size=world)["document_ids"], got["document_ids"])
        )
        _same_plan(plan, plan_documents(order["document_ids"], world_size=world, rank=rank, exchange=plan.exchange))
    assert len(picks) == 1 and next(iter(picks))[0] == exchange
