"""The gather exchange of a document plan, host side: which received key rows each query sees.

In the gather exchange (``DocumentPlan.exchange == "gather"``) one all-to-all brings rank r
every key/value row of the other ranks that its queries see (the rows the ring's P - 1
steps would bring, concatenated by source rank), and ONE full varlen call attends to them.
Its segments: one per (document d, local layout chunk c) of r's query rows, with key rows
= d's received rows that precede chunk c in the sequence (non-causal: one per document,
all its received rows). Why that is exact: a remote chunk lies wholly before or wholly
after chunk c, so a query of d in c sees every received key of d in the earlier remote
chunks and none in the later ones - every query of a segment sees the same keys. That
holds for the zigzag and contiguous layouts, and for balanced (permuted) sequences, which
are sharded the same way; ``gather_segments`` checks it for every query row of the plan
and raises RuntimeError where it would not hold. Key rows repeat across the segments of a
document (the later chunk's keys include the earlier chunk's); query rows never do.
"""

from __future__ import annotations

import numpy as np


def gather_segments(q_doc, q_pos, q_chunk, k_doc, k_pos, causal: bool, seq_len: int):
    """Segments of the gather call. ``q_*``: this rank's shard rows (document number,
    position in the sequence, local layout chunk); ``k_*``: the received rows in buffer
    order. Returns (query rows, key rows into the buffer, per-segment query counts,
    per-segment key counts); query rows of a segment in shard order, key rows by position."""
    order = np.lexsort((k_pos, k_doc))  # received rows by (document, position)
    doc_sorted = k_doc[order]
    first = np.searchsorted(doc_sorted, q_doc, side="left")
    if causal:
        # Received keys of the query's document strictly before it (no remote key shares
        # its position): a prefix of the document's keys in position order.
        flat = doc_sorted * seq_len + k_pos[order]
        seen = np.searchsorted(flat, q_doc * seq_len + q_pos, side="left") - first
        group = q_doc * (int(q_chunk.max(initial=0)) + 1) + q_chunk
    else:
        seen = np.searchsorted(doc_sorted, q_doc, side="right") - first
        group = q_doc
    by_group = np.argsort(group, kind="stable")
    starts = np.flatnonzero(np.r_[True, group[by_group][1:] != group[by_group][:-1]])
    if len(by_group):
        low = np.minimum.reduceat(seen[by_group], starts)
        high = np.maximum.reduceat(seen[by_group], starts)
        if np.any(low != high):
            raise RuntimeError(
                "document plan: the queries of a document in one layout chunk see different "
                "received keys (the gather exchange needs one key set per chunk)"
            )
    heads = by_group[starts]  # one row per segment candidate
    keep = seen[heads] > 0
    lengths = np.diff(np.r_[starts, len(by_group)])
    q_lens = lengths[keep]
    k_lens = seen[heads][keep]
    q_rows = by_group[np.repeat(keep, lengths)]
    k_rows = order[ranges(first[heads][keep], k_lens)]
    return q_rows.astype(np.int64), k_rows.astype(np.int64), q_lens, k_lens


def returned_rows(sent: np.ndarray):
    """The rows whose dK/dV partials come back, for ``sent`` (rows sent, in message order;
    a row sent to several ranks repeats): (distinct rows, the place of each sent row among
    them), or (``sent``, None) where no row repeats (the partials add in directly)."""
    rows, slot = np.unique(sent, return_inverse=True)
    if len(rows) == len(sent):
        return sent, None
    return rows, slot.reshape(-1).astype(np.int64)


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, start + length)`` for every (start, length)."""
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return np.arange(int(lengths.sum())) + offsets
