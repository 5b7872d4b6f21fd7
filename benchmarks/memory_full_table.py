"""The full-depth memory runs of benchmarks/device_memory_full.sh as one table: per case the
memory model's prediction (recomputed from the run's own config.yaml) against the measured
``torch.cuda.max_memory_allocated`` (the fullest rank's), the ratio and whether it passes
(measured <= predicted <= 1.10 x measured), with tokens/s and MFU of the last step.

    python benchmarks/memory_full_table.py RUNS --out $OUT/memory_full.json [--readme]

RUNS holds one folder per case (``longctx.bench.memory_runs``). ``--readme`` also prints the
rows in the README's table format. ``memory_validate.py --recheck`` takes the JSON later.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from longctx.bench.memory_runs import readme_rows, run_row
from longctx.memory import GiB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", help="folder of case folders (device_memory_full.sh's)")
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--cases", default="", help="the case folders, in order (default: all, by name)")
    ap.add_argument("--readme", action="store_true", help="print the README rows too")
    args = ap.parse_args(argv)
    runs = Path(args.runs)
    names = args.cases.split() or sorted(p.name for p in runs.iterdir() if p.is_dir())
    rows = [run_row(runs / name) for name in names if (runs / name).is_dir()]
    import torch

    gpus = runs / "gpus.txt"
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__,
                gpus=gpus.read_text().strip().splitlines() if gpus.is_file() else [],
                note="measured: metrics.csv peak_mem_gib (max_memory_allocated, fullest rank, cumulative); "
                     "predicted: longctx.memory.estimate from the run's config.yaml")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    for r in rows:
        if "predicted_gpu" not in r:
            print(f"{r['case']}: {r.get('error')} (rc {r.get('rc')})")
            continue
        got = f"{r['measured_gpu'] / GiB:.2f} GiB" if r.get("measured_gpu") else "no measurement"
        print(f"{r['case']}: rc {r['rc']}, {r.get('wall_s')} s; measured {got} per step "
              f"{r['measured_steps_gib']}; predicted {r['predicted_gpu'] / GiB:.2f} GiB allocated "
              f"({r['predicted_gpu_with_context'] / GiB:.1f} GiB device) at {r['predicted_phase']}"
              + (f"; ratio {r['ratio']:.3f} {'pass' if r['passed'] else 'FAIL'}" if "ratio" in r else "")
              + (f"; {r['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in r else "")
              + (f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "")
              + (f"; step_s {r['step_s']}" if r.get("step_s") else "")
              + (f"; loss finite {r['loss_finite']}" if r.get("train_loss") else ""))
    if args.readme:
        print("\n".join(readme_rows(rows)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
