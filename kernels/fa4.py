"""FlashAttention-4 block kernels (backend ``"fa4"``): pip ``flash-attn-4``, CuTe DSL, sm90/sm100.

Optional: ``pip install 'longctx[fa4]'``. Absent or on another GPU, ``backend="auto"`` never
picks it and ``backend="fa4"`` raises one line saying why (``unavailable_reason``).

Dense blocks (causal or full, GQA native: K/V are never expanded) go through FA4's forward
with ``return_lse=True`` and its backward with the ring's final ``out``/``lse``, which is all
a ring merge needs. The kernels write the input dtype only (like the other vendor kernels):
fp32 partials are a cast, and the backward recomputes delta = rowsum(dO * O) itself.

Document-masked blocks run as varlen. From a caller's prebuilt ``kernels.Segments``
(``longctx.documents``: built once per step for every layer) ``forward_segments`` /
``backward_segments`` touch nothing on the host. From ids alone: each batch row's query and key
ids are cut into runs of equal ids on the host (one device->host copy of the ids per call), and every document present
in both becomes one varlen segment (``cu_seqlens`` = where its runs start, ``seqused`` = their
lengths). A diagonal (causal) block with equal query/key ids is a causal varlen call over all
runs; an off-diagonal (full) block is a non-causal call over the documents the two sides
share. Rows of documents the other side lacks get out = 0, lse = -inf, zero gradients
(pre-filled buffers: FA4 leaves rows outside every segment untouched). Ids whose runs cannot
be expressed as segments (a document in two separate runs, or shared documents in another
order on the two sides) return None from ``plan_documents``; the caller then uses the Triton
document kernels for that block.

Compilation: FA4 compiles each kernel variant on its first call (seconds). The on-disk cache
(``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED``, dir ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``) is
switched on by default here, under ``~/.cache/longctx/fa4``, so later processes load them;
``compile_seconds`` records the first call of every variant in this process (also logged).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .rows import mark_nonfinite_rows_

log = logging.getLogger(__name__)

# Read by flash_attn.cute when it is imported: set before the (lazy) import below.
os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
os.environ.setdefault(
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "longctx", "fa4")
)

SUPPORTED_ARCH = (9, 10)  # compute capability majors: sm90 (H100/H200), sm100 (B200)
INSTALL_HINT = "pip install 'longctx[fa4]'"
# First-call wall time (compile + run) per kernel variant in this process, seconds.
compile_seconds: dict = {}


# FA4's single-tile varlen scheduler builds a batch-lookup aid for calls of more than
# ``interface.BIN_BATCH_SEARCH_THRESH`` segments (256 as shipped, "tunable" upstream). A rank of
# a CP = 2 group over 256-token documents holds exactly 256; there the aid was faster and it
# was slower at 64-128 segments (benchmarks/results/fa4_varlen_scheduler_*.json): from 256 on.
VARLEN_LOOKUP_FROM_SEGMENTS = 256
_SHIPPED_LOOKUP_THRESHOLD = 256


@functools.lru_cache(maxsize=1)
def _interface():
    """flash_attn.cute.interface, or the ImportError's text."""
    try:
        from flash_attn.cute import interface
    except Exception as error:  # noqa: BLE001 - a broken install is "not available" too
        return f"{type(error).__name__}: {error}"
    # Only over the shipped value: a user's own setting stays.
    if getattr(interface, "BIN_BATCH_SEARCH_THRESH", None) == _SHIPPED_LOOKUP_THRESHOLD:
        interface.BIN_BATCH_SEARCH_THRESH = VARLEN_LOOKUP_FROM_SEGMENTS - 1
    return interface


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple:
    """A GPU's compute capability (asked once: the layers ask on every call)."""
    return torch.cuda.get_device_capability(device)


def unavailable_reason(device) -> Optional[str]:
    """None where FA4 can run on ``device``; else why not, in one sentence."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"FlashAttention-4 runs on CUDA GPUs only, not on {device}"
    major, minor = _capability(device)
    if major not in SUPPORTED_ARCH:
        return (
            f"FlashAttention-4 needs an sm90 or sm100 GPU (H100/H200/B200); "
            f"{torch.cuda.get_device_name(device)} is sm{major}{minor}"
        )
    iface = _interface()
    if isinstance(iface, str):
        return f"FlashAttention-4 is not installed or does not import ({iface}): {INSTALL_HINT}"
    return None


def is_available(device) -> bool:
    return unavailable_reason(device) is None


def unsupported_shape(device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """None where FA4 takes blocks of this dtype and head dim on ``device``; else why not."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-4 takes float16/bfloat16 inputs, not {dtype}"
    device = torch.device(device)
    major = _capability(device)[0] if device.type == "cuda" else 9
    ok = 8 <= head_dim <= 256 if major == 9 else (8 <= head_dim <= 128 or head_dim == 256)
    if not ok or head_dim % 8:
        limits = "8..256" if major == 9 else "8..128 or 256"
        return f"FlashAttention-4 on sm{major}0 takes head dims {limits} in multiples of 8, not {head_dim}"
    return None


def cache_dir() -> Optional[str]:
    """Where compiled kernels persist across processes (None: the cache is switched off)."""
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") != "1":
        return None
    return os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")


def _timed_first_call(key, fn):
    if key in compile_seconds:
        result = fn()
    else:
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        compile_seconds[key] = time.perf_counter() - start
        log.info("FlashAttention-4 %s: first call (compile or cache load) %.1f s", key, compile_seconds[key])
    if _watch is not None:
        _check_late_compile(key)
    return result


@dataclass
class _Watch:
    """What the last ``warm_up`` left. FA4's own compile caches hold its kernel variants: more
    than ``_variant`` names (a varlen call over ``VARLEN_LOOKUP_FROM_SEGMENTS`` segments or
    more takes another scheduler). A key added to them later is a compile in the middle of a
    run: logged once, naming the variant, and counted in ``late_compiles``."""

    keys: set  # FA4's compile keys after the warm-up (and any late ones since)
    caches: list  # the caches' dicts, found once
    variants: set  # the ``compile_seconds`` keys first called by then (the step-1 report's)


_watch: Optional[_Watch] = None
late_compiles: list = []
_JIT_FUNCTIONS = (
    "_flash_attn_fwd",
    "_flash_attn_bwd",
    "_bwd_preprocess",
    "_bwd_postprocess_convert",
    "_compute_tile_cumsum",
    "_compute_blocks_to_batch",
)


def _jit_caches() -> list:
    """(name, dict of compile key -> kernel) of FA4's compile caches (internal: tolerant)."""
    iface = _interface()
    caches = []
    for name in _JIT_FUNCTIONS:
        cache = getattr(getattr(getattr(iface, name, None), "compile_cache", None), "cache", None)
        if isinstance(cache, dict):
            caches.append((name, cache))
    return caches


def _jit_keys() -> set:
    return {(name, key) for name, cache in _jit_caches() for key in cache}


def _check_late_compile(variant) -> None:
    if sum(len(cache) for cache in _watch.caches) == len(_watch.keys):
        return
    new = _jit_keys() - _watch.keys
    _watch.keys |= new
    for name, key in sorted(new, key=str):
        late_compiles.append((variant, name, key))
        log.warning(
            "FlashAttention-4 compiled a kernel variant after the warm-up (%s, %s: %s): "
            "longctx's kernels/fa4.warm_up should cover it",
            variant,
            name,
            key,
        )


def _variant(kind, q, k, causal, varlen, one_tile=False):
    return (
        kind,
        str(q.dtype).replace("torch.", ""),
        q.shape[-1],
        q.shape[2] // k.shape[2],
        "causal" if causal else "full",
        ("varlen-one-tile" if one_tile else "varlen") if varlen else "dense",
    )


def forward(q, k, v, causal, softmax_scale, out_dtype=None, q_doc=None, k_doc=None):
    """(out (B, Sq, Hq, D), lse fp32 (B, Hq, Sq)); None if document ids are not varlen-able."""
    iface = _interface()
    if q_doc is not None:
        plan = plan_documents(q_doc, k_doc, causal)
        if plan is None:
            return None
        if plan.empty:
            return _nothing_visible(q, v, out_dtype)
        return _forward_varlen(
            iface, q, k, v, softmax_scale, out_dtype, plan.causal, _device_plan(plan, q.device), plan.q_covered
        )
    with torch.cuda.device(q.device):
        out, lse = _timed_first_call(
            _variant("fwd", q, k, causal, False),
            lambda: iface._flash_attn_fwd(
                q, k, v, softmax_scale=float(softmax_scale), causal=bool(causal), return_lse=True
            )[:2],
        )
    out, lse = _keep_nan(out, lse, None)
    if out_dtype is not None and out_dtype != out.dtype:
        out = out.to(out_dtype)
    return out, lse


def forward_segments(q, k, v, causal, softmax_scale, out_dtype, segments):
    """``forward`` of a document block whose varlen segments the caller built (tight:
    every row in a segment): no host work, no sync."""
    return _forward_varlen(_interface(), q, k, v, softmax_scale, out_dtype, causal, segments.kernel_args())


def _keep_nan(out, lse, covered):
    """NaN in q/k makes a row's scores NaN, and the kernel's max (fmax) can drop them and
    report the row as one that sees no key (lse -inf). Every dense row and every row of a
    varlen segment sees at least one key, so a non-finite lse there means NaN came in: mark
    the row NaN in out and lse, as plain attention would, so that the ring's merge (which
    treats lse -inf as "no contribution") cannot hide it. In place: both were just written
    by the kernel."""
    mark_nonfinite_rows_(out, lse, covered)
    return out, lse


def backward(dout, q, k, v, out, lse, causal, softmax_scale, delta=None, grad_dtype=None, q_doc=None, k_doc=None):
    """(dq, dk, dv) from the final out/lse; ``delta`` is ignored (FA4 computes it from out).
    None if document ids are not varlen-able."""
    iface = _interface()
    out, dout, lse = _backward_inputs(q, out, dout, lse)
    if q_doc is not None:
        plan = plan_documents(q_doc, k_doc, causal)
        if plan is None:
            return None
        if plan.empty:
            grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        else:
            grads = _backward_varlen(
                iface,
                dout,
                q,
                k,
                v,
                out,
                lse,
                softmax_scale,
                plan.causal,
                _device_plan(plan, q.device),
                plan.q_covered is not None,
                plan.k_covered is not None,
            )
    else:
        with torch.cuda.device(q.device):
            grads = _timed_first_call(
                _variant("bwd", q, k, causal, False),
                lambda: iface._flash_attn_bwd(q, k, v, out, dout, lse, float(softmax_scale), bool(causal))[:3],
            )
    grad_dtype = grad_dtype or q.dtype
    return tuple(g.to(grad_dtype) for g in grads)


def backward_segments(dout, q, k, v, out, lse, causal, softmax_scale, grad_dtype, segments):
    """``backward`` of a document block with caller-built (tight) segments."""
    out, dout, lse = _backward_inputs(q, out, dout, lse)
    grads = _backward_varlen(
        _interface(), dout, q, k, v, out, lse, softmax_scale, causal, segments.kernel_args(), False, False
    )
    grad_dtype = grad_dtype or q.dtype
    return tuple(g if g.dtype == grad_dtype else g.to(grad_dtype) for g in grads)


def _backward_inputs(q, out, dout, lse):
    if out is None:
        raise ValueError("the 'fa4' backend needs `out` in backward (it computes delta itself)")
    out, dout = (t if t.dtype == q.dtype else t.to(q.dtype) for t in (out, dout))
    return out, dout, lse if lse.dtype == torch.float32 and lse.is_contiguous() else lse.float().contiguous()


# ---------------------------------------------------------------- documents as varlen runs


@dataclass
class VarlenPlan:
    """Varlen segments of one block over the flattened (B*S) rows of q and k.

    ``seqused_*`` is None where the segments tile their side exactly (then ``cu_seqlens``
    alone describes them); ``*_covered`` is None where every row is in a segment.
    ``cu_seqlens_*`` is None where the two sides share no document (``empty``).
    """

    causal: bool
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    seqused_q: Optional[np.ndarray]
    seqused_k: Optional[np.ndarray]
    max_seqlen_q: int
    max_seqlen_k: int
    q_covered: Optional[np.ndarray]
    k_covered: Optional[np.ndarray]

    @property
    def empty(self) -> bool:
        return self.cu_seqlens_q is None

    @property
    def segments(self):
        """(q_start, q_len, k_start, k_len) of every segment (for tests and emulation)."""
        if self.empty:
            return []
        n = len(self.cu_seqlens_q) - 1
        q_len = self.seqused_q if self.seqused_q is not None else np.diff(self.cu_seqlens_q)
        k_len = self.seqused_k if self.seqused_k is not None else np.diff(self.cu_seqlens_k)
        return [(int(self.cu_seqlens_q[i]), int(q_len[i]), int(self.cu_seqlens_k[i]), int(k_len[i])) for i in range(n)]


def _runs(ids: np.ndarray):
    """(starts, ends, values) of the runs of equal ids in one row."""
    cut = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(ids)]))
    return starts, ends, ids[starts]


def _cover(starts: np.ndarray, lengths: np.ndarray, n: int) -> np.ndarray:
    """Boolean mask of the n rows inside any of the (disjoint) ranges [start, start + length)."""
    edges = np.zeros(n + 1, dtype=np.int64)
    np.add.at(edges, starts, 1)
    np.add.at(edges, starts + lengths, -1)
    return np.cumsum(edges[:-1]) > 0


def plan_documents(q_doc: torch.Tensor, k_doc: torch.Tensor, causal: bool) -> Optional[VarlenPlan]:
    """Varlen segments for a document-masked block, or None where runs cannot express it.

    Copies the ids to the host (one sync). Causal blocks must have equal query and key ids
    (the diagonal block of a ring step or a whole local sequence): one causal segment per run.
    """
    q_ids = q_doc.detach().cpu().numpy()
    k_ids = q_ids if k_doc is q_doc else k_doc.detach().cpu().numpy()
    batch, sq = q_ids.shape
    sk = k_ids.shape[1]
    if causal:
        if k_ids is not q_ids and not np.array_equal(q_ids, k_ids):
            return None
        starts, lens = [], []
        for b in range(batch):
            s, e, vals = _runs(q_ids[b])
            if len(np.unique(vals)) != len(vals):
                return None  # a document in two separate runs
            starts.append(s + b * sq)
            lens.append(e - s)
        starts, lens = np.concatenate(starts), np.concatenate(lens)
        cu = np.concatenate((starts, [batch * sq])).astype(np.int32)
        longest = int(lens.max())
        return VarlenPlan(True, cu, cu, None, None, longest, longest, None, None)
    segs = []  # per batch row: (q_start, q_len, k_start, k_len) columns
    for b in range(batch):
        qs, qe, qv = _runs(q_ids[b])
        ks, ke, kv = _runs(k_ids[b])
        if len(np.unique(qv)) != len(qv) or len(np.unique(kv)) != len(kv):
            return None
        _, qi, ki = np.intersect1d(qv, kv, assume_unique=True, return_indices=True)
        order = np.argsort(qi)  # segments in query order
        qi, ki = qi[order], ki[order]
        if np.any(np.diff(ki) < 0):
            return None  # shared documents in another order on the two sides
        segs.append(np.stack([qs[qi] + b * sq, qe[qi] - qs[qi], ks[ki] + b * sk, ke[ki] - ks[ki]], 1))
    seg = np.concatenate(segs).astype(np.int64)
    if not len(seg):
        return VarlenPlan(
            False, None, None, None, None, 0, 0, np.zeros(batch * sq, dtype=bool), np.zeros(batch * sk, dtype=bool)
        )
    q_covered = _cover(seg[:, 0], seg[:, 1], batch * sq)
    k_covered = _cover(seg[:, 2], seg[:, 3], batch * sk)
    # cu_seqlens: each segment's start, then the end of the last one (FA4 reads a segment's
    # rows from cu_seqlens[i] and its length from seqused[i]: gaps between segments are fine).
    cu_q = np.concatenate((seg[:, 0], [seg[-1, 0] + seg[-1, 1]])).astype(np.int32)
    cu_k = np.concatenate((seg[:, 2], [seg[-1, 2] + seg[-1, 3]])).astype(np.int32)
    return VarlenPlan(
        False,
        cu_q,
        cu_k,
        seg[:, 1].astype(np.int32),
        seg[:, 3].astype(np.int32),
        int(seg[:, 1].max()),
        int(seg[:, 3].max()),
        None if q_covered.all() else q_covered,
        None if k_covered.all() else k_covered,
    )


def _device_plan(plan: VarlenPlan, device) -> dict:
    """The kernels' varlen keywords of a (non-empty) plan, on ``device``."""

    def put(a):
        return None if a is None else torch.from_numpy(a).to(device, non_blocking=True)

    return dict(
        cu_seqlens_q=put(plan.cu_seqlens_q),
        cu_seqlens_k=put(plan.cu_seqlens_k),
        seqused_q=put(plan.seqused_q),
        seqused_k=put(plan.seqused_k),
        max_seqlen_q=max(plan.max_seqlen_q, 1),
        max_seqlen_k=max(plan.max_seqlen_k, 1),
    )


def _on(device):
    """``torch.cuda.device(device)``, or nothing where it is already the current one (the
    usual case: switching costs host time on every call)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _flat(t):
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _nothing_visible(q, v, out_dtype):
    B, Sq, Hq, _ = q.shape
    out = torch.zeros(B, Sq, Hq, v.shape[-1], dtype=out_dtype or q.dtype, device=q.device)
    return out, torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device)


def _forward_varlen(iface, q, k, v, softmax_scale, out_dtype, causal, kernel_args, q_covered=None):
    """Varlen forward over the flattened rows; ``q_covered`` (host bool per row, or None
    where every row is in a segment) marks the rows FA4 writes."""
    B, Sq, Hq, D = q.shape
    partial = q_covered is not None
    # Rows outside every segment keep these pre-filled values: no key -> out 0, lse -inf.
    out = torch.zeros(B * Sq, Hq, v.shape[-1], dtype=q.dtype, device=q.device) if partial else None
    lse = torch.full((Hq, B * Sq), float("-inf"), dtype=torch.float32, device=q.device) if partial else None
    # FA4 compiles a separate forward where every segment's queries fit one tile (its
    # "static persistent" variant): named apart so that the log counts it.
    one_tile = kernel_args["max_seqlen_q"] * (Hq // k.shape[2]) <= 128
    with _on(q.device):
        out, lse = _timed_first_call(
            _variant("fwd", q, k, causal, True, one_tile),
            lambda: iface._flash_attn_fwd(
                _flat(q),
                _flat(k),
                _flat(v),
                softmax_scale=float(softmax_scale),
                causal=causal,
                return_lse=True,
                out=out,
                lse=lse,
                **kernel_args,
            )[:2],
        )
    out = out.view(B, Sq, Hq, -1)
    lse = lse.view(Hq, B, Sq).transpose(0, 1).contiguous()
    covered = None
    if partial:
        covered = torch.from_numpy(q_covered).to(q.device, non_blocking=True).view(B, 1, Sq)
    out, lse = _keep_nan(out, lse, covered)
    if out_dtype is not None and out_dtype != out.dtype:
        out = out.to(out_dtype)
    return out, lse


def _backward_varlen(iface, dout, q, k, v, out, lse, softmax_scale, causal, kernel_args, q_partial, k_partial):
    B, Sq, Hq, D = q.shape
    lse_flat = lse.transpose(0, 1).reshape(Hq, B * Sq)
    # Pre-zeroed gradients where some rows are in no segment: FA4 leaves those rows unwritten.
    dq = torch.zeros_like(_flat(q)) if q_partial else None
    dk = torch.zeros_like(_flat(k)) if k_partial else None
    dv = torch.zeros_like(_flat(v)) if k_partial else None
    with _on(q.device):
        dq, dk, dv = _timed_first_call(
            _variant("bwd", q, k, causal, True),
            lambda: iface._flash_attn_bwd(
                _flat(q),
                _flat(k),
                _flat(v),
                _flat(out),
                _flat(dout),
                lse_flat,
                float(softmax_scale),
                causal,
                dq=dq,
                dk=dk,
                dv=dv,
                **kernel_args,
            )[:3],
        )
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def warm_up(
    device,
    dtype: torch.dtype,
    head_dim: int,
    n_head: int,
    n_kv_head: int,
    *,
    documents: bool,
    full_blocks: bool = True,
    part: tuple = (0, 1),
) -> int:
    """Call every kernel variant a training step can use once, on small blocks, so that their
    compiles (or loads from the disk cache) happen before the first step instead of in the
    middle of a run. Covers dense causal/full blocks and, with ``documents``, varlen calls
    over the axes FA4 compiles apart: under 256 segments and 256 or more (another scheduler), and
    query and key segments each within one tile or over several (a full block's two sides
    independently). ``full_blocks=False``: causal blocks only, all that attention without
    context parallelism calls (one rank's sequence: every block on the diagonal, documents in
    one run each), and most of the variants. Afterwards a compile of any other variant is
    logged (``late_compiles``). Returns the number of FA4 kernels first called here.

    ``part=(i, n)``: only every n-th of the warm-up's calls, from the i-th. The processes of
    one host each compile their part into the shared disk cache (``cache_dir``), wait for each
    other, then warm up fully, loading the rest: a compile is one core's work, so n processes
    that split the calls finish in about 1/n of the time."""
    global _watch
    index, count = part
    if not (isinstance(count, int) and isinstance(index, int) and 0 <= index < count):
        raise ValueError(f"part must be (index, count) with 0 <= index < count, got {part!r}")
    _watch = None  # a later warm-up (another fit in this process) compiles nothing "late"
    before = len(_jit_keys())
    scale = 1.0 / head_dim**0.5
    # Segment lengths within one tile (GQA packing included) and over several; segment counts.
    short, long, counts = 2, 200, (32, 300)
    rows = max(512, long * max(counts))
    gen = torch.Generator(device=device).manual_seed(0)

    def tensor(heads):
        return torch.randn(1, rows, heads, head_dim, device=device, dtype=dtype, generator=gen)

    blocks = dict(q=tensor(n_head), k=tensor(n_kv_head), v=tensor(n_kv_head), dout=tensor(n_head))
    from .segments import Segments

    def dense(causal):
        q, k, v, dout = (blocks[name][:, :512] for name in ("q", "k", "v", "dout"))
        out, lse = forward(q, k, v, causal, scale)
        backward(dout, q, k, v, out, lse, causal, scale)

    def varlen(causal, segs, q_len, k_len):
        q, dout = (blocks[name][:, : segs * q_len] for name in ("q", "dout"))
        k, v = (blocks[name][:, : segs * k_len] for name in ("k", "v"))
        cu_q, cu_k = (torch.arange(0, (segs + 1) * n, n, dtype=torch.int32, device=device) for n in (q_len, k_len))
        segments = Segments(cu_q, cu_k, q_len, k_len)
        out, lse = forward_segments(q, k, v, causal, scale, None, segments)
        backward_segments(dout, q, k, v, out, lse, causal, scale, None, segments)

    calls = []
    for causal in (True, False) if full_blocks else (True,):
        calls.append(functools.partial(dense, causal))
        if documents:
            for segs in counts:
                for q_len in (short, long):
                    for k_len in (q_len,) if causal else (short, long):
                        calls.append(functools.partial(varlen, causal, segs, q_len, k_len))
    for call in calls[index::count]:
        call()
    blocks.clear()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the blocks (up to ~60K rows) go back before the model's own buffers
    _watch = _Watch(_jit_keys(), [cache for _, cache in _jit_caches()], set(compile_seconds))
    return len(_watch.keys) - before


def first_calls_since_warm_up() -> dict:
    """``compile_seconds`` of the variants first called outside ``warm_up`` (all of them where
    no warm-up ran)."""
    before = _watch.variants if _watch is not None else set()
    return {key: s for key, s in compile_seconds.items() if key not in before}
