"""The dense backward's dQ kernel of "split" mode (see triton_attention.py, which launches
it): one program per (query tile, batch*q-head) looping over key tiles."""

from .triton_tiles import (
    BWD_KEY,
    DQ_CONFIGS,
    EVEN_HEURISTICS,
    TL_LOG2E,
    autotune,
    load_row,
    load_tile,
    store_tile,
    tl,
    triton_or_shim,
)


@triton_or_shim.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_ptrs,
    v_ptrs,
    step_k,
    step_v,
    rows,
    offs_nb,
    offs_d,
    lo,
    hi,
    seqlen_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    EVEN_N: tl.constexpr,
    PAD_D: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_nb
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
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


@triton_or_shim.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    Delta,
    DQ,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
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
        LSE + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + rows * stride_ls, rows, seqlen_q, EVEN_M
    )
    delta = load_row(
        Delta + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th + rows * stride_ts,
        rows,
        seqlen_q,
        EVEN_M,
    )
    lse2 = lse * TL_LOG2E

    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    k_tile = offs_nb[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_tile = offs_nb[:, None] * stride_vs + offs_d[None, :] * stride_vd
    step_k = BLOCK_N * stride_ks
    step_v = BLOCK_N * stride_vs

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        band_lo = (start_m // BLOCK_N) * BLOCK_N
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_base + k_tile,
            v_base + v_tile,
            step_k,
            step_v,
            rows,
            offs_nb,
            offs_d,
            0,
            band_lo,
            seqlen_k,
            qk_scale,
            HEAD_DIM,
            BLOCK_N,
            0,
            True,
            PAD_D,
        )
        band_hi = tl.minimum(start_m + BLOCK_M, seqlen_k)
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_base + band_lo.to(tl.int64) * stride_ks + k_tile,
            v_base + band_lo.to(tl.int64) * stride_vs + v_tile,
            step_k,
            step_v,
            rows,
            offs_nb,
            offs_d,
            band_lo,
            band_hi,
            seqlen_k,
            qk_scale,
            HEAD_DIM,
            BLOCK_N,
            1,
            EVEN_N,
            PAD_D,
        )
    else:
        if EVEN_N:
            dq = _dq_inner(
                dq,
                q,
                do,
                lse2,
                delta,
                k_base + k_tile,
                v_base + v_tile,
                step_k,
                step_v,
                rows,
                offs_nb,
                offs_d,
                0,
                seqlen_k,
                seqlen_k,
                qk_scale,
                HEAD_DIM,
                BLOCK_N,
                0,
                True,
                PAD_D,
            )
        else:
            n_full = (seqlen_k // BLOCK_N) * BLOCK_N
            dq = _dq_inner(
                dq,
                q,
                do,
                lse2,
                delta,
                k_base + k_tile,
                v_base + v_tile,
                step_k,
                step_v,
                rows,
                offs_nb,
                offs_d,
                0,
                n_full,
                seqlen_k,
                qk_scale,
                HEAD_DIM,
                BLOCK_N,
                0,
                True,
                PAD_D,
            )
            dq = _dq_inner(
                dq,
                q,
                do,
                lse2,
                delta,
                k_base + n_full.to(tl.int64) * stride_ks + k_tile,
                v_base + n_full.to(tl.int64) * stride_vs + v_tile,
                step_k,
                step_v,
                rows,
                offs_nb,
                offs_d,
                n_full,
                seqlen_k,
                seqlen_k,
                qk_scale,
                HEAD_DIM,
                BLOCK_N,
                2,
                False,
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


dq_tuned = autotune(DQ_CONFIGS, key=BWD_KEY)(triton_or_shim.heuristics(EVEN_HEURISTICS)(_dq_kernel))
