"""Does the order of a varlen call's segments change FlashAttention-4's time? (issue 40)

    python benchmarks/fa4_segment_order.py --out DIR        # one GPU, FA4 installed

At P = 4 ranks with equal visible pairs ran FA4's backward at different speeds (long-tailed
mix: 6.58 ms on the rank whose causal call ends with the last 15K tokens of the 29K-token
document among 5 segments, 5.76 ms on a rank with 15 segments; README, "Scaling"). One guess: the kernel's tiles are
scheduled in segment order, so a long causal segment placed last starts its longest tiles
last and leaves a tail. This times one causal varlen forward and backward (H = 16, D = 128,
bf16, CUDA events over back-to-back reps) of each rank's local call of the balanced plan at
131,072 tokens, P = 4, with its segments as the plan has them, longest first, and longest
last (the same segments, rows permuted; same pairs). Writes DIR/fa4_segment_order_p<P>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from attention import events_ms  # noqa: E402
from fa4_varlen_scheduler import causal_varlen_fwd_bwd  # noqa: E402

from longctx import balance_documents  # noqa: E402
from longctx.data.document_mixes import document_ids, document_lengths  # noqa: E402
from longctx.documents import plan_documents  # noqa: E402


def causal_lengths(mix: str, seq: int, world: int) -> list:
    """Per rank: the segment lengths of the local (causal) call of the balanced plan."""
    ids = document_ids(document_lengths(mix, seq, seed=0))[None]
    balanced = balance_documents({"document_ids": ids}, world_size=world)["document_ids"]
    out = []
    for rank in range(world):
        call = plan_documents(balanced, world_size=world, rank=rank, exchange="ring").local_calls[0]
        out.append(torch.diff(call.segments.cu_seqlens_q.cpu()).tolist())
    return out


def time_order(iface, lengths: list, reps: int) -> float:
    n = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v, dout = (torch.randn(n, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    cu = cu.cuda()

    def step():
        causal_varlen_fwd_bwd(iface, q, k, v, dout, cu, max(lengths))

    step()
    torch.cuda.synchronize()
    return events_ms(step, reps)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--mixes", nargs="+", default=["longtail", "mean16k", "mean4k"])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    from flash_attn.cute import interface as iface

    rows = []
    for mix in args.mixes:
        for rank, lengths in enumerate(causal_lengths(mix, args.seq, args.world)):
            orders = {
                "plan": lengths,
                "longest_first": sorted(lengths, reverse=True),
                "longest_last": sorted(lengths),
            }
            row = dict(mix=mix, rank=rank, segments=len(lengths), longest=max(lengths), tokens=sum(lengths))
            row.update({f"ms_{name}": time_order(iface, order, args.reps) for name, order in orders.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = dict(gpu=torch.cuda.get_device_name(), world=args.world, seq=args.seq, H=16, D=128, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"fa4_segment_order_p{args.world}.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
