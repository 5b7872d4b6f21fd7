"""Merge a block's partial attention result into a running one, in place, in fp32.

Given the running ``(out, lse)`` of a set of keys and a block's ``(out_b, lse_b)`` over
other keys, the attention over the union is

    lse' = logaddexp(lse, lse_b)
    out' = exp(lse - lse') * out + exp(lse_b - lse') * out_b

A row that has seen no key on either side (both lse = -inf) stays (0-weighted, -inf)
instead of becoming NaN. Only that case is guarded: a NaN (or +inf) lse from NaN/Inf in
q or k must make the merged row NaN, as in single-device attention, not drop the block.

On CUDA this is one Triton pass (read out, out_b, both lse; write out, lse); the
unfused PyTorch version makes about seven passes over the fp32 accumulator, which at
8K tokens per GPU costs a third of a ring step. ``out_b`` may be bf16/fp16 (vendor
kernels) and is upcast while loading, so no fp32 copy of it is ever made. ``out`` may be
in the kernels' dtype too (a first call's output kept as written): the merge is done in
fp32 and rounded once on the store. ``rows=`` merges the block into some rows of ``out``
(a slice, or gathered int64 indices: the document ring's exchanged rows) in the same pass.
"""

from __future__ import annotations

import torch

from .rows import Rows, count_rows, row_block, rows_of

try:  # Triton is optional: CPU-only machines merge with PyTorch ops.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None


def _merge_torch_(out, lse, out_b, lse_b) -> None:
    """``out`` in its accumulator dtype (fp32/fp64)."""
    lse_b = lse_b.to(lse.dtype)
    # -inf - -inf is the one NaN that means "no keys on either side": weight 0 there.
    # sigmoid(-inf - x) is 0 already for any other x, so this touches no other row.
    weight = torch.sigmoid(lse_b - lse).masked_fill_(lse_b == float("-inf"), 0.0)  # (B, H, S)
    out.sub_(weight.transpose(1, 2).unsqueeze(-1) * (out - out_b.to(out.dtype)))
    lse.copy_(torch.logaddexp(lse, lse_b))


if triton is not None:
    # Not specialized on what changes with the data (see kernels/rows.py): one variant a run.
    @triton.jit(
        do_not_specialize=["seq_len", "row_offset", "sl_b", "sl_h", "slb_b", "slb_h"],
        do_not_specialize_on_alignment=["lse", "lse_b", "row_index"],
    )
    def _merge_kernel(
        out,
        lse,
        out_b,
        lse_b,
        row_index,
        seq_len,
        n_heads,
        head_dim,
        row_offset,
        so_b,
        so_s,
        so_h,
        sob_b,
        sob_s,
        sob_h,
        sl_b,
        sl_h,
        sl_s,
        slb_b,
        slb_h,
        slb_s,
        INDEXED: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_s = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // n_heads
        h = bh % n_heads
        rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # rows of the block
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < seq_len
        tile_ok = row_ok[:, None] & (cols[None, :] < head_dim)
        if INDEXED:  # the rows of out / lse they merge into
            target = tl.load(row_index + rows, mask=row_ok, other=0)
        else:
            target = row_offset + rows

        lse_ptr = lse + b * sl_b + h * sl_h + target * sl_s
        l_run = tl.load(lse_ptr, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_blk = tl.load(lse_b + b * slb_b + h * slb_h + rows * slb_s, mask=row_ok, other=float("-inf")).to(tl.float32)
        # Only rows with no key on either side are special-cased; a NaN lse (NaN in q
        # or k) makes its weight NaN (whatever tl.maximum picks for top) and so the row.
        empty = (l_run == float("-inf")) & (l_blk == float("-inf"))
        top = tl.where(empty, 0.0, tl.maximum(l_run, l_blk))
        w_run = tl.exp(l_run - top)
        w_blk = tl.exp(l_blk - top)
        total = tl.where(empty, 1.0, w_run + w_blk)
        inv = tl.where(empty, 0.0, 1.0 / total)
        new_lse = tl.where(empty, float("-inf"), top + tl.log(total))

        out_ptr = out + b * so_b + h * so_h + target[:, None] * so_s + cols[None, :]
        blk_ptr = out_b + b * sob_b + h * sob_h + rows[:, None] * sob_s + cols[None, :]
        o_run = tl.load(out_ptr, mask=tile_ok, other=0.0).to(tl.float32)
        o_blk = tl.load(blk_ptr, mask=tile_ok, other=0.0).to(tl.float32)
        merged = o_run * (w_run * inv)[:, None] + o_blk * (w_blk * inv)[:, None]
        tl.store(out_ptr, merged.to(out.dtype.element_ty), mask=tile_ok)
        tl.store(lse_ptr, new_lse, mask=row_ok)


def merge_partials_(
    out: torch.Tensor,
    lse: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    rows: Rows = None,
    impl: str = "auto",
) -> None:
    """In place: ``out`` (B, S, H, D) and ``lse`` (B, H, S) fp32 absorb ``(out_b, lse_b)``.

    ``rows``: which rows of ``out``/``lse`` (dim 1 / dim 2) the block's rows are: None (all,
    in order), a slice, or distinct int64 indices. ``out`` may be fp32 or the kernels' dtype
    (merged in fp32, rounded once). Views (e.g. the second half of the rows) are fine.
    ``impl``: "auto" (Triton on CUDA, PyTorch elsewhere), "torch", or "triton" (also on the
    CPU under TRITON_INTERPRET=1).
    """
    n = count_rows(out, rows)
    if (
        out_b.shape != (out.shape[0], n, *out.shape[2:])
        or lse_b.shape != (*lse.shape[:2], n)
        or lse.shape[2] != out.shape[1]
    ):
        raise ValueError(
            f"merge shapes differ: out {tuple(out.shape)} at {n} rows vs {tuple(out_b.shape)}, "
            f"lse {tuple(lse.shape)} vs {tuple(lse_b.shape)}"
        )
    use_triton = impl == "triton" or (impl == "auto" and triton is not None and out.is_cuda)
    if not use_triton or out.stride(-1) != 1 or out_b.stride(-1) != 1 or out.dtype == torch.float64:
        acc = torch.float64 if out.dtype == torch.float64 else torch.float32
        if out.dtype == acc and not isinstance(rows, torch.Tensor):
            _merge_torch_(rows_of(out, rows, 1), rows_of(lse, rows, 2), out_b, lse_b)
            return
        # Gathered rows or a low-precision out: merge a copy in fp32, write it back once.
        out_rows = rows_of(out, rows, 1).to(acc, copy=True)
        lse_rows = rows_of(lse, rows, 2).clone()
        _merge_torch_(out_rows, lse_rows, out_b, lse_b)
        if isinstance(rows, torch.Tensor):
            out.index_copy_(1, rows, out_rows.to(out.dtype))
            lse.index_copy_(2, rows, lse_rows)
        else:
            rows_of(out, rows, 1).copy_(out_rows)
            rows_of(lse, rows, 2).copy_(lse_rows)
        return
    if n == 0:
        return
    b, _, h, d = out.shape
    block_s, block_d = row_block(d)
    grid = (triton.cdiv(n, block_s), b * h)
    indexed = isinstance(rows, torch.Tensor)
    _merge_kernel[grid](
        out,
        lse,
        out_b,
        lse_b,
        rows if indexed else lse,
        n,
        h,
        d,
        rows.start if isinstance(rows, slice) else 0,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        out_b.stride(0),
        out_b.stride(1),
        out_b.stride(2),
        lse.stride(0),
        lse.stride(1),
        lse.stride(2),
        lse_b.stride(0),
        lse_b.stride(1),
        lse_b.stride(2),
        INDEXED=indexed,
        BLOCK_S=block_s,
        BLOCK_D=block_d,
        num_warps=4,
    )
