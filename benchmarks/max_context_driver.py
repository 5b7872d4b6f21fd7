"""The driver of benchmarks/max_context.py: schedules one job per (P, checkpointing) on GPU
subsets (disjoint ones at the same time), retries a failed verification lower, rewrites the
summary JSON after every new record and plots it at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from max_context_plot import plot

from longctx.bench.max_context_fit import fmt_len, grid_lengths, prev_grid, read_records, summarize

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().with_name("max_context.py")  # jobs run through the command line


PASS_THROUGH = (
    "preset",
    "mem_frac",
    "verify_max_s",
    "grid_min",
    "grid_max",
    "fit_lengths_off",
    "fit_lengths_on",
    "backend",
    "dry_run_mem_mib",
    "dry_run_oom_rank",
    "nccl_timeout_s",
)


def job_command(args, spec: dict, records: Path, deadline: float) -> list[str]:
    cmd = [
        str(SCRIPT),
        "--job",
        spec["name"],
        "--p",
        str(spec["p"]),
        "--ckpt",
        str(int(spec["ckpt"])),
        "--records",
        str(records),
        "--deadline",
        f"{deadline:.0f}",
    ]
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
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={spec['p']}",
        "--monitor-interval=0.5",
    ] + cmd


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
    meta = dict(
        preset=args.preset,
        gpus=n,
        sizes=sizes,
        mem_frac=args.mem_frac,
        verify_max_s=args.verify_max_s,
        budget_s=args.budget_s,
        grid_min=args.grid_min,
        grid_max=args.grid_max,
        fit_lengths_off=args.fit_lengths_off,
        fit_lengths_on=args.fit_lengths_on,
        dry_run=args.dry_run,
        date=time.strftime("%Y-%m-%d %H:%M"),
        torch=torch.__version__,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        command=" ".join(sys.argv),
    )
    # Longest first by GPU-seconds (P x a rough duration): the P=max jobs hold every GPU.
    specs = [
        dict(name=f"P{p}_{'ckpt' if c else 'nockpt'}", p=p, ckpt=c, est=70 if c else 40) for p in sizes for c in ckpts
    ]
    pending = sorted(specs, key=lambda s: -s["p"] * s["est"])
    free, running, seen_sizes = list(range(n)), {}, None
    while pending or running:
        for spec in list(pending):
            if time.time() > deadline - 30:
                print(f"[driver] out of time budget: not starting {spec['name']}", flush=True)
                pending.remove(spec)
            elif len(free) >= spec["p"]:
                gpus, free = free[: spec["p"]], free[spec["p"] :]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                if not args.dry_run:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] for i in gpus)
                log = open(rec_dir / f"{spec['name']}.log", "w")
                cmd = job_command(args, spec, rec_dir / f"{spec['name']}.jsonl", deadline)
                proc = subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
                )
                running[spec["name"]] = (proc, spec, gpus, log)
                pending.remove(spec)
                print(f"[driver] {time.time() - start:5.0f}s start {spec['name']} on GPUs {gpus}", flush=True)
        for name, (proc, spec, gpus, log) in list(running.items()):
            rc = proc.poll()
            if rc is None and time.time() > deadline + 20:
                _kill(proc)
                rc = proc.wait()
                with open(rec_dir / f"{name}.jsonl", "a") as f:
                    f.write(
                        json.dumps(
                            dict(
                                kind="error", job=name, p=spec["p"], ckpt=spec["ckpt"], msg="killed at the time budget"
                            )
                        )
                        + "\n"
                    )
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
        print(
            f"P={r['P']} ckpt={'on ' if r['checkpointing'] else 'off'} max={fmt_len(r.get('max_seq_len')):>6} "
            f"({r['status']}; predicted {fmt_len(r.get('predicted_max'))}, "
            f"{(r.get('bytes_per_token_per_layer') or 0) / 1024:.1f} KiB/token/layer; peak at max "
            f"{r.get('measured_peak_GiB_at_max') or 0:.1f} GiB measured, "
            f"{r.get('memory_model_peak_GiB_at_max') or 0:.1f} GiB longctx.memory)"
        )


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
