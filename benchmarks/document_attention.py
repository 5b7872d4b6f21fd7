"""Document-masked attention (packed sequences) on GPUs: our Triton kernels vs flex_attention.

    python benchmarks/document_attention.py                           # part A, 1 GPU, ~3 min
    torchrun --nproc-per-node=2 benchmarks/document_attention.py      # part B, the ring

Part A (kernel level, one GPU): S = 128K tokens packed with documents drawn from seeded
mixes (MIXES: mean length 4K, mean 16K, a long-tailed lognormal mix), bf16 B=1, H=16,
D=128 (and GQA 32/8 with --gqa), forward+backward through the library's seam
(attention_forward/backward with q/k document ids, the full sequence as one causal block,
block maps built inside every call) for the split and the atomic backward, next to
  cudnn-causal  plain causal cuDNN without the mask (what skipping is measured against),
  triton-causal the same through our dense Triton kernels,
  flex          torch.nn.attention.flex_attention with a document BlockMask
                (create_block_mask of a document mask_mod; torch.compile'd; the mask is
                built once, outside the timing).
Reported per mix: ms, TFLOP/s on the visible pairs (4*D*H per pair forward, 3.5x for
fwd+bwd), speed-up vs flex, the ideal speed-up over dense causal (causal pairs / visible
pairs) and the fraction of it achieved (dense ms / ours ms / ideal; against cudnn-causal
and against triton-causal, our own dense kernels: the latter isolates what skipping
achieves from how fast the tile kernels are). A correctness
check comes first: bf16 out and grads of ours and flex vs float64 (the library's reference
backend) at 6K tokens with ~6 documents (one id reused by two runs): max abs and
norm-relative errors (ok: relative < 2e-2, as in benchmarks/attention.py).

Part B (torchrun, N GPUs; benchmarks/device/device_documents.sh): per mix (the three above, and
--mixes mean1k,docs256 for 1K and 256-token documents), first ONE GPU (rank 0 alone, in the
same job): our plan path (ring_attention with a DocumentPlan, "auto" = FA4 where installed),
the same with our Triton kernels, and flex_attention; then all GPUs: the document ring by
plan on the packed and on the balanced sequence (balance_documents), with each plan's
busiest-rank imbalance, the share of the plain ring's K/V rows it moves and its host time;
the plain causal ring for reference. --check first compares the bf16 document ring with a
float64 explicit-mask reference. --exchange ring|gather|both: how the plan moves K/V rows
(``plan_documents(exchange=...)``: the ring's P - 1 steps, or one all-to-all and one
kernel call per direction); "both" times the two on the same mixes in one call (keys
``<arrangement>_ms`` for the ring, ``<arrangement>_gather_ms`` for the gather, each
arrangement's busiest rank's kernel calls per forward under both; ``ms`` the faster
balanced one, named by ``exchange``).

One JSON per part under --out (default $OUT or benchmarks/results/):
document_attention_<gpu>.json / document_attention_ring_ws<N>.json, rewritten after each
section so that a time-out keeps what finished. Failures (e.g. flex_attention not
compiling) are recorded and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the checkout, and the sibling benchmark scripts

from attention import bench_ms, events_ms, gpu_tag, poison_allocator, rel_err  # noqa: E402

from longctx.data.document_mixes import document_ids, document_lengths  # noqa: E402
from longctx.kernels import attention_backward, attention_forward  # noqa: E402
from longctx.kernels import triton_attention as ta  # noqa: E402

K = 1024
MIXES = ("mean4k", "mean16k", "longtail")  # part A's mixes; part B also takes mean1k, docs256


def ids_from_lengths(lengths, device="cuda"):
    return document_ids(lengths, device=device)[None]


def mix_summary(lengths, S):
    visible = sum(n * (n + 1) // 2 for n in lengths)
    causal = S * (S + 1) // 2
    return dict(
        documents=len(lengths),
        mean_len=round(S / len(lengths)),
        min_len=min(lengths),
        max_len=max(lengths),
        visible_pairs=visible,
        causal_pairs=causal,
        ideal_speedup=causal / visible,
    )


def pair_tflops(pairs, H, D, ms):
    return 4.0 * pairs * D * H * 3.5 / (ms * 1e-3) / 1e12


def record_error(row, exc):
    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    row["traceback"] = traceback.format_exc()[-4000:]
    print(f"  FAILED {row.get('provider', '')}: {row['error'][:300]}", flush=True)


# ----------------------------------------------------------------------------- providers


def ours_step(q, k, v, dout, ids, bwd_mode, backend="triton"):
    def step():
        ta.BWD_MODE = bwd_mode
        docs = dict(q_document_ids=ids, k_document_ids=ids)
        out, lse = attention_forward(q, k, v, causal=True, backend=backend, **docs)
        return (out,) + tuple(attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend, **docs))

    return step


def _fa4_usable():
    from longctx.kernels import fa4

    return fa4.is_available("cuda")


def dense_causal_step(q, k, v, dout, backend):
    """Plain causal attention, no document mask: the work the mask lets us skip."""

    def step():
        ta.BWD_MODE = "split"
        out, lse = attention_forward(q, k, v, causal=True, backend=backend)
        return (out,) + tuple(attention_backward(dout, q, k, v, out, lse, causal=True, backend=backend))

    return step


_FLEX = {}


def flex_step(q, k, v, dout, ids):
    """flex_attention on (B, H, S, D) views of our tensors with a document BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        # Compiled: evaluated eagerly the mask would be materialised densely (S^2) at 128K.
        _FLEX["mask"] = torch.compile(create_block_mask)
    doc = ids[0]

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    S = q.shape[1]
    block_mask = _FLEX["mask"](document_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device=q.device)
    qf, kf, vf = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dout_t = dout.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]

    def step():
        out = _FLEX["fn"](qf, kf, vf, block_mask=block_mask, enable_gqa=gqa)
        grads = torch.autograd.grad(out, (qf, kf, vf), dout_t)
        return (out.transpose(1, 2),) + tuple(g.transpose(1, 2) for g in grads)

    return step


# ----------------------------------------------------------------------------- part A


def inputs(S, Hq, Hkv, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


def section_check(report):
    """bf16 vs float64 at 6K tokens, ~6 documents, one id reused by two separate runs."""
    lengths = [700, 1500, 64, 1200, 900, 1780]
    ids = ids_from_lengths(lengths)
    ids[0, 700 + 1500 + 64 + 1200 : 700 + 1500 + 64 + 1200 + 900] = 1  # non-adjacent repeat of doc 1
    S, Hq, Hkv, D = sum(lengths), 4, 2, 128
    q, k, v, dout = inputs(S, Hq, Hkv, D, seed=1)
    docs = dict(q_document_ids=ids, k_document_ids=ids)
    out64, lse64 = attention_forward(q.double(), k.double(), v.double(), causal=True, backend="torch", **docs)
    want = (out64,) + tuple(
        attention_backward(
            dout.double(), q.double(), k.double(), v.double(), out64, lse64, causal=True, backend="torch", **docs
        )
    )
    rows = []
    steps = {
        "triton-doc": lambda: ours_step(q, k, v, dout, ids, "split"),
        "triton-doc-atomic": lambda: ours_step(q, k, v, dout, ids, "atomic"),
        "flex": lambda: flex_step(q, k, v, dout, ids),
    }
    if _fa4_usable():
        steps["fa4-doc"] = lambda: ours_step(q, k, v, dout, ids, "split", backend="fa4")
    for provider, make in steps.items():
        row = dict(provider=provider, shape=dict(S=S, Hq=Hq, Hkv=Hkv, D=D, documents=lengths))
        try:
            poison_allocator()
            t0 = time.time()
            got = make()()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - t0, 1)
            names = ("out", "dq", "dk", "dv")
            row["max_abs_err"] = {n: (a.double() - b).abs().max().item() for n, a, b in zip(names, got, want)}
            row["rel_err"] = {n: rel_err(a, b) for n, a, b in zip(names, got, want)}
            row["ok"] = all(e < 2e-2 for e in row["rel_err"].values())  # NaN fails too
            print(
                f"[check] {provider}: {'ok' if row['ok'] else 'FAIL'} max abs {row['max_abs_err']} "
                f"norm-relative {row['rel_err']}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - record and go on
            row["ok"] = False
            record_error(row, e)
        rows.append(row)
    report["check"] = rows


def steady_ms(fn, group, warmup=2, reps=10):
    """Median ms of ``fn`` run back to back on every rank of ``group`` (a fixed count, so the
    ranks' collectives pair up), events between the steps: the host queues ahead of the GPU
    as in training, and the one-GPU baselines (``bench_ms``) are timed the same way."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    return events_ms(fn, reps)


def time_provider(make_step):
    step = make_step()
    step()  # compile / autotune / first block map
    torch.cuda.synchronize()
    return bench_ms(step, budget_s=1.0, min_reps=5, max_reps=30)


def section_kernels(report, args):
    S, D = args.seq, 128
    heads = [(16, 16)] + ([(32, 8)] if args.gqa else [])
    rows = report.setdefault("kernels", [])
    for Hq, Hkv in heads:
        q, k, v, dout = inputs(S, Hq, Hkv, D, seed=S)
        dense = {}
        plain = {
            "cudnn-causal": lambda: dense_causal_step(q, k, v, dout, "cudnn"),
            "triton-causal": lambda: dense_causal_step(q, k, v, dout, "triton"),
        }
        if _fa4_usable():
            plain["fa4-causal"] = lambda: dense_causal_step(q, k, v, dout, "fa4")
        for provider, make in plain.items():
            row = dict(provider=provider, S=S, Hq=Hq, Hkv=Hkv, D=D)
            try:
                row["ms"] = dense[provider] = time_provider(make)
                row["tflops"] = pair_tflops(S * (S + 1) // 2, Hq, D, row["ms"])
                print(f"[kernels] H={Hq}/{Hkv} {provider}: {row['ms']:.2f} ms", flush=True)
            except Exception as e:  # noqa: BLE001
                record_error(row, e)
            rows.append(row)
        for mix in args.mixes:
            lengths = document_lengths(mix, S, seed=args.seed)
            summary = mix_summary(lengths, S)
            ids = ids_from_lengths(lengths)
            steps = {
                "triton-doc": lambda: ours_step(q, k, v, dout, ids, "split"),
                "triton-doc-atomic": lambda: ours_step(q, k, v, dout, ids, "atomic"),
                "flex": lambda: flex_step(q, k, v, dout, ids),
            }
            if _fa4_usable():
                steps["fa4-doc"] = lambda: ours_step(q, k, v, dout, ids, "split", backend="fa4")
            timed = {}
            for provider, make in steps.items():
                row = dict(provider=provider, mix=mix, S=S, Hq=Hq, Hkv=Hkv, D=D, **summary)
                try:
                    row["ms"] = timed[provider] = time_provider(make)
                    row["tflops_visible"] = pair_tflops(summary["visible_pairs"], Hq, D, row["ms"])
                except Exception as e:  # noqa: BLE001
                    record_error(row, e)
                rows.append(row)
            for row in rows[-len(steps) :]:
                if "ms" not in row:
                    continue
                if "flex" in timed:
                    row["speedup_vs_flex"] = timed["flex"] / row["ms"]
                for peer, ms in dense.items():
                    row[f"speedup_vs_{peer}"] = ms / row["ms"]
                    row[f"fraction_of_ideal_vs_{peer}"] = ms / row["ms"] / summary["ideal_speedup"]
                print(
                    f"[kernels] H={Hq}/{Hkv} {mix} ({summary['documents']} docs, ideal "
                    f"{summary['ideal_speedup']:.1f}x) {row['provider']}: {row['ms']:.2f} ms, "
                    f"{row['tflops_visible']:.0f} TFLOP/s visible, vs flex "
                    f"{row.get('speedup_vs_flex', float('nan')):.2f}x, of ideal (vs cudnn / "
                    f"triton causal) {row.get('fraction_of_ideal_vs_cudnn-causal', float('nan')):.2f}"
                    f" / {row.get('fraction_of_ideal_vs_triton-causal', float('nan')):.2f}",
                    flush=True,
                )
            torch.cuda.empty_cache()
        q = k = v = dout = None  # free the tensors (closures above name them)


def block_map_cost(report, args):
    """What the block maps cost per fwd+bwd (three maps at 128K), timed alone."""
    from longctx.kernels import triton_tiles as tt
    from longctx.kernels.triton_document import build_block_map

    ids = ids_from_lengths(document_lengths("mean4k", args.seq, seed=args.seed))
    D = 128
    tiles = [tt.document_tiles(t, D, torch.bfloat16) for t in (tt.FWD_CONFIGS, tt.DKDV_CONFIGS, tt.DQ_CONFIGS)]

    def build():
        for (bm, bn), key_major in zip(tiles, (False, True, False)):
            build_block_map(ids, ids, bm, bn, True, key_major=key_major)

    build()
    report["block_maps"] = dict(tiles=tiles, ms=bench_ms(build, budget_s=0.3))
    print(f"[maps] three block maps at S={args.seq}: {report['block_maps']['ms']:.3f} ms", flush=True)


def part_kernels(args):
    import triton

    report = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d"),
        config=dict(
            S=args.seq,
            dtype="bfloat16",
            B=1,
            D=128,
            mixes=args.mixes,
            seed=args.seed,
            flops="4*D*H per visible pair fwd, x3.5 fwd+bwd",
        ),
    )
    path = os.path.join(args.out, f"document_attention_{gpu_tag()}{args.tag}.json")
    for name, fn in (
        ("check", lambda: section_check(report)),
        ("maps", lambda: block_map_cost(report, args)),
        ("kernels", lambda: section_kernels(report, args)),
    ):
        t0 = time.time()
        try:
            fn()
        except Exception:  # noqa: BLE001 - a broken section must not lose the others
            report.setdefault("section_errors", {})[name] = traceback.format_exc()[-4000:]
            print(f"section {name} failed:\n{traceback.format_exc()}", flush=True)
        report.setdefault("section_s", {})[name] = round(time.time() - t0, 1)
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print(f"wrote {path}", flush=True)


# ----------------------------------------------------------------------------- part B


def _reference_check(world, rank, S=4096, H=2, D=64, mix="longtail", exchange="ring"):
    """bf16 document ring (balanced, plan) vs float64 explicit-mask attention on rank 0."""
    import torch.distributed as dist

    from longctx import balance_documents, ring_attention, shard_sequence, unshard_sequence
    from longctx.documents import plan_documents

    lengths = document_lengths(mix, S, seed=1)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(1, S, H, D, device="cuda", dtype=torch.float64, generator=g) for _ in range(4))
    batch = balance_documents(
        {"document_ids": ids_from_lengths(lengths), "q": q, "k": k, "v": v, "dout": dout}, world_size=world
    )
    ids = batch["document_ids"]
    pos = batch["position_ids"][0]
    plan = plan_documents(ids, world_size=world, rank=rank, exchange=exchange)
    shard = lambda t: shard_sequence(t, 1, rank=rank, world_size=world)  # noqa: E731
    ql, kl, vl = (shard(batch[n]).to(torch.bfloat16).requires_grad_() for n in "qkv")
    out = ring_attention(ql, kl, vl, group=dist.group.WORLD, document_ids=plan)
    out.backward(shard(batch["dout"]).to(torch.bfloat16))
    got = [unshard_sequence(t.detach(), 1, group=dist.group.WORLD) for t in (out, ql.grad, kl.grad, vl.grad)]
    if rank:
        return None
    qr, kr, vr = (batch[n].detach().requires_grad_() for n in "qkv")
    same = (ids[0][:, None] == ids[0][None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("bqhd,bkhd->bhqk", qr, kr) * D**-0.5
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~same, float("-inf")).softmax(-1), vr)
    ref.backward(batch["dout"])
    want = [ref, qr.grad, kr.grad, vr.grad]
    names = ("out", "dq", "dk", "dv")
    errors = {name: float((a.double() - w).norm() / w.norm()) for name, a, w in zip(names, got, want)}
    return errors


def _key(arrangement: str, exchange: str) -> str:
    """Prefix of a ring row's keys: the ring's keep the names they always had."""
    return arrangement if exchange == "ring" else f"{arrangement}_{exchange}"


def _ring_report(args, world, S, H, D):
    return dict(
        world_size=world,
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        config=dict(
            S_total=S,
            H=H,
            D=D,
            dtype="bfloat16",
            layout="zigzag",
            mixes=args.mixes,
            exchange=args.exchange,
            layers_per_backward=args.layers,
        ),
    )


def _ring_checks(report, world, rank, exchanges, save):
    """A bf16 vs float64 check of the document ring per exchange, recorded (errors too)."""
    from ring import log

    for exchange in exchanges:
        key = "check_bf16_vs_float64" + ("" if exchange == "ring" else f"_{exchange}")
        try:
            report[key] = _reference_check(world, rank, exchange=exchange)
        except Exception as e:  # noqa: BLE001
            report[key] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        log(f"[check {exchange}] {report[key]}")
        save()


def stacked_step(q, kvs, dout, layer):
    """One fwd+bwd of ``len(kvs)`` attention layers in one backward, as in a model: layer i
    takes the previous output as its queries and its own K/V (``kvs[i]``; leaves, so no
    gradient is summed across layers). One layer is the plain fwd+bwd."""

    def step():
        for t in (q, *(t for kv in kvs for t in kv)):
            t.grad = None
        x = q
        for k, v in kvs:
            x = layer(x, k, v)
        x.backward(dout)

    return step


def layer_kvs(k, v, layers: int) -> list:
    """``layers`` (k, v) pairs: the given ones, then fresh copies (distinct leaves)."""
    extra = [(k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()) for _ in range(layers - 1)]
    return [(k, v), *extra]


def _time_ring(q, k, v, dout, document_ids, backend="auto", layers=1):
    """Steady ms of one zigzag ring fwd+bwd over the world per layer (``layers`` of them a
    backward), the slowest rank's."""
    import torch.distributed as dist

    from longctx import ring_attention

    def layer(x, k_, v_):
        return ring_attention(
            x,
            k_,
            v_,
            group=dist.group.WORLD,
            causal=True,
            layout="zigzag",
            backend=backend,
            document_ids=document_ids,
        )

    run = stacked_step(q, layer_kvs(k, v, layers), dout, layer)
    t = torch.tensor([steady_ms(run, dist.group.WORLD) / layers], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _one_gpu_cells(args, mix, S, ids, mk, one):
    """Rank 0 alone over the whole sequence of this mix: each provider's fwd+bwd ms (per
    layer, ``--layers`` of them a backward), appended to `one` (our plan-driven FA4 path, our
    Triton kernels, flex_attention)."""
    from ring import log

    from longctx import ring_attention
    from longctx.documents import plan_documents

    q1, k1, v1, d1 = (mk(S) for _ in range(4))
    plan1 = plan_documents(ids, world_size=1, rank=0)
    layers = args.layers
    for provider in args.providers:
        if provider == "flex" and S > args.flex_max:
            continue
        cell = dict(mix=mix, S=S, provider=provider)
        try:
            if provider == "flex":
                step = flex_step(q1.requires_grad_(), k1.requires_grad_(), v1.requires_grad_(), d1, ids)
            else:
                backend = "auto" if provider == "fa4-plan" else "triton"
                kvs = layer_kvs(k1.requires_grad_(), v1.requires_grad_(), layers)
                step = stacked_step(
                    q1.requires_grad_(),
                    kvs,
                    d1,
                    lambda x, k_, v_, backend=backend: ring_attention(x, k_, v_, backend=backend, document_ids=plan1),
                )

            step()
            # per layer (flex: one layer a step)
            cell["ms"] = bench_ms(step) / (1 if provider == "flex" else layers)
        except Exception as e:  # noqa: BLE001
            record_error(cell, e)
        one.append(cell)
        log(f"[one GPU] {json.dumps({k: v for k, v in cell.items() if k != 'traceback'})}")
    q1 = k1 = v1 = d1 = None  # free the tensors (closures above name them)
    torch.cuda.empty_cache()


def _ring_arrangements(row, ids, exchanges, world, rank, S, time_ids):
    """The document ring over this mix, packed and balanced, per exchange: host planning
    time, the plan's imbalance and traffic, and the step's ms (through `time_ids`)."""
    from longctx import balance_documents
    from longctx.documents import plan_documents

    for arrangement in ("packed", "balanced"):
        batch = {"document_ids": ids}
        if arrangement == "balanced":
            start = time.perf_counter()
            batch = balance_documents(batch, world_size=world)
            row["balance_host_ms"] = (time.perf_counter() - start) * 1e3
        for exchange in exchanges:
            key = _key(arrangement, exchange)
            start = time.perf_counter()
            plan = plan_documents(batch["document_ids"], world_size=world, rank=rank, exchange=exchange)
            row[f"{key}_plan_host_ms"] = (time.perf_counter() - start) * 1e3
            row[f"{arrangement}_imbalance"] = plan.imbalance
            row[f"{arrangement}_kv_rows_moved_share"] = plan.moved / (world * (world - 1) * S / world)
            row[f"{arrangement}_max_link_rows"] = int(plan.rows_between.max())
            row[f"{arrangement}_kernel_calls_max"] = {m: int(c.max()) for m, c in plan.launches.items()}
            row[f"{key}_ms"] = time_ids(plan)


def _compare_with_one_gpu(row, one, mix, exchanges, rank):
    """The row's ms is the balanced ring's over its fastest exchange; on rank 0 its
    speedups over the one-GPU providers of the same mix."""
    row["exchange"] = min(exchanges, key=lambda e: row[f"{_key('balanced', e)}_ms"])
    row["ms"] = row[f"{_key('balanced', row['exchange'])}_ms"]
    best = [c["ms"] for c in one if c["mix"] == mix and c.get("ms") and c["provider"] != "flex"]
    flex = [c["ms"] for c in one if c["mix"] == mix and c.get("ms") and c["provider"] == "flex"]
    if rank == 0 and best:
        row["one_gpu_best_ms"] = min(best)
        row["speedup_vs_one_gpu_best"] = min(best) / row["ms"]
    if rank == 0 and flex:
        row["speedup_vs_one_gpu_flex"] = flex[0] / row["ms"]


def _ring_row(args, mix, S, H, D, world, rank, exchanges, mk, one, time_ids):
    """One mix's row: the plain causal ring ("none"), else one GPU first (rank 0), then
    the document ring packed and balanced; an error is recorded in the row."""
    import torch.distributed as dist

    row = dict(mix=mix, S=S)
    try:
        if mix == "none":
            row["ms"] = time_ids(None)
            row["visible_pairs"] = S * (S + 1) // 2
        else:
            lengths = document_lengths(mix, S, seed=args.seed)
            ids = ids_from_lengths(lengths)
            row.update(mix_summary(lengths, S))
            if rank == 0:  # one GPU, the other waits at the barrier
                _one_gpu_cells(args, mix, S, ids, mk, one)
            dist.barrier()
            _ring_arrangements(row, ids, exchanges, world, rank, S, time_ids)
            _compare_with_one_gpu(row, one, mix, exchanges, rank)
        row["tflops_visible_per_gpu"] = pair_tflops(row["visible_pairs"], H, D, row["ms"]) / world
    except Exception as e:  # noqa: BLE001
        record_error(row, e)
    return row


def part_ring(args):
    """One call: every mix on ONE GPU (rank 0 alone: our plan-driven FA4 path, our Triton
    kernels, flex_attention) and then on all GPUs (the document ring, packed and balanced),
    plus the plain causal ring for reference."""
    import torch.distributed as dist
    from ring import log

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world, rank = dist.get_world_size(), dist.get_rank()
    S, H, D = args.seq, 16, 128
    report = _ring_report(args, world, S, H, D)
    exchanges = ("ring", "gather") if args.exchange == "both" else (args.exchange,)
    path = os.path.join(args.out, f"document_attention_ring_ws{world}{args.tag}.json")

    def save():
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1, default=str)

    if args.check:
        _ring_checks(report, world, rank, exchanges, save)

    g = torch.Generator(device="cuda").manual_seed(rank)
    mk = lambda n: torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = (mk(S // world).requires_grad_(i < 3) for i in range(4))

    def time_ids(document_ids):
        return _time_ring(q, k, v, dout, document_ids, layers=args.layers)

    rows = report.setdefault("ring", [])
    one = report.setdefault("one_gpu", [])
    for mix in ["none"] + list(args.mixes):
        row = _ring_row(args, mix, S, H, D, world, rank, exchanges, mk, one, time_ids)
        rows.append(row)
        log(f"[ring ws{world}] {json.dumps({k: v for k, v in row.items() if k != 'traceback'})[:700]}")
        save()
    save()
    if rank == 0:
        print(f"wrote {path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--part",
        choices=("kernels", "ring"),
        default=None,
        help="default: ring under torchrun with several processes, else kernels",
    )
    ap.add_argument("--seq", type=int, default=128 * K, help="tokens per packed sequence")
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gqa", action="store_true", help="part A also with 32 query / 8 kv heads")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--check", action="store_true", help="part B: a bf16 vs float64 check first")
    ap.add_argument(
        "--exchange",
        choices=("ring", "gather", "both"),
        default="ring",
        help="part B: the document plan's K/V exchange (both: each timed on the same mixes)",
    )
    ap.add_argument("--flex-max", type=int, default=256 * K, help="part B: flex_attention up to this length")
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="part B: attention layers chained in one backward (ms per layer): a model pays the "
        "autograd engine's per-backward cost once, a one-layer loop once per layer",
    )
    ap.add_argument(
        "--providers",
        default="fa4-plan,triton-plan,flex",
        type=lambda v: v.split(","),
        help="part B: the one-GPU paths timed (of fa4-plan, triton-plan, flex)",
    )
    args = ap.parse_args(argv)
    args.mixes = [m for m in args.mixes.split(",") if m]
    if not torch.cuda.is_available():
        print("benchmarks/document_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    part = args.part or ("ring" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "kernels")
    (part_ring if part == "ring" else part_kernels)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
