"""benchmarks/max_context.py's figure: largest trainable length vs GPUs, peak memory vs tokens per GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from longctx.bench.max_context_fit import ONE_M, GiB, fmt_len


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
            ax.plot(
                ps,
                [base["max_seq_len"] * p for p in ps],
                ":",
                color=colors[ckpt],
                alpha=0.7,
                label="linear in P from P=1",
            )
    ax.axhline(ONE_M, color="gray", lw=0.8, ls="--")
    ax.annotate(
        "1M", (sizes[0] if sizes else 1, ONE_M), textcoords="offset points", xytext=(2, 3), fontsize=8, color="gray"
    )
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
        bx.plot(
            line,
            [(fit["a"] + fit["b"] * x) / GiB for x in line],
            ls,
            color=colors[ckpt],
            lw=0.9,
            label=f"P={p} {'ckpt' if ckpt else 'no ckpt'}",
        )
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
