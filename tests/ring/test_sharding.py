"""shard_batch: shift-then-shard, label alignment across shard boundaries, round trips, markers.

Everything is index arithmetic, so ranks are simulated in one process. The expected
layouts are written out here (zigzag: rank r holds chunks r and 2P-1-r of 2P; contiguous:
chunk r of P) rather than taken from longctx.layouts, so the tests check the contract.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.sharding import ShardedBatch, is_sharded, shard_batch

LAYOUTS = ("zigzag", "contiguous")


def expected_chunks(rank: int, world: int, layout: str) -> list[int]:
    return [rank, 2 * world - 1 - rank] if layout == "zigzag" else [rank]


def n_chunks(world: int, layout: str) -> int:
    return 2 * world if layout == "zigzag" else world


def global_positions(rank: int, world: int, layout: str, seq_len: int) -> torch.Tensor:
    c = seq_len // n_chunks(world, layout)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in expected_chunks(rank, world, layout)])


def restore(shards: list[torch.Tensor], world: int, layout: str, dim: int = 1) -> torch.Tensor:
    """Undo sharding with explicit chunk math: put every rank's chunks back in chunk order."""
    pieces = {}
    for r, x in enumerate(shards):
        ks = expected_chunks(r, world, layout)
        for i, part in enumerate(x.chunk(len(ks), dim=dim)):
            pieces[ks[i]] = part
    return torch.cat([pieces[k] for k in range(n_chunks(world, layout))], dim=dim)


def full_batch(tokens: torch.Tensor) -> dict:
    """Shift on the FULL sequence, as the data module does: tokens (B, S+1) -> (B, S) inputs/labels."""
    s = tokens.shape[1] - 1
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(s).expand(tokens.shape[0], s),
        "document_ids": torch.cumsum(torch.rand(tokens.shape[0], s) < 0.05, dim=1),
    }


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 5),
    per_chunk=st.integers(1, 6),
    batch=st.integers(1, 3),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_round_trip_and_positions(world, per_chunk, batch, layout, seed):
    seq_len = n_chunks(world, layout) * per_chunk
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (batch, seq_len + 1), generator=g)
    full = full_batch(tokens)
    shards = [shard_batch(full, rank=r, world_size=world, layout=layout) for r in range(world)]
    for key, value in full.items():
        assert torch.equal(restore([s[key] for s in shards], world, layout), value), key
    for r, s in enumerate(shards):
        pos = global_positions(r, world, layout, seq_len)
        assert s["input_ids"].shape == (batch, seq_len // world)
        assert torch.equal(s["position_ids"], pos.expand(batch, -1))
        # Without position_ids in the batch, shard_batch adds the layout's global positions.
        no_pos = {k: v for k, v in full.items() if k != "position_ids"}
        added = shard_batch(no_pos, rank=r, world_size=world, layout=layout)["position_ids"]
        assert added.dtype == torch.int64 and torch.equal(added, pos.expand(batch, -1))
        # Every local label is the token right after the local input's global position.
        assert torch.equal(s["labels"], tokens[:, pos + 1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_labels_cross_shard_boundaries(layout):
    """The last token of each chunk predicts the first token of the next chunk, held by another rank."""
    world, per_chunk = 4, 3
    seq_len = n_chunks(world, layout) * per_chunk
    tokens = torch.randperm(10_000)[: seq_len + 1].unsqueeze(0)  # distinct tokens: no lucky matches
    shards = [shard_batch(full_batch(tokens), rank=r, world_size=world, layout=layout) for r in range(world)]
    owner = {k: (r, i) for r in range(world) for i, k in enumerate(expected_chunks(r, world, layout))}
    crossings = 0
    for k in range(n_chunks(world, layout) - 1):
        r, i = owner[k]
        r_next, i_next = owner[k + 1]
        last_label = shards[r]["labels"][0, (i + 1) * per_chunk - 1]
        first_input_next = shards[r_next]["input_ids"][0, i_next * per_chunk]
        assert last_label == first_input_next
        crossings += r != r_next
    assert crossings == n_chunks(world, layout) - 1 - (1 if layout == "zigzag" else 0)
    # The very last label is the extra (S+1)-th token, which is no rank's input.
    r, i = owner[n_chunks(world, layout) - 1]
    assert shards[r]["labels"][0, -1] == tokens[0, -1]


def test_shift_after_shard_would_be_wrong():
    """Guard the reason for shift-then-shard: shifting a shard pairs chunk ends with wrong targets."""
    tokens = torch.arange(17).unsqueeze(0)
    s = shard_batch(full_batch(tokens), rank=0, world_size=2)  # zigzag chunks 0 and 3 of 4
    assert s["input_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert s["labels"].tolist() == [[1, 2, 3, 4, 13, 14, 15, 16]]  # 3 -> 4 although 4 lives on rank 1


def test_plain_token_tensor_is_shifted_then_sharded():
    tokens = torch.arange(2 * 9).reshape(2, 9)  # (B, S+1), S = 8
    out = shard_batch(tokens, rank=1, world_size=2)
    assert isinstance(out, ShardedBatch)
    assert out["input_ids"].tolist() == [[2, 3, 4, 5], [11, 12, 13, 14]]
    assert out["labels"].tolist() == [[3, 4, 5, 6], [12, 13, 14, 15]]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    with pytest.raises(ValueError, match=r"length 9 .*S\+1.*S=8|S=8"):
        shard_batch(torch.zeros(1, 9, dtype=torch.long), rank=0, world_size=3)


def test_tuple_and_passthrough():
    x = torch.arange(16).reshape(2, 8)
    y = x + 100
    per_sample = torch.tensor([7, 9])
    out = shard_batch((x, y, per_sample, "tag"), rank=0, world_size=2, layout="contiguous")
    assert is_sharded(out) and isinstance(out, tuple)
    assert out[0].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]] and torch.equal(out[1], out[0] + 100)
    assert out[2] is per_sample and out[3] == "tag"
    d = shard_batch(
        {"input_ids": x, "mask": torch.ones(2, 8), "other": torch.ones(2, 5), "n": 3, "s": per_sample},
        rank=1,
        world_size=2,
    )
    assert d["mask"].shape == (2, 4) and d["other"].shape == (2, 5) and d["n"] == 3 and d["s"] is per_sample


def test_idempotent_marker():
    b = full_batch(torch.arange(9).unsqueeze(0))
    once = shard_batch(b, rank=1, world_size=2)
    assert is_sharded(once) and not is_sharded(b)
    assert shard_batch(once, rank=1, world_size=2) is once
    with pytest.raises(ValueError, match="already sharded for rank 1 of 2"):
        shard_batch(once, rank=0, world_size=2)
    # Survives pickling (worker processes) and Lightning-style rebuilding (marker kept, details lost).
    again = pickle.loads(pickle.dumps(once))
    assert is_sharded(again) and again.sharding == once.sharding
    rebuilt = type(once)({k: v for k, v in once.items()})
    assert shard_batch(rebuilt, rank=0, world_size=2) is rebuilt
    # world_size 1: nothing sliced, positions added, marked.
    single = shard_batch({"input_ids": torch.ones(2, 5, dtype=torch.long)}, rank=0, world_size=1)
    assert single["position_ids"].tolist() == [list(range(5))] * 2 and is_sharded(single)


def test_errors_name_the_numbers():
    b = full_batch(torch.arange(13).unsqueeze(0))  # S = 12
    with pytest.raises(ValueError, match=r"12.*P=4.*multiple of 8"):
        shard_batch(b, rank=0, world_size=4)
    shard_batch(b, rank=0, world_size=4, layout="contiguous")  # 12 % 4 == 0 is fine there
    with pytest.raises(ValueError, match="input_ids"):
        shard_batch({"tokens": torch.ones(1, 8)}, rank=0, world_size=2)
    assert shard_batch({"tokens": torch.ones(1, 8)}, rank=0, world_size=2, seq_len=8)["tokens"].shape == (1, 4)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        shard_batch(b, rank=2, world_size=2)
    with pytest.raises(TypeError, match="mapping"):
        shard_batch("text", rank=0, world_size=2)
