"""Largest trainable sequence length of a preset on 1, 2, 4, ... GPUs, +/- activation checkpointing.

Run (driver; launches its own jobs, do NOT wrap in torchrun):
    python benchmarks/max_context.py [--preset gpt-350m] [--gpus 4] [--budget-s 300]
    python benchmarks/max_context.py --plot benchmarks/results/max_context_ws4.json   # CPU ok
    python benchmarks/max_context.py --dry-run      # tiny preset, CPU, gloo: tests the pipeline

Method (measure cheaply, predict, then verify what the clock allows):

1. One *job* per (P, checkpointing): a fresh process group of P GPUs (``torchrun
   --standalone`` under ``CUDA_VISIBLE_DEVICES``; plain python for P=1). The driver packs
   jobs onto the GPUs so that disjoint ones run at the same time.
2. A job builds the full model (bf16 autocast, fp32 weights, fused AdamW, DDP for P>1,
   ring attention over the P ranks, zigzag layout) and runs real training steps at three
   modest per-GPU lengths that surely fit (4K/8K/16K tokens per GPU without
   checkpointing, 8K/16K/32K with). Each length: one step (new shapes, optimizer state
   exists from the warm-up), then ``reset_peak_memory_stats`` and a measured step:
   peak = ``max_memory_allocated`` (max over ranks), step time.
3. Peak memory is linear in the per-GPU length S/P (weights + grads + AdamW + DDP
   buckets + one loss chunk are constant; activations, ring buffers, attention
   outputs/LSE, dQ/dK/dV accumulators scale with S/P; nothing is quadratic), so fit
   ``peak = a + b * S/P`` and predict the largest grid length (2^k and 1.5 * 2^k) with a
   predicted peak under ``--mem-frac`` (92%) of the device's total memory. The 8% left
   covers what ``max_memory_allocated`` does not see: CUDA context, NCCL buffers,
   allocator slack (``expandable_segments`` is on; the non-PyTorch part is recorded).
4. Step time is fitted as ``c1 * S/P + c2 * (S/P) * S`` (matmuls linear, attention
   quadratic; recompute included when checkpointing), with ``c2`` at least the attention
   FLOPs at the GPU's peak rate (a noisy fit at short lengths must not call a quadratic
   step linear). If the predicted step at the maximum takes <= ``--verify-max-s``
   (default 45 s, so that 1/2/4 GPUs finish in ~4 minutes on 4 x H200 within the
   ``--budget-s`` 300 s deadline), one real step at that length VERIFIES it, then the next
   grid length is tried (expected out of memory: that brackets the maximum). If it is too
   slow (checkpointing: a 1M-token 350M step on 4 GPUs takes ~2 min), the job measures the
   largest grid length it can afford in time instead ("extend") and refits with it, so
   the prediction rests on a point 1/3-1/2 of the way out; the row then says "predicted".
5. Collective safety: an out-of-memory inside a ring step of P>1 would leave the other
   ranks blocked in NCCL. So every job is its own process group in its own subprocess:
   the rank that runs out of memory writes its record and ``os._exit``s, torchrun tears
   the others down at once, and the driver (which never touches CUDA) carries on; a
   failed verification of P>1 is retried one grid length lower in a new job when time
   allows. P=1 steps have no collectives and catch the error in-process. Every decision
   inside a job is taken on rank 0 from all-reduced values and broadcast.
6. Which buffers dominate: at the largest fitting length rank 0 records one step with
   ``torch.cuda.memory._record_memory_history``; the trace is replayed to the moment of
   peak and the live blocks are grouped by the innermost source line of this repository
   (per token and per token per layer). The slope ``b`` per token per layer is in the
   table; if memory is O(S/P) the fitted lines of all P nearly coincide in the right panel
   of the plot (P>1 adds the ring's K/V and dK/dV buffers, also O(S/P)) and the maximum
   grows linearly with P.

Records (JSON lines, written by each job after every measurement) and each job's log live
in ``$OUT/max_context_ws{N}_records/``; the driver rewrites ``$OUT/max_context_ws{N}.json``
(default OUT=benchmarks/results) after every new record and plots it at the end.
"""
from __future__ import annotations

import os

# Before torch initialises CUDA: long sequences allocate huge, differently sized blocks;
# expandable segments keep fragmentation (reserved - allocated) small.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

from longctx.bench.step import LossModule, mean_step_seconds, train_step  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEP_FILE = train_step.__code__.co_filename  # as allocator traces name it
GiB = 2**30
OOM_EXIT = 17
ONE_M = 1 << 20

# ---- pure logic: grid, fits, decisions (CPU-testable) ---------------------------------------


def grid_lengths(lo: int, hi: int, multiple: int = 1) -> list[int]:
    """Powers of two and their halfway points (2^k, 1.5 * 2^k) in [lo, hi], divisible by ``multiple``."""
    out = set()
    k = 1
    while (1 << k) <= hi:
        for s in (1 << k, 3 << (k - 1)):
            if lo <= s <= hi and s % multiple == 0:
                out.add(s)
        k += 1
    return sorted(out)


def fit_linear(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b * x``; returns (a, b, max relative residual)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError(f"need >= 2 distinct lengths to fit memory, got {xs}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    res = max(abs(a + b * x - y) / y for x, y in zip(xs, ys))
    return a, b, res


def fit_time(points: list[tuple[int, int, float]], c2_min: float = 0.0) -> tuple[float, float]:
    """Non-negative least squares of ``t = c1 * s_local + c2 * s_local * s_total``, ``c2 >= c2_min``.

    ``c2_min`` is the attention term at the GPU's peak FLOP/s: a step cannot be faster, and
    it keeps a noisy fit at short lengths from predicting a quadratic step as linear.
    """
    rows = [(sl, sl * st, t) for sl, st, t in points]
    s11 = sum(u * u for u, _, _ in rows)
    s12 = sum(u * v for u, v, _ in rows)
    s22 = sum(v * v for _, v, _ in rows)
    y1 = sum(u * t for u, _, t in rows)
    y2 = sum(v * t for _, v, t in rows)
    det = s11 * s22 - s12 * s12
    c1, c2 = ((y1 * s22 - y2 * s12) / det, (y2 * s11 - y1 * s12) / det) if det > 0 else (-1.0, -1.0)
    if c1 < 0 or c2 < 0:  # noise at short lengths: keep the better single term
        fits = [(y1 / s11, 0.0), (0.0, y2 / s22)]
        c1, c2 = min(fits, key=lambda c: sum((c[0] * u + c[1] * v - t) ** 2 for u, v, t in rows))
    if c2 < c2_min:
        c2 = c2_min
        c1 = max(0.0, sum(u * (t - c2 * v) for u, v, t in rows) / s11)
    return c1, c2


def attention_time_floor(cfg, checkpointing: bool, device_name: str) -> float:
    """Seconds per (local token x total token) of causal attention at the GPU's peak FLOP/s."""
    from longctx.models.lit_module import peak_bf16_flops

    peak = peak_bf16_flops(device_name)
    if peak is None:
        return 0.0
    # GPTConfig.flops_per_token: 12 * L * H * D * S / 2 per token for causal fwd + bwd;
    # checkpointing recomputes the forward (+1/3).
    flops = 6 * cfg.n_layer * cfg.n_head * cfg.head_dim * (4 / 3 if checkpointing else 1)
    return flops / peak


def predict_time(coef: tuple[float, float], s_total: int, p: int) -> float:
    s_local = s_total / p
    return coef[0] * s_local + coef[1] * s_local * s_total


def predict_peak(a: float, b: float, s_total: int, p: int) -> float:
    return a + b * s_total / p


def predict_max(a: float, b: float, p: int, budget: float, grid: list[int]) -> Optional[int]:
    """Largest grid length whose predicted peak fits the budget (None: not even the smallest)."""
    fitting = [s for s in grid if predict_peak(a, b, s, p) <= budget]
    return max(fitting) if fitting else None


def next_grid(grid: list[int], s: int) -> Optional[int]:
    return next((g for g in grid if g > s), None)


def prev_grid(grid: list[int], s: int) -> Optional[int]:
    return next((g for g in reversed(grid) if g < s), None)


def extension_length(grid, s_pred, p, coef, cap_s, done_max) -> Optional[int]:
    """Largest grid length beyond the measured ones, below the prediction, affordable in time."""
    ok = [s for s in grid if done_max < s < s_pred and predict_time(coef, s, p) <= cap_s]
    return max(ok) if ok else None


def library_roots() -> dict[str, str]:
    """Source directories of longctx, longctx.models, longctx.kernels -> display prefix.

    Taken from the imported packages, so frames match whether the project is installed
    editable (models/ and kernels/ at the top of the repository) or into site-packages.
    """
    import longctx
    import longctx.kernels
    import longctx.models

    return {str(Path(m.__file__).resolve().parent) + os.sep: name + "/"
            for m, name in ((longctx, "longctx"), (longctx.models, "models"), (longctx.kernels, "kernels"))}


def site_label(frames: list[dict], roots: dict[str, str]) -> str:
    """The innermost frame in the library (else in this benchmark): ``file:line:function``.
    The shared training step (longctx.bench.step) is the benchmark's step, not the library:
    what it allocates itself is autograd's gradients and temporaries, AdamW's state."""
    own = None
    for f in frames:  # innermost first
        fn = f.get("filename", "")
        if fn == STEP_FILE:
            own = own or "benchmark:step (autograd: gradients, temporaries)"
            continue
        for root, prefix in roots.items():
            if fn.startswith(root):
                return f"{prefix}{fn[len(root):]}:{f.get('line')}:{f.get('name')}"
        if own is None and fn.endswith(os.sep + Path(__file__).name):
            own = f"benchmark:{f.get('name')} (autograd: gradients, temporaries)" if f.get("name") == "step" \
                else f"benchmark:{f.get('name')}"
    return own or "other (outside the library)"


def attribute_peak(trace: list[dict], baseline: int, s_local: int, n_layer: int,
                   roots: dict[str, str], top: int = 14) -> dict:
    """Replay an allocator trace to its peak and group the live blocks by source line.

    ``baseline``: bytes allocated when recording started (weights, grads, AdamW state,
    DDP buckets, inputs); blocks from before the trace that are freed during it are
    subtracted from it.
    """
    def replay(stop: Optional[int]):
        live, cur, pre_freed, peak, peak_i = {}, baseline, 0, baseline, -1
        for i, e in enumerate(trace):
            if stop is not None and i > stop:
                break
            act, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
            if act == "alloc":
                live[addr] = (size, e.get("frames", []))
                cur += size
            elif act == "free_completed":
                if addr in live:
                    cur -= live.pop(addr)[0]
                else:
                    cur -= size
                    pre_freed += size
            if cur > peak:
                peak, peak_i = cur, i
        return live, pre_freed, peak, peak_i

    _, _, peak, peak_i = replay(None)
    live, pre_freed, _, _ = replay(peak_i)
    sites: dict[str, list[int]] = {}
    for size, frames in live.values():
        s = sites.setdefault(site_label(frames, roots), [0, 0])
        s[0] += size
        s[1] += 1
    rows = [dict(site=k, bytes=v[0], blocks=v[1], bytes_per_token=v[0] / s_local,
                 bytes_per_token_per_layer=v[0] / s_local / n_layer)
            for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])]
    rest = rows[top:]
    rows = rows[:top]
    if rest:
        b = sum(r["bytes"] for r in rest)
        rows.append(dict(site=f"other ({len(rest)} sites)", bytes=b, blocks=sum(r["blocks"] for r in rest),
                         bytes_per_token=b / s_local, bytes_per_token_per_layer=b / s_local / n_layer))
    at_peak = trace[peak_i] if peak_i >= 0 else {}
    return dict(peak_bytes_replayed=peak, resident_before_step_bytes=baseline - pre_freed,
                peak_event=site_label(at_peak.get("frames", []), roots) if at_peak else "before the step",
                trace_events=len(trace), s_local=s_local, sites=rows)


def summarize(records: list[dict], meta: dict) -> dict:
    """Fits, predictions and the table from all job records (rerunnable at any time)."""
    groups: dict[tuple[int, bool], list[dict]] = {}
    for r in records:
        if "p" in r:
            groups.setdefault((r["p"], r["ckpt"]), []).append(r)
    table, fits = [], {}
    for (p, ckpt), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        info = next((r for r in rs if r["kind"] == "meta"), None)
        ok = [r for r in rs if r["kind"] == "measure"]
        ooms = sorted({r["s_total"] for r in rs if r["kind"] == "oom"})
        row = dict(P=p, checkpointing=ckpt, status="no data")
        if info is None or len({r["s_local"] for r in ok}) < 2:
            row["errors"] = [r.get("msg") for r in rs if r["kind"] == "error"][:2]
            table.append(row)
            continue
        grid = grid_lengths(meta["grid_min"], meta["grid_max"], 2 * p)
        a, b, res = fit_linear([r["s_local"] for r in ok], [r["peak_alloc"] for r in ok])
        coef = fit_time([(r["s_local"], r["s_total"], r["step_s"]) for r in ok], info.get("time_c2_floor", 0.0))
        budget = info["budget_bytes"]
        pred = predict_max(a, b, p, budget, grid)
        fits_s = sorted({r["s_total"] for r in ok})
        max_ok = fits_s[-1]
        if pred is None:
            status, best = "nothing on the grid fits", None
        elif ooms and next_grid(grid, max_ok) in ooms:
            status, best = "measured (fits, next length out of memory)", max_ok
        elif max_ok >= pred:
            status, best = "verified (next length not tried)", max_ok
        elif ooms and min(ooms) <= pred:
            status, best = "prediction too high: largest measured", max_ok
        else:
            status, best = "predicted (step too slow to verify)", pred
        row.update(status=status, max_seq_len=best, predicted_max=pred, largest_measured_fit=max_ok,
                   smallest_oom=ooms[0] if ooms else None,
                   predicted_peak_GiB_at_max=predict_peak(a, b, best, p) / GiB if best else None,
                   predicted_step_s_at_max=predict_time(coef, best, p) if best else None,
                   budget_GiB=budget / GiB, device_total_GiB=info["total_bytes"] / GiB,
                   intercept_GiB=a / GiB, bytes_per_token=b, bytes_per_token_per_layer=b / info["n_layer"],
                   fit_max_rel_residual=res, n_points=len(ok))
        at_best = [r for r in ok if r["s_total"] == best]
        if at_best:
            row["measured_peak_GiB_at_max"] = max(r["peak_alloc"] for r in at_best) / GiB
            if at_best[0].get("predicted_alloc"):
                row["memory_model_peak_GiB_at_max"] = at_best[0]["predicted_alloc"] / GiB
            row["measured_step_s_at_max"] = min(r["step_s"] for r in at_best)
        if ckpt:
            row["predicted_peak_GiB_at_1M"] = predict_peak(a, b, ONE_M, p) / GiB
        fits[f"P{p}_{'ckpt' if ckpt else 'nockpt'}"] = dict(a=a, b=b, time_c1=coef[0], time_c2=coef[1])
        table.append(row)
    scaling = {}
    for ckpt in (False, True):
        rows = {r["P"]: r.get("max_seq_len") for r in table if r["checkpointing"] == ckpt}
        if rows.get(1):
            scaling["ckpt" if ckpt else "no_ckpt"] = {str(p): (m / rows[1] if m else None) for p, m in rows.items()}
    return dict(meta=meta, table=table, fits=fits, scaling_vs_1gpu=scaling,
                breakdowns=[r for r in records if r["kind"] == "breakdown"],
                records=[r for r in records if r["kind"] != "breakdown"])


def fmt_len(s: Optional[int]) -> str:
    if not s:
        return "-"
    return f"{s / ONE_M:.3g}M" if s >= ONE_M else f"{s / 1024:.3g}K"


def plot(json_path: str, png_path: Optional[str] = None) -> str:
    """Max trainable length vs GPUs (left) and peak memory vs tokens per GPU (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    data = json.loads(Path(json_path).read_text())
    png_path = png_path or str(Path(json_path).with_suffix(".png"))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {False: "tab:blue", True: "tab:orange"}
    styles = {1: ("o", "-"), 2: ("s", "--"), 4: ("^", "-."), 8: ("D", ":"), 16: ("v", ":")}
    sizes = sorted({r["P"] for r in data["table"]})
    for ckpt in (False, True):
        rows = [r for r in data["table"] if r["checkpointing"] == ckpt and r.get("max_seq_len")]
        if not rows:
            continue
        ps, ms = [r["P"] for r in rows], [r["max_seq_len"] for r in rows]
        ax.plot(ps, ms, "-", color=colors[ckpt], label="activation checkpointing" if ckpt else "no checkpointing")
        for p, m, r in zip(ps, ms, rows):
            measured = not r["status"].startswith("predicted")
            ax.plot(p, m, "o", ms=7, color=colors[ckpt], mfc=colors[ckpt] if measured else "white")
            ax.annotate(fmt_len(m), (p, m), textcoords="offset points", xytext=(6, -12), fontsize=8)
        base = next((r for r in rows if r["P"] == 1), None)
        if base:
            ax.plot(ps, [base["max_seq_len"] * p for p in ps], ":", color=colors[ckpt], alpha=0.7,
                    label="linear in P from P=1")
    ax.axhline(ONE_M, color="gray", lw=0.8, ls="--")
    ax.annotate("1M", (sizes[0] if sizes else 1, ONE_M), textcoords="offset points", xytext=(2, 3),
                fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(sizes, [str(p) for p in sizes])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt_len(int(v))))
    ax.set_xlabel("GPUs (context-parallel size P)")
    ax.set_ylabel("largest trainable sequence length")
    ax.set_title(f"{data['meta'].get('preset')}: filled = measured, hollow = predicted", fontsize=10)
    ax.legend(fontsize=8)
    for key, fit in data.get("fits", {}).items():
        p = int(key.split("_")[0][1:])
        ckpt = key.endswith("_ckpt")
        marker, ls = styles.get(p, ("o", "-"))
        pts = [r for r in data["records"] if r.get("kind") == "measure" and r["p"] == p and r["ckpt"] == ckpt]
        xs = [r["s_local"] for r in pts]
        bx.plot(xs, [r["peak_alloc"] / GiB for r in pts], marker, color=colors[ckpt], mfc="none")
        line = [0, max(xs + [1]) * 1.3]
        bx.plot(line, [(fit["a"] + fit["b"] * x) / GiB for x in line], ls, color=colors[ckpt], lw=0.9,
                label=f"P={p} {'ckpt' if ckpt else 'no ckpt'}")
    budget = next((r.get("budget_GiB") for r in data["table"] if r.get("budget_GiB")), None)
    if budget:
        bx.axhline(budget, color="red", lw=0.8, ls="--", label="budget")
    bx.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt_len(int(v)) if v > 0 else "0"))
    bx.set_xlabel("tokens per GPU (S / P)")
    bx.set_ylabel("peak allocated (GiB)")
    bx.set_title("O(S/P): the fits of all P coincide per setting", fontsize=10)
    bx.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


# ---- one job: (P, checkpointing) on P devices ---------------------------------------------------


class CudaMeter:
    def __init__(self, device: torch.device):
        self.device = device

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def overhead(self) -> int:
        """Device memory in use that PyTorch's allocator does not own (context, NCCL, ...)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free - torch.cuda.memory_reserved(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> tuple[int, int]:
        self.sync()
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)

    def watch(self):
        return contextlib.nullcontext()


class ProxyMeter:
    """Dry run on the CPU: weights + grads + AdamW state + bytes saved for backward.

    The CPU has no allocator statistics to ask; this proxy lets the dry run exercise the
    whole pipeline (fits, decisions, an out-of-memory in the middle of a ring step of P>1
    and the teardown that follows) against a synthetic device of ``total_bytes``.
    """

    def __init__(self, total_bytes: int, model: torch.nn.Module, enforce: bool = True):
        self.total_bytes, self.enforce = total_bytes, enforce
        self.static = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
        self.peak_ = 0

    def total(self) -> int:
        return self.total_bytes

    def overhead(self) -> int:
        return 0

    def sync(self) -> None:
        pass

    def reset(self) -> None:
        self.peak_ = 0

    def peak(self) -> tuple[int, int]:
        return self.peak_, self.peak_

    @contextlib.contextmanager
    def watch(self):
        cur, seen = [self.static], set()

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                cur[0] += st.nbytes()
                self.peak_ = max(self.peak_, cur[0])
                if self.enforce and cur[0] > self.total_bytes:
                    raise torch.OutOfMemoryError(f"simulated (dry run): {cur[0]} > {self.total_bytes} bytes")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


class Job:
    def __init__(self, args):
        from datetime import timedelta

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from longctx.models import GPT, GPTConfig

        self.args, self.p, self.ckpt, self.dry = args, args.p, bool(args.ckpt), args.dry_run
        self.dist, self.rank = dist, 0
        if self.dry:
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.p > 1:
            kw = {} if self.dry else {"device_id": self.device}
            dist.init_process_group("gloo" if self.dry else "nccl",
                                    timeout=timedelta(seconds=args.nccl_timeout_s), **kw)
            if dist.get_world_size() != self.p:
                raise RuntimeError(f"job for P={self.p} started with {dist.get_world_size()} processes")
            self.rank = dist.get_rank()
        from longctx import CPContext, ParallelDims, ParallelPlan, parallelize

        self.cfg = GPTConfig.from_preset(args.preset)
        torch.manual_seed(0)
        with self.device:  # initialise on the device: a CPU init of 350M weights takes seconds
            self.gpt = GPT(self.cfg)
        self.plan = ParallelPlan(activation_checkpointing=self.ckpt, attention_backend=args.backend)
        parallelize(self.gpt, ParallelDims(cp=CPContext(dist.group.WORLD if self.p > 1 else None)), self.plan)
        net = LossModule(self.gpt)
        # DDP as Lightning's strategy uses it (defaults: separate gradient buckets).
        self.net = (DDP(net, device_ids=None if self.dry else [self.device.index]) if self.p > 1 else net)
        self.opt = torch.optim.AdamW(self.gpt.parameters(), lr=1e-5, fused=not self.dry)
        # --dry-run-oom-rank R: only rank R runs out of memory, the others stay blocked in the
        # ring (the case the one-job-per-subprocess design exists for).
        enforce = args.dry_run_oom_rank < 0 or args.dry_run_oom_rank == self.rank
        self.meter = (ProxyMeter(int(args.dry_run_mem_mib * 2**20), self.gpt, enforce) if self.dry
                      else CudaMeter(self.device))
        self.grid = grid_lengths(args.grid_min, args.grid_max, 2 * self.p)
        self.deadline = args.deadline

    # -- plumbing --------------------------------------------------------------------------

    def write(self, rec: dict, any_rank: bool = False) -> None:
        if self.rank == 0 or any_rank:
            rec = dict(rec, job=self.args.job, p=self.p, ckpt=self.ckpt, rank=self.rank, time=time.time())
            with open(self.args.records, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def agree(self, s: Optional[int]) -> Optional[int]:
        """Rank 0's decision for every rank (deadlines are read from each rank's clock)."""
        if self.p == 1:
            return s
        t = torch.tensor([s or 0], dtype=torch.int64, device=self.device)
        self.dist.broadcast(t, src=0)
        return int(t.item()) or None

    def max_over_ranks(self, vals: list[float]) -> list[float]:
        if self.p == 1:
            return vals
        t = torch.tensor(vals, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def predicted_alloc(self, s_total: int) -> int:
        """longctx.memory's prediction of max_memory_allocated for this setup (autocast with fp32
        weights, DDP over the P ranks; fp32 in the dry run)."""
        from longctx.memory import estimate

        return estimate(self.cfg, s_total, plan=self.plan, cp=self.p, data_parallel="ddp" if self.p > 1 else "none",
                        precision="32-true" if self.dry else "bf16-mixed").allocated_bytes

    def affordable(self, est_s: float) -> bool:
        return time.time() + 1.3 * est_s + 10 < self.deadline

    def batch(self, s_total: int):
        from longctx import position_ids, shard_sequence

        # Built on the CPU, only this rank's shard goes to the device: the benchmark itself
        # must not hold a full-sequence tensor on any GPU.
        g = torch.Generator().manual_seed(s_total)
        tokens = torch.randint(0, self.cfg.vocab_size, (1, s_total + 1), generator=g)
        ids = shard_sequence(tokens[:, :-1], 1, rank=self.rank, world_size=self.p)
        lab = shard_sequence(tokens[:, 1:], 1, rank=self.rank, world_size=self.p)
        pos = position_ids(s_total, rank=self.rank, world_size=self.p)[None]
        return [t.contiguous().to(self.device) for t in (ids, lab, pos)], s_total

    def step(self, batch) -> torch.Tensor:
        (ids, lab, pos), s_total = batch
        # DDP averages over P: the global token mean
        loss_sum, _ = train_step(lambda: self.net(ids, lab, pos), self.opt, lambda loss, n: loss * (self.p / s_total),
                                 autocast=None if self.dry else "cuda", watch=self.meter.watch())
        return loss_sum.detach()

    # -- measurements ------------------------------------------------------------------------

    def run(self, s_total: int, phase: str, warm: bool = False, history: bool = False) -> Optional[dict]:
        """One measured training step at ``s_total``; None if it ran out of memory (P=1)."""
        oom = None
        try:
            batch = self.batch(s_total)
            if warm:
                self.step(batch)
            base = 0 if self.dry else torch.cuda.memory_allocated(self.device)
            history = history and self.rank == 0 and not self.dry
            if history:
                torch.cuda.memory._record_memory_history(
                    "all", context="alloc", stacks="python", max_entries=1_000_000, clear_history=True)

            def start():
                self.meter.reset()
                if self.p > 1:
                    self.dist.barrier()

            dt, loss = mean_step_seconds(functools.partial(self.step, batch), 1, self.meter.sync, start)
            peak_a, peak_r = self.meter.peak()
            snap = None
            if history:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(None)
            bad = 0.0 if bool(torch.isfinite(loss)) else 1.0
            peak_a, peak_r, dt, bad = self.max_over_ranks([peak_a, peak_r, dt, bad])
            del batch, loss
        except (torch.OutOfMemoryError, RuntimeError) as e:
            # Allocations outside PyTorch's allocator (cuDNN, NCCL) fail as RuntimeError.
            if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
                raise
            oom = str(e).strip().splitlines()[0][:300]
            self.write(dict(kind="oom", phase=phase, s_total=s_total, s_local=s_total // self.p, msg=oom),
                       any_rank=True)
            if self.p > 1:
                # The other ranks are (or soon will be) blocked in the ring: no collective can
                # recover. Leave now; torchrun ends the rest of the job.
                sys.stdout.flush()
                os._exit(OOM_EXIT)
        if oom is not None:  # outside the except block: the traceback no longer pins tensors
            self.opt.zero_grad(set_to_none=True)
            gc.collect()
            if not self.dry:
                torch.cuda.empty_cache()
            return None
        s_local = s_total // self.p
        rec = dict(kind="measure", phase=phase, s_total=s_total, s_local=s_local, peak_alloc=int(peak_a),
                   peak_reserved=int(peak_r), step_s=dt, loss_finite=bad == 0.0,
                   predicted_alloc=self.predicted_alloc(s_total))
        if self.rank == 0:
            print(f"S={s_total}: peak allocated {peak_a / GiB:.2f} GiB measured, "
                  f"{rec['predicted_alloc'] / GiB:.2f} GiB predicted (longctx.memory)", flush=True)
        if not history:
            self.write(rec)
        if snap is not None:
            try:  # a diagnostic: never let it end the job
                trace = snap["device_traces"][self.device.index]
                bd = attribute_peak(trace, base, s_local, self.cfg.n_layer, library_roots())
                self.write(dict(bd, kind="breakdown", s_total=s_total, peak_alloc_measured=int(peak_a),
                                trace_truncated=len(trace) >= 1_000_000))
            except Exception as e:  # noqa: BLE001
                self.write(dict(kind="breakdown_error", msg=f"{type(e).__name__}: {e}"[:300]))
        return rec


def run_job(args) -> None:
    job = Job(args)
    p, cap = job.p, args.verify_max_s
    lengths = [int(x) * p for x in (args.fit_lengths_on if job.ckpt else args.fit_lengths_off).split(",")]
    batch = job.batch(lengths[0])
    job.step(batch)  # warm-up: optimizer state, kernels, communicators
    del batch
    job.meter.sync()
    total = job.meter.total()
    budget = args.mem_frac * total
    device = "cpu (dry run proxy)" if job.dry else torch.cuda.get_device_name(job.device)
    c2_min = attention_time_floor(job.cfg, job.ckpt, device)
    job.write(dict(kind="meta", preset=args.preset, n_layer=job.cfg.n_layer, params=job.gpt.num_params(),
                   total_bytes=total, budget_bytes=budget, non_torch_bytes=job.meter.overhead(),
                   device=device, time_c2_floor=c2_min,
                   torch=torch.__version__, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    if args.verify_lengths:  # a retry from the driver: verification only, largest first
        for s in [int(x) for x in args.verify_lengths.split(",")]:
            if job.run(s, "verify") is not None:
                break
        return
    points = [r for r in (job.run(s, "fit", warm=True) for s in lengths) if r is not None]
    if args.breakdown and not job.dry and points:
        job.run(points[-1]["s_total"], "breakdown", history=True)
    if len(points) < 2:
        job.write(dict(kind="error", msg=f"only {len(points)} fit lengths ran; cannot fit"))
        return

    def refit(phase):
        a, b, res = fit_linear([r["s_local"] for r in points], [r["peak_alloc"] for r in points])
        coef = fit_time([(r["s_local"], r["s_total"], r["step_s"]) for r in points], c2_min)
        s_pred = predict_max(a, b, p, budget, job.grid)
        t_pred = predict_time(coef, s_pred, p) if s_pred else None
        job.write(dict(kind="fit", phase=phase, a=a, b=b, residual=res, time_coef=coef,
                       predicted_max=s_pred, predicted_step_s=t_pred))
        return coef, s_pred, t_pred

    coef, s_pred, t_pred = refit("fit")
    if s_pred is None:
        return
    if t_pred <= cap:
        direction = 0  # 0: verifying the prediction, +1: probing above, -1: stepping down
        if s_pred <= lengths[-1]:  # a fit length already verified it: probe the next one
            direction, s_pred = 1, next_grid(job.grid, lengths[-1])
            t_pred = predict_time(coef, s_pred, p) if s_pred else math.inf
        ok = s_pred is not None and t_pred <= cap and job.affordable(t_pred)
        s = job.agree(s_pred if ok else None)
        while s:
            rec = job.run(s, "probe" if direction > 0 else "verify")
            if rec is not None:
                points.append(rec)
                if direction < 0:
                    break
                direction, nxt = 1, next_grid(job.grid, s)
            else:  # P=1 only: P>1 jobs end inside run()
                if direction > 0:
                    break
                direction, nxt = -1, prev_grid(job.grid, s)
                if nxt is not None and nxt <= lengths[-1]:
                    nxt = None
            ok = nxt is not None and predict_time(coef, nxt, p) <= cap and job.affordable(predict_time(coef, nxt, p))
            s = job.agree(nxt if ok else None)
    else:
        s_ext = extension_length(job.grid, s_pred, p, coef, cap, max(r["s_total"] for r in points))
        if s_ext is not None and not job.affordable(predict_time(coef, s_ext, p)):
            s_ext = None
        s_ext = job.agree(s_ext)
        if s_ext:
            rec = job.run(s_ext, "extend")
            if rec is not None:
                points.append(rec)
                refit("refit")


def job_main(args) -> None:
    try:
        run_job(args)
    except BaseException as e:  # noqa: BLE001 - record, then leave without NCCL teardown hangs
        import traceback

        traceback.print_exc()
        rank = int(os.environ.get("RANK", 0))
        with open(args.records, "a") as f:
            f.write(json.dumps(dict(kind="error", job=args.job, p=args.p, ckpt=bool(args.ckpt), rank=rank,
                                    msg=f"{type(e).__name__}: {e}"[:500], time=time.time())) + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---- driver: schedules jobs on GPU subsets, collects records, writes JSON + plot ----------------


PASS_THROUGH = ("preset", "mem_frac", "verify_max_s", "grid_min", "grid_max", "fit_lengths_off",
                "fit_lengths_on", "backend", "dry_run_mem_mib", "dry_run_oom_rank", "nccl_timeout_s")


def job_command(args, spec: dict, records: Path, deadline: float) -> list[str]:
    cmd = [str(Path(__file__).resolve()), "--job", spec["name"], "--p", str(spec["p"]),
           "--ckpt", str(int(spec["ckpt"])), "--records", str(records), "--deadline", f"{deadline:.0f}"]
    for k in PASS_THROUGH:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.dry_run:
        cmd.append("--dry-run")
    if not args.breakdown:
        cmd.append("--no-breakdown")
    if spec.get("verify_lengths"):
        cmd += ["--verify-lengths", spec["verify_lengths"]]
    if spec["p"] == 1:
        return [sys.executable] + cmd
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['p']}",
            "--monitor-interval=0.5"] + cmd


def read_records(rec_dir: Path) -> list[dict]:
    out = []
    for f in sorted(rec_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written right now
    return out


def write_summary(path: Path, records: list[dict], meta: dict) -> dict:
    summary = summarize(records, meta)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, path)
    return summary


def drive(args) -> None:
    if args.dry_run:
        n = args.gpus or 2
    else:
        # NVML answers without creating a CUDA context in the driver (the jobs need the memory).
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on GPUs, or use --dry-run (CPU) / --plot FILE.json")
        n = args.gpus or torch.cuda.device_count()
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [p for p in (1, 2, 4, 8, 16) if p <= n]
    ckpts = {"both": [False, True], "on": [True], "off": [False]}[args.checkpointing]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else [str(i) for i in range(n)]
    out = Path(args.out)
    rec_dir = out / f"max_context_ws{n}_records"
    rec_dir.mkdir(parents=True, exist_ok=True)
    for old in list(rec_dir.glob("*.jsonl")) + list(rec_dir.glob("*.log")):
        old.unlink()  # our own files from a previous run
    json_path = out / f"max_context_ws{n}.json"
    start = time.time()
    deadline = start + args.budget_s
    meta = dict(preset=args.preset, gpus=n, sizes=sizes, mem_frac=args.mem_frac, verify_max_s=args.verify_max_s,
                budget_s=args.budget_s, grid_min=args.grid_min, grid_max=args.grid_max,
                fit_lengths_off=args.fit_lengths_off, fit_lengths_on=args.fit_lengths_on, dry_run=args.dry_run,
                date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__,
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), command=" ".join(sys.argv))
    # Longest first by GPU-seconds (P x a rough duration): the P=max jobs hold every GPU.
    specs = [dict(name=f"P{p}_{'ckpt' if c else 'nockpt'}", p=p, ckpt=c, est=70 if c else 40)
             for p in sizes for c in ckpts]
    pending = sorted(specs, key=lambda s: -s["p"] * s["est"])
    free, running, seen_sizes = list(range(n)), {}, None
    while pending or running:
        for spec in list(pending):
            if time.time() > deadline - 30:
                print(f"[driver] out of time budget: not starting {spec['name']}", flush=True)
                pending.remove(spec)
            elif len(free) >= spec["p"]:
                gpus, free = free[:spec["p"]], free[spec["p"]:]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                if not args.dry_run:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] for i in gpus)
                log = open(rec_dir / f"{spec['name']}.log", "w")
                cmd = job_command(args, spec, rec_dir / f"{spec['name']}.jsonl", deadline)
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                        start_new_session=True)
                running[spec["name"]] = (proc, spec, gpus, log)
                pending.remove(spec)
                print(f"[driver] {time.time() - start:5.0f}s start {spec['name']} on GPUs {gpus}", flush=True)
        for name, (proc, spec, gpus, log) in list(running.items()):
            rc = proc.poll()
            if rc is None and time.time() > deadline + 20:
                _kill(proc)
                rc = proc.wait()
                with open(rec_dir / f"{name}.jsonl", "a") as f:
                    f.write(json.dumps(dict(kind="error", job=name, p=spec["p"], ckpt=spec["ckpt"],
                                            msg="killed at the time budget")) + "\n")
            if rc is None:
                continue
            log.close()
            del running[name]
            free = sorted(free + gpus)
            print(f"[driver] {time.time() - start:5.0f}s end {name} rc={rc}", flush=True)
            if rc != 0 and not any(r["kind"] == "oom" for r in read_records(rec_dir) if r.get("job") == name):
                print("".join((rec_dir / f"{name}.log").read_text().splitlines(True)[-15:]), flush=True)
            # torchrun reports a worker's OOM exit as 1: the records tell what happened.
            retry = _retry_spec(spec, read_records(rec_dir), args, deadline) if rc != 0 else None
            if retry:
                pending.append(retry)
        sizes_now = tuple(f.stat().st_size for f in sorted(rec_dir.glob("*.jsonl")))
        if sizes_now != seen_sizes:
            seen_sizes = sizes_now
            write_summary(json_path, read_records(rec_dir), meta)
        time.sleep(0.5)
    summary = write_summary(json_path, read_records(rec_dir), meta)
    png = plot(str(json_path))
    print(f"[driver] {time.time() - start:.0f}s  wrote {json_path} and {png}")
    for r in summary["table"]:
        print(f"P={r['P']} ckpt={'on ' if r['checkpointing'] else 'off'} max={fmt_len(r.get('max_seq_len')):>6} "
              f"({r['status']}; predicted {fmt_len(r.get('predicted_max'))}, "
              f"{(r.get('bytes_per_token_per_layer') or 0) / 1024:.1f} KiB/token/layer; peak at max "
              f"{r.get('measured_peak_GiB_at_max') or 0:.1f} GiB measured, "
              f"{r.get('memory_model_peak_GiB_at_max') or 0:.1f} GiB longctx.memory)")


def _kill(proc: subprocess.Popen) -> None:
    """End a job we started: its own process group (torchrun and its workers), by id."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _retry_spec(spec: dict, records: list[dict], args, deadline: float) -> Optional[dict]:
    """After a P>1 job died verifying its predicted maximum, verify one grid length lower."""
    mine = [r for r in records if r.get("p") == spec["p"] and r.get("ckpt") == spec["ckpt"]]
    ooms = [r["s_total"] for r in mine if r["kind"] == "oom" and r.get("phase") == "verify"]
    fits = [r["s_total"] for r in mine if r["kind"] == "measure"]
    if not ooms or spec.get("retries", 0) >= 2 or time.time() > deadline - 90:
        return None
    grid = grid_lengths(args.grid_min, args.grid_max, 2 * spec["p"])
    lower = prev_grid(grid, min(ooms))
    if lower is None or (fits and lower <= max(fits)):
        return None
    k = spec.get("retries", 0) + 1
    return dict(spec, name=f"{spec['name'].split('_retry')[0]}_retry{k}", retries=k, verify_lengths=str(lower))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help="model preset (default gpt-350m; tiny with --dry-run)")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible)")
    ap.add_argument("--sizes", default="", help="comma list of P (default 1,2,4,... up to --gpus)")
    ap.add_argument("--checkpointing", default="both", choices=["both", "on", "off"])
    ap.add_argument("--mem-frac", type=float, default=0.92, help="usable fraction of device memory")
    ap.add_argument("--verify-max-s", type=float, default=None, help="longest step run to verify (s)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole run (s)")
    ap.add_argument("--grid-min", type=int, default=None)
    ap.add_argument("--grid-max", type=int, default=None)
    ap.add_argument("--fit-lengths-off", default=None, help="tokens per GPU measured without checkpointing")
    ap.add_argument("--fit-lengths-on", default=None, help="tokens per GPU measured with checkpointing")
    ap.add_argument("--backend", default=None, help="attention backend (default auto; torch with --dry-run)")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="skip the allocator-trace breakdown of the peak")
    ap.add_argument("--nccl-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--dry-run", action="store_true", help="tiny preset on the CPU with gloo (pipeline test)")
    ap.add_argument("--dry-run-mem-mib", type=float, default=48.0, help="synthetic device memory (dry run)")
    ap.add_argument("--dry-run-oom-rank", type=int, default=-1,
                    help="dry run: only this rank runs out of memory (-1: all)")
    ap.add_argument("--plot", default=None, metavar="FILE.json", help="only plot a results file (CPU)")
    # internal: one job, launched by the driver
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--p", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--records", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--verify-lengths", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dry = args.dry_run
    defaults = dict(preset="tiny" if dry else "gpt-350m", verify_max_s=3.0 if dry else 45.0,
                    budget_s=300.0, grid_min=256 if dry else 16384, grid_max=(1 << 18) if dry else (1 << 25),
                    fit_lengths_off="128,256,512" if dry else "4096,8192,16384",
                    fit_lengths_on="128,256,512" if dry else "8192,16384,32768", backend="torch" if dry else "auto")
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not 0 < args.mem_frac <= 1:
        raise SystemExit(f"--mem-frac must be in (0, 1], got {args.mem_frac}")
    if args.deadline is None:
        args.deadline = time.time() + args.budget_s
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot:
        print(plot(args.plot))
    elif args.job:
        job_main(args)
    elif "LOCAL_RANK" in os.environ:
        raise SystemExit("run the driver with plain `python benchmarks/max_context.py`; it launches torchrun itself")
    else:
        drive(args)


if __name__ == "__main__":
    main()
