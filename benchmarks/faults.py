#!/usr/bin/env python
"""Fault suite (issue 33): every way a 2-rank CP=2 train.py run can fail, one case per run,
each checked for how it ends, how fast, and what work it keeps; one JSON table.

    python benchmarks/faults.py --backend nccl --out $OUT/faults.json   # 2 GPUs, NCCL, ~5 min
    python benchmarks/faults.py --backend gloo --out faults.json        # 2 CPU processes, tiny model
    python benchmarks/faults.py --cases sigkill_rank1,nan_rank1         # a subset

Every case runs train.py (a tiny GPT, CP=2 over 2 ranks, FSDP2, causal ring attention,
a checkpoint every ``--checkpoint-every`` steps) through benchmarks/fault_inject.py, which
adds a step probe and the injected fault; cases are in benchmarks/fault_cases.py, process
handling in benchmarks/fault_runs.py. First an uninterrupted run gives the reference losses
(and its checkpoints for the 2 -> 1 resume); a second one measures the run-to-run noise
(0 on CPU: resumes must then be bit-exact). The table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from fault_cases import CASES, NEEDS_REFERENCE, Settings, baseline
from fault_runs import compare, gpu_held  # benchmarks/ is sys.path[0]

GPU_MODEL = [
    "--model.model.n_layer",
    "4",
    "--model.model.n_embd",
    "512",
    "--model.model.n_head",
    "4",
    "--model.model.n_kv_head",
    "2",
    "--model.model.intermediate_size",
    "1408",
]


def parse_args(argv=None) -> argparse.Namespace:
    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl" if two_gpus else "gloo",
        help="nccl: 2 GPUs, bf16; gloo: 2 CPU processes, fp32 (default: nccl if 2 GPUs are visible)",
    )
    p.add_argument("--out", type=Path, default=None, help="the JSON table (default: print only)")
    p.add_argument("--cases", default="all", help=f"comma-separated subset of: {', '.join(CASES)}")
    p.add_argument("--workdir", type=Path, default=None, help="run folders and logs (default: a temp dir, removed)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (gloo 16, nccl 120)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="(gloo 4, nccl 30); faults hit 1.5x this")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (gloo 64, nccl 16384)")
    p.add_argument("--preset", default="tiny", help="model preset (nccl adds 4 layers x 512, head dim 128)")
    p.add_argument("--failure-timeout", type=float, default=10.0, help="the watchdog's (train.py --failure-timeout)")
    p.add_argument("--grace", type=float, default=25.0, help="SIGTERM grace period (--stop-grace-period)")
    p.add_argument("--stall-timeout", type=int, default=30, help="process-group timeout in the stall case, s")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="cases run at once (nccl 3: the runs are small and share the 2 GPUs; gloo 1)",
    )
    p.add_argument(
        "--no-repeat",
        action="store_true",
        help="skip the second uninterrupted run (noise then counts as 0: resumes must be bit-exact)",
    )
    p.add_argument("--train-flags", default="", help="more train.py flags for every run (one string)")
    return p.parse_args(argv)


def settings(args: argparse.Namespace, workdir: Path) -> Settings:
    gpu = args.backend == "nccl"
    steps = args.steps or (120 if gpu else 16)
    every = args.checkpoint_every or (30 if gpu else 4)
    seq = args.seq_len or (16384 if gpu else 64)
    if not 2 * every < steps:
        raise SystemExit(f"faults.py: error: --steps {steps} must exceed 2 x --checkpoint-every {every}")
    flags = [
        "--data",
        "stdlib:json,email",
        "--preset",
        args.preset,
        "--model.model.vocab_size",
        "512",
        "--seq-len",
        str(seq),
        "--batch-size",
        "1" if gpu else "2",
        "--max-steps",
        str(steps),
        "--decay-steps",
        str(steps),
        "--warmup-steps",
        "2",
        "--lr",
        "3e-3",
        "--seed",
        "1234",
        "--context-parallel",
        "2",
        "--devices",
        "2",
        "--data-parallel",
        "fsdp",
        "--attention",
        "causal",
        "--accelerator",
        "gpu" if gpu else "cpu",
        "--precision",
        "bf16-mixed" if gpu else "32-true",
        "--strategy.process_group_backend",
        args.backend,
        "--checkpoint-every",
        str(every),
        "--val-every",
        "0",
        "--trainer.enable_progress_bar",
        "false",
        "--failure-timeout",
        f"{args.failure_timeout:g}",
        "--stop-grace-period",
        f"{args.grace:g}",
        *(GPU_MODEL if gpu else []),
        *args.train_flags.split(),
    ]
    return Settings(
        workdir=workdir,
        flags=flags,
        steps=steps,
        checkpoint_every=every,
        failure_timeout=args.failure_timeout,
        grace=args.grace,
        stall_pg_timeout=args.stall_timeout,
        startup_s=240.0 if gpu else 300.0,
        gpu=gpu,
        loss_tol=2e-2 if gpu else 1e-3,
    )


def machine(backend: str) -> str:
    if backend == "nccl":
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        return f"{torch.cuda.device_count()} x {', '.join(sorted(names))}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table (what the README's reliability section shows)."""
    lines = [
        "| case | outcome | s to exit | exit codes | work lost | message (or why it failed) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        codes = ", ".join(f"{k} {v}" for k, v in r["exit_codes"].items() if k != "workers" or v)
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        lost = "-" if r["work_lost"] is None else str(r["work_lost"])
        note = (r["why"] if r["outcome"] == "fail" else r["message"]).replace("|", "/")
        lines.append(f"| {r['case']} | {r['outcome']} | {seconds} | {codes} | {lost} | {note[:160]} |")
    return "\n".join(lines)


def run_case(name: str, s: Settings) -> dict:
    try:
        return CASES[name](s)
    except Exception as exc:  # noqa: BLE001 - a case that cannot run is a failed row
        return {
            "case": name,
            "what": name,
            "outcome": "fail",
            "why": f"{type(exc).__name__}: {exc}",
            "seconds": None,
            "exit_codes": {},
            "work_lost": None,
            "message": "",
        }


def main(argv=None) -> int:
    args = parse_args(argv)
    args.jobs = args.jobs or (3 if args.backend == "nccl" else 1)
    chosen = list(CASES) if args.cases == "all" else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CASES]
    if unknown:
        raise SystemExit(f"faults.py: error: unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if args.backend == "nccl" and not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
        raise SystemExit("faults.py: error: --backend nccl needs 2 GPUs; use --backend gloo")
    # No core files: NCCL's watchdog aborts the process whose collective timed out (the stall case).
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    # A suite started in the background (`cmd &` without job control) ignores SIGINT, and so would
    # every run it starts (an ignored signal stays ignored across exec): the SIGINT cases need
    # runs that receive it, as in a terminal. (A handled signal is reset to the default on exec.)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="longctx-faults-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LONGCTX_CACHE_DIR", str(workdir / "cache"))  # tokenizer + corpus, built once
    s = settings(args, workdir)
    start = time.monotonic()
    rows = []

    def record(row: dict) -> None:
        row["message"] = row["message"].replace(f"{workdir}/", "")  # run folders by their names
        rows.append(row)
        print(
            f"[faults] {row['case']}: {row['outcome']} ({'-' if row['seconds'] is None else row['seconds']}s) "
            f"{row['why'] or row['message']}",
            flush=True,
        )

    try:
        if NEEDS_REFERENCE & set(chosen):
            names = ["baseline"] + ([] if args.no_repeat else ["baseline_repeat"])
            with ThreadPoolExecutor(max_workers=min(args.jobs, 2)) as pool:
                ref, *rep = pool.map(lambda name: baseline(s, name), names)
            s.reference = ref.pop("losses")
            record(ref)
            for row in rep:  # the run-to-run noise a resume is allowed
                row["what"] = "second uninterrupted run (run-to-run loss noise)"
                s.noise = row["loss_diff"] = compare(row.pop("losses"), s.reference, range(s.steps))
                row.check(s.noise is not None, "losses missing")
                record(row)
            if ref["outcome"] != "pass":
                chosen = [c for c in chosen if c not in NEEDS_REFERENCE]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each case waits on its own processes
            for row in pool.map(lambda name: run_case(name, s), chosen):
                record(row)
        if s.gpu:  # with every run over, no process may hold GPU memory (the cases check their own)
            held = gpu_held()
            gpu_after = {
                "case": "gpu_memory_after_all",
                "what": "no process holds GPU memory after the suite",
                "outcome": "pass" if not held else "fail",
                "why": f"held by pids {held}" if held else "",
                "seconds": None,
                "exit_codes": {},
                "work_lost": None,
                "message": f"nvidia-smi: {held}",
            }
            record(gpu_after)
    finally:
        if args.workdir is None and all(r["outcome"] == "pass" for r in rows):
            shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "backend": args.backend,
        "machine": machine(args.backend),
        "steps": s.steps,
        "checkpoint_every": s.checkpoint_every,
        "fault_step": s.signal_step,
        "failure_timeout": s.failure_timeout,
        "grace_period": s.grace,
        "train_flags": s.flags,
        "run_plan": next((r["run_plan"] for r in rows if r.get("run_plan")), None),
        "noise": s.noise,
        "wall_s": round(time.monotonic() - start),
        "passed": sum(r["outcome"] == "pass" for r in rows),
        "cases": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(
        f"\nfault suite, {args.backend} ({result['machine']}), {result['wall_s']} s; run-to-run loss noise "
        f"{s.noise}\n" + table(rows)
    )
    if any(r["outcome"] == "fail" for r in rows):
        print(f"(run folders and logs kept in {workdir})")
    return 0 if all(r["outcome"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
