"""The document-masked forward kernel (see triton_document.py for the block maps it walks,
triton_document_launch.py for its launch): per query tile the key tiles its map lists,
full ones unmasked, the rest with the exact document mask."""

from . import triton_tiles as tt
from .triton_tiles import TL_LN2, document_autotune, load_tile, store_tile, tl, triton_or_shim


@triton_or_shim.jit
def _fwd_tile(
    acc,
    l_i,
    m_i,
    q,
    q_doc,
    k_base,
    v_base,
    kdoc_base,
    k_tile,
    v_tile,
    stride_ks,
    stride_vs,
    stride_kds,
    start_n,
    rows,
    offs_n,
    offs_d,
    seqlen_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_N: tl.constexpr,
    PAD_D: tl.constexpr,
):
    cols = start_n + offs_n
    k_ptrs = k_base + start_n.to(tl.int64) * stride_ks + k_tile
    v_ptrs = v_base + start_n.to(tl.int64) * stride_vs + v_tile
    if MASKED:
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    else:  # full tiles are never the ragged key tail (see tile_classes): unmasked loads
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, PAD_D)
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
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    else:
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, PAD_D)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return acc, l_i, m_new


@document_autotune(tt.FWD_CONFIGS)
@triton_or_shim.heuristics(tt.EVEN_HEURISTICS)
@triton_or_shim.jit
def document_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    QDOC,
    KDOC,
    NUM_FULL,
    NUM_VISIT,
    INDICES,
    ORDER,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_qdb,
    stride_qds,
    stride_kdb,
    stride_kds,
    stride_nb,
    stride_nr,
    stride_ib,
    stride_ir,
    stride_ic,
    n_heads_q,
    group,
    seqlen_q,
    seqlen_k,
    qk_scale,
    Q_BUCKET,
    K_BUCKET,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    MAP_M: tl.constexpr,
    MAP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
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

    q_ptrs = (
        Q
        + off_b.to(tl.int64) * stride_qb
        + off_h.to(tl.int64) * stride_qh
        + start_m.to(tl.int64) * stride_qs
        + offs_mb[:, None] * stride_qs
        + offs_d[None, :] * stride_qd
    )
    q = load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
    q_doc = tl.load(QDOC + off_b.to(tl.int64) * stride_qdb + rows * stride_qds, mask=rows < seqlen_q, other=0)
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
        acc, l_i, m_i = _fwd_tile(
            acc,
            l_i,
            m_i,
            q,
            q_doc,
            k_base,
            v_base,
            kdoc_base,
            k_tile,
            v_tile,
            stride_ks,
            stride_vs,
            stride_kds,
            start_n,
            rows,
            offs_n,
            offs_d,
            seqlen_k,
            qk_scale,
            HEAD_DIM,
            CAUSAL,
            False,
            EVEN_N,
            PAD_D,
        )
    for i in range(n_full, n_visit):
        start_n = tl.load(idx_ptr + i * stride_ic) * BLOCK_N
        acc, l_i, m_i = _fwd_tile(
            acc,
            l_i,
            m_i,
            q,
            q_doc,
            k_base,
            v_base,
            kdoc_base,
            k_tile,
            v_tile,
            stride_ks,
            stride_vs,
            stride_kds,
            start_n,
            rows,
            offs_n,
            offs_d,
            seqlen_k,
            qk_scale,
            HEAD_DIM,
            CAUSAL,
            True,
            EVEN_N,
            PAD_D,
        )

    # No visible key: l = 0 -> out 0, lse -inf. A NaN row keeps NaN in both.
    empty = l_i == 0.0
    acc = acc * tl.where(empty, 0.0, 1.0 / l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * TL_LN2)
    o_ptrs = (
        Out
        + off_b.to(tl.int64) * stride_ob
        + off_h.to(tl.int64) * stride_oh
        + start_m.to(tl.int64) * stride_os
        + offs_mb[:, None] * stride_os
        + offs_d[None, :] * stride_od
    )
    store_tile(o_ptrs, acc.to(Out.dtype.element_ty), rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
    l_ptrs = LSE + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + rows * stride_ls
    if EVEN_M:
        tl.store(l_ptrs, lse)
    else:
        tl.store(l_ptrs, lse, mask=rows < seqlen_q)
