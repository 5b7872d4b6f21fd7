"""train.py runs as rows of predicted vs measured memory (benchmarks/device/device_memory_full.sh,
benchmarks/memory_full_table.py).

A case folder holds ``train.log`` (the run's output), ``rc`` (its exit status), ``wall_s``
and ``run/`` (train.py's output dir: ``config.yaml``, ``metrics.csv``). The prediction is
recomputed from the run's own config.yaml, which records the plan the run resolved (kernels,
and what ``fitting_plan`` escalated); the measurement is ``metrics.csv``'s ``peak_mem_gib``:
``torch.cuda.max_memory_allocated`` of the fullest rank, cumulative, logged before each
optimizer step (so a step's row also covers the previous step's optimizer step). Step 1's
peak comes before the first optimizer step creates AdamW's states: it is compared with the
model's first step, the later steps' with its steady peak.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import yaml

from longctx.memory import GiB, kernel_family
from longctx.models import GPTConfig

from .memory_recheck import comparisons, predict

UPPER = 1.10  # a prediction passes at or above the measurement and at most 10% above it


def _config_sizes(model: dict) -> tuple[dict, bool]:
    """(GPTConfig sizes, hf_modules) of a run's ``model`` section."""
    if model.get("hf_model"):
        from longctx.models.hf_lm import sizes_config

        hf = json.loads((Path(model["hf_model"]) / "config.json").read_text())
        return sizes_config(SimpleNamespace(**hf)).to_dict(), True
    return GPTConfig.from_dict(model["model"]).to_dict(), False


def _metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for r in csv.DictReader(path.open()):
        rows.append({k: float(v) for k, v in r.items() if v not in ("", None)})
    return rows


def _printed(log: str, prefix: str) -> Optional[str]:
    return next((line.strip() for line in log.splitlines() if line.startswith(prefix)), None)


def run_row(folder) -> dict:
    """One case folder as a row: the run's shape and plan, measured and predicted bytes."""
    folder = Path(folder)
    log = (folder / "train.log").read_text(errors="replace") if (folder / "train.log").is_file() else ""
    row: dict = dict(case=folder.name, rc=_int(folder / "rc"), wall_s=_int(folder / "wall_s"))
    config_path = folder / "run" / "config.yaml"
    if not config_path.is_file():
        return dict(row, error="no config.yaml (the run did not start)", log_tail=log[-2000:])
    cfg = yaml.safe_load(config_path.read_text())
    model, plan = cfg["model"], dict(cfg["model"]["parallel"])
    sizes, hf = _config_sizes(model)
    cp = int(cfg["strategy"]["context_parallel_size"])
    world = int(cfg["trainer"]["devices"]) * int(cfg["trainer"].get("num_nodes") or 1)
    plan_line = _printed(log, "run plan:")
    mode = re.search(r"data_parallel=(\w+)", plan_line or "")
    documents = model.get("attention", "document") == "document"
    kernel = plan.get("document_backend") if documents else plan.get("attention_backend")
    precision = str(cfg["trainer"].get("precision", "32-true"))
    row.update(
        model=sizes,
        hf_modules=hf,
        seq_len=int(cfg["data"]["seq_len"]),
        cp=cp,
        dp=max(world // cp, 1),
        batch_size=int(cfg["data"]["batch_size"]),
        data_parallel=mode.group(1) if mode else cfg["strategy"].get("data_parallel", "fsdp"),
        precision="32-true" if precision[:2] in ("32", "64") else "bf16-mixed",
        attention=model.get("attention"),
        plan=plan,
        attention_kernel="auto" if kernel in (None, "auto") else kernel_family(kernel),
        printed=[line for line in (_printed(log, "memory: "), plan_line, _printed(log, "memory (predicted")) if line],
    )
    pred = predict(row, {})
    row.update(
        predicted_gpu=pred.allocated_bytes,
        predicted_first_step_gpu=pred.first_step_allocated_bytes,
        predicted_gpu_with_context=pred.gpu_bytes,
        predicted_phase=pred.phase,
        predicted_items={k: round(v / GiB, 3) for k, v in pred.items.items()},
        predicted_phases={k: round(v / GiB, 3) for k, v in pred.phases.items()},
    )
    # OUTPUT_DIR/metrics.csv is written at the end; a run killed at its limit left only
    # Lightning's own CSV (flushed every step).
    raw = sorted((folder / "run" / "logs").glob("version_*/metrics.csv"), key=lambda p: p.stat().st_mtime)
    steps = _metrics(folder / "run" / "metrics.csv") or (_metrics(raw[-1]) if raw else [])
    peaks = [s["peak_mem_gib"] for s in steps if "peak_mem_gib" in s]
    losses = [s["train_loss"] for s in steps if "train_loss" in s]
    row.update(
        steps=len(steps),
        measured_steps_gib=[round(p, 3) for p in peaks],
        step_s=[round(s["step_s"], 2) for s in steps if "step_s" in s],
        train_loss=losses,
        loss_finite=bool(losses) and all(math.isfinite(v) for v in losses),
    )
    last = steps[-1] if steps else {}
    for key in ("tokens_per_s", "mfu"):
        if key in last:
            row[key] = last[key]
    if peaks:
        row["measured_first_step_gpu"] = int(peaks[0] * GiB)
        if len(peaks) > 1:
            row["measured_gpu"] = int(max(peaks[1:]) * GiB)
        checks = comparisons(row, pred)
        row.update(
            ratios={what: measured / predicted for what, measured, predicted, _ in checks},
            passed=all(measured <= predicted <= UPPER * measured for _, measured, predicted, _ in checks),
        )
    if row["rc"] not in (0, None):
        row["log_tail"] = log[-2000:]
    return row


def _int(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def readme_rows(rows: list[dict]) -> list[str]:
    """The README's table of the full-depth runs: a header and one markdown row per case."""
    lines = [
        "| case | model, tokens (CP) | plan | step 1: predicted / measured (ratio) "
        "| steady: predicted / measured (ratio) | tokens/s | MFU |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "model" not in r:
            lines.append(f"| {r['case']} | | | {r.get('error', '')} | | | |")
            continue
        p = r["plan"]
        plan = ", ".join(
            x
            for x in (
                p.get("activation_checkpointing"),
                f"tile {p['mlp_tile_size']}" if p.get("mlp_tile_size") else "",
                f"{p['attention_head_chunks']} head chunks" if p.get("attention_head_chunks", 1) > 1 else "",
                f"offload {p['offload_activations']}" if p.get("offload_activations") else "",
                r.get("attention") or "",
            )
            if x
        )
        cells = [
            r["case"],
            f"{'HF ' if r['hf_modules'] else ''}{r['model']['n_layer']}x{r['model']['n_embd']}, "
            f"{r['seq_len']:,} ({r['cp']})",
            plan,
            _compared(r["predicted_first_step_gpu"], r.get("measured_first_step_gpu"), f"none (rc {r.get('rc')})"),
            _compared(r["predicted_gpu"], r.get("measured_gpu"), "not run (one step)"),
            f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "",
            f"{100 * r['mfu']:.1f}%" if "mfu" in r else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _compared(predicted: int, measured: Optional[int], missing: str) -> str:
    if not measured:
        return f"{predicted / GiB:.1f} GiB / {missing}"
    return f"{predicted / GiB:.1f} / {measured / GiB:.1f} GiB ({measured / predicted:.3f})"


def table_main(argv=None) -> int:
    """The command line of benchmarks/memory_full_table.py (see there)."""
    ap = argparse.ArgumentParser(description="the full-depth memory runs as one table of predicted vs measured")
    ap.add_argument("runs", help="folder of case folders (device_memory_full.sh's)")
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--cases", default="", help="the case folders, in order (default: all, by name)")
    ap.add_argument("--readme", action="store_true", help="print the README rows too")
    args = ap.parse_args(argv)
    runs = Path(args.runs)
    names = args.cases.split() or sorted(p.name for p in runs.iterdir() if p.is_dir())
    rows = [run_row(runs / name) for name in names if (runs / name).is_dir()]
    gpus = runs / "gpus.txt"
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M"),
        torch=torch.__version__,
        gpus=gpus.read_text().strip().splitlines() if gpus.is_file() else [],
        note="measured: metrics.csv peak_mem_gib (max_memory_allocated, fullest rank, cumulative); "
        "predicted: longctx.memory.estimate from the run's config.yaml",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    for r in rows:
        if "predicted_gpu" not in r:
            print(f"{r['case']}: {r.get('error')} (rc {r.get('rc')})")
            continue
        ratios = ", ".join(f"{what} {ratio:.3f}" for what, ratio in r.get("ratios", {}).items())
        print(
            f"{r['case']}: rc {r['rc']}, {r.get('wall_s')} s; measured per step {r['measured_steps_gib']} GiB; "
            f"predicted {r['predicted_first_step_gpu'] / GiB:.2f} GiB allocated in step 1, "
            f"{r['predicted_gpu'] / GiB:.2f} GiB ({r['predicted_gpu_with_context'] / GiB:.1f} GiB device) "
            f"at {r['predicted_phase']} from step 2 on"
            + (f"; ratio {ratios} {'pass' if r['passed'] else 'FAIL'}" if ratios else "")
            + (f"; {r['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in r else "")
            + (f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "")
            + (f"; step_s {r['step_s']}" if r.get("step_s") else "")
            + (f"; loss finite {r['loss_finite']}" if r.get("train_loss") else "")
        )
    if args.readme:
        print("\n".join(readme_rows(rows)))
    print(f"wrote {args.out}")
    return 0
