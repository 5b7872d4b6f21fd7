"""Document-masked Triton attention: query i sees key j iff doc[i] == doc[j] (and j <= i
when causal). Same layout, GQA handling and fp32 statistics as triton_attention.py; the
tile helpers and configs both use are in triton_tiles.py, and the delta pass is
triton_attention.py's (its backward() computes delta before handing over to these kernels).
This module: the block maps and the tile sizes the kernels run with; the kernels are in
triton_document_fwd.py, triton_document_dkdv.py and triton_document_dq.py, their launches
in triton_document_launch.py.

Work skipping: before launching, a *block map* is built on the GPU (torch ops, no host
sync) from per-tile min/max document ids. Every (query tile, key tile) pair is one of
  skip   - the id ranges do not overlap (or the tile is above the causal diagonal):
           never visited, costs nothing;
  full   - both tiles lie inside one and the same document and below the diagonal:
           runs without any mask (the dense kernels' fast path);
  masked - anything else (document boundaries, the causal diagonal, ragged tails):
           runs with the exact elementwise mask. The range test is conservative
           (non-adjacent repeated ids only cause extra masked tiles), the mask is exact.
The map is stored compressed like flex_attention's BlockMask: per row tile the number of
full tiles, the number of visited tiles and their column indices, full ones first.
Forward and dQ use a query-major map (per query tile its key tiles); dK/dV a key-major one
(per key tile its query tiles). Maps are dense O((Sq/BLOCK_M) * (Sk/BLOCK_N)) int32
(8 MB at 128K tokens), like flex_attention's.

Tile sizes are fixed per head dim (the first, best-on-average config of each measured
list in triton_tiles.py) because the map depends on them; the autotuner only chooses
among configs with those tile sizes (warps, stages).

A query row that sees no key in the block gets out = 0, lse = -inf and zero gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockMap(NamedTuple):
    """Compressed tile map; rows are the outer tiles of a kernel (query tiles for the
    forward and dQ, key tiles for dK/dV)."""

    num_full: torch.Tensor  # (B, rows) int32: leading entries of `indices` that need no mask
    num_visit: torch.Tensor  # (B, rows) int32: entries of `indices` to visit (full + masked)
    indices: torch.Tensor  # (B, rows, cols) int32: column tiles, full first, then masked
    order: torch.Tensor  # (B, rows) int32: rows by decreasing num_visit (launch order)


SKIP, MASKED, FULL = 0, 1, 2


def _tile_id_ranges(ids: torch.Tensor, block: int):
    """Per-tile (min, max) document id, (B, n_tiles). A ragged tail is padded by repeating
    the last id, which leaves its range unchanged."""
    B, S = ids.shape
    n_tiles = -(-S // block)
    pad = n_tiles * block - S
    if pad:
        ids = torch.cat([ids, ids[:, -1:].expand(B, pad)], dim=1)
    tiles = ids.reshape(B, n_tiles, block)
    return tiles.amin(-1), tiles.amax(-1)


def tile_classes(q_ids, k_ids, block_q: int, block_k: int, causal: bool) -> torch.Tensor:
    """(B, q_tiles, k_tiles) int8 of SKIP / MASKED / FULL for these tile sizes."""
    q_min, q_max = _tile_id_ranges(q_ids, block_q)
    k_min, k_max = _tile_id_ranges(k_ids, block_k)
    visit = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])
    one_doc = (q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :] & (q_min[:, :, None] == k_min[:, None, :])
    device = q_ids.device
    q_start = torch.arange(q_min.shape[1], device=device) * block_q
    k_start = torch.arange(k_min.shape[1], device=device) * block_k
    if causal:
        visit &= k_start[None, None, :] <= (q_start + block_q - 1)[None, :, None]
        one_doc &= (k_start + block_k - 1)[None, None, :] <= q_start[None, :, None]
    if k_ids.shape[1] % block_k:
        one_doc[:, :, -1] = False  # the ragged key tail needs the bounds mask
    return visit.to(torch.int8) + (visit & one_doc).to(torch.int8)


def compress(classes: torch.Tensor) -> BlockMap:
    """Per row the visited columns, full ones first (both groups in ascending order), and
    the rows' launch order."""
    columns = torch.sort((FULL - classes).to(torch.int16), dim=-1, stable=True).indices
    num_visit = (classes != SKIP).sum(-1, dtype=torch.int32)
    # Longest rows launch first within each head: the work per row tile follows
    # document lengths, and the long ones last would leave SMs idle at the end.
    order = torch.sort(num_visit, dim=-1, descending=True, stable=True).indices
    return BlockMap(
        num_full=(classes == FULL).sum(-1, dtype=torch.int32),
        num_visit=num_visit,
        indices=columns.to(torch.int32),
        order=order.to(torch.int32),
    )


def build_block_map(q_ids, k_ids, block_q: int, block_k: int, causal: bool, *, key_major: bool = False) -> BlockMap:
    classes = tile_classes(q_ids, k_ids, block_q, block_k, causal)
    return compress(classes.transpose(1, 2) if key_major else classes)
