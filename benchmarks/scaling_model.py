"""A scaling model of document-masked ring attention: fwd+bwd time of one layer call at CP size P.

    python benchmarks/scaling_model.py \\
        --measured benchmarks/results/document_attention_ring_ws2_rows_h200x2.json \\
        --link benchmarks/results/ring_ws2_h200_finish.json \\
        --predict 8 --out benchmarks/results/scaling_model_h200x2.json

What it counts comes from the host: every rank's ``DocumentPlan`` (``plan_documents(ids,
world_size=P, rank=r)``, reduced to ``RankWork`` by ``rank_work``). What it costs comes from
a rates JSON per machine, which ``fit`` derives from measured times. Per kernel call
(phase f = forward or b = backward, kind = causal diagonal call or full off-diagonal call):

    t_call = pairs * c_kind,f + rows * c_row,f + c_call,f

``pairs``: visible (query, key) pairs of the call; ``rows``: its query rows plus key rows
(what grows with the rows and not the pairs: tile waste at segment edges, the vendor
kernels' pre/post-processing, merges and gathers); ``c_call``: launches and fixed work. A
message of n rows over a link: ``n * bytes_per_row * c_byte + c_message`` (K/V rows
forward, dK/dV rows going home in the backward; a rank's send and receive of one step run
at once, so the larger of the two counts).

Overlap, as ``longctx.document_ring`` runs it. Each rank has a compute stream and a link
(its NCCL stream, one message at a time in posting order). Forward: step s + 1's K/V leave a
rank when it starts step s (posted before that step's compute, gathered after the previous
one), step 0 is the local calls; rank r starts step s once its step s - 1 is done and its
step-s message has completed (a send completes when the peer has posted its receive too).
Backward: the steps in the same order, the dK/dV of step s sent home right after its
compute, the local step last, then the wait for the gradients coming home; where the
forward's messages are not kept (they exceed one shard), K/V travel again as in the forward,
step 1's exposed. The layer's time is the last rank's finish: where every rank exchanges at
every step this is the lock-step ring, each step as long as the busiest rank's max(compute,
transfer); ranks that share nothing run on without waiting. P = 1 is the local calls alone.
The host launches every call (FA4's Python path costs ~0.5 ms a call): the time is at least
the busiest rank's ``c_host_layer + 2 * calls * c_host_call``, where launch times are given
(``--host``: ``benchmarks/document_profile.py`` output); without them the host is taken to
keep ahead of the GPUs.

The time is piecewise linear in the costs, so ``fit`` is least squares over relative errors
(non-negative; ``scipy.optimize.nnls``) with the critical path re-found after each solve
until it no longer changes. Forward and backward costs are not separable from fwd+bwd
times: the fit ties every backward cost to ``bwd_over_fwd`` times its forward cost (2.5:
the FLOP ratio of attention's backward to its forward). The link is nearly always hidden at
P = 2, so its two costs come from the plain ring's communication-only times
(``benchmarks/ring.py`` ``breakdown``: ``--link``); a cost nothing measured determines is
left at the prior's value (``--prior``) or zero and listed as ``undetermined``.

The CLI rebuilds the benchmark's mixes (``benchmarks/document_attention.py``, seeded) at each
measured sequence length for P = 1, 2, 4 and the ``--predict`` sizes, fits, and prints every
measured point's error and the predicted grid, with what bounds each prediction (``gpu``:
host launches free; ``host``; ``free_messages``: the per-message cost dropped).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (os.path.dirname(HERE), HERE) if p not in sys.path]  # checkout, sibling scripts

# Seconds per unit: per visible pair (causal diagonal / full off-diagonal calls), per row of
# a call, per call, forward and backward; per byte over a link and per message.
PARAMS = (
    "causal_fwd",
    "causal_bwd",
    "full_fwd",
    "full_bwd",
    "row_fwd",
    "row_bwd",
    "call_fwd",
    "call_bwd",
    "byte",
    "message",
    "host_call",
    "host_layer",
)
_I = {name: i for i, name in enumerate(PARAMS)}
# What the fit solves for: one cost per kernel term (backward tied to forward), the link's and the host's.
FREE = ("causal", "full", "row", "call", "byte", "message", "host_call", "host_layer")
BWD_OVER_FWD = 2.5  # attention's backward FLOPs over its forward's (FlashAttention's count)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2, "float32": 4, "fp32": 4}


# ----------------------------------------------------------------------------- what a rank does


@dataclass(frozen=True)
class Call:
    """One kernel call: causal (the diagonal) or full, its visible pairs, query + key rows."""

    causal: bool
    pairs: float
    rows: int


@dataclass(frozen=True)
class Step:
    """Ring step s of a rank: rows sent to rank + s, rows received from rank - s, its call."""

    n_send: int
    n_recv: int
    call: Optional[Call]


@dataclass(frozen=True)
class RankWork:
    """A rank's share of one layer call, as its ``DocumentPlan`` has it. ``keep``: the
    forward's messages are kept for the backward (the group's decision, the same on every rank)."""

    local: tuple
    steps: tuple
    keep: bool = True

    @property
    def calls(self) -> int:
        """Kernel calls of the forward (the backward makes as many)."""
        return len(self.local) + sum(s.call is not None for s in self.steps)

    @property
    def pairs(self) -> float:
        return sum(c.pairs for c in self.local) + sum(s.call.pairs for s in self.steps if s.call is not None)


def _call(block) -> Call:
    return Call(bool(block.causal), float(block.pairs), int(block.q_ids.shape[1] + block.k_ids.shape[1]))


def rank_work(plan) -> RankWork:
    """The counts of a ``longctx.documents.DocumentPlan`` the model reads."""
    keep = int(plan.received.max(initial=0)) <= plan.batch * plan.local_len  # as document_ring decides
    steps = tuple(
        Step(int(ex.n_send), int(ex.n_recv), None if ex.call is None else _call(ex.call)) for ex in plan.exchanges
    )
    return RankWork(tuple(_call(c) for c in plan.local_calls), steps, keep)


def _works(plans) -> list:
    works = [p if isinstance(p, RankWork) else rank_work(p) for p in plans]
    world = len(works)
    if not works or any(len(w.steps) != world - 1 for w in works):
        raise ValueError(
            f"need one plan per rank, in rank order (got {world} with steps {[len(w.steps) for w in works]})"
        )
    for s in range(1, world):
        for r in range(world):
            if works[r].steps[s - 1].n_recv != works[(r - s) % world].steps[s - 1].n_send:
                raise ValueError(
                    f"plans disagree: rank {r} receives at step {s} what rank {(r - s) % world} does not send"
                )
    return works


# ----------------------------------------------------------------------------- the rates


@dataclass
class Rates:
    """One machine's costs (seconds per unit of each of ``PARAMS``) and the bytes per row moved."""

    costs: dict
    kv_bytes_per_row: float
    grad_bytes_per_row: float
    machine: str = ""
    fit: dict = field(default_factory=dict)

    def vector(self) -> np.ndarray:
        return np.array([float(self.costs.get(name, 0.0)) for name in PARAMS])

    def to_json(self) -> dict:
        def per_s(cost):
            return None if cost <= 0 else 1.0 / cost

        c = self.costs
        return dict(
            machine=self.machine,
            kv_bytes_per_row=self.kv_bytes_per_row,
            grad_bytes_per_row=self.grad_bytes_per_row,
            costs_s={name: float(c[name]) for name in PARAMS},
            rates={
                **{f"{k}_{p}_pairs_per_s": per_s(c[f"{k}_{p}"]) for k in ("causal", "full") for p in ("fwd", "bwd")},
                **{f"row_{p}_us": c[f"row_{p}"] * 1e6 for p in ("fwd", "bwd")},
                **{f"call_{p}_us": c[f"call_{p}"] * 1e6 for p in ("fwd", "bwd")},
                "link_bytes_per_s": per_s(c["byte"]),
                "message_us": c["message"] * 1e6,
                "host_call_us": c["host_call"] * 1e6,
                "host_layer_us": c["host_layer"] * 1e6,
            },
            fit=self.fit,
        )

    @classmethod
    def from_json(cls, data: dict) -> "Rates":
        data = data.get("rates_json", data)  # a scaling_model output file holds its rates there
        return cls(
            costs={name: float(data["costs_s"][name]) for name in PARAMS},
            kv_bytes_per_row=float(data["kv_bytes_per_row"]),
            grad_bytes_per_row=float(data["grad_bytes_per_row"]),
            machine=data.get("machine", ""),
            fit=data.get("fit", {}),
        )


def bytes_per_row(heads_kv: int, head_dim: int, dtype: str) -> int:
    """Bytes of one row of K and V together (or of dK and dV) for one layer."""
    return 2 * heads_kv * head_dim * DTYPE_BYTES[dtype]


# ----------------------------------------------------------------------------- the timeline


def _zero() -> np.ndarray:
    return np.zeros(len(PARAMS))


def host_time(calls: int) -> np.ndarray:
    """The host's time to launch a rank's forward and backward of ``calls`` kernel calls each."""
    t = _zero()
    t[_I["host_layer"]], t[_I["host_call"]] = 1, 2 * calls
    return t


def _call_time(call: Call, phase: str) -> np.ndarray:
    t = _zero()
    t[_I[f"{'causal' if call.causal else 'full'}_{phase}"]] += call.pairs
    t[_I[f"row_{phase}"]] += call.rows
    t[_I[f"call_{phase}"]] += 1
    return t


class _Timeline:
    """Event times of every rank as linear forms in the costs (coefficient vectors), so that
    the critical path's coefficients are what the fit solves with."""

    def __init__(self, works: list, cost: np.ndarray, kv_bytes: float, grad_bytes: float):
        self.works, self.cost, self.kv_bytes, self.grad_bytes = works, cost, kv_bytes, grad_bytes
        self.world = len(works)
        self.link_free = [_zero() for _ in works]

    def later(self, a: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
        return a if b is None or a @ self.cost >= b @ self.cost else b

    def transfer(self, offset: int, ready: list, out_rows: list, in_rows: list, row_bytes: float) -> list:
        """Every rank r sends ``out_rows[r]`` to r + offset and receives ``in_rows[r]`` from
        r - offset, posted at ``ready[r]``: when each rank's message completes (None: none)."""
        P = self.world
        start = [self.later(ready[r], self.link_free[r]) if out_rows[r] or in_rows[r] else None for r in range(P)]
        done = [None] * P
        for r in range(P):
            if start[r] is None:
                continue
            begin = start[r]
            if in_rows[r]:
                begin = self.later(begin, start[(r - offset) % P])
            if out_rows[r]:
                begin = self.later(begin, start[(r + offset) % P])
            move = _zero()
            move[_I["byte"]] = max(out_rows[r], in_rows[r]) * row_bytes
            move[_I["message"]] = 1
            done[r] = self.link_free[r] = begin + move
        return done

    def _kv(self, step: int, ready: list) -> list:
        return self.transfer(
            step,
            ready,
            [w.steps[step - 1].n_send for w in self.works],
            [w.steps[step - 1].n_recv for w in self.works],
            self.kv_bytes,
        )

    def _step_call(self, r: int, step: int, phase: str) -> np.ndarray:
        call = self.works[r].steps[step - 1].call
        return _zero() if call is None else _call_time(call, phase)

    def run(self) -> np.ndarray:
        """Coefficients of the layer's fwd+bwd time (the last rank's finish)."""
        P, works = self.world, self.works
        clock = [_zero() for _ in works]
        # Forward: step 1's K/V leave at once, while the local calls run.
        arriving = self._kv(1, clock) if P > 1 else None
        clock = [clock[r] + sum((_call_time(c, "fwd") for c in w.local), _zero()) for r, w in enumerate(works)]
        for step in range(1, P):
            start = [self.later(clock[r], arriving[r]) for r in range(P)]
            arriving = self._kv(step + 1, start) if step + 1 < P else None
            clock = [start[r] + self._step_call(r, step, "fwd") for r in range(P)]
        # Backward: steps first (K/V kept, or exchanged again), dK/dV home after each, local last.
        keep = all(w.keep for w in works)
        arriving = self._kv(1, clock) if P > 1 and not keep else None
        home = [[] for _ in works]
        for step in range(1, P):
            start = clock
            if not keep:
                start = [self.later(clock[r], arriving[r]) for r in range(P)]
                arriving = self._kv(step + 1, start) if step + 1 < P else None
            clock = [start[r] + self._step_call(r, step, "bwd") for r in range(P)]
            back = self.transfer(
                -step,
                clock,
                [w.steps[step - 1].n_recv for w in works],
                [w.steps[step - 1].n_send for w in works],
                self.grad_bytes,
            )
            for r in range(P):
                if back[r] is not None:
                    home[r].append(back[r])
        finish = _zero()
        for r, w in enumerate(works):
            end = clock[r] + sum((_call_time(c, "bwd") for c in w.local), _zero())
            for t in home[r]:
                end = self.later(end, t)
            finish = self.later(self.later(finish, end), host_time(w.calls))
        return finish


def coefficients(plans, cost: np.ndarray, kv_bytes: float, grad_bytes: float) -> np.ndarray:
    """The critical path's units of each of ``PARAMS`` (time = coefficients @ costs)."""
    return _Timeline(_works(plans), np.asarray(cost, dtype=np.float64), kv_bytes, grad_bytes).run()


def predict(plans, rates: Rates) -> float:
    """Predicted fwd+bwd seconds of one layer call, from every rank's plan (or ``RankWork``)."""
    cost = rates.vector()
    return float(coefficients(plans, cost, rates.kv_bytes_per_row, rates.grad_bytes_per_row) @ cost)


def bounds(plans, rates: Rates) -> dict:
    """What sets the predicted time: ``gpu`` (the devices' timeline, host launches free),
    ``host`` (the busiest rank's launch time), ``free_messages`` (the GPU timeline with
    messages costing their bytes only: how much the per-message cost weighs), in seconds."""
    works = _works(plans)
    cost = rates.vector()
    gpu = cost.copy()
    gpu[[_I["host_call"], _I["host_layer"]]] = 0.0
    free = gpu.copy()
    free[_I["message"]] = 0.0
    b = rates.kv_bytes_per_row, rates.grad_bytes_per_row
    return dict(
        gpu=float(coefficients(works, gpu, *b) @ gpu),
        host=max(float(host_time(w.calls) @ cost) for w in works),
        free_messages=float(coefficients(works, free, *b) @ free),
    )


# ----------------------------------------------------------------------------- the fit


@dataclass
class Measured:
    """One measured time: of a layer call from its plans (``plans``: one per rank), or of
    something already linear in the costs (``units``: e.g. a plain-ring communication-only
    time, bytes and messages). ``label`` says what it is, for the report."""

    seconds: float
    plans: Optional[list] = None
    units: Optional[np.ndarray] = None
    label: dict = field(default_factory=dict)


def _tie(bwd_over_fwd: float) -> np.ndarray:
    """(len(PARAMS), len(FREE)): costs = tie @ free (backward = bwd_over_fwd x forward)."""
    tie = np.zeros((len(PARAMS), len(FREE)))
    for j, name in enumerate(FREE):
        if name in ("byte", "message", "host_call", "host_layer"):
            tie[_I[name], j] = 1.0
        else:
            tie[_I[f"{name}_fwd"], j] = 1.0
            tie[_I[f"{name}_bwd"], j] = bwd_over_fwd
    return tie


def fit(
    measurements: Sequence[Measured],
    *,
    kv_bytes_per_row: float,
    grad_bytes_per_row: float,
    bwd_over_fwd: float = BWD_OVER_FWD,
    prior: Optional[Rates] = None,
    machine: str = "",
    iterations: int = 50,
    without: Sequence[str] = (),
) -> Rates:
    """Costs minimising the squared relative errors over ``measurements`` (non-negative),
    re-finding each point's critical path until it stops changing. ``without``: terms of
    ``FREE`` held at the prior's value (or zero), e.g. to see what a term buys."""
    from scipy.optimize import nnls

    if not measurements:
        raise ValueError("fit needs at least one measured time")
    tie = _tie(bwd_over_fwd)
    works = [None if m.plans is None else _works(m.plans) for m in measurements]
    seconds = np.array([m.seconds for m in measurements], dtype=np.float64)
    if not (seconds > 0).all():
        raise ValueError("measured times must be positive")
    prior_free = np.linalg.lstsq(tie, prior.vector(), rcond=None)[0] if prior is not None else None

    def design(free: np.ndarray) -> np.ndarray:
        cost = tie @ free
        rows = []
        for m, w in zip(measurements, works):
            units = m.units if w is None else _Timeline(w, cost, kv_bytes_per_row, grad_bytes_per_row).run()
            rows.append(units @ tie)
        return np.array(rows) / seconds[:, None]

    # Start where every kernel term carries an equal share of the compute-only times.
    free = np.zeros(len(FREE)) if prior_free is None else prior_free.copy()
    if prior_free is None:
        a = design(np.ones(len(FREE)))
        for j, name in enumerate(FREE[:4]):
            total = a[:, j].mean()
            free[j] = 0.25 / total if total > 0 else 0.0
    best = None
    for _ in range(iterations):
        a = design(free)
        norms = np.linalg.norm(a, axis=0)
        known = (norms > 1e-12 * norms.max()) & ~np.isin(FREE, list(without))
        solution = np.zeros(len(FREE))
        solution[known] = nnls(a[:, known] / norms[known], np.ones(len(seconds)))[0] / norms[known]
        solution[~known] = 0.0 if prior_free is None else prior_free[~known]
        residual = float(np.linalg.norm(design(solution) @ solution - 1.0))
        if best is None or residual < best[0]:
            best = (residual, solution, known)
        if np.allclose(solution, free, rtol=1e-9, atol=0):
            break
        free = solution
    residual, free, known = best
    undetermined = [name for name, k in zip(FREE, known) if not k]
    return Rates(
        costs=dict(zip(PARAMS, (tie @ free).tolist())),
        kv_bytes_per_row=kv_bytes_per_row,
        grad_bytes_per_row=grad_bytes_per_row,
        machine=machine,
        fit=dict(
            points=len(measurements),
            bwd_over_fwd=bwd_over_fwd,
            rms_relative_error=residual / np.sqrt(len(measurements)),
            undetermined=undetermined,
            undetermined_from="prior" if prior is not None else "zero",
        ),
    )


def measured_seconds(m: Measured, rates: Rates) -> float:
    """The model's time for a measured point (plans or units)."""
    if m.plans is None:
        return float(m.units @ rates.vector())
    return predict(m.plans, rates)


# ----------------------------------------------------------------------------- inputs


def read_ring_results(path: str) -> dict:
    """Measured document-ring times from ``benchmarks/document_attention.py --part ring``
    output: ``{"shape": ..., "points": [{mix, S, P, arrangement, seconds, ...}]}``. P = 1 is the
    best one-GPU path (the fastest provider other than flex_attention); P = world_size the
    ring on the balanced sequence and, where timed, on the packed one."""
    with open(path) as f:
        data = json.load(f)
    world = int(data["world_size"])
    config = data.get("config", {})
    shape = dict(
        H=int(config.get("H", 16)),
        D=int(config.get("D", 128)),
        dtype=config.get("dtype", "bfloat16"),
        layout=config.get("layout", "zigzag"),
    )
    points = []
    one = {}
    for cell in data.get("one_gpu", []):
        if cell.get("ms") and cell.get("provider") != "flex" and "error" not in cell:
            key = (cell["mix"], int(cell["S"]))
            one[key] = min(one.get(key, float("inf")), float(cell["ms"]))
    checks = {}
    for row in data.get("ring", []):
        if row.get("mix", "none") == "none" or "error" in row:
            continue
        key = (row["mix"], int(row.get("S", config.get("S_total", 0))))
        checks[key] = {k: row[k] for k in ("documents", "visible_pairs") if k in row}
        if key not in one and row.get("one_gpu_best_ms"):
            one[key] = float(row["one_gpu_best_ms"])
        for arrangement in ("balanced", "packed"):
            ms = row.get(f"{arrangement}_ms", row.get("ms") if arrangement == "balanced" else None)
            if ms:
                points.append(dict(mix=key[0], S=key[1], P=world, arrangement=arrangement, seconds=ms * 1e-3))
    for (mix, S), ms in one.items():
        points.append(dict(mix=mix, S=S, P=1, arrangement="packed", seconds=ms * 1e-3))
    for p in points:
        p.update(source=os.path.basename(path), check=checks.get((p["mix"], p["S"]), {}))
    return dict(shape=shape, points=points, machine=f"{data.get('gpu', '')} x{world}")


def read_link_results(path: str) -> list:
    """Communication-only times of the plain ring (``benchmarks/ring.py`` ``breakdown``):
    [{P, S, seconds, bytes, messages}]. Its hops, per rank: P - 1 forward K/V shards (the input
    dtype), P - 2 backward ones (its first kept), P - 1 dK/dV shards in fp32."""
    with open(path) as f:
        data = json.load(f)
    shapes = data.get("shapes", "")
    heads = int(re.search(r"\bH=(\d+)", shapes).group(1)) if re.search(r"\bH=(\d+)", shapes) else 16
    dim = int(re.search(r"\bD=(\d+)", shapes).group(1)) if re.search(r"\bD=(\d+)", shapes) else 128
    dtype = shapes.split()[0] if shapes else "bf16"
    out = []
    for row in data.get("breakdown", []) or []:
        if not row.get("comm_only_ms"):
            continue
        P, S = int(row["P"]), int(row["S_total"])
        rows = S // P
        kv, grad = rows * bytes_per_row(heads, dim, dtype), rows * bytes_per_row(heads, dim, "fp32")
        hops_kv, hops_grad = (P - 1) + max(P - 2, 0), P - 1
        out.append(
            dict(
                P=P,
                S=S,
                seconds=row["comm_only_ms"] * 1e-3,
                bytes=hops_kv * kv + hops_grad * grad,
                messages=hops_kv + hops_grad,
                source=os.path.basename(path),
            )
        )
    return out


def read_host_results(path: str) -> list:
    """Host launch times of document-ring steps (``benchmarks/document_profile.py``: the host's
    time to queue one fwd+bwd, the GPU held asleep): [{mix, P, rank, calls, seconds}]."""
    with open(path) as f:
        data = json.load(f)
    return [
        dict(
            mix=c["mix"],
            P=int(c["gpus"]),
            rank=c.get("rank", 0),
            calls=int(c["calls"]),
            seconds=c["host_ms"] * 1e-3,
            source=os.path.basename(path),
        )
        for c in data.get("cases", [])
        if c.get("host_ms") and c.get("calls") and not c.get("fused")
    ]


def host_measurement(point: dict) -> Measured:
    return Measured(
        point["seconds"],
        units=host_time(point["calls"]),
        label=dict(kind="host", mix=f"host {point['mix']}", P=point["P"], arrangement=f"{point['calls']} calls"),
    )


def link_measurement(point: dict) -> Measured:
    units = _zero()
    units[_I["byte"]], units[_I["message"]] = point["bytes"], point["messages"]
    return Measured(point["seconds"], units=units, label=dict(kind="link", mix="link", P=point["P"], S=point["S"]))


@functools.lru_cache(maxsize=None)
def _mix_ids(mix: str, S: int, seed: int):
    from document_attention import ids_from_lengths, mix_summary

    from longctx.data.document_mixes import document_lengths

    lengths = document_lengths(mix, S, seed=seed)
    return ids_from_lengths(lengths, device="cpu"), mix_summary(lengths, S)


@functools.lru_cache(maxsize=None)
def mix_work(mix: str, S: int, P: int, arrangement: str, seed: int = 0, layout: str = "zigzag") -> tuple:
    """Every rank's ``RankWork`` for the benchmark's ``mix`` at ``S`` tokens on P ranks: the
    packed sequence, or (``arrangement="balanced"``) ``balance_documents``' arrangement of it."""
    from longctx import balance_documents
    from longctx.documents import plan_documents

    ids = _mix_ids(mix, S, seed)[0]
    if P > 1 and arrangement == "balanced":
        ids = balance_documents({"document_ids": ids}, world_size=P, layout=layout)["document_ids"]
    return tuple(rank_work(plan_documents(ids, world_size=P, rank=r, layout=layout)) for r in range(P))


def _check_mix(point: dict, seed: int) -> None:
    summary = _mix_ids(point["mix"], point["S"], seed)[1]
    for key, want in point.get("check", {}).items():
        if summary[key] != want:
            raise ValueError(
                f"{point['source']}: mix {point['mix']} at S={point['S']} has {key}={want}, but seed {seed} "
                f"regenerates {summary[key]}: pass the benchmark's --seed"
            )


# ----------------------------------------------------------------------------- the CLI


def _table(rows: list, columns: list) -> str:
    cells = [[str(c) for c in columns]] + [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", nargs="+", required=True, help="document_attention.py --part ring JSON files")
    ap.add_argument("--link", nargs="*", default=[], help="benchmarks/ring.py JSON files with a breakdown section")
    ap.add_argument("--host", nargs="*", default=[], help="benchmarks/document_profile.py JSON files (host times)")
    ap.add_argument("--predict", nargs="+", type=int, default=[8], help="CP sizes to predict (besides 1, 2, 4)")
    ap.add_argument("--out", default=None, help="JSON: the rates, every point's error and the predictions")
    ap.add_argument("--rates", default=None, help="use these rates (a rates or scaling_model JSON) instead of fitting")
    ap.add_argument("--prior", default=None, help="rates JSON for costs the measurements leave undetermined")
    ap.add_argument("--machine", default=None, help="name stored with the rates (default: from the measured file)")
    ap.add_argument("--seed", type=int, default=0, help="the benchmark's mix seed")
    ap.add_argument("--bwd-over-fwd", type=float, default=BWD_OVER_FWD)
    ap.add_argument(
        "--grad-dtype", default=None, help="dtype of the dK/dV sent home (default: the input dtype, as FA4)"
    )
    args = ap.parse_args(argv)

    readings = [read_ring_results(path) for path in args.measured]
    shape = readings[0]["shape"]
    for r in readings[1:]:
        if r["shape"] != shape:
            raise ValueError(f"measured files disagree on the shape: {shape} vs {r['shape']}")
    kv_bytes = bytes_per_row(shape["H"], shape["D"], shape["dtype"])
    grad_bytes = bytes_per_row(shape["H"], shape["D"], args.grad_dtype or shape["dtype"])
    layout = shape["layout"]
    points = [p for r in readings for p in r["points"]]
    for p in points:
        _check_mix(p, args.seed)

    def work(p):
        return list(mix_work(p["mix"], p["S"], p["P"], p["arrangement"], args.seed, layout))

    measured = [Measured(p["seconds"], plans=work(p), label=p) for p in points]
    links = [link_measurement(p) for path in args.link for p in read_link_results(path)]
    links += [host_measurement(p) for path in args.host for p in read_host_results(path)]
    if args.rates:
        with open(args.rates) as f:
            rates = Rates.from_json(json.load(f))
    else:
        prior = None
        if args.prior:
            with open(args.prior) as f:
                prior = Rates.from_json(json.load(f))
        rates = fit(
            measured + links,
            kv_bytes_per_row=kv_bytes,
            grad_bytes_per_row=grad_bytes,
            bwd_over_fwd=args.bwd_over_fwd,
            prior=prior,
            machine=args.machine or readings[0]["machine"],
        )
        rates.fit["sources"] = [os.path.basename(p) for p in args.measured + args.link + args.host]
        rates.fit["shape"] = shape

    report_rows = []
    for m in measured + links:
        got = measured_seconds(m, rates)
        label = m.label
        row = dict(
            mix=label.get("mix", label.get("kind", "")),
            S=label.get("S", ""),
            P=label.get("P", ""),
            arrangement=label.get("arrangement", "comm only"),
            measured_ms=round(m.seconds * 1e3, 3),
            predicted_ms=round(got * 1e3, 3),
            error=round(got / m.seconds - 1, 4),
        )
        report_rows.append(row)
    print(_table(report_rows, ["mix", "S", "P", "arrangement", "measured_ms", "predicted_ms", "error"]))
    per_mix = {}
    for row in report_rows:
        per_mix[row["mix"]] = max(per_mix.get(row["mix"], 0.0), abs(row["error"]))
    print("\nlargest |relative error| per mix: " + ", ".join(f"{k} {v:.1%}" for k, v in per_mix.items()))

    sizes = sorted({1, 2, 4, *args.predict, *(p["P"] for p in points)})
    grid = []
    for mix, S in dict.fromkeys((p["mix"], p["S"]) for p in points):
        one = predict(list(mix_work(mix, S, 1, "packed", args.seed, layout)), rates)
        for P in sizes:
            row = dict(mix=mix, S=S, P=P)
            for p in points:
                if (p["mix"], p["S"], p["P"], p["arrangement"]) == (mix, S, P, "balanced" if P > 1 else "packed"):
                    row["measured_ms"] = round(p["seconds"] * 1e3, 3)
            for arrangement in ("balanced", "packed"):
                ws = list(mix_work(mix, S, P, arrangement, args.seed, layout))
                t = predict(ws, rates)
                row[f"{arrangement}_ms"] = round(t * 1e3, 3)
                row[f"{arrangement}_speedup"] = round(one / t, 2)
                if arrangement == "balanced":
                    pairs = np.array([w.pairs for w in ws])
                    row["imbalance"] = round(float(pairs.max() / pairs.mean()), 3)
                    row["kv_rows_moved"] = sum(s.n_recv for w in ws for s in w.steps)
                    row["max_calls"] = max(w.calls for w in ws)
                    row.update({f"{k}_ms": round(v * 1e3, 3) for k, v in bounds(ws, rates).items()})
            grid.append(row)
    print("\npredicted fwd+bwd per layer call (balanced and packed; speed-up over the predicted P = 1;")
    print("gpu: host launches free, host: the busiest rank's launches, free_messages: no per-message cost):")
    columns = ["mix", "S", "P", "measured_ms", "balanced_ms", "balanced_speedup", "packed_ms", "packed_speedup"]
    print(_table(grid, columns + ["gpu_ms", "host_ms", "free_messages_ms", "max_calls", "kv_rows_moved"]))
    for P in args.predict:
        print(f"\nP = {P}: " + ", ".join(f"{r['mix']} {r['balanced_ms']} ms" for r in grid if r["P"] == P))
    undetermined = rates.fit.get("undetermined")
    if undetermined:
        print(f"\nnote: {undetermined} not determined by the measurements (from {rates.fit.get('undetermined_from')})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                dict(rates_json=rates.to_json(), points=report_rows, per_mix_max_error=per_mix, predictions=grid),
                f,
                indent=1,
            )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
