"""Could PyTorch's varlen vendor kernels run document-masked blocks? A probe on one GPU.

    python benchmarks/vendor_varlen.py          # ~2 min on one H200

A packed sequence whose documents are contiguous runs is, on one GPU, exactly a varlen
(cu_seqlens) batch. PyTorch exposes two varlen kernels with a log-sum-exp (what the ring's
merge needs): FlashAttention-2 (aten._flash_attention_forward/backward) and cuDNN
(aten._cudnn_attention_forward/backward, the nested-tensor path). This script checks both
against float64 (bf16 at 6K tokens, six documents, MHA and GQA: out, LSE and gradients) and
times forward+backward at S = 128K with the mixes of benchmarks/document_attention.py,
including the host-side cu_seqlens construction (one device sync) a real call would pay,
next to our Triton document kernels and flex_attention in the same run.
Writes vendor_varlen_<gpu>.json under $OUT (default benchmarks/results/).
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from attention import bench_ms, gpu_tag, rel_err  # noqa: E402
from document_attention import MIXES, document_lengths, flex_step, ids_from_lengths, ours_step  # noqa: E402

aten = torch.ops.aten
D = 128


def cu_seqlens(ids):
    """int32 offsets of the runs of equal ids in ids[0], and the longest run (host int)."""
    _, counts = torch.unique_consecutive(ids[0], return_counts=True)
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = counts.cumsum(0)
    return cu, int(counts.max())


def varlen_step(which, q, k, v, dout, ids):
    """Forward + backward through the vendor varlen op; returns (out, dq, dk, dv, lse (Hq, S))."""
    S, Hq, Hkv = q.shape[1], q.shape[2], k.shape[2]
    flat = lambda t, h: t.reshape(S, h, D)  # noqa: E731 - (1, S, H, D) -> (T, H, D), a view
    scale = 1.0 / math.sqrt(D)

    def step():
        cu, longest = cu_seqlens(ids)
        qf, kf, vf, dof = flat(q, Hq), flat(k, Hkv), flat(v, Hkv), flat(dout, Hq)
        if which == "flash":
            out, lse, rng, unused, _ = aten._flash_attention_forward(
                qf, kf, vf, cu, cu, longest, longest, 0.0, True, False, scale=scale
            )
            grads = aten._flash_attention_backward(
                dof, qf, kf, vf, out, lse, cu, cu, longest, longest, 0.0, True, rng, unused, scale=scale
            )
            lse_hs = lse  # (Hq, T)
        else:
            res = aten._cudnn_attention_forward(
                qf, kf, vf, None, cu, cu, longest, longest, True, 0.0, True, False, scale=scale
            )
            out, lse = res[0], res[1]
            grads = aten._cudnn_attention_backward(
                dof, qf, kf, vf, out, lse, res[6], res[7], None, cu, cu, longest, longest, 0.0, True, scale=scale
            )
            lse_hs = lse.reshape(S, Hq).t()  # (T, Hq, 1) -> (Hq, T)
        return (out.reshape(1, S, Hq, D), *(g.reshape(1, S, -1, D) for g in grads), lse_hs)

    return step


def reference(q, k, v, dout, ids):
    """float64 document-causal attention: out, dq, dk, dv and lse (Hq, S)."""
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = kd.repeat_interleave(group, 2), vd.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kk) / math.sqrt(D)
    i = torch.arange(q.shape[1], device=q.device)
    visible = (ids[0][:, None] == ids[0][None, :]) & (i[:, None] >= i[None, :])
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vv)
    grads = torch.autograd.grad(out, (qd, kd, vd), dout.double())
    return (out.detach(), *grads, torch.logsumexp(scores, -1)[0].detach())


def inputs(S, Hq, Hkv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


def check(which, Hq, Hkv):
    row = dict(provider=which, Hq=Hq, Hkv=Hkv)
    try:
        lengths = [700, 1500, 64, 1200, 900, 1780]
        q, k, v, dout = inputs(sum(lengths), Hq, Hkv, seed=0)
        ids = ids_from_lengths(lengths)
        want = reference(q, k, v, dout, ids)
        got = varlen_step(which, q, k, v, dout, ids)()
        names = ("out", "dq", "dk", "dv")
        row["rel_err"] = {n: rel_err(a, b) for n, a, b in zip(names, got, want)}
        row["lse_max_abs_err"] = (got[4].double() - want[4]).abs().max().item()
        row["ok"] = all(e < 2e-2 for e in row["rel_err"].values()) and row["lse_max_abs_err"] < 1e-2
    except Exception as e:  # noqa: BLE001 - record and go on
        row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"[:1000]
        row["traceback"] = traceback.format_exc()[-3000:]
    print(json.dumps(row), flush=True)
    return row


def main():
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    path = os.path.join(out_dir, f"vendor_varlen_{gpu_tag()}.json")
    report = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cudnn=torch.backends.cudnn.version(),
        check=[],
        timing=[],
    )
    for which in ("flash", "cudnn"):
        for Hq, Hkv in ((4, 4), (4, 2)):
            report["check"].append(check(which, Hq, Hkv))
    S = 128 * 1024
    for Hq, Hkv in ((16, 16), (32, 8)):
        for mix in MIXES:
            q, k, v, dout = inputs(S, Hq, Hkv, seed=1)
            ids = ids_from_lengths(document_lengths(mix, S))
            row = dict(mix=mix, Hq=Hq, Hkv=Hkv)
            providers = {
                "flash-varlen": lambda: varlen_step("flash", q, k, v, dout, ids),
                "cudnn-varlen": lambda: varlen_step("cudnn", q, k, v, dout, ids),
                "triton-doc": lambda: ours_step(q, k, v, dout, ids, "split"),
                "flex": lambda: flex_step(q, k, v, dout, ids),
            }
            for name, make in providers.items():
                try:
                    step = make()
                    step()
                    torch.cuda.synchronize()
                    row[name] = round(bench_ms(step, budget_s=1.0, min_reps=5, max_reps=30), 2)
                except Exception as e:  # noqa: BLE001
                    row[name] = f"error: {type(e).__name__}: {e}"[:300]
            print(json.dumps(row), flush=True)
            report["timing"].append(row)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
