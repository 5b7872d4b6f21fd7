"""Load balance for document-masked context parallelism: a token permutation of the full
sequence that evens out the attention work of the zigzag ranks, exactly.

With packed documents and document masking, a token's attention work is the number of keys
it sees: its index in its document + 1 (causal). Zigzag evens out plain causal work, not
this: a rank whose chunks hold the tail of a long document does far more than one holding
short documents (``longctx.layouts.document_work_per_rank``: max/mean 1.2-1.9 on realistic
mixes at P = 2-8).

``balance_permutation(document_ids, P)`` gives ``perm`` with ``balanced = full[..., perm]``
such that, sharded with the zigzag layout (2P chunks of C = S/2P tokens, rank r holding
chunks r and 2P-1-r), every rank does about the same work (max/mean <= 1.03 on the mixes
of ``benchmarks/document_balance.py``):

* a *long* document (>= 2P kernel tiles of ``tile`` = 128 tokens) is cut into 2P nearly
  equal pieces of whole tiles, piece c going to chunk c (PyTorch CP's per-document
  head-tail: pieces r and 2P-1-r together cost every rank the same). Each chunk starts
  with these pieces, so they stay tile-aligned and two pieces of a document meet in
  unmasked tiles;
* the rest - *short* documents, kept whole where they fit (fragments cost the kernels
  masked tiles), and the < 128 odd tokens of cut ones - fills each chunk's tail, the
  costliest first onto the least-loaded rank; what fits in no chunk whole is split over
  neighbouring chunks. Documents shorter than a tile are poured into the room left, in
  order (vectorised: ~0.5 s for a million length-1 documents, 2 ms for realistic 128K
  sequences, 20-30 ms at 1M).

The ring runs in lock-step, so its time follows the busiest rank of every step (zigzag
with documents: up to 2.3x the ideal at P = 8 on those mixes). ``min_gain`` (default 1.2)
leaves a sequence as packed where balancing would shorten that by less, counted in
visible pairs: a balanced sequence costs the kernels masked tiles and unmasked blocks
inside one document, which the count does not see.

Why it is exact: ``ring_attention(document_ids=...)`` lets query i see key j iff their ids
are equal and (causal) j <= i in the sequence it is given. The permutation keeps every
document's tokens in their original relative order (pieces in increasing chunk order), so
each query sees the same keys as before; the order across documents is free under
document masking. Labels (shifted on the full sequence) and position ids travel with their
token, so RoPE and the (token-sum) loss are unchanged. Not valid for attention across
documents (plain causal): there the permutation changes the result.

``balance_documents(batch, world_size=P)`` applies it to every per-token tensor of a
full-sequence batch, before sharding, and renumbers the document ids (a bijection, so the
mask is the same) so that the kernels' tile skip test, which compares per-tile id ranges,
stays as tight as on the unbalanced batch. The model's outputs on a balanced batch are in
permuted order (``out[:, perm.argsort()]`` restores the original one).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .layouts import check_layout, check_seq_len
from .sharding import is_sharded

TILE = 128  # the document kernels' tile (kernels/triton_document.py): pieces are cut in whole tiles
# Balance only where the ring's lock-step time in visible pairs drops by 20% or more: a
# balanced sequence costs the kernels more per visible pair (documents cut into slivers over
# every ring step, masked tiles, no cuDNN blocks inside one document), which that count does
# not see (measured on an H200, benchmarks/NOTES.md).
MIN_GAIN = 1.2
# CausalLMModule's automatic choice also needs this many tokens per rank: below it the
# per-block costs of a balanced ring outweigh its gain (measured, benchmarks/NOTES.md).
AUTO_MIN_SHARD = 32 * 1024


def _documents(ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(tokens, starts, lengths)`` of a 1-D id sequence, documents numbered by first
    appearance: document d is the positions ``tokens[starts[d]:starts[d] + lengths[d]]``
    (ascending). ``tokens`` is None where every document is one contiguous run (the
    packer's output): then it is the identity and no sort is needed."""
    seq_len = ids.numel()
    run_start = torch.ones(seq_len, dtype=torch.bool)
    run_start[1:] = ids[1:] != ids[:-1]
    starts = run_start.nonzero().squeeze(1)
    run_ids = ids[starts]
    if bool((run_ids[1:] > run_ids[:-1]).all()) or torch.unique(run_ids).numel() == starts.numel():
        return None, starts, torch.diff(starts, append=torch.tensor([seq_len]))
    # Equal ids in separate runs are one document: group tokens by id (stable sort keeps
    # each document's positions ascending), then number documents by first position.
    tokens = torch.argsort(ids, stable=True)
    sorted_ids = ids[tokens]
    first = torch.ones(seq_len, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    starts = first.nonzero().squeeze(1)
    lengths = torch.diff(starts, append=torch.tensor([seq_len]))
    by_appearance = torch.argsort(tokens[starts])
    return tokens, starts[by_appearance], lengths[by_appearance]


def _packed_sizes(tokens: torch.Tensor | None, starts: torch.Tensor, lengths: torch.Tensor,
                  n_chunks: int) -> torch.Tensor:
    """(documents, chunks) int64: each document's tokens per chunk in the packed order
    (``_documents``' output)."""
    seq_len = int(lengths.sum())
    chunk = seq_len // n_chunks
    if tokens is None:  # contiguous runs: overlap of [start, end) with every chunk
        edges = torch.arange(n_chunks) * chunk
        low = torch.maximum(starts[:, None], edges[None, :])
        high = torch.minimum((starts + lengths)[:, None], edges[None, :] + chunk)
        return (high - low).clamp(min=0)
    by_entry = torch.argsort(starts)  # documents in the order their tokens sit in `tokens`
    doc_of_entry = torch.repeat_interleave(by_entry, lengths[by_entry])
    return torch.bincount(doc_of_entry * n_chunks + tokens // chunk,
                          minlength=len(lengths) * n_chunks).view(-1, n_chunks)


def _piece_work(start: int, end: int, length: int, causal: bool) -> int:
    """Visible (query, key) pairs of the queries at indices [start, end) of a document."""
    if causal:
        return (end * (end + 1) - start * (start + 1)) // 2
    return (end - start) * length


def _ring_cost(sizes: torch.Tensor, world_size: int, causal: bool) -> float:
    """The lock-step time of the zigzag ring, in visible pairs, over its ideal (all pairs / P):
    sum over ring steps of the busiest rank's pairs, rank r attending to rank (r - step)'s
    keys. ``sizes`` (documents, 2P): each document's tokens per chunk, in document order by
    chunk (within a chunk the arrangement does not change the counts)."""
    sizes = sizes.double()
    gram = sizes.T @ sizes  # [a, b]: pairs of queries in chunk a and keys in chunk b, same document
    if causal:  # keys in earlier chunks, and the earlier ones of the same chunk
        gram = torch.tril(gram, -1) + torch.diag((sizes * (sizes + 1) / 2).sum(0))
    n = sizes.shape[1]
    rank = torch.minimum(torch.arange(n), n - 1 - torch.arange(n))
    per_rank = torch.zeros(world_size, world_size, dtype=torch.float64)
    per_rank.index_put_((rank[:, None].expand(n, n), rank[None, :].expand(n, n)), gram, accumulate=True)
    ranks = torch.arange(world_size)
    slowest = sum(per_rank[ranks, (ranks - step) % world_size].max() for step in range(world_size))
    return float(slowest / (per_rank.sum() / world_size))


class _Placement:
    """Documents being distributed over the 2P chunks, each chunk's free room and each rank's
    work. A document placed whole sits in one chunk (``whole``); one spread over chunks has
    its tokens per chunk in whole tiles (``aligned``) and the ``rest``, chunk c holding the
    tokens after those of chunks < c, its aligned ones first."""

    def __init__(self, world_size: int, chunk: int, tile: int, lengths: list, causal: bool):
        self.n, self.tile, self.lengths, self.causal = 2 * world_size, tile, lengths, causal
        self.room = [chunk] * self.n
        self.work = [0] * world_size
        self.whole: list[list[int]] = [[] for _ in range(self.n)]
        self.aligned: dict[int, list] = {}
        self.rest: dict[int, list] = {}

    def rank_of(self, chunk: int) -> int:
        return min(chunk, self.n - 1 - chunk)

    def cut(self, doc: int) -> None:
        """A long document: the same number of whole tiles in every chunk (piece c in chunk c:
        head-tail pairs cost every rank the same; pieces that start tile-aligned meet in
        unmasked tiles); its leftover tiles to the emptiest chunks. The < ``tile`` odd
        tokens are left to ``place``."""
        length, tile, n = self.lengths[doc], self.tile, self.n
        units = length // tile
        sizes = [units // n * tile] * n
        emptiest = sorted(range(n), key=lambda c: (-self.room[c], self.work[self.rank_of(c)]))
        for c in emptiest[:units % n]:  # ties: the least-loaded rank's
            sizes[c] += tile
        sizes = [min(size, room // tile * tile) for size, room in zip(sizes, self.room)]
        self.aligned[doc], self.rest[doc] = sizes, [0] * n
        start = 0
        for c, size in enumerate(sizes):
            self.room[c] -= size
            self.work[self.rank_of(c)] += _piece_work(start, start + size, length, self.causal)
            start += size

    def remaining(self, doc: int) -> int:
        return self.lengths[doc] - sum(self.aligned.get(doc, ())) - sum(self.rest.get(doc, ()))

    def insert(self, doc: int, chunk: int, size: int) -> None:
        """Append ``size`` more tokens of ``doc`` to its tokens in ``chunk``: they see the
        tokens of chunks <= ``chunk``; the doc's tokens in later chunks each see ``size`` more."""
        length, n = self.lengths[doc], self.n
        aligned = self.aligned.setdefault(doc, [0] * n)
        rest = self.rest.setdefault(doc, [0] * n)
        start = sum(aligned[:chunk + 1]) + sum(rest[:chunk + 1])
        self.work[self.rank_of(chunk)] += _piece_work(start, start + size, length, self.causal)
        if self.causal:
            for later in range(chunk + 1, n):
                self.work[self.rank_of(later)] += size * (aligned[later] + rest[later])
        rest[chunk] += size
        self.room[chunk] -= size

    def place(self, doc: int) -> None:
        """The rest of a document: whole in one chunk of the least-loaded rank with room, else
        over two neighbouring chunks (whose shared tile ids then stay close, see
        ``segments``), else over any chunks with room in increasing order."""
        size = self.remaining(doc)
        for r in sorted(range(len(self.work)), key=self.work.__getitem__):
            fitting = [c for c in (r, self.n - 1 - r) if self.room[c] >= size]
            if fitting:  # the tighter fit keeps the larger hole for a larger document
                c = min(fitting, key=self.room.__getitem__)
                if doc in self.rest:
                    self.insert(doc, c, size)
                else:
                    self.whole[c].append(doc)
                    self.room[c] -= size
                    self.work[r] += _piece_work(0, size, size, self.causal)
                return
        pairs = [c for c in range(self.n - 1) if self.room[c] + self.room[c + 1] >= size]
        if pairs:
            c = min(pairs, key=lambda c: self.work[self.rank_of(c)] + self.work[self.rank_of(c + 1)])
            first = min(self.room[c], size)
            self.insert(doc, c, first)
            if size > first:
                self.insert(doc, c + 1, size - first)
            return
        for c in range(self.n):
            part = min(self.room[c], size)
            if part:
                self.insert(doc, c, part)
                size -= part

    def segments(self) -> list:
        """``(chunk, doc, start, size)`` of every segment, chunk by chunk: first the aligned
        pieces (they stay tile-aligned), in document order, then the rest: documents that
        continue from the previous chunk first and those continuing into the next one last,
        so that a document split over neighbouring chunks sits at both sides of the boundary."""
        spread = sorted(self.rest)
        starts = {}
        for doc in spread:
            sizes = [a + r for a, r in zip(self.aligned[doc], self.rest[doc])]
            starts[doc] = [sum(sizes[:c]) for c in range(self.n)]
        out = []
        for c in range(self.n):
            out += [(c, doc, starts[doc][c], self.aligned[doc][c]) for doc in spread if self.aligned[doc][c]]
            tail = [(0 if any(self.rest[doc][:c]) else 2 if any(self.rest[doc][c + 1:]) else 1, doc,
                     starts[doc][c] + self.aligned[doc][c], self.rest[doc][c]) for doc in spread if self.rest[doc][c]]
            tail += [(1, doc, 0, self.lengths[doc]) for doc in self.whole[c]]
            out += [(c, *segment[1:]) for segment in sorted(tail)]
        return out


def _pour(docs: torch.Tensor, lengths: torch.Tensor, room: list) -> tuple[torch.Tensor, ...]:
    """``(chunk, doc, start, size)`` of whole documents ``docs`` poured in order, as one line,
    into the chunks' free ``room`` in chunk order: a document that reaches the end of a
    chunk's room goes on in the next chunk with room. Vectorised."""
    size = lengths[docs]
    line_end = torch.cumsum(size, 0)
    line_start = line_end - size
    hole_end = torch.cumsum(torch.tensor(room, dtype=torch.int64), 0)
    hole_start = hole_end - torch.tensor(room, dtype=torch.int64)
    first = torch.searchsorted(hole_end, line_start, right=True)
    count = torch.searchsorted(hole_end, line_end - 1, right=True) - first + 1
    of = torch.repeat_interleave(torch.arange(len(docs)), count)  # the document of each piece
    hole = first[of] + torch.arange(len(of)) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    low = torch.maximum(line_start[of], hole_start[hole])
    high = torch.minimum(line_end[of], hole_end[hole])
    keep = high > low  # holes without room between two with room
    return hole[keep], docs[of][keep], (low - line_start[of])[keep], (high - low)[keep]


def balance_permutation(
    document_ids: torch.Tensor,
    world_size: int,
    *,
    layout: str = "zigzag",
    causal: bool = True,
    tile: int = TILE,
    min_gain: float = MIN_GAIN,
) -> torch.Tensor:
    """The token permutation (int64 ``(S,)``, on ``document_ids``' device) that balances the
    document-masked attention work of ``world_size`` zigzag ranks; ``full[..., perm]`` is the
    balanced sequence (see the module docstring). Every document keeps its tokens' order.

    ``document_ids``: the FULL sequence's integer ids ``(S,)``; equal ids anywhere are one
    document, as in ``ring_attention``. ``causal``: the work model (the attention's mask).
    ``tile``: the kernels' tile: documents shorter than ``2 * world_size * tile`` are not
    cut into 2P pieces, and pieces are cut in whole tiles.
    ``min_gain``: the identity unless balancing shortens the ring's lock-step time (counted
    in visible pairs) by at least this factor: below that the kernels' costs of a balanced
    sequence (more masked tiles, no unmasked blocks inside one document) may eat the gain.
    ``world_size == 1`` gives the identity. ``balance_documents`` also renumbers the ids
    (``document_ids[perm]`` works too, with more masked tiles).
    """
    return _balance(document_ids, world_size, layout, causal, tile, min_gain)[0]


def _balance(document_ids: torch.Tensor, world_size: int, layout: str, causal: bool,
             tile: int, min_gain: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, ids)``: the permutation and the permuted sequence's document ids renumbered
    for the kernels' tile skip test (``_tile_friendly_ids``), both on the input's device;
    ``(identity, document_ids)`` where balancing gains less than ``min_gain``."""
    if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 1:
        raise ValueError("document_ids must be a 1-D tensor of the full sequence's ids, got "
                         f"{getattr(document_ids, 'shape', type(document_ids).__name__)}")
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must hold integers, got dtype {document_ids.dtype}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_layout(layout)
    if layout != "zigzag" and world_size > 1:
        raise ValueError(
            f"load balance needs layout='zigzag' (got {layout!r}): its head-tail pairing of chunks "
            "is what balances cut documents; with the contiguous layout rank r's piece of a "
            "document always sees more keys than rank r-1's")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    seq_len = document_ids.numel()
    check_seq_len(seq_len, world_size, layout)
    if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not min_gain >= 1:
        raise ValueError(f"min_gain must be a number >= 1, got {min_gain!r}")
    device = document_ids.device
    unchanged = torch.arange(seq_len, device=device), document_ids
    if world_size == 1:
        return unchanged

    tokens, doc_starts, lengths = _documents(document_ids.detach().cpu().long())
    n_chunks = 2 * world_size
    packed_cost = _ring_cost(_packed_sizes(tokens, doc_starts, lengths, n_chunks), world_size, causal)
    if packed_cost < min_gain:  # not even a perfect balance would gain enough
        return unchanged
    place = _Placement(world_size, seq_len // n_chunks, tile, lengths.tolist(), causal)
    is_long = lengths >= n_chunks * tile
    for doc in is_long.nonzero().squeeze(1).tolist():
        place.cut(doc)
    # What is left - short documents, the odd tokens of cut ones - the costliest first onto
    # the least-loaded rank (the classic greedy for even loads; a cut document's rest costs
    # ~ its length per token). Documents shorter than a tile ("dust", cheap to attend) are
    # poured into the room left afterwards, in order: a million of them take milliseconds.
    is_dust = lengths < tile
    left = []
    for doc, long in zip((~is_dust).nonzero().squeeze(1).tolist(), is_long[~is_dust].tolist()):
        size = place.remaining(doc)
        if size:
            left.append((size * (2 * place.lengths[doc] if long else size), doc))
    for _, doc in sorted(left, key=lambda item: -item[0]):
        place.place(doc)
    placed = torch.tensor(place.segments(), dtype=torch.int64).view(-1, 4).unbind(1)
    poured = _pour(is_dust.nonzero().squeeze(1), lengths, place.room)
    chunk, seg_doc, seg_start, seg_size = (torch.cat(pair) for pair in zip(placed, poured))
    order = torch.argsort(chunk, stable=True)  # per chunk: placed, then poured
    chunk, seg_doc, seg_start, seg_size = chunk[order], seg_doc[order], seg_start[order], seg_size[order]
    balanced_sizes = torch.zeros(len(lengths) * n_chunks, dtype=torch.int64).index_add_(
        0, seg_doc * n_chunks + chunk, seg_size).view(-1, n_chunks)
    if packed_cost < min_gain * _ring_cost(balanced_sizes, world_size, causal):
        return unchanged
    source = doc_starts[seg_doc] + seg_start  # where each segment starts in `tokens`
    out_start = torch.cumsum(seg_size, 0) - seg_size
    perm = torch.repeat_interleave(source - out_start, seg_size) + torch.arange(seq_len)
    if tokens is not None:
        perm = tokens[perm]
    ids = torch.repeat_interleave(_tile_friendly_ids(seg_doc, out_start, seg_size, len(lengths), tile), seg_size)
    return perm.to(device), ids.to(device=device, dtype=document_ids.dtype)


def _tile_friendly_ids(seg_doc: torch.Tensor, seg_start: torch.Tensor, seg_size: torch.Tensor,
                       n_docs: int, tile: int) -> torch.Tensor:
    """New ids (per segment) for the documents of a sequence of segments (document number,
    start, size): numbered in order of first appearance in a tile shared with another
    segment, then the rest.

    The kernels skip a (query tile, key tile) pair when the tiles' [min, max] id ranges do
    not overlap; a balanced sequence mixes ids from all over the batch in each chunk, so
    with the original ids a tile at a document boundary spans many foreign ids and gets
    visited (masked) against their tiles. Numbering documents as they meet in boundary
    tiles keeps those ranges narrow. A bijection: the mask is unchanged."""
    seq_len = int(seg_start[-1] + seg_size[-1])
    end = seg_start + seg_size
    # A segment's first token in a shared tile: its first token if it starts mid-tile, else
    # the start of its last tile if it ends mid-tile (and something follows), else none.
    last_tile = end - end % tile
    first_shared = torch.where(seg_start % tile != 0, seg_start,
                               torch.where((end % tile != 0) & (end < seq_len), last_tile, seg_start + seq_len))
    first = torch.full((n_docs,), 2 * seq_len, dtype=torch.int64).scatter_reduce(0, seg_doc, first_shared, "amin")
    label = torch.empty(n_docs, dtype=torch.int64)
    label[torch.argsort(first)] = torch.arange(n_docs)
    return label[seg_doc]


def balance_documents(batch: Mapping[str, Any], *, world_size: int, layout: str = "zigzag",
                      tile: int = TILE, min_gain: float = MIN_GAIN) -> Any:
    """Balance a FULL-sequence batch for ``world_size`` zigzag CP ranks (before sharding).

    ``batch``: a mapping with integer ``document_ids`` ``(B, S)``; every tensor whose dim 1
    has length S (input_ids, labels, document_ids, position_ids, loss masks, ...) is
    permuted along it, row b by ``balance_permutation(document_ids[b], world_size, tile=,
    min_gain=)``;
    anything else passes through. Positions travel with their tokens: a batch without
    ``position_ids`` gets the global ``arange(S)`` first (the positions sharding would
    otherwise derive from the permuted layout would be wrong). Returns a new dict;
    ``world_size == 1`` returns ``batch`` itself.

    Only for document-masked attention (``ring_attention(document_ids=...)`` with these
    permuted ids); the outputs of a model on the result are in permuted order. The
    permutations are computed on the host (the ids are copied there once per batch).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(batch, Mapping) or not isinstance(batch.get("document_ids"), torch.Tensor):
        raise ValueError("balance_documents needs a mapping batch with a 'document_ids' tensor (B, S)")
    if is_sharded(batch):
        raise ValueError("balance_documents takes full sequences: this batch is already sharded "
                         "(balance before sharding)")
    docs = batch["document_ids"]
    if docs.dim() != 2:
        raise ValueError(f"document_ids must be (B, S), got shape {tuple(docs.shape)}")
    if world_size == 1:
        return batch
    rows, seq_len = docs.shape
    perm, balanced_ids = (torch.stack(t) for t in zip(*(
        _balance(row, world_size, layout, True, tile, min_gain) for row in docs)))
    row_index = torch.arange(rows, device=docs.device)[:, None]
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq_len, device=docs.device).expand(rows, seq_len)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
            if value.shape[0] not in (1, rows):
                raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, document_ids {rows}")
            out[key] = value.expand(rows, *value.shape[1:])[row_index, perm.to(value.device)]
    out["document_ids"] = balanced_ids
    return out
