"""The document-masked dQ kernel of "split" mode (see triton_document.py for the block map
it walks, triton_document_launch.py for its launch)."""

from . import triton_tiles as tt
from .triton_tiles import TL_LOG2E, document_autotune, load_row, load_tile, store_tile, tl, triton_or_shim


@triton_or_shim.jit
def _dq_tile(
    dq,
    q,
    do,
    lse2,
    delta,
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
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    else:
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, PAD_D)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, PAD_D)
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


@document_autotune(tt.DQ_CONFIGS)
@triton_or_shim.heuristics(tt.EVEN_HEURISTICS)
@triton_or_shim.jit
def document_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    Delta,
    DQ,
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
    stride_db,
    stride_ds,
    stride_dh,
    stride_dd,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_tb,
    stride_th,
    stride_ts,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dqd,
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
    sm_scale,
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
    start_m64 = start_m.to(tl.int64)

    n_full = tl.load(NUM_FULL + off_b * stride_nb + pid_m * stride_nr)
    n_visit = tl.load(NUM_VISIT + off_b * stride_nb + pid_m * stride_nr)
    idx_ptr = INDICES + off_b.to(tl.int64) * stride_ib + pid_m.to(tl.int64) * stride_ir
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if n_visit > 0:
        q_ptrs = (
            Q
            + off_b.to(tl.int64) * stride_qb
            + off_h.to(tl.int64) * stride_qh
            + start_m64 * stride_qs
            + offs_mb[:, None] * stride_qs
            + offs_d[None, :] * stride_qd
        )
        do_ptrs = (
            DO
            + off_b.to(tl.int64) * stride_db
            + off_h.to(tl.int64) * stride_dh
            + start_m64 * stride_ds
            + offs_mb[:, None] * stride_ds
            + offs_d[None, :] * stride_dd
        )
        q = load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
        do = load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
        lse = load_row(
            LSE + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + rows * stride_ls,
            rows,
            seqlen_q,
            EVEN_M,
        )
        delta = load_row(
            Delta + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th + rows * stride_ts,
            rows,
            seqlen_q,
            EVEN_M,
        )
        lse2 = lse * TL_LOG2E
        q_doc = tl.load(QDOC + off_b.to(tl.int64) * stride_qdb + rows * stride_qds, mask=rows < seqlen_q, other=0)
        k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
        kdoc_base = KDOC + off_b.to(tl.int64) * stride_kdb
        k_tile = offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_tile = offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
        for i in range(0, n_full):
            start_n = tl.load(idx_ptr + i * stride_ic) * BLOCK_N
            dq = _dq_tile(
                dq,
                q,
                do,
                lse2,
                delta,
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
            dq = _dq_tile(
                dq,
                q,
                do,
                lse2,
                delta,
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

    dq = dq * sm_scale
    dq_ptrs = (
        DQ
        + off_b.to(tl.int64) * stride_dqb
        + off_h.to(tl.int64) * stride_dqh
        + start_m64 * stride_dqs
        + offs_mb[:, None] * stride_dqs
        + offs_d[None, :] * stride_dqd
    )
    store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
