"""The dense backward's first kernels (see triton_attention.py, which launches them):
delta = rowsum(dO * O), and dK/dV, one program per (key tile, batch*kv-head) looping over
the group's query heads and query tiles; in "atomic" mode it also adds dQ with fp32
atomics (pointers, or a TMA descriptor on Hopper+)."""

from .triton_tiles import (
    BWD_KEY,
    DKDV_CONFIGS,
    EVEN_HEURISTICS,
    TL_LOG2E,
    autotune,
    load_row,
    load_tile,
    store_tile,
    tl,
    triton_or_shim,
    with_dq_desc_hook,
)


@triton_or_shim.jit
def delta_kernel(
    Out,
    DO,
    Delta,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_db,
    stride_ds,
    stride_dh,
    stride_dd,
    stride_tb,
    stride_th,
    stride_ts,
    n_heads_q,
    seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_q
    off_h = pid_bh % n_heads_q
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = (
        Out
        + off_b.to(tl.int64) * stride_ob
        + off_h.to(tl.int64) * stride_oh
        + rows.to(tl.int64)[:, None] * stride_os
        + offs_d[None, :] * stride_od
    )
    do_ptrs = (
        DO
        + off_b.to(tl.int64) * stride_db
        + off_h.to(tl.int64) * stride_dh
        + rows.to(tl.int64)[:, None] * stride_ds
        + offs_d[None, :] * stride_dd
    )
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    t_ptrs = Delta + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th + rows * stride_ts
    tl.store(t_ptrs, delta, mask=rows < seqlen_q)


@triton_or_shim.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    lse_ptrs,
    delta_ptrs,
    dq_ptrs,
    dq_desc,
    dq_row,
    step_q,
    step_do,
    step_lse,
    step_delta,
    step_dq,
    offs_n,
    offs_mb,
    offs_d,
    lo,
    hi,
    seqlen_q,
    seqlen_k,
    sm_scale,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASK: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    PAD_D: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    DQ_TMA: tl.constexpr,
):
    # Works in the transposed frame (keys x queries) so that dK/dV accumulate as
    # [BLOCK_N, D] with the key tile as the MMA's M dimension.
    # Out-of-range query rows load q = dO = 0, lse = delta = 0: their p is 1 but every
    # product they enter is multiplied by a zero row, so they contribute nothing.
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_mb
        q = load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
        lse = load_row(lse_ptrs, rows, seqlen_q, EVEN_M)
        s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
        p_t = tl.math.exp2(s_t * qk_scale - (lse * TL_LOG2E)[None, :])
        if MASK == 1:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        if not EVEN_N:
            # zero-loaded keys past seqlen_k would get p = exp(-lse), possibly inf
            p_t = tl.where(offs_n[:, None] < seqlen_k, p_t, 0.0)
        do = load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
        delta = load_row(delta_ptrs, rows, seqlen_q, EVEN_M)
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    pid_n = tl.program_id(0)  # causal: low key tiles have the most work and launch first
    pid_bh = tl.program_id(1)
    off_b = pid_bh // n_heads_kv
    off_hk = pid_bh % n_heads_kv
    start_n = pid_n * BLOCK_N

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

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
    k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
    v = load_tile(v_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
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
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                q_base + lo64 * stride_qs + q_tile,
                do_base + lo64 * stride_ds + do_tile,
                lse_base + lo64 * stride_ls + offs_mb * stride_ls,
                delta_base + lo64 * stride_ts + offs_mb * stride_ts,
                dq_base + lo64 * stride_dqs + dq_tile,
                DQ_DESC,
                dq_row,
                step_q,
                step_do,
                step_lse,
                step_delta,
                step_dq,
                offs_n,
                offs_mb,
                offs_d,
                lo,
                mid,
                seqlen_q,
                seqlen_k,
                sm_scale,
                qk_scale,
                HEAD_DIM,
                BLOCK_M,
                1,
                EVEN_M,
                EVEN_N,
                PAD_D,
                DQ_ATOMIC,
                DQ_TMA,
            )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base + mid64 * stride_qs + q_tile,
            do_base + mid64 * stride_ds + do_tile,
            lse_base + mid64 * stride_ls + offs_mb * stride_ls,
            delta_base + mid64 * stride_ts + offs_mb * stride_ts,
            dq_base + mid64 * stride_dqs + dq_tile,
            DQ_DESC,
            dq_row,
            step_q,
            step_do,
            step_lse,
            step_delta,
            step_dq,
            offs_n,
            offs_mb,
            offs_d,
            mid,
            seqlen_q,
            seqlen_q,
            seqlen_k,
            sm_scale,
            qk_scale,
            HEAD_DIM,
            BLOCK_M,
            0,
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


dkdv_split = autotune(DKDV_CONFIGS, key=BWD_KEY)(triton_or_shim.heuristics(EVEN_HEURISTICS)(_dkdv_kernel))
# Autotuning the atomic flavour runs it several times: dQ must be re-zeroed each time.
dkdv_atomic = autotune(DKDV_CONFIGS, key=BWD_KEY, reset_to_zero=["DQ"])(
    triton_or_shim.heuristics(EVEN_HEURISTICS)(_dkdv_kernel)
)


dkdv_atomic_tma = autotune(with_dq_desc_hook(DKDV_CONFIGS), key=BWD_KEY, reset_to_zero=["DQ"])(
    triton_or_shim.heuristics(EVEN_HEURISTICS)(_dkdv_kernel)
)
