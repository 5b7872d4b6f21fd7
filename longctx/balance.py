"""Load balance for document-masked context parallelism: a token permutation of the full
sequence that evens out the ranks' attention work and keeps documents whole where it can.

With packed documents and document masking a token's attention work is the number of keys
it sees (its index in its document + 1, causal). Zigzag evens out plain causal work, not
this (``longctx.layouts.document_work_per_rank``: max/mean up to 1.5 at P = 2 and 2.4 at
P = 8 on realistic mixes), and the plain ring moves every K/V shard to every rank. With a
``DocumentPlan`` (``longctx.documents``) only the keys of documents that two ranks share
move, so the arrangement decides both the work and the traffic.

``balance_permutation(document_ids, P)`` gives ``perm`` with ``balanced = full[..., perm]``
such that, sharded with the zigzag layout (2P chunks of C = S/2P tokens, rank r holding
chunks r and 2P-1-r), every rank's visible pairs are within ``TOLERANCE`` of the mean
wherever the documents allow (plain causal: one document, exactly zigzag):

* short documents all whole, each rank filled exactly (nothing moves), where they allow it;
* else documents are placed whole on one rank wherever that keeps the balance: the costliest
  first onto the least-loaded rank with room (a rank's two chunks take a document whole;
  one per rank may straddle them). Ranks that share no document exchange nothing;
* a document whose work exceeds a rank's fair share, or that keeps the busiest rank over
  the tolerance, is cut into 2P pieces, piece c in chunk c (head-tail: pieces r and
  2P-1-r cost every rank the same); a rank's first such document sits at the junction of
  its two chunks, so its two pieces are one run of the shard;
* what fits nowhere whole, and documents shorter than ``DUST`` tokens, are poured in
  order into the room left, chunk by chunk;
* contiguous cuts instead (causal): rank by rank, whole documents plus at most one head and
  one tail cut that bring the rank to exactly its token share and the mean remaining work;
  a cut document sends only the rows before each piece, not 2P pieces' worth. Of the
  arrangements within the tolerance, the one ``longctx.exchange_cost``'s terms price fastest.

Why it is exact: ``ring_attention(document_ids=...)`` lets query i see key j iff their ids
are equal and (causal) j <= i in the sequence it is given. The permutation keeps every
document's tokens in their original relative order (pieces in increasing chunk order), so
each query sees the same keys as before; the order across documents is free under document
masking. Labels (shifted on the full sequence) and position ids travel with their token, so
RoPE and the (token-sum) loss are unchanged. Not valid for attention across documents
(plain causal): there the permutation changes the result.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .exchange_cost import H200
from .layouts import check_layout, check_seq_len, document_work_per_rank
from .sharding import is_sharded

# The busiest rank's visible pairs may exceed the mean by this factor before another
# document is cut into head-tail pieces (which costs traffic and kernel calls).
TOLERANCE = 1.05
# Documents shorter than this are poured into the room left instead of being placed.
DUST = 128
# Shares of the documents (the shortest) kept back to fill each rank exactly when every
# document stays whole; each is tried (subset sums need enough short documents to choose from).
WHOLE_RESERVES = (0.6, 0.5, 0.4, 0.3, 0.2)


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


def _piece_work(start: int, end: int, length: int, causal: bool) -> float:
    """Visible (query, key) pairs of the queries at indices [start, end) of a document."""
    if causal:
        return (end * (end + 1) - start * (start + 1)) / 2
    return float((end - start) * length)


def _head_tail(length: int, n: int) -> list:
    """Piece sizes (n = 2P) of a cut document, as equal as whole tokens allow."""
    base, extra = divmod(length, n)
    return [base + (c < extra) for c in range(n)]


def _arrange(lengths: list, world_size: int, chunk: int, causal: bool, split: set):
    """One arrangement: for each of the 2P chunks, its pieces ``(doc, start, size)`` in
    order; and which documents were cut head-tail or placed whole on which rank."""
    n = 2 * world_size
    total = sum(_piece_work(0, L, L, causal) for L in lengths)
    fair = total / world_size
    work = [0.0] * world_size
    room = [2 * chunk] * world_size
    ht_room = [chunk] * n  # per chunk: what head-tail pieces may still take
    cut, whole, pour = [], [[] for _ in range(world_size)], []
    order = sorted(range(len(lengths)), key=lambda d: -lengths[d])
    for d in order:
        L = lengths[d]
        if L < DUST:
            pour.append(d)
            continue
        w = _piece_work(0, L, L, causal)
        if (d in split or w > fair or L > 2 * chunk) and L >= n:
            sizes = _head_tail(L, n)
            if all(size <= ht_room[c] for c, size in enumerate(sizes)):
                for c, size in enumerate(sizes):
                    ht_room[c] -= size
                    room[min(c, n - 1 - c)] -= size
                start = 0
                for c, size in enumerate(sizes):
                    work[min(c, n - 1 - c)] += _piece_work(start, start + size, L, causal)
                    start += size
                cut.append((d, sizes))
                continue
        fitting = [r for r in range(world_size) if room[r] >= L]
        if not fitting:
            pour.append(d)
            continue
        r = min(fitting, key=lambda r: work[r])
        whole[r].append(d)
        room[r] -= L
        work[r] += w
    # Each rank's chunks: [room a][whole docs][head-tail pieces, the first at the junction]
    # | [head-tail pieces][whole docs][room b]; a rank without head-tail pieces may let one
    # whole document straddle the junction.
    regions = [([], []) for _ in range(world_size)]  # per rank: pieces of chunk r, of chunk 2P-1-r
    free = []
    for r in range(world_size):
        first, second = r, n - 1 - r
        mine = [(d, sizes) for d, sizes in cut if sizes[first] or sizes[second]]
        inner1 = [(d, sum(sizes[:first]), sizes[first]) for d, sizes in mine if sizes[first]]
        inner2 = [(d, sum(sizes[:second]), sizes[second]) for d, sizes in mine if sizes[second]]
        f1 = chunk - sum(p[2] for p in inner1)
        f2 = chunk - sum(p[2] for p in inner2)
        w1, w2, straddler = [], [], None
        for d in sorted(whole[r], key=lambda d: -lengths[d]):
            L = lengths[d]
            if L <= max(f1, f2):
                if f1 >= f2 and L <= f1 or L > f2:
                    w1.append(d)
                    f1 -= L
                else:
                    w2.append(d)
                    f2 -= L
            elif straddler is None and not mine:
                straddler = d
            else:
                pour.append(d)
        if straddler is not None:
            L = lengths[straddler]
            if L <= f1 + f2:
                head = f1
                regions[r][0].extend([(d, 0, lengths[d]) for d in w1] + [(straddler, 0, head)])
                regions[r][1].extend([(straddler, head, L - head)] + [(d, 0, lengths[d]) for d in w2])
                free.append((0, f2 - (L - head)))
                continue
            pour.append(straddler)
        regions[r][0].extend([(d, 0, lengths[d]) for d in w1] + inner1[::-1])
        regions[r][1].extend(inner2 + [(d, 0, lengths[d]) for d in w2])
        free.append((f1, f2))
    # The room line in chunk order: room a of chunks 0..P-1, then room b of chunks P..2P-1.
    line = [(r, 0, free[r][0]) for r in range(world_size)] + [(r, 1, free[r][1]) for r in reversed(range(world_size))]
    poured = [[[], []] for _ in range(world_size)]
    holes = iter(line)
    r, side, left = next(holes)
    for d in sorted(pour):
        start, L = 0, lengths[d]
        while start < L:
            while left == 0:
                r, side, left = next(holes)
            size = min(left, L - start)
            poured[r][side].append((d, start, size))
            start += size
            left -= size
    chunks = [None] * n
    for r in range(world_size):
        chunks[r] = poured[r][0] + regions[r][0]
        chunks[n - 1 - r] = regions[r][1] + poured[r][1]
    return chunks, cut, whole


def _exact_subset(sizes: list, target: int):
    """Indices into ``sizes`` of a subset summing exactly to ``target``, or None (subset-sum
    over a bitset: bit t of ``reach[i]`` says the first i sizes can make t)."""
    mask = (1 << (target + 1)) - 1
    reach = [1]
    for size in sizes:
        reach.append((reach[-1] | (reach[-1] << size)) & mask)
    if not reach[-1] >> target & 1:
        return None
    chosen, t = [], target
    for i in range(len(sizes), 0, -1):
        if not reach[i - 1] >> t & 1:  # t needs size i - 1
            chosen.append(i - 1)
            t -= sizes[i - 1]
    return chosen


def _exact_fill(candidates: list, lengths: list, room: int):
    """Documents of ``candidates`` (longest first) whose lengths sum exactly to ``room``, with
    about the candidates' own mix of lengths (so their work per token is typical): taken
    from both ends of the list in turn while more than a margin of the room is left, then
    an exact subset sum of the rest for the margin. None where no subset fills it."""
    margin = min(room, 4 * max((lengths[d] for d in candidates), default=0))
    taken, filled = [], 0
    lo, hi = 0, len(candidates) - 1
    while lo <= hi and room - filled > margin:
        d = candidates[lo] if len(taken) % 2 == 0 else candidates[hi]
        if filled + lengths[d] > room - margin:
            break
        taken.append(d)
        filled += lengths[d]
        lo, hi = (lo + 1, hi) if len(taken) % 2 == 1 else (lo, hi - 1)
    rest = candidates[lo : hi + 1]
    chosen = _exact_subset([lengths[d] for d in rest], room - filled)
    return None if chosen is None else taken + [rest[i] for i in chosen]


def _whole_documents(lengths: list, world_size: int, chunk: int, causal: bool, reserve: float):
    """Every document whole on one rank, so that no rank needs another's keys: a rank's two
    chunks hold its documents back to back (the one across their junction is one run of the
    shard), each rank exactly full, its work within ``TOLERANCE`` of the mean. The longer
    documents go first, costliest onto the rank that will end least loaded; the shortest
    (a ``reserve`` share of them) then fill each rank's room exactly (subset sums). Returns
    the chunks' pieces, or None where the documents do not allow it (one too long or too
    costly, no exact fill, over the tolerance)."""
    n, room_per_rank = 2 * world_size, 2 * chunk
    work_of = [_piece_work(0, L, L, causal) for L in lengths]
    fair = sum(work_of) / world_size
    if max(lengths) > room_per_rank or max(work_of) > fair * TOLERANCE:
        return None
    by_length = sorted(range(len(lengths)), key=lambda d: -lengths[d])
    cut = len(by_length) - int(len(by_length) * reserve)
    large, small = by_length[:cut], by_length[cut:]
    work, room, docs = [0.0] * world_size, [room_per_rank] * world_size, [[] for _ in range(world_size)]
    # A rank's room will take short documents' work too: rank by the work it will end with.
    per_token = sum(work_of[d] for d in small) / max(1, sum(lengths[d] for d in small))
    for d in sorted(large, key=lambda d: -work_of[d]):
        fitting = [r for r in range(world_size) if room[r] >= lengths[d]]
        if not fitting:
            return None
        r = min(fitting, key=lambda r: work[r] + (room[r] - lengths[d]) * per_token)
        docs[r].append(d)
        room[r] -= lengths[d]
        work[r] += work_of[d]
    *fill_first, last = sorted(range(world_size), key=work.__getitem__)  # the busiest takes the rest
    for r in fill_first:
        fill = _exact_fill(small, lengths, room[r])
        if fill is None:
            return None
        docs[r] += fill
        work[r] += sum(work_of[d] for d in fill)
        taken = set(fill)
        small = [d for d in small if d not in taken]
    docs[last] += small
    work[last] += sum(work_of[d] for d in small)
    mean = sum(work) / world_size
    if mean and max(work) / mean > TOLERANCE:
        return None
    chunks = [[] for _ in range(n)]
    for r in range(world_size):
        filled = 0  # tokens of the rank laid so far: the first `chunk` go to chunk r
        for d in docs[r]:
            L = lengths[d]
            head = min(L, max(0, chunk - filled))
            if head:
                chunks[r].append((d, 0, head))
            if L - head:
                chunks[n - 1 - r].append((d, head, L - head))
            filled += L
    return chunks


def _cut_pair(head_of, tail_of, tokens: int, pairs: float, chunk: int):
    """``(a, t)``: a head ``[s, s + a)`` of piece ``head_of`` and a tail ``[e - t, e)`` of
    piece ``tail_of`` (``(doc, s, e)`` each; the same piece allowed) that together hold
    ``tokens`` tokens and about ``pairs`` visible pairs (causal), or None. With ``t`` tail
    tokens the two hold ``tokens * s_head + tokens**2 / 2 + t * (e_tail - s_head - tokens)``
    pairs: linear in ``t``, so ``t`` is solved for directly."""
    (_, head_start, head_end), (_, tail_start, tail_end) = head_of, tail_of
    slope = tail_end - head_start - tokens
    if slope <= 0:
        return None
    t = min(max(round((pairs - tokens * head_start - tokens * tokens / 2) / slope), 0), tokens)
    a = tokens - t
    if t > tail_end - tail_start or a > head_end - head_start or a > chunk or t > chunk:
        return None
    if head_of is tail_of and a + t > head_end - head_start:
        return None
    return a, t


def _whole_pieces(pool: list, work_of, tokens: int, target: float) -> list:
    """Candidate sets of whole pieces for one rank (at most ``tokens`` tokens and ``target``
    pairs), each ``(pieces, tokens, pairs)``: greedy over the pool by length (either way) and
    by pairs per token, skipping the first few fits; and sets that track the rank's target
    pairs per token as they fill (to a share of the tokens, the rest left for the cut)."""

    def greedy(order, skip):
        chosen, held, work = [], 0, 0.0
        for p in order:
            size, w = p[2] - p[1], work_of(p)
            if held + size <= tokens and work + w <= target:
                if skip:
                    skip -= 1
                    continue
                chosen.append(p)
                held, work = held + size, work + w
        return chosen, held, work

    def tracking(stop):
        chosen, held, work, left = [], 0, 0.0, list(pool)
        while held < stop:
            fits = [p for p in left if held + p[2] - p[1] <= stop and work + work_of(p) <= target]
            if not fits:
                break
            p = min(fits, key=lambda p: abs(work + work_of(p) - target * (held + p[2] - p[1]) / tokens))
            left.remove(p)
            chosen.append(p)
            held, work = held + p[2] - p[1], work + work_of(p)
        return chosen, held, work

    orders = (
        sorted(pool, key=lambda p: p[1] - p[2]),
        sorted(pool, key=lambda p: -work_of(p) / (p[2] - p[1])),
        sorted(pool, key=lambda p: p[2] - p[1]),
    )
    return [greedy(o, skip) for o in orders for skip in range(4)] + [tracking(tokens * f) for f in (1.0, 0.9, 0.75)]


def _fill_rank(pool: list, work_of, lengths: list, tokens: int, target: float, chunk: int):
    """One rank's pieces from the pool: whole pieces, then at most one head cut (kept in the
    rank's first chunk) and one tail cut (its second chunk) that bring it to exactly
    ``tokens`` tokens and within 2% of ``target`` pairs; of the candidates, the one whose
    pieces need the fewest keys from elsewhere. ``(whole, cut)`` with ``cut`` None or
    ``(head_of, a, tail_of, t)``; None where no candidate reaches the target."""
    best, tried = None, set()
    for whole, held, work in _whole_pieces(pool, work_of, tokens, target):
        if (key := frozenset(map(id, whole))) in tried:  # the orders often pick the same set
            continue
        tried.add(key)
        rest_tokens, rest_pairs = tokens - held, target - work
        starts = sum(p[1] for p in whole)  # rows before each piece: held elsewhere
        if rest_tokens == 0:
            if abs(rest_pairs) <= 0.02 * target and (best is None or starts < best[0]):
                best = (starts, whole, None)
            continue
        taken = {id(p) for p in whole}
        left = sorted((p for p in pool if id(p) not in taken), key=lambda p: p[1] - p[2])
        for head_of in left[:12] + left[-6:]:
            for tail_of in left[:12] + left[-6:]:
                cut = _cut_pair(head_of, tail_of, rest_tokens, rest_pairs, chunk)
                if cut is None:
                    continue
                a, t = cut
                d_head, s_head, _ = head_of
                d_tail, _, e_tail = tail_of
                got = work
                got += _piece_work(s_head, s_head + a, lengths[d_head], True) if a else 0.0
                got += _piece_work(e_tail - t, e_tail, lengths[d_tail], True) if t else 0.0
                if abs(got - target) > 0.02 * target:
                    continue
                # The tail needs the keys before it; the head's remainder will need the head's.
                cost = starts + (s_head + a if a else 0) + (e_tail - t if t else 0)
                if best is None or cost < best[0]:
                    best = (cost, whole, (head_of, a, tail_of, t))
    return None if best is None else best[1:]


def _take_cut(pool: list, cut) -> tuple[list, list]:
    """Cut ``(head_of, a, tail_of, t)`` out of the pool (in place): the rank's head and tail
    pieces; what is left of the cut pieces goes back to the pool."""
    head_of, a, tail_of, t = cut
    heads, tails = [], []
    if head_of is tail_of:
        d, s, e = head_of
        pool.remove(head_of)
        heads += [(d, s, s + a)] if a else []
        tails += [(d, e - t, e)] if t else []
        pool += [(d, s + a, e - t)] if s + a < e - t else []
        return heads, tails
    for piece in (head_of, tail_of):
        pool.remove(piece)
    d, s, e = head_of
    heads += [(d, s, s + a)] if a else []
    pool += [(d, s + a, e)] if a and s + a < e else ([head_of] if not a else [])
    d, s, e = tail_of
    tails += [(d, e - t, e)] if t else []
    pool += [(d, s, e - t)] if t and s < e - t else ([tail_of] if not t else [])
    return heads, tails


def _contiguous_cuts(lengths: list, world_size: int, chunk: int):
    """Documents cut into few contiguous pieces (causal only): rank by rank, whole documents
    (or pieces left by earlier ranks) plus one head and one tail cut that bring the rank to
    exactly its token share and the mean of the remaining work; the last rank takes what is
    left. A head sits in the rank's first chunk and a tail in its second, so every cut
    document's pieces stay in order whatever ranks take the rest. Unlike head-tail cuts into
    2P pieces, a cut document sends only the rows before each piece. Returns the chunks'
    pieces, or None where some rank cannot be brought to its share."""
    pool = [(d, 0, L) for d, L in enumerate(lengths)]
    work_of = lambda p: _piece_work(p[1], p[2], lengths[p[0]], True)  # noqa: E731
    left_work = sum(work_of(p) for p in pool)
    ranks = []
    for r in range(world_size - 1):
        fill = _fill_rank(pool, work_of, lengths, 2 * chunk, left_work / (world_size - r), chunk)
        if fill is None:
            return None
        whole, cut = fill
        taken = {id(p) for p in whole}
        pool = [p for p in pool if id(p) not in taken]
        heads, tails = _take_cut(pool, cut) if cut is not None else ([], [])
        ranks.append(heads + sorted(whole) + tails)
        left_work -= sum(work_of(p) for p in ranks[-1])
    ranks.append(sorted(pool))
    n = 2 * world_size
    chunks = [[] for _ in range(n)]
    for r, pieces in enumerate(ranks):
        filled = 0  # the rank's first `chunk` tokens go to chunk r, the rest to chunk 2P-1-r
        for d, start, end in pieces:
            size = end - start
            head = min(size, max(0, chunk - filled))
            if head:
                chunks[r].append((d, start, head))
            if size - head:
                chunks[n - 1 - r].append((d, start + head, size - head))
            filled += size
    return chunks


def _exchange_ms(chunks: list, lengths: list, world_size: int, causal: bool) -> float:
    """An arrangement's predicted attention time (``longctx.exchange_cost``'s ring terms, in
    relative units): the busiest rank's pairs, the K/V rows the ranks receive (per document
    and rank, the rows before its last piece there that the rank does not hold) and the
    busiest rank's kernel calls (one, plus one per rank it needs keys from)."""
    n = len(chunks)
    pieces: dict = {}
    for c, on_chunk in enumerate(chunks):
        for d, start, size in on_chunk:
            pieces.setdefault(d, []).append((min(c, n - 1 - c), start, size))
    moved, sources = 0, [set() for _ in range(world_size)]
    for d, held in pieces.items():
        for r in {rank for rank, _, _ in held}:
            end = max(start + size for rank, start, size in held if rank == r)
            mine = sum(size for rank, start, size in held if rank == r)
            moved += end - mine
            sources[r] |= {rank for rank, start, _ in held if rank != r and start < end}
    work = _rank_work(chunks, lengths, world_size, causal)
    calls = 1 + max(len(s) for s in sources)
    return H200.pair_ms * max(work) / 1e8 + H200.ring_row_ms * moved / 1e4 + H200.call_ms * calls


def _rank_work(chunks: list, lengths: list, world_size: int, causal: bool) -> list:
    work = [0.0] * world_size
    n = len(chunks)
    for c, pieces in enumerate(chunks):
        for d, start, size in pieces:
            work[min(c, n - 1 - c)] += _piece_work(start, start + size, lengths[d], causal)
    return work


def _balanced_chunks(lengths: list, world_size: int, chunk: int, causal: bool) -> tuple[list, float]:
    """The arrangement within ``TOLERANCE`` predicted fastest (``_exchange_ms``), and its
    busiest rank over the mean. Short documents all whole when they allow it (nothing
    moves); else the fewer rows of contiguous cuts (``_contiguous_cuts``) and head-tail cuts:
    while the busiest rank is over the tolerance, the longest document it holds a piece of
    (not yet cut, at least 2P tokens) is cut head-tail too. Where none is within it, the
    best arrangement seen."""

    def ratio_of(chunks):
        work = _rank_work(chunks, lengths, world_size, causal)
        return max(work) * world_size / sum(work) if sum(work) else 1.0

    # Short documents that can all stay whole: nothing moves between ranks at all.
    whole = [w for w in (_whole_documents(lengths, world_size, chunk, causal, r) for r in WHOLE_RESERVES) if w]
    if whole:
        return min(((w, ratio_of(w)) for w in whole), key=lambda arrangement: arrangement[1])
    candidates = [_head_tail_arrangement(lengths, world_size, chunk, causal)]
    contiguous = _contiguous_cuts(lengths, world_size, chunk) if causal else None
    if contiguous is not None:
        candidates.append((contiguous, ratio_of(contiguous)))
    within = [c for c in candidates if c[1] <= TOLERANCE]
    if within:
        return min(within, key=lambda c: _exchange_ms(c[0], lengths, world_size, causal))
    return min(candidates, key=lambda c: c[1])


def _head_tail_arrangement(lengths: list, world_size: int, chunk: int, causal: bool) -> tuple[list, float]:
    """Whole documents, cut head-tail into 2P pieces while the busiest rank is over
    ``TOLERANCE`` (the longest it holds a piece of, not yet cut, at least 2P tokens); the
    first arrangement within it, else the best seen, with its busiest rank over the mean."""
    n = 2 * world_size
    split: set = set()
    best = None
    while True:
        chunks, cut, _ = _arrange(lengths, world_size, chunk, causal, split)
        work = _rank_work(chunks, lengths, world_size, causal)
        mean = sum(work) / world_size
        ratio = max(work) / mean if mean else 1.0
        if best is None or ratio < best[1]:
            best = (chunks, ratio)
        if ratio <= TOLERANCE:
            return chunks, ratio
        busiest = max(range(world_size), key=work.__getitem__)
        held = {d for c in (busiest, n - 1 - busiest) for d, _, _ in chunks[c]}
        candidates = held - {d for d, _ in cut} - split
        candidates = [d for d in candidates if lengths[d] >= n]
        if not candidates:
            return best
        split.add(max(candidates, key=lengths.__getitem__))


def balance_permutation(
    document_ids: torch.Tensor,
    world_size: int,
    *,
    layout: str = "zigzag",
    causal: bool = True,
) -> torch.Tensor:
    """The token permutation (int64 ``(S,)``, on ``document_ids``' device) that balances the
    document-masked attention work of ``world_size`` zigzag ranks, keeping documents whole
    where it can; ``full[..., perm]`` is the balanced sequence (see the module docstring).
    Every document keeps its tokens' order.

    ``document_ids``: the FULL sequence's integer ids ``(S,)``; equal ids anywhere are one
    document, as in ``ring_attention``. ``causal``: the work model (the attention's mask).
    ``world_size == 1`` gives the identity.
    """
    if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 1:
        raise ValueError(
            "document_ids must be a 1-D tensor of the full sequence's ids, got "
            f"{getattr(document_ids, 'shape', type(document_ids).__name__)}"
        )
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must hold integers, got dtype {document_ids.dtype}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_layout(layout)
    if layout != "zigzag" and world_size > 1:
        raise ValueError(
            f"load balance needs layout='zigzag' (got {layout!r}): its head-tail pairing of chunks "
            "is what balances cut documents; with the contiguous layout rank r's piece of a "
            "document always sees more keys than rank r-1's"
        )
    seq_len = document_ids.numel()
    check_seq_len(seq_len, world_size, layout)
    device = document_ids.device
    if world_size == 1:
        return torch.arange(seq_len, device=device)
    ids = document_ids.detach().cpu().long()
    tokens, doc_starts, lengths = _documents(ids)
    chunks, ratio = _balanced_chunks(lengths.tolist(), world_size, seq_len // (2 * world_size), causal)
    if ratio > TOLERANCE:  # short of the tolerance: never worse than the sequence as it came
        packed = document_work_per_rank(ids, world_size, causal=causal).double()
        if float(packed.max() / packed.mean()) <= ratio:
            return torch.arange(seq_len, device=device)
    seg_doc, seg_start, seg_size = (
        torch.tensor([piece for pieces in chunks for piece in pieces], dtype=torch.int64).view(-1, 3).unbind(1)
    )
    source = doc_starts[seg_doc] + seg_start  # where each piece starts in `tokens`
    out_start = torch.cumsum(seg_size, 0) - seg_size
    perm = torch.repeat_interleave(source - out_start, seg_size) + torch.arange(seq_len)
    if tokens is not None:
        perm = tokens[perm]
    return perm.to(device)


def balance_documents(batch: Mapping[str, Any], *, world_size: int, layout: str = "zigzag") -> Any:
    """Balance a FULL-sequence batch for ``world_size`` zigzag CP ranks (before sharding).

    ``batch``: a mapping with integer ``document_ids`` ``(B, S)``; every tensor whose dim 1
    has length S (input_ids, labels, document_ids, position_ids, loss masks, ...) is
    permuted along it, row b by ``balance_permutation(document_ids[b], world_size)``;
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
        raise ValueError(
            "balance_documents takes full sequences: this batch is already sharded (balance before sharding)"
        )
    docs = batch["document_ids"]
    if docs.dim() != 2:
        raise ValueError(f"document_ids must be (B, S), got shape {tuple(docs.shape)}")
    if world_size == 1:
        return batch
    rows, seq_len = docs.shape
    perm = torch.stack([balance_permutation(row, world_size, layout=layout) for row in docs])
    row_index = torch.arange(rows, device=docs.device)[:, None]
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq_len, device=docs.device).expand(rows, seq_len)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
            if value.shape[0] not in (1, rows):
                raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, document_ids {rows}")
            out[key] = value.expand(rows, *value.shape[1:])[row_index, perm.to(value.device)]
    return out
