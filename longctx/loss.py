"""Token-weighted loss normalisation over the whole ``dp x cp`` world.

Every rank computes a *summed* token loss over its shard and the number of tokens that
count (labels != -100). The training objective is the mean over all tokens of the global
batch, so the per-rank loss cannot be a local mean: shards hold different numbers of
counted tokens (document boundaries, padding) and a CP rank holds only part of a sequence.

DDP averages gradients over the ``W`` ranks of its group, so a rank backpropagates

    loss_sum_local * W / n_global

and the averaged gradient is ``grad(sum of all token losses) / n_global`` -- exactly the
single-device gradient of the global token mean. Forgetting ``W`` scales gradients by
``1/W``; a per-rank mean weights tokens unequally. Both are measurably wrong (tests).

Gradient accumulation (``K`` micro-batches per optimizer step) needs the token count of the
whole accumulated batch, which is unknown while the first micro-batches are backpropagated.
``TokenWeightedAccumulator`` therefore normalises each micro-batch by a *reference* count
(the global count of the window's first micro-batch, so values stay O(1)) and, once all
``K`` are in, rescales the summed gradients by ``n_reference / n_total``. The result is the
exact gradient of the token mean over all ``K`` micro-batches; with ``K = 1`` the rescale
factor is exactly 1 and is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass
class GlobalLoss:
    """Result of normalising one (micro-)batch."""

    loss: torch.Tensor  # what to backpropagate (carries the graph)
    mean: torch.Tensor  # global token-mean loss, detached fp32 scalar (for logging)
    loss_sum: torch.Tensor  # global summed token loss, detached float64 scalar
    n_tokens: torch.Tensor  # global number of counted tokens, float64 scalar


def _world(group: Optional[dist.ProcessGroup]) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_reduce_sum_and_count(
    loss_sum: torch.Tensor, n_tokens: torch.Tensor | int, group: Optional[dist.ProcessGroup] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (loss_sum, n_tokens) as float64 scalars, in ONE all-reduce.

    float64 keeps token counts exact far beyond fp32's 2**24 (a 64-GPU x 1M-token batch).
    """
    if loss_sum.dim() != 0:
        raise ValueError(f"loss_sum must be a scalar, got shape {tuple(loss_sum.shape)}")
    n = torch.as_tensor(n_tokens, device=loss_sum.device)
    if n.dim() != 0:
        raise ValueError(f"n_tokens must be a scalar, got shape {tuple(n.shape)}")
    packed = torch.stack([loss_sum.detach().to(torch.float64), n.to(torch.float64)])
    if _world(group) > 1:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return packed[0], packed[1]


def global_token_loss(
    loss_sum: torch.Tensor,
    n_tokens: torch.Tensor | int,
    *,
    group: Optional[dist.ProcessGroup] = None,
    n_reference: Optional[torch.Tensor] = None,
) -> GlobalLoss:
    """Normalise a rank's summed token loss by the global token count.

    Args:
        loss_sum: this rank's summed token loss, fp32 scalar with grad.
        n_tokens: this rank's number of counted tokens (int or scalar tensor).
        group: the group DDP averages over; ``None`` = the whole world. Without an
            initialised process group this is plain ``loss_sum / n_tokens``.
        n_reference: divide by this global count instead of this batch's (used by
            ``TokenWeightedAccumulator``); the world factor is applied either way.

    Returns ``GlobalLoss``: ``loss = loss_sum * W / n`` for backward, and the true global
    mean for logging. A batch with no counted tokens gives loss 0 (no gradient), not NaN.
    """
    total, count = all_reduce_sum_and_count(loss_sum, n_tokens, group)
    denom = (count if n_reference is None else n_reference).clamp(min=1.0)
    world = _world(group)
    loss = loss_sum * (world / denom).to(loss_sum.dtype)
    mean = (total / count.clamp(min=1.0)).to(torch.float32)
    return GlobalLoss(loss=loss, mean=mean, loss_sum=total, n_tokens=count)


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """The loss tensor to return from ``training_step``: exact global token-mean training.

    ``logits`` ``(..., vocab)`` and ``labels`` ``(...)`` (already shifted; ``-100`` ignored)
    are this rank's shard. Cross-entropy is summed in fp32 and normalised by the token count
    of the whole ``group`` (default: the world, over which DDP/FSDP average gradients), so
    the averaged gradient is the single-device gradient of the global batch's token mean
    (``global_token_loss``). Averaged over ranks (``self.log(..., sync_dist=True)``) the
    returned values give that global mean. Without a process group it is the plain mean.
    With ``accumulate_grad_batches > 1`` each micro-batch is weighted equally; exact
    weighting across micro-batches is ``TokenWeightedAccumulator`` (``CausalLMModule``).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match labels {tuple(labels.shape)}: "
            "expected logits (..., vocab) for labels (...)"
        )
    loss_sum = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return global_token_loss(loss_sum, (labels != IGNORE_INDEX).sum(), group=group).loss


class TokenWeightedAccumulator:
    """Exact token weighting across the micro-batches of one optimizer step.

    Usage in a LightningModule (automatic optimisation, ``accumulate_grad_batches=K``)::

        # training_step
        out = self.acc.add(loss_sum, n_tokens, accumulate=self.trainer.accumulate_grad_batches)
        return out.loss          # Lightning divides it by K; add() pre-multiplied by K
        # on_before_optimizer_step (runs after all K backwards, before clipping)
        mean, n = self.acc.finish(self.parameters())

    Lightning calls the optimizer step on the last batch of an epoch even if fewer than K
    micro-batches arrived; the rescale uses the tokens actually seen, so that stays exact.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.reset()

    def reset(self) -> None:
        self.n_reference: Optional[torch.Tensor] = None
        self.loss_sum: Optional[torch.Tensor] = None
        self.n_total: Optional[torch.Tensor] = None
        self.micro_batches = 0

    def add(self, loss_sum: torch.Tensor, n_tokens: torch.Tensor | int, *, accumulate: int = 1) -> GlobalLoss:
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}")
        out = global_token_loss(loss_sum, n_tokens, group=self.group, n_reference=self.n_reference)
        if self.n_reference is None:
            self.n_reference = out.n_tokens.clamp(min=1.0)
            self.loss_sum, self.n_total = out.loss_sum, out.n_tokens
        else:
            self.loss_sum = self.loss_sum + out.loss_sum
            self.n_total = self.n_total + out.n_tokens
        self.micro_batches += 1
        if accumulate != 1:
            out.loss = out.loss * accumulate  # cancels Lightning's division by K
        return out

    @torch.no_grad()
    def finish(self, parameters: Iterable[torch.nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rescale accumulated gradients to the exact global token mean; return (mean, n_total).

        Call after all backwards of the step (gradients already averaged by DDP).
        """
        if self.n_reference is None:
            raise RuntimeError("finish() called before any add() in this optimizer step")
        n_total = self.n_total.clamp(min=1.0)
        if self.micro_batches > 1:
            scale = (self.n_reference / n_total).item()
            if scale != 1.0:
                grads = [p.grad for p in parameters if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, scale)
        mean = (self.loss_sum / n_total).to(torch.float32)
        n = self.n_total
        self.reset()
        return mean, n
