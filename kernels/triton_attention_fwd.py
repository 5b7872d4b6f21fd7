"""The dense forward kernel (see triton_attention.py, which launches it): one program per
(query tile, batch*q-head); off-diagonal key tiles unmasked, the diagonal band and a ragged
key tail masked, online softmax in base 2, lse in natural log."""

from .triton_tiles import (
    EVEN_HEURISTICS,
    FWD_CONFIGS,
    TL_LN2,
    autotune,
    load_tile,
    store_tile,
    tl,
    triton_or_shim,
)


@triton_or_shim.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    step_k,
    step_v,
    rows,
    offs_n,
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
    # MASK: 0 = none (interior tiles), 1 = causal band, 2 = ragged key tail (full mode).
    # k_ptrs / v_ptrs point at key row `lo` on entry.
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
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
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, PAD_D)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new
        k_ptrs += step_k
        v_ptrs += step_v
    return acc, l_i, m_i


@autotune(FWD_CONFIGS, key=["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL"])
@triton_or_shim.heuristics(EVEN_HEURISTICS)
@triton_or_shim.jit
def fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
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

    q_ptrs = q_base + start_m.to(tl.int64) * stride_qs + offs_mb[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, PAD_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        # Key tiles ending at or before this query tile's first row: no mask at all.
        band_lo = (start_m // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base + k_tile,
            v_base + v_tile,
            step_k,
            step_v,
            rows,
            offs_n,
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
        # Diagonal band; its first tile starts at or before every row, so each row sees
        # at least one key there. Nothing above the diagonal is visited.
        band_hi = tl.minimum(start_m + BLOCK_M, seqlen_k)
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base + band_lo.to(tl.int64) * stride_ks + k_tile,
            v_base + band_lo.to(tl.int64) * stride_vs + v_tile,
            step_k,
            step_v,
            rows,
            offs_n,
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
            acc, l_i, m_i = _fwd_inner(
                acc,
                l_i,
                m_i,
                q,
                k_base + k_tile,
                v_base + v_tile,
                step_k,
                step_v,
                rows,
                offs_n,
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
            acc, l_i, m_i = _fwd_inner(
                acc,
                l_i,
                m_i,
                q,
                k_base + k_tile,
                v_base + v_tile,
                step_k,
                step_v,
                rows,
                offs_n,
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
            acc, l_i, m_i = _fwd_inner(
                acc,
                l_i,
                m_i,
                q,
                k_base + n_full.to(tl.int64) * stride_ks + k_tile,
                v_base + n_full.to(tl.int64) * stride_vs + v_tile,
                step_k,
                step_v,
                rows,
                offs_n,
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

    inv_l = 1.0 / l_i
    acc = acc * inv_l[:, None]
    lse = (m_i + tl.math.log2(l_i)) * TL_LN2

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
