"""Attention kernel benchmark on one GPU: our Triton kernels vs FlashAttention-2 and cuDNN.

    python benchmarks/attention.py            # full grid, < 5 min on an H100/H200
    python benchmarks/attention.py --quick    # smoke run (1K/4K, split backward only)

bf16, B=1, H=16, D in {128, 64}, causal and full, S in {1K, 4K, 16K, 64K}. Providers:
  triton         longctx.kernels.triton_attention (split dK/dV + dQ backward)
  triton-atomic  same forward, dQ accumulated in fp32 inside the dK/dV kernel (TMA bulk
                 reduce-add on Hopper+, per-thread atomics elsewhere)
  sdpa-flash     F.scaled_dot_product_attention, SDPBackend.FLASH_ATTENTION
  sdpa-cudnn     F.scaled_dot_product_attention, SDPBackend.CUDNN_ATTENTION
  flash, cudnn   our vendor wrappers (longctx.kernels.vendor) around the same aten ops
FLOPs: forward 4*S*S*D*H*B (half for causal); forward+backward 3.5x that (backward 2.5x).

Order of work: correctness first (bf16 vs a float64 reference, outputs poisoned with NaN
so unwritten elements show), then timing (CUDA events, warm-up excluded, median) with
sequence lengths ascending so a time-budget cut keeps every (D, causal) at short lengths.
Every provider/shape failure is caught and recorded; the JSON is rewritten after each
shape, so even a run cut short leaves results. Output: $OUT (default benchmarks/results/)
/attention_<gpu>.json and .png, and a summary table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, ROOT)

from longctx.kernels import (  # noqa: E402
    attention_backward,
    attention_forward,
    vendor,  # noqa: E402
)
from longctx.kernels import triton_attention as ta  # noqa: E402

PROVIDERS = ["triton", "triton-atomic", "sdpa-flash", "sdpa-cudnn", "flash", "cudnn"]


# ----------------------------------------------------------------------------- helpers


def flops(B, H, S, D, causal, mode):
    f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return f * (3.5 if mode == "fwd_bwd" else 1.0)


def bench_ms(fn, budget_s=0.3, min_reps=3, max_reps=50):
    """Median ms per call; `fn` has already run once (compile/autotune excluded)."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    est = s.elapsed_time(e) / 1e3
    return events_ms(fn, int(min(max_reps, max(min_reps, budget_s / max(est, 1e-6)))))


def events_ms(fn, reps):
    """Median ms of ``reps`` runs of ``fn`` back to back, CUDA events between them (the host
    queues ahead of the GPU, as in training)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def poison_allocator(nbytes=1 << 30):
    """Fill reusable allocator blocks with NaN: kernels that skip elements get caught."""
    x = torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del x


def reference(q, k, v, dout, causal, scale):
    """out, lse, dq, dk, dv in float64 through the library's reference backend (itself
    tested against float64 autograd in tests/kernels/test_triton_kernels.py)."""
    q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=scale, backend="torch")
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, backend="torch")
    return out, lse, dq, dk, dv


def rel_err(got, want):
    got = got.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm()).item()


# ----------------------------------------------------------------------------- providers


def make_step(provider, q, k, v, dout, causal, scale, mode):
    """A zero-argument callable running one forward (or forward+backward)."""
    if provider.startswith("triton"):
        bwd_mode = "atomic" if provider == "triton-atomic" else "split"

        def step():
            ta.BWD_MODE = bwd_mode
            out, lse = ta.forward(q, k, v, causal, scale)
            if mode == "fwd_bwd":
                ta.backward(dout, q, k, v, out, lse, causal, scale)

        return step

    if provider in ("flash", "cudnn"):

        def step():
            out, lse = vendor.forward(q, k, v, causal, scale, which=provider)
            if mode == "fwd_bwd":
                vendor.backward(dout, q, k, v, out, lse, causal, scale, which=provider)

        return step

    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdp = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[provider]
    # Same (B, S, H, D) storage as ours, viewed as (B, H, S, D): no copies on either side.
    qg, kg, vg = (t.detach().requires_grad_(mode == "fwd_bwd") for t in (q, k, v))
    dout_t = dout.transpose(1, 2)

    def step():
        with sdpa_kernel([sdp]):
            out = F.scaled_dot_product_attention(
                qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=causal, scale=scale
            )
            if mode == "fwd_bwd":
                torch.autograd.grad(out, (qg, kg, vg), dout_t)

    return step


def run_provider_once(provider, q, k, v, dout, causal, scale):
    """(out, lse, dq, dk, dv) for the correctness check (vendor/triton paths only)."""
    if provider.startswith("triton"):
        ta.BWD_MODE = "atomic" if provider == "triton-atomic" else "split"
        out, lse = ta.forward(q, k, v, causal, scale)
        return (out, lse) + tuple(ta.backward(dout, q, k, v, out, lse, causal, scale))
    out, lse = vendor.forward(q, k, v, causal, scale, which=provider)
    return (out, lse) + tuple(vendor.backward(dout, q, k, v, out, lse, causal, scale, which=provider))


# ----------------------------------------------------------------------------- phases


def correctness(providers, D_list, causal_list, H):
    """bf16 vs float64 at the 1K grid shapes (this also tunes the 1K bucket) and at ragged,
    GQA, Sq != Sk shapes in the same buckets (so they reuse the tuned configs)."""
    shapes = [(1, 1024, 1024, H, H, D, c) for D in D_list for c in causal_list]
    shapes += [(1, 1000, 1000, H, H // 4, 128, True), (2, 700, 1000, H, H // 4, 64, False)]
    rows = []
    for shape in shapes:
        B, Sq, Sk, Hq, Hkv, D, causal = shape
        g = torch.Generator(device="cuda").manual_seed(Sq * 131 + D)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v, dout = mk(B, Sq, Hq, D), mk(B, Sk, Hkv, D), mk(B, Sk, Hkv, D), mk(B, Sq, Hq, D)
        scale = D**-0.5
        want = reference(q, k, v, dout, causal, scale)
        for p in providers:
            if p.startswith("sdpa"):
                continue  # the same aten kernels as our vendor wrappers
            row = {"provider": p, "shape": dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, causal=causal)}
            try:
                poison_allocator()
                t0 = time.time()
                got = run_provider_once(p, q, k, v, dout, causal, scale)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 2)  # includes compile/autotune
                row["errs"] = {n: rel_err(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want)}
                row["ok"] = all(e < 2e-2 for e in row["errs"].values())
            except Exception as e:  # noqa: BLE001 - record and go on
                row["ok"] = False
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                row["traceback"] = traceback.format_exc()[-4000:]
            rows.append(row)
            status = "ok" if row["ok"] else "FAIL"
            detail = row.get("errs") or row.get("error")
            print(f"[check] {p:14s} {shape}: {status} {detail}", flush=True)
        del q, k, v, dout, want
        torch.cuda.empty_cache()
    return rows


def probe_cudnn_native_gqa():
    """Does this build run cuDNN attention with Hkv < Hq directly (no K/V expansion)?"""
    try:
        g = torch.Generator(device="cuda").manual_seed(7)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v = mk(1, 256, 8, 64), mk(1, 256, 2, 64), mk(1, 256, 2, 64)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, True, False, scale=0.125
        )[0].transpose(1, 2)
        want = reference(q, k, v, torch.zeros_like(q), True, 0.125)[0]
        err = rel_err(out, want)
        return {"works": err < 2e-2, "rel_err": err}
    except Exception as e:  # noqa: BLE001
        return {"works": False, "error": f"{type(e).__name__}: {e}"[:500]}


def profile_breakdown(S, D, H, causal, providers):
    """Per-kernel CUDA time of one fwd+bwd step (what limits the Triton path)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(3)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = mk(1, S, H, D), mk(1, S, H, D), mk(1, S, H, D), mk(1, S, H, D)
    out = {}
    for p in providers:
        try:
            step = make_step(p, q, k, v, dout, causal, D**-0.5, "fwd_bwd")
            step()
            torch.cuda.synchronize()
            iters = 3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    step()
                torch.cuda.synchronize()
            kernels = {}
            for evt in prof.key_averages():
                t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
                if t > 0:
                    kernels[evt.key[:120]] = round(t / iters / 1e3, 4)  # ms per step
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:10]
            out[p] = {"kernels_ms": dict(top), "total_ms": round(sum(kernels.values()), 4)}
        except Exception as e:  # noqa: BLE001
            out[p] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out


def autotune_choices():
    """The configs Triton's autotuner picked, per kernel and tuning key."""
    result = {}
    for name, kern in (
        ("fwd", ta.fwd_kernel),
        ("dkdv_split", ta.dkdv_split),
        ("dkdv_atomic", ta.dkdv_atomic),
        ("dq", ta.dq_tuned),
    ):
        cache = getattr(kern, "cache", {}) or {}
        result[name] = {str(k): str(v) for k, v in cache.items()}
    return result


# ----------------------------------------------------------------------------- output


def gpu_tag():
    name = torch.cuda.get_device_name()
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


def write_outputs(report, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"attention_{gpu_tag()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def ratios(results):
    """triton TFLOP/s divided by each vendor's, per shape and mode."""
    table = {}
    for r in results:
        if r.get("tflops"):
            table.setdefault((r["D"], r["causal"], r["S"], r["mode"]), {})[r["provider"]] = r["tflops"]
    out = {}
    for (D, causal, S, mode), row in sorted(table.items()):
        key = f"D{D}_{'causal' if causal else 'full'}_S{S}"
        for mine in ("triton", "triton-atomic"):
            for ref in ("sdpa-flash", "sdpa-cudnn"):
                if mine in row and ref in row:
                    out.setdefault(key, {}).setdefault(mode, {})[f"{mine}/{ref}"] = round(row[mine] / row[ref], 3)
    return out


def plot(report, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in report["results"] if r.get("tflops")]
    combos = [(D, c) for D in report["config"]["head_dims"] for c in report["config"]["causal"]]
    fig, axes = plt.subplots(2, len(combos), figsize=(4.2 * len(combos), 7.5), squeeze=False)
    for j, (D, causal) in enumerate(combos):
        for i, mode in enumerate(("fwd", "fwd_bwd")):
            ax = axes[i][j]
            for n, p in enumerate(PROVIDERS):
                pts = sorted(
                    (r["S"], r["tflops"])
                    for r in res
                    if r["D"] == D and r["causal"] == causal and r["mode"] == mode and r["provider"] == p
                )
                if pts:
                    ax.plot(
                        [s for s, _ in pts],
                        [t for _, t in pts],
                        marker="o",
                        color=f"C{n}",
                        linewidth=2.5 if p.startswith("triton") else 1.3,
                        label=p,
                    )
            ax.set_xscale("log", base=2)
            ax.set_title(f"D={D} {'causal' if causal else 'full'} {mode.replace('_', '+')}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[1][0].legend(fontsize=8)  # the fwd+bwd row has every provider
    fig.suptitle(f"attention, bf16, B=1, H={report['config']['H']} — {report['device']}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"attention_{gpu_tag()}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(report):
    res = {(r["D"], r["causal"], r["S"], r["mode"], r["provider"]): r for r in report["results"]}
    provs = [p for p in PROVIDERS if any(k[4] == p for k in res)]
    print("\nTFLOP/s (fwd | fwd+bwd); ratio columns: triton fwd+bwd / vendor fwd+bwd")
    print(f"{'D':>4} {'mode':>6} {'S':>6} | " + " | ".join(f"{p:>15}" for p in provs) + " | tri/flash tri/cudnn")
    shapes = sorted({k[:3] for k in res})
    for D, causal, S in shapes:
        cells = []
        for p in provs:
            f = res.get((D, causal, S, "fwd", p), {}).get("tflops")
            b = res.get((D, causal, S, "fwd_bwd", p), {}).get("tflops")
            fs = f"{f:6.0f}" if f else f"{'-':>6}"
            bs = f"{b:5.0f}" if b else f"{'-':>5}"
            cells.append(f"{fs} | {bs}".rjust(15))
        tb = res.get((D, causal, S, "fwd_bwd", "triton"), {}).get("tflops")
        rf = res.get((D, causal, S, "fwd_bwd", "sdpa-flash"), {}).get("tflops")
        rc = res.get((D, causal, S, "fwd_bwd", "sdpa-cudnn"), {}).get("tflops")
        r1 = f"{tb / rf:9.2f}" if tb and rf else f"{'-':>9}"
        r2 = f"{tb / rc:10.2f}" if tb and rc else f"{'-':>10}"
        print(f"{D:>4} {'causal' if causal else 'full':>6} {S:>6} | " + " | ".join(cells) + f" | {r1} {r2}")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: S in {1K, 4K}, no atomic variant")
    ap.add_argument("--seq", type=str, default=None, help="comma-separated sequence lengths")
    ap.add_argument("--head-dims", type=str, default="128,64")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--providers", type=str, default=",".join(PROVIDERS))
    ap.add_argument(
        "--time-budget",
        type=float,
        default=270.0,
        help="seconds; shapes left when it runs out are skipped (recorded as such)",
    )
    ap.add_argument("--no-profile", action="store_true")
    return ap.parse_args(argv)


def environment_report(B, H, seqs, head_dims, causal_list, providers):
    """The report's header: device, versions, the sweep's configuration, vendor probes."""
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "config": {
            "B": B,
            "H": H,
            "dtype": "bfloat16",
            "seq_lens": seqs,
            "head_dims": head_dims,
            "causal": causal_list,
            "providers": providers,
            "flops": "fwd 4*B*H*S*S*D (x0.5 causal); fwd_bwd 3.5x fwd",
        },
        "vendor_available": {w: vendor.is_available("cuda", w) for w in ("flash", "cudnn")},
        "vendor_native_gqa": dict(vendor.NATIVE_GQA),
        # triton-atomic adds dQ with TMA bulk reduce-adds where this is True, else with
        # per-thread fp32 atomics (LONGCTX_TRITON_TMA=0 forces the latter).
        "triton_dq_tma": ta.tma_available(torch.device("cuda")),
        "results": [],
    }


def time_row(p, mode, q, k, v, dout, causal, scale):
    """One provider and mode at one shape: first-call time, ms and TFLOP/s (or the error)."""
    B, S, H, D = q.shape
    row = {"D": D, "causal": causal, "S": S, "provider": p, "mode": mode}
    try:
        step = make_step(p, q, k, v, dout, causal, scale, mode)
        t0 = time.time()
        step()  # compile / autotune / cuDNN plan build, not timed
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.time() - t0, 2)
        ms = bench_ms(step)
        row["ms"] = round(ms, 4)
        row["tflops"] = round(flops(B, H, S, D, causal, mode) / (ms * 1e-3) / 1e12, 1)
    except Exception as e:  # noqa: BLE001 - record, keep going
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
    print(
        f"[time] D={D:3d} {'causal' if causal else 'full  '} S={S:6d} {p:14s} "
        f"{mode:7s} {row.get('ms', '-')} ms  {row.get('tflops', row.get('error', '-'))} "
        f"TFLOP/s",
        flush=True,
    )
    return row


def time_shape(providers, B, H, S, D, causal):
    """The rows of every provider and mode at one shape (fresh inputs, freed after)."""
    g = torch.Generator(device="cuda").manual_seed(S + D)
    mk = lambda: torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = mk(), mk(), mk(), mk()
    scale = 1.0 / math.sqrt(D)
    rows = []
    for p in providers:
        for mode in ("fwd", "fwd_bwd"):
            if p == "triton-atomic" and mode == "fwd":
                continue  # same forward kernel as "triton"
            rows.append(time_row(p, mode, q, k, v, dout, causal, scale))
    del q, k, v, dout
    torch.cuda.empty_cache()
    return rows


def refresh_summary(report, t_start):
    report["ratios"] = ratios(report["results"])
    report["autotune"] = autotune_choices()
    report["elapsed_s"] = round(time.time() - t_start, 1)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results")
    seqs = (
        [int(s) for s in args.seq.split(",")]
        if args.seq
        else ([1024, 4096] if args.quick else [1024, 4096, 16384, 65536])
    )
    head_dims = [int(d) for d in args.head_dims.split(",")]
    providers = [p for p in args.providers.split(",") if p]
    if args.quick:
        providers = [p for p in providers if p != "triton-atomic"]
    causal_list = [True, False]
    H, B = args.heads, 1

    report = environment_report(B, H, seqs, head_dims, causal_list, providers)
    report["cudnn_native_gqa_probe"] = probe_cudnn_native_gqa()
    print(
        f"{report['device']}  torch {report['torch']}  triton {report['triton']}  "
        f"vendor available {report['vendor_available']}",
        flush=True,
    )

    report["correctness"] = correctness(providers, head_dims, causal_list, H)
    report["correctness_s"] = round(time.time() - t_start, 1)
    write_outputs(report, out_dir)

    for S in seqs:
        for D in head_dims:
            for causal in causal_list:
                if time.time() - t_start > args.time_budget:
                    report["results"].append({"D": D, "causal": causal, "S": S, "skipped": "time budget"})
                    print(f"[skip] D={D} causal={causal} S={S}: time budget", flush=True)
                    continue
                report["results"].extend(time_shape(providers, B, H, S, D, causal))
                refresh_summary(report, t_start)
                write_outputs(report, out_dir)

    if not args.no_profile and time.time() - t_start < args.time_budget + 20:
        S_prof = 16384 if 16384 in seqs else seqs[-1]
        report["profile"] = {
            "shape": {"S": S_prof, "D": 128, "H": H, "causal": True},
            "per_provider": profile_breakdown(
                S_prof, 128, H, True, [p for p in providers if p != "flash" and p != "cudnn"]
            ),
        }
    refresh_summary(report, t_start)
    path = write_outputs(report, out_dir)
    try:
        png = plot(report, out_dir)
    except Exception as e:  # noqa: BLE001
        png = f"(plot failed: {e})"
    summary(report)
    print(f"\nwrote {path}\n      {png}\nelapsed {report['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
