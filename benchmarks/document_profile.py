"""Where the time of a short-document step goes: host launch time vs GPU time, per kernel.

    torchrun --nproc-per-node=2 benchmarks/document_profile.py --mixes docs256,mean1k --out $OUT

For each mix at --seq tokens (bf16, H=16, D=128, zigzag, balanced), forward+backward of
``ring_attention`` by plan, first on ONE GPU (rank 0 alone, world-1 plan) and then on all
GPUs, measured three ways:
  wall_ms   CUDA events around one step started from an idle GPU (what document_attention.py
            part B reports: host launch time shows here when the host is the bottleneck);
  gpu_ms    the same step queued behind a GPU sleep long enough that the host has launched
            everything before the GPU reaches it: the GPU's own time;
  host_ms   the host's time to launch the step (perf_counter around it, GPU still asleep;
            a host sync inside the step would show as the whole sleep).
then torch.profiler over 5 steps: the kernels by GPU time (count, total us) and the host ops
by self CPU time, one text table per case, and a chrome trace of the 2-GPU case of the
first mix on rank 0. Everything lands under --out/document_profile/ and one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from ring import time_in_group  # noqa: E402

from longctx import balance_documents, ring_attention  # noqa: E402
from longctx.data.document_mixes import document_lengths  # noqa: E402
from longctx.documents import plan_documents  # noqa: E402

_CYCLES_PER_MS = []


def _sleep_cycles(ms: float) -> int:
    """GPU cycles of ``torch.cuda._sleep`` that last about ``ms`` (calibrated once)."""
    if not _CYCLES_PER_MS:
        torch.cuda._sleep(1_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS.append(10_000_000 / a.elapsed_time(b))
    return int(ms * _CYCLES_PER_MS[0])


def measure(step, group, reps=7, sleep_ms=60.0):
    """(wall_ms, gpu_ms, host_ms) medians of ``step``."""
    wall = time_in_group(step, group, warmup=2, iters=reps)  # each step from an idle GPU
    gpus, hosts = [], []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group=group)
        torch.cuda._sleep(_sleep_cycles(sleep_ms))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        start = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - start) * 1e3)
        b.record()
        torch.cuda.synchronize()
        gpus.append(a.elapsed_time(b))
    return wall, statistics.median(gpus), statistics.median(hosts)


def profile(step, path_prefix, trace: bool):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    with open(path_prefix + ".txt", "w") as f:
        f.write("# per 5 steps, by GPU time\n")
        f.write(averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=90))
        f.write("\n# per 5 steps, by host self time\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90))
    if trace:
        prof.export_chrome_trace(path_prefix + ".trace.json")
    kernels = [e for e in averages if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return [dict(name=e.key[:120], count=e.count // 5, us_per_step=e.self_device_time_total / 5) for e in kernels[:15]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--mixes", default="docs256,mean1k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world, rank = dist.get_world_size(), dist.get_rank()
    S, H, D = args.seq, 16, 128
    folder = os.path.join(args.out, "document_profile")
    os.makedirs(folder, exist_ok=True)
    report = dict(
        world_size=world,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        S=S,
        H=H,
        D=D,
        date=time.strftime("%Y-%m-%d"),
        cases=[],
    )
    g = torch.Generator(device="cuda").manual_seed(rank)

    def tensors(n):
        return [
            torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(i < 3)
            for i in range(4)
        ]

    def stepper(q, k, v, dout, plan, group):
        def step():
            q.grad = k.grad = v.grad = None
            out = ring_attention(q, k, v, group=group, causal=True, layout="zigzag", backend="auto", document_ids=plan)
            out.backward(dout)

        return step

    for i, mix in enumerate(args.mixes.split(",")):
        lengths = document_lengths(mix, S, seed=args.seed)
        ids = torch.repeat_interleave(
            torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda")
        ).view(1, -1)
        if rank == 0:
            q, k, v, dout = tensors(S)
            plan1 = plan_documents(ids, world_size=1, rank=0)
            step = stepper(q, k, v, dout, plan1, None)
            wall, gpu, host = measure(step, None)
            kernels = profile(step, os.path.join(folder, f"{mix}_p1"), trace=i == 0)
            report["cases"].append(
                dict(mix=mix, gpus=1, calls=plan1.calls, wall_ms=wall, gpu_ms=gpu, host_ms=host, kernels=kernels)
            )
            print(f"[{mix} 1 GPU] wall {wall:.3f} gpu {gpu:.3f} host {host:.3f} ms", flush=True)
            q = k = v = dout = step = None
            torch.cuda.empty_cache()
        dist.barrier()
        batch = balance_documents({"document_ids": ids}, world_size=world)
        plan = plan_documents(batch["document_ids"], world_size=world, rank=rank)
        q, k, v, dout = tensors(S // world)
        step = stepper(q, k, v, dout, plan, dist.group.WORLD)
        wall, gpu, host = measure(step, dist.group.WORLD)
        kernels = profile(step, os.path.join(folder, f"{mix}_p{world}_rank{rank}"), trace=i == 0 and rank == 0)
        case = dict(
            mix=mix,
            gpus=world,
            rank=rank,
            calls=plan.calls,
            moved=plan.moved,
            imbalance=plan.imbalance,
            wall_ms=wall,
            gpu_ms=gpu,
            host_ms=host,
            kernels=kernels,
        )
        cases = [None] * world
        dist.all_gather_object(cases, case)
        if rank == 0:
            report["cases"].extend(cases)
            for c in cases:
                print(
                    f"[{mix} {world} GPUs rank {c['rank']}] calls {c['calls']} moved {c['moved']} wall "
                    f"{c['wall_ms']:.3f} gpu {c['gpu_ms']:.3f} host {c['host_ms']:.3f} ms",
                    flush=True,
                )
            with open(os.path.join(args.out, f"document_profile_ws{world}.json"), "w") as f:
                json.dump(report, f, indent=1)
        q = k = v = dout = step = None
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
