"""Launches of the document-masked kernels: the block map for each kernel's tile sizes,
then the kernel over its rows (longest first). Called by triton_attention.forward/backward
after their checks and allocations; q, k, v, dout have unit head_dim stride, the block is
non-empty, ids are validated (B, S) ints."""

import torch

from . import triton_tiles as tt
from .triton_document import BlockMap, build_block_map
from .triton_document_dq import document_dq_kernel
from .triton_document_fwd import document_fwd_kernel
from .triton_tiles import document_tiles


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
        raise ValueError(
            f"batch x heads = {batch_heads} exceeds the CUDA grid limit (65535); use smaller micro-batches"
        )
    return (bmap.num_visit.shape[1], batch_heads)


def _map_strides(bmap: BlockMap):
    # num_full, num_visit and order are all contiguous (B, rows): one pair of strides.
    return (*bmap.num_full.stride(), *bmap.indices.stride())


def launch_forward(q, k, v, out, lse, q_doc, k_doc, causal, qk_scale):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q_doc, k_doc = _ids(q_doc), _ids(k_doc)
    block_m, block_n = document_tiles(tt.FWD_CONFIGS, D, q.dtype)
    bmap = build_block_map(q_doc, k_doc, block_m, block_n, causal)
    document_fwd_kernel[_grid(B * Hq, bmap)](
        q,
        k,
        v,
        out,
        lse,
        q_doc,
        k_doc,
        *_map_args(bmap),
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *lse.stride(),
        *q_doc.stride(),
        *k_doc.stride(),
        *_map_strides(bmap),
        Hq,
        Hq // Hkv,
        Sq,
        Sk,
        qk_scale,
        tt.length_bucket(Sq),
        tt.length_bucket(Sk),
        HEAD_DIM=D,
        BLOCK_D=tt.block_d(D),
        CAUSAL=bool(causal),
        MAP_M=block_m,
        MAP_N=block_n,
    )


def launch_dkdv(
    kernel,
    q,
    k,
    v,
    dout,
    lse,
    delta,
    dk,
    dv,
    dq,
    dq_desc,
    q_doc,
    k_doc,
    causal,
    sm_scale,
    qk_scale,
    *,
    dq_atomic,
    dq_tma,
):
    """dK/dV (and with dq_atomic dQ by atomics into `dq`) through `kernel`, one of
    document_dkdv_split / document_dkdv_atomic / document_dkdv_atomic_tma of
    triton_document_dkdv (triton_attention picks as for plain)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q_doc, k_doc = _ids(q_doc), _ids(k_doc)
    block_m, block_n = document_tiles(tt.DKDV_CONFIGS, D, q.dtype)
    bmap = build_block_map(q_doc, k_doc, block_m, block_n, causal, key_major=True)
    kernel[_grid(B * Hkv, bmap)](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk,
        dv,
        dq,
        dq_desc,
        q_doc,
        k_doc,
        *_map_args(bmap),
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *lse.stride(),
        *delta.stride(),
        *dk.stride(),
        *dv.stride(),
        *dq.stride(),
        *q_doc.stride(),
        *k_doc.stride(),
        *_map_strides(bmap),
        Hkv,
        Hq // Hkv,
        Sq,
        Sk,
        sm_scale,
        qk_scale,
        tt.length_bucket(Sq),
        tt.length_bucket(Sk),
        HEAD_DIM=D,
        BLOCK_D=tt.block_d(D),
        CAUSAL=bool(causal),
        DQ_ATOMIC=dq_atomic,
        DQ_TMA=dq_tma,
        MAP_M=block_m,
        MAP_N=block_n,
    )


def launch_dq(q, k, v, dout, lse, delta, dq, q_doc, k_doc, causal, sm_scale, qk_scale):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    q_doc, k_doc = _ids(q_doc), _ids(k_doc)
    block_m, block_n = document_tiles(tt.DQ_CONFIGS, D, q.dtype)
    bmap = build_block_map(q_doc, k_doc, block_m, block_n, causal)
    document_dq_kernel[_grid(B * Hq, bmap)](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq,
        q_doc,
        k_doc,
        *_map_args(bmap),
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *lse.stride(),
        *delta.stride(),
        *dq.stride(),
        *q_doc.stride(),
        *k_doc.stride(),
        *_map_strides(bmap),
        Hq,
        Hq // Hkv,
        Sq,
        Sk,
        sm_scale,
        qk_scale,
        tt.length_bucket(Sq),
        tt.length_bucket(Sk),
        HEAD_DIM=D,
        BLOCK_D=tt.block_d(D),
        CAUSAL=bool(causal),
        MAP_M=block_m,
        MAP_N=block_n,
    )
