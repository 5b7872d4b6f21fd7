"""benchmarks/max_context.py's numbers: the grid of lengths, the memory and time fits, the
predictions and decisions they drive, and the summary table of the jobs' records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

GiB = 2**30
ONE_M = 1 << 20


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
    from longctx.hardware import peak_bf16_flops

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


def read_records(rec_dir: Path) -> list[dict]:
    out = []
    for f in sorted(rec_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written right now
    return out


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
        row.update(
            status=status,
            max_seq_len=best,
            predicted_max=pred,
            largest_measured_fit=max_ok,
            smallest_oom=ooms[0] if ooms else None,
            predicted_peak_GiB_at_max=predict_peak(a, b, best, p) / GiB if best else None,
            predicted_step_s_at_max=predict_time(coef, best, p) if best else None,
            budget_GiB=budget / GiB,
            device_total_GiB=info["total_bytes"] / GiB,
            intercept_GiB=a / GiB,
            bytes_per_token=b,
            bytes_per_token_per_layer=b / info["n_layer"],
            fit_max_rel_residual=res,
            n_points=len(ok),
        )
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
    return dict(
        meta=meta,
        table=table,
        fits=fits,
        scaling_vs_1gpu=scaling,
        breakdowns=[r for r in records if r["kind"] == "breakdown"],
        records=[r for r in records if r["kind"] != "breakdown"],
    )


def fmt_len(s: Optional[int]) -> str:
    if not s:
        return "-"
    return f"{s / ONE_M:.3g}M" if s >= ONE_M else f"{s / 1024:.3g}K"
