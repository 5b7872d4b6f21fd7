"""Seeded mixes of document lengths for packed sequences: what the document benchmarks and
the balance tests pack (the same draws everywhere, so their figures are comparable).

``document_lengths(mix, total, seed)`` returns lengths summing to ``total`` (the last one
cut to fit); ``document_ids(lengths)`` the ``(S,)`` ids of those documents packed in order.
``document_id_pattern(kind, ...)`` draws the ``(B, S)`` q/k id patterns the kernel tests
and benchmarks/fa4_blocks.py check document masking on (short runs, one-token documents,
reused ids, rows without keys).
"""

from __future__ import annotations

import math

import torch

K = 1024
ID_PATTERNS = ("one", "short", "len1", "mix", "repeat", "halves", "disjoint")
# mean 4K (uniform 2-6K), mean 16K (uniform 8-24K), long-tailed (lognormal, sigma 1.5, mean
# ~4K: many short, a few very long), mean 1K (uniform 512-1536), 256 tokens each.
MIXES = ("mean4k", "mean16k", "longtail", "mean1k", "docs256")


def document_lengths(mix: str, total: int, seed: int = 0) -> list:
    """Seeded document lengths of ``mix`` summing to ``total``."""
    if mix not in MIXES:
        raise ValueError(f"unknown document mix {mix!r}; expected one of {MIXES}")
    g = torch.Generator().manual_seed(seed)
    lengths: list = []
    while sum(lengths) < total:
        if mix == "mean4k":
            n = int(torch.randint(2 * K, 6 * K + 1, (1,), generator=g))
        elif mix == "mean16k":
            n = int(torch.randint(8 * K, 24 * K + 1, (1,), generator=g))
        elif mix == "mean1k":
            n = int(torch.randint(K // 2, 3 * K // 2 + 1, (1,), generator=g))
        elif mix == "docs256":
            n = 256
        else:
            sigma = 1.5
            n = int(math.exp(math.log(4 * K) - sigma**2 / 2 + sigma * float(torch.randn(1, generator=g))))
        lengths.append(max(1, min(n, total - sum(lengths))))
    return lengths


def document_ids(lengths: list, device=None) -> torch.Tensor:
    """``(S,)`` int64 ids, document i being ``lengths[i]`` tokens of id i, packed in order."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))


def document_id_pattern(kind, B, Sq, Sk, gen):
    """(q_ids, k_ids) int tensors. Causal cases need Sq == Sk and use q_ids for both."""

    def runs(S, max_len, n_ids=None):
        ids, doc = [], 0
        while len(ids) < S:
            length = int(torch.randint(1, max_len + 1, (1,), generator=gen))
            value = doc if n_ids is None else int(torch.randint(0, n_ids, (1,), generator=gen))
            ids += [value] * length
            doc += 1
        return ids[:S]

    def batch(make):
        return torch.tensor([make() for _ in range(B)], dtype=torch.int64)

    if kind == "one":
        q = torch.full((B, Sq), 7, dtype=torch.int32)
        return q, torch.full((B, Sk), 7, dtype=torch.int32)
    if kind == "short":
        return batch(lambda: runs(Sq, 12)), batch(lambda: runs(Sk, 12))
    if kind == "len1":  # every token its own document (huge ids: compared as int64)
        return (torch.arange(Sq).expand(B, Sq) + 2**40, torch.arange(Sk).expand(B, Sk) + 2**40)
    if kind == "mix":  # long documents with runs of one-token documents between them
        ids = [0] * 30 + list(range(1, 9)) + [9] * 20 + list(range(10, 22))
        return torch.tensor([ids[:Sq]] * B), torch.tensor([ids[:Sk]] * B)
    if kind == "repeat":  # 3 ids reused by non-adjacent runs: one document each
        return batch(lambda: runs(Sq, 9, n_ids=3)), batch(lambda: runs(Sk, 9, n_ids=3))
    if kind == "halves":  # two documents split at 32: a multiple of every test tile size
        return (torch.arange(Sq).expand(B, Sq) // 32, torch.arange(Sk).expand(B, Sk) // 32)
    if kind == "disjoint":  # q rows of documents 5 and 6 have no key at all
        q = batch(lambda: runs(Sq, 8, n_ids=4))
        q[:, 10:17] = 5
        q[:, -3:] = 6
        return q, batch(lambda: runs(Sk, 8, n_ids=4))
    raise ValueError(f"unknown document-id pattern {kind!r}; expected one of {ID_PATTERNS}")
