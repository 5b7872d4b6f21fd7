"""FP8 against bf16 from train.py runs (benchmarks/device/device_float8.sh): per run the median
tokens/s, step_s and MFU over steps FIRST.. (1-based), the peak memory measured (metrics.csv's
peak_mem_gib, the largest step: max_memory_allocated) against the run plan's prediction of the
same (the log's "memory (predicted, per rank): GPU X GiB (Y allocated)": Y), the losses step by
step; then FP8 over bf16 and the bf16 noise.

    python benchmarks/float8_table.py --runs DIR --out float8.json   # DIR: <run>.log, <run>_metrics.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
from pathlib import Path


def summarize(log: Path, metrics: Path, first: int) -> dict:
    row: dict = {"run": log.stem}
    text = log.read_text(errors="replace") if log.exists() else ""
    plan = re.search(r"^run plan: .*$", text, re.M)
    predicted = re.search(r"memory \(predicted, per rank\): GPU ([0-9.]+) GiB \(([0-9.]+) allocated\)", text)
    row["run_plan"] = plan.group(0) if plan else None
    # GPU: with the CUDA context and the allocator's slack; allocated: what max_memory_allocated
    # (metrics.csv's peak_mem_gib) measures, the figure to compare.
    row["predicted_gib"] = float(predicted.group(1)) if predicted else None
    row["predicted_allocated_gib"] = float(predicted.group(2)) if predicted else None
    if not metrics.exists():
        row["error"] = (text.strip().splitlines() or ["no log"])[-1][:400]
        return row
    with open(metrics) as f:
        rows = [r for r in csv.DictReader(f) if r.get("step") not in (None, "")]

    def column(name, picked):
        return [float(r[name]) for r in picked if r.get(name) not in (None, "")]

    steady = [r for r in rows if int(r["step"]) >= first - 1]
    for name in ("tokens_per_s", "step_s", "mfu"):
        values = column(name, steady)
        row[name] = statistics.median(values) if values else None
    peaks = column("peak_mem_gib", rows)
    row["peak_mem_gib"] = max(peaks) if peaks else None
    row["losses"] = column("train_loss", rows)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--first", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logs = sorted(args.runs.glob("*.log"))
    runs = {log.stem: summarize(log, args.runs / f"{log.stem}_metrics.csv", args.first) for log in logs}
    report: dict = {"runs": runs}
    bf16, repeat, fp8 = runs.get("bf16"), runs.get("bf16-repeat"), runs.get("fp8")

    def loss_gap(a, b):
        pairs = list(zip(a["losses"], b["losses"]))
        return max((abs(x - y) for x, y in pairs), default=None)

    if bf16 and fp8 and bf16.get("tokens_per_s") and fp8.get("tokens_per_s"):
        report["fp8_over_bf16_tokens_per_s"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        report["fp8_vs_bf16_max_loss_gap"] = loss_gap(bf16, fp8)
    if bf16 and repeat and bf16.get("losses") and repeat.get("losses"):
        report["bf16_noise_max_loss_gap"] = loss_gap(bf16, repeat)
    for row in runs.values():
        if row.get("predicted_allocated_gib") and row.get("peak_mem_gib"):
            row["predicted_over_measured"] = row["predicted_allocated_gib"] / row["peak_mem_gib"]
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    for name, row in runs.items():
        print(name, {k: v for k, v in row.items() if k not in ("losses", "run_plan")})


if __name__ == "__main__":
    main()
