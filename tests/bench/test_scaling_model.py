"""benchmarks/scaling_model.py on the CPU: the model's invariants on small document plans, the
fit recovering the rates that generated its times, and the CLI on tiny synthetic result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks")]

import scaling_model as sm  # noqa: E402

from longctx import balance_documents  # noqa: E402
from longctx.documents import plan_documents  # noqa: E402

BYTES = dict(kv_bytes_per_row=64.0, grad_bytes_per_row=128.0)


def ids_of(lengths) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def draw_lengths(seq: int, longest: int, g: torch.Generator) -> list:
    lengths = []
    while sum(lengths) < seq:
        lengths.append(min(int(torch.randint(1, longest + 1, (1,), generator=g)), seq - sum(lengths)))
    return lengths


def works(ids, world, layout="zigzag", balanced=False, causal=True) -> list:
    if balanced and world > 1:
        ids = balance_documents({"document_ids": ids}, world_size=world)["document_ids"]
    return [
        sm.rank_work(plan_documents(ids, world_size=world, rank=r, layout=layout, causal=causal)) for r in range(world)
    ]


def rates(costs: dict) -> sm.Rates:
    return sm.Rates(costs={name: float(costs.get(name, 0.0)) for name in sm.PARAMS}, **BYTES)


def random_costs(g: np.random.Generator) -> dict:
    return {name: float(g.uniform(0.5, 2.0)) * scale for name, scale in SCALES.items()}


# Seconds per unit at sizes where every term matters for plans of a few hundred tokens.
SCALES = dict(
    causal_fwd=1e-6,
    causal_bwd=2.5e-6,
    full_fwd=1.5e-6,
    full_bwd=3e-6,
    row_fwd=1e-5,
    row_bwd=2e-5,
    call_fwd=1e-4,
    call_bwd=2e-4,
    byte=1e-7,
    message=5e-5,
    host_call=1e-4,
    host_layer=1e-4,
)


def test_rank_work_counts_the_plan():
    g = torch.Generator().manual_seed(0)
    ids = ids_of(draw_lengths(256, 40, g))
    for world in (1, 2, 4):
        plans = [plan_documents(ids, world_size=world, rank=r) for r in range(world)]
        for r, plan in enumerate(plans):
            w = sm.rank_work(plan)
            assert w.pairs == pytest.approx(plan.pairs[r])
            assert w.calls == plan.calls
            assert sum(s.n_recv for s in w.steps) == plan.received[r]
        counted = [sm.rank_work(p) for p in plans]
        assert sm.predict(plans, rates(SCALES)) == pytest.approx(sm.predict(counted, rates(SCALES)))


def test_one_rank_has_no_communication():
    ids = ids_of(draw_lengths(128, 30, torch.Generator().manual_seed(1)))
    one = works(ids, 1)
    units = sm.coefficients(one, rates(SCALES).vector(), kv_bytes=64.0, grad_bytes=128.0)
    assert units[sm._I["byte"]] == 0 and units[sm._I["message"]] == 0
    expensive = dict(SCALES, byte=1.0, message=1.0)
    assert sm.predict(one, rates(expensive)) == sm.predict(one, rates(dict(SCALES, byte=0, message=0)))
    # ...and is its calls' time, forward and backward (plus nothing for a host that keeps up).
    c = rates(dict(SCALES, host_call=0, host_layer=0)).vector()
    want = sum(float((sm._call_time(call, "fwd") + sm._call_time(call, "bwd")) @ c) for call in one[0].local)
    assert sm.predict(one, rates(dict(SCALES, host_call=0, host_layer=0))) == pytest.approx(want)


def _bumped(ws: list, rank: int, what: str, index: int) -> list:
    """A copy of ``ws`` with one count of one rank grown (the peer's matching count too)."""
    ws = list(ws)
    w = ws[rank]
    if what == "local":
        call = w.local[index]
        local = list(w.local)
        local[index] = sm.Call(call.causal, call.pairs * 3 + 7, call.rows + 5)
        ws[rank] = sm.RankWork(tuple(local), w.steps, w.keep)
        return ws
    world = len(ws)
    step = w.steps[index]
    s = index + 1
    call = step.call or sm.Call(False, 0.0, 0)
    steps = list(w.steps)
    steps[index] = sm.Step(step.n_send, step.n_recv + 9, sm.Call(False, call.pairs * 2 + 11, call.rows + 9))
    ws[rank] = sm.RankWork(w.local, tuple(steps), w.keep)
    source = (rank - s) % world
    src = ws[source]
    src_steps = list(src.steps)
    src_steps[index] = sm.Step(src.steps[index].n_send + 9, src.steps[index].n_recv, src.steps[index].call)
    ws[source] = sm.RankWork(src.local, tuple(src_steps), src.keep)
    return ws


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_more_work_never_predicts_less_time(layout):
    """Growing any call's pairs or rows, or any message, never shortens the prediction; and
    on whole plans, ids whose visible pairs are a superset (documents merged) never predict
    less time where only pairs and bytes cost (rows and calls are not monotone in pairs)."""
    g = torch.Generator().manual_seed(2)
    rng = np.random.default_rng(2)
    for trial in range(4):
        lengths = draw_lengths(128, 24, g)
        ids = ids_of(lengths)
        for world in (2, 4):
            ws = works(ids, world, layout)
            r = rates(random_costs(rng))
            base = sm.predict(ws, r)
            for rank in range(world):
                for i in range(len(ws[rank].local)):
                    assert sm.predict(_bumped(ws, rank, "local", i), r) >= base * (1 - 1e-12)
                for i in range(world - 1):
                    assert sm.predict(_bumped(ws, rank, "step", i), r) >= base * (1 - 1e-12)
            merged = ids.clone()
            merged[merged % 3 == 1] -= 1  # every third document joins the one before it
            pair_costs = random_costs(rng)
            pair_costs.update(full_fwd=pair_costs["causal_fwd"], full_bwd=pair_costs["causal_bwd"])
            pair_costs.update({k: 0.0 for k in ("row_fwd", "row_bwd", "call_fwd", "call_bwd", "host_call")})
            r = rates(pair_costs)
            wm = works(merged, world, layout)
            assert sum(w.pairs for w in wm) > sum(w.pairs for w in ws)
            assert sm.predict(wm, r) >= sm.predict(ws, r) * (1 - 1e-12)


def test_plain_ring_with_a_slow_link_is_its_messages_back_to_back():
    """One document, not causal: every rank moves its whole shard at every step. With
    free compute the time is the link's: forward P - 1 K/V hops; backward (not kept at P = 4:
    the messages add up to more than a shard) P - 1 K/V hops again and P - 1 dK/dV hops home
    (twice the bytes here), one after another on the same link."""
    world, seq = 4, 64
    ws = works(torch.zeros(1, seq, dtype=torch.long), world, causal=False)
    assert all(s.n_recv == seq // world for w in ws for s in w.steps) and not ws[0].keep
    link_only = {name: 0.0 for name in sm.PARAMS} | {"byte": 1.0}
    shard = seq // world * BYTES["kv_bytes_per_row"]
    assert sm.predict(ws, rates(link_only)) == pytest.approx((world - 1) * shard * (1 + 1 + 2))
    # A per-message cost adds once per hop on the critical path: 3 (P - 1) hops.
    assert sm.predict(ws, rates(link_only | {"message": 5.0})) == pytest.approx(
        (world - 1) * shard * 4 + 3 * (world - 1) * 5.0
    )


def test_fit_recovers_the_rates_that_made_the_times():
    g = torch.Generator().manual_seed(3)
    truth = rates(random_costs(np.random.default_rng(3)))
    tie = sm._tie(2.5)
    free = np.linalg.lstsq(tie, truth.vector(), rcond=None)[0]
    truth = rates(dict(zip(sm.PARAMS, tie @ free)))  # backward = 2.5 x forward, as the fit assumes
    points = []
    for trial in range(6):
        ids = ids_of(draw_lengths(192, [12, 40, 96][trial % 3], g))
        for world in (1, 2, 4):
            for balanced in (False, True):
                if world == 1 and balanced:
                    continue
                ws = works(ids, world, balanced=balanced)
                points.append(sm.Measured(sm.predict(ws, truth), plans=ws))
    for n_bytes, messages in ((1e4, 2), (4e4, 2), (2e4, 8)):
        units = sm._zero()
        units[sm._I["byte"]], units[sm._I["message"]] = n_bytes, messages
        points.append(sm.Measured(float(units @ truth.vector()), units=units))
    for calls in (1, 2, 5):
        units = sm.host_time(calls)
        points.append(sm.Measured(float(units @ truth.vector()), units=units))
    got = sm.fit(points, **BYTES)
    assert got.fit["undetermined"] == []
    assert got.fit["rms_relative_error"] < 1e-9
    for name in sm.PARAMS:
        assert got.costs[name] == pytest.approx(truth.costs[name], rel=1e-6), name
    assert sm.Rates.from_json(json.loads(json.dumps(got.to_json()))).costs == got.costs


def test_fit_names_what_the_measurements_leave_undetermined():
    ids = ids_of(draw_lengths(128, 30, torch.Generator().manual_seed(4)))
    truth = rates(dict(SCALES, host_call=0, host_layer=0))
    points = [sm.Measured(sm.predict(works(ids, 1), truth), plans=works(ids, 1))]
    got = sm.fit(points, **BYTES)
    assert {"full", "byte", "message", "host_call", "host_layer"} <= set(got.fit["undetermined"])
    assert got.costs["byte"] == 0 and got.costs["message"] == 0
    prior = rates(SCALES)
    assert sm.fit(points, prior=prior, **BYTES).costs["byte"] == pytest.approx(SCALES["byte"])


# ----------------------------------------------------------------------------- the CLI


def _ring_file(path: Path, world: int, S: int, times: dict) -> None:
    """A ``document_attention.py --part ring`` result file: ``times[(mix, P, arrangement)]``."""
    from document_attention import mix_summary

    from longctx.data.document_mixes import document_lengths

    mixes = sorted({m for m, _, _ in times})
    data = dict(world_size=world, gpu="Test GPU", config=dict(S_total=S, H=2, D=16, dtype="bfloat16", layout="zigzag"))
    data["one_gpu"] = [
        dict(mix=m, S=S, provider=p, ms=times[(m, 1, "packed")] * 1e3 * f)
        for m in mixes
        for p, f in (("fa4-plan", 1.0), ("triton-plan", 1.5), ("flex", 0.5))  # flex is not ours: left out
    ]
    data["ring"] = [dict(mix="none", S=S, ms=1.0)] + [
        dict(
            mix=m,
            S=S,
            **mix_summary(document_lengths(m, S, seed=0), S),
            packed_ms=times[(m, world, "packed")] * 1e3,
            balanced_ms=times[(m, world, "balanced")] * 1e3,
            ms=times[(m, world, "balanced")] * 1e3,
        )
        for m in mixes
    ]
    path.write_text(json.dumps(data))


def test_cli_fits_tiny_synthetic_measurements(tmp_path, capsys):
    S, mixes = 2048, ("longtail", "mean1k", "docs256")
    truth = rates(dict(random_costs(np.random.default_rng(5)), host_call=0.0, host_layer=0.0))
    tie = sm._tie(2.5)
    truth = rates(dict(zip(sm.PARAMS, tie @ np.linalg.lstsq(tie, truth.vector(), rcond=None)[0])))
    truth.kv_bytes_per_row = truth.grad_bytes_per_row = sm.bytes_per_row(2, 16, "bfloat16")
    times = {
        (m, P, a): sm.predict(list(sm.mix_work(m, S, P, a)), truth)
        for m in mixes
        for P in (1, 2, 4)
        for a in ("packed", "balanced")
    }
    _ring_file(tmp_path / "ws2.json", 2, S, times)
    _ring_file(tmp_path / "ws4.json", 4, S, times)
    link = dict(
        world_size=2,
        shapes="bf16 causal B=1 H=2 D=16",
        breakdown=[
            dict(P=2, S_total=s, comm_only_ms=1e3 * (b * truth.costs["byte"] + 2 * truth.costs["message"]))
            for s, b in ((4096, 4096 // 2 * (128 + 256)), (16384, 16384 // 2 * (128 + 256)))  # K/V bf16, dK/dV fp32
        ],
    )
    (tmp_path / "ring.json").write_text(json.dumps(link))
    out = tmp_path / "model.json"
    argv = ["--measured", str(tmp_path / "ws2.json"), str(tmp_path / "ws4.json"), "--link", str(tmp_path / "ring.json")]
    assert sm.main(argv + ["--predict", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "P = 8:" in printed and "largest |relative error| per mix" in printed
    report = json.loads(out.read_text())
    assert set(report["per_mix_max_error"]) == {*mixes, "link"}
    assert max(report["per_mix_max_error"].values()) < 1e-6
    assert len(report["points"]) == 2 * 3 * (1 + 2) + 2  # per file and mix: P = 1, two arrangements; 2 link
    p8 = [row for row in report["predictions"] if row["P"] == 8]
    assert sorted(row["mix"] for row in p8) == sorted(mixes) and all(row["balanced_ms"] > 0 for row in p8)
    for row in p8:
        want = sm.predict(list(sm.mix_work(row["mix"], S, 8, "balanced")), truth) * 1e3
        assert row["balanced_ms"] == pytest.approx(want, rel=1e-3)
    # The written rates predict again without a fit.
    assert sm.main(argv + ["--rates", str(out)]) == 0
    # A measured file whose mixes the seed does not regenerate is refused, naming the seed.
    bad = json.loads((tmp_path / "ws2.json").read_text())
    bad["ring"][1]["visible_pairs"] += 1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="seed 0 regenerates"):
        sm.main(["--measured", str(tmp_path / "bad.json")])
