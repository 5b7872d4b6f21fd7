"""The in-place partial-result merge against a float64 formula, incl. rows with no keys."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import pythonpath

from longctx.kernels.merge import merge_partials_


def check_merge(impl: str, block_dtype: torch.dtype) -> None:
    b, s, h, d = 2, 37, 3, 24
    out = torch.randn(b, s, h, d)
    lse = torch.randn(b, h, s) * 3
    out_b = torch.randn(b, s, h, d).to(block_dtype)
    lse_b = torch.randn(b, h, s) * 3
    lse[0, 0, :5] = float("-inf")  # running side has seen no key yet
    out[0, :5, 0] = 0.0
    lse_b[1, 2, 7:9] = float("-inf")  # block side saw no key
    lse[1, 2, 8] = float("-inf")  # ... and neither did the running side
    out[1, 8, 2] = 0.0
    # NaN/Inf in q or k reach the merge as a NaN or +inf lse: the row must come out NaN,
    # whatever the partial output holds (a kernel may have written 0 there).
    lse[0, 1, 10], out[0, 10, 1] = float("nan"), 0.0  # running side NaN
    lse_b[1, 0, 12], out_b[1, 12, 0] = float("nan"), 0.0  # block side NaN
    lse_b[0, 2, 3], out_b[0, 3, 2] = float("inf"), float("nan")  # block side +inf
    lse_b[1, 1, 20], out_b[1, 20, 1] = float("nan"), 0.0  # NaN block on an
    lse[1, 1, 20], out[1, 20, 1] = float("-inf"), 0.0  # empty running row
    want_lse = torch.logaddexp(lse.double(), lse_b.double())
    empty = (lse == float("-inf")) & (lse_b == float("-inf"))
    weight = lambda side: torch.exp(side.double() - want_lse).masked_fill(empty, 0.0).transpose(1, 2).unsqueeze(-1)  # noqa: E731
    want_out = weight(lse) * out.double() + weight(lse_b) * out_b.double()
    nan_rows = want_out.isnan()
    assert int(nan_rows.any(-1).sum()) == 4  # the reference itself shows each non-finite row
    # merge into the second half of a larger buffer: views with non-trivial strides
    big_out = torch.randn(b, 2 * s, h, d)
    big_lse = torch.randn(b, h, 2 * s)
    big_out[:, s:] = out
    big_lse[:, :, s:] = lse
    merge_partials_(big_out[:, s:], big_lse[:, :, s:], out_b, lse_b, impl=impl)
    got_out, got_lse = big_out[:, s:], big_lse[:, :, s:]
    assert torch.equal(got_out.isnan(), nan_rows), "NaN rows differ from the reference"
    # Rows with no key stay exactly -inf; a non-finite row may read NaN or +inf.
    assert torch.equal(got_lse == float("-inf"), want_lse == float("-inf"))
    assert torch.equal(torch.isfinite(got_lse), torch.isfinite(want_lse))
    assert torch.isfinite(got_out[~nan_rows]).all()
    fin = torch.isfinite(want_lse)
    assert ((got_lse.double() - want_lse)[fin].abs().max()) < 1e-5
    err = (got_out.double() - want_out)[~nan_rows].norm() / want_out[~nan_rows].norm()
    assert err < 1e-6, err


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16])
def test_merge_torch(block_dtype):
    check_merge("torch", block_dtype)


def test_merge_triton_interpreted():
    """The Triton merge kernel, run by Triton's CPU interpreter in a fresh process."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch, test_merge
        for dt in (torch.float32, torch.bfloat16):
            test_merge.check_merge("triton", dt)
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath(os.path.dirname(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
