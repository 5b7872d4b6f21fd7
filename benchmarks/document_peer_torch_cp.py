"""Peer: packed-document attention under PyTorch's own context parallel (torchtitan's route).

    torchrun --nproc-per-node=2 benchmarks/document_peer_torch_cp.py --check --out $OUT  # GPUs, nccl
    torchrun --standalone --nproc-per-node=2 benchmarks/document_peer_torch_cp.py --device cpu \\
        --seq 2048 --heads 2 --dim 16 --dtype float64 --mixes mean1k --seed 2 --check \\
        --check-seq 2048 --out /tmp/x                                                      # CPU, gloo

The problem of benchmarks/document_attention.py part B: S = 128K tokens packed from the seeded
mixes of longctx.data.document_mixes, bf16, B=1, H=16, D=128, forward+backward, each mix timed
on all ranks with its one-GPU flex_attention time (rank 0 alone, same job) for reference. Here
the document-causal attention is flex_attention under torch.distributed.tensor.experimental's
context parallel, as torchtitan runs it: the module calling flex_attention is wrapped by
``_ContextParallel(FLEX)`` (its pre-hook all-gathers K and V along the sequence, the backward
reduce-scatters dK/dV), the global document BlockMask is built once and handed to
``_context_parallel_shard`` with q, k, v, dout, which permutes the tokens by a load balancer
and rewrites the mask for each rank's queries. Load balancers (--balancers): ptrr
(``_PTRRLoadBalancer``: blocks of 128 queries dealt by their mask work, torchtitan's choice for
flex), headtail (``_HeadTailLoadBalancer``, zigzag), perdoc (``_PerDocumentHeadTailLoadBalancer``:
needs every document a multiple of 2 x ranks tokens, refused in one line otherwise), none.

Which API this torch has is probed by name, not by version; the JSON says which path was taken,
or why none could be (the missing names), and every mix records its failure as text. Timing:
the CP step with document_attention.steady_ms (back to back, a fixed count on every rank, the
slowest rank's median), the one-GPU flex step with bench_ms as document_attention part B does.
Per balancer it also reports the busiest rank's share of the visible pairs and of the mask's
128x128 blocks (what flex computes) against the mean.

--check compares out, dq, dk, dv of the CP step (gathered and un-permuted) with a float64
explicit-mask reference on rank 0, at --check-seq tokens. On the CPU flex_attention has no
backward (torch refuses it), so there the forward of flex itself is checked and the
forward+backward (also the timed step) runs a dense stand-in with flex's semantics under the
same CP wrapper: the CP BlockMask's own mask_mod over its own block table. CPU times only show
that the path runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the checkout, and the sibling benchmark scripts

from document_attention import flex_step, mix_summary, pair_tflops, record_error, steady_ms  # noqa: E402

from longctx.data.document_mixes import MIXES, document_ids, document_lengths  # noqa: E402

BALANCERS = ("ptrr", "headtail", "perdoc", "none")
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2}  # norm-relative
PROBED = (
    "_ContextParallel",
    "_context_parallel_shard",
    "context_parallel_unshard",
    "_enable_context_parallel_dispatcher",
    "_PTRRLoadBalancer",
    "_HeadTailLoadBalancer",
    "_PerDocumentHeadTailLoadBalancer",
    "create_cp_block_mask",
    "_create_cp_block_mask",
    "context_parallel",
)


# ----------------------------------------------------------------------------- the API


def probe_api() -> dict:
    """Which of torch's CP names exist, and the path this script takes (None: why not)."""
    found = {}
    try:
        import torch.distributed.tensor.experimental._attention as cp
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return dict(
            path=None,
            reason=f"import torch.distributed.tensor.experimental._attention: {type(e).__name__}: {e}",
            names={},
        )
    for name in PROBED:
        found[name] = hasattr(cp, name)
    flex_style = found["_ContextParallel"] and hasattr(getattr(cp._ContextParallel, "AttentionType", None), "FLEX")
    found["_ContextParallel.AttentionType.FLEX"] = flex_style
    try:
        from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401

        found["parallelize_module"] = True
    except ImportError:
        found["parallelize_module"] = False
    need = (
        "_ContextParallel.AttentionType.FLEX",
        "_context_parallel_shard",
        "context_parallel_unshard",
        "parallelize_module",
    )
    missing = [n for n in need if not found[n]]
    if missing:
        return dict(
            path=None,
            names=found,
            reason=f"this torch lacks {', '.join(missing)} (the module-wrapper flex CP torchtitan uses); not attempted",
        )
    return dict(
        path="module-wrapper: parallelize_module(_ContextParallel(seq_dim=2, FLEX)) around "
        "torch.compile(flex_attention); _context_parallel_shard of q, k, v, dout and the "
        "document BlockMask with a load balancer",
        names=found,
        balancers=[
            b
            for b, n in (
                ("ptrr", "_PTRRLoadBalancer"),
                ("headtail", "_HeadTailLoadBalancer"),
                ("perdoc", "_PerDocumentHeadTailLoadBalancer"),
            )
            if found[n]
        ]
        + ["none"],
    )


def make_balancer(name, block_mask, lengths, S, world, device):
    import torch.distributed.tensor.experimental._attention as cp

    if name == "none":
        return None
    if name == "ptrr":
        return cp._PTRRLoadBalancer(block_mask, world)
    if name == "headtail":
        return cp._HeadTailLoadBalancer(S, world, torch.device(device))
    bad = [n for n in lengths if n % (2 * world)]
    if bad:  # its own check is a bare assert
        raise ValueError(
            f"perdoc needs every document a multiple of 2 x {world} tokens; "
            f"{len(bad)} of {len(lengths)} are not (e.g. {bad[0]})"
        )
    return cp._PerDocumentHeadTailLoadBalancer([lengths], world, torch.device(device))


def permutation(balancer, S, device):
    """Global token order the ranks hold, rank r holding the r-th S/P slice."""
    if balancer is None:
        return torch.arange(S, device=device)
    return balancer._generate_indices(restore=False)[0]


def document_causal(doc):
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


class FlexCore(torch.nn.Module):
    """The module _ContextParallel hooks: its forward is the attention call alone."""

    def __init__(self, attend):
        super().__init__()
        self.attend = attend

    def forward(self, q, k, v, block_mask):
        return self.attend(q, k, v, block_mask=block_mask)


class DenseFlex:
    """flex_attention's result computed densely: the BlockMask's mask_mod where its block table
    has the block (flex has no backward on the CPU, so the CPU runs this under the CP wrapper).
    The dense mask is kept for the last BlockMask seen (vmapping mask_mod is the slow part)."""

    def __init__(self):
        self.block_mask = self.allowed = None

    def __call__(self, q, k, v, block_mask):
        from torch.nn.attention.flex_attention import create_mask

        if block_mask is not self.block_mask:
            Lq, Lk = q.shape[2], k.shape[2]
            bq, bk = block_mask.BLOCK_SIZE
            blocks = block_mask.to_dense().repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :Lq, :Lk]
            self.allowed = create_mask(block_mask.mask_mod, 1, 1, Lq, Lk, device=q.device) & blocks.bool()
            self.block_mask = block_mask
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return scores.masked_fill(~self.allowed, float("-inf")).softmax(-1) @ v


def wrap(attend, mesh):
    import torch.distributed.tensor.experimental._attention as cp
    from torch.distributed.tensor.parallel import parallelize_module

    if hasattr(cp, "_enable_context_parallel_dispatcher"):
        cp._enable_context_parallel_dispatcher()  # as torchtitan's apply_cp does
    return parallelize_module(
        FlexCore(attend), mesh, cp._ContextParallel(seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX)
    )


# ----------------------------------------------------------------------------- one problem


@functools.cache
def _compiled_create_block_mask():
    """Compiled once: eager, create_block_mask would build the (S, S) mask densely."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


class Problem:
    """One mix at (S, H, D): full tensors (identical on every rank), the global document
    BlockMask, and per balancer the rank's shards and CP BlockMask."""

    def __init__(self, mix, S, H, D, dtype, device, seed, mesh):
        from torch.nn.attention.flex_attention import create_block_mask

        self.S, self.H, self.D, self.device, self.mesh = S, H, D, device, mesh
        self.lengths = document_lengths(mix, S, seed=seed)
        self.ids = document_ids(self.lengths, device=device)
        g = torch.Generator(device=device).manual_seed(S + 17)
        self.full = [torch.randn(1, H, S, D, device=device, dtype=dtype, generator=g) for _ in range(4)]
        build = create_block_mask if device == "cpu" else _compiled_create_block_mask()
        self.block_mask = build(document_causal(self.ids), B=None, H=None, Q_LEN=S, KV_LEN=S, device=device)

    def shard(self, balancer_name):
        import torch.distributed.tensor.experimental._attention as cp

        world = self.mesh.size()
        lb = make_balancer(balancer_name, self.block_mask, self.lengths, self.S, world, self.device)
        shards = cp._context_parallel_shard(self.mesh, self.full, [2] * 4, load_balancer=lb)
        q, k, v, dout = (t.contiguous() for t in shards)  # as a projection would give them
        (cp_mask,) = cp._context_parallel_shard(self.mesh, [self.block_mask], [2], load_balancer=lb)
        return lb, (q, k, v, dout), cp_mask

    def work(self, lb, cp_mask):
        """Busiest rank / mean: visible pairs (exact) and 128x128 blocks the mask visits."""
        world, rank = self.mesh.size(), self.mesh.get_local_rank()
        order = permutation(lb, self.S, self.device)
        starts = torch.repeat_interleave(
            torch.cumsum(torch.tensor([0] + self.lengths[:-1]), 0), torch.tensor(self.lengths)
        ).to(self.device)
        seen = (torch.arange(self.S, device=self.device) - starts + 1)[order]  # keys each query sees
        pairs = seen.view(world, -1).sum(1).double()
        nb = cp_mask.kv_num_blocks + (cp_mask.full_kv_num_blocks if cp_mask.full_kv_num_blocks is not None else 0)
        blocks = torch.zeros(world, dtype=torch.float64, device=self.device)
        blocks[rank] = nb.sum().double()
        dist.all_reduce(blocks)
        return dict(
            pair_imbalance=float(pairs.max() / pairs.mean()),
            block_imbalance=float(blocks.max() / blocks.mean()),
            blocks_per_rank=[int(b) for b in blocks.tolist()],
        )


def reference(problem):
    """float64 out, dq, dk, dv on the whole sequence with an explicit (S, S) mask."""
    q, k, v = (t.detach().double().requires_grad_() for t in problem.full[:3])
    ids = problem.ids
    pos = torch.arange(problem.S, device=ids.device)
    same = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])
    scores = (q @ k.transpose(-1, -2)) * problem.D**-0.5
    out = scores.masked_fill(~same, float("-inf")).softmax(-1) @ v
    out.backward(problem.full[3].double())
    return [out.detach(), q.grad, k.grad, v.grad]


def check(problem, balancer_name, attend_fwd, attend_bwd, dtype):
    """Norm-relative errors of the CP result (gathered, un-permuted) vs float64, on rank 0."""
    import torch.distributed.tensor.experimental._attention as cp

    lb, (q, k, v, dout), cp_mask = problem.shard(balancer_name)
    row = {}
    names = ("out", "dq", "dk", "dv")
    want = reference(problem) if dist.get_rank() == 0 else None
    if attend_fwd is not None:  # flex itself, forward only (CPU)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
            out = wrap(attend_fwd, problem.mesh)(q, k, v, block_mask=cp_mask)
        (got,) = cp.context_parallel_unshard(problem.mesh, [out], [2], load_balancer=lb)
        if want is not None:
            row["flex_forward_rel_err"] = float((got.double() - want[0]).norm() / want[0].norm())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = wrap(attend_bwd, problem.mesh)(ql, kl, vl, block_mask=cp_mask)
    out.backward(dout)
    got = cp.context_parallel_unshard(
        problem.mesh, [out.detach(), ql.grad, kl.grad, vl.grad], [2] * 4, load_balancer=lb
    )
    if want is None:
        return None
    row["rel_err"] = {n: float((a.double() - w).norm() / w.norm()) for n, a, w in zip(names, got, want)}
    errors = list(row["rel_err"].values()) + [row.get("flex_forward_rel_err", 0.0)]
    row["tolerance"] = TOLERANCE[dtype]
    row["ok"] = all(e < TOLERANCE[dtype] for e in errors)  # NaN fails too
    return row


# ----------------------------------------------------------------------------- the run


def timed_ms(step, device):
    """The slowest rank's median ms (and every rank's), steps back to back on every rank."""
    if device == "cuda":
        ms = steady_ms(step, dist.group.WORLD)
    else:  # wall clock, one step after one warm-up: only shows the CPU path runs
        step()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        ms = (time.perf_counter() - t0) * 1e3
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ms)
    return max(every), every


def one_gpu_flex(problem):
    """document_attention's flex step on the whole sequence, rank 0 alone, as its part B times it."""
    from attention import bench_ms

    q, k, v, dout = (t.transpose(1, 2) for t in problem.full)  # flex_step takes (B, S, H, D)
    step = flex_step(q, k, v, dout, problem.ids[None])
    step()
    return bench_ms(step)


def parse_args(argv=None):
    """(args, mixes, balancers); unknown mixes or balancers, or CUDA asked for and absent,
    end the run with argparse's error."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=128 * 1024, help="tokens per packed sequence")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "float64"), default="bfloat16")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument(
        "--balancers",
        default="ptrr,headtail,perdoc",
        help=f"comma-separated of {BALANCERS}; ptrr is torchtitan's choice for flex",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--check", action="store_true", help="float64 check of out and grads first, per mix")
    ap.add_argument("--check-seq", type=int, default=4096, help="tokens of the --check problem")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args(argv)
    mixes = [m for m in args.mixes.split(",") if m]
    balancers = [b for b in args.balancers.split(",") if b]
    for name, given, allowed in (("mix", mixes, MIXES), ("balancer", balancers, BALANCERS)):
        if any(x not in allowed for x in given):
            ap.error(f"unknown {name} in {given}; expected some of {allowed}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs CUDA; on a CPU machine pass --device cpu (gloo, tiny shapes)")
    return args, mixes, balancers


def init_distributed(device):
    """(world, rank, mesh): nccl on CUDA, gloo on the CPU; dynamo keeps every flex graph."""
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device, (world,))
    # A new document mask per mix and balancer is a new flex graph to guard; keep them all.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(128, getattr(torch._dynamo.config, knob)))
    return world, rank, mesh


def new_report(args, world, api, mixes, balancers):
    on_cpu = args.device == "cpu"
    return dict(
        world_size=world,
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name() if not on_cpu else "cpu",
        api=api,
        config=dict(
            S=args.seq,
            B=1,
            H=args.heads,
            D=args.dim,
            dtype=args.dtype,
            mixes=mixes,
            balancers=balancers,
            seed=args.seed,
            fwd_bwd=True,
            timed_attention="dense stand-in of flex (flex_attention has no backward on the "
            "CPU): the times only show the path runs"
            if on_cpu
            else "torch.compile(flex_attention)",
        ),
        mixes=[],
    )


def log(*a):
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(*a, flush=True)


def check_mix(row, args, mix, balancers, dtype, mesh, attend):
    """--check: each balancer's CP step against the float64 reference at --check-seq tokens
    (rank 0 records it in the row)."""
    on_cpu = args.device == "cpu"
    small = Problem(mix, args.check_seq, min(args.heads, 4), min(args.dim, 64), dtype, args.device, args.seed, mesh)
    for name in balancers:
        try:
            got = check(small, name, _flex() if on_cpu else None, attend, dtype)
        except Exception as e:  # noqa: BLE001
            got = {"ok": False}
            record_error(got, e)
        if dist.get_rank() == 0:
            row.setdefault("check", {})[name] = dict(S=args.check_seq, **got)
            log(f"[check] {mix} {name}: {json.dumps(got)[:400]}")


def one_gpu_cell(problem, on_cpu):
    """Rank 0 alone: the whole problem through flex_attention on one GPU (not on the CPU)."""
    if on_cpu:
        return {"error": "not run: flex_attention has no backward on the CPU"}
    cell = {}
    try:
        cell["ms"] = one_gpu_flex(problem)
    except Exception as e:  # noqa: BLE001
        record_error(cell, e)
    torch.cuda.empty_cache()
    return cell


def balancer_cell(problem, name, attend, mesh, args, visible_pairs):
    """The CP step with this load balancer: its work shares, ms (and per rank), TFLOP/s."""
    cell = {}
    try:
        lb, (q, k, v, dout), cp_mask = problem.shard(name)
        cell.update(problem.work(lb, cp_mask))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        core = wrap(attend, mesh)

        def step():
            q.grad = k.grad = v.grad = None
            core(q, k, v, block_mask=cp_mask).backward(dout)

        cell["ms"], cell["ms_per_rank"] = timed_ms(step, args.device)
        world = dist.get_world_size()
        cell["tflops_visible_per_gpu"] = pair_tflops(visible_pairs, args.heads, args.dim, cell["ms"]) / world
    except Exception as e:  # noqa: BLE001 - one balancer failing leaves the others
        record_error(cell, e)
    return cell


def pick_balancer(row):
    """The row's ms is its fastest balancer's; its speedup over the one-GPU flex step."""
    done = {n: c["ms"] for n, c in row["balancers"].items() if "ms" in c}
    if done:
        row["balancer"] = min(done, key=done.get)
        row["ms"] = done[row["balancer"]]
        flex_ms = row.get("one_gpu_flex", {}).get("ms")
        if flex_ms:
            row["speedup_vs_one_gpu_flex"] = flex_ms / row["ms"]


def run_mix(row, args, mix, balancers, dtype, mesh, api, attend):
    """One mix: the check (--check), the one-GPU flex time (rank 0), every balancer's CP
    step; the tensors are freed when it returns."""
    on_cpu = args.device == "cpu"
    world = dist.get_world_size()
    if api["path"] is None:
        raise RuntimeError(api["reason"])
    if args.check:
        check_mix(row, args, mix, balancers, dtype, mesh, attend)
    problem = Problem(mix, args.seq, args.heads, args.dim, dtype, args.device, args.seed, mesh)
    row.update(mix_summary(problem.lengths, args.seq))
    if dist.get_rank() == 0:
        row["one_gpu_flex"] = one_gpu_cell(problem, on_cpu)
        shown = {k: v for k, v in row["one_gpu_flex"].items() if k != "traceback"}
        log(f"[one GPU] {mix}: {json.dumps(shown)}")
    dist.barrier()
    for name in balancers:
        cell = row["balancers"][name] = balancer_cell(problem, name, attend, mesh, args, row["visible_pairs"])
        if not on_cpu:
            torch.cuda.empty_cache()  # the balancer's tensors are freed: before the next one
        log(f"[cp ws{world}] {mix} {name}: {json.dumps({k: v for k, v in cell.items() if k != 'traceback'})}")
    pick_balancer(row)


def main(argv=None):
    args, mixes, balancers = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    world, rank, mesh = init_distributed(args.device)
    api = probe_api()
    on_cpu = args.device == "cpu"
    report = new_report(args, world, api, mixes, balancers)
    path = os.path.join(args.out, f"document_peer_torch_cp_ws{world}{args.tag}.json")

    def save():
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1, default=str)

    log(f"[api] {api.get('path') or api['reason']}")
    attend = DenseFlex() if on_cpu else torch.compile(_flex(), dynamic=False)
    for mix in mixes:
        row = dict(mix=mix, S=args.seq, torch=torch.__version__, balancers={})
        report["mixes"].append(row)
        try:
            run_mix(row, args, mix, balancers, dtype, mesh, api, attend)
        except Exception as e:  # noqa: BLE001 - a mix that fails does not stop the others
            record_error(row, e)
        save()
    save()
    log(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


if __name__ == "__main__":
    sys.exit(main())
