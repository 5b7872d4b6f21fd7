"""What a test needs of the machine, as marks that both skip and select (after litgpt's RunIf):

    @requires_cuda()               # marked gpu, skipped without CUDA
    @requires_cuda(min_gpus=2)     # also marked multigpu, skipped below 2 GPUs
    @requires_cuda(fa4=True)       # skipped where FlashAttention-4 cannot run
    pytestmark = requires_cuda()   # a whole module

so ``pytest -m gpu`` (``-m multigpu``) selects exactly the tests that need a GPU (several).
Under pytest-xdist (``-n N --dist loadgroup``) the GPU tests of one file share a group (one
worker runs them in turn, so a file's kernel compiles are not repeated on several workers) and
the multi-GPU tests share one, so two NCCL jobs never hold the same GPUs at once.
"""

from __future__ import annotations

import sys

import pytest
import torch


class Marks(list):
    """Marks that apply together: a ``pytestmark`` value, a ``pytest.param(marks=...)`` or a decorator."""

    def __call__(self, test):
        for mark in self:
            test = mark(test)
        return test


def requires_cuda(min_gpus: int = 1, *, fa4: bool = False) -> Marks:
    group = "multigpu" if min_gpus > 1 else "gpu:" + sys._getframe(1).f_globals.get("__name__", "")
    marks = Marks([pytest.mark.gpu, pytest.mark.xdist_group(group)])
    if min_gpus > 1:
        marks.append(pytest.mark.multigpu)
    count = torch.cuda.device_count()
    if count < min_gpus:
        reason = "needs CUDA" if min_gpus == 1 else f"needs {min_gpus} GPUs (NCCL)"
        marks.append(pytest.mark.skipif(True, reason=f"{reason}; {count} visible"))
    elif fa4:
        from longctx.kernels import fa4 as fa4_backend

        if not fa4_backend.is_available("cuda"):
            reason = "needs FlashAttention-4 (pip install 'longctx[fa4]') on an sm90/sm100 GPU"
            marks.append(pytest.mark.skipif(True, reason=reason))
    return marks
