"""Document-masked ring attention at P = 8 over gloo: exact against the float64 reference.

One spawned group of 8 processes (spawning and importing torch is most of the time) runs
every case in float64 through the ``"torch"`` backend, causal, and compares the gathered out,
dq, dk, dv with the explicit-mask reference (``tests/attention_reference.py``):

* the document layouts of ``tests/ring/test_ring_documents.py`` (random short documents, documents
  crossing every shard boundary, one-token documents, ids reused far apart, documents ending
  on shard boundaries, one document over every rank), zigzag and contiguous, with plain ids
  (planned per call) and with the step's ``DocumentPlan`` (then in two head chunks where the
  K/V heads allow);
* balanced sequences (``balance_documents``: documents placed whole, cut head-tail, poured;
  zigzag only), whose results, un-permuted, equal the reference on the sequence as packed;
* a NaN in one V row shows in every query of its document that sees it, both layouts.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from helpers.attention_reference import reference
from helpers.dist_harness import run_distributed
from test_balance import random_ids
from test_ring_attention import rel_err, run_case
from test_ring_documents import CHUNK, HEADS, PATTERNS, document_ids

from longctx import balance_documents, ring_attention, shard_sequence, unshard_sequence
from longctx.documents import plan_documents

WORLD = 8
LAYOUTS = ("zigzag", "contiguous")
BALANCED_SEQ = 2 * WORLD * 64  # chunks of 64: documents of 20-300 tokens are placed, cut or poured
TOLERANCE = 1e-10


def _attend(q, k, v, dout, ids, layout, plan, rank, **kwargs):
    """Shard full inputs, run the document ring in float64 ("torch"), gather out and grads."""
    shard = lambda t: shard_sequence(t, 1, rank=rank, world_size=WORLD, layout=layout)  # noqa: E731
    ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
    docs = plan_documents(ids, world_size=WORLD, rank=rank, layout=layout) if plan else shard(ids)
    out = ring_attention(
        ql, kl, vl, group=dist.group.WORLD, layout=layout, document_ids=docs, backend="torch", **kwargs
    )
    out.backward(shard(dout))
    return [
        unshard_sequence(t.detach(), 1, group=dist.group.WORLD, layout=layout) for t in (out, ql.grad, kl.grad, vl.grad)
    ]


def _inputs(batch, seq, hq, hkv, g):
    return [torch.randn(batch, seq, h, 8, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _all_cases(rank, world, seed):
    assert world == WORLD
    errors, nan_rows = [], []
    # The document layouts of the P = 2-4 tests, both layouts, ids and plan.
    for i, (layout, pattern) in enumerate((lo, p) for lo in LAYOUTS for p in PATTERNS):
        g = torch.Generator().manual_seed(seed + i)  # the same full tensors on every rank
        seq = CHUNK * WORLD * (2 if layout == "zigzag" else 1)
        hq, hkv = HEADS[i % len(HEADS)]
        q, k, v, dout = _inputs(2, seq, hq, hkv, g)
        ids = document_ids(pattern, 2, seq, g)
        for plan in (False, True):
            extra = {"head_chunks": 2} if plan and hkv % 2 == 0 else {}
            case = (layout, pattern, hq, hkv, "plan" if plan else "ids")
            got = run_case(
                ring_attention, dist.group.WORLD, rank, WORLD, layout, True, q, k, v, dout,
                documents=ids, plan=plan, backend="torch", **extra,
            )  # fmt: skip
            errors += [(case, name, err) for name, err in got]
    # Balanced sequences: the results, put back in packed order, against the packed reference.
    g = torch.Generator().manual_seed(seed + 100)
    ids = torch.stack([random_ids("runs", BALANCED_SEQ, g), random_ids("repeated", BALANCED_SEQ, g)])
    q, k, v, dout = _inputs(2, BALANCED_SEQ, 4, 2, g)
    index = torch.arange(BALANCED_SEQ).expand(2, BALANCED_SEQ)
    batch = balance_documents(dict(document_ids=ids, q=q, k=k, v=v, dout=dout, index=index), world_size=WORLD)
    inverse = batch["index"].argsort(1)
    moved = not torch.equal(inverse, index)
    want = None
    if rank == 0:
        ref = reference(q, k, v, dout, True, 8**-0.5, ids)
        want = [ref[0], *ref[2:]]
    for plan in (False, True):
        got = _attend(*(batch[key] for key in ("q", "k", "v", "dout", "document_ids")), "zigzag", plan, rank)
        if rank == 0:
            got = [torch.stack([t[b, inverse[b]] for b in range(2)]) for t in got]
            case = ("zigzag", "balanced", 4, 2, "plan" if plan else "ids")
            errors += [(case, name, rel_err(a, w)) for name, a, w in zip(("out", "dq", "dk", "dv"), got, want)]
    # NaN in one V row of a document over every rank: every query of it at or after the row sees it.
    for layout in LAYOUTS:
        seq = CHUNK * WORLD * (2 if layout == "zigzag" else 1)
        q, k, v, dout = _inputs(1, seq, 4, 2, g)
        ids = document_ids("spanning", 1, seq, g)
        row = seq // 3
        v[0, row, 1, 0] = float("nan")
        out = _attend(q, k, v, dout, ids, layout, True, rank)[0][0]
        expected = (ids[0] == ids[0, row]) & (torch.arange(seq) >= row)
        nan_rows.append((layout, bool(out.isnan().any(-1).any(-1)[expected].all()), int(expected.sum())))
    return errors, nan_rows, moved


@pytest.mark.slow  # ~25 s on 2 idle cores: 8 processes each import torch
def test_document_ring_at_p8_matches_float64_reference_over_gloo():
    seed = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
    errors, nan_rows, moved = run_distributed(_all_cases, WORLD, seed)[0]
    assert moved, "balance_documents left the sequence as it was: the balanced case tests nothing"
    assert len(errors) == 4 * (2 * len(LAYOUTS) * len(PATTERNS) + 2)
    bad = [f"{case} {name}: {err:.2e}" for case, name, err in errors if not err < TOLERANCE]
    assert not bad, f"seed={seed}:\n" + "\n".join(bad)
    assert [(layout, shows) for layout, shows, _ in nan_rows] == [(lo, True) for lo in LAYOUTS], (seed, nan_rows)
    assert all(n > 1 for _, _, n in nan_rows)
