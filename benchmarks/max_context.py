"""Largest trainable sequence length of a preset on 1, 2, 4, ... GPUs, +/- activation checkpointing.

Run (driver; launches its own jobs, do NOT wrap in torchrun):
    python benchmarks/max_context.py [--preset gpt-350m] [--gpus 4] [--budget-s 300]
    python benchmarks/max_context.py --plot benchmarks/results/max_context_ws4.json   # CPU ok
    python benchmarks/max_context.py --dry-run      # tiny preset, CPU, gloo: tests the pipeline

Method (measure cheaply, predict, then verify what the clock allows):

1. One *job* per (P, checkpointing): a fresh process group of P GPUs (``torchrun
   --standalone`` under ``CUDA_VISIBLE_DEVICES``; plain python for P=1). The driver packs
   jobs onto the GPUs so that disjoint ones run at the same time.
2. A job builds the full model (bf16 autocast, fp32 weights, fused AdamW, DDP for P>1,
   ring attention over the P ranks, zigzag layout) and runs real training steps at three
   modest per-GPU lengths that surely fit (4K/8K/16K tokens per GPU without
   checkpointing, 8K/16K/32K with). Each length: one step (new shapes, optimizer state
   exists from the warm-up), then ``reset_peak_memory_stats`` and a measured step:
   peak = ``max_memory_allocated`` (max over ranks), step time.
3. Peak memory is linear in the per-GPU length S/P (weights + grads + AdamW + DDP
   buckets + one loss chunk are constant; activations, ring buffers, attention
   outputs/LSE, dQ/dK/dV accumulators scale with S/P; nothing is quadratic), so fit
   ``peak = a + b * S/P`` and predict the largest grid length (2^k and 1.5 * 2^k) with a
   predicted peak under ``--mem-frac`` (92%) of the device's total memory. The 8% left
   covers what ``max_memory_allocated`` does not see: CUDA context, NCCL buffers,
   allocator slack (``expandable_segments`` is on; the non-PyTorch part is recorded).
4. Step time is fitted as ``c1 * S/P + c2 * (S/P) * S`` (matmuls linear, attention
   quadratic; recompute included when checkpointing), with ``c2`` at least the attention
   FLOPs at the GPU's peak rate (a noisy fit at short lengths must not call a quadratic
   step linear). If the predicted step at the maximum takes <= ``--verify-max-s``
   (default 45 s, so that 1/2/4 GPUs finish in ~4 minutes on 4 x H200 within the
   ``--budget-s`` 300 s deadline), one real step at that length VERIFIES it, then the next
   grid length is tried (expected out of memory: that brackets the maximum). If it is too
   slow (checkpointing: a 1M-token 350M step on 4 GPUs takes ~2 min), the job measures the
   largest grid length it can afford in time instead ("extend") and refits with it, so
   the prediction rests on a point 1/3-1/2 of the way out; the row then says "predicted".
5. Collective safety: an out-of-memory inside a ring step of P>1 would leave the other
   ranks blocked in NCCL. So every job is its own process group in its own subprocess:
   the rank that runs out of memory writes its record and ``os._exit``s, torchrun tears
   the others down at once, and the driver (which never touches CUDA) carries on; a
   failed verification of P>1 is retried one grid length lower in a new job when time
   allows. P=1 steps have no collectives and catch the error in-process. Every decision
   inside a job is taken on rank 0 from all-reduced values and broadcast.
6. Which buffers dominate: at the largest fitting length rank 0 records one step with
   ``torch.cuda.memory._record_memory_history``; the trace is replayed to the moment of
   peak and the live blocks are grouped by the innermost source line of this repository
   (per token and per token per layer). The slope ``b`` per token per layer is in the
   table; if memory is O(S/P) the fitted lines of all P nearly coincide in the right panel
   of the plot (P>1 adds the ring's K/V and dK/dV buffers, also O(S/P)) and the maximum
   grows linearly with P.

Records (JSON lines, written by each job after every measurement) and each job's log live
in ``$OUT/max_context_ws{N}_records/``; the driver rewrites ``$OUT/max_context_ws{N}.json``
(default OUT=benchmarks/results) after every new record and plots it at the end.

Files: this one is the command line; max_context_driver.py the driver, max_context_job.py one
job, max_context_plot.py the figure; the fits, decisions and summary table are in
longctx/bench/max_context_fit.py, the peak attribution in longctx/bench/peak_trace.py.
"""

from __future__ import annotations

import os

# Before torch initialises CUDA: long sequences allocate huge, differently sized blocks;
# expandable segments keep fragmentation (reserved - allocated) small.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import time  # noqa: E402

from max_context_driver import drive  # noqa: E402
from max_context_job import job_main  # noqa: E402
from max_context_plot import plot  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help="model preset (default gpt-350m; tiny with --dry-run)")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible)")
    ap.add_argument("--sizes", default="", help="comma list of P (default 1,2,4,... up to --gpus)")
    ap.add_argument("--checkpointing", default="both", choices=["both", "on", "off"])
    ap.add_argument("--mem-frac", type=float, default=0.92, help="usable fraction of device memory")
    ap.add_argument("--verify-max-s", type=float, default=None, help="longest step run to verify (s)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole run (s)")
    ap.add_argument("--grid-min", type=int, default=None)
    ap.add_argument("--grid-max", type=int, default=None)
    ap.add_argument("--fit-lengths-off", default=None, help="tokens per GPU measured without checkpointing")
    ap.add_argument("--fit-lengths-on", default=None, help="tokens per GPU measured with checkpointing")
    ap.add_argument("--backend", default=None, help="attention backend (default auto; torch with --dry-run)")
    ap.add_argument(
        "--no-breakdown", dest="breakdown", action="store_false", help="skip the allocator-trace breakdown of the peak"
    )
    ap.add_argument("--nccl-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--dry-run", action="store_true", help="tiny preset on the CPU with gloo (pipeline test)")
    ap.add_argument("--dry-run-mem-mib", type=float, default=48.0, help="synthetic device memory (dry run)")
    ap.add_argument(
        "--dry-run-oom-rank", type=int, default=-1, help="dry run: only this rank runs out of memory (-1: all)"
    )
    ap.add_argument("--plot", default=None, metavar="FILE.json", help="only plot a results file (CPU)")
    # internal: one job, launched by the driver
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--p", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--records", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--verify-lengths", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dry = args.dry_run
    defaults = dict(
        preset="tiny" if dry else "gpt-350m",
        verify_max_s=3.0 if dry else 45.0,
        budget_s=300.0,
        grid_min=256 if dry else 16384,
        grid_max=(1 << 18) if dry else (1 << 25),
        fit_lengths_off="128,256,512" if dry else "4096,8192,16384",
        fit_lengths_on="128,256,512" if dry else "8192,16384,32768",
        backend="torch" if dry else "auto",
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not 0 < args.mem_frac <= 1:
        raise SystemExit(f"--mem-frac must be in (0, 1], got {args.mem_frac}")
    if args.deadline is None:
        args.deadline = time.time() + args.budget_s
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot:
        print(plot(args.plot))
    elif args.job:
        job_main(args)
    elif "LOCAL_RANK" in os.environ:
        raise SystemExit("run the driver with plain `python benchmarks/max_context.py`; it launches torchrun itself")
    else:
        drive(args)


if __name__ == "__main__":
    main()
