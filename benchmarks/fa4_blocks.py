"""FlashAttention-4 ring blocks on one GPU: exactness first, then speed against cuDNN and Triton.

    source benchmarks/device/device_env.sh && python benchmarks/fa4_blocks.py      # ~5 min on one H200

Sections (one JSON, fa4_blocks_<gpu>.json under $OUT or benchmarks/results/, rewritten after
each section so a time-out keeps what finished):
  check     bf16 blocks through the library's seam (attention_forward/backward, backend="fa4")
            vs float64 (the "torch" backend): causal/full, MHA D=128, GQA 32/8 D=64 and 8/2
            D=128, Sq != Sk, ragged lengths, fp32 partials as the ring asks; a NaN in q must
            show in the output. Then document-masked blocks with the id patterns of
            tests/kernels/test_document_kernels.py (longctx.data.document_mixes.document_id_pattern;
            diagonal causal blocks and off-diagonal full blocks, rows without keys), noting
            which went through FA4 varlen and which fell back to Triton (ids FA4's runs cannot
            express).
  ring      the zigzag ring emulated on one GPU, the unsharded result vs float64 (P=2 and 4):
            without documents every rank's blocks (longctx.ring.ring_blocks, the same slices
            and skips), fp32 merges, the backward from the merged out/lse, dK/dV summed onto
            their owner; with documents every rank's DocumentPlan (longctx.documents.
            plan_documents): its local calls, then each step's exchange call over the rows
            the sending rank's plan sends (longctx.document_ring.forward_calls/backward_calls),
            dK/dV back onto the sender's rows. Then the plain P=2 ring's per-rank block time
            at 128K, fa4 vs cudnn.
  compile   first-call seconds of every FA4 kernel variant this process compiled (or loaded
            from the on-disk cache, see kernels/fa4.py).
  blocks    fwd+bwd ms of the issue's ring block shapes (causal diagonal and full off-diagonal,
            MHA D=128, GQA 32/8 D=64 and D=128, 32K-128K) for cudnn, triton and fa4, ratio fa4/cudnn.
  select    the grid kernels/selection_table.py is written from (benchmarks/write_selection.py):
            S in 1K..16K, causal/full, D 64/128, H=16, every available backend.
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
sys.path[:0] = [os.path.dirname(HERE), HERE]

from attention import bench_ms, gpu_tag, poison_allocator  # noqa: E402

from longctx import shard_sequence  # noqa: E402
from longctx.data.document_mixes import document_id_pattern  # noqa: E402
from longctx.document_ring import backward_calls, call_forward, forward_calls  # noqa: E402
from longctx.documents import plan_documents  # noqa: E402
from longctx.kernels import (  # noqa: E402
    attention_backward,
    attention_forward,
    fa4,
    resolve_backend,  # noqa: E402
)
from longctx.kernels.merge import merge_partials_  # noqa: E402
from longctx.kernels.rows import rows_of  # noqa: E402
from longctx.ring import ring_blocks  # noqa: E402

K = 1024
DEV = "cuda"
_SAVE = []  # the report writer, called after every row so that a time-out keeps what finished


def save(report):
    for write in _SAVE:
        write(report)


def rel(got, want):
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    if want.norm() < 1e-12:
        return (got - want).abs().max().item() if got.numel() else 0.0
    return ((got - want).norm() / want.norm()).item()


def randn(*shape, gen):
    return torch.randn(*shape, device=DEV, dtype=torch.float32, generator=gen)


def block(q, k, v, dout, causal, backend, out_dtype=None, grad_dtype=None, **docs):
    out, lse = attention_forward(q, k, v, causal=causal, backend=backend, out_dtype=out_dtype, **docs)
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend, grad_dtype=grad_dtype, **docs)
    return (out, lse, *grads)


def compare(got, want, tol=2e-2):
    names = ("out", "lse", "dq", "dk", "dv")
    finite = torch.isfinite(want[1])
    errs = {}
    for n, g, w in zip(names, got, want):
        if n == "lse":
            g, w = g[finite], w[finite]
        errs[n] = rel(g, w)
    empty = ~finite
    empty_ok = bool((got[1][empty] == float("-inf")).all() and (got[0].transpose(1, 2)[empty] == 0).all())
    return dict(
        errs={k: round(e, 6) for k, e in errs.items()},
        empty_rows=int(empty.sum()),
        ok=all(e < tol for e in errs.values()) and empty_ok,
    )


# ------------------------------------------------------------------------------ check

DENSE_CASES = {  # name: (B, Sq, Sk, Hq, Hkv, D, causal)
    "causal_mha_d128": (2, 1000, 1000, 4, 4, 128, True),
    "full_mha_d128_sq_ne_sk": (1, 700, 1100, 4, 4, 128, False),
    "causal_gqa32_8_d64": (1, 1536, 1536, 32, 8, 64, True),
    "full_gqa32_8_d64": (1, 1024, 2048, 32, 8, 64, False),
    "causal_gqa8_2_d128_ragged": (1, 1337, 1337, 8, 2, 128, True),
    "full_gqa8_2_d128_short_keys": (1, 777, 65, 8, 2, 128, False),
}


def section_check(report):
    rows = report.setdefault("check", [])
    for name, (B, Sq, Sk, Hq, Hkv, D, causal) in DENSE_CASES.items():
        gen = torch.Generator(device=DEV).manual_seed(len(rows) + 1)
        q, dout = randn(B, Sq, Hq, D, gen=gen), randn(B, Sq, Hq, D, gen=gen)
        k, v = randn(B, Sk, Hkv, D, gen=gen), randn(B, Sk, Hkv, D, gen=gen)
        want = block(q.double(), k.double(), v.double(), dout.double(), causal, "torch")
        bf = [t.bfloat16() for t in (q, k, v, dout)]
        for partials in ("bf16", "fp32"):
            row = dict(kind="dense", case=name, partials=partials)
            try:
                poison_allocator()
                f32 = torch.float32 if partials == "fp32" else None
                row.update(compare(block(*bf, causal, "fa4", out_dtype=f32, grad_dtype=f32), want))
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500], tb=traceback.format_exc()[-3000:])
            rows.append(row)
            print(f"[check] {row}", flush=True)
            save(report)
        if name == "causal_mha_d128":
            qn = bf[0].clone()
            qn[0, 17, 1, 5] = float("nan")
            out, lse = attention_forward(qn, bf[1], bf[2], causal=True, backend="fa4")
            nan_rows = torch.isnan(out[0]).any(-1).any(-1)
            rows.append(
                dict(
                    kind="nan",
                    case=name,
                    out_nan_rows=int(nan_rows.sum()),
                    lse_17=lse[0, :, 17].tolist(),
                    ok=bool(nan_rows[17] and torch.isnan(lse[0, 1, 17])),
                )
            )
            print(f"[check] {rows[-1]}", flush=True)
    # Documents: the Triton document tests' id patterns at GPU-sized lengths, plus ring-like
    # off-diagonal blocks (keys of an earlier chunk, one document straddling the cut).
    doc_cases = [
        ("short", True, 1, 900, 900),
        ("len1", True, 1, 300, 300),
        ("mix", True, 2, 70, 70),
        ("halves", True, 1, 512, 512),
        ("repeat", True, 1, 600, 600),
        ("one", True, 1, 700, 700),
        ("short", False, 2, 640, 960),
        ("disjoint", False, 1, 400, 330),
        ("repeat", False, 1, 500, 450),
        ("straddle", False, 1, 1024, 1024),
        ("nothing_shared", False, 1, 256, 384),
    ]
    for kind, causal, B, Sq, Sk in doc_cases:
        gen = torch.Generator().manual_seed(Sq * 7 + Sk)
        if kind == "straddle":
            q_ids = torch.cat([torch.full((B, 300), 4), torch.full((B, Sq - 300), 5)], 1)
            k_ids = torch.cat([torch.full((B, Sk - 200), 3), torch.full((B, 200), 4)], 1)
        elif kind == "nothing_shared":
            q_ids, k_ids = torch.full((B, Sq), 2), torch.full((B, Sk), 1)
        else:
            q_ids, k_ids = document_id_pattern(kind, B, Sq, Sk, gen)
        if causal:
            k_ids = q_ids
        q_ids, k_ids = q_ids.to(DEV), k_ids.to(DEV)
        Hq, Hkv, D = 8, 2, 128
        g = torch.Generator(device=DEV).manual_seed(Sq + Sk)
        q, dout = randn(B, Sq, Hq, D, gen=g), randn(B, Sq, Hq, D, gen=g)
        k, v = randn(B, Sk, Hkv, D, gen=g), randn(B, Sk, Hkv, D, gen=g)
        docs = dict(q_document_ids=q_ids, k_document_ids=k_ids)
        want = block(q.double(), k.double(), v.double(), dout.double(), causal, "torch", **docs)
        row = dict(
            kind="documents",
            case=kind,
            causal=causal,
            shape=(B, Sq, Sk, Hq, Hkv, D),
            varlen=fa4.plan_documents(q_ids, k_ids, causal) is not None,
        )
        try:
            poison_allocator()
            row.update(compare(block(*(t.bfloat16() for t in (q, k, v, dout)), causal, "fa4", **docs), want))
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500], tb=traceback.format_exc()[-3000:])
        rows.append(row)
        print(f"[check] {row}", flush=True)
        save(report)


# ------------------------------------------------------------------------------ ring


def _add_rows(acc, rows, grad):
    """``acc[:, rows] += grad`` for the plan's rows (None, a slice or an index tensor)."""
    if rows is None or isinstance(rows, slice):
        rows_of(acc, rows).add_(grad.to(acc.dtype))
    else:
        acc.index_add_(1, rows, grad.to(acc.dtype))


def emulated_ring(q, k, v, dout, ids, world, backend):
    """Unsharded (out, dq, dk, dv) of a zigzag ring of `world` ranks, every rank's work run
    here (on q's device) one rank after another, as the library does it.

    Without documents (``ids`` None): the plain ring's blocks (``longctx.ring.ring_blocks``:
    the same slices and skips), fp32 merges, the backward from the merged out/lse, dK/dV
    summed onto the rank that owns the K/V shard. With documents: every rank's
    ``longctx.documents.plan_documents`` plan - its local calls over its own shard, then at
    step s its exchange's call over the message rank r - s would send it (that rank's
    ``exchanges[s - 1].send_rows`` of its shard, gathered with ``rows_of``), through
    ``longctx.document_ring``'s call runners; the message's dK/dV go back to the sender's rows."""
    shard = lambda t, r: shard_sequence(t, 1, rank=r, world_size=world, layout="zigzag")  # noqa: E731
    device, s_local, scale = q.device, q.shape[1] // world, q.shape[-1] ** -0.5
    local = [dict(q=shard(q, r), k=shard(k, r), v=shard(v, r), dout=shard(dout, r)) for r in range(world)]
    if ids is not None:
        outs, dqs, dks, dvs = _emulated_document_ring(local, ids, world, backend, scale)
    else:
        outs, dqs, dks, dvs = _emulated_plain_ring(local, q.dtype, world, s_local, backend)

    def full(parts):
        return torch.cat([p for p in parts], 1)[:, _zigzag_inverse(q.shape[1], world, device)]

    return full(outs), full(dqs), full(dks), full(dvs)


def _emulated_plain_ring(local, dtype, world, s_local, backend):
    plans = [ring_blocks(r, world, "zigzag", True, s_local) for r in range(world)]
    outs, lses = [], []
    for r in range(world):
        out = lse = None
        for step, blk in enumerate(plans[r]):
            if blk is None:
                continue
            rows, cols, masked = blk
            src = (r - step) % world
            ob, lb = attention_forward(
                local[r]["q"][:, rows],
                local[src]["k"][:, cols],
                local[src]["v"][:, cols],
                causal=masked,
                backend=backend,
            )
            if out is None:
                out, lse = ob.float().contiguous(), lb.float()
            else:
                merge_partials_(out[:, rows], lse[:, :, rows], ob, lb)
        outs.append(out)
        lses.append(lse)
    dqs = [torch.zeros_like(local[r]["q"], dtype=torch.float32) for r in range(world)]
    dks = [torch.zeros_like(local[r]["k"], dtype=torch.float32) for r in range(world)]
    dvs = [torch.zeros_like(local[r]["v"], dtype=torch.float32) for r in range(world)]
    for r in range(world):
        final = outs[r].to(dtype)
        for step, blk in enumerate(plans[r]):
            if blk is None:
                continue
            rows, cols, masked = blk
            src = (r - step) % world
            dq, dk, dv = attention_backward(
                local[r]["dout"][:, rows],
                local[r]["q"][:, rows],
                local[src]["k"][:, cols],
                local[src]["v"][:, cols],
                final[:, rows],
                lses[r][:, :, rows],
                causal=masked,
                backend=backend,
            )
            dqs[r][:, rows] += dq.float()
            dks[src][:, cols] += dk.float()
            dvs[src][:, cols] += dv.float()
    return [o.to(dtype) for o in outs], dqs, dks, dvs


def _emulated_document_ring(local, ids, world, backend, scale):
    flat = lambda t: t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])  # noqa: E731 - the plan's rows
    device = local[0]["q"].device
    plans = [
        plan_documents(ids, world_size=world, rank=r, layout="zigzag", causal=True, device=device) for r in range(world)
    ]
    fl = [{key: flat(t) for key, t in shard.items()} for shard in local]
    name = resolve_backend(backend, fl[0]["q"], fl[0]["k"], True, documents=True)

    def message(r, step, key):
        """What rank r - step sends rank r at this step: its rows that r's queries see."""
        src = (r - step) % world
        return rows_of(fl[src][key], plans[src].exchanges[step - 1].send_rows)

    outs, lses = [], []
    for r in range(world):
        out, lse = forward_calls(fl[r]["q"], fl[r]["k"], fl[r]["v"], plans[r].local_calls, scale, name)
        for step in range(1, world):
            call = plans[r].exchanges[step - 1].call
            if call is not None:
                out, lse = call_forward(
                    call, fl[r]["q"], message(r, step, "k"), message(r, step, "v"), out, lse, scale, name
                )
        outs.append(out.to(fl[r]["q"].dtype))
        lses.append(lse)
    grads = [
        tuple(torch.zeros(fl[r][key].shape, dtype=torch.float32, device=device) for key in ("q", "k", "v"))
        for r in range(world)
    ]
    for r in range(world):
        dq = grads[r][0]
        for step in range(1, world):
            call = plans[r].exchanges[step - 1].call
            if call is None:
                continue
            src = (r - step) % world
            k_m, v_m = message(r, step, "k"), message(r, step, "v")
            dk_m, dv_m = (torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (k_m, v_m))
            backward_calls(
                fl[r]["dout"], fl[r]["q"], k_m, v_m, outs[r], lses[r], [call], scale, name, grads=(dq, dk_m, dv_m)
            )
            send_rows = plans[src].exchanges[step - 1].send_rows  # the dK/dV go home
            _add_rows(grads[src][1], send_rows, dk_m)
            _add_rows(grads[src][2], send_rows, dv_m)
        backward_calls(
            fl[r]["dout"],
            fl[r]["q"],
            fl[r]["k"],
            fl[r]["v"],
            outs[r],
            lses[r],
            plans[r].local_calls,
            scale,
            name,
            grads=grads[r],
        )
    shape = lambda r, t: t.view(local[r]["q"].shape[0], -1, *t.shape[2:])  # noqa: E731
    return (
        [shape(r, outs[r]) for r in range(world)],
        *([shape(r, grads[r][i]) for r in range(world)] for i in range(3)),
    )


def _zigzag_inverse(S, world, device=DEV):
    order = torch.cat(
        [
            shard_sequence(torch.arange(S).view(1, S), 1, rank=r, world_size=world, layout="zigzag")[0]
            for r in range(world)
        ]
    )
    return torch.argsort(order).to(device)


def rank_blocks(q, k, v, dout, world, rank, backend):
    """One callable per ring step: forward + backward of the block ``rank`` computes at that
    step of a ``world``-rank plain (no documents) zigzag ring; a no-op for a skipped step."""
    s_local = q.shape[1] // world
    shards = [[shard_sequence(t, 1, rank=r, world_size=world, layout="zigzag") for t in (k, v)] for r in range(world)]
    q_r, dout_r = (shard_sequence(t, 1, rank=rank, world_size=world, layout="zigzag") for t in (q, dout))

    def make(step, blk):
        if blk is None:
            return lambda: None
        rows, cols, causal = blk
        k_s, v_s = shards[(rank - step) % world]
        qb, kb, vb, dob = q_r[:, rows], k_s[:, cols], v_s[:, cols], dout_r[:, rows]

        def run():
            out, lse = attention_forward(qb, kb, vb, causal=causal, backend=backend)
            attention_backward(dob, qb, kb, vb, out, lse, causal=causal, backend=backend)

        return run

    return [make(step, blk) for step, blk in enumerate(ring_blocks(rank, world, "zigzag", True, s_local))]


def section_ring(report):
    rows = report.setdefault("ring", [])
    S, Hq, Hkv, D = 4096, 8, 2, 128
    g = torch.Generator(device=DEV).manual_seed(11)
    q, dout = randn(1, S, Hq, D, gen=g), randn(1, S, Hq, D, gen=g)
    k, v = randn(1, S, Hkv, D, gen=g), randn(1, S, Hkv, D, gen=g)
    lengths = [300, 1200, 64, 1700, 500, 332]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(1, S).to(DEV)
    for with_docs in (False, True):
        docs = dict(q_document_ids=ids, k_document_ids=ids) if with_docs else {}
        ref = block(q.double(), k.double(), v.double(), dout.double(), True, "torch", **docs)
        want = (ref[0], ref[2], ref[3], ref[4])
        for world in (2, 4):
            row = dict(world=world, documents=with_docs, S=S, Hq=Hq, Hkv=Hkv, D=D)
            try:
                got = emulated_ring(*(t.bfloat16() for t in (q, k, v, dout)), ids if with_docs else None, world, "fa4")
                row["errs"] = {n: round(rel(a, b), 6) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
                row["ok"] = all(e < 2e-2 for e in row["errs"].values())
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500], tb=traceback.format_exc()[-3000:])
            rows.append(row)
            print(f"[ring] {row}", flush=True)
            save(report)
    # P=2 at 128K: each rank's blocks back to back (the ring at P=2 runs at its blocks' rate).
    S, H = 128 * K, 16
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, H, 128, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(4))
    timing = dict(S=S, H=H, D=128, world=2)
    for backend in ("cudnn", "fa4"):
        per_rank = []
        for r in range(2):
            blocks = rank_blocks(q, k, v, dout, 2, r, backend)
            run = lambda blocks=blocks: [b() for b in blocks]  # noqa: E731
            run()
            per_rank.append(round(bench_ms(run, budget_s=1.0), 2))
        timing[backend] = dict(rank_ms=per_rank, max_rank_ms=max(per_rank))
    timing["fa4_speedup"] = round(timing["cudnn"]["max_rank_ms"] / timing["fa4"]["max_rank_ms"], 3)
    report["ring_p2_128k"] = timing
    print(f"[ring] P=2 128K per-rank blocks: {timing}", flush=True)


# ------------------------------------------------------------------------------ speed

BLOCK_SHAPES = [  # (label, Sq, Sk, Hq, Hkv, D, causal)
    ("causal 64K 16/16 D128", 64 * K, 64 * K, 16, 16, 128, True),
    ("full 32Kx32K 16/16 D128", 32 * K, 32 * K, 16, 16, 128, False),
    ("causal 64K 32/8 D64", 64 * K, 64 * K, 32, 8, 64, True),
    ("full 32K 32/8 D64", 32 * K, 32 * K, 32, 8, 64, False),
    ("causal 64K 32/8 D128", 64 * K, 64 * K, 32, 8, 128, True),
    ("full 32K 32/8 D128", 32 * K, 32 * K, 32, 8, 128, False),
    ("causal 128K 16/16 D128", 128 * K, 128 * K, 16, 16, 128, True),
]


def time_block(backend, Sq, Sk, Hq, Hkv, D, causal):
    g = torch.Generator(device=DEV).manual_seed(Sq + D)
    q, dout = (torch.randn(1, Sq, Hq, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, Sk, Hkv, D, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))

    def step():
        out, lse = attention_forward(q, k, v, causal=causal, backend=backend)
        attention_backward(dout, q, k, v, out, lse, causal=causal, backend=backend)

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    return bench_ms(step, budget_s=1.0, min_reps=3, max_reps=20), first


def section_blocks(report, backends):
    rows = report.setdefault("blocks", [])
    for label, Sq, Sk, Hq, Hkv, D, causal in BLOCK_SHAPES:
        row = dict(shape=label, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, causal=causal)
        for backend in backends:
            try:
                row[backend], row[f"{backend}_first_call_s"] = time_block(backend, Sq, Sk, Hq, Hkv, D, causal)
                row[backend] = round(row[backend], 2)
                row[f"{backend}_first_call_s"] = round(row[f"{backend}_first_call_s"], 2)
            except Exception as e:  # noqa: BLE001
                row[f"{backend}_error"] = f"{type(e).__name__}: {e}"[:500]
            torch.cuda.empty_cache()
        if "fa4" in row and "cudnn" in row:
            row["fa4_vs_cudnn"] = round(row["cudnn"] / row["fa4"], 3)
        if "fa4" in row and "triton" in row:
            row["fa4_vs_triton"] = round(row["triton"] / row["fa4"], 3)
        rows.append(row)
        print(f"[blocks] {row}", flush=True)
        save(report)


def section_select(report, backends):
    rows = report.setdefault("select", [])
    for S in (1 * K, 4 * K, 16 * K):
        for D in (64, 128):
            for causal in (True, False):
                row = dict(S=S, D=D, H=16, causal=causal, ms={})
                for backend in backends:
                    try:
                        row["ms"][backend] = round(time_block(backend, S, S, 16, 16, D, causal)[0], 3)
                    except Exception as e:  # noqa: BLE001
                        row.setdefault("errors", {})[backend] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(f"[select] {row}", flush=True)
                save(report)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["check", "ring", "blocks", "select"])
    parser.add_argument("--backends", nargs="+", default=["cudnn", "triton", "fa4"])
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"fa4_blocks_{gpu_tag()}{args.tag}.json")
    import flash_attn.cute  # noqa: F401 - fail here, loudly, if FA4 is missing

    report = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        capability=torch.cuda.get_device_capability(),
        date=time.strftime("%Y-%m-%d"),
        fa4_cache=os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"),
        dtype="bfloat16",
        timing="CUDA-event median of fwd+bwd through attention_forward/backward, after a first call",
    )

    def write(report):
        report["compile"] = {" ".join(map(str, k)): round(v, 2) for k, v in fa4.compile_seconds.items()}
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)

    _SAVE.append(write)
    sections = dict(
        check=lambda: section_check(report),
        ring=lambda: section_ring(report),
        blocks=lambda: section_blocks(report, args.backends),
        select=lambda: section_select(report, args.backends),
    )
    for name in args.sections:
        t0 = time.time()
        try:
            sections[name]()
        except Exception:  # noqa: BLE001 - keep the other sections
            report.setdefault("section_errors", {})[name] = traceback.format_exc()[-4000:]
            print(traceback.format_exc(), flush=True)
        report.setdefault("section_s", {})[name] = round(time.time() - t0, 1)
        write(report)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
