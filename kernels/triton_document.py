"""Document-masked Triton attention: query i sees key j iff doc[i] == doc[j] (and j <= i
when causal). Same layout, GQA handling and fp32 statistics as triton_attention.py; the
tile helpers and configs both use are in triton_tiles.py, and the delta pass is
triton_attention.py's (its backward() computes delta before handing over to these kernels).

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

from . import triton_tiles as tt
from .triton_tiles import _LN2, _LOG2E, _load_row, _load_tile, _store_tile, _triton, tl, triton


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
    one_doc = ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
               & (q_min[:, :, None] == k_min[:, None, :]))
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
    return BlockMap(num_full=(classes == FULL).sum(-1, dtype=torch.int32), num_visit=num_visit,
                    indices=columns.to(torch.int32), order=order.to(torch.int32))


def build_block_map(q_ids, k_ids, block_q: int, block_k: int, causal: bool, *,
                    key_major: bool = False) -> BlockMap:
    classes = tile_classes(q_ids, k_ids, block_q, block_k, causal)
    return compress(classes.transpose(1, 2) if key_major else classes)


# ----------------------------------------------------------------------------- configs


def _tiles(table, head_dim: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N) the kernels run with: the first config of the matching list."""
    if dtype == torch.float32 and "fp32" in table:
        return _tile_of(table["fp32"][0])
    bounds = sorted(b for b in table if isinstance(b, int))
    bound = next((b for b in bounds if tt._block_d(head_dim) <= b), bounds[-1])
    return _tile_of(table[bound][0])


def _tile_of(config):
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]


def _pruner(table):
    base = tt._pruner(table)

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        tiles = (args["MAP_M"], args["MAP_N"])
        return [c for c in base(configs, named_args, **kwargs) if _tile_of(c) == tiles]

    return prune


def _autotune(table, **kwargs):
    key = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL"]
    if tt._INTERPRET or triton is None:
        return _triton.autotune(configs=tt._all_configs(table), key=key, **kwargs)
    return _triton.autotune(configs=tt._all_configs(table), key=key,
                            prune_configs_by={"early_config_prune": _pruner(table)},
                            do_bench=tt._tuned_bench, **kwargs)


# ----------------------------------------------------------------------------- forward


@_triton.jit
def _fwd_tile(acc, l_i, m_i, q, q_doc, k_base, v_base, kdoc_base, k_tile, v_tile,
              stride_ks, stride_vs, stride_kds, start_n, rows, offs_n, offs_d, seqlen_k,
              qk_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              EVEN_N: tl.constexpr, PAD_D: tl.constexpr):
    cols = start_n + offs_n
    k_ptrs = k_base + start_n.to(tl.int64) * stride_ks + k_tile
    v_ptrs = v_base + start_n.to(tl.int64) * stride_vs + v_tile
    if MASKED:
        k = _load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    else:  # full tiles are never the ragged key tail (see tile_classes): unmasked loads
        k = _load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, PAD_D)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if MASKED:
        if EVEN_N:
            k_doc = tl.load(kdoc_base + cols * stride_kds)
        else:
            k_doc = tl.load(kdoc_base + cols * stride_kds, mask=cols < seqlen_k, other=0)
        valid = q_doc[:, None] == k_doc[None, :]
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        if not EVEN_N:
            valid = valid & (cols[None, :] < seqlen_k)
        s = tl.where(valid, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key so far keeps m = -inf: subtract 0 instead (no NaN).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_sub = m_new
        s = s * qk_scale
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if MASKED:
        v = _load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    else:
        v = _load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, PAD_D)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return acc, l_i, m_new


@_autotune(tt._FWD_CONFIGS)
@_triton.heuristics(tt._EVEN_HEURISTICS)
@_triton.jit
def _fwd_kernel(Q, K, V, Out, LSE, QDOC, KDOC, NUM_FULL, NUM_VISIT, INDICES, ORDER,
                stride_qb, stride_qs, stride_qh, stride_qd,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                stride_ob, stride_os, stride_oh, stride_od,
                stride_lb, stride_lh, stride_ls,
                stride_qdb, stride_qds, stride_kdb, stride_kds,
                stride_nb, stride_nr, stride_ib, stride_ir, stride_ic,
                n_heads_q, group, seqlen_q, seqlen_k, qk_scale,
                Q_BUCKET, K_BUCKET,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                MAP_M: tl.constexpr, MAP_N: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    tl.static_assert(BLOCK_M == MAP_M)  # the block map was built for these tiles
    tl.static_assert(BLOCK_N == MAP_N)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_q
    pid_m = tl.load(ORDER + off_b * stride_nb + tl.program_id(0) * stride_nr)
    off_h = pid_bh % n_heads_q
    off_hk = off_h // group
    start_m = pid_m * BLOCK_M

    offs_mb = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_mb

    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
              + start_m.to(tl.int64) * stride_qs + offs_mb[:, None] * stride_qs
              + offs_d[None, :] * stride_qd)
    q = _load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
    q_doc = tl.load(QDOC + off_b.to(tl.int64) * stride_qdb + rows * stride_qds,
                    mask=rows < seqlen_q, other=0)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    kdoc_base = KDOC + off_b.to(tl.int64) * stride_kdb
    k_tile = offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_tile = offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

    n_full = tl.load(NUM_FULL + off_b * stride_nb + pid_m * stride_nr)
    n_visit = tl.load(NUM_VISIT + off_b * stride_nb + pid_m * stride_nr)
    idx_ptr = INDICES + off_b.to(tl.int64) * stride_ib + pid_m.to(tl.int64) * stride_ir

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(0, n_full):
        start_n = tl.load(idx_ptr + i * stride_ic) * BLOCK_N
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, q_doc, k_base, v_base, kdoc_base, k_tile,
                                  v_tile, stride_ks, stride_vs, stride_kds, start_n, rows,
                                  offs_n, offs_d, seqlen_k, qk_scale, HEAD_DIM, CAUSAL, False,
                                  EVEN_N, PAD_D)
    for i in range(n_full, n_visit):
        start_n = tl.load(idx_ptr + i * stride_ic) * BLOCK_N
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, q_doc, k_base, v_base, kdoc_base, k_tile,
                                  v_tile, stride_ks, stride_vs, stride_kds, start_n, rows,
                                  offs_n, offs_d, seqlen_k, qk_scale, HEAD_DIM, CAUSAL, True,
                                  EVEN_N, PAD_D)

    # No visible key: l = 0 -> out 0, lse -inf. A NaN row keeps NaN in both.
    empty = l_i == 0.0
    acc = acc * tl.where(empty, 0.0, 1.0 / l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * _LN2)
    o_ptrs = (Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
              + start_m.to(tl.int64) * stride_os
              + offs_mb[:, None] * stride_os + offs_d[None, :] * stride_od)
    _store_tile(o_ptrs, acc.to(Out.dtype.element_ty), rows, seqlen_q, offs_d, HEAD_DIM,
                EVEN_M, PAD_D)
    l_ptrs = LSE + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + rows * stride_ls
    if EVEN_M:
        tl.store(l_ptrs, lse)
    else:
        tl.store(l_ptrs, lse, mask=rows < seqlen_q)


# ----------------------------------------------------------------------------- backward


@_triton.jit
def _dkdv_tile(dk, dv, k, v, k_doc, q_base, do_base, lse_base, delta_base, dq_base, qdoc_base,
               dq_desc, dq_row, stride_qs, stride_qd, stride_ds, stride_dd, stride_ls, stride_ts,
               stride_dqs, stride_dqd, stride_qds,
               start_m, offs_n, offs_mb, offs_d, seqlen_q, seqlen_k, sm_scale, qk_scale,
               HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr,
               DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr):
    # Transposed frame (keys x queries), as in triton_attention._dkdv_inner. Query rows
    # past seqlen_q load q = dO = 0, lse = delta = 0 and contribute exact zeros.
    rows = start_m + offs_mb
    start64 = start_m.to(tl.int64)
    q_tile = offs_mb[:, None] * stride_qs + offs_d[None, :] * stride_qd
    do_tile = offs_mb[:, None] * stride_ds + offs_d[None, :] * stride_dd
    q = _load_tile(q_base + start64 * stride_qs + q_tile, rows, seqlen_q, offs_d, HEAD_DIM,
                   EVEN_M, PAD_D)
    lse = _load_row(lse_base + (start64 + offs_mb) * stride_ls, rows, seqlen_q, EVEN_M)
    s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
    p_t = tl.math.exp2(s_t * qk_scale - (lse * _LOG2E)[None, :])
    if MASKED:
        # Rows with lse = -inf (no visible key anywhere) get p = inf here; the mask is a
        # select, so they become exact zeros.
        q_doc = tl.load(qdoc_base + rows * stride_qds, mask=rows < seqlen_q, other=0)
        valid = k_doc[:, None] == q_doc[None, :]
        if CAUSAL:
            valid = valid & (rows[None, :] >= offs_n[:, None])
        if not EVEN_N:
            valid = valid & (offs_n[:, None] < seqlen_k)
        p_t = tl.where(valid, p_t, 0.0)
    do = _load_tile(do_base + start64 * stride_ds + do_tile, rows, seqlen_q, offs_d, HEAD_DIM,
                    EVEN_M, PAD_D)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
    delta = _load_row(delta_base + (start64 + offs_mb) * stride_ts, rows, seqlen_q, EVEN_M)
    dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision="ieee")
    if DQ_ATOMIC:
        dq = tl.dot(tl.trans(ds_t), k, input_precision="ieee") * sm_scale
        if DQ_TMA:
            dq_desc.atomic_add([dq_row + start_m, 0], dq)
        else:
            dq_ptrs = (dq_base + start64 * stride_dqs + offs_mb[:, None] * stride_dqs
                       + offs_d[None, :] * stride_dqd)
            if EVEN_M and not PAD_D:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
            else:
                dq_mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
                tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
    return dk, dv


@_triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, Delta, DK, DV, DQ, DQ_DESC, QDOC, KDOC,
                 NUM_FULL, NUM_VISIT, INDICES, ORDER,
                 stride_qb, stride_qs, stride_qh, stride_qd,
                 stride_kb, stride_ks, stride_kh, stride_kd,
                 stride_vb, stride_vs, stride_vh, stride_vd,
                 stride_db, stride_ds, stride_dh, stride_dd,
                 stride_lb, stride_lh, stride_ls,
                 stride_tb, stride_th, stride_ts,
                 stride_dkb, stride_dks, stride_dkh, stride_dkd,
                 stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                 stride_dqb, stride_dqs, stride_dqh, stride_dqd,
                 stride_qdb, stride_qds, stride_kdb, stride_kds,
                 stride_nb, stride_nr, stride_ib, stride_ir, stride_ic,
                 n_heads_kv, group, seqlen_q, seqlen_k, sm_scale, qk_scale,
                 Q_BUCKET, K_BUCKET,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr,
                 MAP_M: tl.constexpr, MAP_N: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    tl.static_assert(BLOCK_M == MAP_M)  # the block map was built for these tiles
    tl.static_assert(BLOCK_N == MAP_N)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_kv
    pid_n = tl.load(ORDER + off_b * stride_nb + tl.program_id(0) * stride_nr)
    off_hk = pid_bh % n_heads_kv
    start_n = pid_n * BLOCK_N

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    n_full = tl.load(NUM_FULL + off_b * stride_nb + pid_n * stride_nr)
    n_visit = tl.load(NUM_VISIT + off_b * stride_nb + pid_n * stride_nr)
    idx_ptr = INDICES + off_b.to(tl.int64) * stride_ib + pid_n.to(tl.int64) * stride_ir

    k_ptrs = (K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
              + start_n.to(tl.int64) * stride_ks
              + tl.arange(0, BLOCK_N)[:, None] * stride_ks + offs_d[None, :] * stride_kd)
    v_ptrs = (V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
              + start_n.to(tl.int64) * stride_vs
              + tl.arange(0, BLOCK_N)[:, None] * stride_vs + offs_d[None, :] * stride_vd)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Key tiles nobody sees (e.g. of a later document) loop zero times and store zeros.
    k = _load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    v = _load_tile(v_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    k_doc = tl.load(KDOC + off_b.to(tl.int64) * stride_kdb + offs_n * stride_kds,
                    mask=offs_n < seqlen_k, other=0)
    qdoc_base = QDOC + off_b.to(tl.int64) * stride_qdb
    # GQA: this program owns kv head off_hk and reduces dK/dV over its query-head group.
    for g in range(0, group):
        off_h = off_hk * group + g
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        do_base = DO + off_b.to(tl.int64) * stride_db + off_h.to(tl.int64) * stride_dh
        dq_base = DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
        lse_base = LSE + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
        delta_base = Delta + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
        dq_row = (off_b * n_heads_kv * group + off_h) * seqlen_q  # TMA dQ buffer row
        for i in range(0, n_full):
            start_m = tl.load(idx_ptr + i * stride_ic) * BLOCK_M
            dk, dv = _dkdv_tile(dk, dv, k, v, k_doc, q_base, do_base, lse_base, delta_base,
                                dq_base, qdoc_base, DQ_DESC, dq_row, stride_qs, stride_qd,
                                stride_ds, stride_dd, stride_ls, stride_ts, stride_dqs,
                                stride_dqd, stride_qds, start_m, offs_n, offs_mb, offs_d, seqlen_q,
                                seqlen_k, sm_scale, qk_scale, HEAD_DIM, CAUSAL, False,
                                EVEN_M, EVEN_N, PAD_D, DQ_ATOMIC, DQ_TMA)
        for i in range(n_full, n_visit):
            start_m = tl.load(idx_ptr + i * stride_ic) * BLOCK_M
            dk, dv = _dkdv_tile(dk, dv, k, v, k_doc, q_base, do_base, lse_base, delta_base,
                                dq_base, qdoc_base, DQ_DESC, dq_row, stride_qs, stride_qd,
                                stride_ds, stride_dd, stride_ls, stride_ts, stride_dqs,
                                stride_dqd, stride_qds, start_m, offs_n, offs_mb, offs_d, seqlen_q,
                                seqlen_k, sm_scale, qk_scale, HEAD_DIM, CAUSAL, True,
                                EVEN_M, EVEN_N, PAD_D, DQ_ATOMIC, DQ_TMA)

    dk = dk * sm_scale
    dk_ptrs = (DK + off_b.to(tl.int64) * stride_dkb + off_hk.to(tl.int64) * stride_dkh
               + start_n.to(tl.int64) * stride_dks
               + tl.arange(0, BLOCK_N)[:, None] * stride_dks + offs_d[None, :] * stride_dkd)
    dv_ptrs = (DV + off_b.to(tl.int64) * stride_dvb + off_hk.to(tl.int64) * stride_dvh
               + start_n.to(tl.int64) * stride_dvs
               + tl.arange(0, BLOCK_N)[:, None] * stride_dvs + offs_d[None, :] * stride_dvd)
    _store_tile(dk_ptrs, dk.to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM,
                EVEN_N, PAD_D)
    _store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM,
                EVEN_N, PAD_D)


@_triton.jit
def _dq_tile(dq, q, do, lse2, delta, q_doc, k_base, v_base, kdoc_base, k_tile, v_tile,
             stride_ks, stride_vs, stride_kds, start_n, rows, offs_n, offs_d, seqlen_k,
             qk_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
             EVEN_N: tl.constexpr, PAD_D: tl.constexpr):
    cols = start_n + offs_n
    k_ptrs = k_base + start_n.to(tl.int64) * stride_ks + k_tile
    v_ptrs = v_base + start_n.to(tl.int64) * stride_vs + v_tile
    if MASKED:
        k = _load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
        v = _load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    else:
        k = _load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, PAD_D)
        v = _load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, PAD_D)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        if EVEN_N:
            k_doc = tl.load(kdoc_base + cols * stride_kds)
        else:
            k_doc = tl.load(kdoc_base + cols * stride_kds, mask=cols < seqlen_k, other=0)
        valid = q_doc[:, None] == k_doc[None, :]
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        if not EVEN_N:
            valid = valid & (cols[None, :] < seqlen_k)
        p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = (p * (dp - delta[:, None])).to(k.dtype)
    return tl.dot(ds, k, dq, input_precision="ieee")


@_autotune(tt._DQ_CONFIGS)
@_triton.heuristics(tt._EVEN_HEURISTICS)
@_triton.jit
def _dq_kernel(Q, K, V, DO, LSE, Delta, DQ, QDOC, KDOC, NUM_FULL, NUM_VISIT, INDICES, ORDER,
               stride_qb, stride_qs, stride_qh, stride_qd,
               stride_kb, stride_ks, stride_kh, stride_kd,
               stride_vb, stride_vs, stride_vh, stride_vd,
               stride_db, stride_ds, stride_dh, stride_dd,
               stride_lb, stride_lh, stride_ls,
               stride_tb, stride_th, stride_ts,
               stride_dqb, stride_dqs, stride_dqh, stride_dqd,
               stride_qdb, stride_qds, stride_kdb, stride_kds,
               stride_nb, stride_nr, stride_ib, stride_ir, stride_ic,
               n_heads_q, group, seqlen_q, seqlen_k, sm_scale, qk_scale,
               Q_BUCKET, K_BUCKET,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
               MAP_M: tl.constexpr, MAP_N: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    tl.static_assert(BLOCK_M == MAP_M)  # the block map was built for these tiles
    tl.static_assert(BLOCK_N == MAP_N)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_q
    pid_m = tl.load(ORDER + off_b * stride_nb + tl.program_id(0) * stride_nr)
    off_h = pid_bh % n_heads_q
    off_hk = off_h // group
    start_m = pid_m * BLOCK_M

    offs_mb = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_mb
    start_m64 = start_m.to(tl.int64)

    n_full = tl.load(NUM_FULL + off_b * stride_nb + pid_m * stride_nr)
    n_visit = tl.load(NUM_VISIT + off_b * stride_nb + pid_m * stride_nr)
    idx_ptr = INDICES + off_b.to(tl.int64) * stride_ib + pid_m.to(tl.int64) * stride_ir
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if n_visit > 0:
        q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                  + start_m64 * stride_qs + offs_mb[:, None] * stride_qs + offs_d[None, :] * stride_qd)
        do_ptrs = (DO + off_b.to(tl.int64) * stride_db + off_h.to(tl.int64) * stride_dh
                   + start_m64 * stride_ds + offs_mb[:, None] * stride_ds + offs_d[None, :] * stride_dd)
        q = _load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
        do = _load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
        lse = _load_row(LSE + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
                        + rows * stride_ls, rows, seqlen_q, EVEN_M)
        delta = _load_row(Delta + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
                          + rows * stride_ts, rows, seqlen_q, EVEN_M)
        lse2 = lse * _LOG2E
        q_doc = tl.load(QDOC + off_b.to(tl.int64) * stride_qdb + rows * stride_qds,
                        mask=rows < seqlen_q, other=0)
        k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
        kdoc_base = KDOC + off_b.to(tl.int64) * stride_kdb
        k_tile = offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_tile = offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
        for i in range(0, n_full):
            start_n = tl.load(idx_ptr + i * stride_ic) * BLOCK_N
            dq = _dq_tile(dq, q, do, lse2, delta, q_doc, k_base, v_base, kdoc_base, k_tile,
                          v_tile, stride_ks, stride_vs, stride_kds, start_n, rows, offs_n, offs_d,
                          seqlen_k, qk_scale, HEAD_DIM, CAUSAL, False, EVEN_N, PAD_D)
        for i in range(n_full, n_visit):
            start_n = tl.load(idx_ptr + i * stride_ic) * BLOCK_N
            dq = _dq_tile(dq, q, do, lse2, delta, q_doc, k_base, v_base, kdoc_base, k_tile,
                          v_tile, stride_ks, stride_vs, stride_kds, start_n, rows, offs_n, offs_d,
                          seqlen_k, qk_scale, HEAD_DIM, CAUSAL, True, EVEN_N, PAD_D)

    dq = dq * sm_scale
    dq_ptrs = (DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
               + start_m64 * stride_dqs + offs_mb[:, None] * stride_dqs
               + offs_d[None, :] * stride_dqd)
    _store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M,
                PAD_D)


_dkdv_split = _autotune(tt._DKDV_CONFIGS)(_triton.heuristics(tt._EVEN_HEURISTICS)(_dkdv_kernel))
# Autotuning the atomic flavour runs it several times: dQ must be re-zeroed each time.
_dkdv_atomic = _autotune(tt._DKDV_CONFIGS, reset_to_zero=["DQ"])(
    _triton.heuristics(tt._EVEN_HEURISTICS)(_dkdv_kernel))
_dkdv_atomic_tma = _autotune(tt._with_hook(tt._DKDV_CONFIGS), reset_to_zero=["DQ"])(
    _triton.heuristics(tt._EVEN_HEURISTICS)(_dkdv_kernel))

# ----------------------------------------------------------------------------- launchers
# Called by triton_attention.forward/backward after their checks and allocations; q, k, v,
# dout have unit head_dim stride, the block is non-empty, ids are validated (B, S) ints.


def _ids(ids: torch.Tensor) -> torch.Tensor:
    # Any integer dtype: compare as int64 so that distinct ids never collide.
    return ids.to(torch.int64)


def _map_args(bmap: BlockMap):
    return (bmap.num_full, bmap.num_visit, bmap.indices, bmap.order)


def _grid(batch_heads: int, bmap: BlockMap):
    # (row tiles, batch*heads): CUDA starts blocks x-fastest, so one head's rows run
    # together (longest first, per `order`) and share that head's K/V in L2 (heads-fastest
    # measured slower: benchmarks/NOTES.md). grid y holds at most 65535.
    if batch_heads > 65535:
        raise ValueError(f"batch x heads = {batch_heads} exceeds the CUDA grid limit (65535); "
                         "use smaller micro-batches")
    return (bmap.num_visit.shape[1], batch_heads)


def _map_strides(bmap: BlockMap):
    # num_full, num_visit and order are all contiguous (B, rows): one pair of strides.
    return (*bmap.num_full.stride(), *bmap.indices.stride())


def launch_forward(q, k, v, out, lse, q_doc, k_doc, causal, qk_scale):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q_doc, k_doc = _ids(q_doc), _ids(k_doc)
    block_m, block_n = _tiles(tt._FWD_CONFIGS, D, q.dtype)
    bmap = build_block_map(q_doc, k_doc, block_m, block_n, causal)
    _fwd_kernel[_grid(B * Hq, bmap)](
        q, k, v, out, lse, q_doc, k_doc, *_map_args(bmap),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        *q_doc.stride(), *k_doc.stride(), *_map_strides(bmap),
        Hq, Hq // Hkv, Sq, Sk, qk_scale, tt._bucket(Sq), tt._bucket(Sk),
        HEAD_DIM=D, BLOCK_D=tt._block_d(D), CAUSAL=bool(causal), MAP_M=block_m, MAP_N=block_n)


def launch_dkdv(kernel, q, k, v, dout, lse, delta, dk, dv, dq, dq_desc, q_doc, k_doc, causal,
                sm_scale, qk_scale, *, dq_atomic, dq_tma):
    """dK/dV (and with dq_atomic dQ by atomics into `dq`) through `kernel`, one of
    _dkdv_split / _dkdv_atomic / _dkdv_atomic_tma (triton_attention picks as for plain)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q_doc, k_doc = _ids(q_doc), _ids(k_doc)
    block_m, block_n = _tiles(tt._DKDV_CONFIGS, D, q.dtype)
    bmap = build_block_map(q_doc, k_doc, block_m, block_n, causal, key_major=True)
    kernel[_grid(B * Hkv, bmap)](
        q, k, v, dout, lse, delta, dk, dv, dq, dq_desc, q_doc, k_doc, *_map_args(bmap),
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
        *delta.stride(), *dk.stride(), *dv.stride(), *dq.stride(),
        *q_doc.stride(), *k_doc.stride(), *_map_strides(bmap),
        Hkv, Hq // Hkv, Sq, Sk, sm_scale, qk_scale, tt._bucket(Sq), tt._bucket(Sk),
        HEAD_DIM=D, BLOCK_D=tt._block_d(D), CAUSAL=bool(causal), DQ_ATOMIC=dq_atomic,
        DQ_TMA=dq_tma, MAP_M=block_m, MAP_N=block_n)


def launch_dq(q, k, v, dout, lse, delta, dq, q_doc, k_doc, causal, sm_scale, qk_scale):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q_doc, k_doc = _ids(q_doc), _ids(k_doc)
    block_m, block_n = _tiles(tt._DQ_CONFIGS, D, q.dtype)
    bmap = build_block_map(q_doc, k_doc, block_m, block_n, causal)
    _dq_kernel[_grid(B * Hq, bmap)](
        q, k, v, dout, lse, delta, dq, q_doc, k_doc, *_map_args(bmap),
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
        *delta.stride(), *dq.stride(), *q_doc.stride(), *k_doc.stride(), *_map_strides(bmap),
        Hq, Hq // Hkv, Sq, Sk, sm_scale, qk_scale, tt._bucket(Sq), tt._bucket(Sk),
        HEAD_DIM=D, BLOCK_D=tt._block_d(D), CAUSAL=bool(causal), MAP_M=block_m, MAP_N=block_n)
