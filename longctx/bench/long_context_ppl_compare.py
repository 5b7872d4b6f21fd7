"""benchmarks/long_context_ppl.py --compare: result files against the first (paired per
window where they saw the same windows), as JSON and a plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .long_context_ppl_eval import fmt_size


def _paired(ref: dict, other: dict, bucket_from: int = 0) -> Optional[dict]:
    """Per-window loss difference (other - ref) over buckets [bucket_from:], mean and std error."""
    if (
        not ref["window_indices"]
        or ref["window_indices"] != other["window_indices"]
        or [b["lo"] for b in ref["buckets"]] != [b["lo"] for b in other["buckets"]]
    ):
        return None  # not the same windows and buckets: nothing to pair
    a_s, a_n = np.asarray(ref["per_window"]["loss_sum"]), np.asarray(ref["per_window"]["n_tokens"])
    b_s, b_n = np.asarray(other["per_window"]["loss_sum"]), np.asarray(other["per_window"]["n_tokens"])
    a_n, b_n = a_n[:, bucket_from:].sum(1), b_n[:, bucket_from:].sum(1)
    keep = (a_n > 0) & (b_n > 0)
    if not keep.any():
        return None
    d = b_s[:, bucket_from:].sum(1)[keep] / b_n[keep] - a_s[:, bucket_from:].sum(1)[keep] / a_n[keep]
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
    return {
        "mean_delta_loss": float(d.mean()),
        "stderr": se,
        "n_windows": int(len(d)),
        "windows_better": int((d < 0).sum()),
    }


def compare(paths: Sequence[str], out_dir: str, name: str = "compare") -> dict:
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    tags = [r["tag"] for r in runs]
    if len(set(tags)) != len(tags):
        tags = [f"{t}#{i}" for i, t in enumerate(tags)]
    ref_tag = tags[0]
    if len({r["data"].get("corpus_fingerprint") for r in runs}) > 1:
        print("warning: the runs evaluated different data; deltas are not paired", flush=True)
    by_len = [{r["seq_len"]: r for r in run["results"]} for run in runs]
    lengths = sorted(set().union(*by_len))
    report: dict = {"reference": ref_tag, "tags": tags, "files": list(paths), "lengths": {}}
    print(f"perplexity on {runs[0]['data'].get('corpus')} ({runs[0]['data'].get('split')}); deltas vs {ref_tag}")
    for S in lengths:
        entry: dict = {}
        ref = by_len[0].get(S)
        print(f"seq_len {fmt_size(S)}")
        for tag, rl in zip(tags, by_len):
            r = rl.get(S)
            if r is None:
                continue
            row = {
                "ppl": r["ppl"],
                "loss": r["loss"],
                "n_windows": r["n_windows"],
                "buckets": {f"{fmt_size(b['lo'])}-{fmt_size(b['hi'])}": b["ppl"] for b in r["buckets"]},
            }
            for part in ("within_base_context", "beyond_base_context"):
                if part in r:
                    row[part] = r[part]["ppl"]
            if ref is not None and r is not ref and ref["ppl"] and r["ppl"]:
                row["delta_ppl"] = r["ppl"] - ref["ppl"]
                row["rel_delta_ppl"] = r["ppl"] / ref["ppl"] - 1
                row["paired_all"] = _paired(ref, r)
                if "beyond_base_context" in r and "beyond_base_context" in ref:
                    split = [b["lo"] for b in r["buckets"]].index(r["beyond_base_context"]["lo"])
                    row["paired_beyond_base_context"] = _paired(ref, r, split)
            entry[tag] = row
            line = f"  {tag:>24}: ppl {row['ppl'] or float('nan'):9.3f}"
            if "within_base_context" in row:
                line += (
                    f"  (<base {row['within_base_context'] or float('nan'):9.3f},"
                    f" >=base {row['beyond_base_context'] or float('nan'):9.3f})"
                )
            if "rel_delta_ppl" in row:
                line += f"  {100 * row['rel_delta_ppl']:+7.2f}%"
                pb = row.get("paired_beyond_base_context") or row.get("paired_all")
                if pb and pb["stderr"] is not None:
                    line += (
                        f"  paired dloss{' >=base' if 'paired_beyond_base_context' in row else ''} "
                        f"{pb['mean_delta_loss']:+.4f} +- {pb['stderr']:.4f} "
                        f"({pb['windows_better']}/{pb['n_windows']} windows better)"
                    )
            print(line)
            print("  " + " " * 26 + "  ".join(f"{k}:{v or float('nan'):.2f}" for k, v in row["buckets"].items()))
        report["lengths"][str(S)] = entry
    os.makedirs(out_dir, exist_ok=True)
    json_path = Path(out_dir) / f"long_context_ppl_{name}.json"
    json_path.write_text(json.dumps(report, indent=1))
    png = Path(out_dir) / f"long_context_ppl_{name}.png"
    _plot(runs, tags, by_len, lengths, png)
    print(f"wrote {json_path} and {png}")
    return report


def _plot(runs, tags, by_len, lengths, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    S = max(lengths)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for tag, rl in zip(tags, by_len):
        r = rl.get(S)
        if r is not None:
            xs = [b["hi"] for b in r["buckets"] if b["ppl"]]
            ax1.plot(xs, [b["ppl"] for b in r["buckets"] if b["ppl"]], "o-", label=tag)
        pts = [(L, rl[L]["ppl"]) for L in lengths if L in rl and rl[L]["ppl"]]
        if pts:
            ax2.plot(*zip(*pts), "o-", label=tag)
    base = next((r.get("base_context") for r in runs if r.get("base_context")), None)
    sizes = FuncFormatter(lambda x, _: fmt_size(int(round(x))))
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(sizes)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(alpha=0.3, which="both")
        if base:
            ax.axvline(base, color="gray", ls="--", lw=1)
        ax.legend(fontsize=8)
    ax1.set_xlabel("position in window (bucket upper edge, tokens)")
    ax1.set_ylabel("perplexity of the bucket")
    ax1.set_title(f"by position, windows of {fmt_size(S)} tokens")
    ax2.set_xlabel("window length (tokens)")
    ax2.set_ylabel("perplexity")
    ax2.set_title("whole windows")
    fig.suptitle(f"held-out perplexity: {runs[0]['data'].get('corpus')} ({runs[0]['data'].get('split')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
