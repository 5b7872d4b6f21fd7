"""Document segments of a block, built once by the caller: what FlashAttention-4 takes.

A ``Segments`` value describes a document-masked block as varlen segments over the
flattened ``(B * S)`` rows of q and k: segment i is q rows ``[cu_seqlens_q[i],
cu_seqlens_q[i+1])`` attending k rows ``[cu_seqlens_k[i], cu_seqlens_k[i+1])``, every query
row of the block in exactly one segment and every key row too ("tight": no row outside).
``causal`` segments have equal q and k rows (a diagonal block); full segments see all of
their keys. The caller (``longctx.documents``) builds them on the host once per step and
moves them to the device in one copy, so a kernel call reads no ids back to the host.

The same block's ``q_document_ids`` / ``k_document_ids`` (each row's segment number) still
go along: the kernels that take a per-token mask (Triton, the reference) use those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    cu_seqlens_q: torch.Tensor  # int32 (n + 1,), on the inputs' device
    cu_seqlens_k: torch.Tensor  # int32 (n + 1,)
    max_seqlen_q: int
    max_seqlen_k: int

    def check(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
        """Raise ValueError where these segments cannot describe a (q, k) block."""
        for name, cu, t in (("cu_seqlens_q", self.cu_seqlens_q, q), ("cu_seqlens_k", self.cu_seqlens_k, k)):
            if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
                raise ValueError(f"segments.{name} must be a 1-D int32 tensor")
            if cu.device != t.device:
                raise ValueError(f"segments.{name} is on {cu.device}, the block on {t.device}")
        if self.cu_seqlens_q.shape != self.cu_seqlens_k.shape or self.cu_seqlens_q.numel() < 2:
            raise ValueError("segments need cu_seqlens_q and cu_seqlens_k of one length (>= 2)")
        if causal and q.shape[1] != k.shape[1]:
            raise ValueError("causal segments need aligned blocks (equal q and k rows)")

    def kernel_args(self) -> dict:
        return dict(
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=max(self.max_seqlen_q, 1),
            max_seqlen_k=max(self.max_seqlen_k, 1),
        )
