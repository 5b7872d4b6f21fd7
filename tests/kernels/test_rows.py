"""Row-wise passes (kernels/rows.py and merge_partials_(rows=)): Triton (interpreted here)
and PyTorch forms against float64 formulas, for every kind of rows, NaN kept."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import pythonpath
from helpers.run_if import requires_cuda

from longctx.kernels.merge import merge_partials_
from longctx.kernels.rows import add_rows_, count_rows, mark_nonfinite_rows_, sum_rows_

ROWS = (None, slice(3, 9), torch.tensor([11, 0, 7, 5]))


def _index(n, rows):
    return torch.arange(n) if rows is None else (torch.arange(n)[rows] if isinstance(rows, slice) else rows)


def check_add_rows(impl: str, seed: int, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(seed)
    b, n, h, d = 2, 12, 3, 24
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            m = count_rows(torch.empty(1, n), rows)
            dst = torch.randn(b, n, h, d, generator=g).to(device, dtype)
            src = torch.randn(b, m, h, d, generator=g).to(device, torch.bfloat16 if dtype == torch.bfloat16 else dtype)
            src[0, 0, 1, 2] = float("nan")  # NaN in a partial shows in the sum
            want = dst.double()
            want[:, _index(n, rows).to(device)] += src.double()
            add_rows_(dst, rows if not isinstance(rows, torch.Tensor) else rows.to(device), src, impl=impl)
            dst, want = dst.cpu(), want.cpu()
            assert torch.equal(dst.isnan(), want.isnan()) and int(dst.isnan().sum()) == 1
            fin = ~want.isnan()
            tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: rounded once on the store
            err = (dst.double()[fin] - want[fin]).abs().max() / want[fin].abs().max()
            assert err < tol, (dtype, rows, float(err))
            # the other rows are untouched
            other = torch.ones(n, dtype=torch.bool)
            other[_index(n, rows)] = False
            assert torch.equal(dst[:, other].double(), want[:, other].to(dtype).double())


def check_mark(impl: str, seed: int, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(seed)
    b, s, h, d = 2, 37, 3, 24
    for covered_too in (False, True):
        out = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16)
        lse = torch.randn(b, h, s, generator=g)
        covered = torch.ones(b, 1, s, dtype=torch.bool)
        lse[0, 1, 4] = float("nan")
        lse[1, 2, 30] = float("-inf")
        lse[1, 0, 7] = float("inf")
        covered[1, 0, 7] = False  # an uncovered row (in no varlen segment) stays as it is
        out, lse, covered = out.to(device), lse.to(device), covered.to(device)
        want_bad = ~torch.isfinite(lse) & (covered if covered_too else True)
        before_out, before_lse = out.clone(), lse.clone()
        mark_nonfinite_rows_(out, lse, covered if covered_too else None, impl=impl)
        row_bad = want_bad.transpose(1, 2).unsqueeze(-1).expand_as(out)
        assert out[row_bad].isnan().all() and torch.equal(out[~row_bad], before_out[~row_bad])
        assert lse[want_bad].isnan().all()
        keep = ~want_bad
        assert torch.equal(lse[keep].isnan(), before_lse[keep].isnan())
        assert torch.equal(lse[keep & torch.isfinite(before_lse)], before_lse[keep & torch.isfinite(before_lse)])
        assert int(want_bad.sum()) == (3 if not covered_too else 2)  # rows to mark exist: not vacuous


def check_merge_rows(impl: str, seed: int, device: str = "cpu") -> None:
    """A block merged into some rows of a bf16 or fp32 out: fp32 math, one rounding, the
    other rows untouched; a NaN lse row comes out NaN."""
    g = torch.Generator().manual_seed(seed)
    n, h, d = 12, 2, 24
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            m = count_rows(torch.empty(1, n), rows)
            out = torch.randn(1, n, h, d, generator=g).to(dtype)
            lse = torch.randn(1, h, n, generator=g) * 3
            out_b = torch.randn(1, m, h, d, generator=g).to(torch.bfloat16)
            lse_b = torch.randn(1, h, m, generator=g) * 3
            lse_b[0, 1, 1] = float("nan")
            index = _index(n, rows)
            want_rows = rows if not isinstance(rows, torch.Tensor) else rows.to(device)
            new_lse = torch.logaddexp(lse[:, :, index].double(), lse_b.double())
            w_run = torch.exp(lse[:, :, index].double() - new_lse).transpose(1, 2).unsqueeze(-1)
            w_blk = torch.exp(lse_b.double() - new_lse).transpose(1, 2).unsqueeze(-1)
            want = out.double().clone()
            want[:, index] = w_run * out[:, index].double() + w_blk * out_b.double()
            want_lse = lse.double().clone()
            want_lse[:, :, index] = new_lse
            out, lse, out_b, lse_b = (t.to(device) for t in (out, lse, out_b, lse_b))
            merge_partials_(out, lse, out_b, lse_b, rows=want_rows, impl=impl)
            out, lse = out.cpu(), lse.cpu()
            assert torch.equal(out.isnan(), want.isnan()) and bool(out.isnan().any())
            fin = ~want.isnan()
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert (out.double()[fin] - want[fin]).abs().max() / want[fin].abs().max() < tol
            lfin = torch.isfinite(want_lse)
            assert (lse.double()[lfin] - want_lse[lfin]).abs().max() < 1e-5


def check_sum_rows(impl: str, seed: int, device: str = "cpu") -> None:
    """Partials summed per target row (rows read 1-3 times, one read by none), into a strided
    bf16 or fp32 view like the gather's message: the float64 sum rounded once; NaN kept."""
    g = torch.Generator().manual_seed(seed)
    m, h, d = 9, 3, 24
    # Row 4 read three times, rows 0 and 3 twice, row 8 by no position.
    target = torch.tensor([4, 0, 4, 7, 2, 4, 0, 1, 3, 6, 5, 3])
    counts = torch.bincount(target, minlength=m)
    assert counts[8] == 0 and counts.max() == 3  # not vacuous
    order = torch.argsort(target, stable=True)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    for dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(1, len(target), h, d, generator=g).to(dtype)
        src[0, 2, 1, 5] = float("nan")  # a partial of row 4: NaN shows in its sum
        want = torch.zeros(1, m, h, d, dtype=torch.float64).index_add_(1, target, src.double())
        message = torch.full((m, 2, h, d), 7.0, dtype=dtype, device=device)
        sum_rows_(message[:, 1].unsqueeze(0), src.to(device), order.to(device), starts.to(device), 3, impl=impl)
        got = message[:, 1].unsqueeze(0).cpu()
        assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 1
        fin = ~want.isnan()
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: rounded once on the store
        assert (got.double()[fin] - want[fin]).abs().max() / want[fin].abs().max() < tol
        assert torch.equal(got[0, 8], torch.zeros(h, d, dtype=dtype))  # read by none: 0
        assert torch.equal(message[:, 0].cpu(), torch.full((m, h, d), 7.0, dtype=dtype))  # the other half untouched
    with pytest.raises(ValueError, match="do not fit"):
        sum_rows_(message[:, 1].unsqueeze(0), src.to(device), order[:-1].to(device), starts.to(device), 3, impl=impl)


CHECKS = (check_add_rows, check_mark, check_merge_rows, check_sum_rows)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_torch_forms(check):
    check("torch", random.randrange(1 << 30))


def test_triton_kernels_interpreted():
    """The same checks on the Triton kernels, by Triton's CPU interpreter in a fresh process."""
    pytest.importorskip("triton")
    seed = random.randrange(1 << 30)
    code = textwrap.dedent(f"""
        import test_rows
        for check in test_rows.CHECKS:
            check("triton", {seed})
        print("ok")
        """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath(os.path.dirname(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, f"seed {seed}\n" + r.stdout + r.stderr


@requires_cuda()
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_compiled_kernels_on_gpu(check):
    check("auto", random.randrange(1 << 30), device="cuda")
