"""The document-masked dK/dV kernel (see triton_document.py for the key-major block map it
walks, triton_document_launch.py for its launch), and its split / atomic / atomic-TMA
flavours as in the dense backward."""

from . import triton_tiles as tt
from .triton_tiles import TL_LOG2E, document_autotune, load_row, load_tile, store_tile, tl, triton_or_shim


@triton_or_shim.jit
def _dkdv_tile(
    dk,
    dv,
    k,
    v,
    k_doc,
    q_base,
    do_base,
    lse_base,
    delta_base,
    dq_base,
    qdoc_base,
    dq_desc,
    dq_row,
    stride_qs,
    stride_qd,
    stride_ds,
    stride_dd,
    stride_ls,
    stride_ts,
    stride_dqs,
    stride_dqd,
    stride_qds,
    start_m,
    offs_n,
    offs_mb,
    offs_d,
    seqlen_q,
    seqlen_k,
    sm_scale,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    PAD_D: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    DQ_TMA: tl.constexpr,
):
    # Transposed frame (keys x queries), as in triton_attention_dkdv._dkdv_inner. Query rows
    # past seqlen_q load q = dO = 0, lse = delta = 0 and contribute exact zeros.
    rows = start_m + offs_mb
    start64 = start_m.to(tl.int64)
    q_tile = offs_mb[:, None] * stride_qs + offs_d[None, :] * stride_qd
    do_tile = offs_mb[:, None] * stride_ds + offs_d[None, :] * stride_dd
    q = load_tile(q_base + start64 * stride_qs + q_tile, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
    lse = load_row(lse_base + (start64 + offs_mb) * stride_ls, rows, seqlen_q, EVEN_M)
    s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
    p_t = tl.math.exp2(s_t * qk_scale - (lse * TL_LOG2E)[None, :])
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
    do = load_tile(do_base + start64 * stride_ds + do_tile, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
    delta = load_row(delta_base + (start64 + offs_mb) * stride_ts, rows, seqlen_q, EVEN_M)
    dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision="ieee")
    if DQ_ATOMIC:
        dq = tl.dot(tl.trans(ds_t), k, input_precision="ieee") * sm_scale
        if DQ_TMA:
            dq_desc.atomic_add([dq_row + start_m, 0], dq)
        else:
            dq_ptrs = dq_base + start64 * stride_dqs + offs_mb[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
            if EVEN_M and not PAD_D:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
            else:
                dq_mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
                tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
    return dk, dv


@triton_or_shim.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    Delta,
    DK,
    DV,
    DQ,
    DQ_DESC,
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
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dkd,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_dvd,
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
    n_heads_kv,
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
    DQ_ATOMIC: tl.constexpr,
    DQ_TMA: tl.constexpr,
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

    k_ptrs = (
        K
        + off_b.to(tl.int64) * stride_kb
        + off_hk.to(tl.int64) * stride_kh
        + start_n.to(tl.int64) * stride_ks
        + tl.arange(0, BLOCK_N)[:, None] * stride_ks
        + offs_d[None, :] * stride_kd
    )
    v_ptrs = (
        V
        + off_b.to(tl.int64) * stride_vb
        + off_hk.to(tl.int64) * stride_vh
        + start_n.to(tl.int64) * stride_vs
        + tl.arange(0, BLOCK_N)[:, None] * stride_vs
        + offs_d[None, :] * stride_vd
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Key tiles nobody sees (e.g. of a later document) loop zero times and store zeros.
    k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    v = load_tile(v_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    k_doc = tl.load(KDOC + off_b.to(tl.int64) * stride_kdb + offs_n * stride_kds, mask=offs_n < seqlen_k, other=0)
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
            dk, dv = _dkdv_tile(
                dk,
                dv,
                k,
                v,
                k_doc,
                q_base,
                do_base,
                lse_base,
                delta_base,
                dq_base,
                qdoc_base,
                DQ_DESC,
                dq_row,
                stride_qs,
                stride_qd,
                stride_ds,
                stride_dd,
                stride_ls,
                stride_ts,
                stride_dqs,
                stride_dqd,
                stride_qds,
                start_m,
                offs_n,
                offs_mb,
                offs_d,
                seqlen_q,
                seqlen_k,
                sm_scale,
                qk_scale,
                HEAD_DIM,
                CAUSAL,
                False,
                EVEN_M,
                EVEN_N,
                PAD_D,
                DQ_ATOMIC,
                DQ_TMA,
            )
        for i in range(n_full, n_visit):
            start_m = tl.load(idx_ptr + i * stride_ic) * BLOCK_M
            dk, dv = _dkdv_tile(
                dk,
                dv,
                k,
                v,
                k_doc,
                q_base,
                do_base,
                lse_base,
                delta_base,
                dq_base,
                qdoc_base,
                DQ_DESC,
                dq_row,
                stride_qs,
                stride_qd,
                stride_ds,
                stride_dd,
                stride_ls,
                stride_ts,
                stride_dqs,
                stride_dqd,
                stride_qds,
                start_m,
                offs_n,
                offs_mb,
                offs_d,
                seqlen_q,
                seqlen_k,
                sm_scale,
                qk_scale,
                HEAD_DIM,
                CAUSAL,
                True,
                EVEN_M,
                EVEN_N,
                PAD_D,
                DQ_ATOMIC,
                DQ_TMA,
            )

    dk = dk * sm_scale
    dk_ptrs = (
        DK
        + off_b.to(tl.int64) * stride_dkb
        + off_hk.to(tl.int64) * stride_dkh
        + start_n.to(tl.int64) * stride_dks
        + tl.arange(0, BLOCK_N)[:, None] * stride_dks
        + offs_d[None, :] * stride_dkd
    )
    dv_ptrs = (
        DV
        + off_b.to(tl.int64) * stride_dvb
        + off_hk.to(tl.int64) * stride_dvh
        + start_n.to(tl.int64) * stride_dvs
        + tl.arange(0, BLOCK_N)[:, None] * stride_dvs
        + offs_d[None, :] * stride_dvd
    )
    store_tile(dk_ptrs, dk.to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)


document_dkdv_split = document_autotune(tt.DKDV_CONFIGS)(triton_or_shim.heuristics(tt.EVEN_HEURISTICS)(_dkdv_kernel))
# Autotuning the atomic flavour runs it several times: dQ must be re-zeroed each time.
document_dkdv_atomic = document_autotune(tt.DKDV_CONFIGS, reset_to_zero=["DQ"])(
    triton_or_shim.heuristics(tt.EVEN_HEURISTICS)(_dkdv_kernel)
)
document_dkdv_atomic_tma = document_autotune(tt.with_dq_desc_hook(tt.DKDV_CONFIGS), reset_to_zero=["DQ"])(
    triton_or_shim.heuristics(tt.EVEN_HEURISTICS)(_dkdv_kernel)
)
