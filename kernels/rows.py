"""Row-wise passes over attention results: one Triton pass each where PyTorch needs several.

``add_rows_(dst, rows, src)``: a gradient partial ``src`` added into rows of an accumulator
``dst`` in fp32, stored back in ``dst``'s dtype (bf16 where the first contribution was a
vendor kernel's own output). PyTorch needs a gather, an upcast, the add and a scatter
(what that cost the document ring: benchmarks/NOTES.md).

``sum_rows_(dst, src, order, starts, most)``: row r of ``dst`` becomes the fp32 sum of the rows
``order[starts[r]:starts[r + 1]]`` of ``src``, rounded once to ``dst``'s dtype: the dK/dV
partials of the gather call's key rows summed per received row (a row read by several
segments). PyTorch needs zeros, an upcast, ``index_add_`` (a slow scatter) and a downcast.

``mark_nonfinite_rows_(out, lse, covered)``: rows whose lse is not finite become NaN in
``out`` and ``lse``. A kernel's max (fmax) can drop NaN scores and report the row as one
that saw no key; where every row sees a key that means NaN came in, and the row must show
it. ``masked_fill_`` rewrote all of ``out`` to mark (almost always) no row; this reads the
lse and writes only the rows it marks.

Rows are along dim 1 of ``(B, S, H, D)`` tensors (lse ``(B, H, S)``); ``rows`` is None (all,
in order), a slice, or an int64 index tensor of distinct rows (each is written once: no
atomics). CPU tensors take the PyTorch form; ``impl="triton"`` runs the kernels under
``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

try:  # Triton is optional: CPU-only machines use the PyTorch forms.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

# Rows of a tensor along its sequence dim: None = every row in order, a slice = a contiguous
# range, a tensor = gathered rows (int64 indices on the tensor's device).
Rows = Union[None, slice, torch.Tensor]


def rows_of(t: torch.Tensor, rows: Rows, dim: int = 1) -> torch.Tensor:
    """``t``'s rows ``rows`` along ``dim`` (a view for None and slices, a gather otherwise)."""
    if rows is None:
        return t
    if isinstance(rows, slice):
        return t.narrow(dim, rows.start, rows.stop - rows.start)
    return t.index_select(dim, rows)


def count_rows(t: torch.Tensor, rows: Rows, dim: int = 1) -> int:
    """How many rows ``rows`` names of ``t``'s ``dim``."""
    if rows is None:
        return t.shape[dim]
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _use_triton(impl: str, *tensors: torch.Tensor) -> bool:
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if triton is None or impl == "torch" or any(t.stride(-1) != 1 for t in tensors):
        return False
    return impl == "triton" or tensors[0].is_cuda


if triton is not None:
    # Row counts, offsets and lse strides change from call to call with the data; Triton would
    # compile a new variant whenever one of them changes class (1, multiple of 16, other) or an
    # lse/index pointer changes alignment, i.e. in the middle of a run. Not specialized on them,
    # every call of a run takes the variant compiled on its first step.

    @triton.jit(do_not_specialize=["n_rows", "row_offset"], do_not_specialize_on_alignment=["rows"])
    def _add_rows_kernel(
        dst,
        src,
        rows,
        n_rows,
        n_heads,
        head_dim,
        row_offset,
        sd_b,
        sd_s,
        sd_h,
        ss_b,
        ss_s,
        ss_h,
        INDEXED: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // n_heads
        h = bh % n_heads
        i = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        ok = i < n_rows
        if INDEXED:
            target = tl.load(rows + i, mask=ok, other=0)
        else:
            target = row_offset + i
        tile_ok = ok[:, None] & (cols[None, :] < head_dim)
        dst_ptr = dst + b * sd_b + h * sd_h + target[:, None] * sd_s + cols[None, :]
        src_ptr = src + b * ss_b + h * ss_h + i[:, None] * ss_s + cols[None, :]
        acc = tl.load(dst_ptr, mask=tile_ok, other=0.0).to(tl.float32)
        acc += tl.load(src_ptr, mask=tile_ok, other=0.0).to(tl.float32)
        tl.store(dst_ptr, acc.to(dst.dtype.element_ty), mask=tile_ok)

    @triton.jit(
        do_not_specialize=["n_rows", "most", "sd_s", "ss_s"],
        do_not_specialize_on_alignment=["order", "starts"],
    )
    def _sum_rows_kernel(
        dst,
        src,
        order,
        starts,
        n_rows,
        most,
        n_heads,
        head_dim,
        sd_s,
        sd_h,
        ss_s,
        ss_h,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        h = tl.program_id(1)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        ok = r < n_rows
        first = tl.load(starts + r, mask=ok, other=0)
        count = tl.load(starts + r + 1, mask=ok, other=0) - first
        col_ok = cols[None, :] < head_dim
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        # A while loop: Triton 3.5's interpreter turns a runtime int bound of range() into an
        # int with int(one-element array), which NumPy 2.4 refuses.
        j = 0
        while j < most:
            has = ok & (j < count)
            pos = tl.load(order + first + j, mask=has, other=0)
            src_ptr = src + h * ss_h + pos[:, None] * ss_s + cols[None, :]
            acc += tl.load(src_ptr, mask=has[:, None] & col_ok, other=0.0).to(tl.float32)
            j += 1
        dst_ptr = dst + h * sd_h + r[:, None] * sd_s + cols[None, :]
        tl.store(dst_ptr, acc.to(dst.dtype.element_ty), mask=ok[:, None] & col_ok)

    @triton.jit(
        do_not_specialize=["seq_len", "sl_b", "sl_h", "sc_b"],
        do_not_specialize_on_alignment=["lse", "covered"],
    )
    def _mark_rows_kernel(
        out,
        lse,
        covered,
        seq_len,
        n_heads,
        head_dim,
        so_b,
        so_s,
        so_h,
        sl_b,
        sl_h,
        sl_s,
        sc_b,
        HAS_COVERED: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_s = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // n_heads
        h = bh % n_heads
        rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_D)
        ok = rows < seq_len
        lse_ptr = lse + b * sl_b + h * sl_h + rows * sl_s
        value = tl.load(lse_ptr, mask=ok, other=0.0)
        # Not finite: NaN (x != x) or +-inf.
        bad = ok & ((value != value) | (tl.abs(value) == float("inf")))
        if HAS_COVERED:
            bad = bad & (tl.load(covered + b * sc_b + rows, mask=ok, other=0) != 0)
        tl.store(lse_ptr, tl.full([BLOCK_S], float("nan"), tl.float32), mask=bad)
        out_ptr = out + b * so_b + h * so_h + rows[:, None] * so_s + cols[None, :]
        nan = tl.full([BLOCK_S, BLOCK_D], float("nan"), tl.float32)
        tl.store(out_ptr, nan.to(out.dtype.element_ty), mask=bad[:, None] & (cols[None, :] < head_dim))


def row_block(head_dim: int) -> tuple[int, int]:
    """(rows, columns) of one program's tile for rows of ``head_dim`` values (~8K elements)."""
    block_d = triton.next_power_of_2(head_dim)
    return max(16, min(128, 8192 // block_d)), block_d


def add_rows_(dst: torch.Tensor, rows: Rows, src: torch.Tensor, *, impl: str = "auto") -> None:
    """In place: ``dst[:, rows] += src`` in fp32 (fp64 for fp64), stored in ``dst``'s dtype.

    ``dst`` ``(B, S, H, D)``; ``src`` ``(B, n, H, D)`` with n the number of ``rows`` (any
    float dtype, upcast while loading). ``rows``: None, a slice, or distinct int64 indices.
    """
    n = count_rows(dst, rows)
    if src.shape != (dst.shape[0], n, *dst.shape[2:]):
        raise ValueError(f"add_rows_: src {tuple(src.shape)} does not match dst {tuple(dst.shape)} at {n} rows")
    indexed = isinstance(rows, torch.Tensor)
    if not _use_triton(impl, dst, src) or dst.dtype == torch.float64:
        acc = _accumulator(dst.dtype)
        if dst.dtype == acc and indexed:
            dst.index_add_(1, rows, src.to(acc))
        elif indexed:
            dst.index_copy_(1, rows, dst.index_select(1, rows).to(acc).add_(src).to(dst.dtype))
        else:
            view = rows_of(dst, rows)
            if dst.dtype == acc:
                view.add_(src)
            else:
                view.copy_(view.to(acc).add_(src))
        return
    if n == 0:
        return
    b, _, h, d = dst.shape
    block_r, block_d = row_block(d)
    offset = rows.start if isinstance(rows, slice) else 0
    index = rows if indexed else dst  # any pointer: not read unless INDEXED
    _add_rows_kernel[(triton.cdiv(n, block_r), b * h)](
        dst,
        src,
        index,
        n,
        h,
        d,
        offset,
        dst.stride(0),
        dst.stride(1),
        dst.stride(2),
        src.stride(0),
        src.stride(1),
        src.stride(2),
        INDEXED=indexed,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=4,
    )


def sum_rows_(
    dst: torch.Tensor, src: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, most: int, *, impl: str = "auto"
) -> None:
    """In place: ``dst[:, r] = sum(src[:, order[starts[r]:starts[r + 1]]])`` for every row r of
    ``dst``, summed in fp32 (fp64 for fp64) and rounded once to ``dst``'s dtype; a row no
    position names becomes 0.

    ``dst`` ``(1, m, H, D)``, ``src`` ``(1, n, H, D)`` (any float dtype); ``order`` int64 ``(n,)``:
    the positions of ``src`` grouped by target row; ``starts`` int64 ``(m + 1,)``: each group's
    first place in ``order``; ``most``: the largest group (the kernel's loop count).
    """
    m, n = dst.shape[1], src.shape[1]
    if dst.shape[0] != 1 or src.shape[0] != 1 or dst.shape[2:] != src.shape[2:]:
        raise ValueError(f"sum_rows_: dst {tuple(dst.shape)} and src {tuple(src.shape)} must be (1, rows, H, D) alike")
    if order.shape != (n,) or starts.shape != (m + 1,):
        raise ValueError(
            f"sum_rows_: order {tuple(order.shape)} / starts {tuple(starts.shape)} do not fit "
            f"{n} source and {m} target rows"
        )
    if not _use_triton(impl, dst, src) or dst.dtype == torch.float64:
        acc = _accumulator(dst.dtype)
        target = torch.repeat_interleave(torch.arange(m, device=dst.device), starts.diff(), output_size=n)
        summed = torch.zeros(dst.shape, dtype=acc, device=dst.device)
        summed.index_add_(1, target, src.index_select(1, order).to(acc))
        dst.copy_(summed)
        return
    if m == 0:
        return
    _, _, h, d = dst.shape
    block_r, block_d = row_block(d)
    _sum_rows_kernel[(triton.cdiv(m, block_r), h)](
        dst,
        src,
        order,
        starts,
        m,
        most,
        h,
        d,
        dst.stride(1),
        dst.stride(2),
        src.stride(1),
        src.stride(2),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=4,
    )


def mark_nonfinite_rows_(
    out: torch.Tensor, lse: torch.Tensor, covered: Optional[torch.Tensor] = None, *, impl: str = "auto"
) -> None:
    """In place: where ``lse`` (``(B, H, S)`` fp32) is not finite, and ``covered`` (bool
    ``(B, 1, S)``, or None: every row) holds, ``lse`` and that row of ``out`` (``(B, S, H, D)``)
    become NaN."""
    if not _use_triton(impl, out) or lse.dtype != torch.float32:
        bad = ~torch.isfinite(lse)
        if covered is not None:
            bad &= covered
        lse.masked_fill_(bad, float("nan"))
        # The row mask is made contiguous in out's (B, S, H) order: read through the
        # transposed view, the fill ran at a small fraction of memory bandwidth.
        out.masked_fill_(bad.transpose(1, 2).contiguous().unsqueeze(-1), float("nan"))
        return
    b, s, h, d = out.shape
    block_s, block_d = row_block(d)
    has_covered = covered is not None
    cov = covered.view(torch.uint8) if has_covered else lse  # bool is one byte: no copy
    _mark_rows_kernel[(triton.cdiv(s, block_s), b * h)](
        out,
        lse,
        cov,
        s,
        h,
        d,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        lse.stride(2),
        cov.stride(0) if has_covered else 0,
        HAS_COVERED=has_covered,
        BLOCK_S=block_s,
        BLOCK_D=block_d,
        num_warps=4,
    )
