"""Two GPUs over NCCL, where a CPU cannot show it: ring, Ulysses and the document-masked
exchange (plain ids and the step's DocumentPlan, packed and balanced) in bf16 against the
float64 reference with the explicit mask (not yet run on GPUs: written after this session's
device time was spent)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from helpers.dist_harness import run_distributed
from helpers.run_if import requires_cuda
from test_ring_attention import run_case

from longctx import balance_documents, ring_attention, ulysses_attention
from longctx.data.document_mixes import document_ids, document_lengths

pytestmark = requires_cuda(min_gpus=2)

BF16_TOL = 2e-2


def _cases_vs_float64(rank, world, seed):
    device = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(seed)  # the same full tensors on both ranks
    S, H, HKV, D = 4096, 8, 2, 64
    full = {name: torch.randn(1, S, h, D, generator=g) for name, h in (("q", H), ("k", HKV), ("v", HKV), ("dout", H))}
    ids = document_ids(document_lengths("longtail", S, seed))[None]
    balanced = balance_documents({**full, "document_ids": ids}, world_size=world)
    errors = []
    for name, attention, tensors, docs, plan in (
        ("ring", ring_attention, full, None, False),
        ("ulysses", ulysses_attention, full, None, False),
        ("ring ids", ring_attention, full, ids, False),
        ("ring plan", ring_attention, full, ids, True),
        ("ring plan balanced", ring_attention, balanced, balanced["document_ids"], True),
        ("ulysses plan", ulysses_attention, full, ids, True),
    ):
        q, k, v, dout = (tensors[n].to(device, torch.bfloat16) for n in ("q", "k", "v", "dout"))
        docs = None if docs is None else docs.to(device)
        for what, err in run_case(
            attention, dist.group.WORLD, rank, world, "zigzag", True, q, k, v, dout, documents=docs, plan=plan
        ):
            errors.append((name, what, err))
    return errors


def test_attention_over_nccl_matches_float64():
    seed = random.randrange(1 << 30)
    errors = run_distributed(_cases_vs_float64, 2, seed, backend="nccl")[0]
    bad = [f"{name} {what}: {err:.2e}" for name, what, err in errors if not err < BF16_TOL]
    assert len(errors) == 6 * 4 and not bad, f"seed={seed}:\n" + "\n".join(bad)
