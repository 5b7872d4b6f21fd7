"""Check longctx.memory's predictions against one real training step on one GPU.

Run (one GPU, ~5-6 minutes on an H200):
    OUT=out python benchmarks/memory_validate.py
    python benchmarks/memory_validate.py --smoke          # CPU, tiny sizes, seconds
    python benchmarks/memory_validate.py --cases 1b-128k-full,1b-128k-ab
    OUT=out torchrun --nproc-per-node 2 benchmarks/memory_validate.py   # CP over 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/memory_validate.py --smoke   # CP=2 over gloo

Every case builds the GPT (``longctx.models.GPT`` + ``longctx.parallelize``) the way
``CausalLMModule`` under ``train.py`` runs it on one GPU: FSDP2 over a one-rank mesh with
bf16 parameters (fp32 masters, ``reduce_dtype`` fp32), bf16 autocast, AdamW (foreach),
the chunked loss. AdamW's state is created first (a zero-gradient step at lr 0), so the
ONE measured step (forward, backward, optimizer step) is a steady-state step:
``torch.cuda.max_memory_allocated`` against ``estimate(...).allocated_bytes`` (what the
allocator sees) and the host RSS high-water mark during the step (sampled every 20 ms)
against ``estimate(...).host_bytes``.

Cases, cheapest first; an out-of-memory error is recorded and the next case runs. The
128K cases are plain causal (backend "auto", as train.py's Llama-3.2-1B config). The longer ones
use packed documents of 16K tokens (document-masked kernels, FlashAttention-4 varlen where
installed: attention work linear in the length, so each step takes seconds). ``1b-128k-ab`` times 3 steps
after a warm-up (the measured step), untiled vs tiled MLP +
offload of every block (the issue's limit: <= 10% slower), and that plus 8 attention head
chunks.

Under ``torchrun`` with N processes the cases are the CP ones (``cp_cases``): one sequence
of N x the per-rank tokens, zigzag-sharded over a ring of N GPUs (CP = N, FSDP2 over the
same N ranks), against ``estimate(..., cp=N)``: the ring's send/receive buffers and
gradient messages, which one GPU cannot show. Every rank measures its own peak; the row
keeps all of them and the largest.

Rows (JSON list, rewritten after every case): $OUT/memory_validate.json (OUT default ./out;
memory_validate_cp{N}.json under CP).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from longctx import CPContext, ParallelDims, ParallelPlan, parallelize, shard_sequence
from longctx.bench.memory_recheck import recheck
from longctx.bench.step import mean_step_seconds, train_step
from longctx.memory import GiB, auto_attention_kernel, estimate
from longctx.models import GPT, GPTConfig

K = 1024
DOC = 16 * K

ONE_B = dict(preset="llama3.2-1b")
EIGHT_B = dict(preset="llama3-8b")


def cp_cases(smoke: bool, cp: int) -> list[dict]:
    """Per-rank sizes as in ``cases``; the sequence is ``cp`` times as long."""
    tiled = dict(activation_checkpointing="full", mlp_tile_size=8192)
    if smoke:
        return [
            dict(
                case=f"smoke-cp{cp}-tiled-chunks2-docs",
                model=dict(preset="tiny"),
                seq_len=cp * 512,
                docs=True,
                plan=dict(tiled, mlp_tile_size=128, attention_head_chunks=2, offload_activations=1),
            )
        ]
    return [
        dict(
            case=f"cp{cp}-8b-width-1layer-512k-per-rank-tiled-chunks8-docs",
            model=dict(EIGHT_B, n_layer=1),
            seq_len=cp * 512 * K,
            plan=dict(tiled, attention_head_chunks=8),
            docs=True,
        ),
        dict(
            case=f"cp{cp}-8b-width-4layers-512k-per-rank-tiled-offload-chunks8-docs",
            model=dict(EIGHT_B, n_layer=4),
            seq_len=cp * 512 * K,
            plan=dict(tiled, attention_head_chunks=8, offload_activations=True),
            docs=True,
        ),
        # All heads at once: the ring's buffers at full size (the largest predicted transient).
        dict(
            case=f"cp{cp}-8b-width-1layer-512k-per-rank-tiled-docs",
            model=dict(EIGHT_B, n_layer=1),
            seq_len=cp * 512 * K,
            plan=tiled,
            docs=True,
        ),
    ]


def cases(smoke: bool) -> list[dict]:
    full = dict(activation_checkpointing="full")
    tiled_off = dict(activation_checkpointing="full", mlp_tile_size=8192, offload_activations=True)
    if smoke:
        tiny = dict(preset="tiny")
        return [
            dict(case="smoke-full", model=tiny, seq_len=512, plan=full),
            dict(case="smoke-none", model=tiny, seq_len=512, plan=dict(activation_checkpointing="none")),
            dict(
                case="smoke-tiled-offload-docs",
                model=tiny,
                seq_len=1024,
                docs=True,
                plan=dict(
                    activation_checkpointing="full", mlp_tile_size=128, offload_activations=1, attention_head_chunks=2
                ),
            ),
            dict(
                case="smoke-ab",
                model=tiny,
                seq_len=512,
                plan=full,
                ab={"-tiled-offload": dict(mlp_tile_size=64, offload_activations=True)},
            ),
        ]
    return [
        dict(case="1b-128k-none", model=ONE_B, seq_len=128 * K, plan=dict(activation_checkpointing="none")),
        dict(case="1b-128k-selective", model=ONE_B, seq_len=128 * K, plan=dict(activation_checkpointing="selective")),
        dict(
            case="1b-128k-ab",
            model=ONE_B,
            seq_len=128 * K,
            plan=full,
            ab={
                "-tiled-offload": dict(mlp_tile_size=8192, offload_activations=True),
                "-tiled-offload-chunks8": dict(mlp_tile_size=8192, offload_activations=True, attention_head_chunks=8),
            },
        ),
        dict(case="1b-512k-full-docs", model=ONE_B, seq_len=512 * K, plan=full, docs=True),
        dict(
            case="1b-8layers-1m-tiled-offload-docs",
            model=dict(ONE_B, n_layer=8),
            seq_len=1024 * K,
            plan=tiled_off,
            docs=True,
        ),
        dict(
            case="8b-width-4layers-512k-tiled-offload-chunks8-docs",
            model=dict(EIGHT_B, n_layer=4),
            seq_len=512 * K,
            plan=dict(tiled_off, attention_head_chunks=8),
            docs=True,
        ),
        # One 8B-width layer at 512K: the recompute-and-backward transient nearly alone (the
        # term that decides whether the 8B fits at 512K per rank; NOTES), all heads at once
        # and in 8 head chunks.
        dict(
            case="8b-width-1layer-512k-tiled-docs",
            model=dict(EIGHT_B, n_layer=1),
            seq_len=512 * K,
            plan=dict(activation_checkpointing="full", mlp_tile_size=8192),
            docs=True,
        ),
        dict(
            case="8b-width-1layer-512k-tiled-chunks8-docs",
            model=dict(EIGHT_B, n_layer=1),
            seq_len=512 * K,
            plan=dict(activation_checkpointing="full", mlp_tile_size=8192, attention_head_chunks=8),
            docs=True,
        ),
    ]


class RssPeak:
    """Resident-set high-water mark of this process over a window (sampled)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self):
        self.peak = self.now()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


class Setup:
    def __init__(self, case: dict, device: torch.device, mesh):
        self.device, self.case = device, case
        self.cuda = device.type == "cuda"
        self.cfg = GPTConfig.from_dict(case["model"])
        self.plan = ParallelPlan(attention_backend="auto" if self.cuda else "torch", **case["plan"])
        self.cp = dist.get_world_size()
        cp = CPContext(group=dist.group.WORLD) if self.cp > 1 else CPContext()
        torch.manual_seed(0)
        with device:
            self.model = GPT(self.cfg)
        dims = ParallelDims(
            cp=cp, data_parallel="fsdp", fsdp_mesh=mesh, param_dtype=torch.bfloat16 if self.cuda else None
        )
        parallelize(self.model, dims, self.plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.1, foreach=self.cuda)
        # AdamW's moments exist from here on (a zero-gradient step at lr 0 changes nothing):
        # the measured step is a steady-state one.
        for group in self.opt.param_groups:
            group["lr"] = 0.0
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for group in self.opt.param_groups:
            group["lr"] = 1e-5
        S = case["seq_len"]
        g = torch.Generator().manual_seed(S)  # the same sequence on every rank, then sharded
        tokens = torch.randint(0, self.cfg.vocab_size, (1, S + 1), generator=g)
        ids, labels, pos, docs = tokens[:, :-1], tokens[:, 1:], torch.arange(S)[None], None
        if case.get("docs"):
            doc = 128 if not self.cuda else DOC
            docs, pos = torch.arange(S)[None] // doc, torch.arange(S)[None] % doc

        def local(t):
            if t is None:
                return None
            return shard_sequence(t, 1, rank=dist.get_rank(), world_size=self.cp).contiguous().to(device)

        self.ids, self.labels, self.pos, self.docs = local(ids), local(labels), local(pos), local(docs)

    def step(self, marks: Optional[list] = None) -> float:
        """One training step. ``marks`` (CUDA): a list that receives ``(period, peak bytes,
        bytes allocated at its end)`` for the forward, the loss backward, each block's
        backward in three parts (MLP and output projection; attention; q/k/v projections
        and norm) and the optimizer step (the peak counter is reset at every mark)."""

        def mark(period):
            if marks is not None:
                marks.append(
                    (period, torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device))
                )
                torch.cuda.reset_peak_memory_stats(self.device)

        handles = []
        if marks is not None:
            # The gradient reaching block i's output starts block i's backward: it ends the
            # period before (the loss backward, or block i+1's backward).
            def on_output(before):
                def hook(module, args, out):
                    if out.requires_grad:
                        out.register_hook(lambda grad: mark(before))

                return hook

            def on_query(before):
                def hook(module, args):
                    if args[0].requires_grad:
                        args[0].register_hook(lambda grad: mark(before))

                return hook

            blocks = list(self.model.blocks)
            for i, block in enumerate(blocks):
                handles.append(
                    block.register_forward_hook(
                        on_output("loss backward" if i == len(blocks) - 1 else f"block {i + 1} backward")
                    )
                )
                # Inside block i's backward: the gradient reaching the attention core's output
                # ends the MLP and output-projection part; dQ ends the attention's own part
                # (the kernels and the ring). The rest (q/k/v projections, norm) is "block i backward".
                handles.append(block.attn.core.register_forward_hook(on_output(f"block {i} mlp backward")))
                handles.append(block.attn.core.register_forward_pre_hook(on_query(f"block {i} attention backward")))
        try:
            loss_sum, n = train_step(
                lambda: self.model(self.ids, self.pos, labels=self.labels, document_ids=self.docs),
                self.opt,
                lambda loss, n: loss / n,
                autocast="cuda" if self.cuda else None,
                mark=lambda part: mark("block 0 backward" if part == "backward" else part),
            )
        finally:
            for h in handles:
                h.remove()
        return float(loss_sum.detach() / n)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def predict(self, plan: ParallelPlan):
        return estimate(
            self.cfg,
            self.case["seq_len"],
            plan=plan,
            cp=self.cp,
            dp=1,
            data_parallel="fsdp",
            precision="bf16-mixed" if self.cuda else "32-true",
            attention_kernel="auto",
        )


def measured_step(setup: Setup, plan: ParallelPlan) -> dict:
    dev = setup.device
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    pred = setup.predict(plan)
    marks = [] if setup.cuda else None
    with RssPeak() as rss:
        t0 = time.perf_counter()
        loss = setup.step(marks)
        setup.sync()
        dt = time.perf_counter() - t0
    row = dict(
        predicted_gpu=pred.allocated_bytes,
        predicted_gpu_with_context=pred.gpu_bytes,
        predicted_phase=pred.phase,
        predicted_items={k: round(v / GiB, 3) for k, v in pred.items.items()},
        predicted_phases={k: round(v / GiB, 3) for k, v in pred.phases.items()},
        predicted_host=pred.host_bytes,
        measured_host_rss_peak=rss.peak,
        step_s=dt,
        loss=loss,
    )
    if setup.cuda:
        row["measured_gpu"] = max(peak for _, peak, _ in marks)
        row["measured_periods"] = [
            dict(period=p, peak_gib=round(peak / GiB, 3), end_gib=round(end / GiB, 3)) for p, peak, end in marks
        ]
        row["measured_gpu_reserved"] = torch.cuda.max_memory_reserved(dev)
    if setup.cp > 1:  # every rank's peaks; the row's figures are the largest
        ranks = [None] * setup.cp
        dist.all_gather_object(
            ranks, {k: row.get(k) for k in ("measured_gpu", "measured_periods", "measured_host_rss_peak", "loss")}
        )
        row["ranks"] = ranks
        row["measured_host_rss_peak"] = max(r["measured_host_rss_peak"] for r in ranks)
        if setup.cuda:
            row["measured_gpu"] = max(r["measured_gpu"] for r in ranks)
    if setup.cuda:
        row["ratio"] = row["measured_gpu"] / pred.allocated_bytes
    row["host_ratio"] = row["measured_host_rss_peak"] / pred.host_bytes
    return row


def timed(setup: Setup, steps: int) -> float:
    """Mean seconds per step; the measured step before it was the warm-up (same shapes)."""
    return mean_step_seconds(setup.step, steps, setup.sync)[0]


def run_case(case: dict, device, mesh, steps: int) -> list[dict]:
    base = dict(
        case=case["case"],
        seq_len=case["seq_len"],
        model=case["model"],
        plan=case["plan"],
        documents_of=(DOC if device.type == "cuda" else 128) if case.get("docs") else None,
    )
    rows = []
    setup = Setup(case, device, mesh)
    rows.append(dict(base, **measured_step(setup, setup.plan)))
    if case.get("ab"):
        a_s = timed(setup, steps)
        tokens = case["seq_len"]
        rows[0].update(step_s_mean=a_s, tokens_per_s=tokens / a_s)
        for suffix, change in case["ab"].items():
            del setup
            _free()
            variant = dict(case, plan=dict(case["plan"], **change))
            setup = Setup(variant, device, mesh)
            row_b = dict(base, case=case["case"] + suffix, plan=variant["plan"], **measured_step(setup, setup.plan))
            b_s = timed(setup, steps)
            row_b.update(step_s_mean=b_s, tokens_per_s=tokens / b_s, slowdown_vs_untiled=b_s / a_s - 1.0)
            rows.append(row_b)
    del setup
    return rows


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        try:
            torch._C._host_emptyCache()  # pinned offload buffers of the previous case
        except AttributeError:
            pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (tests the script)")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per A/B variant")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument(
        "--recheck",
        nargs="+",
        metavar="JSON",
        help="no GPU: stored results (memory_validate*.json; device_memory_full.sh's "
        "memory_full*.json) against the memory model as it is now (FlashAttention-4 runs)",
    )
    args = ap.parse_args(argv)
    # Before the first CUDA allocation (the allocator reads it then); the memory model's slack
    # term was measured with it.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.recheck:
        for path in args.recheck:
            for r in recheck(path, "fa4"):
                print(
                    f"{Path(path).name}: {r['case']}: measured {r['measured'] / GiB:.1f} GiB, predicted "
                    f"{r['predicted'] / GiB:.1f} GiB, ratio {r['ratio']:.3f} (peak at {r['phase']})"
                )
        return
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke on the CPU")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun: CP over every process
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo", rank=rank, world_size=world, **({"device_id": device} if cuda else {})
        )
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("dp_cp",))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("memory_validate.json" if world == 1 else f"memory_validate_cp{world}.json")
    wanted = {c for c in args.cases.split(",") if c}
    todo = [
        c
        for c in (cases(args.smoke) if world == 1 else cp_cases(args.smoke, world))
        if not wanted or c["case"] in wanted
    ]
    meta = dict(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        torch=torch.__version__,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        date=time.strftime("%Y-%m-%d %H:%M"),
        cp=world,
        attention_kernel=auto_attention_kernel(128, 512 * 1024) if cuda else "torch",
    )
    rows: list[dict] = []
    start = time.time()
    for case in todo:
        t0 = time.time()
        try:
            new = run_case(case, device, mesh, args.steps)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if world > 1:
                raise  # the other ranks wait in the ring: end the whole run (rows so far are written)
            if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
                traceback.print_exc()
            msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            new = [
                dict(
                    case=case["case"],
                    seq_len=case["seq_len"],
                    model=case["model"],
                    plan=case["plan"],
                    error=f"{type(e).__name__}: {msg}",
                )
            ]
            try:
                setup_pred = estimate(
                    GPTConfig.from_dict(case["model"]),
                    case["seq_len"],
                    plan=ParallelPlan(**case["plan"]),
                    data_parallel="fsdp",
                    precision="bf16-mixed" if cuda else "32-true",
                    attention_kernel="auto",
                )
                new[0].update(
                    predicted_gpu=setup_pred.allocated_bytes,
                    predicted_gpu_with_context=setup_pred.gpu_bytes,
                    predicted_host=setup_pred.host_bytes,
                )
            except Exception:  # noqa: BLE001 - a diagnostic only
                pass
        _free()
        if rank != 0:
            continue
        for r in new:
            r["case_wall_s"] = time.time() - t0
            rows.append(r)
            gpu = f"{r['measured_gpu'] / GiB:.1f}" if "measured_gpu" in r else "-"
            pred = f"{r['predicted_gpu'] / GiB:.1f}" if "predicted_gpu" in r else "-"
            print(
                f"[{time.time() - start:5.0f}s] {r['case']}: GPU measured {gpu} GiB, predicted {pred} GiB"
                + (f", ratio {r['ratio']:.3f}" if "ratio" in r else "")
                + (f", step {r['step_s']:.1f} s" if "step_s" in r else "")
                + (f", {r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else "")
                + (f", slowdown {100 * r['slowdown_vs_untiled']:.1f}%" if "slowdown_vs_untiled" in r else "")
                + (f"; {r['error']}" if "error" in r else ""),
                flush=True,
            )
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        os.replace(tmp, path)
    if rank == 0:
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
