"""benchmarks/scaling_model.py on the CPU: the model's invariants on small document plans, the
fit recovering the rates that generated its times, and the CLI on tiny synthetic result files."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
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


def works(ids, world, layout="zigzag", balanced=False, causal=True, exchange="ring") -> list:
    if balanced and world > 1:
        ids = balance_documents({"document_ids": ids}, world_size=world)["document_ids"]
    return [
        sm.rank_work(plan_documents(ids, world_size=world, rank=r, layout=layout, causal=causal, exchange=exchange))
        for r in range(world)
    ]


def rates(costs: dict) -> sm.Rates:
    return sm.Rates(costs={name: float(costs.get(name, 0.0)) for name in sm.PARAMS}, **BYTES)


def random_costs(g: np.random.Generator) -> dict:
    return {name: float(g.uniform(0.5, 2.0)) * scale for name, scale in SCALES.items()}


# Seconds per unit at sizes where every term matters for plans of a few hundred tokens.
SCALES = dict(
    tile_fwd=1e-4,
    tile_bwd=2.5e-4,
    seg_fwd=2e-5,
    seg_bwd=5e-5,
    row_fwd=1e-5,
    row_bwd=2e-5,
    call_fwd=1e-4,
    call_bwd=2e-4,
    pass_fwd=5e-6,
    pass_bwd=1e-5,
    byte=1e-7,
    message=5e-5,
    a2a_byte=2e-7,
    host_layer=1e-4,
    host_call=1e-4,
    host_message=5e-5,
    host_multi=1e-4,
    host_group=1e-4,
)
NO_HOST = {name: 0.0 for name in sm.HOST_TERMS}
assert set(SCALES) == set(sm.PARAMS)


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
    c = rates(dict(SCALES, **NO_HOST)).vector()
    want = sum(float((sm._call_time(call, "fwd") + sm._call_time(call, "bwd")) @ c) for call in one[0].local)
    assert sm.predict(one, rates(dict(SCALES, **NO_HOST))) == pytest.approx(want)


def _bumped(ws: list, rank: int, what: str, index: int) -> list:
    """A copy of ``ws`` with one count of one rank grown (the peer's matching count too)."""
    ws = list(ws)
    w = ws[rank]
    if what == "local":
        call = w.local[index]
        local = list(w.local)
        local[index] = replace(call, pairs=call.pairs * 3 + 7, rows=call.rows + 5, tiles=call.tiles + 3)
        ws[rank] = sm.RankWork(tuple(local), w.steps, w.keep)
        return ws
    world = len(ws)
    step = w.steps[index]
    s = index + 1
    call = step.call or sm.Call(False, 0.0, 0, 0, 0.0, 0)
    steps = list(w.steps)
    grown = replace(
        call, pairs=call.pairs * 2 + 11, rows=call.rows + 9, tiles=call.tiles + 1, segments=call.segments + 1
    )
    steps[index] = sm.Step(step.n_send, step.n_recv + 9, grown)
    ws[rank] = sm.RankWork(w.local, tuple(steps), w.keep)
    source = (rank - s) % world
    src = ws[source]
    src_steps = list(src.steps)
    src_steps[index] = sm.Step(src.steps[index].n_send + 9, src.steps[index].n_recv, src.steps[index].call)
    ws[source] = sm.RankWork(src.local, tuple(src_steps), src.keep)
    return ws


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_more_work_never_predicts_less_time(layout):
    """Growing any call's pairs, tiles, segments or rows, or any message, never shortens the
    prediction."""
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


@pytest.mark.parametrize("exchange", ["ring", "gather"])
def test_time_is_the_larger_of_the_gpus_and_the_host(exchange):
    """The prediction is the GPU timeline or the busiest rank's host time, whichever is
    longer; a slow host makes every plan host-bound, with its calls and messages counted."""
    g = torch.Generator().manual_seed(6)
    rng = np.random.default_rng(6)
    ids = ids_of(draw_lengths(256, 40, g))
    for world in (1, 2, 4):
        for balanced in (False, True):
            ws = works(ids, world, balanced=balanced, exchange=exchange)
            r = rates(random_costs(rng))
            b = sm.bounds(ws, r)
            assert sm.predict(ws, r) == pytest.approx(max(b["gpu"], b["host"]))
            slow = rates({name: (1.0 if name == "host_call" else 0.0) for name in sm.PARAMS})
            assert sm.predict(ws, slow) == pytest.approx(2 * max(w.calls for w in ws))


def test_gather_plans_count_one_exchange_and_one_call():
    """A gather plan's work: the launches ``plan_documents`` counts, one all-to-all each way
    (again in the backward where not kept), and nothing of the ring's steps."""
    g = torch.Generator().manual_seed(7)
    ids = ids_of(draw_lengths(256, 60, g))
    for world in (2, 4):
        plans = [plan_documents(ids, world_size=world, rank=r, exchange="gather") for r in range(world)]
        ws = [sm.rank_work(p) for p in plans]
        for r, (p, w) in enumerate(zip(plans, ws)):
            assert w.calls == p.calls == p.launches["gather"][r]
            assert not w.steps and w.exchange == "gather"
            assert w.messages == (2 if w.keep else 3)
            assert w.gather.n_recv == p.received[r]
        # A slow all-to-all only: the forward's waits for it, the backward's home trip too.
        a2a = rates({name: 0.0 for name in sm.PARAMS} | {"a2a_byte": 1.0})
        longest = max(max(w.gather.n_send, w.gather.n_recv) for w in ws)
        trips = 2 if ws[0].keep else 3
        assert sm.predict(ws, a2a) == pytest.approx(trips * longest * BYTES["kv_bytes_per_row"], rel=0.5)
        assert sm.predict(ws, a2a) >= 2 * longest * BYTES["kv_bytes_per_row"] * (1 - 1e-12)


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


def test_posting_every_step_first_never_predicts_more_time():
    """A ring rank that posts every step's messages before its local calls (the plan's
    ``posts_steps_first``) sends them while it computes: with the stacking free (it is what
    posting first moves ahead of the local calls) the prediction never grows, and it shrinks
    where a rank's local work held back a later step's message."""
    g = torch.Generator().manual_seed(8)
    rng = np.random.default_rng(8)
    shrank = False
    for trial in range(6):
        ids = ids_of(draw_lengths(240, 80, g))
        for world in (3, 4):
            ws = works(ids, world, balanced=trial % 2 == 1)
            assert any(w.posts_first for w in ws)  # small messages: every step posted first
            late = [replace(w, posts_first=False) for w in ws]
            r = rates(random_costs(rng) | NO_HOST | {"pass_fwd": 0.0})
            first, after = sm.predict(ws, r), sm.predict(late, r)
            assert first <= after * (1 + 1e-12)
            shrank |= first < after * (1 - 1e-3)
    assert shrank  # not vacuous


def test_fit_recovers_the_rates_that_made_the_times():
    g = torch.Generator().manual_seed(3)
    # A host that keeps up with these small plans (its costs come from the host points).
    costs = random_costs(np.random.default_rng(3))
    truth = rates({k: v * (0.01 if k in sm.HOST_TERMS else 1.0) for k, v in costs.items()})
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
                for exchange in ("ring", "gather") if world > 1 else ("ring",):
                    ws = works(ids, world, balanced=balanced, exchange=exchange)
                    points.append(sm.Measured(sm.predict(ws, truth), plans=ws))
    for n_bytes, messages in ((1e4, 2), (4e4, 2), (2e4, 8)):
        units = sm._zero()
        units[sm._I["byte"]], units[sm._I["message"]] = n_bytes, messages
        points.append(sm.Measured(float(units @ truth.vector()), units=units))
    for calls, messages, group in (
        (1, 0, False),
        (2, 0, False),
        (5, 0, False),
        (1, 0, True),
        (3, 4, True),
        (2, 9, True),
    ):
        units = sm.host_time(calls, messages, group=group)
        points.append(sm.Measured(float(units @ truth.vector()), units=units))
    got = sm.fit(points, **BYTES)
    assert got.fit["undetermined"] == []
    assert got.fit["rms_relative_error"] < 1e-9
    # Plans this small do not tell tiles from segments (a segment under a tile is one of each):
    # the times are reproduced, the link's and host's costs recovered.
    for name in sm.LINK_TERMS + sm.HOST_TERMS:
        assert got.costs[name] == pytest.approx(truth.costs[name], rel=1e-6), name
    assert sm.Rates.from_json(json.loads(json.dumps(got.to_json()))).costs == got.costs


def test_fit_names_what_the_measurements_leave_undetermined():
    ids = ids_of(draw_lengths(128, 30, torch.Generator().manual_seed(4)))
    truth = rates(dict(SCALES, **NO_HOST))
    points = [sm.Measured(sm.predict(works(ids, 1), truth), plans=works(ids, 1))]
    got = sm.fit(points, **BYTES)
    # One GPU, one call: no passes, no link, no all-to-all, no distributed host path.
    assert {"pass", "byte", "message", "a2a_byte", "host_message", "host_group"} <= set(got.fit["undetermined"])
    assert got.costs["byte"] == 0 and got.costs["message"] == 0
    prior = rates(SCALES)
    assert sm.fit(points, prior=prior, **BYTES).costs["byte"] == pytest.approx(SCALES["byte"])


# ----------------------------------------------------------------------------- the CLI


def _ring_file(path: Path, world: int, S: int, times: dict) -> None:
    """A ``document_attention.py --part ring`` result file: ``times[(mix, P, arrangement,
    exchange)]`` (the one-GPU rows: ``times[(mix, 1, "packed", "ring")]``)."""
    from document_attention import mix_summary

    from longctx.data.document_mixes import document_lengths

    mixes = sorted({m for m, _, _, _ in times})
    data = dict(world_size=world, gpu="Test GPU", config=dict(S_total=S, H=2, D=16, dtype="bfloat16", layout="zigzag"))
    data["one_gpu"] = [
        dict(mix=m, S=S, provider=p, ms=times[(m, 1, "packed", "ring")] * 1e3 * f)
        for m in mixes
        for p, f in (("fa4-plan", 1.0), ("triton-plan", 1.5), ("flex", 0.5))  # flex is not ours: left out
    ]
    data["ring"] = [dict(mix="none", S=S, ms=1.0)] + [
        dict(
            mix=m,
            S=S,
            **mix_summary(document_lengths(m, S, seed=0), S),
            packed_ms=times[(m, world, "packed", "ring")] * 1e3,
            balanced_ms=times[(m, world, "balanced", "ring")] * 1e3,
            packed_gather_ms=times[(m, world, "packed", "gather")] * 1e3,
            balanced_gather_ms=times[(m, world, "balanced", "gather")] * 1e3,
            ms=times[(m, world, "balanced", "ring")] * 1e3,
        )
        for m in mixes
    ]
    path.write_text(json.dumps(data))


def test_cli_fits_tiny_synthetic_measurements(tmp_path, capsys):
    S, mixes = 2048, ("longtail", "mean1k", "docs256")
    truth = rates(dict(random_costs(np.random.default_rng(5)), **NO_HOST))
    tie = sm._tie(2.5)
    truth = rates(dict(zip(sm.PARAMS, tie @ np.linalg.lstsq(tie, truth.vector(), rcond=None)[0])))
    truth.kv_bytes_per_row = truth.grad_bytes_per_row = sm.bytes_per_row(2, 16, "bfloat16")
    times = {
        (m, P, a, e): sm.predict(list(sm.mix_work(m, S, P, a, exchange=e)), truth)
        for m in mixes
        for P in (1, 2, 4)
        for a in ("packed", "balanced")
        for e in ("ring", "gather")
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
    assert "P = 8:" in printed and "leave one mix out" in printed and "within 10%" in printed
    report = json.loads(out.read_text())
    assert set(report["per_mix_max_error"]) == set(mixes)
    assert max(report["per_mix_max_error"].values()) < 1e-6
    # Per mix: P = 1 (both files' rows merged), P = 2 and 4 x four options; 2 link points.
    assert len(report["points"]) == 3 * (1 + 4 + 4) + 2
    assert max(abs(p["error"]) for p in report["leave_one_mix_out"]["points"]) < 1e-4
    p8 = [row for row in report["predictions"] if row["P"] == 8]
    assert sorted(row["mix"] for row in p8) == sorted(mixes) and all(row["best_ms"] > 0 for row in p8)
    for row in p8:
        for a, e in sm.OPTIONS:
            want = sm.predict(list(sm.mix_work(row["mix"], S, 8, a, exchange=e)), truth) * 1e3
            assert row[f"{a}_{e}_ms"] == pytest.approx(want, rel=1e-3)
        assert row["best_ms"] == min(row[f"{a}_{e}_ms"] for a, e in sm.OPTIONS)
    # The written rates predict again without a fit.
    assert sm.main(argv + ["--rates", str(out)]) == 0
    # A measured file whose mixes the seed does not regenerate is refused, naming the seed.
    bad = json.loads((tmp_path / "ws2.json").read_text())
    bad["ring"][1]["visible_pairs"] += 1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="seed 0 regenerates"):
        sm.main(["--measured", str(tmp_path / "bad.json")])
