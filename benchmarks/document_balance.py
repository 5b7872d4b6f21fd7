"""Load balance of document-masked zigzag context parallelism, before and after
``longctx.balance_documents``: pure arithmetic on document ids, CPU only.

    python benchmarks/document_balance.py                     # ~1 min (plus the corpus, once cached)
    python benchmarks/document_balance.py --seeds 1 --seq 16384 --no-corpus     # a few seconds

For P = 2, 4, 8 on the seeded mixes below (--seeds draws of each, S = --seq) and on the
windows of the default corpus that hold more than one document (the stdlib, tokenized as
train.py does by default), reports packed (as the data comes) vs balanced:

  rank max/mean  busiest rank's visible (query, key) pairs over the mean
                 (``DocumentPlan.imbalance``, = ``longctx.layouts.document_work_per_rank``);
  K/V moved      the K/V rows the ranks' ``DocumentPlan`` exchange in a forward, as a share
                 of the plain ring's (every rank receives the P - 1 other shards:
                 ``plan.moved / (P (P - 1) S / P)``); 0 when every document is whole on one rank;
  host ms        ``balance_permutation`` and ``plan_documents`` (one rank's plan, kept on the
                 CPU), one thread, median of --repeats.

Mixes: mean4k, mean16k, longtail (benchmarks/document_attention.py: uniform 2K-6K, uniform
8K-24K, lognormal sigma 1.5 mean ~4K), mean1k (uniform 512-1536) and docs256 (256 tokens
each). Prints a table and writes document_balance.json under $OUT or benchmarks/results/
(or --out).

    torchrun --nproc-per-node=N benchmarks/document_balance.py --ring     # GPUs, ~2 min

times the document-masked zigzag ring (``longctx.ring_attention`` with the step's
``DocumentPlan``, bf16, S = --seq, H = 16, D = 128, forward + backward, the slowest rank's
median) on each mix's ids (seed 0) as packed and balanced, and writes
document_balance_ring_ws<N>_<gpu>.json next to --out.
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


from longctx.balance import TOLERANCE, balance_documents, balance_permutation  # noqa: E402
from longctx.data.document_mixes import MIXES, document_ids, document_lengths  # noqa: E402
from longctx.documents import plan_documents  # noqa: E402

WORLD_SIZES = (2, 4, 8)


def mix_ids(mix: str, total: int, seed: int = 0) -> torch.Tensor:
    """(total,) int64 ids of the packed mix (on the CPU)."""
    return document_ids(document_lengths(mix, total, seed))


def ring_rows(seq_len: int, world_size: int, batch: int = 1) -> int:
    """K/V rows the plain ring moves in a forward: every rank receives the P - 1 other shards."""
    return world_size * (world_size - 1) * batch * (seq_len // world_size)


def measure(ids: torch.Tensor, world_size: int) -> dict:
    """Rank max/mean and the K/V share a ``DocumentPlan`` moves, for one full sequence."""
    plan = plan_documents(ids[None], world_size=world_size, rank=0)
    return dict(
        rank_imbalance=plan.imbalance, kv_moved=plan.moved / ring_rows(ids.numel(), world_size), kv_rows=plan.moved
    )


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def compare(ids: torch.Tensor, world_size: int, repeats: int = 0) -> dict:
    """Packed vs balanced figures of one sequence (and the host times where ``repeats``)."""
    batch = {"document_ids": ids[None], "index": torch.arange(ids.numel())[None]}
    balanced = balance_documents(batch, world_size=world_size)["document_ids"][0]
    row = {"packed": measure(ids, world_size), "balanced": measure(balanced, world_size)}
    if repeats:
        row["balance_ms"] = median_ms(lambda: balance_permutation(ids, world_size), repeats)
        row["plan_ms"] = median_ms(lambda: plan_documents(balanced[None], world_size=world_size, rank=0), repeats)
    return row


def summarise(rows: list) -> dict:
    """Mean, min and max over the rows of every figure."""
    stats = lambda values: {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}  # noqa: E731
    out = {when: {k: stats([r[when][k] for r in rows]) for k in rows[0][when]} for when in ("packed", "balanced")}
    for key in ("balance_ms", "plan_ms"):
        if key in rows[0]:
            out[key] = stats([r[key] for r in rows])
    out["over_tolerance"] = sum(r["balanced"]["rank_imbalance"] > TOLERANCE for r in rows)
    return out


def corpus_windows(seq_len: int) -> list:
    """Document ids of every training window of the default corpus, as train.py builds it."""
    from longctx.data import LongDocumentDataModule

    dm = LongDocumentDataModule("stdlib", seq_len=seq_len, batch_size=1, val_fraction=0.0)
    dm.prepare_data()
    dm.setup("fit")
    return [dm.train_dataset[i]["document_ids"] for i in range(len(dm.train_dataset))]


def ring_times(args) -> None:
    """The ``--ring`` part (torchrun, one GPU per process)."""
    import torch.distributed as dist
    from attention import gpu_tag
    from ring import log, time_fn

    from longctx import ring_attention

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world, rank = dist.get_world_size(), dist.get_rank()
    seq, heads, head_dim = args.seq, 16, 128
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v, dout = (
        torch.randn(1, seq // world, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(
            i < 3
        )
        for i in range(4)
    )

    def fwd_bwd_ms(ids: torch.Tensor) -> float:
        plan = plan_documents(ids.cuda()[None], world_size=world, rank=rank)  # once per step, as in training

        def step():
            q.grad = k.grad = v.grad = None
            ring_attention(q, k, v, group=dist.group.WORLD, document_ids=plan).backward(dout)

        return time_fn(step)

    report = dict(
        world_size=world,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        seq_len=seq,
        heads=heads,
        head_dim=head_dim,
        rows=[],
    )
    path = os.path.join(os.path.dirname(args.out), f"document_balance_ring_ws{world}_{gpu_tag()}.json")
    for mix in args.mixes:
        ids = mix_ids(mix, seq, 0)
        balanced = balance_documents({"document_ids": ids[None]}, world_size=world)["document_ids"][0]
        row = dict(mix=mix, packed_ms=fwd_bwd_ms(ids), balanced_ms=fwd_bwd_ms(balanced), **compare(ids, world))
        row["speedup"] = row["packed_ms"] / row["balanced_ms"]
        report["rows"].append(row)
        log(
            f"[ring ws{world}] {mix}: packed {row['packed_ms']:.1f} ms, balanced {row['balanced_ms']:.1f} ms, "
            f"{row['speedup']:.2f}x (rank max/mean {row['packed']['rank_imbalance']:.3f} -> "
            f"{row['balanced']['rank_imbalance']:.3f})"
        )
        if rank == 0:
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    log(f"wrote {path}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=128 * 1024, help="full sequence length S")
    ap.add_argument("--seeds", type=int, default=3, help="seeded draws of each synthetic mix")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLD_SIZES), help="CP sizes P")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats of balance and plan (median)")
    ap.add_argument("--no-corpus", action="store_true", help="skip the default-corpus windows")
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT") or os.path.join(HERE, "results"), "document_balance.json")
    )
    ap.add_argument("--ring", action="store_true", help="time the GPU ring instead (under torchrun)")
    args = ap.parse_args(argv)
    if args.ring:
        ring_times(args)
        return
    torch.set_num_threads(1)  # the timing: one core, as in a data-loading path beside training
    report = dict(
        seq_len=args.seq,
        tolerance=TOLERANCE,
        host=platform.processor() or platform.machine(),
        torch=torch.__version__,
        mixes={},
        corpus={},
    )
    print(
        f"S = {args.seq}; rank max/mean: max over the sequences; K/V moved: mean share of the plain "
        f"ring's rows; host ms: mean of the medians"
    )
    print(
        f"{'data':22s} {'P':>2s}  {'rank max/mean':>15s}  {'K/V moved':>15s}  {'balance ms':>10s}  "
        f"{'plan ms':>8s}  over {TOLERANCE}"
    )

    def show(name, world_size, stats):
        p, b = stats["packed"], stats["balanced"]
        times = (
            f"{stats['balance_ms']['mean']:10.1f}  {stats['plan_ms']['mean']:8.1f}"
            if "balance_ms" in stats
            else f"{'':10s}  {'':8s}"
        )
        print(
            f"{name:22s} {world_size:2d}  {p['rank_imbalance']['max']:6.3f} -> {b['rank_imbalance']['max']:5.3f}  "
            f"{p['kv_moved']['mean']:6.1%} -> {b['kv_moved']['mean']:5.1%}  {times}  "
            f"{stats['over_tolerance']}",
            flush=True,
        )

    for mix in args.mixes:
        for world_size in args.worlds:
            rows = [compare(mix_ids(mix, args.seq, seed), world_size, args.repeats) for seed in range(args.seeds)]
            report["mixes"][f"{mix} P={world_size}"] = dict(seeds=args.seeds, **summarise(rows))
            show(f"{mix} ({args.seeds} seeds)", world_size, report["mixes"][f"{mix} P={world_size}"])
    if not args.no_corpus:
        windows = corpus_windows(args.seq)
        several = [w for w in windows if w.unique().numel() > 1]
        report["corpus"]["windows"], report["corpus"]["windows_with_several_documents"] = len(windows), len(several)
        for world_size in args.worlds:
            stats = summarise([compare(w.long(), world_size) for w in several])
            report["corpus"][f"P={world_size}"] = stats
            show(f"stdlib ({len(several)} windows)", world_size, stats)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
