"""Loss (perplexity) by position inside windows of a token stream, with context parallelism.

The long-context evaluation's first measurement (evaluate.py; the passkey retrieval is
``passkey.py``; benchmarks/long_context_ppl.py and the training callback call it too):
``--max-sequences`` windows evenly spaced over the stream, each window run through the model
as training runs it (sharded by the CP group's layout, ring attention), per-token losses a
chunk of logits at a time, summed per (window, position bucket) and token-weighted over the
ranks. Every rank returns the same numbers; at P ranks they equal one process's
(tests/model/test_evaluation.py, float64).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx.layouts import check_seq_len
from longctx.sharding import IGNORE_INDEX, shard_batch


def fmt_size(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def ppl(loss: Optional[float]) -> Optional[float]:
    return None if loss is None else math.exp(min(loss, 700.0))


def _finite_or_none(x: float) -> Optional[float]:
    return float(x) if math.isfinite(x) else None


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log(*msg: Any) -> None:
    if is_rank0():
        print(*msg, flush=True)


def window_indices(n_available: int, k: int) -> list[int]:
    """``k`` windows evenly spaced over ``n_available`` (all of them when k >= n)."""
    if n_available <= 0:
        return []
    if k >= n_available:
        return list(range(n_available))
    return [int(i) for i in np.linspace(0, n_available - 1, k).round().astype(np.int64)]


def bucket_edges(seq_len: int, edges: Sequence[int], base_context: Optional[int]) -> list[int]:
    """[0, e1, e2, ..., seq_len]: the given edges below seq_len plus the base context."""
    inner = {e for e in edges if 0 < e < seq_len}
    if base_context is not None and 0 < base_context < seq_len:
        inner.add(base_context)
    return [0, *sorted(inner), seq_len]


# ---- evaluation --------------------------------------------------------------------------


def per_token_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Cross-entropy of every token (0 where the label is ignored), ``chunk_size`` at a time;
    fp32 (float64 for a float64 model)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    out = torch.empty(y.shape, dtype=dtype, device=h.device)
    for s in range(0, y.numel(), chunk_size):
        logits = F.linear(h[s : s + chunk_size], weight).to(dtype)
        out[s : s + chunk_size] = F.cross_entropy(
            logits, y[s : s + chunk_size], ignore_index=IGNORE_INDEX, reduction="none"
        )
    return out.view(labels.shape)


@torch.no_grad()
def evaluate_length(
    model,
    tokens: np.ndarray,
    doc_ids: np.ndarray,
    seq_len: int,
    *,
    max_sequences: int,
    edges: Sequence[int],
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    device: torch.device = torch.device("cpu"),
    autocast_dtype: Optional[torch.dtype] = None,
    loss_chunk: int = 4096,
    batch_tokens: int = 131072,
    max_seconds: Optional[float] = None,
) -> dict:
    """Loss sums and token counts per (window, position bucket), summed over the CP group.

    Returns ``{"windows": [...], "stats": float64 (n_windows, n_buckets, 2), "seconds", ...}``;
    every rank returns the same numbers.
    """
    from longctx.data.packing import PackedSequenceDataset

    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if world > 1:
        check_seq_len(seq_len, world, layout)
    dataset = PackedSequenceDataset(tokens, doc_ids, seq_len)
    windows = window_indices(len(dataset), max_sequences)
    n_b = len(edges) - 1
    inner = torch.tensor(list(edges[1:-1]), dtype=torch.int64, device=device)
    # Flat (window, bucket) accumulators in float64: sums of up to millions of fp32 losses.
    sums = torch.zeros(len(windows) * n_b, dtype=torch.float64, device=device)
    counts = torch.zeros_like(sums)
    weight = model.lm_head_weight
    per_batch = max(1, batch_tokens // seq_len)
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    done = 0
    for start in range(0, len(windows), per_batch):
        rows = windows[start : start + per_batch]
        samples = [dataset[i] for i in rows]
        full = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "labels", "position_ids")}
        local = shard_batch(full, rank=rank, world_size=world, layout=layout)
        ids, labels, pos = (local[k].to(device, non_blocking=True) for k in ("input_ids", "labels", "position_ids"))
        with amp:
            hidden = model.hidden_states(ids, pos)
            losses = per_token_loss(hidden, weight, labels, loss_chunk)
        del hidden
        valid = labels != IGNORE_INDEX
        row = torch.arange(start, start + len(rows), device=device).unsqueeze(1)
        bucket = torch.bucketize(pos, inner, right=True) if inner.numel() else torch.zeros_like(pos)
        key = (row * n_b + bucket)[valid]
        sums.index_add_(0, key, losses[valid].double())
        counts.index_add_(0, key, torch.ones_like(key, dtype=torch.float64))
        done = start + len(rows)
        if max_seconds is not None and done < len(windows):
            # Decided together: a rank that stopped alone would leave the others in the ring.
            over = torch.tensor([float(time.perf_counter() - t0 > max_seconds)], device=device)
            if world > 1:
                dist.all_reduce(over, op=dist.ReduceOp.MAX, group=group)
            if over.item():
                break
    stats = torch.stack([sums[: done * n_b], counts[: done * n_b]], dim=1)
    if world > 1:
        dist.all_reduce(stats, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.tensor(
        [torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
        dtype=torch.float64,
        device=device,
    )
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return {
        "windows": windows[:done],
        "windows_available": len(dataset),
        "stats": stats.view(done, n_b, 2).cpu(),
        "seconds": seconds,
        "peak_mem_gib": float(peak.item()),
    }


def summarise(seq_len: int, edges: Sequence[int], base_context: Optional[int], raw: dict) -> dict:
    """Token-weighted losses and perplexities: overall, per bucket, before/after the base context."""
    stats = raw["stats"]
    sums, counts = stats[..., 0], stats[..., 1]

    def entry(lo: int, hi: int, s: float, n: float) -> dict:
        loss = _finite_or_none(s / n) if n > 0 else None
        return {"lo": lo, "hi": hi, "n_tokens": int(n), "loss": loss, "ppl": ppl(loss)}

    buckets = [
        entry(edges[b], edges[b + 1], float(sums[:, b].sum()), float(counts[:, b].sum())) for b in range(len(edges) - 1)
    ]
    total = entry(0, seq_len, float(sums.sum()), float(counts.sum()))
    out = {
        "seq_len": seq_len,
        "n_windows": len(raw["windows"]),
        "windows_available": raw["windows_available"],
        "window_indices": raw["windows"],
        "n_tokens": total["n_tokens"],
        "loss": total["loss"],
        "ppl": total["ppl"],
        "buckets": buckets,
    }
    if base_context is not None and 0 < base_context < seq_len:
        k = edges.index(base_context)
        out["within_base_context"] = entry(0, base_context, float(sums[:, :k].sum()), float(counts[:, :k].sum()))
        out["beyond_base_context"] = entry(base_context, seq_len, float(sums[:, k:].sum()), float(counts[:, k:].sum()))
    out["per_window"] = {"loss_sum": sums.tolist(), "n_tokens": counts.long().tolist()}
    n_tok = total["n_tokens"]
    out.update(
        seconds=raw["seconds"],
        tokens_per_s=n_tok / raw["seconds"] if raw["seconds"] > 0 else None,
        peak_mem_gib=raw["peak_mem_gib"],
    )
    return out


def evaluate(
    model,
    tokens: np.ndarray,
    doc_ids: np.ndarray,
    seq_lens: Sequence[int],
    *,
    max_sequences: int,
    edges: Sequence[int] = (),
    base_context: Optional[int] = None,
    on_length=None,
    **kwargs,
) -> list[dict]:
    """``evaluate_length`` + ``summarise`` for each length; ``on_length(list_so_far)`` after each."""
    results: list[dict] = []
    device = kwargs.get("device", torch.device("cpu"))
    if device.type == "cuda" and seq_lens:
        # One untimed window first: kernel selection, cuDNN plans and NCCL channels are set up
        # on first use and would otherwise count against the first length.
        e = bucket_edges(seq_lens[0], edges, base_context)
        evaluate_length(model, tokens, doc_ids, seq_lens[0], max_sequences=1, edges=e, **kwargs)
    for seq_len in seq_lens:
        e = bucket_edges(seq_len, edges, base_context)
        raw = evaluate_length(model, tokens, doc_ids, seq_len, max_sequences=max_sequences, edges=e, **kwargs)
        res = summarise(seq_len, e, base_context, raw)
        if res["n_windows"] == 0:
            log(f"warning: the data ({len(tokens):,} tokens) holds no window of {seq_len + 1:,} tokens")
        results.append(res)
        if on_length is not None:
            on_length(results)
    return results


def format_length(r: dict) -> str:
    line = (
        f"  {fmt_size(r['seq_len']):>5} | {r['n_windows']:3d} windows {r['n_tokens'] / 1e6:7.3f}M tok | "
        f"ppl {r['ppl'] or float('nan'):9.3f}"
    )
    if "within_base_context" in r:
        w, b = r["within_base_context"], r["beyond_base_context"]
        line += (
            f" | <{fmt_size(w['hi'])} {w['ppl'] or float('nan'):9.3f}"
            f"  >={fmt_size(b['lo'])} {b['ppl'] or float('nan'):9.3f}"
        )
    line += f" | {r['seconds']:6.1f}s"
    buckets = "  ".join(f"{fmt_size(b['lo'])}-{fmt_size(b['hi'])}:{b['ppl'] or float('nan'):.3f}" for b in r["buckets"])
    return line + "\n          " + buckets


def plot_loss_by_position(results: Sequence[dict], path, title: str = "loss by position") -> None:
    """One line per window length: each position bucket's mean loss at its upper edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in results:
        points = [(b["hi"], b["loss"]) for b in r["buckets"] if b["loss"] is not None]
        if points:
            ax.plot(*zip(*points), "o-", label=f"windows of {fmt_size(r['seq_len'])}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: fmt_size(int(round(x)))))
    ax.set_xlabel("position in the window (bucket upper edge, tokens)")
    ax.set_ylabel("mean loss of the bucket (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
