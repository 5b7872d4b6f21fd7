"""How far FP8 training's losses depart from bf16's, beside bf16 runs whose gradients carry a
small random perturbation: what a per-step loss comparison over the first steps can tell.

    python benchmarks/float8_departure.py --out benchmarks/results/float8_departure_cpu.json

CPU only (torchao installed: ``pip install 'longctx[float8]'``; torch's CPU ``_scaled_mm`` runs
the FP8 matmuls): a 4-layer GPT (n_embd 256, byte vocabulary) on Python standard-library source,
8 x 256 tokens a step, AdamW (lr 3e-3, betas 0.9/0.95), gradient clipping 1.0, bf16 autocast,
the same batches in every run. For a short warmup (2 steps, as the 8B benchmark configs) and a
longer one (20): bf16, bf16 again (CPU kernels are deterministic: the repeat is bit-exact), FP8
(``longctx.float8.convert_to_float8``), and bf16 with every gradient element multiplied by
(1 + s * N(0, 1)) for s = 3% and 0.3%. Writes each run's losses and the largest departure from
the bf16 run over steps 0-9, 10-19 and 20 on.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from longctx.float8 import convert_to_float8  # noqa: E402
from longctx.models import GPT, GPTConfig  # noqa: E402

SEQ, BATCH = 256, 8
CONFIG = dict(preset="tiny", vocab_size=256, n_layer=4, n_embd=256, n_head=4, n_kv_head=4, head_dim=64)
RUNS = (("bf16", False, 0.0), ("bf16_repeat", False, 0.0), ("fp8", True, 0.0))
NOISES = (0.03, 0.003)


def corpus() -> torch.Tensor:
    stdlib = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(stdlib, "json", "*.py")) + glob.glob(os.path.join(stdlib, "email", "*.py")))
    return torch.tensor(list(b"".join(open(f, "rb").read() for f in files)), dtype=torch.long)


def batch(data: torch.Tensor, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
    x = torch.stack([data[s : s + SEQ + 1] for s in starts])
    return x[:, :-1], x[:, 1:]


def train(data, steps: int, warmup: int, fp8: bool, noise: float, lr: float = 3e-3) -> list:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_dict(CONFIG))
    if fp8:
        convert_to_float8(model, fsdp_all_gather=False, compile_linears=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(77)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        x, y = batch(data, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, n = model.loss(x, y)
        loss = total / n
        loss.backward()
        for p in model.parameters() if noise else ():
            p.grad.mul_(1 + noise * torch.randn(p.grad.shape, generator=g))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="float8_departure_cpu.json")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    data = corpus()
    report = dict(config=CONFIG, seq=SEQ, batch=BATCH, steps=args.steps, runs={}, departure={})
    for warmup in (2, 20):
        runs = [*RUNS, *((f"bf16_noise{s:g}", False, s) for s in NOISES)]
        base = None
        for name, fp8, noise in runs:
            losses = train(data, args.steps, warmup, fp8, noise)
            base = base or losses
            key = f"warmup{warmup}_{name}"
            report["runs"][key] = losses
            gaps = [abs(a - b) for a, b in zip(losses, base)]
            report["departure"][key] = dict(
                steps_0_9=max(gaps[:10]), steps_10_19=max(gaps[10:20]), steps_20_on=max(gaps[20:], default=0.0)
            )
            print(key, {k: round(v, 3) for k, v in report["departure"][key].items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
