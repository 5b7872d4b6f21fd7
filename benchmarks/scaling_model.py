"""A scaling model of document-masked context-parallel attention: fwd+bwd time of one layer
call at CP size P, for either exchange (``ring``: P - 1 point-to-point steps; ``gather``: one
all-to-all and one call per direction).

Refit from measurements (one command; rerun it whenever the measured JSONs are redone, in
the same format) and predict P = 8, 16 at 131,072 and 1,048,576 tokens:

    python benchmarks/scaling_model.py \\
        --measured benchmarks/results/document_attention_ring_ws2_contig_h200x4.json \\
                   benchmarks/results/document_attention_ring_ws4_contig_h200x4.json \\
        --link benchmarks/results/ring_ws2_h200_finish.json \\
        --host-overhead benchmarks/results/fa4_host_overhead_h200.json \\
        --prior benchmarks/results/scaling_model_h200x4_v2.json \\
        --predict 8 16 --predict-seq 131072 1048576 --late-posts \\
        --out benchmarks/results/scaling_model_h200x4_v3.json

(``--rates FILE`` predicts with a written fit instead of fitting; ``--no-loo`` skips the
leave-one-mix-out refits; ``--late-posts`` models the measured runs as the ring ran before
it posted every step first, which every run up to ``scaling_model_h200x4_v5_layers4.json``
did.)

What it counts comes from the host: every rank's ``DocumentPlan`` (``plan_documents(ids,
world_size=P, rank=r, exchange=...)``, reduced to ``RankWork`` by ``rank_work``). What it
costs comes from a rates JSON per machine, which ``fit`` derives from measured times.

GPU, per kernel call (phase f = forward or b = backward):

    t_call = tiles * c_tile + segments * c_seg + rows * c_row + c_call

``tiles``: the 128 x 128 (query, key) tiles the varlen kernel visits (a causal segment's
diagonal tiles counted whole: the work FlashAttention-4 does, not the visible pairs);
``segments``: its varlen segments; ``rows``: query plus key rows (the kernels' per-row pre-
and post-processing); ``c_call``: the launches and fixed work of one call. Around the calls,
where a rank runs more than one call or exchanges anything, the passes over rows (merges of
partial outputs, the fp32 accumulators, the stacks of rows sent, the gather's index_select /
index_add, the dK/dV added back home) cost ``c_pass`` per row each: forward the calls' query
rows and the rows stacked to send; backward the calls' query + key rows and the rows coming
home (twice where a row went to several ranks). A rank whose plan is one call and moves
nothing takes the one-call path: no passes. A message of n rows over a link: ``n *
bytes_per_row * c_byte + c_message`` (K/V rows forward, dK/dV home in the backward; a
rank's send and receive of one step run at once, so the larger counts); an all-to-all is
one message per rank, started when every rank has posted it (a collective), each rank's
part as long as its larger side.

Overlap, as ``longctx.document_ring`` runs it. Ring: step s + 1's K/V are stacked and leave
a rank when it starts step s (after waiting for step s's), step 0 is the local calls; a rank
whose plan posts every step first (``DocumentPlan.posts_steps_first``; ``--late-posts`` for
runs of the code before it) stacks and sends them all before its local calls; the
backward runs the steps in the same order, dK/dV of step s sent home right after its call,
the local step last, then the wait for the gradients coming home; where the forward's
messages are not kept (they exceed one shard) K/V travel again as in the forward. Gather:
the all-to-all is posted before the local calls and waited for before the one gather call;
backward: the gather call first (after a second all-to-all where not kept), its dK/dV
summed per received row and sent home by a reverse all-to-all that runs while the local
calls' backward does. The GPU time is the last rank's finish.

Host: every call goes through Python (FlashAttention-4's entry points, our seam, merges and
accumulators: ~0.35 ms a call fwd+bwd on an H200 host, ``fa4_host_overhead_h200.json``), and
the timed loop queues ahead of the GPUs, so a layer takes at least the busiest rank's
``c_host_layer + 2 * calls * c_host_call + messages * c_host_message`` (messages: the ring
steps a rank posts anything in, forward and backward, or the gather's all-to-alls). The
time is the larger of the GPU timeline and that host time.

Fit: the time is piecewise linear in the costs, so ``fit`` is least squares over relative
errors (non-negative; ``scipy.optimize.nnls``) with the critical path (and which of GPU and
host binds) re-found after each solve until it no longer changes. Forward and backward
costs are not separable from fwd+bwd times: every backward cost is tied to ``bwd_over_fwd``
times its forward cost (2.5: attention's backward FLOPs over its forward's). The link's two
costs come from the plain ring's communication-only times (``--link``); the host's from the
measured times and the host measurement of one layer (``--host-overhead``: ``ours_layer_fwd_bwd``
of ``benchmarks/fa4_host_overhead.py``, one call: ``c_host_layer + 2 c_host_call``). A cost
nothing measured determines is left at the prior's value (``--prior``) or zero and listed as
``undetermined``. ``leave_one_out`` refits without each mix in turn and predicts it.

The CLI rebuilds the benchmark's mixes (``benchmarks/document_attention.py``, seeded) for
every measured point (P = 1; each P > 1 file's four arrangement x exchange options; P = 1
rows of several files averaged), fits, prints every point's error, the leave-one-mix-out
errors and the predicted grid (both arrangements and exchanges, the fastest marked, with
what bounds it: ``gpu`` = host free, ``host``).
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

TILE = 128  # FlashAttention-4's (query, key) tile at head dim 128 on Hopper
# What a kernel-side cost is per, forward and backward (tied by ``bwd_over_fwd`` in the fit).
KERNEL_TERMS = ("tile", "seg", "row", "call", "pass")
LINK_TERMS = ("byte", "message", "a2a_byte")
HOST_TERMS = ("host_layer", "host_call", "host_message", "host_multi", "host_group")
# Seconds per unit: per tile, segment, row and call of a kernel call; per row of a pass
# around the calls; per byte over a link and per message; the host's per layer, per call
# (each direction) and per message posted.
PARAMS = tuple(f"{t}_{p}" for t in KERNEL_TERMS for p in ("fwd", "bwd")) + LINK_TERMS + HOST_TERMS
_I = {name: i for i, name in enumerate(PARAMS)}
FREE = KERNEL_TERMS + LINK_TERMS + HOST_TERMS  # what the fit solves for
BWD_OVER_FWD = 2.5  # attention's backward FLOPs over its forward's (FlashAttention's count)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2, "float32": 4, "fp32": 4}
# Where the fit starts (seconds per unit; H200-like), before the critical paths are re-found.
START = dict(
    tile=0.2e-6,
    seg=0.3e-6,
    row=3e-9,
    call=20e-6,
    byte=2.4e-12,
    message=30e-6,
    host_layer=1e-3,
    host_call=0.15e-3,
    host_message=50e-6,
    host_multi=0.3e-3,
    host_group=0.3e-3,
    a2a_byte=2.4e-12,
)
START["pass"] = 2e-9


# ----------------------------------------------------------------------------- what a rank does


@dataclass(frozen=True)
class Call:
    """One kernel call: causal (the diagonal) or full, its visible pairs, query + key rows,
    varlen segments, ``TILE`` x ``TILE`` tiles visited, query rows (default: half the rows)."""

    causal: bool
    pairs: float
    rows: int
    segments: int = 1
    tiles: float = 0.0
    q_rows: Optional[int] = None

    @property
    def queries(self) -> int:
        return self.rows // 2 if self.q_rows is None else self.q_rows


@dataclass(frozen=True)
class Step:
    """Ring step s of a rank: rows sent to rank + s, rows received from rank - s, its call."""

    n_send: int
    n_recv: int
    call: Optional[Call]


@dataclass(frozen=True)
class Gather:
    """A rank's gather exchange: rows it sends (all destinations) and receives, rows its
    call reads through an index (``key_rows``, 0: the buffer as it is), sent rows summed
    before adding home (``home_slot``, 0: none repeat), and the call (None: sees nothing)."""

    n_send: int
    n_recv: int
    key_rows: int
    home_slot: int
    call: Optional[Call]


@dataclass(frozen=True)
class RankWork:
    """A rank's share of one layer call, as its ``DocumentPlan`` has it. ``keep``: the
    forward's messages are kept for the backward (the group's decision, the same on every
    rank); ``gather``: the gather exchange (None: the ring's ``steps``, or nothing moves);
    ``posts_first``: the ring's forward posts every step's messages before its local calls
    (``DocumentPlan.posts_steps_first``), else each step's after the step before."""

    local: tuple
    steps: tuple
    keep: bool = True
    gather: Optional[Gather] = None
    exchange: str = "ring"
    posts_first: bool = False

    @property
    def calls(self) -> int:
        """Kernel calls of the forward (the backward makes as many)."""
        extra = self.gather is not None and self.gather.call is not None
        return len(self.local) + sum(s.call is not None for s in self.steps) + int(extra)

    @property
    def pairs(self) -> float:
        calls = list(self.local) + [s.call for s in self.steps if s.call is not None]
        if self.gather is not None and self.gather.call is not None:
            calls.append(self.gather.call)
        return sum(c.pairs for c in calls)

    @property
    def one_call(self) -> bool:
        """The one-call path: one kernel call, nothing sent or received (no merges)."""
        moves = any(s.n_send or s.n_recv for s in self.steps) or self.gather is not None
        return self.calls == 1 and not moves

    @property
    def messages(self) -> int:
        """Exchanges this rank posts in a forward and backward (host work)."""
        again = 1 if self.keep else 2
        if self.exchange == "gather":
            return (1 + again) if self.gather is not None else 0
        posted = sum(bool(s.n_send or s.n_recv) for s in self.steps)
        return posted * (1 + again)


def _call(block) -> Call:
    seg = block.segments
    q = np.diff(seg.cu_seqlens_q.detach().cpu().numpy().astype(np.int64))
    k = np.diff(seg.cu_seqlens_k.detach().cpu().numpy().astype(np.int64))
    qt, kt = -(-q // TILE), -(-k // TILE)
    tiles = float(np.sum(qt * (qt + 1) // 2) if block.causal else np.sum(qt * kt))
    n_q, n_k = int(block.q_ids.shape[1]), int(block.k_ids.shape[1])
    return Call(bool(block.causal), float(block.pairs), n_q + n_k, len(q), tiles, n_q)


def _count(t) -> int:
    return 0 if t is None else int(t.numel())


def rank_work(plan, late_posts: bool = False) -> RankWork:
    """The counts of a ``longctx.documents.DocumentPlan`` the model reads. ``late_posts``: as
    the ring ran before it posted every step first (each step's messages after the step
    before), for measurements of that code."""
    steps = tuple(
        Step(int(ex.n_send), int(ex.n_recv), None if ex.call is None else _call(ex.call)) for ex in plan.exchanges
    )
    exchange = getattr(plan, "exchange", "ring")
    gather = None
    g = getattr(plan, "gather", None)
    if g is not None:
        gather = Gather(
            int(g.n_send),
            int(g.n_recv),
            _count(g.key_rows),
            _count(g.home_slot),
            None if g.call is None else _call(g.call),
        )
    posts_first = plan.posts_steps_first and not late_posts
    return RankWork(
        tuple(_call(c) for c in plan.local_calls), steps, plan.keeps_messages, gather, exchange, posts_first
    )


def _works(plans) -> list:
    works = [p if isinstance(p, RankWork) else rank_work(p) for p in plans]
    world = len(works)
    if not works:
        raise ValueError("need one plan per rank, in rank order (got none)")
    if len({w.exchange for w in works}) != 1:
        raise ValueError("plans disagree on the exchange")
    if works[0].exchange == "gather":
        if len({w.gather is None for w in works}) != 1:
            raise ValueError("plans disagree: some ranks gather, some do not")
        if any(w.steps for w in works):
            raise ValueError("a gather plan has no ring steps")
        if world > 1 and works[0].gather is not None:
            if sum(w.gather.n_send for w in works) != sum(w.gather.n_recv for w in works):
                raise ValueError("plans disagree: rows sent and received in the all-to-all differ")
        return works
    if any(len(w.steps) != world - 1 for w in works):
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
        c = self.costs
        return dict(
            machine=self.machine,
            kv_bytes_per_row=self.kv_bytes_per_row,
            grad_bytes_per_row=self.grad_bytes_per_row,
            tile=TILE,
            costs_s={name: float(c[name]) for name in PARAMS},
            rates={
                **{f"{t}_{p}_us": c[f"{t}_{p}"] * 1e6 for t in KERNEL_TERMS for p in ("fwd", "bwd")},
                "link_bytes_per_s": None if c["byte"] <= 0 else 1.0 / c["byte"],
                "message_us": c["message"] * 1e6,
                "all_to_all_bytes_per_s": None if c["a2a_byte"] <= 0 else 1.0 / c["a2a_byte"],
                **{f"{t}_us": c[t] * 1e6 for t in HOST_TERMS},
            },
            fit=self.fit,
        )

    @classmethod
    def from_json(cls, data: dict) -> "Rates":
        data = data.get("rates_json", data)  # a scaling_model output file holds its rates there
        missing = [name for name in PARAMS if name not in data["costs_s"]]
        if missing:
            raise ValueError(f"rates JSON lacks {missing}: written by an older scaling_model.py, refit it")
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


def host_time(calls: int, messages: int = 0, multi: Optional[bool] = None, group: bool = False) -> np.ndarray:
    """The host's time to queue a rank's forward and backward of ``calls`` kernel calls
    each and ``messages`` exchanges posted; ``multi``: the several-call path (merges and
    accumulators; default: more than one call); ``group``: the distributed path (P > 1)."""
    t = _zero()
    t[_I["host_layer"]], t[_I["host_call"]], t[_I["host_message"]] = 1, 2 * calls, messages
    t[_I["host_multi"]] = float(calls > 1 if multi is None else multi)
    t[_I["host_group"]] = float(group)
    return t


def _call_time(call: Call, phase: str, passes: bool = False) -> np.ndarray:
    """A call's kernel time; ``passes``: with the merge / accumulator passes around it
    (forward its query rows, backward its query and key rows)."""
    t = _zero()
    t[_I[f"tile_{phase}"]] += call.tiles
    t[_I[f"seg_{phase}"]] += call.segments
    t[_I[f"row_{phase}"]] += call.rows
    t[_I[f"call_{phase}"]] += 1
    if passes:
        t[_I[f"pass_{phase}"]] += call.queries if phase == "fwd" else call.rows
    return t


def _passes(rows: float, phase: str) -> np.ndarray:
    t = _zero()
    t[_I[f"pass_{phase}"]] = rows
    return t


def _calls_time(calls, phase: str, passes: bool) -> np.ndarray:
    return sum((_call_time(c, phase, passes) for c in calls), _zero())


class _Timeline:
    """Event times of every rank as linear forms in the costs (coefficient vectors), so that
    the critical path's coefficients are what the fit solves with."""

    def __init__(self, works: list, cost: np.ndarray, kv_bytes: float, grad_bytes: float):
        self.works, self.cost, self.kv_bytes, self.grad_bytes = works, cost, kv_bytes, grad_bytes
        self.world = len(works)
        self.link_free = [_zero() for _ in works]
        self.passes = [not w.one_call for w in works]

    def later(self, a: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
        return a if b is None or a @ self.cost >= b @ self.cost else b

    def latest(self, times) -> np.ndarray:
        out = None
        for t in times:
            out = t if out is None else self.later(out, t)
        return out

    def _move(self, rows: float, row_bytes: float, byte: str = "byte") -> np.ndarray:
        move = _zero()
        move[_I[byte]] = rows * row_bytes
        move[_I["message"]] = 1
        return move

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
            done[r] = self.link_free[r] = begin + self._move(max(out_rows[r], in_rows[r]), row_bytes)
        return done

    def all_to_all(self, ready: list, out_rows: list, in_rows: list, row_bytes: float) -> list:
        """A collective: it starts once every rank has posted it (and its link is free); each
        rank's part completes after its larger side."""
        begin = self.latest(self.later(ready[r], self.link_free[r]) for r in range(self.world))
        done = [begin + self._move(max(out_rows[r], in_rows[r]), row_bytes, "a2a_byte") for r in range(self.world)]
        self.link_free = list(done)
        return done

    # -- the ring

    def _stack(self, step: int, phase: str) -> list:
        return [_passes(w.steps[step - 1].n_send if self.passes[r] else 0, phase) for r, w in enumerate(self.works)]

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
        return _zero() if call is None else _call_time(call, phase, self.passes[r])

    def _ring(self) -> list:
        P, works = self.world, self.works
        clock = [_zero() for _ in works]
        # Forward: step 1's K/V stacked and sent at once, while the local calls run; a rank
        # that posts every step first stacks and posts them all there, the others each step's
        # when they start the step before it.
        posted = {}
        if P > 1:
            for step in range(1, P):
                stack = self._stack(step, "fwd")
                for r, w in enumerate(works):
                    if step == 1 or w.posts_first:
                        clock[r] = clock[r] + stack[r]
                        posted[r, step] = clock[r]
        arriving = self._kv(1, [posted[r, 1] for r in range(P)]) if P > 1 else None
        clock = [clock[r] + _calls_time(w.local, "fwd", self.passes[r]) for r, w in enumerate(works)]
        for step in range(1, P):
            start = [self.later(clock[r], arriving[r]) for r in range(P)]
            if step + 1 < P:
                stack = self._stack(step + 1, "fwd")
                for r, w in enumerate(works):
                    if not w.posts_first:
                        start[r] = start[r] + stack[r]
                        posted[r, step + 1] = start[r]
                arriving = self._kv(step + 1, [posted[r, step + 1] for r in range(P)])
            clock = [start[r] + self._step_call(r, step, "fwd") for r in range(P)]
        # Backward: steps first (K/V kept, or exchanged again), dK/dV home after each, local last.
        keep = all(w.keep for w in works)
        if P > 1 and not keep:
            clock = [c + s for c, s in zip(clock, self._stack(1, "fwd"))]
            arriving = self._kv(1, clock)
        home = [[] for _ in works]
        for step in range(1, P):
            start = clock
            if not keep:
                start = [self.later(clock[r], arriving[r]) for r in range(P)]
                if step + 1 < P:
                    start = [s + x for s, x in zip(start, self._stack(step + 1, "fwd"))]
                    arriving = self._kv(step + 1, start)
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
        ends = []
        for r, w in enumerate(works):
            end = clock[r] + _calls_time(w.local, "bwd", self.passes[r])
            end = self.latest([end, *home[r]])
            if self.passes[r]:
                end = end + _passes(sum(s.n_send for s in w.steps), "bwd")  # dK/dV added home
            ends.append(end)
        return ends

    # -- the gather

    def _gather(self) -> list:
        P, works = self.world, self.works
        gs = [w.gather for w in works]
        if gs[0] is None:  # nothing moves anywhere: the local calls alone
            return [
                _calls_time(w.local, "fwd", self.passes[r]) + _calls_time(w.local, "bwd", self.passes[r])
                for r, w in enumerate(works)
            ]
        sends, recvs = [g.n_send for g in gs], [g.n_recv for g in gs]

        def gather_call(r, phase):
            g = gs[r]
            if g.call is None:
                return _zero()
            index = _passes(g.key_rows, phase)  # index_select forward, the per-row sum backward
            if phase == "bwd" and not g.key_rows:
                index = _passes(g.n_recv, phase)  # the cast into the message home
            return _call_time(g.call, phase, True) + index

        stacked = [_passes(n, "fwd") for n in sends]
        arriving = self.all_to_all(stacked, sends, recvs, self.kv_bytes)
        clock = [stacked[r] + _calls_time(w.local, "fwd", True) for r, w in enumerate(works)]
        clock = [self.later(clock[r], arriving[r]) + gather_call(r, "fwd") for r in range(P)]
        if not all(w.keep for w in works):  # the rows travel again
            clock = [c + s for c, s in zip(clock, stacked)]
            arriving = self.all_to_all(clock, sends, recvs, self.kv_bytes)
            clock = [self.later(clock[r], arriving[r]) for r in range(P)]
        clock = [clock[r] + gather_call(r, "bwd") for r in range(P)]
        back = self.all_to_all(clock, recvs, sends, self.grad_bytes)
        ends = []
        for r, w in enumerate(works):
            end = self.later(clock[r] + _calls_time(w.local, "bwd", True), back[r])
            ends.append(end + _passes(gs[r].n_send + gs[r].home_slot, "bwd"))
        return ends

    def run(self, host: bool = True) -> np.ndarray:
        """Coefficients of the layer's fwd+bwd time: the last rank's finish, or the busiest
        rank's host time where that is longer (``host=False``: the GPUs alone)."""
        gather = self.works[0].exchange == "gather" and self.world > 1
        ends = self._gather() if gather else self._ring()
        if host:
            ends += [host_time(w.calls, w.messages, not w.one_call, self.world > 1) for w in self.works]
        return self.latest(ends)


def coefficients(plans, cost: np.ndarray, kv_bytes: float, grad_bytes: float, host: bool = True) -> np.ndarray:
    """The critical path's units of each of ``PARAMS`` (time = coefficients @ costs)."""
    return _Timeline(_works(plans), np.asarray(cost, dtype=np.float64), kv_bytes, grad_bytes).run(host)


def predict(plans, rates: Rates) -> float:
    """Predicted fwd+bwd seconds of one layer call, from every rank's plan (or ``RankWork``)."""
    cost = rates.vector()
    return float(coefficients(plans, cost, rates.kv_bytes_per_row, rates.grad_bytes_per_row) @ cost)


def bounds(plans, rates: Rates) -> dict:
    """What sets the predicted time, in seconds: ``gpu`` (the devices' timeline, host free),
    ``host`` (the busiest rank's host time), ``free_messages`` (the GPU timeline with messages
    costing their bytes only: how much the per-message cost weighs)."""
    works = _works(plans)
    cost = rates.vector()
    free = cost.copy()
    free[_I["message"]] = 0.0
    b = rates.kv_bytes_per_row, rates.grad_bytes_per_row
    return dict(
        gpu=float(coefficients(works, cost, *b, host=False) @ cost),
        host=max(float(host_time(w.calls, w.messages, not w.one_call, len(works) > 1) @ cost) for w in works),
        free_messages=float(coefficients(works, free, *b, host=False) @ free),
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
        if name in KERNEL_TERMS:
            tie[_I[f"{name}_fwd"], j] = 1.0
            tie[_I[f"{name}_bwd"], j] = bwd_over_fwd
        else:
            tie[_I[name], j] = 1.0
    return tie


def fit(
    measurements: Sequence[Measured],
    *,
    kv_bytes_per_row: float,
    grad_bytes_per_row: float,
    bwd_over_fwd: float = BWD_OVER_FWD,
    prior: Optional[Rates] = None,
    machine: str = "",
    iterations: int = 60,
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

    def design(free: np.ndarray, host: bool = True) -> np.ndarray:
        cost = tie @ free
        rows = []
        for m, w in zip(measurements, works):
            units = m.units if w is None else _Timeline(w, cost, kv_bytes_per_row, grad_bytes_per_row).run(host)
            rows.append(units @ tie)
        return np.array(rows) / seconds[:, None]

    def solve(free: np.ndarray, host: bool = True):
        a = design(free, host)
        norms = np.linalg.norm(a, axis=0)
        known = (norms > 1e-12 * max(norms.max(), 1e-300)) & ~np.isin(FREE, list(without))
        solution = free.copy()  # what this path does not see keeps its value for the next
        solution[known] = nnls(a[:, known] / norms[known], np.ones(len(seconds)), maxiter=50 * len(FREE))[0]
        solution[known] /= norms[known]
        return solution, known

    # Start from ``START`` and from the GPUs alone (every time a GPU timeline), each with
    # several host starts (as START, slower, faster): the critical paths found depend on it.
    base = prior_free.copy() if prior_free is not None else np.array([START[name] for name in FREE])
    host = np.isin(FREE, HOST_TERMS)
    gpu_only = solve(base, host=False)[0]
    best = None
    for kernel, scale in [(k, x) for k in (base, gpu_only) for x in (1.0, 3.0, 0.3)]:
        free = np.where(host, base * scale, kernel)
        seen = []
        for _ in range(iterations):
            solution, known = solve(free)
            residual = float(np.linalg.norm(design(solution) @ solution - 1.0))
            if best is None or residual < best[0]:
                best = (residual, solution, known)
            if any(np.allclose(solution, x, rtol=1e-9, atol=0) for x in seen):
                break  # a fixed point, or a cycle of critical paths: the best of it is kept
            seen.append(solution)
            free = solution
    residual, free, known = best
    free = free.copy()
    free[~known] = 0.0 if prior_free is None else prior_free[~known]
    residual = float(np.linalg.norm(design(free) @ free - 1.0))
    undetermined = [name for name, k in zip(FREE, known) if not k]
    return Rates(
        costs=dict(zip(PARAMS, (tie @ free).tolist())),
        kv_bytes_per_row=kv_bytes_per_row,
        grad_bytes_per_row=grad_bytes_per_row,
        machine=machine,
        fit=dict(
            points=len(measurements),
            parameters=int(known.sum()),
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


def leave_one_out(measurements: Sequence[Measured], key: str = "mix", **fit_args) -> list:
    """For each value of ``label[key]`` among the plan points: fit without its points (the
    link and host points stay) and predict them. Returns [{key, ..., error}] per point."""
    groups = list(dict.fromkeys(m.label.get(key) for m in measurements if m.plans is not None))
    out = []
    for g in groups:
        held = [m for m in measurements if m.plans is not None and m.label.get(key) == g]
        rest = [m for m in measurements if not (m.plans is not None and m.label.get(key) == g)]
        rates = fit(rest, **fit_args)
        for m in held:
            got = measured_seconds(m, rates)
            out.append({**_point_label(m), "predicted_ms": round(got * 1e3, 3), "error": round(got / m.seconds - 1, 4)})
    return out


def _point_label(m: Measured) -> dict:
    label = m.label
    return dict(
        mix=label.get("mix", label.get("kind", "")),
        S=label.get("S", ""),
        P=label.get("P", ""),
        arrangement=label.get("arrangement", "comm only"),
        exchange=label.get("exchange", ""),
        measured_ms=round(m.seconds * 1e3, 3),
    )


def error_summary(rows: Sequence[dict]) -> dict:
    """Largest and rms |relative error| per mix and per (mix, P) of report rows."""
    groups: dict = {}
    for row in rows:
        for key in (row["mix"], f"{row['mix']} P={row['P']}"):
            groups.setdefault(key, []).append(row["error"])
    return {
        k: dict(max=round(float(np.max(np.abs(v))), 4), rms=round(float(np.sqrt(np.mean(np.square(v)))), 4), n=len(v))
        for k, v in groups.items()
    }


# ----------------------------------------------------------------------------- inputs


def read_ring_results(path: str) -> dict:
    """Measured document-attention times from ``benchmarks/document_attention.py --part ring``
    output: ``{"shape": ..., "points": [{mix, S, P, arrangement, exchange, seconds, ...}]}``.
    P = 1 is the best one-GPU path (the fastest provider other than flex_attention); P =
    world_size every timed arrangement (packed, balanced) x exchange (ring: ``{arr}_ms``,
    gather: ``{arr}_gather_ms``)."""
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
            for exchange in ("ring", "gather"):
                name = f"{arrangement}_ms" if exchange == "ring" else f"{arrangement}_{exchange}_ms"
                ms = row.get(name)
                if ms is None and exchange == "ring" and arrangement == "balanced" and "balanced_gather_ms" not in row:
                    ms = row.get("ms")  # older files: one balanced ring time
                if ms:
                    points.append(
                        dict(
                            mix=key[0], S=key[1], P=world, arrangement=arrangement, exchange=exchange, seconds=ms * 1e-3
                        )
                    )
    for (mix, S), ms in one.items():
        points.append(dict(mix=mix, S=S, P=1, arrangement="packed", exchange="ring", seconds=ms * 1e-3))
    for p in points:
        p.update(source=os.path.basename(path), check=checks.get((p["mix"], p["S"]), {}))
    return dict(shape=shape, points=points, machine=f"{data.get('gpu', '')} x{world}")


def merge_points(points: Sequence[dict]) -> list:
    """One point per (mix, S, P, arrangement, exchange): the mean of the files that timed it
    (the one-GPU rows of every file), with their spread."""
    groups: dict = {}
    for p in points:
        groups.setdefault((p["mix"], p["S"], p["P"], p["arrangement"], p["exchange"]), []).append(p)
    merged = []
    for ps in groups.values():
        seconds = [p["seconds"] for p in ps]
        m = dict(ps[0], seconds=float(np.mean(seconds)), source=", ".join(sorted({p["source"] for p in ps})))
        if len(ps) > 1:
            m["spread"] = round(max(seconds) / min(seconds) - 1, 4)
        merged.append(m)
    return merged


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
            messages=int(c.get("messages", 0)),
            seconds=c["host_ms"] * 1e-3,
            source=os.path.basename(path),
        )
        for c in data.get("cases", [])
        if c.get("host_ms") and c.get("calls") and not c.get("fused")
    ]


def read_host_overhead(path: str) -> list:
    """Host time of one document layer's forward+backward on one GPU
    (``benchmarks/fa4_host_overhead.py``: its ``ours_layer_fwd_bwd`` row, one call):
    [{mix, P, calls, seconds}]."""
    with open(path) as f:
        data = json.load(f)
    out = []
    for c in data.get("cases", []):
        row = c.get("rows", {}).get("ours_layer_fwd_bwd", {})
        if row.get("host_us"):
            out.append(
                dict(
                    mix=f"{c['mix']} S={c['S']}",
                    P=1,
                    calls=int(c.get("calls", 1)),
                    messages=0,
                    seconds=row["host_us"] * 1e-6,
                    source=os.path.basename(path),
                )
            )
    return out


def host_measurement(point: dict) -> Measured:
    return Measured(
        point["seconds"],
        units=host_time(point["calls"], point.get("messages", 0)),
        label=dict(kind="host", mix="host", P=point["P"], arrangement=f"{point['mix']}, {point['calls']} call(s)"),
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
def mix_work(
    mix: str,
    S: int,
    P: int,
    arrangement: str,
    seed: int = 0,
    layout: str = "zigzag",
    exchange: str = "ring",
    late_posts: bool = False,
) -> tuple:
    """Every rank's ``RankWork`` for the benchmark's ``mix`` at ``S`` tokens on P ranks: the
    packed sequence, or (``arrangement="balanced"``) ``balance_documents``' arrangement of it,
    by ``exchange`` (``late_posts``: see ``rank_work``)."""
    from longctx import balance_documents
    from longctx.documents import plan_documents

    ids = _mix_ids(mix, S, seed)[0]
    if P > 1 and arrangement == "balanced":
        ids = balance_documents({"document_ids": ids}, world_size=P, layout=layout)["document_ids"]
    return tuple(
        rank_work(plan_documents(ids, world_size=P, rank=r, layout=layout, exchange=exchange), late_posts)
        for r in range(P)
    )


def _check_mix(point: dict, seed: int) -> None:
    summary = _mix_ids(point["mix"], point["S"], seed)[1]
    for key, want in point.get("check", {}).items():
        if summary[key] != want:
            raise ValueError(
                f"{point['source']}: mix {point['mix']} at S={point['S']} has {key}={want}, but seed {seed} "
                f"regenerates {summary[key]}: pass the benchmark's --seed"
            )


# ----------------------------------------------------------------------------- the CLI

OPTIONS = tuple((a, e) for a in ("packed", "balanced") for e in ("ring", "gather"))


def _table(rows: list, columns: list) -> str:
    cells = [[str(c) for c in columns]] + [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def prediction_grid(mixes, seqs, sizes, rates: Rates, seed: int, layout: str, measured=()) -> list:
    """Per (mix, S, P): every arrangement x exchange's predicted ms, the fastest, its speed-up
    over the predicted P = 1 and what bounds it."""
    grid = []
    for mix in mixes:
        for S in seqs:
            one = predict(list(mix_work(mix, S, 1, "packed", seed, layout)), rates)
            for P in sizes:
                row = dict(mix=mix, S=S, P=P)
                options = [("packed", "ring")] if P == 1 else OPTIONS
                times = {}
                for arrangement, exchange in options:
                    ws = list(mix_work(mix, S, P, arrangement, seed, layout, exchange))
                    times[(arrangement, exchange)] = (predict(ws, rates), ws)
                    name = f"{arrangement}_{exchange}"
                    row[f"{name}_ms"] = round(times[(arrangement, exchange)][0] * 1e3, 3)
                    for p in measured:
                        if (p["mix"], p["S"], p["P"], p["arrangement"], p["exchange"]) == (
                            mix,
                            S,
                            P,
                            arrangement,
                            exchange,
                        ):
                            row[f"{name}_measured_ms"] = round(p["seconds"] * 1e3, 3)
                (arrangement, exchange), (t, ws) = min(times.items(), key=lambda kv: kv[1][0])
                pairs = np.array([w.pairs for w in ws])
                row.update(
                    best=f"{arrangement} {exchange}",
                    best_ms=round(t * 1e3, 3),
                    speedup=round(one / t, 2),
                    imbalance=round(float(pairs.max() / pairs.mean()), 3) if pairs.mean() else 1.0,
                    max_calls=max(w.calls for w in ws),
                    **{f"{k}_ms": round(v * 1e3, 3) for k, v in bounds(ws, rates).items() if k != "free_messages"},
                )
                grid.append(row)
    return grid


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", nargs="+", required=True, help="document_attention.py --part ring JSON files")
    ap.add_argument("--link", nargs="*", default=[], help="benchmarks/ring.py JSON files with a breakdown section")
    ap.add_argument("--host", nargs="*", default=[], help="benchmarks/document_profile.py JSON files (host times)")
    ap.add_argument(
        "--host-overhead", nargs="*", default=[], help="benchmarks/fa4_host_overhead.py JSON files (one layer's host)"
    )
    ap.add_argument("--predict", nargs="+", type=int, default=[8, 16], help="CP sizes to predict (besides 1, 2, 4)")
    ap.add_argument(
        "--predict-seq", nargs="+", type=int, default=None, help="sequence lengths to predict (default: the measured)"
    )
    ap.add_argument("--out", default=None, help="JSON: the rates, every point's error and the predictions")
    ap.add_argument("--rates", default=None, help="use these rates (a rates or scaling_model JSON) instead of fitting")
    ap.add_argument("--prior", default=None, help="rates JSON for costs the measurements leave undetermined")
    ap.add_argument("--machine", default=None, help="name stored with the rates (default: from the measured file)")
    ap.add_argument("--seed", type=int, default=0, help="the benchmark's mix seed")
    ap.add_argument("--bwd-over-fwd", type=float, default=BWD_OVER_FWD)
    ap.add_argument("--no-loo", action="store_true", help="skip the leave-one-mix-out refits")
    ap.add_argument(
        "--late-posts",
        action="store_true",
        help="the measured runs posted each ring step's messages after the step before (longctx before "
        "DocumentPlan.posts_steps_first): model them so; the predictions follow the current plans",
    )
    ap.add_argument(
        "--grad-dtype", default=None, help="dtype of the dK/dV sent home (default: the input dtype, as FA4)"
    )
    return ap.parse_args(argv)


def point_rows(measurements, rates):
    """Per measurement: its label, the predicted ms, the relative error and (for plan
    points) whether the host or the GPU bounds it."""
    report_rows = []
    for m in measurements:
        got = measured_seconds(m, rates)
        row = dict(_point_label(m), predicted_ms=round(got * 1e3, 3), error=round(got / m.seconds - 1, 4))
        if m.plans is not None:
            b = bounds(m.plans, rates)
            row["bound"] = "host" if b["host"] >= b["gpu"] else "gpu"
            if "spread" in m.label:
                row["spread"] = m.label["spread"]
        report_rows.append(row)
    return report_rows


def print_predictions(grid, seqs, predict):
    print("\npredicted fwd+bwd per layer call, ms (every arrangement x exchange; the fastest, its speed-up")
    print("over the predicted P = 1; gpu: the GPU timeline alone, host: the busiest rank's host time):")
    columns = ["mix", "S", "P"] + [f"{a}_{e}_ms" for a, e in OPTIONS]
    print(_table(grid, columns + ["best", "best_ms", "speedup", "gpu_ms", "host_ms", "max_calls"]))
    for S in seqs:
        for P in predict:
            cells = [
                f"{r['mix']} {r['best_ms']} ms ({r['best']}, {r['speedup']}x)"
                for r in grid
                if (r["P"], r["S"]) == (P, S)
            ]
            print(f"\nS = {S}, P = {P}: " + ", ".join(cells))


def main(argv=None) -> int:
    args = parse_args(argv)

    readings = [read_ring_results(path) for path in args.measured]
    shape = readings[0]["shape"]
    for r in readings[1:]:
        if r["shape"] != shape:
            raise ValueError(f"measured files disagree on the shape: {shape} vs {r['shape']}")
    kv_bytes = bytes_per_row(shape["H"], shape["D"], shape["dtype"])
    grad_bytes = bytes_per_row(shape["H"], shape["D"], args.grad_dtype or shape["dtype"])
    layout = shape["layout"]
    points = merge_points([p for r in readings for p in r["points"]])
    for p in points:
        _check_mix(p, args.seed)

    def work(p):
        return list(
            mix_work(p["mix"], p["S"], p["P"], p["arrangement"], args.seed, layout, p["exchange"], args.late_posts)
        )

    measured = [Measured(p["seconds"], plans=work(p), label=p) for p in points]
    extra = [link_measurement(p) for path in args.link for p in read_link_results(path)]
    extra += [host_measurement(p) for path in args.host for p in read_host_results(path)]
    extra += [host_measurement(p) for path in args.host_overhead for p in read_host_overhead(path)]
    prior = None
    if args.prior:
        with open(args.prior) as f:
            prior = Rates.from_json(json.load(f))
    fit_args = dict(
        kv_bytes_per_row=kv_bytes,
        grad_bytes_per_row=grad_bytes,
        bwd_over_fwd=args.bwd_over_fwd,
        prior=prior,
        machine=args.machine or readings[0]["machine"],
    )
    if args.rates:
        with open(args.rates) as f:
            rates = Rates.from_json(json.load(f))
    else:
        rates = fit(measured + extra, **fit_args)
        rates.fit["sources"] = [os.path.basename(p) for p in args.measured + args.link + args.host + args.host_overhead]
        rates.fit["shape"] = shape
        rates.fit["measured_points"] = len(measured)

    report_rows = point_rows(measured + extra, rates)
    columns = ["mix", "S", "P", "arrangement", "exchange", "measured_ms", "predicted_ms", "error", "bound"]
    print(_table(report_rows, columns))
    plan_rows = [r for r in report_rows if r["mix"] not in ("link", "host")]
    summary = error_summary(plan_rows)
    per_mix = {k: v["max"] for k, v in summary.items() if " P=" not in k}
    print("\n|relative error| per mix and P (max / rms): ")
    print(", ".join(f"{k} {v['max']:.1%} / {v['rms']:.1%}" for k, v in summary.items()))
    n_params = rates.fit.get("parameters", len(FREE))
    within = sum(abs(r["error"]) <= 0.10 for r in plan_rows)
    print(f"{within} of {len(plan_rows)} measured points within 10%; {n_params} fitted parameters")

    loo = []
    if not args.rates and not args.no_loo:
        loo = leave_one_out(measured + extra, **fit_args)
        loo_summary = error_summary(loo)
        print("\nleave one mix out (fit without the mix, predict it), |relative error| max / rms:")
        print(", ".join(f"{k} {v['max']:.1%} / {v['rms']:.1%}" for k, v in loo_summary.items() if " P=" not in k))

    sizes = sorted({1, 2, 4, *args.predict, *(p["P"] for p in points)})
    seqs = args.predict_seq or sorted({p["S"] for p in points})
    mixes = list(dict.fromkeys(p["mix"] for p in points))
    grid = prediction_grid(mixes, seqs, sizes, rates, args.seed, layout, points)
    print_predictions(grid, seqs, args.predict)
    undetermined = rates.fit.get("undetermined")
    if undetermined:
        print(f"\nnote: {undetermined} not determined by the measurements (from {rates.fit.get('undetermined_from')})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    rates_json=rates.to_json(),
                    points=report_rows,
                    error_summary=summary,
                    per_mix_max_error=per_mix,
                    leave_one_mix_out=dict(points=loo, summary=error_summary(loo) if loo else {}),
                    predictions=grid,
                ),
                f,
                indent=1,
            )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
