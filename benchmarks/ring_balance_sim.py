"""Per-rank compute of the document-masked zigzag ring, with and without load balancing,
simulated on one GPU.

    python benchmarks/ring_balance_sim.py                     # S = 128K, P = 2, 4, 8: ~1 min on one H200
    python benchmarks/ring_balance_sim.py --seq-len 524288 --worlds 8

The ring runs in lock-step: each step lasts as long as its slowest rank's block, so what
load balancing buys is the drop of the sum over steps of the slowest block. This script
runs, one after another on a single GPU, exactly the blocks each rank of a P-rank ring
computes (``longctx.ring._ring_blocks``: the same skipping, the same plain-vs-document
kernel choice, the same slices), forward and backward, and times every block alone with
CUDA events (the lock-step estimate: launch and block-map costs fully exposed) and each
rank's blocks back to back (the slowest rank: those costs overlap the GPU queue).
Communication is left out (on NVLink the ring hides it behind the blocks;
benchmarks/results/ring_ws2_h200.json).
Inputs: S = 128K tokens, bf16, H=16, D=128, the document mixes of
benchmarks/document_attention.py, "packed" as they come, or balanced by
``longctx.balance_documents`` before sharding: "default" with its default ``min_gain``
(a sequence whose predicted lock-step gain is smaller stays packed; the committed
results were taken at 1.1, the default is now 1.2; CausalLMModule also needs 32K tokens
per rank) and "forced" (``min_gain=1.0``). Also reported: the visible-pair imbalance
(``longctx.layouts.document_work_per_rank``), the lock-step ring time (sum over steps of
the slowest rank's block, timed block by block) and the balancing's own time.
Writes ring_balance_sim_<gpu>.json under $OUT (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from attention import gpu_tag  # noqa: E402
from ring import time_in_group  # noqa: E402
from document_attention import MIXES, document_lengths, ids_from_lengths  # noqa: E402
from longctx import balance_documents, shard_sequence  # noqa: E402
from longctx.kernels import attention_backward, attention_forward, resolve_backend  # noqa: E402
from longctx.layouts import document_work_per_rank  # noqa: E402
from longctx.ring import _document_ranges, _ring_blocks  # noqa: E402

S, H, D = 128 * 1024, 16, 128
DEVICE = "cuda"
# "packed": as the data comes; "default": balance_documents as CausalLMModule calls it;
# "forced": balanced even where the pair count predicts less than a 10% gain.
VARIANTS = (("packed", None), ("default", {}), ("forced", dict(min_gain=1.0)))


def rank_blocks(q, k, v, dout, ids, world, rank, ranges, backends=None):
    """One callable per ring step: forward + backward of the block `rank` computes at that
    step of a `world`-rank zigzag ring (a no-op for a skipped step). ``backends``: (plain,
    document-masked) kernels instead of what "auto" picks."""
    s_local = q.shape[1] // world
    shards = [[shard_sequence(t, 1, rank=r, world_size=world, layout="zigzag") for t in (k, v, ids)]
              for r in range(world)]
    q_r, dout_r, ids_r = (shard_sequence(t, 1, rank=rank, world_size=world, layout="zigzag")
                          for t in (q, dout, ids))
    plain, masked = backends or (resolve_backend("auto", q_r, q_r, True),
                                 resolve_backend("auto", q_r, q_r, True, documents=True))

    def make(step, block):
        if block is None:
            return lambda: None
        rows, cols, causal, needs_ids = block
        k_s, v_s, ids_s = shards[(rank - step) % world]
        backend = masked if needs_ids else plain
        docs = dict(q_document_ids=ids_r[:, rows], k_document_ids=ids_s[:, cols]) if needs_ids else {}
        qb, kb, vb, dob = q_r[:, rows], k_s[:, cols], v_s[:, cols], dout_r[:, rows]

        def run():
            out, lse = attention_forward(qb, kb, vb, causal=causal, backend=backend, **docs)
            attention_backward(dob, qb, kb, vb, out, lse, causal=causal, backend=backend, **docs)
        return run

    blocks = _ring_blocks(rank, world, "zigzag", True, s_local, ranges)
    return [make(step, block) for step, block in enumerate(blocks)]


def time_ms(fn):
    return time_in_group(fn, None, warmup=1, iters=5)


def main():
    global S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=S, help="full sequence length")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="ring sizes P")
    args = parser.parse_args()
    S = args.seq_len
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    suffix = "" if S == 128 * 1024 else f"_{S // 1024}k"
    path = os.path.join(out_dir, f"ring_balance_sim_{gpu_tag()}{suffix}.json")
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, S=S, H=H, D=D, rows=[])
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, H, D, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(4))
    for mix in MIXES:
        ids = ids_from_lengths(document_lengths(mix, S), device=DEVICE)
        for world in args.worlds:
            row = dict(mix=mix, world=world)
            for name, options in VARIANTS:
                if options is None:
                    ids_used, tensors = ids, [q, k, v, dout]
                else:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    batch = balance_documents({"document_ids": ids}, world_size=world, **options)
                    torch.cuda.synchronize()
                    row[f"{name}_balance_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
                    perm = batch["position_ids"][0]  # the arange it added, permuted: the order
                    if torch.equal(perm, torch.arange(S, device=perm.device)):
                        row[name] = "left packed"
                        continue
                    ids_used, tensors = batch["document_ids"], [t[:, perm] for t in (q, k, v, dout)]
                work = document_work_per_rank(ids_used, world)
                ranges = torch.stack([_document_ranges(shard_sequence(ids_used, 1, rank=r, world_size=world,
                                                                      layout="zigzag")) for r in range(world)]).cpu()
                steps = [rank_blocks(*tensors, ids_used, world, r, ranges) for r in range(world)]
                # Each block alone (the GPU idle before it: launch and block-map costs fully
                # exposed), and each rank's blocks back to back (those costs overlap the queue).
                rank_ms = [[time_ms(block) for block in rank_steps] for rank_steps in steps]
                lockstep = sum(max(rank_ms[r][s] for r in range(world)) for s in range(world))
                totals = [time_ms(lambda blocks=rank_steps: [b() for b in blocks]) for rank_steps in steps]
                row[name] = dict(rank_ms=[round(x, 2) for x in totals], max_rank_ms=round(max(totals), 2),
                                 lockstep_ms=round(lockstep, 2),
                                 time_imbalance=round(max(totals) / statistics.mean(totals), 3),
                                 work_imbalance=round(float(work.max() / work.float().mean()), 3))
            for name, _ in VARIANTS[1:]:
                if isinstance(row[name], dict):
                    row[f"{name}_speedup"] = round(row["packed"]["lockstep_ms"] / row[name]["lockstep_ms"], 3)
                    row[f"{name}_speedup_max_rank"] = round(row["packed"]["max_rank_ms"] / row[name]["max_rank_ms"], 3)
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
