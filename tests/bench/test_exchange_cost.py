"""The document exchange's cost model (``longctx.exchange_cost``) against the committed
attention timings (benchmarks/results/document_attention_ring_ws{4,2}_h200x4.json): its
coefficients are the fit of those timings, and the option it picks is close to the fastest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("scipy")
sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "benchmarks")]

from fit_exchange_cost import choices, fit, timings  # noqa: E402

from longctx.exchange_cost import COEFFICIENTS, H200, ExchangeCost  # noqa: E402
from longctx.parallel import ParallelPlan  # noqa: E402


def test_the_library_coefficients_are_the_fit_of_the_committed_timings():
    fitted = fit(timings())
    for name in COEFFICIENTS:
        assert getattr(H200, name) == pytest.approx(fitted[name], rel=1e-5), name


def test_the_pick_is_within_5_percent_of_the_fastest_on_every_measured_case():
    picked = choices(timings(), H200)
    assert len(picked) == 10
    for case in picked:
        assert case["pick_over_fastest"] < 1.05, case


def test_fitted_without_a_mix_it_is_never_slower_than_the_default_on_that_mix():
    """Out of sample: the model fitted on four mixes picks for the fifth no worse than the
    default (balanced order, ring) by more than 2%."""
    rows = timings()
    for mix in {r[1] for r in rows}:
        model = ExchangeCost(**fit([r for r in rows if r[1] != mix]))
        for case in choices([r for r in rows if r[1] == mix], model):
            assert case["default_over_pick"] > 0.98, case


def test_auto_is_the_gpu_default_and_a_named_exchange_is_kept():
    assert ParallelPlan().defaults_for("cuda").document_exchange == "auto"
    assert ParallelPlan().defaults_for("cpu").document_exchange == "ring"
    assert ParallelPlan(document_exchange="gather").defaults_for("cuda").document_exchange == "gather"
    with pytest.raises(ValueError, match="document_exchange"):
        ParallelPlan(document_exchange="scatter")
