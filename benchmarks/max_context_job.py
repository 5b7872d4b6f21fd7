"""One job of benchmarks/max_context.py: (P, checkpointing) on P devices (or the CPU in a dry
run): fit lengths measured, the maximum predicted, verified or extended as time allows, every
measurement appended to the job's records; an out-of-memory of P>1 ends the process."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from longctx.bench.max_context_fit import (
    GiB,
    attention_time_floor,
    extension_length,
    fit_linear,
    fit_time,
    grid_lengths,
    next_grid,
    predict_max,
    predict_time,
    prev_grid,
)
from longctx.bench.peak_trace import attribute_peak, library_roots
from longctx.bench.step import LossModule, mean_step_seconds, train_step

OOM_EXIT = 17


class CudaMeter:
    def __init__(self, device: torch.device):
        self.device = device

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def overhead(self) -> int:
        """Device memory in use that PyTorch's allocator does not own (context, NCCL, ...)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free - torch.cuda.memory_reserved(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> tuple[int, int]:
        self.sync()
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)

    def watch(self):
        return contextlib.nullcontext()


class ProxyMeter:
    """Dry run on the CPU: weights + grads + AdamW state + bytes saved for backward.

    The CPU has no allocator statistics to ask; this proxy lets the dry run exercise the
    whole pipeline (fits, decisions, an out-of-memory in the middle of a ring step of P>1
    and the teardown that follows) against a synthetic device of ``total_bytes``.
    """

    def __init__(self, total_bytes: int, model: torch.nn.Module, enforce: bool = True):
        self.total_bytes, self.enforce = total_bytes, enforce
        self.static = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
        self.peak_ = 0

    def total(self) -> int:
        return self.total_bytes

    def overhead(self) -> int:
        return 0

    def sync(self) -> None:
        pass

    def reset(self) -> None:
        self.peak_ = 0

    def peak(self) -> tuple[int, int]:
        return self.peak_, self.peak_

    @contextlib.contextmanager
    def watch(self):
        cur, seen = [self.static], set()

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                cur[0] += st.nbytes()
                self.peak_ = max(self.peak_, cur[0])
                if self.enforce and cur[0] > self.total_bytes:
                    raise torch.OutOfMemoryError(f"simulated (dry run): {cur[0]} > {self.total_bytes} bytes")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


class Job:
    def __init__(self, args):
        from datetime import timedelta

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from longctx.models import GPT, GPTConfig

        self.args, self.p, self.ckpt, self.dry = args, args.p, bool(args.ckpt), args.dry_run
        self.dist, self.rank = dist, 0
        if self.dry:
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.p > 1:
            kw = {} if self.dry else {"device_id": self.device}
            dist.init_process_group(
                "gloo" if self.dry else "nccl", timeout=timedelta(seconds=args.nccl_timeout_s), **kw
            )
            if dist.get_world_size() != self.p:
                raise RuntimeError(f"job for P={self.p} started with {dist.get_world_size()} processes")
            self.rank = dist.get_rank()
        from longctx import CPContext, ParallelDims, ParallelPlan, parallelize

        self.cfg = GPTConfig.from_preset(args.preset)
        torch.manual_seed(0)
        with self.device:  # initialise on the device: a CPU init of 350M weights takes seconds
            self.gpt = GPT(self.cfg)
        self.plan = ParallelPlan(
            activation_checkpointing="full" if self.ckpt else "none", attention_backend=args.backend
        )
        parallelize(self.gpt, ParallelDims(cp=CPContext(dist.group.WORLD if self.p > 1 else None)), self.plan)
        net = LossModule(self.gpt)
        # DDP as Lightning's strategy uses it (defaults: separate gradient buckets).
        self.net = DDP(net, device_ids=None if self.dry else [self.device.index]) if self.p > 1 else net
        self.opt = torch.optim.AdamW(self.gpt.parameters(), lr=1e-5, fused=not self.dry)
        # --dry-run-oom-rank R: only rank R runs out of memory, the others stay blocked in the
        # ring (the case the one-job-per-subprocess design exists for).
        enforce = args.dry_run_oom_rank < 0 or args.dry_run_oom_rank == self.rank
        self.meter = (
            ProxyMeter(int(args.dry_run_mem_mib * 2**20), self.gpt, enforce) if self.dry else CudaMeter(self.device)
        )
        self.grid = grid_lengths(args.grid_min, args.grid_max, 2 * self.p)
        self.deadline = args.deadline

    # -- plumbing --------------------------------------------------------------------------

    def write(self, rec: dict, any_rank: bool = False) -> None:
        if self.rank == 0 or any_rank:
            rec = dict(rec, job=self.args.job, p=self.p, ckpt=self.ckpt, rank=self.rank, time=time.time())
            with open(self.args.records, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def agree(self, s: Optional[int]) -> Optional[int]:
        """Rank 0's decision for every rank (deadlines are read from each rank's clock)."""
        if self.p == 1:
            return s
        t = torch.tensor([s or 0], dtype=torch.int64, device=self.device)
        self.dist.broadcast(t, src=0)
        return int(t.item()) or None

    def max_over_ranks(self, vals: list[float]) -> list[float]:
        if self.p == 1:
            return vals
        t = torch.tensor(vals, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def predicted_alloc(self, s_total: int) -> int:
        """longctx.memory's prediction of max_memory_allocated for this setup (autocast with fp32
        weights, DDP over the P ranks; fp32 in the dry run)."""
        from longctx.memory import estimate

        return estimate(
            self.cfg,
            s_total,
            plan=self.plan,
            cp=self.p,
            data_parallel="ddp" if self.p > 1 else "none",
            precision="32-true" if self.dry else "bf16-mixed",
        ).allocated_bytes

    def affordable(self, est_s: float) -> bool:
        return time.time() + 1.3 * est_s + 10 < self.deadline

    def batch(self, s_total: int):
        from longctx import position_ids, shard_sequence

        # Built on the CPU, only this rank's shard goes to the device: the benchmark itself
        # must not hold a full-sequence tensor on any GPU.
        g = torch.Generator().manual_seed(s_total)
        tokens = torch.randint(0, self.cfg.vocab_size, (1, s_total + 1), generator=g)
        ids = shard_sequence(tokens[:, :-1], 1, rank=self.rank, world_size=self.p)
        lab = shard_sequence(tokens[:, 1:], 1, rank=self.rank, world_size=self.p)
        pos = position_ids(s_total, rank=self.rank, world_size=self.p)[None]
        return [t.contiguous().to(self.device) for t in (ids, lab, pos)], s_total

    def step(self, batch) -> torch.Tensor:
        (ids, lab, pos), s_total = batch
        # DDP averages over P: the global token mean
        loss_sum, _ = train_step(
            lambda: self.net(ids, lab, pos),
            self.opt,
            lambda loss, n: loss * (self.p / s_total),
            autocast=None if self.dry else "cuda",
            watch=self.meter.watch(),
        )
        return loss_sum.detach()

    # -- measurements ------------------------------------------------------------------------

    def run(self, s_total: int, phase: str, warm: bool = False, history: bool = False) -> Optional[dict]:
        """One measured training step at ``s_total``; None if it ran out of memory (P=1)."""
        oom = None
        try:
            batch = self.batch(s_total)
            if warm:
                self.step(batch)
            base = 0 if self.dry else torch.cuda.memory_allocated(self.device)
            history = history and self.rank == 0 and not self.dry
            if history:
                torch.cuda.memory._record_memory_history(
                    "all", context="alloc", stacks="python", max_entries=1_000_000, clear_history=True
                )

            def start():
                self.meter.reset()
                if self.p > 1:
                    self.dist.barrier()

            dt, loss = mean_step_seconds(functools.partial(self.step, batch), 1, self.meter.sync, start)
            peak_a, peak_r = self.meter.peak()
            snap = None
            if history:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(None)
            bad = 0.0 if bool(torch.isfinite(loss)) else 1.0
            peak_a, peak_r, dt, bad = self.max_over_ranks([peak_a, peak_r, dt, bad])
            del batch, loss
        except (torch.OutOfMemoryError, RuntimeError) as e:
            # Allocations outside PyTorch's allocator (cuDNN, NCCL) fail as RuntimeError.
            if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
                raise
            oom = str(e).strip().splitlines()[0][:300]
            self.write(
                dict(kind="oom", phase=phase, s_total=s_total, s_local=s_total // self.p, msg=oom), any_rank=True
            )
            if self.p > 1:
                # The other ranks are (or soon will be) blocked in the ring: no collective can
                # recover. Leave now; torchrun ends the rest of the job.
                sys.stdout.flush()
                os._exit(OOM_EXIT)
        if oom is not None:  # outside the except block: the traceback no longer pins tensors
            self.opt.zero_grad(set_to_none=True)
            gc.collect()
            if not self.dry:
                torch.cuda.empty_cache()
            return None
        s_local = s_total // self.p
        rec = dict(
            kind="measure",
            phase=phase,
            s_total=s_total,
            s_local=s_local,
            peak_alloc=int(peak_a),
            peak_reserved=int(peak_r),
            step_s=dt,
            loss_finite=bad == 0.0,
            predicted_alloc=self.predicted_alloc(s_total),
        )
        if self.rank == 0:
            print(
                f"S={s_total}: peak allocated {peak_a / GiB:.2f} GiB measured, "
                f"{rec['predicted_alloc'] / GiB:.2f} GiB predicted (longctx.memory)",
                flush=True,
            )
        if not history:
            self.write(rec)
        if snap is not None:
            try:  # a diagnostic: never let it end the job
                trace = snap["device_traces"][self.device.index]
                bd = attribute_peak(trace, base, s_local, self.cfg.n_layer, library_roots(), (Path(__file__).name,))
                self.write(
                    dict(
                        bd,
                        kind="breakdown",
                        s_total=s_total,
                        peak_alloc_measured=int(peak_a),
                        trace_truncated=len(trace) >= 1_000_000,
                    )
                )
            except Exception as e:  # noqa: BLE001
                self.write(dict(kind="breakdown_error", msg=f"{type(e).__name__}: {e}"[:300]))
        return rec


def run_job(args) -> None:
    job = Job(args)
    p, cap = job.p, args.verify_max_s
    lengths = [int(x) * p for x in (args.fit_lengths_on if job.ckpt else args.fit_lengths_off).split(",")]
    batch = job.batch(lengths[0])
    job.step(batch)  # warm-up: optimizer state, kernels, communicators
    del batch
    job.meter.sync()
    total = job.meter.total()
    budget = args.mem_frac * total
    device = "cpu (dry run proxy)" if job.dry else torch.cuda.get_device_name(job.device)
    c2_min = attention_time_floor(job.cfg, job.ckpt, device)
    job.write(
        dict(
            kind="meta",
            preset=args.preset,
            n_layer=job.cfg.n_layer,
            params=job.gpt.num_params(),
            total_bytes=total,
            budget_bytes=budget,
            non_torch_bytes=job.meter.overhead(),
            device=device,
            time_c2_floor=c2_min,
            torch=torch.__version__,
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        )
    )
    if args.verify_lengths:  # a retry from the driver: verification only, largest first
        for s in [int(x) for x in args.verify_lengths.split(",")]:
            if job.run(s, "verify") is not None:
                break
        return
    points = [r for r in (job.run(s, "fit", warm=True) for s in lengths) if r is not None]
    if args.breakdown and not job.dry and points:
        job.run(points[-1]["s_total"], "breakdown", history=True)
    if len(points) < 2:
        job.write(dict(kind="error", msg=f"only {len(points)} fit lengths ran; cannot fit"))
        return

    def refit(phase):
        a, b, res = fit_linear([r["s_local"] for r in points], [r["peak_alloc"] for r in points])
        coef = fit_time([(r["s_local"], r["s_total"], r["step_s"]) for r in points], c2_min)
        s_pred = predict_max(a, b, p, budget, job.grid)
        t_pred = predict_time(coef, s_pred, p) if s_pred else None
        job.write(
            dict(
                kind="fit",
                phase=phase,
                a=a,
                b=b,
                residual=res,
                time_coef=coef,
                predicted_max=s_pred,
                predicted_step_s=t_pred,
            )
        )
        return coef, s_pred, t_pred

    coef, s_pred, t_pred = refit("fit")
    if s_pred is None:
        return
    if t_pred <= cap:
        direction = 0  # 0: verifying the prediction, +1: probing above, -1: stepping down
        if s_pred <= lengths[-1]:  # a fit length already verified it: probe the next one
            direction, s_pred = 1, next_grid(job.grid, lengths[-1])
            t_pred = predict_time(coef, s_pred, p) if s_pred else math.inf
        ok = s_pred is not None and t_pred <= cap and job.affordable(t_pred)
        s = job.agree(s_pred if ok else None)
        while s:
            rec = job.run(s, "probe" if direction > 0 else "verify")
            if rec is not None:
                points.append(rec)
                if direction < 0:
                    break
                direction, nxt = 1, next_grid(job.grid, s)
            else:  # P=1 only: P>1 jobs end inside run()
                if direction > 0:
                    break
                direction, nxt = -1, prev_grid(job.grid, s)
                if nxt is not None and nxt <= lengths[-1]:
                    nxt = None
            ok = nxt is not None and predict_time(coef, nxt, p) <= cap and job.affordable(predict_time(coef, nxt, p))
            s = job.agree(nxt if ok else None)
    else:
        s_ext = extension_length(job.grid, s_pred, p, coef, cap, max(r["s_total"] for r in points))
        if s_ext is not None and not job.affordable(predict_time(coef, s_ext, p)):
            s_ext = None
        s_ext = job.agree(s_ext)
        if s_ext:
            rec = job.run(s_ext, "extend")
            if rec is not None:
                points.append(rec)
                refit("refit")


def job_main(args) -> None:
    try:
        run_job(args)
    except BaseException as e:  # noqa: BLE001 - record, then leave without NCCL teardown hangs
        import traceback

        traceback.print_exc()
        rank = int(os.environ.get("RANK", 0))
        with open(args.records, "a") as f:
            f.write(
                json.dumps(
                    dict(
                        kind="error",
                        job=args.job,
                        p=args.p,
                        ckpt=bool(args.ckpt),
                        rank=rank,
                        msg=f"{type(e).__name__}: {e}"[:500],
                        time=time.time(),
                    )
                )
                + "\n"
            )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
