"""Host time of one document-masked attention layer with FlashAttention-4, layer by layer.

    python benchmarks/fa4_host_overhead.py --out DIR        # one GPU, FA4 installed

Times, on the host only (no sync inside the timed loop; the GPU work is small enough that
the launch queue never fills), one forward and one forward+backward of a rank's shard at
each level of our stack, from FA4's own entry points up to ``ring_attention`` with a
prebuilt plan, and the GPU time of the same (CUDA events). Where host time exceeds GPU
time the layer is launch-bound. Then cProfile of the full layer (our functions and FA4's)
by own time. Writes DIR/fa4_host_overhead.json and DIR/fa4_host_profile.txt.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from longctx import ring_attention  # noqa: E402
from longctx.data.document_mixes import document_ids, document_lengths  # noqa: E402
from longctx.documents import plan_documents  # noqa: E402
from longctx.kernels import attention_backward, attention_forward, fa4  # noqa: E402


def host_and_gpu_us(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - start) / reps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / reps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return dict(host_us=host * 1e6, wall_us=wall * 1e6, events_us=begin.elapsed_time(end) * 1e3 / reps)


def measure(S, H, D, mix, seed=0):
    dev = torch.device("cuda")
    lengths = document_lengths(mix, S, seed=seed)
    ids = document_ids(lengths, device=dev)[None]
    plan = plan_documents(ids, world_size=1, rank=0)
    call = plan.local_calls[0]
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, dout = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    scale = D**-0.5
    iface = fa4._interface()
    seg = call.segments
    flat = lambda t: t.reshape(S, H, D)  # noqa: E731
    out, lse = fa4.forward_segments(q, k, v, True, scale, None, seg)
    lse_flat = lse.transpose(0, 1).reshape(H, S).contiguous()
    rows = {}

    rows["fa4_bare_fwd"] = host_and_gpu_us(
        lambda: iface._flash_attn_fwd(
            flat(q), flat(k), flat(v), softmax_scale=scale, causal=True, return_lse=True, **seg.kernel_args()
        )
    )
    rows["fa4_bare_bwd"] = host_and_gpu_us(
        lambda: iface._flash_attn_bwd(
            flat(q), flat(k), flat(v), flat(out), flat(dout), lse_flat, scale, True, **seg.kernel_args()
        )
    )
    rows["ours_forward_segments"] = host_and_gpu_us(lambda: fa4.forward_segments(q, k, v, True, scale, None, seg))
    rows["ours_backward_segments"] = host_and_gpu_us(
        lambda: fa4.backward_segments(dout, q, k, v, out, lse, True, scale, None, seg)
    )
    kw = dict(causal=True, backend="fa4", q_document_ids=call.q_ids, k_document_ids=call.k_ids, segments=seg)
    rows["ours_attention_forward"] = host_and_gpu_us(lambda: attention_forward(q, k, v, **kw))
    rows["ours_attention_backward"] = host_and_gpu_us(lambda: attention_backward(dout, q, k, v, out, lse, **kw))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    rows["ours_layer_fwd"] = host_and_gpu_us(lambda: ring_attention(qg, kg, vg, backend="fa4", document_ids=plan))

    def layer_step():
        qg.grad = kg.grad = vg.grad = None
        ring_attention(qg, kg, vg, backend="fa4", document_ids=plan).backward(dout)

    rows["ours_layer_fwd_bwd"] = host_and_gpu_us(layer_step)
    try:
        from flash_attn.cute import flash_attn_varlen_func

        def upstream_step():
            qg.grad = kg.grad = vg.grad = None
            o = flash_attn_varlen_func(flat(qg), flat(kg), flat(vg), causal=True, **seg.kernel_args())
            o = o[0] if isinstance(o, tuple) else o
            o.backward(flat(dout))

        rows["upstream_varlen_func_fwd_bwd"] = host_and_gpu_us(upstream_step)
    except Exception as e:  # noqa: BLE001 - recorded; the rest stands
        rows["upstream_varlen_func_fwd_bwd"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    profile.enable()
    for _ in range(30):
        layer_step()
    profile.disable()
    torch.cuda.synchronize()
    return dict(S=S, H=H, D=D, mix=mix, documents=len(lengths), calls=plan.calls, rows=rows), profile


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--mixes", nargs="+", default=["mean1k", "mean16k"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cases=[])
    text = io.StringIO()
    for mix in args.mixes:
        case, profile = measure(args.seq, 16, 128, mix)
        report["cases"].append(case)
        print(json.dumps(case, indent=1), flush=True)
        text.write(f"==== {mix}, S={args.seq}: 30 x layer forward+backward\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(40)
    with open(os.path.join(args.out, "fa4_host_overhead.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "fa4_host_profile.txt"), "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
