"""Where a document-masked attention layer's time goes at CP size P: host, GPU, or waiting.

    torchrun --nproc-per-node 4 benchmarks/document_layer_profile.py --out DIR   # FA4 installed
    python benchmarks/document_layer_profile.py --out DIR                         # P = 1

For each mix and (arrangement, exchange) of ``benchmarks/document_attention.py`` at
131,072 tokens (H = 16, D = 128, bf16, plan prebuilt), every rank runs the layer's
forward+backward back to back and records:

* ``wall_ms``: CUDA events over the steady loop (the benchmark's figure);
* ``host_ms``: the host's time to issue one iteration (perf_counter over the loop before
  the final synchronize; the GPU queue never fills at these sizes, so where ``host_ms`` is
  close to ``wall_ms`` the layer is host-bound);
* from ``torch.profiler`` over a few iterations: the GPU's busy time per iteration on the
  compute stream(s) and on NCCL's (kernel intervals merged), kernel launches per iteration,
  and the largest CPU-side ops.

Every rank's numbers are gathered; rank 0 writes DIR/document_layer_profile_ws{P}.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from longctx import balance_documents, ring_attention  # noqa: E402
from longctx.data.document_mixes import document_ids, document_lengths  # noqa: E402
from longctx.documents import plan_documents  # noqa: E402


def merged_us(intervals) -> float:
    """Total length of the union of (start, end) intervals, us."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def host_profile(step, iters: int, sort: str, lines: int) -> str:
    """cProfile of ``iters`` calls of ``step`` (the GPU idle before and after), its ``lines``
    costliest functions by ``sort`` as text."""
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(lines)
    return text.getvalue()


def gpu_profile(step, iters: int):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    compute, nccl, launches, kernels = [], [], 0, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            span = (e.time_range.start, e.time_range.end)
            (nccl if "nccl" in e.name.lower() else compute).append(span)
            total, count = kernels.get(e.name[:90], (0.0, 0))
            kernels[e.name[:90]] = (total + e.time_range.elapsed_us(), count + 1)
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += 1
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return dict(
        gpu_compute_busy_ms=merged_us(compute) / iters / 1e3,
        gpu_nccl_busy_ms=merged_us(nccl) / iters / 1e3,
        launches_per_iter=launches / iters,
        # per kernel name: GPU us and launches per iteration, the costliest first
        kernels=[
            dict(name=name, us=round(total / iters, 1), count=count / iters)
            for name, (total, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:24]
        ],
        sites=op_sites(prof.events(), iters),
    ), table


def op_sites(events, iters: int, top: int = 16) -> list:
    """GPU time per iteration of the outermost aten ops, by the line of our code that called
    them (the innermost longctx/ or kernels/ frame above the op), the costliest first:
    which pass around the kernel calls costs what."""
    sites: dict = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        chain, parent = [], e.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        if any(name.startswith("aten::") for name in chain):
            continue  # counted in its outermost aten op
        gpu_us = getattr(e, "device_time_total", None)
        gpu_us = e.cuda_time_total if gpu_us is None else gpu_us
        if not gpu_us:
            continue
        # with_stack: Python frames are events named "path(line): function"
        ours = [n for n in chain if ".py(" in n and ("longctx/" in n or "kernels/" in n)]
        site = ours[0].split("/")[-1] if ours else "(outside longctx)"
        total, count = sites.get((e.name, site), (0.0, 0))
        sites[(e.name, site)] = (total + gpu_us, count + 1)
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return [dict(op=op, site=site, us=round(t / iters, 1), count=c / iters) for (op, site), (t, c) in ranked]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--mixes", nargs="+", default=["mean1k", "docs256", "mean4k", "mean16k", "longtail"])
    parser.add_argument("--options", nargs="+", default=["balanced:gather", "balanced:ring", "packed:gather"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", default="mean1k", help="the mix whose first option runs under cProfile")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank = dist.get_rank() if world > 1 else 0
    group = dist.group.WORLD if world > 1 else None
    S, H, D = args.seq, 16, 128
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v, dout = (
        torch.randn(1, S // world, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(i < 3)
        for i in range(4)
    )
    report = dict(world_size=world, gpu=torch.cuda.get_device_name(), torch=torch.__version__, S=S, H=H, D=D, rows=[])
    tables = []
    options = args.options if world > 1 else ["packed:ring"]
    for mix in args.mixes:
        ids = document_ids(document_lengths(mix, S, seed=args.seed), device="cuda")[None]
        for option in options:
            arrangement, exchange = option.split(":")
            batch = {"document_ids": ids}
            if arrangement == "balanced":
                batch = balance_documents(batch, world_size=world)
            plan = plan_documents(batch["document_ids"], world_size=world, rank=rank, exchange=exchange)

            def step():
                q.grad = k.grad = v.grad = None
                out = ring_attention(q, k, v, group=group, causal=True, layout="zigzag", document_ids=plan)
                out.backward(dout)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            if group is not None:
                dist.barrier()
            start = time.perf_counter()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(args.reps):
                step()
            end.record()
            host_ms = (time.perf_counter() - start) * 1e3 / args.reps
            torch.cuda.synchronize()
            wall_ms = begin.elapsed_time(end) / args.reps
            if group is not None:
                dist.barrier()
            gpu, table = gpu_profile(step, 5)
            if mix == args.cprofile and option == options[0]:  # every rank runs it (collectives)
                text = host_profile(step, 20, "tottime", 45)
                tables.append(f"==== cProfile {mix} {option} rank 0, 20 iterations\n{text}\n")
            mine = dict(
                rank=rank,
                host_ms=host_ms,
                wall_ms=wall_ms,
                calls=plan.calls,
                pairs=float(plan.pairs[rank]),
                received_rows=int(plan.received[rank]),
                **gpu,
            )
            everyone = [None] * world
            if group is not None:
                dist.all_gather_object(everyone, mine)
            else:
                everyone = [mine]
            row = dict(mix=mix, option=option, imbalance=plan.imbalance, moved=plan.moved, ranks=everyone)
            row["wall_ms_max"] = max(r["wall_ms"] for r in everyone)
            row["host_ms_max"] = max(r["host_ms"] for r in everyone)
            row["gpu_compute_busy_ms_max"] = max(r["gpu_compute_busy_ms"] for r in everyone)
            report["rows"].append(row)
            tables.append(f"==== {mix} {option} rank {rank}\n{table}\n")
            if rank == 0:
                brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "ranks"}
                print(json.dumps(brief), flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"document_layer_profile_ws{world}.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, f"document_layer_profile_ws{world}.txt"), "w") as f:
            f.write("".join(tables))
    if group is not None:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
