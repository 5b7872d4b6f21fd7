"""The in-place partial-result merge against a float64 formula, incl. rows with no keys."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from longctx.kernels.merge import merge_partials_


def check_merge(impl: str, block_dtype: torch.dtype) -> None:
    b, s, h, d = 2, 37, 3, 24
    out = torch.randn(b, s, h, d)
    lse = torch.randn(b, h, s) * 3
    out_b = torch.randn(b, s, h, d).to(block_dtype)
    lse_b = torch.randn(b, h, s) * 3
    lse[0, 0, :5] = float("-inf")          # running side has seen no key yet
    out[0, :5, 0] = 0.0
    lse_b[1, 2, 7:9] = float("-inf")       # block side saw no key
    lse[1, 2, 8] = float("-inf")           # ... and neither did the running side
    out[1, 8, 2] = 0.0
    want_lse = torch.logaddexp(lse.double(), lse_b.double())
    wa = torch.exp(lse.double() - want_lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lse_b.double() - want_lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    want_out = wa * out.double() + wb * out_b.double()
    # merge into the second half of a larger buffer: views with non-trivial strides
    big_out = torch.randn(b, 2 * s, h, d)
    big_lse = torch.randn(b, h, 2 * s)
    big_out[:, s:] = out
    big_lse[:, :, s:] = lse
    merge_partials_(big_out[:, s:], big_lse[:, :, s:], out_b, lse_b, impl=impl)
    got_out, got_lse = big_out[:, s:], big_lse[:, :, s:]
    assert torch.isfinite(got_out).all()
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert ((got_lse.double() - want_lse)[fin].abs().max()) < 1e-5
    err = (got_out.double() - want_out).norm() / want_out.norm()
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
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
