"""Where a document layer call's host time goes, on one GPU (issue 40: short documents at P = 4
are host-bound).

    python benchmarks/document_host_cost.py --out DIR        # FlashAttention-4 installed

For each mix and share (a rank's part of a 131,072-token sequence at P = share: the mix's first
S / share tokens, H = 16, D = 128, bf16, plan prebuilt), the layer's forward+backward through
``ring_attention`` with the ``fa4`` backend, and as peers FlashAttention-4's own autograd
function (``flash_attn_varlen_func``) and its bare interface calls on the same segments:

* ``host_ms``: the host's time to issue one iteration while the GPU is kept busy ahead of it
  (``torch.cuda._sleep``), so the host never waits for the device;
* ``gpu_ms``: CUDA events over the same iterations (the kernels back to back);
* ``inside_ms``: for our layer, the host time spent inside each FlashAttention-4 interface
  function and each of longctx's kernel launchers (wrapped with a clock), the rest being
  longctx's Python and autograd.

Beside them: the bare calls inside a minimal autograd function (``in_function``: what the engine
adds), the same runs with the engine's backward on the calling thread (``*_one_thread``:
``torch.autograd.set_multithreading_enabled(False)``), and ``ours_4_layers``: four layers
chained through q in one backward, each with its own K/V, per layer (a model pays the engine's
per-backward cost once, not per layer as a one-layer loop does; ``document_attention.py
--layers``'s harness).

Writes DIR/document_host_cost.json and a cProfile (cumulative) of our layer.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from document_attention import layer_kvs, stacked_step  # noqa: E402
from document_layer_profile import host_profile  # noqa: E402

from longctx import ring_attention  # noqa: E402
from longctx.data.document_mixes import document_ids, document_lengths  # noqa: E402
from longctx.documents import plan_documents  # noqa: E402
from longctx.kernels.fa4 import _JIT_FUNCTIONS as FA4_ENTRY_POINTS  # noqa: E402

LAYERS = 4  # layers per backward call in the stacked timing
BUSY_CYCLES = int(3e9)  # ~1.5 s of GPU time queued ahead of the timed iterations


def timed(fn, reps: int):
    """(host ms, GPU ms) per call of ``fn`` over ``reps`` calls issued behind a busy GPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - start) * 1e3 / reps
    end.record()
    torch.cuda.synchronize()
    return host, begin.elapsed_time(end) / reps


class Clock:
    """Wraps module attributes with an inclusive host clock (nested wrapped calls counted once,
    in the outermost)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.depth = 0
        self.undo = []

    def wrap(self, module, name, label):
        original = getattr(module, name)

        @functools.wraps(original)  # FA4 reads attributes of its own functions (compile caches)
        def clocked(*args, **kwargs):
            outer = self.depth == 0
            self.depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1
                if outer:
                    self.total[label] += time.perf_counter() - start
                    self.calls[label] += 1

        setattr(module, name, clocked)
        self.undo.append((module, name, original))

    def restore(self):
        for module, name, original in reversed(self.undo):
            setattr(module, name, original)


def segments_of(ids: torch.Tensor):
    """cu_seqlens (int32, device) and the longest run of the runs of equal ids."""
    lengths = torch.unique_consecutive(ids, return_counts=True)[1]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return cu, int(lengths.max())


class _Nothing(torch.autograd.Function):
    """An autograd function that does nothing: the engine's own cost per forward+backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def pieces(q, k, reps: int) -> dict:
    """Host ms of single pieces of a layer call, on the layer's shapes."""
    from longctx.kernels import resolve_backend
    from longctx.kernels.rows import mark_nonfinite_rows_

    B, S, H, D = q.shape
    out = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(B, H, S, device="cuda")
    x = torch.randn(B, S, H, D, device="cuda", requires_grad=True)
    grad = torch.randn_like(x)

    def nothing():
        x.grad = None
        _Nothing.apply(x).backward(grad)

    found = {}
    for name, fn in (
        ("mark_rows_triton", lambda: mark_nonfinite_rows_(out, lse, None, impl="triton")),
        ("mark_rows_torch", lambda: mark_nonfinite_rows_(out, lse, None, impl="torch")),
        ("resolve_backend", lambda: resolve_backend("fa4", q, k, True, documents=True)),
        ("empty_autograd_fn", nothing),
        ("torch_empty", lambda: torch.empty(1024, device="cuda")),
        ("torch_add", lambda: lse.add_(0.0)),
    ):
        for _ in range(3):
            fn()
        found[name] = round(timed(fn, reps)[0], 4)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--mixes", nargs="+", default=["docs256", "mean1k"])
    parser.add_argument("--shares", nargs="+", type=int, default=[4, 1])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    from flash_attn.cute import interface as iface

    H, D = 16, 128
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, H=H, D=D, rows=[])
    profiles = []
    for mix in args.mixes:
        full = document_ids(document_lengths(mix, args.seq, seed=0), device="cuda")
        for share in args.shares:
            S = args.seq // share
            ids = full[:S][None]
            plan = plan_documents(ids, world_size=1, rank=0)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout = (
                torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(i < 3)
                for i in range(4)
            )

            def ours():
                q.grad = k.grad = v.grad = None
                out = ring_attention(q, k, v, causal=True, document_ids=plan, backend="fa4")
                out.backward(dout)

            def ours_forward():
                with torch.no_grad():
                    ring_attention(q, k, v, causal=True, document_ids=plan, backend="fa4")

            cu, longest = segments_of(ids[0])
            flat = [t.detach()[0].requires_grad_(t.requires_grad) for t in (q, k, v)]

            def upstream():
                for t in flat:
                    t.grad = None
                out = iface.flash_attn_varlen_func(
                    *flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True
                )
                out = out[0] if isinstance(out, tuple) else out
                out.backward(dout[0])

            qf, kf, vf = (t.detach()[0] for t in (q, k, v))
            varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
            scale = D**-0.5

            def bare():
                fwd = iface._flash_attn_fwd(qf, kf, vf, softmax_scale=scale, causal=True, return_lse=True, **varlen)
                out, lse = fwd[:2]
                iface._flash_attn_bwd(qf, kf, vf, out, dout[0], lse, scale, True, **varlen)

            def bare_forward():
                iface._flash_attn_fwd(qf, kf, vf, softmax_scale=scale, causal=True, return_lse=True, **varlen)

            saved = iface._flash_attn_fwd(qf, kf, vf, softmax_scale=scale, causal=True, return_lse=True, **varlen)[:2]

            def bare_backward():
                iface._flash_attn_bwd(qf, kf, vf, saved[0], dout[0], saved[1], scale, True, **varlen)

            class InFunction(torch.autograd.Function):
                """The bare calls inside an autograd function: what the engine adds to them."""

                @staticmethod
                def forward(ctx, q_, k_, v_):
                    out, lse = iface._flash_attn_fwd(
                        q_, k_, v_, softmax_scale=scale, causal=True, return_lse=True, **varlen
                    )[:2]
                    ctx.save_for_backward(q_, k_, v_, out, lse)
                    return out

                @staticmethod
                def backward(ctx, grad):
                    q_, k_, v_, out, lse = ctx.saved_tensors
                    return iface._flash_attn_bwd(q_, k_, v_, out, grad.contiguous(), lse, scale, True, **varlen)[:3]

            def in_function():
                for t in flat:
                    t.grad = None
                InFunction.apply(*flat).backward(dout[0])

            def one_thread(fn):
                # The engine runs the backward on the calling thread instead of its device thread.
                def run():
                    with torch.autograd.set_multithreading_enabled(False):
                        fn()

                return run

            row = dict(mix=mix, share=share, tokens=S, segments=int(cu.numel() - 1), calls=plan.calls)
            for name, fn in (
                ("ours", ours),
                ("ours_forward", ours_forward),
                ("upstream", upstream),
                ("bare", bare),
                ("bare_forward", bare_forward),
                ("bare_backward", bare_backward),
                ("in_function", in_function),
                ("ours_one_thread", one_thread(ours)),
                ("upstream_one_thread", one_thread(upstream)),
                ("in_function_one_thread", one_thread(in_function)),
                (  # LAYERS layers in one backward, as in a model: the engine's cost per backward once
                    f"ours_{LAYERS}_layers",
                    stacked_step(
                        q,
                        layer_kvs(k, v, LAYERS),
                        dout,
                        lambda x, k_, v_: ring_attention(x, k_, v_, causal=True, document_ids=plan, backend="fa4"),
                    ),
                ),
            ):
                for _ in range(3):
                    fn()
                host, gpu = timed(fn, args.reps)
                per = LAYERS if name.endswith("_layers") else 1  # per layer
                row[name] = dict(host_ms=round(host / per, 4), gpu_ms=round(gpu / per, 4))
            clock = Clock()
            for fname in FA4_ENTRY_POINTS:  # the interface functions that dispatch FA4's kernels
                clock.wrap(iface, fname, f"fa4.{fname}")
            # longctx's launchers, wherever a module imported them by name
            launchers = ("mark_nonfinite_rows_", "sum_rows_", "add_rows_", "merge_partials_")
            for module in [m for name, m in sys.modules.items() if name.startswith("longctx") and m is not None]:
                for fname in launchers:
                    if hasattr(module, fname):
                        clock.wrap(module, fname, f"longctx.{fname}")
            host, _ = timed(ours, args.reps)
            clock.restore()
            row["ours"]["host_clocked_ms"] = round(host, 4)
            row["ours"]["inside_ms"] = {
                label: round(total * 1e3 / args.reps, 4) for label, total in sorted(clock.total.items())
            }
            row["ours"]["inside_calls"] = {label: n / args.reps for label, n in sorted(clock.calls.items())}
            text = host_profile(ours, args.reps, "cumulative", 70)
            profiles.append(f"==== {mix} share {share}: cProfile of ours, {args.reps} iterations\n{text}")
            if not report.get("pieces"):
                report["pieces"] = pieces(q, k, args.reps)
                print(json.dumps(report["pieces"]), flush=True)
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "document_host_cost.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "document_host_cost_cprofile.txt"), "w") as f:
        f.write("\n".join(profiles))


if __name__ == "__main__":
    main()
