"""Seeded mixes of document lengths for packed sequences: what the document benchmarks and
the balance tests pack (the same draws everywhere, so their figures are comparable).

``document_lengths(mix, total, seed)`` returns lengths summing to ``total`` (the last one
cut to fit); ``document_ids(lengths)`` the ``(S,)`` ids of those documents packed in order.
"""
from __future__ import annotations

import math

import torch

K = 1024
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
            n = int(math.exp(math.log(4 * K) - sigma ** 2 / 2 + sigma * float(torch.randn(1, generator=g))))
        lengths.append(max(1, min(n, total - sum(lengths))))
    return lengths


def document_ids(lengths: list, device=None) -> torch.Tensor:
    """``(S,)`` int64 ids, document i being ``lengths[i]`` tokens of id i, packed in order."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.tensor(lengths, device=device))
