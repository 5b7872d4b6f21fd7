"""Training throughput with context parallelism: tokens/s, MFU and peak memory per GPU.

Run: torchrun --nproc-per-node=N benchmarks/train_throughput.py [--preset gpt-350m]
     [--seqs 32768,131072] [--sizes 1,2,4] [--steps 3] [--profile]

One optimizer step = forward + backward of one sequence of S tokens split over a CP group
of P GPUs (P = 1, 2, 4, ... as subgroups of this launch), DDP gradient all-reduce over
the group, AdamW. bf16 autocast with fp32 master weights (what Lightning's bf16-mixed
does). Activation checkpointing per block when S/P >= 64K (recorded per row), or as
--checkpointing says (on, off, selective, auto-selective). MFU = model FLOPs per token
(GPTConfig.flops_per_token, causal attention, recompute not counted) x tokens/s /
(P x peak bf16 dense FLOP/s).
--profile adds, per row, one profiled step's GPU kernel time by kind (attention, NCCL,
matmul, other) on rank 0: where a step's time goes.
Results: $OUT/train_throughput_ws{N}{tag}.json (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from longctx import position_ids, shard_sequence
from longctx.bench.step import LossModule, mean_step_seconds, train_step
from longctx.hardware import peak_bf16_flops
from longctx.models import GPT, GPTConfig
from longctx.ring_comm import new_ring_group


def peak_flops() -> float:
    return peak_bf16_flops(torch.cuda.get_device_name()) or float("nan")


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def measure(preset, s_total, p, group, ddp_group, steps, checkpointing, backend, profile=False, overrides=None):
    rank = dist.get_rank()
    # --set overrides win over --checkpointing/--backend (variants may set them too); keys
    # of longctx.ParallelPlan go to the plan, the rest to the model's sizes.
    from longctx import CPContext, ParallelDims, ParallelPlan, parallelize
    from longctx.models.config import RUNTIME_KEYS

    overrides = dict(overrides or {})
    plan = {
        "activation_checkpointing": checkpointing,
        "attention_backend": backend,
        **{k: overrides.pop(k) for k in list(overrides) if k in RUNTIME_KEYS},
    }
    cfg = GPTConfig.from_preset(preset, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    parallelize(model, ParallelDims(cp=CPContext(group)), ParallelPlan.from_dict(plan))
    step_loss = LossModule(model)
    if p > 1:  # DDP's hooks run through forward(), so wrap the loss path as a module
        step_loss = DDP(step_loss, process_group=ddp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, s_total + 1), device="cuda", generator=g)
    r = rank if p > 1 else 0
    inp = shard_sequence(tokens[:, :-1], 1, rank=r, world_size=p)
    lab = shard_sequence(tokens[:, 1:], 1, rank=r, world_size=p)
    pos = position_ids(s_total, rank=r, world_size=p, device="cuda")[None]
    del tokens

    def step():
        # DDP averages over p: the global token mean
        loss_sum, _ = train_step(
            lambda: step_loss(inp, lab, pos), opt, lambda loss, n: loss / s_total * p, autocast="cuda"
        )
        return loss_sum

    def start():
        torch.cuda.reset_peak_memory_stats()
        if group is not None:
            dist.barrier(group=group)

    step()  # warm-up: allocator, kernels, NCCL communicators
    dt, loss = mean_step_seconds(step, steps, torch.cuda.synchronize, start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    finite = bool(torch.isfinite(loss).item())
    kernel_time = profile_step(step) if profile else None
    model = step_loss = opt = None  # free the tensors (closures above name them)
    torch.cuda.empty_cache()
    tps = s_total / dt
    return dict(
        preset=preset,
        overrides=overrides or {},
        head_dim=cfg.head_dim,
        P=p,
        S_total=s_total,
        S_per_gpu=s_total // p,
        checkpointing=plan["activation_checkpointing"],
        step_s=dt,
        tokens_per_s=tps,
        tokens_per_s_per_gpu=tps / p,
        mfu=cfg.flops_per_token(s_total) * tps / (p * peak_flops()),
        peak_mem_GiB=peak,
        params=cfg.num_params(),
        loss_finite=finite,
        **({"kernel_ms_by_kind": kernel_time} if kernel_time else {}),
    )


_KINDS = (  # substring of a CUDA kernel name -> kind; first match wins
    ("nccl", "nccl"),
    ("fmha", "attention"),
    ("cudnn", "attention"),
    ("flash", "attention"),
    ("_attn_", "attention"),
    ("merge_partials", "attention"),
    ("gemm", "matmul"),
    ("nvjet", "matmul"),
    ("cutlass", "matmul"),
    ("xmma", "matmul"),
)


def profile_step(step) -> dict:
    """GPU kernel time of one step by kind (summed kernel durations, ms), plus the top 12."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kind, by_name = {}, {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        us = e.time_range.end - e.time_range.start
        low = e.name.lower()
        kind = next((k for sub, k in _KINDS if sub in low), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3
        by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + us / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return dict(by_kind={k: round(v, 2) for k, v in by_kind.items()}, top=[(n, round(v, 2)) for n, v in top])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-350m")
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--checkpointing",
        default="auto",
        choices=["auto", "auto-selective", "on", "off", "selective"],
        help="auto: whole blocks when S/P >= 64K, else none; auto-selective: 'selective' "
        "(never recompute the ring) when S/P >= 64K",
    )
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--sizes", default="1,2,4,8", help="CP sizes to measure (<= world size)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="GPTConfig overrides (JSON values) of one variant, ',' between keys, e.g. "
        "'fuse_pointwise=true,n_head=8'; repeat --set to measure several variants",
    )
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [p for p in (int(x) for x in args.sizes.split(",")) if p <= world]
    groups = {p: (new_ring_group(range(p)) if p > 1 else None) for p in sizes}
    # Gradients reduce on a communicator of their own, as in ContextParallelStrategy (DDP on
    # the world group, the ring on its CP group): on the ring's own communicator DDP's
    # all-reduce would queue on the stream that carries the ring's K/V hops.
    ddp_groups = {p: (dist.new_group(list(range(p))) if p > 1 else None) for p in sizes}
    res = dict(
        world_size=world,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        peak_bf16_flops=peak_flops(),
        rows=[],
    )
    variants = [{}]
    if args.set:
        variants = []
        for chunk in ";".join(args.set).split(";"):
            pairs = [kv for kv in chunk.split(",") if kv.strip()]
            variants.append({k.strip(): json.loads(v) for k, v in (kv.split("=", 1) for kv in pairs)})
    for s_total, p, overrides in [(int(s), p, o) for s in args.seqs.split(",") for p in sizes for o in variants]:
        big = s_total // p >= 65536
        ckpt = {
            "on": True,
            "off": False,
            "selective": "selective",
            "auto": big,
            "auto-selective": "selective" if big else False,
        }[args.checkpointing]
        out = torch.zeros(1, device="cuda")
        row = None
        if rank < p:
            try:
                row = measure(
                    args.preset,
                    s_total,
                    p,
                    groups[p],
                    ddp_groups[p],
                    args.steps,
                    ckpt,
                    args.backend,
                    profile=args.profile,
                    overrides=overrides,
                )
            except Exception:
                out[0] = 1
                if rank == 0:
                    traceback.print_exc()
        dist.all_reduce(out)
        if rank == 0:
            row = row or dict(preset=args.preset, overrides=overrides, P=p, S_total=s_total, error=True)
            res["rows"].append(row)
            print("train", json.dumps(row), flush=True)
            os.makedirs(args.out, exist_ok=True)
            json.dump(res, open(os.path.join(args.out, f"train_throughput_ws{world}{args.tag}.json"), "w"), indent=1)
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
