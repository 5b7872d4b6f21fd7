"""Triton flash-attention kernels (FlashAttention-2 structure) for one ring step.

Layout (B, S, H, D) with arbitrary strides (the ring hands in seq-dim slices and reads
partials back through views), GQA by index arithmetic (kv head = q head // group; K/V are
never repeated), causal = aligned diagonal block (Sq == Sk, q_i sees k_j for j <= i).

  forward:  one program per (query tile, batch*q-head). Off-diagonal key tiles run
            unmasked; the diagonal band (and ragged key tail) runs masked; nothing above
            the diagonal is touched. Online softmax in base 2 (scores pre-scaled by
            log2(e)), lse returned in natural log, fp32 (B, Hq, Sq).
  backward: delta = rowsum(dO * O) by a small preprocess kernel (unless given), then
            "split" mode (default, deterministic): a dK/dV kernel, one program per
            (key tile, batch*kv-head) looping over the group's query heads and query
            tiles (the GQA reduction happens in registers), and a dQ kernel, one program
            per (query tile, batch*q-head) looping over key tiles. "atomic" mode computes
            dQ inside the dK/dV kernel and adds it with fp32 atomics (5 instead of 7
            matmuls per tile pair, not bitwise deterministic). Select with the environment
            variable LONGCTX_TRITON_BWD=split|atomic or by setting `BWD_MODE`; the
            benchmark measures both.

Document masking (q/k document ids): the same tile helpers and configs (triton_tiles.py,
shared by both), kernels that visit only the tiles a block map lists, in triton_document.py
(forward()/backward() below hand over to it).

One file on purpose (~700 lines): the kernels and the wrappers that launch them share
argument order, constexpr names and tile conventions; splitting them hides that contract.

LONGCTX_TRITON_AUTOTUNE=0 restricts every kernel to the first config of its list (GPU tests:
one compile per variant instead of one per candidate).

Under TRITON_INTERPRET=1 (read when triton_tiles.py is imported: triton.jit picks
interpreter or compiler at decoration time) the kernels run on CPU tensors with one small
fixed config, which is what the CPU tests exercise.
"""

import contextlib
import os

import torch

# The shared pieces; several are also read through this module (triton_attention._cfg,
# ._FWD_CONFIGS, ...) by benchmarks/ and the tests.
from .triton_tiles import (  # noqa: F401
    _DKDV_CONFIGS,
    _DQ_CONFIGS,
    _EVEN_HEURISTICS,
    _FWD_CONFIGS,
    _INTERPRET,
    _LN2,
    _LOG2E,
    LOG2E,
    _autotune,
    _block_d,
    _bucket,
    _cfg,
    _load_row,
    _load_tile,
    _store_tile,
    _triton,
    _with_hook,
    tl,
    triton,
)

try:  # host-side TMA descriptors (triton >= 3.4); used for dQ reduce-adds on Hopper+
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # noqa: BLE001 - older triton or no triton
    TensorDescriptor = None

# Backward flavour: "split" (dK/dV kernel + dQ kernel, deterministic) or "atomic".
BWD_MODE = os.environ.get("LONGCTX_TRITON_BWD", "split")

# ----------------------------------------------------------------------------- forward


@_triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, step_k, step_v, rows, offs_n, offs_d,
               lo, hi, seqlen_k, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               EVEN_N: tl.constexpr, PAD_D: tl.constexpr):
    # MASK: 0 = none (interior tiles), 1 = causal band, 2 = ragged key tail (full mode).
    # k_ptrs / v_ptrs point at key row `lo` on entry.
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if MASK == 0:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale - m_new[:, None]
        else:
            if MASK == 1:
                # keys past seqlen_k sit above the diagonal of every valid row.
                valid = rows[:, None] >= cols[None, :]
            else:
                valid = cols[None, :] < seqlen_k
            s = tl.where(valid, s * qk_scale, float("-inf"))
            # Every row has >= 1 valid key in its first processed tile (see forward()),
            # so m_new is finite and -inf - m_new never produces NaN.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            s = s - m_new[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new
        k_ptrs += step_k
        v_ptrs += step_v
    return acc, l_i, m_i


@_autotune(_FWD_CONFIGS, key=["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL"])
@_triton.heuristics(_EVEN_HEURISTICS)
@_triton.jit
def _fwd_kernel(Q, K, V, Out, LSE,
                stride_qb, stride_qs, stride_qh, stride_qd,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                stride_ob, stride_os, stride_oh, stride_od,
                stride_lb, stride_lh, stride_ls,
                n_heads_q, group, seqlen_q, seqlen_k, qk_scale,
                Q_BUCKET, K_BUCKET,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # longest rows first: better tail balance
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_q
    off_h = pid_bh % n_heads_q
    off_hk = off_h // group
    start_m = pid_m * BLOCK_M

    offs_mb = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_mb

    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    k_tile = offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_tile = offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
    step_k = BLOCK_N * stride_ks
    step_v = BLOCK_N * stride_vs

    q_ptrs = (q_base + start_m.to(tl.int64) * stride_qs
              + offs_mb[:, None] * stride_qs + offs_d[None, :] * stride_qd)
    q = _load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        # Key tiles ending at or before this query tile's first row: no mask at all.
        band_lo = (start_m // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base + k_tile, v_base + v_tile,
                                   step_k, step_v, rows, offs_n, offs_d, 0, band_lo,
                                   seqlen_k, qk_scale, HEAD_DIM, BLOCK_N, 0, True, PAD_D)
        # Diagonal band; its first tile starts at or before every row, so each row sees
        # at least one key there. Nothing above the diagonal is visited.
        band_hi = tl.minimum(start_m + BLOCK_M, seqlen_k)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q,
                                   k_base + band_lo.to(tl.int64) * stride_ks + k_tile,
                                   v_base + band_lo.to(tl.int64) * stride_vs + v_tile,
                                   step_k, step_v, rows, offs_n, offs_d, band_lo, band_hi,
                                   seqlen_k, qk_scale, HEAD_DIM, BLOCK_N, 1, EVEN_N, PAD_D)
    else:
        if EVEN_N:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base + k_tile, v_base + v_tile,
                                       step_k, step_v, rows, offs_n, offs_d, 0, seqlen_k,
                                       seqlen_k, qk_scale, HEAD_DIM, BLOCK_N, 0, True, PAD_D)
        else:
            n_full = (seqlen_k // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base + k_tile, v_base + v_tile,
                                       step_k, step_v, rows, offs_n, offs_d, 0, n_full,
                                       seqlen_k, qk_scale, HEAD_DIM, BLOCK_N, 0, True, PAD_D)
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q,
                                       k_base + n_full.to(tl.int64) * stride_ks + k_tile,
                                       v_base + n_full.to(tl.int64) * stride_vs + v_tile,
                                       step_k, step_v, rows, offs_n, offs_d, n_full, seqlen_k,
                                       seqlen_k, qk_scale, HEAD_DIM, BLOCK_N, 2, False, PAD_D)

    inv_l = 1.0 / l_i
    acc = acc * inv_l[:, None]
    lse = (m_i + tl.math.log2(l_i)) * _LN2

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
def _delta_kernel(Out, DO, Delta,
                  stride_ob, stride_os, stride_oh, stride_od,
                  stride_db, stride_ds, stride_dh, stride_dd,
                  stride_tb, stride_th, stride_ts,
                  n_heads_q, seqlen_q,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_q
    off_h = pid_bh % n_heads_q
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = (Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
              + rows.to(tl.int64)[:, None] * stride_os + offs_d[None, :] * stride_od)
    do_ptrs = (DO + off_b.to(tl.int64) * stride_db + off_h.to(tl.int64) * stride_dh
               + rows.to(tl.int64)[:, None] * stride_ds + offs_d[None, :] * stride_dd)
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    t_ptrs = Delta + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th + rows * stride_ts
    tl.store(t_ptrs, delta, mask=rows < seqlen_q)


@_triton.jit
def _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, dq_ptrs, dq_desc, dq_row,
                step_q, step_do, step_lse, step_delta, step_dq,
                offs_n, offs_mb, offs_d, lo, hi, seqlen_q, seqlen_k, sm_scale, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PAD_D: tl.constexpr,
                DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr):
    # Works in the transposed frame (keys x queries) so that dK/dV accumulate as
    # [BLOCK_N, D] with the key tile as the MMA's M dimension.
    # Out-of-range query rows load q = dO = 0, lse = delta = 0: their p is 1 but every
    # product they enter is multiplied by a zero row, so they contribute nothing.
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_mb
        q = _load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
        lse = _load_row(lse_ptrs, rows, seqlen_q, EVEN_M)
        s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
        p_t = tl.math.exp2(s_t * qk_scale - (lse * _LOG2E)[None, :])
        if MASK == 1:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        if not EVEN_N:
            # zero-loaded keys past seqlen_k would get p = exp(-lse), possibly inf
            p_t = tl.where(offs_n[:, None] < seqlen_k, p_t, 0.0)
        do = _load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
        delta = _load_row(delta_ptrs, rows, seqlen_q, EVEN_M)
        dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision="ieee")
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(ds_t), k, input_precision="ieee") * sm_scale
            if DQ_TMA:
                # One bulk asynchronous reduce-add of the tile (TMA), as FlashAttention-3
                # does; rows past this head's seqlen_q add exact zeros, the buffer's end
                # is clipped by the descriptor.
                dq_desc.atomic_add([dq_row + start_m, 0], dq)
            else:
                if EVEN_M and not PAD_D:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")
                else:
                    dq_mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
                    tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
                dq_ptrs += step_dq
        q_ptrs += step_q
        do_ptrs += step_do
        lse_ptrs += step_lse
        delta_ptrs += step_delta
    return dk, dv


@_triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, Delta, DK, DV, DQ, DQ_DESC,
                 stride_qb, stride_qs, stride_qh, stride_qd,
                 stride_kb, stride_ks, stride_kh, stride_kd,
                 stride_vb, stride_vs, stride_vh, stride_vd,
                 stride_db, stride_ds, stride_dh, stride_dd,
                 stride_lb, stride_lh, stride_ls,
                 stride_tb, stride_th, stride_ts,
                 stride_dkb, stride_dks, stride_dkh, stride_dkd,
                 stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                 stride_dqb, stride_dqs, stride_dqh, stride_dqd,
                 n_heads_kv, group, seqlen_q, seqlen_k, sm_scale, qk_scale,
                 Q_BUCKET, K_BUCKET,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_n = tl.program_id(0)  # causal: low key tiles have the most work and launch first
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_kv
    off_hk = pid_bh % n_heads_kv
    start_n = pid_n * BLOCK_N

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    k_ptrs = (K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
              + start_n.to(tl.int64) * stride_ks
              + tl.arange(0, BLOCK_N)[:, None] * stride_ks + offs_d[None, :] * stride_kd)
    v_ptrs = (V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
              + start_n.to(tl.int64) * stride_vs
              + tl.arange(0, BLOCK_N)[:, None] * stride_vs + offs_d[None, :] * stride_vd)
    k = _load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    v = _load_tile(v_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    q_tile = offs_mb[:, None] * stride_qs + offs_d[None, :] * stride_qd
    do_tile = offs_mb[:, None] * stride_ds + offs_d[None, :] * stride_dd
    dq_tile = offs_mb[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
    step_q = BLOCK_M * stride_qs
    step_do = BLOCK_M * stride_ds
    step_dq = BLOCK_M * stride_dqs
    step_lse = BLOCK_M * stride_ls
    step_delta = BLOCK_M * stride_ts

    if CAUSAL:
        # Query tiles overlapping rows [start_n, start_n + BLOCK_N) need the mask; all
        # later tiles see every key of this tile; earlier tiles see none of them.
        lo = (start_n // BLOCK_M) * BLOCK_M
        band_end = tl.minimum(start_n + BLOCK_N, seqlen_q)
        mid = tl.minimum(lo + tl.cdiv(band_end - lo, BLOCK_M) * BLOCK_M, seqlen_q)
        lo64 = lo.to(tl.int64)
        mid64 = mid.to(tl.int64)
    else:
        mid = 0
        mid64 = 0

    # GQA: this program owns kv head off_hk and reduces dK/dV over its query-head group.
    for g in range(0, group):
        off_h = off_hk * group + g
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        do_base = DO + off_b.to(tl.int64) * stride_db + off_h.to(tl.int64) * stride_dh
        dq_base = DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
        lse_base = LSE + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
        delta_base = Delta + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
        # TMA dQ buffer is (B * Hq * Sq, D): this head's rows start here.
        dq_row = (off_b * n_heads_kv * group + off_h) * seqlen_q
        if CAUSAL:
            dk, dv = _dkdv_inner(dk, dv, k, v,
                                 q_base + lo64 * stride_qs + q_tile,
                                 do_base + lo64 * stride_ds + do_tile,
                                 lse_base + lo64 * stride_ls + offs_mb * stride_ls,
                                 delta_base + lo64 * stride_ts + offs_mb * stride_ts,
                                 dq_base + lo64 * stride_dqs + dq_tile, DQ_DESC, dq_row,
                                 step_q, step_do, step_lse, step_delta, step_dq,
                                 offs_n, offs_mb, offs_d, lo, mid, seqlen_q, seqlen_k,
                                 sm_scale, qk_scale, HEAD_DIM, BLOCK_M, 1, EVEN_M, EVEN_N,
                                 PAD_D, DQ_ATOMIC, DQ_TMA)
        dk, dv = _dkdv_inner(dk, dv, k, v,
                             q_base + mid64 * stride_qs + q_tile,
                             do_base + mid64 * stride_ds + do_tile,
                             lse_base + mid64 * stride_ls + offs_mb * stride_ls,
                             delta_base + mid64 * stride_ts + offs_mb * stride_ts,
                             dq_base + mid64 * stride_dqs + dq_tile, DQ_DESC, dq_row,
                             step_q, step_do, step_lse, step_delta, step_dq,
                             offs_n, offs_mb, offs_d, mid, seqlen_q, seqlen_q, seqlen_k,
                             sm_scale, qk_scale, HEAD_DIM, BLOCK_M, 0, EVEN_M, EVEN_N,
                             PAD_D, DQ_ATOMIC, DQ_TMA)

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
def _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, step_k, step_v, rows, offs_nb, offs_d,
              lo, hi, seqlen_k, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
              EVEN_N: tl.constexpr, PAD_D: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_nb
        k = _load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
        v = _load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASK == 1:
            p = tl.where(rows[:, None] >= cols[None, :], p, 0.0)
        if MASK == 2:
            p = tl.where(cols[None, :] < seqlen_k, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision="ieee")
        k_ptrs += step_k
        v_ptrs += step_v
    return dq


@_triton.jit
def _dq_kernel(Q, K, V, DO, LSE, Delta, DQ,
               stride_qb, stride_qs, stride_qh, stride_qd,
               stride_kb, stride_ks, stride_kh, stride_kd,
               stride_vb, stride_vs, stride_vh, stride_vd,
               stride_db, stride_ds, stride_dh, stride_dd,
               stride_lb, stride_lh, stride_ls,
               stride_tb, stride_th, stride_ts,
               stride_dqb, stride_dqs, stride_dqh, stride_dqd,
               n_heads_q, group, seqlen_q, seqlen_k, sm_scale, qk_scale,
               Q_BUCKET, K_BUCKET,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_q
    off_h = pid_bh % n_heads_q
    off_hk = off_h // group
    start_m = pid_m * BLOCK_M

    offs_mb = tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = start_m + offs_mb
    start_m64 = start_m.to(tl.int64)

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

    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    k_tile = offs_nb[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_tile = offs_nb[:, None] * stride_vs + offs_d[None, :] * stride_vd
    step_k = BLOCK_N * stride_ks
    step_v = BLOCK_N * stride_vs

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        band_lo = (start_m // BLOCK_N) * BLOCK_N
        dq = _dq_inner(dq, q, do, lse2, delta, k_base + k_tile, v_base + v_tile, step_k, step_v,
                       rows, offs_nb, offs_d, 0, band_lo, seqlen_k, qk_scale,
                       HEAD_DIM, BLOCK_N, 0, True, PAD_D)
        band_hi = tl.minimum(start_m + BLOCK_M, seqlen_k)
        dq = _dq_inner(dq, q, do, lse2, delta,
                       k_base + band_lo.to(tl.int64) * stride_ks + k_tile,
                       v_base + band_lo.to(tl.int64) * stride_vs + v_tile, step_k, step_v,
                       rows, offs_nb, offs_d, band_lo, band_hi, seqlen_k, qk_scale,
                       HEAD_DIM, BLOCK_N, 1, EVEN_N, PAD_D)
    else:
        if EVEN_N:
            dq = _dq_inner(dq, q, do, lse2, delta, k_base + k_tile, v_base + v_tile, step_k,
                           step_v, rows, offs_nb, offs_d, 0, seqlen_k, seqlen_k, qk_scale,
                           HEAD_DIM, BLOCK_N, 0, True, PAD_D)
        else:
            n_full = (seqlen_k // BLOCK_N) * BLOCK_N
            dq = _dq_inner(dq, q, do, lse2, delta, k_base + k_tile, v_base + v_tile, step_k,
                           step_v, rows, offs_nb, offs_d, 0, n_full, seqlen_k, qk_scale,
                           HEAD_DIM, BLOCK_N, 0, True, PAD_D)
            dq = _dq_inner(dq, q, do, lse2, delta,
                           k_base + n_full.to(tl.int64) * stride_ks + k_tile,
                           v_base + n_full.to(tl.int64) * stride_vs + v_tile, step_k, step_v,
                           rows, offs_nb, offs_d, n_full, seqlen_k, seqlen_k, qk_scale,
                           HEAD_DIM, BLOCK_N, 2, False, PAD_D)

    dq = dq * sm_scale
    dq_ptrs = (DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
               + start_m64 * stride_dqs + offs_mb[:, None] * stride_dqs
               + offs_d[None, :] * stride_dqd)
    _store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M,
                PAD_D)


_BWD_KEY = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL"]
_dkdv_split = _autotune(_DKDV_CONFIGS, key=_BWD_KEY)(_triton.heuristics(_EVEN_HEURISTICS)(_dkdv_kernel))
# Autotuning the atomic flavour runs it several times: dQ must be re-zeroed each time.
_dkdv_atomic = _autotune(_DKDV_CONFIGS, key=_BWD_KEY, reset_to_zero=["DQ"])(
    _triton.heuristics(_EVEN_HEURISTICS)(_dkdv_kernel))


_dkdv_atomic_tma = _autotune(_with_hook(_DKDV_CONFIGS), key=_BWD_KEY, reset_to_zero=["DQ"])(
    _triton.heuristics(_EVEN_HEURISTICS)(_dkdv_kernel))
_dq_tuned = _autotune(_DQ_CONFIGS, key=_BWD_KEY)(_triton.heuristics(_EVEN_HEURISTICS)(_dq_kernel))

# ----------------------------------------------------------------------------- python API

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_available(device) -> bool:
    """True where these kernels can run: CUDA/ROCm devices, or CPU in interpreter mode."""
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        # The interpreter is chosen when the kernels are decorated (module import).
        return _INTERPRET
    return False


def _tma_available(device: torch.device) -> bool:
    """TMA reduce-add for dQ: Hopper+ CUDA, a triton with host tensor descriptors and
    descriptor atomics, compiled mode. Elsewhere the atomic mode uses pointer atomics."""
    return (TensorDescriptor is not None and not _INTERPRET and device.type == "cuda"
            and torch.version.hip is None and hasattr(tl, "tensor_descriptor")
            and hasattr(tl.tensor_descriptor, "atomic_add")
            and torch.cuda.get_device_capability(device)[0] >= 9
            and os.environ.get("LONGCTX_TRITON_TMA", "1") != "0")


def _device_guard(t: torch.Tensor):
    # Triton launches on the *current* CUDA device; make it the tensors' device.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    # Any strides work except a non-unit stride on head_dim (it would defeat vector loads).
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_qkv(q, k, v, causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} not supported (float16, bfloat16, float32)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if D > 256:
        raise ValueError(f"head_dim {D} > 256 is not supported by the triton backend")
    if causal and Sq != k.shape[1]:
        raise ValueError(f"causal attention needs an aligned block (Sq == Sk), got Sq={Sq}, Sk={k.shape[1]}")
    if B * Hq >= 65536:
        raise ValueError(f"batch*heads = {B * Hq} exceeds the CUDA grid limit (65535)")
    if not is_available(q.device):
        raise RuntimeError(f"triton attention is not available on {q.device}"
                           + (" (set TRITON_INTERPRET=1 before import for CPU)" if q.device.type == "cpu" else ""))


def forward(q, k, v, causal, softmax_scale, out_dtype=None, q_doc=None, k_doc=None):
    """(out (B, Sq, Hq, D) in out_dtype or q.dtype, lse fp32 (B, Hq, Sq), natural log).
    q_doc / k_doc: document ids (B, Sq) / (B, Sk) (validated by the seam) or None."""
    _check_qkv(q, k, v, causal)
    if out_dtype is None:
        out_dtype = q.dtype
    if out_dtype not in _DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not supported")
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = torch.empty((B, Sq, Hq, D), dtype=out_dtype, device=q.device)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if Sk == 0:  # no keys: empty softmax, the merge treats lse = -inf as "no contribution"
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    q, k, v = _last_dim_unit(q), _last_dim_unit(k), _last_dim_unit(v)
    if q_doc is not None:
        from . import triton_document

        with _device_guard(q):
            triton_document.launch_forward(q, k, v, out, lse, q_doc, k_doc, causal,
                                           float(softmax_scale) * LOG2E)
        return out, lse

    def grid(meta):
        return (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)

    with _device_guard(q):
        _fwd_kernel[grid](
            q, k, v, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
            Hq, Hq // Hkv, Sq, Sk, float(softmax_scale) * LOG2E,
            _bucket(Sq), _bucket(Sk),
            HEAD_DIM=D, BLOCK_D=_block_d(D), CAUSAL=bool(causal),
        )
    return out, lse


def compute_delta(out, dout):
    """rowsum(dout * out) in fp32, (B, Hq, Sq): one pass over both (any float dtypes)."""
    if out.shape != dout.shape or out.dim() != 4:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must be equal (B, S, H, D)")
    B, Sq, Hq, _ = out.shape
    if out.numel() == 0:
        return torch.zeros((B, Hq, Sq), dtype=torch.float32, device=out.device)
    with _device_guard(out):
        return _compute_delta(_last_dim_unit(out), _last_dim_unit(dout), (B, Hq, Sq))


def _compute_delta(out, dout, lse_shape):
    B, Sq, Hq, D = out.shape
    delta = torch.empty(lse_shape, dtype=torch.float32, device=out.device)
    block_m = 16 if _INTERPRET else 64
    grid = (triton.cdiv(Sq, block_m), B * Hq)
    _delta_kernel[grid](out, dout, delta, *out.stride(), *dout.stride(), *delta.stride(),
                        Hq, Sq, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=block_m)
    return delta


def backward(dout, q, k, v, out, lse, causal, softmax_scale, delta=None, grad_dtype=None,
             q_doc=None, k_doc=None):
    """(dq, dk, dv) in grad_dtype (None -> q.dtype). dK/dV are reduced over GQA groups.
    q_doc / k_doc: document ids as in forward()."""
    _check_qkv(q, k, v, causal)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if dout.shape != q.shape:
        raise ValueError(f"dout shape {tuple(dout.shape)} != q shape {tuple(q.shape)}")
    if tuple(lse.shape) != (B, Hq, Sq):
        raise ValueError(f"lse must be (B, Hq, Sq) = {(B, Hq, Sq)}, got {tuple(lse.shape)}")
    if delta is None and out is None:
        raise ValueError("backward needs `out` (or a precomputed `delta`)")
    if delta is not None and tuple(delta.shape) != (B, Hq, Sq):
        raise ValueError(f"delta must be (B, Hq, Sq) = {(B, Hq, Sq)}, got {tuple(delta.shape)}")
    if grad_dtype is None:
        grad_dtype = q.dtype
    if grad_dtype not in _DTYPES:
        raise TypeError(f"grad_dtype {grad_dtype} not supported")
    if BWD_MODE not in ("split", "atomic"):
        raise ValueError(f"BWD_MODE must be 'split' or 'atomic', got {BWD_MODE!r}")

    dk = torch.empty((B, Sk, Hkv, D), dtype=grad_dtype, device=q.device)
    dv = torch.empty_like(dk)
    if Sq == 0 or Sk == 0 or B * Hq == 0:
        return (torch.zeros((B, Sq, Hq, D), dtype=grad_dtype, device=q.device), dk.zero_(), dv.zero_())

    # The kernels multiply dO with V and Q tiles: one dtype for all (a no-op normally).
    dout = dout.to(q.dtype)
    q, k, v, dout = (_last_dim_unit(t) for t in (q, k, v, dout))
    lse = lse.float()
    with _device_guard(q):
        if delta is None:
            delta = _compute_delta(_last_dim_unit(out), dout, (B, Hq, Sq))
        else:
            delta = delta.float()
        qk_scale = float(softmax_scale) * LOG2E
        common = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), CAUSAL=bool(causal))
        buckets = (_bucket(Sq), _bucket(Sk))

        def grid_kv(meta):
            return (triton.cdiv(Sk, meta["BLOCK_N"]), B * Hkv)

        doc = None
        if q_doc is not None:
            from . import triton_document as doc

        if BWD_MODE == "atomic":
            if _tma_available(q.device) and D % 4 == 0:
                # (B, Hq, Sq, D) so that each head's rows are one contiguous 2D block.
                dq_acc = torch.zeros((B, Hq, Sq, D), dtype=torch.float32, device=q.device)
                desc = TensorDescriptor(dq_acc.view(B * Hq * Sq, D), [B * Hq * Sq, D], [D, 1],
                                        [16, 16])  # box set per config by _set_dq_block
                dq_view = dq_acc.transpose(1, 2)
                kernel, tma = (doc._dkdv_atomic_tma if doc else _dkdv_atomic_tma), True
            else:
                dq_acc = torch.zeros((B, Sq, Hq, D), dtype=torch.float32, device=q.device)
                desc, dq_view, tma = dq_acc, dq_acc, False
                kernel = doc._dkdv_atomic if doc else _dkdv_atomic
            if doc:
                doc.launch_dkdv(kernel, q, k, v, dout, lse, delta, dk, dv, dq_view, desc, q_doc,
                                k_doc, causal, float(softmax_scale), qk_scale, dq_atomic=True,
                                dq_tma=tma)
            else:
                kernel[grid_kv](
                    q, k, v, dout, lse, delta, dk, dv, dq_view, desc,
                    *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
                    *delta.stride(), *dk.stride(), *dv.stride(), *dq_view.stride(),
                    Hkv, Hq // Hkv, Sq, Sk, float(softmax_scale), qk_scale, *buckets,
                    DQ_ATOMIC=True, DQ_TMA=tma, **common)
            dq = dq_view.to(grad_dtype, memory_format=torch.contiguous_format)
            return dq, dk, dv

        dq = torch.empty((B, Sq, Hq, D), dtype=grad_dtype, device=q.device)
        if doc:
            doc.launch_dkdv(doc._dkdv_split, q, k, v, dout, lse, delta, dk, dv, dq, dq, q_doc,
                            k_doc, causal, float(softmax_scale), qk_scale, dq_atomic=False,
                            dq_tma=False)
            doc.launch_dq(q, k, v, dout, lse, delta, dq, q_doc, k_doc, causal,
                          float(softmax_scale), qk_scale)
            return dq, dk, dv
        # dq is passed as the unused DQ / DQ_DESC arguments of the split dK/dV kernel.
        _dkdv_split[grid_kv](
            q, k, v, dout, lse, delta, dk, dv, dq, dq,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
            *delta.stride(), *dk.stride(), *dv.stride(), *dq.stride(),
            Hkv, Hq // Hkv, Sq, Sk, float(softmax_scale), qk_scale, *buckets,
            DQ_ATOMIC=False, DQ_TMA=False, **common)

        def grid_q(meta):
            return (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)

        _dq_tuned[grid_q](
            q, k, v, dout, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(),
            *delta.stride(), *dq.stride(),
            Hq, Hq // Hkv, Sq, Sk, float(softmax_scale), qk_scale, *buckets, **common)
    return dq, dk, dv
