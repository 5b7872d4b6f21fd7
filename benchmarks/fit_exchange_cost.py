"""Fit the document exchange's cost model (``longctx.exchange_cost``) to measured attention times.

    python benchmarks/fit_exchange_cost.py [--out benchmarks/results/exchange_cost_h200x4.json]

Reads benchmarks/document_attention.py's part-B results at P = 4 and P = 2 (every mix timed
in packed and balanced order, with the ring and the gather exchange), fits the model's
non-negative coefficients by least squares over all 40 timings, and reports for every (P, mix)
which option the model picks against the measured fastest and the default (balanced, ring).
``longctx.exchange_cost.H200`` holds the coefficients this writes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from longctx.exchange_cost import COEFFICIENTS, ExchangeCost, PlanStats  # noqa: E402

RESULTS = os.path.join(HERE, "results")
MEASURED = ("document_attention_ring_ws4_h200x4.json", "document_attention_ring_ws2_h200x4.json")


def timings(files=MEASURED):
    """(P, mix, order, exchange, ms, PlanStats) of every timed option."""
    rows = []
    for name in files:
        report = json.load(open(os.path.join(RESULTS, name)))
        world, seq = report["world_size"], report["config"]["S_total"]
        for r in report["ring"]:
            if r["mix"] == "none":
                continue
            for order in ("packed", "balanced"):
                for exchange in ("ring", "gather"):
                    key = order if exchange == "ring" else f"{order}_gather"
                    stats = PlanStats(
                        world_size=world,
                        max_pairs=r[f"{order}_imbalance"] * r["visible_pairs"] / world,
                        moved_rows=r[f"{order}_kv_rows_moved_share"] * (world - 1) * seq,
                        calls=r[f"{order}_kernel_calls_max"],
                    )
                    rows.append((world, r["mix"], order, exchange, r[f"{key}_ms"], stats))
    return rows


def fit(rows):
    from scipy.optimize import nnls

    x = np.array([ExchangeCost.features(stats, exchange) for *_, exchange, _, stats in rows])
    y = np.array([ms for *_, ms, _ in rows])
    coefficients, _ = nnls(x, y)
    return dict(zip(COEFFICIENTS, (float(c) for c in coefficients)))


def choices(rows, model: ExchangeCost):
    """Per (P, mix): the measured fastest option, the model's pick and the default's time."""
    table = {}
    for world, mix, order, exchange, ms, stats in rows:
        table.setdefault((world, mix), []).append((order, exchange, ms, model.predict_ms(stats, exchange)))
    out = []
    for (world, mix), options in table.items():
        best = min(options, key=lambda o: o[2])
        pick = min(options, key=lambda o: o[3])
        default = next(o for o in options if o[:2] == ("balanced", "ring"))
        out.append(
            dict(
                world_size=world,
                mix=mix,
                fastest=list(best[:2]),
                fastest_ms=best[2],
                pick=list(pick[:2]),
                pick_ms=pick[2],
                pick_over_fastest=pick[2] / best[2],
                default_ms=default[2],
                default_over_pick=default[2] / pick[2],
            )
        )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(RESULTS, "exchange_cost_h200x4.json"))
    args = parser.parse_args()
    rows = timings()
    coefficients = fit(rows)
    model = ExchangeCost(**coefficients)
    errors = [abs(model.predict_ms(stats, ex) - ms) / ms for *_, ex, ms, stats in rows]
    report = dict(
        measured=list(MEASURED),
        shape=dict(heads=16, kv_heads=16, head_dim=128),
        coefficients=coefficients,
        relative_error=dict(median=float(np.median(errors)), max=float(np.max(errors))),
        choices=choices(rows, model),
    )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for c in report["choices"]:
        print(
            f"P={c['world_size']} {c['mix']:9s} fastest {'/'.join(c['fastest']):16s} {c['fastest_ms']:7.2f} ms; "
            f"pick {'/'.join(c['pick']):16s} {c['pick_ms']:7.2f} ms ({c['pick_over_fastest']:.2f}x); "
            f"default {c['default_ms']:7.2f} ms"
        )
    print(json.dumps(coefficients))


if __name__ == "__main__":
    main()
