"""Load balance of document-masked zigzag context parallelism, before and after
``longctx.balance_documents``: pure arithmetic on document ids, CPU only.

    python benchmarks/document_balance.py      # ~1 min once the default corpus is cached

For S = 128K and P = 2, 4, 8, on the seeded mixes of benchmarks/document_attention.py
(mean4k, mean16k, longtail; --seeds draws of each) and on the 128K windows of the default
corpus that hold more than one document (the stdlib, tokenized as train.py does by
default; a window of one document is balanced already), reports before / after:

  rank_imbalance   max / mean over ranks of visible (query, key) pairs: a rank's total work
                   (``longctx.layouts.document_work_per_rank``);
  ring_cost        sum over ring steps of the slowest rank's pairs, over (all pairs / P):
                   the ring runs in lock-step, so this (>= rank_imbalance) is what time follows;
  masked_tiles,    the kernels' 128x128 tile classes on the sequence (the block map of
  full_tiles       longctx.kernels.triton_document, from per-tile min/max ids): visited tiles
                   that need the elementwise mask, and unmasked ones. Cutting documents costs
                   masked tiles;
  ring_cost_tiles  ring_cost counted in visited tiles, and ring_tiles the same unnormalised
                   (sum over steps of the slowest rank's tiles);
  one_document_blocks, document_blocks
                   ring blocks (rank x step) that the ring runs on the plain kernels (rows
                   inside one document: cuDNN on GPUs) and on the Triton document kernels;
  modeled_speedup  ring_tiles before / after: the expected speed-up of the attention if a
                   tile costs the same masked or not and on either kernel (the GPU run
                   decides the rest);
  balanced         the share of sequences that balance_documents reordered (--min-gain);
and the time of balance_permutation at S = 128K and 1M (one CPU thread, median of 7).
Prints a table and writes benchmarks/results/document_balance.json (or --out).

    torchrun --nproc-per-node=N benchmarks/document_balance.py --ring     # GPUs, ~2 min

times what it models: the document-masked zigzag ring (longctx.ring_attention, bf16,
S = 128K, H = 16, D = 128, forward + backward, the slowest rank's median) on each mix's
ids (seed 0) as packed and balanced, and writes document_balance_ring_ws<N>_<gpu>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the checkout, and the sibling benchmark scripts

from document_attention import MIXES, document_lengths, ids_from_lengths  # noqa: E402
from longctx.balance import MIN_GAIN, balance_documents, balance_permutation  # noqa: E402
from longctx.kernels.triton_document import SKIP, FULL, tile_classes  # noqa: E402
from longctx.layouts import check_seq_len, document_work_per_rank, shard_sequence  # noqa: E402
from longctx.ring import _document_ranges, _ring_blocks  # noqa: E402

TILE = 128
WORLD_SIZES = (2, 4, 8)


def token_ranks(seq_len: int, world_size: int) -> torch.Tensor:
    """The zigzag rank holding each position of the full sequence."""
    check_seq_len(seq_len, world_size, "zigzag")
    chunk = torch.arange(seq_len) // (seq_len // (2 * world_size))
    return torch.minimum(chunk, 2 * world_size - 1 - chunk)


def pair_matrix(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """(P, P) int64: visible causal (query, key) pairs with the query on rank a, the key on b."""
    ranks = token_ranks(ids.numel(), world_size)
    order = torch.argsort(ids, stable=True)  # by document, positions ascending
    sorted_ids, r = ids[order], ranks[order]
    held = torch.nn.functional.one_hot(r, world_size).cumsum(0)  # keys so far, per rank
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    doc = torch.cumsum(first, 0) - 1
    before_doc = held[first.nonzero().squeeze(1)] - torch.nn.functional.one_hot(r[first], world_size)
    seen = held - before_doc[doc]  # per query: its document's keys at or before it, per rank
    return torch.zeros(world_size, world_size, dtype=torch.int64).index_add_(0, r, seen)


def ring_cost(per_pair: torch.Tensor) -> float:
    """Sum over ring steps s of max over ranks r of work(r, (r - s) mod P), over the ideal."""
    world = per_pair.shape[0]
    ranks = torch.arange(world)
    slowest = sum(per_pair[ranks, (ranks - s) % world].max().item() for s in range(world))
    return slowest / (per_pair.sum().item() / world)


def imbalance(work: torch.Tensor) -> float:
    work = work.double()
    return (work.max() / work.mean()).item()


def measure(ids: torch.Tensor, world_size: int) -> dict:
    """Every figure of the module docstring for one full sequence of ids."""
    pairs = pair_matrix(ids, world_size)
    classes = tile_classes(ids[None], ids[None], TILE, TILE, causal=True)[0]
    visited = classes != SKIP
    tile_ranks = token_ranks(ids.numel(), world_size)[::TILE]
    tiles = torch.zeros(world_size, world_size, dtype=torch.int64)
    tiles.index_put_((tile_ranks[:, None].expand_as(visited)[visited], tile_ranks[None, :].expand_as(visited)[visited]),
                     torch.ones((), dtype=torch.int64), accumulate=True)
    row = dict(rank_imbalance=imbalance(document_work_per_rank(ids, world_size)),
               ring_cost=ring_cost(pairs),
               masked_tiles=int((classes == SKIP + 1).sum()), full_tiles=int((classes == FULL).sum()),
               ring_cost_tiles=ring_cost(tiles))
    row["ring_tiles"] = row["ring_cost_tiles"] * tiles.sum().item() / world_size
    # Ring blocks (rank, step) whose rows all lie in one document run on the plain kernels
    # (cuDNN on GPUs), the others on the Triton document kernels: what the ring decides.
    shards = [shard_sequence(ids[None], 1, rank=r, world_size=world_size) for r in range(world_size)]
    ranges = torch.stack([_document_ranges(shard) for shard in shards])
    blocks = [block for r in range(world_size)
              for block in _ring_blocks(r, world_size, "zigzag", True, ids.numel() // world_size, ranges)]
    row["one_document_blocks"] = sum(block is not None and not block[3] for block in blocks)
    row["document_blocks"] = sum(block is not None and block[3] for block in blocks)
    assert pairs.sum(1).tolist() == document_work_per_rank(ids, world_size).tolist()
    return row


def compare(ids: torch.Tensor, world_size: int, min_gain: float) -> dict:
    batch = {"document_ids": ids[None], "index": torch.arange(ids.numel())[None]}
    balanced = balance_documents(batch, world_size=world_size, min_gain=min_gain)
    before, after = measure(ids, world_size), measure(balanced["document_ids"][0], world_size)
    return {"before": before, "after": after, "modeled_speedup": before["ring_tiles"] / after["ring_tiles"],
            "balanced": float(not torch.equal(balanced["index"], batch["index"]))}


def corpus_windows(seq_len: int) -> list:
    """Document ids of every training window of the default corpus, as train.py builds it."""
    from longctx.data import LongDocumentDataModule

    dm = LongDocumentDataModule("stdlib", seq_len=seq_len, batch_size=1, val_fraction=0.0)
    dm.prepare_data()
    dm.setup("fit")
    return [dm.train_dataset[i]["document_ids"] for i in range(len(dm.train_dataset))]


def time_ms(ids: torch.Tensor, world_size: int, repeats: int) -> float:
    balance_permutation(ids, world_size)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        balance_permutation(ids, world_size)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def summarise(rows: list) -> dict:
    """Mean and max over the rows of every figure."""
    stats = lambda values: {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}  # noqa: E731
    out = {when: {k: stats([r[when][k] for r in rows]) for k in rows[0][when]} for when in ("before", "after")}
    for key in ("modeled_speedup", "balanced"):
        out[key] = stats([r[key] for r in rows])
    return out


def ring_times(args) -> None:
    """The ``--ring`` part (torchrun, one GPU per process)."""
    import torch.distributed as dist

    from attention import gpu_tag
    from longctx import ring_attention, shard_sequence
    from ring import log, time_fn

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world, rank = dist.get_world_size(), dist.get_rank()
    seq, heads, head_dim = args.seq, 16, 128
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v, dout = (torch.randn(1, seq // world, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                                 generator=g).requires_grad_(i < 3) for i in range(4))

    def fwd_bwd_ms(ids: torch.Tensor) -> float:
        local = shard_sequence(ids.cuda()[None], 1, rank=rank, world_size=world)

        def step():
            q.grad = k.grad = v.grad = None
            ring_attention(q, k, v, group=dist.group.WORLD, document_ids=local).backward(dout)
        return time_fn(step)

    report = dict(world_size=world, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d"), seq_len=seq, heads=heads, head_dim=head_dim, rows=[])
    path = os.path.join(os.path.dirname(args.out), f"document_balance_ring_ws{world}_{gpu_tag()}.json")
    for mix in MIXES:
        ids = ids_from_lengths(document_lengths(mix, seq, 0), device="cpu")[0]
        # min_gain=1: balanced wherever that shortens the ring at all, to see what balancing
        # does to the time (the default leaves sequences that gain < 10% in pairs alone).
        balanced = balance_documents({"document_ids": ids[None]}, world_size=world, min_gain=1.0)["document_ids"][0]
        row = dict(mix=mix, packed_ms=fwd_bwd_ms(ids), balanced_ms=fwd_bwd_ms(balanced),
                   modeled_speedup=compare(ids, world, min_gain=1.0)["modeled_speedup"])
        row["speedup"] = row["packed_ms"] / row["balanced_ms"]
        report["rows"].append(row)
        log(f"[ring ws{world}] {mix}: packed {row['packed_ms']:.1f} ms, balanced {row['balanced_ms']:.1f} ms, "
            f"{row['speedup']:.2f}x (modeled {row['modeled_speedup']:.2f}x)")
        if rank == 0:
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    log(f"wrote {path}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=128 * 1024)
    ap.add_argument("--seeds", type=int, default=3, help="seeded draws of each synthetic mix")
    ap.add_argument("--no-corpus", action="store_true", help="skip the default-corpus windows")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT") or os.path.join(HERE, "results"),
                                                  "document_balance.json"))
    ap.add_argument("--min-gain", type=float, default=MIN_GAIN, help="balance_documents(min_gain=)")
    ap.add_argument("--ring", action="store_true", help="time the GPU ring instead (under torchrun)")
    args = ap.parse_args()
    if args.ring:
        ring_times(args)
        return
    torch.set_num_threads(1)  # the timing: one core, as in a data-loading path beside training
    report = dict(seq_len=args.seq, tile=TILE, min_gain=args.min_gain, host=platform.processor() or platform.machine(),
                  torch=torch.__version__, mixes={}, corpus={}, timing_ms={})
    print("means over the sequences; rank max/mean: max over them; speed-up: ring tiles before / after")
    print(f"{'data':24s} {'P':>2s}  {'rank max/mean':>14s}  {'ring cost':>13s}  {'ring cost, tiles':>16s}  "
          f"{'masked tiles':>15s}  {'full tiles':>15s}  {'one-doc blocks':>14s}  {'speed-up (min)':>14s}  balanced")

    def show(name, world_size, stats):
        b, a = stats["before"], stats["after"]
        print(f"{name:24s} {world_size:2d}  {b['rank_imbalance']['max']:5.3f} -> {a['rank_imbalance']['max']:5.3f}  "
              f"{b['ring_cost']['mean']:5.3f} -> {a['ring_cost']['mean']:5.3f}  "
              f"{b['ring_cost_tiles']['mean']:7.3f} -> {a['ring_cost_tiles']['mean']:5.3f}  "
              f"{b['masked_tiles']['mean']:6.0f} -> {a['masked_tiles']['mean']:6.0f}  "
              f"{b['full_tiles']['mean']:6.0f} -> {a['full_tiles']['mean']:6.0f}  "
              f"{b['one_document_blocks']['mean']:5.1f} -> {a['one_document_blocks']['mean']:4.1f}  "
              f"{stats['modeled_speedup']['mean']:5.2f} ({stats['modeled_speedup']['min']:.2f})  "
              f"{stats['balanced']['mean']:4.0%}", flush=True)

    for mix in MIXES:
        for world_size in WORLD_SIZES:
            rows = [compare(ids_from_lengths(document_lengths(mix, args.seq, seed), device="cpu")[0], world_size,
                            args.min_gain) for seed in range(args.seeds)]
            report["mixes"][f"{mix} P={world_size}"] = dict(seeds=args.seeds, **summarise(rows))
            show(f"{mix} ({args.seeds} seeds)", world_size, report["mixes"][f"{mix} P={world_size}"])
    if not args.no_corpus:
        windows = corpus_windows(args.seq)
        several = [w for w in windows if w.unique().numel() > 1]
        report["corpus"]["windows"], report["corpus"]["windows_with_several_documents"] = len(windows), len(several)
        for world_size in WORLD_SIZES:
            stats = summarise([compare(w, world_size, args.min_gain) for w in several])
            report["corpus"][f"P={world_size}"] = stats
            show(f"stdlib ({len(several)} windows)", world_size, stats)
    for seq in (args.seq, 1 << 20):
        for mix in MIXES:
            ids = ids_from_lengths(document_lengths(mix, seq, 0), device="cpu")[0]
            report["timing_ms"][f"{mix} S={seq} P=8"] = ms = time_ms(ids, 8, repeats=7)
            print(f"balance_permutation {mix} S={seq} P=8: {ms:.1f} ms", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
