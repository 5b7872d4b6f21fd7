"""The scale-out table from train.py runs' metrics.csv files: one row per (workload, gpus) with
the median tokens_per_s, step_s, outside_s, mfu and peak_mem_gib over steps FIRST..LAST (1-based, as train.py's
steps are counted), the speed-up over the same workload's one-GPU row, and outside_s as a share
of the step's wall time.

    python benchmarks/scaleout_table.py --runs DIR --gpu h100 --out benchmarks/results/scaleout_h100x4.json

``DIR`` holds ``<workload>_<n>gpu_metrics.csv`` files (benchmarks/device/device_scaleout.sh writes them);
a workload named ``<base>-<variant>`` without a one-GPU row is compared with ``<base>``'s.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
from pathlib import Path

FIELDS = ("tokens_per_s", "step_s", "outside_s", "mfu", "peak_mem_gib")


def run_row(path: Path, first: int, last: int) -> dict:
    """Medians of FIELDS over steps first..last of one metrics.csv (rows are 0-based steps)."""
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("step") not in (None, "")]
    picked = [r for r in rows if first - 1 <= int(r["step"]) <= last - 1]
    row = {"steps": len(picked)}
    for field in FIELDS:
        values = [float(r[field]) for r in picked if r.get(field) not in (None, "")]
        row[field] = statistics.median(values) if values else None
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss") not in (None, "")]
    row["losses"] = losses
    return row


def table(runs: Path, first: int, last: int) -> list[dict]:
    out = []
    for path in sorted(runs.glob("*_metrics.csv")):
        match = re.fullmatch(r"(.+)_(\d+)gpu_metrics\.csv", path.name)
        if not match:
            continue
        out.append({"workload": match[1], "gpus": int(match[2]), **run_row(path, first, last)})
    base = {r["workload"]: r["tokens_per_s"] for r in out if r["gpus"] == 1}
    for r in out:
        # "docs-gather" (a variant of "docs") is compared with the one-GPU "docs" row.
        one = base.get(r["workload"]) or base.get(r["workload"].split("-")[0])
        r["speedup"] = r["tokens_per_s"] / one if one and r["tokens_per_s"] else None
        if r["tokens_per_s"] and r["outside_s"] is not None and r["step_s"] is not None:
            r["outside_share"] = r["outside_s"] / (r["outside_s"] + r["step_s"])
    return sorted(out, key=lambda r: (r["workload"], r["gpus"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--gpu", required=True, help="the device, for the file: h100, h200")
    parser.add_argument("--first", type=int, default=5)
    parser.add_argument("--last", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = table(args.runs, args.first, args.last)
    print(f"{'workload':34} gpus  tokens/s   step_s outside_s speed-up")
    for r in rows:
        fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
        print(
            f"{r['workload']:34} {r['gpus']:4} {fmt(r['tokens_per_s'], '9.0f')} {fmt(r['step_s'], '8.3f')} "
            f"{fmt(r['outside_s'], '9.3f')} {fmt(r['speedup'], '7.2f')}x"
        )
    if args.out:
        args.out.write_text(json.dumps({"device": args.gpu, "steps": [args.first, args.last], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
