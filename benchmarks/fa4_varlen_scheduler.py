"""FlashAttention-4's varlen tile lookup against the segment count (issue 40, short documents).

    python benchmarks/fa4_varlen_scheduler.py --out DIR        # one GPU, FA4 installed

FA4's single-tile varlen scheduler finds each tile's segment by a scan over the segments,
and only above ``interface.BIN_BATCH_SEARCH_THRESH`` segments (256 in 4.0.0b36; upstream
calls it tunable) builds a lookup aid first (two small kernels). With 256-token documents a
rank of a CP = 2 group holds exactly 256 segments: this times one causal varlen forward and
backward of such shards (H = 16, D = 128, bf16, one GPU, CUDA events over back-to-back
reps) with the threshold as shipped and with it at 0 (the aid always), for several segment
counts and lengths. Writes DIR/fa4_varlen_scheduler.json.
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


def causal_varlen_fwd_bwd(iface, q, k, v, dout, cu, max_len):
    """One causal varlen forward and backward through FA4's entry points (segments ``cu``)."""
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len)
    out, lse = iface._flash_attn_fwd(q, k, v, causal=True, return_lse=True, **kw)[:2]
    iface._flash_attn_bwd(q, k, v, out, dout, lse, q.shape[-1] ** -0.5, True, **kw)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["256x128", "256x256", "256x512", "1024x64", "1024x128"],
        help="LENxCOUNT: COUNT documents of LEN tokens",
    )
    parser.add_argument("--thresholds", nargs="+", type=int, default=[256, 0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    from flash_attn.cute import interface as iface

    shipped = iface.BIN_BATCH_SEARCH_THRESH
    rows = []
    for case in args.cases:
        length, count = (int(x) for x in case.split("x"))
        n = length * count
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, dout = (torch.randn(n, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        cu = torch.arange(0, n + 1, length, device="cuda", dtype=torch.int32)
        row = dict(doc_len=length, documents=count, tokens=n)
        for threshold in args.thresholds:
            iface.BIN_BATCH_SEARCH_THRESH = threshold
            fn = lambda: causal_varlen_fwd_bwd(iface, q, k, v, dout, cu, length)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            row[f"ms_threshold_{threshold}"] = events_ms(fn, args.reps)
        iface.BIN_BATCH_SEARCH_THRESH = shipped
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = dict(gpu=torch.cuda.get_device_name(), shipped_threshold=shipped, H=16, D=128, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fa4_varlen_scheduler.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
