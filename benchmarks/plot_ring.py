"""Plot benchmarks/results/ring_ws*.json (written by benchmarks/ring.py): scaling and the peer.

Run: python benchmarks/plot_ring.py benchmarks/results/ring_ws4_h200.json  (CPU is fine)
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _scaling(ax, rows, length_key, label, title):
    """Per-GPU TFLOP/s against GPU count, one line per (backend, length)."""
    lines = defaultdict(list)
    for r in rows:
        if r.get("fb_ms") == r.get("fb_ms"):  # skip failed (NaN) measurements
            lines[(r["backend"], r[length_key])].append((r["P"], r["fb_tflops_per_gpu"]))
    for (backend, n), pts in sorted(lines.items()):
        ax.plot(*zip(*sorted(pts)), marker="o", label=f"ours-{backend} " + label.format(n // 1024))
    ax.set(title=title, xlabel="GPUs", ylabel="fwd+bwd TFLOP/s per GPU")
    ax.legend(fontsize=7)


def main(path: str) -> str:
    res = json.load(open(path))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    # 1-2. strong scaling (fixed S) and weak scaling (fixed tokens per GPU)
    _scaling(axes[0], res.get("strong", []), "S_total", "S={}K", "strong scaling (fixed S)")
    _scaling(axes[1], res.get("weak", []), "S_local", "{}K/GPU", "weak scaling (fixed tokens per GPU)")
    # 3. against the peer at the full world size
    ax = axes[2]
    world = res["world_size"]
    bars = {}
    for r in res.get("strong", []):
        if r["P"] == world:
            bars[(f"ours-{r['backend']}", r["S_total"])] = r["fb_ms"]
    for r in res.get("peer", []):
        if r["P"] == world:
            bars[(f"{r['impl']}-{r['method']}", r["S_total"])] = r["fb_ms"]
    seqs = sorted({s for _, s in bars})
    names = sorted({n for n, _ in bars})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j, s in enumerate(seqs) if (name, s) in bars]
        ax.bar(xs, [bars[(name, s)] for s in seqs if (name, s) in bars], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqs))], [f"{s // 1024}K" for s in seqs])
    ax.set(title=f"fwd+bwd time on {world} GPUs (lower is better)", ylabel="ms", yscale="log")
    ax.legend(fontsize=7)
    fig.suptitle(f"ring attention, {res.get('gpu')} x{world}, {res.get('shapes')}", fontsize=9)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(main(p))
