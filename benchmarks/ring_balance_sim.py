"""Per-rank compute of the document-masked zigzag ring, with and without load balancing,
simulated on one GPU.

    python benchmarks/ring_balance_sim.py        # ~2 min on one H200

A ring step is bounded by its slowest rank, so what load balancing buys is the drop of the
slowest rank's attention time. This script runs, one rank after another on a single GPU,
exactly the blocks each rank of a P-rank ring computes (``longctx.ring._ring_blocks``:
the same skipping, the same plain-vs-document kernel choice, the same slices), forward and
backward, and times each rank's total with CUDA events. Communication is left out (on
NVLink the ring hides it behind the blocks; benchmarks/results/ring_ws2_h200.json).
Inputs: S = 128K tokens, bf16, H=16, D=128, the document mixes of
benchmarks/document_attention.py; "balanced" applies ``longctx.balance_permutation`` to the
full sequence before sharding. Also reported: the visible-pair imbalance
(``longctx.layouts.document_work_per_rank``) and the permutation's own time on the GPU.
Writes ring_balance_sim_<gpu>.json under $OUT (default benchmarks/results/).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from attention import gpu_tag  # noqa: E402
from document_attention import MIXES, document_lengths, ids_from_lengths  # noqa: E402
from longctx import balance_permutation, shard_sequence  # noqa: E402
from longctx.kernels import attention_backward, attention_forward, resolve_backend  # noqa: E402
from longctx.layouts import document_work_per_rank  # noqa: E402
from longctx.ring import _document_ranges, _ring_blocks  # noqa: E402

S, H, D = 128 * 1024, 16, 128


def rank_step(q, k, v, dout, ids, world, rank, ranges):
    """Forward + backward of every block `rank` computes in a `world`-rank zigzag ring
    (K/V shards of every rank given in full; the ring would receive them one per step)."""
    s_local = q.shape[1] // world
    shard = lambda t: shard_sequence(t, 1, rank=rank, world_size=world, layout="zigzag")  # noqa: E731
    shards = [[shard_sequence(t, 1, rank=r, world_size=world, layout="zigzag") for t in (k, v, ids)]
              for r in range(world)]
    q_r, dout_r, ids_r = shard(q), shard(dout), shard(ids)
    blocks = _ring_blocks(rank, world, "zigzag", True, s_local, ranges)
    plain = resolve_backend("auto", q_r, q_r, True)
    masked = resolve_backend("auto", q_r, q_r, True, documents=True)

    def step():
        for s, block in enumerate(blocks):
            if block is None:
                continue
            rows, cols, causal, needs_ids = block
            k_s, v_s, ids_s = shards[(rank - s) % world]
            backend = masked if needs_ids else plain
            docs = dict(q_document_ids=ids_r[:, rows], k_document_ids=ids_s[:, cols]) if needs_ids else {}
            qb, kb, vb = q_r[:, rows], k_s[:, cols], v_s[:, cols]
            out, lse = attention_forward(qb, kb, vb, causal=causal, backend=backend, **docs)
            attention_backward(dout_r[:, rows], qb, kb, vb, out, lse, causal=causal, backend=backend, **docs)
    return step


def time_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    path = os.path.join(out_dir, f"ring_balance_sim_{gpu_tag()}.json")
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, S=S, H=H, D=D, rows=[])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for mix in MIXES:
        ids = ids_from_lengths(document_lengths(mix, S))
        for world in (2, 4, 8):
            row = dict(mix=mix, world=world)
            for name in ("zigzag", "balanced"):
                if name == "balanced":
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    perm = balance_permutation(ids[0], world)
                    torch.cuda.synchronize()
                    row["permutation_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
                    ids_used = ids[:, perm]
                    tensors = [t[:, perm] for t in (q, k, v, dout)]
                else:
                    ids_used, tensors = ids, [q, k, v, dout]
                work = document_work_per_rank(ids_used, world)
                ranges = torch.stack([_document_ranges(shard_sequence(ids_used, 1, rank=r, world_size=world,
                                                                      layout="zigzag")) for r in range(world)]).cpu()
                ms = [time_ms(rank_step(*tensors[:3], tensors[3], ids_used, world, r, ranges))
                      for r in range(world)]
                row[name] = dict(rank_ms=[round(x, 2) for x in ms], max_ms=round(max(ms), 2),
                                 time_imbalance=round(max(ms) / statistics.mean(ms), 3),
                                 work_imbalance=round(float(work.max() / work.float().mean()), 3))
            row["speedup_of_slowest_rank"] = round(row["zigzag"]["max_ms"] / row["balanced"]["max_ms"], 3)
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
