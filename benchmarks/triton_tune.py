"""Tile-config sweep of the Triton attention kernels at the ring's block shapes (one GPU).

Run: python benchmarks/triton_tune.py [--head-dims 128,64] [--seqs 16384,8192] [--out DIR]

Why: the kernels autotune over a short, hand-picked list per head_dim (compile time of
every candidate is paid at first use). This measures each candidate *alone* and a wider
set of candidates, so that the shipped lists can be chosen from numbers on the target GPU
instead of from compile-time register counts.

How: for each kernel (forward, dK/dV, dQ), head_dim, causal (diagonal ring block) and full
(off-diagonal block), the kernel's autotune list is replaced by one config, its cache
cleared, and the public `forward` / `backward` timed with triton.testing.do_bench. The
backward rows vary one kernel and pin the other to its shipped first config, so a row's
difference to the next is that kernel's difference (delta is precomputed: not timed).
Every config's output is checked against the shipped config's (bf16, rel. error < 1e-2)
so that a fast wrong config cannot win. Compiles run first in parallel worker processes
(they fill Triton's on-disk cache); the timing pass then runs alone on the GPU.

Results: $OUT/triton_tune_<gpu>.json (default benchmarks/results/): per row ms and TFLOP/s,
and per (kernel, head_dim, causal, seq) the shipped list's best and the sweep's best.
FLOPs: forward 4*S^2*H*D (x0.5 causal), backward 2.5x forward.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

CANDIDATES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages); superset of the shipped lists
    "fwd": {
        128: [
            (128, 64, 8, 3),
            (128, 128, 8, 2),
            (128, 64, 8, 4),
            (64, 64, 4, 3),
            (128, 128, 8, 3),
            (128, 64, 4, 3),
            (128, 32, 4, 4),
            (64, 128, 4, 3),
        ],
        64: [
            (128, 64, 4, 3),
            (128, 128, 8, 3),
            (64, 64, 4, 4),
            (128, 64, 4, 4),
            (128, 128, 4, 3),
            (128, 32, 4, 4),
            (64, 128, 4, 3),
            (128, 64, 8, 3),
        ],
    },
    "dkdv": {
        128: [
            (32, 128, 8, 3),
            (32, 128, 8, 2),
            (64, 128, 8, 2),
            (32, 64, 4, 3),
            (32, 128, 4, 3),
            (32, 128, 4, 4),
            (32, 128, 4, 5),
            (64, 128, 8, 3),
            (16, 128, 4, 4),
            (64, 64, 4, 3),
        ],
        64: [
            (64, 128, 8, 3),
            (32, 128, 8, 3),
            (64, 64, 4, 3),
            (32, 64, 4, 4),
            (32, 128, 4, 4),
            (64, 128, 4, 3),
            (128, 128, 8, 2),
            (32, 128, 4, 5),
        ],
    },
    "dq": {
        128: [
            (128, 64, 8, 2),
            (128, 32, 8, 3),
            (64, 64, 4, 2),
            (64, 32, 4, 3),
            (128, 32, 4, 3),
            (128, 32, 4, 4),
            (128, 32, 4, 5),
            (128, 64, 8, 3),
            (64, 32, 4, 4),
            (128, 64, 4, 3),
        ],
        64: [
            (128, 64, 8, 3),
            (128, 32, 4, 3),
            (64, 64, 4, 3),
            (64, 32, 4, 4),
            (128, 64, 4, 3),
            (128, 32, 4, 5),
            (128, 128, 8, 2),
            (128, 64, 8, 2),
        ],
    },
}


def _tables(ta):
    from longctx.kernels import triton_tiles as tt

    return {"fwd": tt.FWD_CONFIGS, "dkdv": tt.DKDV_CONFIGS, "dq": tt.DQ_CONFIGS}


def _kernels(ta):
    return [ta.fwd_kernel, ta.dkdv_split, ta.dq_tuned]


def _cfg_tuple(c):
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)


def _pin(ta, shipped, kernel, d, cfg):
    """Every table back to its shipped list, then `kernel`'s list = [cfg], the other
    backward kernel pinned to its shipped first config; caches cleared."""
    from longctx.kernels.triton_tiles import tile_config

    tables = _tables(ta)
    for name, table in tables.items():
        table[d] = list(shipped[name][d])
    if kernel != "fwd":
        other = "dq" if kernel == "dkdv" else "dkdv"
        tables[other][d] = [shipped[other][d][0]]
    if cfg is not None:
        tables[kernel][d] = [tile_config(*cfg)]
    for k in _kernels(ta):
        k.cache.clear()


def _inputs(s, h, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda: torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return mk(), mk(), mk(), mk()


def _run(ta, kernel, q, k, v, dout, causal, scale, state):
    if kernel == "fwd":
        return ta.forward(q, k, v, causal, scale)[0]
    return torch.cat(
        [t.flatten() for t in ta.backward(dout, q, k, v, None, state["lse"], causal, scale, delta=state["delta"])]
    )


def _forward_state(ta, shipped, q, k, v, dout, causal, scale, d):
    """lse and delta for the backward rows, from the shipped first forward config (no
    autotuning: it would rerun at every cache clear)."""
    _pin(ta, shipped, "fwd", d, _cfg_tuple(shipped["fwd"][d][0]))
    out, lse = ta.forward(q, k, v, causal, scale)
    return {"lse": lse, "delta": ta.compute_delta(out, dout)}


def _jobs(head_dims, seqs):
    for d in head_dims:
        for kernel, by_d in CANDIDATES.items():
            for cfg in by_d[d]:
                for causal in (True, False):
                    for s in seqs:
                        yield kernel, d, cfg, causal, s


def _compile_worker(args):
    """Runs a share of the jobs once each: fills Triton's disk cache (timings discarded)."""
    jobs, heads = args
    from longctx.kernels import triton_attention as ta

    shipped = {n: {b: list(c) for b, c in t.items()} for n, t in _tables(ta).items()}
    errors = []
    for kernel, d, cfg, causal, s in jobs:
        q, k, v, dout = _inputs(s, heads, d, 0)
        scale = d**-0.5
        try:
            state = _forward_state(ta, shipped, q, k, v, dout, causal, scale, d)
            _pin(ta, shipped, kernel, d, cfg)
            _run(ta, kernel, q, k, v, dout, causal, scale, state)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, the timing pass marks it failed
            errors.append(f"{kernel} d={d} {cfg} causal={causal}: {type(e).__name__}: {e}"[:300])
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--seqs", default="16384,8192", help="block lengths (Sq = Sk)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--workers", type=int, default=8, help="parallel compile processes")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args()
    head_dims = [int(x) for x in a.head_dims.split(",")]
    seqs = [int(x) for x in a.seqs.split(",")]
    t0 = time.time()

    jobs = list(_jobs(head_dims, seqs))
    compile_errors = []
    if a.workers > 1:
        import multiprocessing as mp

        shares = [(jobs[i :: a.workers], a.heads) for i in range(a.workers)]
        with mp.get_context("spawn").Pool(a.workers) as pool:
            for errs in pool.map(_compile_worker, shares):
                compile_errors += errs
    t_compile = time.time() - t0
    print(f"compiled {len(jobs)} variants in {t_compile:.0f}s, {len(compile_errors)} errors", flush=True)

    import triton.testing

    from longctx.kernels import triton_attention as ta

    shipped = {n: {b: list(c) for b, c in t.items()} for n, t in _tables(ta).items()}
    rows, best = [], {}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"triton_tune_{torch.cuda.get_device_name().split()[-1].lower()}.json")

    def save():
        res = dict(
            gpu=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=__import__("triton").__version__,
            date=time.strftime("%Y-%m-%d"),
            heads=a.heads,
            batch=1,
            dtype="bfloat16",
            compile_s=round(t_compile, 1),
            compile_errors=compile_errors,
            elapsed_s=round(time.time() - t0, 1),
            best=best,
            rows=rows,
        )
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        return path

    for d in head_dims:
        for s in seqs:
            for causal in (True, False):
                q, k, v, dout = _inputs(s, a.heads, d, 1)
                scale = d**-0.5
                state = _forward_state(ta, shipped, q, k, v, dout, causal, scale, d)
                fwd_flops = 4 * s * s * a.heads * d * (0.5 if causal else 1.0)
                for kernel in ("fwd", "dkdv", "dq"):
                    _pin(ta, shipped, kernel, d, None)
                    ref = _run(ta, kernel, q, k, v, dout, causal, scale, state).float()
                    flops = fwd_flops * (1.0 if kernel == "fwd" else 2.5)
                    shipped_set = {_cfg_tuple(c) for c in shipped[kernel][d]}
                    group_rows = []
                    for cfg in CANDIDATES[kernel][d]:
                        row = dict(kernel=kernel, D=d, S=s, causal=causal, config=list(cfg), shipped=cfg in shipped_set)
                        try:
                            _pin(ta, shipped, kernel, d, cfg)
                            res = _run(ta, kernel, q, k, v, dout, causal, scale, state).float()
                            err = ((res - ref).norm() / ref.norm()).item()
                            ms = triton.testing.do_bench(
                                lambda: _run(ta, kernel, q, k, v, dout, causal, scale, state), warmup=10, rep=50
                            )
                            row.update(
                                ms=round(ms, 4),
                                tflops=round(flops / ms / 1e9, 1),
                                rel_err_vs_shipped=float(f"{err:.2e}"),
                                ok=bool(err < 1e-2 and torch.isfinite(res).all().item()),
                            )
                        except Exception as e:  # noqa: BLE001
                            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
                        rows.append(row)
                        group_rows.append(row)
                        print(json.dumps(row), flush=True)
                    good = [r for r in group_rows if r.get("ok")]
                    if good:
                        b_all = min(good, key=lambda r: r["ms"])
                        b_shipped = min((r for r in good if r["shipped"]), key=lambda r: r["ms"], default=None)
                        best[f"{kernel}_D{d}_S{s}_{'causal' if causal else 'full'}"] = dict(
                            sweep_best=b_all["config"],
                            sweep_ms=b_all["ms"],
                            shipped_best=b_shipped and b_shipped["config"],
                            shipped_ms=b_shipped and b_shipped["ms"],
                            gain=b_shipped and round(b_shipped["ms"] / b_all["ms"], 3),
                        )
                    save()  # after every group: a run cut short keeps what it measured
    for name in ("fwd", "dkdv", "dq"):  # leave the module as it was
        _tables(ta)[name].update(shipped[name])
    print(json.dumps(best, indent=1))
    print(f"wrote {save()} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
