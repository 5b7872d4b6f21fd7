"""What fits one GPU, on ``longctx.memory``'s per-rank estimate.

``max_seq_len(config, gpu_bytes, plan=..., cp=...)`` is the longest sequence (a multiple
of ``2 x cp``) whose estimate fits. One escalation ladder, ``fitting_plan``: the MLP tiled,
then the fewest attention head chunks, then the fewest blocks offloaded; a run takes it
(``longctx.run_plan``), and ``check_fits`` raises ``PredictedOutOfMemory`` (a ``ValueError``)
with one line naming where the same ladder, from full activation checkpointing, ends (or the
CP size that fits).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from .memory import GiB, MemoryEstimate, as_plan, cpu_process_bytes, estimate, model_shape


def max_seq_len(
    config: Any,
    gpu_bytes: int,
    *,
    plan=None,
    cp: int = 1,
    dp: int = 1,
    data_parallel: str = "fsdp",
    cpu_offload: bool = False,
    batch_size: int = 1,
    precision: str = "bf16-mixed",
    host_bytes: Optional[int] = None,
    multiple: Optional[int] = None,
    limit: int = 1 << 30,
) -> int:
    """Longest sequence (a multiple of ``multiple``, default ``2 x cp``: zigzag) whose
    estimate fits ``gpu_bytes`` per GPU (and ``host_bytes`` per rank, when given); 0 if
    none does."""
    step = multiple or 2 * cp
    kw = dict(
        plan=plan,
        cp=cp,
        dp=dp,
        data_parallel=data_parallel,
        cpu_offload=cpu_offload,
        batch_size=batch_size,
        precision=precision,
    )

    def fits(n: int) -> bool:
        e = estimate(config, n * step, **kw)
        return e.gpu_bytes <= gpu_bytes and (host_bytes is None or e.host_bytes <= host_bytes)

    lo, hi = 0, 1  # fits(lo) (0: nothing), find hi that does not fit
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * step > limit:
            return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * step


# ---- the check before the first step -------------------------------------------------------


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = _meminfo("MemTotal")
        if total is None:
            raise RuntimeError("cannot read the machine's memory size") from None
        return total


def host_available_bytes() -> int:
    """The memory a run starting in this process can have: what the kernel reports available
    (``MemAvailable``: free plus reclaimable) and what this process already holds (its
    resident set, which the memory model's ``cpu_process_bytes()`` counts). Where the kernel
    reports no ``MemAvailable``: the physical memory."""
    available = _meminfo("MemAvailable")
    return host_memory_bytes() if available is None else available + (_status_bytes("VmRSS") or 0)


def _meminfo(key: str) -> Optional[int]:
    return _proc_bytes("/proc/meminfo", key)


def _status_bytes(key: str) -> Optional[int]:
    return _proc_bytes("/proc/self/status", key)


def _proc_bytes(path: str, key: str) -> Optional[int]:
    """A ``KEY: N kB`` entry of a /proc file in bytes, or None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _changes(before, after) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in after.to_dict().items() if getattr(before, k) != v)


def _fix(config, seq_len, kw, plan, gpu_total, host_total) -> str:
    """The cheapest change predicted to make the step fit, named: the one ladder
    (``fitting_plan``) from the plan with full activation checkpointing (the first rung), then
    with a larger CP size."""
    full = dataclasses.replace(plan, activation_checkpointing="full", checkpointed_blocks=None)

    def fitted(**over):
        return fitting_plan(config, seq_len, plan=full, gpu_total=gpu_total, host_total=host_total, **{**kw, **over})

    def predicted(p, **over) -> str:
        e = estimate(config, seq_len, plan=p, **{**kw, **over})
        return f"predicted {e.gpu_bytes / GiB:.1f} GiB" + (
            f" GPU, {e.host_bytes / GiB:.1f} GiB host" if p.offload_activations else ""
        )

    p = fitted()
    if p is not None:
        return f"set ParallelPlan({_changes(plan, p)}) ({predicted(p)})"
    cp = kw["cp"]
    for bigger in (2 * cp, 4 * cp, 8 * cp, 16 * cp, 32 * cp):
        p = fitted(cp=bigger)
        if p is not None:
            settings = _changes(plan, p)
            return (
                f"use a context-parallel size of {bigger}"
                + (f" (with {settings})" if settings else "")
                + f" ({predicted(p, cp=bigger)} per GPU)"
            )
    return "shorten the sequence or use more GPUs"


DEFAULT_MLP_TILE = 8192  # tokens per MLP tile where tiling is switched on for memory


# A lighter checkpointing mode only saves time; running out of memory loses the run: "auto"
# takes one only where its prediction leaves this share of the GPU free.
LIGHTER_MODE_HEADROOM = 0.05


def recomputed_flops_per_token(
    config: Any, seq_len: int, plan, *, tokens_per_rank: int, documents: bool = False
) -> float:
    """Forward FLOPs per token that ``plan``'s memory savings run again in the backward, per
    block summed over blocks: what ``least_recompute`` ranks plans by. Selective recomputes
    the projections and the MLP around the attention, full the attention too, each but the
    block's last matmul (down_proj: a checkpoint's recompute stops once the last tensor it
    needs, that matmul's input, is back). MLP tiles (``mlp_tile_size``, where a tile is
    shorter than ``tokens_per_rank``; otherwise nothing is tiled) recompute in their own
    backward what their gradients need: the norms, gate and up, and o_proj where it is in the
    tiles (a block that checkpoints), not the projections that end a tile (q/k/v, down_proj:
    ``grad_only_linear``). With no checkpointing that is all they add; with selective the tiles
    are the recompute (no checkpoint around them); with full they come on top of the
    checkpoint's, which then runs the whole block. Attention counts ``seq_len / 2`` keys per
    token (causal); with document masking the keys a token sees are unknown before the data,
    and packed documents are short against the sequence: counted as none. With
    ``checkpointed_blocks`` only that many blocks recompute; the rest count as "none". The
    counts are the model's (tests/model/test_tiled_mlp.py checks them against PyTorch's FLOP
    counter)."""
    s = model_shape(config)
    qkv = 2 * s.d * (s.q + 2 * s.kv)
    out = 2 * s.q * s.d
    mlp = 6 * s.d * s.F
    down = 2 * s.F * s.d
    attention = 0.0 if documents else 4 * s.hq * s.hd * seq_len / 2
    mode = plan.activation_checkpointing
    tiled = plan.mlp_tile_size is not None and plan.mlp_tile_size < tokens_per_rank
    plain = mlp - down if tiled else 0.0  # a block that checkpoints nothing
    if mode == "none":
        per_block = plain
    elif mode == "selective":
        per_block = out + mlp - down if tiled else qkv + out + mlp - down
    else:
        per_block = qkv + out + mlp + attention + (out + mlp - down if tiled else -down)
    n = s.L if plan.checkpointed_blocks is None else min(plan.checkpointed_blocks, s.L)
    return n * per_block + (s.L - n) * plain


def least_recompute(
    config: Any, seq_len: int, *, plan=None, gpu_total: int, host_total: Optional[int] = None, **kw
) -> Any:
    """``plan`` with the least recompute (``recomputed_flops_per_token``) predicted to fit with
    ``LIGHTER_MODE_HEADROOM`` to spare, among no checkpointing, selective and full, each
    untiled and, where the plan leaves ``mlp_tile_size`` unset, with the MLP tiled
    (``DEFAULT_MLP_TILE``); selective and full on the fewest blocks that fit
    (``checkpointed_blocks``: the memory a lighter plan leaves spare buys back recompute, block
    by block). Equal costs go to the earlier of that order. Transformers' blocks
    (``kw["hf_modules"]``) have no selective mode and are checkpointed all or none, and are not
    tiled here, nor are FP8 plans (tiles run in bf16). Where nothing fits: full, which
    ``fitting_plan`` escalates from. ``kw``: the rest of ``estimate``'s arguments."""
    plan = as_plan(plan)
    hf = bool(kw.get("hf_modules"))
    modes = ("none",) if hf else ("none", "selective")
    tokens = kw.get("batch_size", 1) * -(-seq_len // kw.get("cp", 1))
    untileable = plan.mlp_tile_size is not None or tokens <= DEFAULT_MLP_TILE or hf or plan.float8
    tiles = (plan.mlp_tile_size,) if untileable else (None, DEFAULT_MLP_TILE)
    documents = kw.get("documents", False)
    n_layer = model_shape(config).L

    def recomputed(p) -> float:
        return recomputed_flops_per_token(config, seq_len, p, tokens_per_rank=tokens, documents=documents)

    def fits(p) -> bool:
        e = estimate(config, seq_len, plan=p, **kw)
        return e.gpu_bytes <= (1 - LIGHTER_MODE_HEADROOM) * gpu_total and (
            host_total is None or e.host_bytes <= host_total
        )

    best, best_cost = None, None
    for mode in modes:
        for tile in tiles:
            candidate = _fewest_checkpointed(
                dataclasses.replace(plan, activation_checkpointing=mode, mlp_tile_size=tile),
                fits,
                n_layer=n_layer,
                hf=hf,
            )
            if candidate is None:
                continue
            cost = recomputed(candidate)
            if best is None or cost < best_cost:
                best, best_cost = candidate, cost
    full = dataclasses.replace(plan, activation_checkpointing="full")
    full_fitted = _fewest_checkpointed(full, fits, n_layer=n_layer, hf=hf)
    if best is not None and (full_fitted is None or best_cost <= recomputed(full_fitted)):
        return best
    return full_fitted or full


def _fewest_checkpointed(plan, fits, *, n_layer: int, hf: bool):
    """``plan`` (a decided mode) on the fewest blocks (``checkpointed_blocks``, the rest keeping
    everything) for which ``fits``, every block where only that fits; None where nothing does.
    Every count is tried: the peak need not fall with each block checkpointed (the recompute's
    transient can outweigh a small model's saved tensors). Transformers' blocks are
    checkpointed all or none."""
    if plan.activation_checkpointing == "none" or hf:
        return plan if fits(plan) else None
    for n in range(1, n_layer):  # none checkpointed is "none", a candidate of its own
        fewer = dataclasses.replace(plan, checkpointed_blocks=n)
        if fits(fewer):
            return fewer
    return plan if fits(plan) else None


def fitting_plan(
    config: Any, seq_len: int, *, plan=None, gpu_total: int, host_total: Optional[int] = None, **kw
) -> Optional[Any]:
    """The cheapest plan predicted to fit: ``plan`` itself, else with the MLP tiled
    (``DEFAULT_MLP_TILE``), else also with the fewest attention head chunks that fit (ring
    attention only), else with the most chunks and the saved inputs of the first n blocks
    offloaded to host memory for the smallest such n. Only settings ``plan`` leaves at
    their defaults (untiled, one chunk, no offload) are changed; None where even every
    block offloaded does not fit. ``kw``: the rest of ``estimate``'s arguments (cp, dp,
    data_parallel, ...)."""
    plan = as_plan(plan)

    def gpu_ok(p):
        return estimate(config, seq_len, plan=p, **kw).gpu_bytes <= gpu_total

    def fits(p):
        e = estimate(config, seq_len, plan=p, **kw)
        return e.gpu_bytes <= gpu_total and (host_total is None or e.host_bytes <= host_total)

    if fits(plan):
        return plan
    tiled = plan if plan.mlp_tile_size is not None else dataclasses.replace(plan, mlp_tile_size=DEFAULT_MLP_TILE)
    if tiled is not plan and fits(tiled):
        return tiled
    if plan.attention_head_chunks == 1 and plan.cp_attention == "ring":
        n_kv = model_shape(config).hkv
        for chunks in (c for c in range(2, n_kv + 1) if n_kv % c == 0):
            tiled = dataclasses.replace(tiled, attention_head_chunks=chunks)
            if fits(tiled):
                return tiled
    if plan.offload_activations is not False or plan.checkpointed_blocks is not None:
        return None  # the user chose how much to offload, or blocks that keep everything
    n_layer = model_shape(config).L
    if not gpu_ok(dataclasses.replace(tiled, offload_activations=n_layer)):
        return None
    # GPU bytes fall as n grows (host bytes rise): the smallest n whose GPU side fits, by
    # bisection, then its host side.
    low, high = 1, n_layer
    while low < high:
        mid = (low + high) // 2
        if gpu_ok(dataclasses.replace(tiled, offload_activations=mid)):
            high = mid
        else:
            low = mid + 1
    chosen = dataclasses.replace(tiled, offload_activations=low)
    return chosen if fits(chosen) else None


class PredictedOutOfMemory(ValueError):
    """A run the memory model predicts not to fit (train.py prints it as one line, exit code 2)."""


def check_fits(
    config: Any,
    seq_len: int,
    *,
    plan=None,
    cp: int = 1,
    dp: int = 1,
    data_parallel: str = "fsdp",
    cpu_offload: bool = False,
    batch_size: int = 1,
    precision: str = "bf16-mixed",
    attention_kernel: str = "auto",
    gpu_total: Optional[int] = None,
    host_total: Optional[int] = None,
    host_ranks: int = 1,
    hf_modules: bool = False,
    device: str = "cuda",
    documents: bool = False,
) -> MemoryEstimate:
    """Estimate, then raise ``PredictedOutOfMemory`` (a ValueError: one line, naming what to change) when the
    prediction exceeds ``gpu_total`` bytes per GPU or ``host_total`` bytes of host memory
    shared by ``host_ranks`` ranks. A total of None is not checked (e.g. no GPU). A CPU run
    (``device="cpu"``) that does not fit is named as sized for GPUs, with the shorter sequence
    and the larger CP size predicted to fit this host (``_cpu_fix``)."""
    plan = as_plan(plan)
    kw = dict(
        cp=cp,
        dp=dp,
        data_parallel=data_parallel,
        cpu_offload=cpu_offload,
        batch_size=batch_size,
        precision=precision,
        attention_kernel=attention_kernel,
        hf_modules=hf_modules,
        device=device,
        documents=documents,
    )
    est = estimate(config, seq_len, plan=plan, **kw)
    host_ranks = max(host_ranks, 1)
    per_rank_host = None if host_total is None else host_total // host_ranks
    too_big = []
    if gpu_total is not None and est.gpu_bytes > gpu_total:
        too_big.append(f"GPU {est.gpu_bytes / GiB:.1f} GiB > {gpu_total / GiB:.1f} GiB")
    if per_rank_host is not None and est.host_bytes > per_rank_host:
        too_big.append(
            f"host {est.host_bytes / GiB:.1f} GiB > {per_rank_host / GiB:.1f} GiB per rank "
            f"({host_total / GiB:.1f} GiB available here over {host_ranks} rank{'s' if host_ranks > 1 else ''})"
        )
    if too_big:
        if device == "cpu":
            fix = _cpu_fix(config, seq_len, kw, plan, host_total, host_ranks)
        else:
            fix = _fix(config, seq_len, kw, plan, gpu_total if gpu_total is not None else float("inf"), per_rank_host)
        raise PredictedOutOfMemory(
            f"predicted not to fit: {seq_len:,} tokens at cp={cp} need {' and '.join(too_big)} "
            f"(peak at {est.phase}); {fix}, or pass memory_check=False (train.py --model.memory_check false) "
            "to try anyway"
        )
    return est


def _cpu_fix(config, seq_len: int, kw: dict, plan, host_total: int, host_ranks: int) -> str:
    """What makes a CPU run fit this host's ``host_total`` bytes shared by ``host_ranks`` ranks:
    the longest of ``seq_len`` / 2, / 4, ... predicted to fit at this CP size, and the smallest
    CP size up to 8x this one (as many more processes on this host) that fits the whole sequence."""

    def per_rank(n: int, cp: int) -> Optional[int]:
        """Predicted host bytes per rank where ``n`` tokens over ``cp`` ranks fit, else None."""
        ranks = host_ranks * cp // kw["cp"]
        if n % (2 * cp) or n < 2 * cp:
            return None
        host = estimate(config, n, plan=plan, **{**kw, "cp": cp}).host_bytes
        return host if host <= host_total // ranks else None

    ways = []
    shorter = seq_len // 2
    while shorter >= 2 * kw["cp"] and per_rank(shorter, kw["cp"]) is None:
        shorter //= 2
    fits = per_rank(shorter, kw["cp"]) if shorter >= 2 * kw["cp"] else None
    if fits is not None:
        ways.append(f"seq_len {shorter:,} (train.py --seq-len {shorter}: {fits / GiB:.1f} GiB per rank predicted)")
    for cp in (2 * kw["cp"], 4 * kw["cp"], 8 * kw["cp"]):
        fits = per_rank(seq_len, cp)
        if fits is not None:
            ways.append(
                f"a context-parallel size of {cp} (train.py --context-parallel {cp}: {fits / GiB:.1f} GiB per "
                "rank predicted)"
            )
            break
    if not ways:  # nothing of this model fits here at this many ranks
        per_rank_budget = host_total // host_ranks
        process = cpu_process_bytes()
        alone = process > per_rank_budget
        ways.append(
            f"fewer ranks (each process takes {process / GiB:.2f} GiB before any tensor)"
            if alone
            else "a smaller model (nothing shorter fits this one here)"
        )
    return f"a run this size is for GPUs (--accelerator gpu); on this CPU use {' or '.join(ways)}"
