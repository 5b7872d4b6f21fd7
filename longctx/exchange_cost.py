"""Which exchange and which token order a batch of packed documents takes: a cost model.

The fastest way to run a batch's document attention over P ranks depends on its documents
(the README's scaling table): the gather exchange (one all-to-all, one kernel call per
direction) wins where few rows move and P >= 4, the ring (P - 1 steps) where many do; the
balanced order evens out the ranks' work but can move far more rows than the packed order.
``ExchangeCost.predict_ms`` estimates one layer's forward and backward from a plan's
statistics (``PlanStats``: the busiest rank's visible pairs and kernel calls, the K/V rows
moved, the ring's steps) with coefficients fitted to measured times by
benchmarks/fit_exchange_cost.py (``H200``: 4 x H200, 16 heads of 128; other head shapes scale
the pair and row terms). ``choose_plan`` builds the candidates' plans and keeps the cheapest.
Every rank computes the same statistics from the same full ids, so every rank of a group
picks the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

COEFFICIENTS = ("pair_ms", "ring_row_ms", "gather_row_ms", "ring_step_ms", "gather_ms", "call_ms")
FIT_WIDTH = 16 * 128  # heads x head dim of the fit's problem


@dataclass(frozen=True)
class PlanStats:
    """What a ``DocumentPlan`` costs: ``max_pairs`` (visible pairs of the busiest rank),
    ``moved_rows`` (K/V rows sent between ranks, all ranks), ``calls`` (the busiest rank's
    kernel calls per forward, by exchange)."""

    world_size: int
    max_pairs: float
    moved_rows: float
    calls: Mapping[str, int]

    @classmethod
    def of(cls, plan) -> "PlanStats":
        return cls(
            world_size=plan.world_size,
            max_pairs=float(plan.pairs.max()),
            moved_rows=float(plan.moved),
            calls={mode: int(counts.max()) for mode, counts in plan.launches.items()},
        )


@dataclass(frozen=True)
class ExchangeCost:
    """Milliseconds per unit: 1e8 visible pairs of the busiest rank, 1e4 K/V rows moved (ring,
    gather), a ring step, the gather's all-to-all, a kernel call of the busiest rank."""

    pair_ms: float
    ring_row_ms: float
    gather_row_ms: float
    ring_step_ms: float
    gather_ms: float
    call_ms: float

    @staticmethod
    def features(stats: PlanStats, exchange: str, pair_scale: float = 1.0, row_scale: float = 1.0) -> list:
        ring = exchange == "ring"
        rows = stats.moved_rows / 1e4 * row_scale
        return [
            stats.max_pairs / 1e8 * pair_scale,
            rows if ring else 0.0,
            0.0 if ring else rows,
            (stats.world_size - 1) if ring else 0.0,
            0.0 if ring else 1.0,
            float(stats.calls[exchange]),
        ]

    def predict_ms(
        self, stats: PlanStats, exchange: str, *, heads: int = 16, kv_heads: Optional[int] = None, head_dim: int = 128
    ) -> float:
        """One layer's forward+backward, ms, for a problem of ``heads`` query heads and
        ``kv_heads`` key/value heads of ``head_dim``."""
        kv_heads = heads if kv_heads is None else kv_heads
        values = self.features(stats, exchange, heads * head_dim / FIT_WIDTH, kv_heads * head_dim / FIT_WIDTH)
        return sum(c * f for c, f in zip((getattr(self, n) for n in COEFFICIENTS), values))


# benchmarks/fit_exchange_cost.py over benchmarks/results/document_attention_ring_ws{4,2}_h200x4.json.
H200 = ExchangeCost(
    pair_ms=4.705837,
    ring_row_ms=0.163716,
    gather_row_ms=0.447738,
    ring_step_ms=0.298941,
    gather_ms=0.542219,
    call_ms=0.473722,
)


def choose_plan(
    candidates: Mapping[str, torch.Tensor],
    *,
    world_size: int,
    rank: int,
    layout: str,
    device=None,
    heads: int = 16,
    kv_heads: Optional[int] = None,
    head_dim: int = 128,
    cost: ExchangeCost = H200,
):
    """``(name, plan)``: of the candidate orders ``candidates`` (name -> full ``document_ids``)
    and both exchanges, the one ``cost`` predicts fastest, and this rank's ``DocumentPlan`` of
    it (``longctx.documents.plan_documents``). One plan per candidate (built for the ring;
    its statistics price the gather too), one more where the gather wins."""
    from .documents import plan_documents

    def plan(ids, exchange):
        return plan_documents(
            ids, world_size=world_size, rank=rank, layout=layout, causal=True, device=device, exchange=exchange
        )

    ring = {name: plan(ids, "ring") for name, ids in candidates.items()}
    if world_size == 1:
        name = next(iter(ring))
        return name, ring[name]
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    priced = [
        (cost.predict_ms(PlanStats.of(p), exchange, **shape), i, name, exchange)
        for i, (name, p) in enumerate(ring.items())
        for exchange in ("ring", "gather")
    ]
    _, _, name, exchange = min(priced)
    return name, ring[name] if exchange == "ring" else plan(candidates[name], "gather")
