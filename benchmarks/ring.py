"""Ring attention on several GPUs: correctness, memory, scaling, and PyTorch's CP as the peer.

Run: torchrun --nproc-per-node=N benchmarks/ring.py [--sections check,memory,speed,peer,breakdown]

Sections (results in $OUT/ring_ws{N}.json, default benchmarks/results/):
  check     bf16 ring (zigzag, causal) vs a float64 reference at S_total=32K: out, dq, dk, dv.
  memory    peak GPU memory of one fwd+bwd at S_total=128K on 1, 2, ... N GPUs (O(S/P)).
  speed     fwd+bwd time and per-GPU TFLOP/s of our backends, strong scaling (fixed S over
            1..N GPUs, as subgroups of this launch) and weak scaling (fixed S per GPU).
  peer      torch.distributed.tensor.experimental.context_parallel (SDPA cuDNN / flash,
            rotate methods allgather / alltoall) and single-GPU SDPA at the same S.
  breakdown the same ring with communication switched off (compute only), the transfers
            alone (communication only), and a profiler summary of how much of the NCCL
            kernel time ran concurrently with compute kernels.
  priority  our ring on a group with a normal- and one with a high-priority NCCL stream,
            interleaved in the same run (what new_ring_group's default rests on).
  d64       the ~350M model's attention shape (H=16, D=64): our ring vs PyTorch's CP (cuDNN)
            at the largest S, full world.
  ulysses   head-parallel all-to-all attention (longctx.ulysses_attention), same shapes and
            groups as the ring's strong scaling. (check covers it too.)
FLOPs: 4*S^2*D*H per forward (half for causal), backward 2.5x forward.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx import ring_attention, ring_comm, shard_sequence, ulysses_attention

K = 1024


def attn_flops(s_total, heads, head_dim, causal=True, backward=True):
    f = 4 * s_total * s_total * head_dim * heads * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def time_fn(fn, warmup=2, iters=5):
    """Median ms over the whole world; the step takes as long as the slowest rank."""
    t = torch.tensor([time_in_group(fn, dist.group.WORLD, warmup, iters)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def subgroups(world, high_priority=False):
    """Groups of the first p ranks for p = 1, 2, 4, ... <= world (created by every rank)."""
    sizes, p = [], 1
    while p <= world:
        sizes.append(p)
        p *= 2
    if world not in sizes:
        sizes.append(world)
    return {p: (ring_comm.new_ring_group(range(p), high_priority=high_priority) if p > 1 else None) for p in sizes}


def local_inputs(b, s_local, hq, hkv, d, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(b, s_local, h, d, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    q, k, v = mk(hq).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_()
    return q, k, v, mk(hq)


ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}


def ring_step(q, k, v, dout, group, backend, impl="ring"):
    attention = ATTENTION[impl]

    def run():
        q.grad = k.grad = v.grad = None
        out = attention(q, k, v, group=group, causal=True, backend=backend)
        out.backward(dout)

    return run


# ---------------------------------------------------------------------------------- check
def reference_fp64(q, k, v, dout, chunk=512):
    """Causal attention and its gradients in float64, chunked over queries to bound memory."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    k = k.repeat_interleave(group, 2)
    v = v.repeat_interleave(group, 2)
    scale = d**-0.5
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for i in range(0, s, chunk):
        j = min(s, i + chunk)
        sc = torch.einsum("bqhd,bkhd->bhqk", q[:, i:j], k[:, :j]) * scale
        rows = torch.arange(i, j, device=q.device)[:, None]
        sc.masked_fill_(torch.arange(j, device=q.device)[None, :] > rows, float("-inf"))
        p = sc.softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", p, v[:, :j])
        out[:, i:j] = o
        do = dout[:, i:j]
        dv[:, :j] += torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, v[:, :j])
        delta = (do * o).sum(-1).transpose(1, 2).unsqueeze(-1)
        ds = p * (dp - delta) * scale
        dq[:, i:j] = torch.einsum("bhqk,bkhd->bqhd", ds, k[:, :j])
        dk[:, :j] += torch.einsum("bhqk,bqhd->bkhd", ds, q[:, i:j])
    fold = lambda t: t.view(b, s, k.shape[2] // group, group, d).sum(3)  # noqa: E731
    return out, dq, fold(dk), fold(dv)


def section_check(res, args, groups):
    rank = dist.get_rank()
    s_total, d = 32 * K, 128
    for hq, hkv in ((16, 16), (32, 8)):
        torch.manual_seed(1234 + hq)
        full = [torch.randn(1, s_total, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq)]
        ref = reference_fp64(*full)
        for impl, backend, (p, group) in [(i, b, g) for i in ATTENTION for b in args.backends for g in groups.items()]:
            if p == 1 or hkv % p:
                continue
            if rank < p:
                shard = lambda t: shard_sequence(t, 1, rank=rank, world_size=p)  # noqa: E731
                q, k, v = (shard(t).detach().requires_grad_() for t in full[:3])
                try:
                    out = ATTENTION[impl](q, k, v, group=group, backend=backend)
                    out.backward(shard(full[3]))
                    errs = []
                    for got, want in zip((out, q.grad, k.grad, v.grad), ref):
                        want = shard(want)
                        finite = bool(torch.isfinite(got).all())
                        errs.append(((got.double() - want).norm() / want.norm()).item() if finite else float("nan"))
                    errs_t = torch.tensor(errs, device="cuda")
                except Exception as ex:  # report, keep going
                    log("check fail", impl, backend, p, repr(ex)[:300])
                    errs_t = torch.full((4,), float("nan"), device="cuda")
            else:
                errs_t = torch.zeros(4, device="cuda")
            dist.all_reduce(errs_t, op=dist.ReduceOp.MAX)
            r = dict(
                impl=impl,
                backend=backend,
                P=p,
                S_total=s_total,
                Hq=hq,
                Hkv=hkv,
                D=d,
                dtype="bf16",
                **{n: e for n, e in zip(("out", "dq", "dk", "dv"), errs_t.tolist())},
            )
            r["pass"] = all(e < 2e-2 for e in errs_t.tolist())
            res.setdefault("check", []).append(r)
            log("check", json.dumps(r))
        full = ref = None  # free the tensors (closures above name them)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------- memory
def section_memory(res, args, groups):
    rank = dist.get_rank()
    s_total, h, d = 128 * K, 16, 128
    for p, group in groups.items():
        peak = torch.zeros(2, device="cuda")
        if rank < p:
            torch.cuda.empty_cache()
            q, k, v, dout = local_inputs(1, s_total // p, h, h, d, seed=rank)
            run = ring_step(q, k, v, dout, group, args.backends[0])
            run()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            run()
            torch.cuda.synchronize()
            peak[0] = (torch.cuda.max_memory_allocated() - base) / 2**20
            peak[1] = torch.cuda.max_memory_allocated() / 2**20
            q = k = v = dout = None  # free the tensors (closures above name them)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        shard_mib = 1 * (s_total // p) * h * d * 2 / 2**20
        r = dict(
            P=p,
            S_total=s_total,
            S_local=s_total // p,
            backend=args.backends[0],
            peak_extra_MiB=peak[0].item(),
            peak_total_MiB=peak[1].item(),
            one_shard_MiB=shard_mib,
            extra_over_shard=peak[0].item() / shard_mib,
        )
        res.setdefault("memory", []).append(r)
        log("memory", json.dumps(r))
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- speed
def run_ring_timing(res_key, res, args, groups, s_total, p, hq, hkv, backend, extra=None, d=128, impl="ring"):
    rank = dist.get_rank()
    group = groups[p]
    t = torch.zeros(1, device="cuda")
    if rank < p:
        try:
            q, k, v, dout = local_inputs(1, s_total // p, hq, hkv, d, seed=rank)
            iters = 5 if s_total <= 128 * K else 2
            # Ranks outside the subgroup must not join its barrier: time inside the group.
            t[0] = time_in_group(ring_step(q, k, v, dout, group, backend, impl), group, iters=iters)
            q = k = v = dout = None  # free the tensors (closures above name them)
        except Exception as ex:
            log("speed fail", backend, s_total, p, repr(ex)[:300])
            t[0] = float("nan")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ms = t.item()
    r = dict(
        impl=impl,
        backend=backend,
        P=p,
        S_total=s_total,
        S_local=s_total // p,
        Hq=hq,
        Hkv=hkv,
        D=d,
        fb_ms=ms,
        fb_tflops_per_gpu=attn_flops(s_total, hq, d) / p / ms / 1e9 if ms == ms else None,
    )
    if extra:
        r.update(extra)
    res.setdefault(res_key, []).append(r)
    log(res_key, json.dumps(r))
    torch.cuda.empty_cache()
    return ms


def time_in_group(fn, group, warmup=2, iters=5):
    """Median ms of ``fn`` on this rank (CUDA events), ranks of ``group`` started together."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def section_speed(res, args, groups):
    world = dist.get_world_size()
    for backend in args.backends:
        for s_total in args.seqs:
            for p in groups:
                if s_total // p > 256 * K and p == 1:
                    continue  # one GPU at 512K takes ~16 s an iteration; the peer table has it
                run_ring_timing("strong", res, args, groups, s_total, p, 16, 16, backend)
        # GQA: 32 query heads / 8 KV heads, full world.
        for s_total in args.seqs[:2]:
            run_ring_timing("gqa", res, args, groups, s_total, world, 32, 8, backend)
        # Weak scaling: fixed tokens per GPU.
        for per_gpu in (8 * K, 32 * K):
            for p in groups:
                run_ring_timing("weak", res, args, groups, per_gpu * p, p, 16, 16, backend)


# ----------------------------------------------------------------------------------- peer
def section_peer(res, args, groups):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    world, rank = dist.get_world_size(), dist.get_rank()
    h, d = 16, 128
    sdpa_backends = [(SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")]
    # single-GPU SDPA at the same S (rank 0 only; the others wait)
    for s_total in args.seqs:
        for be, name in sdpa_backends:
            t = torch.zeros(1, device="cuda")
            if rank == 0 and s_total <= 128 * K:
                try:
                    q, k, v = (
                        torch.randn(1, h, s_total, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                        for _ in range(3)
                    )
                    do = torch.randn_like(q)

                    def fb():
                        with sdpa_kernel(be):
                            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

                    t[0] = time_in_group(fb, None, iters=3)
                    q = k = v = do = None  # free the tensors (closures above name them)
                except Exception as ex:
                    log("sdpa fail", name, s_total, repr(ex)[:200])
                    t[0] = float("nan")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if t.item() > 0:
                r = dict(
                    impl=f"sdpa-{name}",
                    P=1,
                    S_total=s_total,
                    fb_ms=t.item(),
                    fb_tflops_per_gpu=attn_flops(s_total, h, d) / t.item() / 1e9,
                )
                res.setdefault("peer", []).append(r)
                log("peer", json.dumps(r))
            torch.cuda.empty_cache()
    if world == 1:
        return
    for method in ("allgather", "alltoall"):
        for s_total in args.seqs:
            for be, name in sdpa_backends:
                time_torch_cp(res, "peer", method, s_total, h, d, be, name)


def time_torch_cp(res, res_key, method, s_total, h, d, be, name):
    """PyTorch's context_parallel (SDPA backend ``be``) over the whole world, fwd+bwd."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import _attention as cpa
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import sdpa_kernel

    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    try:
        cpa.set_rotate_method(method)
    except Exception as ex:
        log("rotate method", method, repr(ex)[:200])
    try:
        torch.manual_seed(0)
        full = [torch.randn(1, h, s_total, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        with context_parallel(mesh, buffers=full, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(full)):
            q, k, v = (t.detach().requires_grad_() for t in full)
            do = torch.randn_like(q)

            def fb():
                with sdpa_kernel(be):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

            ms = time_fn(fb, iters=5 if s_total <= 128 * K else 2)
        r = dict(
            impl=f"torch-cp-{name}",
            method=method,
            P=world,
            S_total=s_total,
            H=h,
            D=d,
            fb_ms=ms,
            fb_tflops_per_gpu=attn_flops(s_total, h, d) / world / ms / 1e9,
        )
        res.setdefault(res_key, []).append(r)
        log(res_key, json.dumps(r))
        full = q = k = v = do = None  # free the tensors (closures above name them)
    except Exception as ex:
        log("torch cp fail", method, name, s_total, repr(ex)[:300])
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ breakdown
class _NoComm:
    def wait(self):
        pass


def section_breakdown(res, args, groups):
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return
    h, d = 16, 128
    backend = args.backends[0]
    group = groups[world]
    for s_total in args.seqs[:2]:
        q, k, v, dout = local_inputs(1, s_total // world, h, h, d, seed=rank)
        total = time_fn(ring_step(q, k, v, dout, group, backend))
        real = ring_comm.RingExchange.shift, ring_comm.RingExchange.shift_back
        ring_comm.RingExchange.shift = lambda self, send, recv: _NoComm()
        ring_comm.RingExchange.shift_back = lambda self, send, recv: _NoComm()
        try:
            compute = time_fn(ring_step(q, k, v, dout, group, backend))
        finally:
            ring_comm.RingExchange.shift, ring_comm.RingExchange.shift_back = real
        comm_obj = ring_comm.RingExchange(group)
        kv = torch.empty((2, 2, *k.shape), dtype=k.dtype, device="cuda")
        dkv = torch.empty((2, 2, *k.shape), dtype=torch.float32, device="cuda")

        def comm_only():
            for i in range(world - 1):  # forward K/V hops
                comm_obj.shift(kv[i % 2], kv[(i + 1) % 2]).wait()
            for i in range(world - 2):  # backward K/V hops (its first block is kept)
                comm_obj.shift_back(kv[i % 2], kv[(i + 1) % 2]).wait()
            for i in range(world - 1):  # backward dK/dV hops (fp32)
                comm_obj.shift_back(dkv[i % 2], dkv[(i + 1) % 2]).wait()

        comm = time_fn(comm_only)
        r = dict(
            backend=backend,
            P=world,
            S_total=s_total,
            total_ms=total,
            compute_only_ms=compute,
            comm_only_ms=comm,
            hidden_comm_fraction=max(0.0, min(1.0, (compute + comm - total) / comm)),
        )
        # Profiler: how much NCCL kernel time ran concurrently with compute kernels.
        try:
            from torch.profiler import ProfilerActivity, profile

            run = ring_step(q, k, v, dout, group, backend)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                run()
                torch.cuda.synchronize()
            kernels = [
                e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
            ]
            nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
            comp = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
            r["profile"] = overlap_summary(nccl, comp)
            # Where compute time goes, and how long the GPU sat idle within the step.
            span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
            busy = sum(e - s for s, e in _union(nccl + comp))
            by_name = {}
            for e in kernels:
                n, t = by_name.get(e.name[:80], (0, 0.0))
                by_name[e.name[:80]] = (n + 1, t + (e.time_range.end - e.time_range.start))
            # Which operator launched each elementwise kernel (copies, casts, adds): the
            # part of a ring step that is neither attention nor communication.
            sources = {}
            for e in prof.events():
                if e.device_type.name != "CPU" or not e.kernels:
                    continue
                t = sum(kk.duration for kk in e.kernels if "elementwise" in kk.name or "Memcpy" in kk.name)
                if t <= 0:
                    continue
                chain, parent = [], e
                while parent is not None and len(chain) < 4:
                    chain.append(parent.name)
                    parent = parent.cpu_parent
                key = " < ".join(chain) + " " + str(e.input_shapes)[:120]
                sources[key] = sources.get(key, 0.0) + t
            r["profile"].update(
                elementwise_sources=sorted(((k, round(t, 1)) for k, t in sources.items()), key=lambda kv: -kv[1])[:16],
                span_us=span,
                idle_us=span - busy,
                top=[(name, n, round(t, 1)) for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]],
            )
        except Exception as ex:
            r["profile_error"] = repr(ex)[:200]
        res.setdefault("breakdown", []).append(r)
        log("breakdown", json.dumps(r))
        q = k = v = dout = kv = dkv = None  # free the tensors (closures above name them)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- priority
def section_priority(res, args, groups):
    """Normal vs high-priority NCCL stream for the ring's group, interleaved, 3 rounds."""
    world = dist.get_world_size()
    if world == 1:
        return
    normal = (
        groups[world] if args.nccl_priority == "normal" else ring_comm.new_ring_group(range(world), high_priority=False)
    )
    high = groups[world] if args.nccl_priority == "high" else ring_comm.new_ring_group(range(world), high_priority=True)
    by_prio = {"normal": {world: normal}, "high": {world: high}}
    for s_total in args.seqs[:2]:
        for backend in args.backends:
            for rnd in range(3):
                for prio, g in by_prio.items():
                    run_ring_timing(
                        "priority",
                        res,
                        args,
                        g,
                        s_total,
                        world,
                        16,
                        16,
                        backend,
                        extra=dict(nccl_stream=prio, round=rnd),
                    )


# ------------------------------------------------------------------------------------ d64
def section_d64(res, args, groups):
    """The gpt-350m attention shape (16 heads of 64): ours vs PyTorch CP cuDNN."""
    from torch.nn.attention import SDPBackend

    world = dist.get_world_size()
    s_total = args.seqs[min(1, len(args.seqs) - 1)]
    for backend in args.backends:
        for impl in ATTENTION:
            run_ring_timing("d64", res, args, groups, s_total, world, 16, 16, backend, d=64, impl=impl)
    if world > 1:
        time_torch_cp(res, "d64", "alltoall", s_total, 16, 64, SDPBackend.CUDNN_ATTENTION, "cudnn")


# -------------------------------------------------------------------------------- ulysses
def section_ulysses(res, args, groups):
    """Head-parallel attention: strong scaling over the same groups and lengths, and GQA."""
    world = dist.get_world_size()
    for backend in args.backends:
        for s_total in args.seqs:
            for p in groups:
                if p > 1:
                    run_ring_timing("ulysses", res, args, groups, s_total, p, 16, 16, backend, impl="ulysses")
        for s_total in args.seqs[:2]:
            if 8 % world == 0:
                run_ring_timing("ulysses", res, args, groups, s_total, world, 32, 8, backend, impl="ulysses")


def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap_summary(nccl, comp):
    nu, cu = _union(nccl), _union(comp)
    nccl_us = sum(e - s for s, e in nu)
    comp_us = sum(e - s for s, e in cu)
    both, i, j = 0.0, 0, 0
    while i < len(nu) and j < len(cu):
        s, e = max(nu[i][0], cu[j][0]), min(nu[i][1], cu[j][1])
        both += max(0.0, e - s)
        if nu[i][1] < cu[j][1]:
            i += 1
        else:
            j += 1
    return dict(
        nccl_kernel_us=nccl_us,
        compute_kernel_us=comp_us,
        nccl_overlapped_us=both,
        nccl_overlapped_fraction=both / nccl_us if nccl_us else None,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="check,memory,speed,peer,breakdown")
    ap.add_argument("--backends", default="cudnn,triton")
    ap.add_argument("--seqs", default="32768,131072,524288")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument(
        "--nccl-priority",
        choices=("high", "normal"),
        default="normal",
        help="CUDA stream priority of the ring groups' NCCL stream",
    )
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args()
    args.backends = args.backends.split(",")
    args.seqs = [int(s) for s in args.seqs.split(",")]
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world = dist.get_world_size()
    res = dict(
        world_size=world,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        shapes="bf16 causal B=1 H=16 D=128 (gqa: 32q/8kv)",
    )
    res["nccl_stream"] = args.nccl_priority
    groups = subgroups(world, high_priority=args.nccl_priority == "high")
    out_path = os.path.join(args.out, f"ring_ws{world}{args.tag}.json")
    for name in args.sections.split(","):
        t0 = time.time()
        try:
            globals()[f"section_{name}"](res, args, groups)
        except Exception:
            log(f"section {name} failed:\n{traceback.format_exc()}")
        log(f"[{name}] {time.time() - t0:.1f}s")
        if dist.get_rank() == 0:  # write after every section: a time-out keeps what finished
            os.makedirs(args.out, exist_ok=True)
            json.dump(res, open(out_path, "w"), indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
