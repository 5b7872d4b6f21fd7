"""The document plan of a packed batch under context parallelism: built once per step.

``plan_documents(full_ids, world_size=P, rank=r)`` reads the FULL sequence's document ids
(``(B, S)``, as given to the model: packed, or reordered by ``balance_documents``) once on
the host and decides everything the attention layers need for rank r, for every layer,
head group, ring step, recompute and backward of the step:

* the local step (r's queries over r's own keys): one causal call whose varlen segments
  are the runs of equal ids in r's shard, plus, for a document whose tokens lie in
  several separate runs of the shard (its two zigzag pieces), calls over the later runs
  against the earlier ones (full blocks; a document with m runs needs m - 1 of them);
* every other step s (r's queries over rank (r - s)'s keys): which of r's query rows see
  anything of that rank and which of its key rows they see - only rows of documents the
  two ranks share, and of those only the keys some query can see. Rank r - s sends
  exactly those rows (gathered, grouped by document), and r attends to them in one full
  varlen call (under the zigzag and contiguous layouts every query of a document there
  sees every key of it that any query sees: proved per chunk, checked here). A step with
  nothing to see moves nothing and launches nothing.

With ``exchange="gather"`` the same rows of every other rank arrive in one all-to-all and
the local step is followed by ONE full varlen call over them instead of P - 1 steps
(``GatherExchange``; its segments: ``longctx.gather_plan``). Either way the plan holds the
counts a cost model needs: ``rows_between`` (K/V rows per (source, destination) rank) and
``launches`` (every rank's kernel calls per forward under each exchange).

Everything the kernels take - row indices, ``cu_seqlens`` (``longctx.kernels.Segments``)
and per-row segment numbers for the kernels that mask with ids - is shipped to the device
in two copies per plan, so a layer reads nothing back to the host.
``ring_attention`` / ``ulysses_attention`` take the plan as ``document_ids``.

Visibility is the contract of ``ring_attention``: query i sees key j iff both carry the
same id in the same batch row (and j <= i in the sequence when causal).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from longctx.kernels import Segments, resolve_backend
from longctx.kernels.rows import Rows

from .gather_plan import gather_segments, returned_rows
from .gather_plan import ranges as _ranges
from .layouts import check_layout, check_seq_len, chunks_per_rank, rank_chunks
from .memory import ring_receive_buffers

EXCHANGES = ("ring", "gather")
ALIGN_BYTES = 16  # where each shipped index tensor starts (kernels take 16-byte aligned pointers)


@dataclass(frozen=True)
class BlockCall:
    """One kernel call: ``q[q_rows]`` against ``k[k_rows]`` (rows of the flattened
    ``(B * S_local)`` shard, or of a received message in its order), ``segments`` tiling
    both gathered sides, ``q_ids`` / ``k_ids`` the segment number of each gathered row
    (``(1, n)`` int32) for kernels that mask with ids; ``pairs`` visible (query, key) pairs."""

    causal: bool
    q_rows: Rows
    k_rows: Rows
    segments: Segments
    q_ids: torch.Tensor
    k_ids: torch.Tensor
    pairs: int


@dataclass(frozen=True)
class Exchange:
    """Ring step s of this rank: ``send_rows`` (``n_send`` of them) go to rank + s, rank -
    s sends ``n_recv`` rows, which this rank's ``call`` attends to (None: nothing)."""

    send_rows: Rows
    n_send: int
    n_recv: int
    call: Optional[BlockCall]


@dataclass(frozen=True)
class GatherExchange:
    """This rank's gather exchange (``longctx.gather_plan``): ``send_rows`` (``n_send``, by
    destination rank, ``send_splits`` to each; a row seen by several ranks repeats) go out
    in one all-to-all that brings ``n_recv`` rows (``recv_splits`` from each rank, by
    source). ``call`` attends to the received rows ``key_rows`` (None: all, in order; rows
    may repeat; ``key_sums``, with ``key_rows``: ``(order, starts, most)`` for
    ``kernels.rows.sum_rows_``, which sums each received row's dK/dV partials in one pass: the
    call's key positions grouped by received row, each row's first place in ``order``, the
    most reads of one row; ``keys_permuted``: every received row read exactly once, in
    another order, so that pass only copies); None: this rank's queries see nothing received.
    Back home, the dK/dV partials of the sent rows add into ``home_rows``, first summed by
    ``home_slot`` (each sent row's place among ``home_rows``) where a row was sent more than
    once."""

    send_rows: Rows
    n_send: int
    send_splits: tuple
    n_recv: int
    recv_splits: tuple
    key_rows: Optional[torch.Tensor]
    call: Optional[BlockCall]
    home_rows: Rows
    home_slot: Optional[torch.Tensor]
    key_sums: Optional[tuple] = None

    @property
    def keys_permuted(self) -> bool:
        return self.key_sums is not None and self.key_sums[2] == 1 and self.key_rows.numel() == self.n_recv


class DocumentPlan:
    """Rank ``rank``'s document plan for one batch (see the module doc); build it with
    ``plan_documents``. ``one_document``: every batch row is a single document, so no mask
    is needed at all (the plain ring runs). ``exchange``: how the other ranks' K/V rows
    come ("ring": P - 1 point-to-point steps, "gather": one all-to-all and one call).
    ``local_calls``: the local step; ``exchanges[s - 1]``: ring step s (empty for
    "gather"); ``gather``: the ``GatherExchange`` (None for "ring", or where no rank of the
    group receives anything); ``pairs``: visible (query, key) pairs of every rank's queries
    (``pairs[r] / pairs.mean()`` is the load imbalance); ``rows_between[i, j]``: K/V rows
    rank i sends rank j in a forward (either exchange); ``received[r]``: K/V rows rank r
    receives (``moved``: their sum); ``launches[mode][r]``: kernel calls of rank r's
    forward under either exchange ("ring", "gather"), the chosen one's this rank's
    ``calls``."""

    def __init__(
        self,
        *,
        world_size,
        rank,
        layout,
        causal,
        batch,
        seq_len,
        device,
        one_document,
        local_calls,
        exchanges,
        pairs,
        received,
        fingerprint,
        full_doc=None,
        documents=0,
        shipped=None,
        exchange="ring",
        gather=None,
        rows_between=None,
        launches=None,
    ):
        self.world_size, self.rank, self.layout, self.causal = world_size, rank, layout, causal
        self.exchange = exchange
        self.gather: Optional[GatherExchange] = gather
        self.rows_between: Optional[np.ndarray] = rows_between
        self.launches: Optional[dict] = launches
        self.batch, self.seq_len, self.local_len = batch, seq_len, seq_len // world_size
        self.device = device
        self.one_document = one_document
        self.local_calls: list[BlockCall] = local_calls
        self.exchanges: list[Exchange] = exchanges
        self.documents = documents  # documents in the batch (every row's own)
        self._shipped = shipped  # (calls with placeholders, flat tensors): what ``to`` moves
        self.pairs: np.ndarray = pairs
        self.received: np.ndarray = received
        self.moved = int(received.sum())
        # Whether a layer keeps its forward's messages for the backward (at most one shard's
        # rows received on any rank): one decision for the whole group, as every rank's plan
        # holds every rank's count, and a rank that exchanges again needs its peers to.
        self.keeps_messages = int(received.max(initial=0)) <= self.batch * self.local_len
        # Whether the ring's forward posts every step's K/V before its local calls, so that each
        # transfer starts at once (a post waits for the kernels queued before it). Only where
        # this rank receives at most one shard (what it keeps) and sends at most the backward's
        # receive buffers the memory model counts (at least one shard). Every rank posts in the
        # same order either way.
        shard = self.batch * self.local_len
        sent = sum(ex.n_send for ex in exchanges)
        sendable = max(1, ring_receive_buffers(world_size)) * shard
        self.posts_steps_first = world_size > 1 and int(received[rank]) <= shard and sent <= sendable
        self.fingerprint = fingerprint
        self._full_doc = full_doc  # (B, S) document numbers, for sequence_calls
        self._sequence_calls: Optional[list[BlockCall]] = None
        self._checked: Optional[tuple] = None  # the last call check_call passed
        self._backends: dict = {}  # resolved backends by (asked, device, dtype, head dims): per step

    def __repr__(self) -> str:
        return (
            f"DocumentPlan(rank {self.rank} of {self.world_size}, {self.layout}, B={self.batch}, "
            f"S={self.seq_len}, {self.exchange}, imbalance {self.imbalance:.3f}, K/V rows moved {self.moved})"
        )

    def to(self, device, non_blocking: bool = True) -> "DocumentPlan":
        """This plan with its tensors on ``device`` (two copies; non-blocking from pinned host
        memory): a plan built on the host in the data pipeline reaches the GPU with the batch."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        flats = self._flats()
        return self._with_flats({key: flat.to(device, non_blocking=non_blocking) for key, flat in flats.items()})

    def pin_memory(self) -> "DocumentPlan":
        """This plan with its host tensors in pinned memory (the DataLoader's pin-memory thread
        calls it), so that ``to("cuda")`` copies without blocking."""
        if self.device.type != "cpu" or not torch.cuda.is_available():
            return self
        return self._with_flats({key: flat.pin_memory() for key, flat in self._flats().items()})

    def _flats(self) -> dict:
        return self._shipped[1] if self._shipped is not None else {}

    def _with_flats(self, flats: dict) -> "DocumentPlan":
        pending = self._shipped[0]
        device = next(iter(flats.values())).device if flats else self.device
        plan = copy.copy(self)
        plan.device = device
        plan.local_calls, plan.exchanges, plan.gather = _resolve(pending, flats)
        plan._shipped = (pending, flats)
        plan._sequence_calls = plan._checked = None
        plan._backends = {}
        return plan

    def __getstate__(self) -> dict:
        # Pickled (DataLoader workers -> the training process) as the flat tensors and the
        # structure that refers to them; the per-call views are rebuilt on arrival.
        state = dict(self.__dict__)
        state["local_calls"] = state["exchanges"] = state["gather"] = None
        state["_sequence_calls"] = state["_checked"] = None
        state["_backends"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._shipped is not None:
            pending, flats = self._shipped
            self.local_calls, self.exchanges, self.gather = _resolve(pending, flats)

    @property
    def calls(self) -> int:
        """Kernel calls of this rank's forward under its exchange (the local step's, and
        every ring step's or the one gather call)."""
        if self.launches is not None:
            return int(self.launches[self.exchange][self.rank])
        return len(self.local_calls) + sum(ex.call is not None for ex in self.exchanges)

    @property
    def imbalance(self) -> float:
        """Busiest rank's visible pairs over the mean (1.0: balanced)."""
        mean = float(self.pairs.mean())
        return float(self.pairs.max()) / mean if mean else 1.0

    def sequence_calls(self) -> list[BlockCall]:
        """The calls of attention over the whole sequence (``B * S`` rows in sequence order),
        as Ulysses runs it after its all-to-all: built on first use, then reused."""
        if self._sequence_calls is None:
            ship = _Shipper()
            calls = _diagonal_calls(self._full_doc.reshape(-1), self.causal, ship)
            self._sequence_calls = ship.send(calls, self.device)
        return self._sequence_calls

    def backend(self, backend: str, q: torch.Tensor, k: torch.Tensor) -> str:
        """``resolve_backend`` for this plan's calls on q/k, asked once per (backend, device,
        dtype, head dims): every layer of the step asks the same, and the checks behind it
        (install, GPU, shape) are host time on each call."""
        key = (backend, q.device, q.dtype, q.shape[-1], k.shape[-1])
        name = self._backends.get(key)
        if name is None:
            name = self._backends[key] = resolve_backend(backend, q, k, self.causal, documents=True)
        return name

    def check_call(self, q: torch.Tensor, group, layout: str, causal: bool, name: str) -> None:
        """Raise ValueError where this rank's call does not match the plan (no collective)."""
        call = (group, layout, bool(causal), tuple(q.shape[:2]), q.device)
        if self._checked is not None and self._checked[0] is group and self._checked[1:] == call[1:]:
            return  # every layer of the step makes the same call: checked at the first
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        problems = []
        if (world, rank) != (self.world_size, self.rank):
            problems.append(
                f"the plan is for rank {self.rank} of {self.world_size}, the call runs on rank {rank} of {world}"
            )
        if layout != self.layout and self.world_size > 1:  # one rank: any layout is the sequence
            problems.append(f"the plan is for layout {self.layout!r}, the call uses {layout!r}")
        if bool(causal) != self.causal:
            problems.append(f"the plan is for causal={self.causal}, the call has causal={causal}")
        if tuple(q.shape[:2]) != (self.batch, self.local_len):
            problems.append(
                f"the plan is for shards (B, S_local) = {(self.batch, self.local_len)}, q has {tuple(q.shape[:2])}"
            )
        if torch.device(q.device) != self.device:
            problems.append(f"the plan's tensors are on {self.device}, q on {q.device}")
        if problems:
            raise ValueError(f"{name}: document plan does not fit this call: " + "; ".join(problems))
        self._checked = call

    def check_group(self, group) -> None:
        """Raise ValueError unless every rank of ``group`` built its plan from the same ids,
        world size, layout and causality (one small all-gather; once per step)."""
        if group is None or dist.get_world_size(group) == 1:
            return
        device = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        mine = torch.tensor(self.fingerprint, dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        differ = [r for r, t in enumerate(everyone) if not torch.equal(t, everyone[0])]
        if differ:
            raise ValueError(
                f"document plans differ across the context-parallel group (ranks {differ} "
                "built theirs from other ids, sizes or layout than rank 0): every rank of a "
                "group must plan the same full batch"
            )


def plan_documents(
    document_ids: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    layout: str = "zigzag",
    causal: bool = True,
    device=None,
    exchange: str = "ring",
) -> DocumentPlan:
    """Rank ``rank``'s ``DocumentPlan`` for the FULL sequence ids ``document_ids`` ``(B, S)``
    (or ``(S,)``), sharded over ``world_size`` ranks by ``layout``. One copy of the ids to
    the host; the plan's tensors go to ``device`` (default: the ids' device). ``exchange``:
    "ring" (P - 1 point-to-point steps, a kernel call each) or "gather" (one all-to-all and
    one kernel call per direction, ``longctx.gather_plan``); every rank of a group must
    choose the same."""
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(
            f"document_ids must be a torch.Tensor of the full sequence's ids, got {type(document_ids).__name__}"
        )
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must hold integers, got dtype {document_ids.dtype}")
    ids = document_ids[None] if document_ids.dim() == 1 else document_ids
    if ids.dim() != 2:
        raise ValueError(f"document_ids must be (B, S) or (S,), got shape {tuple(document_ids.shape)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is outside [0, {world_size})")
    check_layout(layout)
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be 'ring' or 'gather', got {exchange!r}")
    batch, seq_len = ids.shape
    if world_size > 1:
        check_seq_len(seq_len, world_size, layout)
    elif seq_len == 0:
        raise ValueError("document_ids hold no tokens")
    device = torch.device(device) if device is not None else ids.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    host = ids.detach().cpu().numpy().astype(np.int64, copy=False)
    doc = _document_numbers(host)
    one_document = bool((doc == doc[:, :1]).all())
    fingerprint = _fingerprint(host, world_size, layout, causal, exchange)

    owner, local = _layout_maps(seq_len, world_size, layout)
    s_local = seq_len // world_size
    tokens = [_Tokens.of(doc, owner, local, r, s_local) for r in range(world_size)]
    pairs = np.zeros(world_size, dtype=np.float64)
    rows_between = np.zeros((world_size, world_size), dtype=np.int64)  # [source, receiver]
    diagonal_calls = np.zeros(world_size, dtype=np.int64)
    step_calls = np.zeros(world_size, dtype=np.int64)  # ring steps where a rank's queries see keys
    ship = _Shipper()
    local_calls, exchanges, received_from, sent_to = [], [], {}, {}
    for r in range(world_size):
        diagonal = _diagonal_calls(tokens[r].doc, causal, ship if r == rank else None)
        pairs[r] += sum(call.pairs for call in diagonal)
        diagonal_calls[r] = len(diagonal)
        if r == rank:
            local_calls = diagonal
    for step in range(1, world_size):
        # What every rank's queries see of rank (r - step)'s keys; this rank sends what rank
        # + step's queries see of its own.
        seen = [_visible(tokens[r], tokens[(r - step) % world_size], causal) for r in range(world_size)]
        for r, (q_index, k_index, q_lens, k_lens) in enumerate(seen):
            pairs[r] += float(np.dot(q_lens, k_lens))
            rows_between[(r - step) % world_size, r] = len(k_index)
            step_calls[r] += bool(len(q_index))
        q_index, k_index, q_lens, k_lens = seen[rank]
        send = seen[(rank + step) % world_size][1]
        if exchange == "gather":
            received_from[(rank - step) % world_size], sent_to[(rank + step) % world_size] = k_index, send
            continue
        call = None if not len(q_index) else ship.call(False, ship.rows(q_index, s_local * batch), None, q_lens, k_lens)
        exchanges.append(
            Exchange(ship.rows(send, s_local * batch) if len(send) else None, len(send), len(k_index), call)
        )
    gather = None
    if exchange == "gather" and rows_between.any():  # else no rank of the group moves anything
        gather = _gather_exchange(tokens, rank, received_from, sent_to, causal, layout, seq_len, ship)
    pending = (local_calls, exchanges, gather)
    flats = ship.flats(device)
    local_calls, exchanges, gather = _resolve(pending, flats)
    return DocumentPlan(
        world_size=world_size,
        rank=rank,
        layout=layout,
        causal=bool(causal),
        batch=batch,
        seq_len=seq_len,
        device=device,
        one_document=one_document,
        local_calls=local_calls,
        exchanges=exchanges,
        pairs=pairs,
        received=rows_between.sum(axis=0),
        fingerprint=fingerprint,
        full_doc=doc,
        documents=int(doc.max(initial=-1)) + 1,
        shipped=(pending, flats),
        exchange=exchange,
        gather=gather,
        rows_between=rows_between,
        launches={"ring": diagonal_calls + step_calls, "gather": diagonal_calls + (step_calls > 0)},
    )


# ------------------------------------------------------------------------ host side


def _document_numbers(ids: np.ndarray) -> np.ndarray:
    """(B, S) ids -> document numbers unique over the whole batch (row b's ids are its own)."""
    out = np.empty(ids.shape, dtype=np.int64)
    offset = 0
    for b, row in enumerate(ids):
        values, inverse = np.unique(row, return_inverse=True)
        out[b] = inverse.reshape(-1) + offset
        offset += len(values)
    return out


def _fingerprint(ids: np.ndarray, world_size: int, layout: str, causal: bool, exchange: str) -> list:
    digest = hashlib.blake2b(np.ascontiguousarray(ids).tobytes(), digest_size=8)
    digest.update(f"{ids.shape}|{world_size}|{layout}|{bool(causal)}".encode())
    if exchange != "ring":  # ring plans keep the fingerprint they always had
        digest.update(f"|{exchange}".encode())
    return [int.from_bytes(digest.digest()[:7], "little")]


def _layout_maps(seq_len: int, world_size: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """(owner rank, local index) of every position of the full sequence."""
    per_rank = chunks_per_rank(layout) if world_size > 1 else 1
    chunk = seq_len // (world_size * per_rank)
    owner = np.empty(seq_len, dtype=np.int64)
    local = np.empty(seq_len, dtype=np.int64)
    for r in range(world_size):
        chunks = rank_chunks(r, world_size, layout) if world_size > 1 else (0,)
        for i, c in enumerate(chunks):
            owner[c * chunk : (c + 1) * chunk] = r
            local[c * chunk : (c + 1) * chunk] = np.arange(i * chunk, (i + 1) * chunk)
    return owner, local


@dataclass
class _Tokens:
    """One rank's tokens in the order of its flattened shard rows: document number and
    position in the sequence (comparable within a document)."""

    doc: np.ndarray
    pos: np.ndarray

    @classmethod
    def of(cls, doc: np.ndarray, owner: np.ndarray, local: np.ndarray, rank: int, s_local: int) -> "_Tokens":
        mine = np.flatnonzero(owner == rank)
        order = mine[np.argsort(local[mine], kind="stable")]  # positions in shard order
        return cls(doc[:, order].reshape(-1), np.tile(order, doc.shape[0]))


def _visible(receiver: _Tokens, source: _Tokens, causal: bool):
    """What the receiver's queries see of the source's keys (another rank's): (query rows,
    key rows, per-document query counts, per-document key counts), rows grouped by
    document (increasing), each group in shard order."""
    n_docs = int(max(receiver.doc.max(initial=-1), source.doc.max(initial=-1))) + 1
    if causal:
        first_key = np.full(n_docs, np.iinfo(np.int64).max)
        np.minimum.at(first_key, source.doc, source.pos)
        last_query = np.full(n_docs, -1)
        np.maximum.at(last_query, receiver.doc, receiver.pos)
        q_sel = np.flatnonzero(receiver.pos > first_key[receiver.doc])
        k_sel = np.flatnonzero(source.pos < last_query[source.doc])
    else:
        q_sel = np.flatnonzero(np.isin(receiver.doc, source.doc))
        k_sel = np.flatnonzero(np.isin(source.doc, receiver.doc))
    q_sel = q_sel[np.argsort(receiver.doc[q_sel], kind="stable")]
    k_sel = k_sel[np.argsort(source.doc[k_sel], kind="stable")]
    q_docs, q_lens = np.unique(receiver.doc[q_sel], return_counts=True)
    k_docs, k_lens = np.unique(source.doc[k_sel], return_counts=True)
    if not np.array_equal(q_docs, k_docs):
        raise RuntimeError("document plan: queries and keys of a ring step disagree on their documents")
    if causal and len(q_sel):
        # Each document is one full segment only if all its participating keys come before
        # all its participating queries (true for the zigzag and contiguous layouts).
        q_first = np.minimum.reduceat(receiver.pos[q_sel], np.concatenate(([0], np.cumsum(q_lens)[:-1])))
        k_last = np.maximum.reduceat(source.pos[k_sel], np.concatenate(([0], np.cumsum(k_lens)[:-1])))
        if np.any(q_first <= k_last):
            raise RuntimeError("document plan: a ring step's document is not one full block")
    return q_sel, k_sel, q_lens, k_lens


def _gather_exchange(tokens, rank, received_from, sent_to, causal, layout, seq_len, ship) -> GatherExchange:
    """This rank's ``GatherExchange``: the received buffer is the rows of every other rank
    its queries see (``received_from[source]``, by source rank), the message it sends the
    rows each rank sees of its own (``sent_to[rank]``, by destination rank)."""
    world, mine = len(tokens), tokens[rank]
    n, none = len(mine.doc), np.zeros(0, dtype=np.int64)
    parts = [(tokens[s], received_from.get(s, none)) for s in range(world)]
    k_doc = np.concatenate([t.doc[rows] for t, rows in parts])
    k_pos = np.concatenate([t.pos[rows] for t, rows in parts])
    s_local = seq_len // world
    q_chunk = np.arange(n) % s_local // (s_local // chunks_per_rank(layout))
    q_rows, key_rows, q_lens, k_lens = gather_segments(mine.doc, mine.pos, q_chunk, k_doc, k_pos, causal, seq_len)
    call = ship.call(False, ship.rows(q_rows, n), None, q_lens, k_lens) if len(q_rows) else None
    sent = np.concatenate([sent_to.get(j, none) for j in range(world)])
    send_rows = ship.rows(sent, n) if len(sent) else None
    home, slot = returned_rows(sent)
    in_order = len(key_rows) == len(k_doc) and np.array_equal(key_rows, np.arange(len(k_doc)))
    key_sums = None
    if not in_order:
        reads = np.bincount(key_rows, minlength=len(k_doc))
        key_sums = (
            ship.index(np.argsort(key_rows, kind="stable")),
            ship.index(np.concatenate(([0], np.cumsum(reads)))),
            int(reads.max(initial=0)),
        )
    return GatherExchange(
        send_rows=send_rows,
        n_send=len(sent),
        send_splits=tuple(len(sent_to.get(j, none)) for j in range(world)),
        n_recv=len(k_doc),
        recv_splits=tuple(len(received_from.get(s, none)) for s in range(world)),
        key_rows=None if in_order else ship.index(key_rows),
        call=call,
        home_rows=send_rows if slot is None else ship.rows(home, n),
        home_slot=None if slot is None else ship.index(slot),
        key_sums=key_sums,
    )


def _diagonal_calls(doc: np.ndarray, causal: bool, ship: Optional["_Shipper"]) -> list:
    """Calls of attention among rows in sequence order (one rank's shard, or the whole
    sequence): call 0 over every run of equal documents (causal), then call d over the
    runs that are d runs later in their document against those runs (full; for
    non-causal attention also the reverse). ``ship=None``: only the pair counts."""
    n = len(doc)
    cut = np.flatnonzero(doc[1:] != doc[:-1]) + 1
    starts = np.concatenate(([0], cut))
    lengths = np.diff(np.concatenate((starts, [n])))
    run_doc = doc[starts]
    if causal:
        own = float(np.sum(lengths * (lengths + 1) // 2))
    else:
        own = float(np.sum(lengths.astype(np.float64) ** 2))
    calls = [ship.call(causal, None, None, lengths, lengths, own) if ship else _Count(own)]
    by_doc = np.argsort(run_doc, kind="stable")  # runs grouped by document, in order
    grouped = run_doc[by_doc]
    first_of_doc = np.concatenate(([0], np.flatnonzero(grouped[1:] != grouped[:-1]) + 1))
    ordinal = np.arange(len(grouped)) - np.repeat(first_of_doc, np.diff(np.concatenate((first_of_doc, [len(grouped)]))))
    most = int(ordinal.max()) + 1 if len(ordinal) else 0
    for distance in range(1, most):
        later = by_doc[ordinal >= distance]
        earlier = by_doc[np.flatnonzero(ordinal >= distance) - distance]
        directions = [(later, earlier)] if causal else [(later, earlier), (earlier, later)]
        for q_runs, k_runs in directions:
            q_lens, k_lens = lengths[q_runs], lengths[k_runs]
            pairs = float(np.dot(q_lens, k_lens))
            if ship is None:
                calls.append(_Count(pairs))
                continue
            q_rows = _ranges(starts[q_runs], q_lens)
            k_rows = _ranges(starts[k_runs], k_lens)
            calls.append(ship.call(False, ship.rows(q_rows, n), ship.rows(k_rows, n), q_lens, k_lens, pairs))
    return calls


@dataclass
class _Count:
    pairs: float


class _Shipper:
    """Collects a plan's host arrays and sends them to the device in two copies (int64 row
    indices, int32 segment tables), then fills in the tensors."""

    def __init__(self):
        self.int64: list[np.ndarray] = []
        self.int32: list[np.ndarray] = []
        self.sizes = {True: 0, False: 0}  # elements collected so far (int64, int32)

    def _add(self, array: np.ndarray, dtype) -> "_Pending":
        wide = dtype == np.int64
        store = self.int64 if wide else self.int32
        array = np.ascontiguousarray(array, dtype=dtype)
        # Every view starts 16-byte aligned: FlashAttention-4 copies a misaligned index
        # tensor (cu_seqlens) on every call, a launch and host time per layer.
        gap = -self.sizes[wide] % (ALIGN_BYTES // array.itemsize)
        if gap:
            store.append(np.zeros(gap, dtype=dtype))
            self.sizes[wide] += gap
        offset = self.sizes[wide]
        self.sizes[wide] += array.size
        store.append(array)
        return _Pending(wide, offset, tuple(array.shape))

    def index(self, index: np.ndarray) -> "_Pending":
        """An int64 index tensor, whatever it holds."""
        return self._add(index, np.int64)

    def rows(self, index: np.ndarray, n: int):
        """None (all n rows in order), a slice (a contiguous range) or a pending index."""
        if len(index) == n and (n == 0 or (index[0] == 0 and np.all(np.diff(index) == 1))):
            return None
        if len(index) and index[-1] - index[0] + 1 == len(index) and np.all(np.diff(index) == 1):
            return slice(int(index[0]), int(index[-1]) + 1)
        return self._add(index, np.int64)

    def call(self, causal, q_rows, k_rows, q_lens, k_lens, pairs=None) -> BlockCall:
        segment = np.arange(len(q_lens), dtype=np.int32)
        cu_q = np.concatenate(([0], np.cumsum(q_lens)))
        cu_k = np.concatenate(([0], np.cumsum(k_lens)))
        return BlockCall(
            causal=bool(causal),
            q_rows=q_rows,
            k_rows=k_rows,
            segments=Segments(
                self._add(cu_q, np.int32),
                self._add(cu_k, np.int32),
                int(q_lens.max(initial=0)),
                int(k_lens.max(initial=0)),
            ),
            q_ids=self._add(np.repeat(segment, q_lens)[None], np.int32),
            k_ids=self._add(np.repeat(segment, k_lens)[None], np.int32),
            pairs=float(np.dot(q_lens, k_lens)) if pairs is None else pairs,
        )

    def flats(self, device) -> dict:
        """The collected arrays as two flat tensors on ``device`` (int64 rows, int32 tables)."""
        flats = {}
        for wide, store in ((True, self.int64), (False, self.int32)):
            if not store:
                continue
            flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in store]))
            if device.type == "cuda":
                flat = flat.pin_memory().to(device, non_blocking=True)
            else:
                flat = flat.to(device)
            flats[wide] = flat
        return flats

    def send(self, value, device):
        """``value`` with every pending array replaced by its tensor on ``device``."""
        return _resolve(value, self.flats(device))


@dataclass(frozen=True)
class _Pending:
    """Where one shipped array lies in its flat tensor."""

    wide: bool
    offset: int
    shape: tuple


def _resolve(value, flats: dict):
    """``value`` with every ``_Pending`` replaced by its view of ``flats``."""
    if isinstance(value, _Pending):
        size = int(np.prod(value.shape))
        return flats[value.wide][value.offset : value.offset + size].view(value.shape)
    if isinstance(value, list):
        return [_resolve(v, flats) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, flats) for v in value)
    if isinstance(value, Segments):
        return Segments(
            _resolve(value.cu_seqlens_q, flats),
            _resolve(value.cu_seqlens_k, flats),
            value.max_seqlen_q,
            value.max_seqlen_k,
        )
    if isinstance(value, (BlockCall, Exchange, GatherExchange)):
        return type(value)(**{f: _resolve(getattr(value, f), flats) for f in value.__dataclass_fields__})
    return value
