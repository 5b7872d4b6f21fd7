"""Global token-weighted loss normalisation (longctx.loss).

The reference is the float64 gradient of the token-mean loss over the whole global batch on
one device. Ranks hold different numbers of counted tokens (random -100 masks), which is
what makes a per-rank mean wrong; DDP's averaging is emulated by all-reduce(sum) / W.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers.dist_harness import run_distributed

from longctx.loss import TokenWeightedAccumulator, all_reduce_sum_and_count, causal_lm_loss, global_token_loss

VOCAB, DIM, SEQ, WORLD, MICRO = 11, 8, 16, 4, 3


def _data(seed: int, n_seq: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_seq, SEQ, DIM, generator=g)
    labels = torch.randint(0, VOCAB, (n_seq, SEQ), generator=g)
    # Uneven masks: sequence i drops a different share of its tokens.
    keep = torch.rand(n_seq, SEQ, generator=g) < torch.linspace(0.15, 0.95, n_seq)[:, None]
    labels[~keep] = -100
    return x, labels


def _weight(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(DIM, VOCAB, generator=torch.Generator().manual_seed(0)).to(dtype)


def _loss_sum(w: torch.Tensor, x: torch.Tensor, labels: torch.Tensor):
    logits = (x.to(w.dtype) @ w).reshape(-1, VOCAB)
    loss_sum = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    return loss_sum, (labels != -100).sum()


def _reference_grad(x, labels) -> torch.Tensor:
    w = _weight(torch.float64).requires_grad_()
    s, n = _loss_sum(w, x, labels)
    (s / n).backward()
    return w.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _ddp_grad(method: str, x, labels) -> torch.Tensor:
    """This rank's shard -> backward -> gradient averaged over ranks (what DDP does)."""
    w = _weight().requires_grad_()
    s, n = _loss_sum(w, x, labels)
    if method == "exact":
        loss = global_token_loss(s, n).loss
    elif method == "causal_lm_loss":  # the one-call helper, from plain logits
        loss = causal_lm_loss(x.to(w.dtype) @ w, labels)
    elif method == "per_rank_mean":
        loss = s / n
    elif method == "no_world_factor":
        _, n_global = all_reduce_sum_and_count(s, n)
        loss = s / n_global.float()
    loss.backward()
    g = w.grad.clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


def _check_ranks(rank: int, world: int):
    # Global batch of 2*world sequences; rank r holds sequences 2r, 2r+1. Their counted
    # tokens differ per rank, so only the global count gives equal token weights.
    x, labels = _data(1, 2 * world)
    ref = _reference_grad(x, labels)
    mine = slice(2 * rank, 2 * rank + 2)
    out = {
        m: _rel(_ddp_grad(m, x[mine], labels[mine]), ref)
        for m in ("exact", "causal_lm_loss", "per_rank_mean", "no_world_factor")
    }

    # Logged value: the true global mean, identical on every rank.
    w = _weight(torch.float64)
    s, n = _loss_sum(w, x[mine], labels[mine])
    res = global_token_loss(s.float(), n)
    s_all, n_all = _loss_sum(w, x, labels)
    out["mean_err"] = abs(res.mean.item() - (s_all / n_all).item()) / (s_all / n_all).item()
    out["n_tokens"] = res.n_tokens.item() == n_all.item()

    # Gradient accumulation: MICRO micro-batches per step with very different token counts,
    # Lightning divides each loss by K; finish() rescales once at the end.
    xs, ls = _data(2, MICRO * 2 * world)
    ref_acc = _reference_grad(xs, ls)
    w = _weight().requires_grad_()
    acc = TokenWeightedAccumulator()
    for m in range(MICRO):
        base = m * 2 * world + 2 * rank
        s, n = _loss_sum(w, xs[base : base + 2], ls[base : base + 2])
        (acc.add(s, n, accumulate=MICRO).loss / MICRO).backward()
    dist.all_reduce(w.grad)
    w.grad /= world  # DDP's averaging, before on_before_optimizer_step
    mean, n_total = acc.finish([w])
    out["acc_exact"] = _rel(w.grad, ref_acc)
    s_all, n_all = _loss_sum(_weight(torch.float64), xs, ls)
    out["acc_mean_err"] = abs(mean.item() - (s_all / n_all).item()) / (s_all / n_all).item()
    out["acc_n"] = n_total.item() == n_all.item()
    # Without the rescale (each micro-batch normalised by its own count) it is wrong:
    w2 = _weight().requires_grad_()
    for m in range(MICRO):
        base = m * 2 * world + 2 * rank
        s, n = _loss_sum(w2, xs[base : base + 2], ls[base : base + 2])
        global_token_loss(s, n).loss.div(MICRO).backward()
    dist.all_reduce(w2.grad)
    out["acc_naive"] = _rel(w2.grad / world, ref_acc)
    return out


def test_global_normalisation_matches_single_device():
    results = run_distributed(_check_ranks, WORLD)
    for r, out in enumerate(results):
        assert out["exact"] < 1e-5 and out["causal_lm_loss"] < 1e-5, (r, out)
        # The two classic mistakes are far off, not rounding-close.
        assert out["per_rank_mean"] > 1e-2, (r, out)
        assert out["no_world_factor"] > 0.5, (r, out)  # gradient scaled by 1/W
        assert out["mean_err"] < 1e-6 and out["n_tokens"], (r, out)
        assert out["acc_exact"] < 1e-5, (r, out)
        assert out["acc_mean_err"] < 1e-6 and out["acc_n"], (r, out)
        assert out["acc_naive"] > 1e-2, (r, out)


def test_no_process_group_is_local_mean():
    x, labels = _data(3, 3)
    w = _weight().requires_grad_()
    s, n = _loss_sum(w, x, labels)
    res = global_token_loss(s, n)
    torch.testing.assert_close(res.loss, s / n)
    torch.testing.assert_close(res.mean, (s / n).detach())
    res.loss.backward()
    assert _rel(w.grad, _reference_grad(x, labels)) < 1e-5
    # All tokens ignored: zero loss and zero gradient, never NaN.
    empty = global_token_loss(torch.zeros((), requires_grad=True), 0)
    assert empty.loss.item() == 0.0 and empty.mean.item() == 0.0


def test_bad_input():
    import pytest

    with pytest.raises(ValueError, match="scalar"):
        global_token_loss(torch.zeros(3), 1)
    with pytest.raises(ValueError, match="accumulate"):
        TokenWeightedAccumulator().add(torch.zeros(()), 1, accumulate=0)
    with pytest.raises(RuntimeError, match="before any add"):
        TokenWeightedAccumulator().finish([])


def test_causal_lm_loss_without_process_group():
    import pytest

    x, labels = _data(4, 3)
    w = _weight().requires_grad_()
    logits = x @ w
    loss = causal_lm_loss(logits, labels)
    s, n = _loss_sum(w.detach().double(), x, labels)
    assert abs(loss.item() - (s / n).item()) < 1e-6 * (s / n).item()
    loss.backward()
    assert _rel(w.grad, _reference_grad(x, labels)) < 1e-5
    # bf16 logits: the sum runs in fp32, so the result is within bf16 rounding of the logits.
    assert abs(causal_lm_loss(logits.detach().bfloat16(), labels).item() - (s / n).item()) < 1e-2 * (s / n).item()
    bad = logits.detach().clone()
    bad[0, 0, 0] = float("nan")
    labels_kept = labels.clone()
    labels_kept[0, 0] = 1
    assert causal_lm_loss(bad, labels_kept).isnan()  # NaN in, NaN out
    with pytest.raises(ValueError, match="does not match labels"):
        causal_lm_loss(logits, labels[:, 1:])
