"""What the Triton attention kernels share: the triton import (a shim where triton is
absent, so the package still imports), the tile configs and their autotune wiring, and the
@triton.jit tile load/store helpers.

The dense kernels (triton_attention_{fwd,dkdv,dq}.py, launched by triton_attention.py) and
the document-masked ones (triton_document_{fwd,dkdv,dq}.py) both import from here, so
neither reaches into the other: the document kernels use the same tiles, configs and
helpers as the dense ones by construction.

Under TRITON_INTERPRET=1 (read when this module is imported: triton.jit picks interpreter
or compiler at decoration time) the configs are one small fixed tile per kernel, which is
what the CPU tests exercise.
"""

import os
import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton (e.g. macOS): keep the module importable, report unavailable
    triton = None

    def _identity_decorator(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    class _ShimTL(types.SimpleNamespace):
        @staticmethod
        def constexpr(x=None):
            return x

    tl = _ShimTL()
    _shim = types.SimpleNamespace(
        jit=_identity_decorator,
        autotune=_identity_decorator,
        heuristics=_identity_decorator,
        Config=lambda *a, **k: None,
    )
else:
    _shim = None

triton_or_shim = triton if triton is not None else _shim

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
TL_LOG2E = tl.constexpr(LOG2E)  # globals read inside @triton.jit must be constexpr
TL_LN2 = tl.constexpr(0.6931471805599453)

# Autotune keys use bucketed sequence lengths so that a new length (every ring size and
# every layout gives different block lengths) re-tunes only when it lands in a new
# power-of-two bucket, and every length >= the cap shares one tuning (measured once at
# the cheaper length instead of at 64K+).
_BUCKET_CAP = 16384


def length_bucket(n: int) -> int:
    return min(max(16, 1 << max(0, (n - 1)).bit_length()), _BUCKET_CAP)


# ----------------------------------------------------------------------------- configs


def tile_config(block_m, block_n, warps, stages):
    return triton_or_shim.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# Each list is (head_dim upper bound -> configs). Kept short: compile time of every
# config is paid once per (head_dim, causal, dtype, even-length) variant. BLOCK_M is the
# query tile, BLOCK_N the key tile in every kernel.
if INTERPRET:
    # One small config per kernel (autotuning in the interpreter is slow). Non-square by
    # default so the CPU tests cover multi-tile loops, the band split with
    # BLOCK_M != BLOCK_N and ragged tails; the tests swap the shapes through
    # LONGCTX_TRITON_INTERP_TILES="fwd,dkdv,dq" (each BLOCK_MxBLOCK_N).
    _interp_tiles = [
        tuple(int(x) for x in t.split("x"))
        for t in os.environ.get("LONGCTX_TRITON_INTERP_TILES", "32x16,16x32,32x16").split(",")
    ]
    FWD_CONFIGS = {256: [tile_config(*_interp_tiles[0], 4, 1)]}
    DKDV_CONFIGS = {256: [tile_config(*_interp_tiles[1], 4, 1)]}
    DQ_CONFIGS = {256: [tile_config(*_interp_tiles[2], 4, 1)]}
else:
    # Measured on H200 by benchmarks/triton_tune.py (each candidate alone, B=1 H=16 bf16,
    # 8K and 16K blocks, causal and full; results/triton_tune_h200.json): each list keeps the
    # configs within a few percent of the best somewhere, best-on-average first (the one
    # LONGCTX_TRITON_AUTOTUNE=0 uses). Candidates that spill registers at their head_dim
    # were dropped at compile time; D=256 spills in dK/dV whatever the tile (correct, not
    # tuned). fp32 (tests only) uses exact-fp32 FMA dots: one small tile.
    FWD_CONFIGS = {
        64: [
            tile_config(128, 64, 8, 3),
            tile_config(128, 64, 4, 3),
            tile_config(128, 128, 4, 3),
            tile_config(64, 64, 4, 4),
        ],
        128: [
            tile_config(128, 64, 8, 3),
            tile_config(128, 64, 8, 4),
            tile_config(128, 128, 8, 3),
            tile_config(64, 64, 4, 3),
        ],
        256: [tile_config(64, 32, 4, 2), tile_config(128, 64, 8, 2), tile_config(64, 64, 8, 2)],
        "fp32": [tile_config(32, 32, 4, 2)],
    }
    # dK/dV: BLOCK_N keys stay resident (K, V in shared memory, dK, dV in registers),
    # BLOCK_M queries stream through.
    DKDV_CONFIGS = {
        64: [
            tile_config(64, 64, 4, 3),
            tile_config(32, 128, 4, 5),
            tile_config(32, 64, 4, 4),
            tile_config(64, 128, 8, 3),
        ],
        128: [
            tile_config(64, 128, 8, 3),
            tile_config(32, 64, 4, 3),
            tile_config(64, 128, 8, 2),
            tile_config(32, 128, 8, 3),
        ],
        256: [tile_config(32, 64, 8, 1), tile_config(16, 64, 8, 2), tile_config(32, 32, 4, 1)],
        "fp32": [tile_config(16, 32, 4, 2)],
    }
    # dQ: BLOCK_M queries stay resident, BLOCK_N keys stream through.
    DQ_CONFIGS = {
        64: [
            tile_config(128, 64, 4, 3),
            tile_config(128, 64, 8, 3),
            tile_config(64, 64, 4, 3),
            tile_config(128, 32, 4, 3),
        ],
        128: [
            tile_config(128, 64, 8, 3),
            tile_config(128, 32, 8, 3),
            tile_config(64, 64, 4, 2),
            tile_config(64, 32, 4, 3),
        ],
        256: [tile_config(64, 32, 4, 2), tile_config(32, 32, 4, 2), tile_config(64, 32, 8, 2)],
        "fp32": [tile_config(32, 32, 4, 2)],
    }


def _all_configs(table):
    return [c for cfgs in table.values() for c in cfgs]


def _pruner(table):
    """Autotune prune hook: keep only the configs listed for this head-dim class/dtype."""
    bounds = sorted(b for b in table if isinstance(b, int))

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        if args["Q"].dtype == torch.float32 and "fp32" in table:
            return list(table["fp32"])
        bound = next((b for b in bounds if args["BLOCK_D"] <= b), bounds[-1])
        if os.environ.get("LONGCTX_TRITON_AUTOTUNE", "1") == "0":
            return list(table[bound][:1])  # first listed config only: fast compiles (tests)
        return list(table[bound])

    return prune


def _tuned_bench(kernel_call, quantiles):
    import triton.testing

    # Shorter than triton's default 25 ms warm-up + 100 ms measurement per config: the
    # whole benchmark, tuning included, has to stay within a few minutes.
    return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)


def autotune(table, key, **kwargs):
    if INTERPRET or triton is None:
        return triton_or_shim.autotune(configs=_all_configs(table), key=key, **kwargs)
    prune = {"early_config_prune": _pruner(table)}
    try:
        return triton_or_shim.autotune(
            configs=_all_configs(table), key=key, prune_configs_by=prune, do_bench=_tuned_bench, **kwargs
        )
    except TypeError:  # triton < 3.2 has no do_bench hook: default timing, slower tuning
        return triton_or_shim.autotune(configs=_all_configs(table), key=key, prune_configs_by=prune, **kwargs)


# The document kernels (triton_document_{fwd,dkdv,dq}.py) run with fixed tile sizes per head
# dim, because their block maps (triton_document.py) depend on them: the autotuner only
# chooses among configs with those tile sizes (warps, stages).
def document_tiles(table, head_dim: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N) the kernels run with: the first config of the matching list."""
    if dtype == torch.float32 and "fp32" in table:
        return _tile_of(table["fp32"][0])
    bounds = sorted(b for b in table if isinstance(b, int))
    bound = next((b for b in bounds if block_d(head_dim) <= b), bounds[-1])
    return _tile_of(table[bound][0])


def _tile_of(config):
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]


def _document_pruner(table):
    base = _pruner(table)

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        tiles = (args["MAP_M"], args["MAP_N"])
        return [c for c in base(configs, named_args, **kwargs) if _tile_of(c) == tiles]

    return prune


def document_autotune(table, **kwargs):
    key = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL"]
    if INTERPRET or triton is None:
        return triton_or_shim.autotune(configs=_all_configs(table), key=key, **kwargs)
    return triton_or_shim.autotune(
        configs=_all_configs(table),
        key=key,
        prune_configs_by={"early_config_prune": _document_pruner(table)},
        do_bench=_tuned_bench,
        **kwargs,
    )


# What the dense backward kernels are tuned for (the forward names the same list).
BWD_KEY = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL"]

EVEN_HEURISTICS = {
    "EVEN_M": lambda a: a["seqlen_q"] % a["BLOCK_M"] == 0,
    "EVEN_N": lambda a: a["seqlen_k"] % a["BLOCK_N"] == 0,
}

# ----------------------------------------------------------------------------- helpers


@triton_or_shim.jit
def load_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, EVEN: tl.constexpr, PAD_D: tl.constexpr):
    """Load a [rows, BLOCK_D] tile; masks only where the shape needs them."""
    if EVEN:
        if PAD_D:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        if PAD_D:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    return x


@triton_or_shim.jit
def store_tile(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, EVEN: tl.constexpr, PAD_D: tl.constexpr):
    if EVEN:
        if PAD_D:
            tl.store(ptrs, x, mask=offs_d[None, :] < HEAD_DIM)
        else:
            tl.store(ptrs, x)
    else:
        if PAD_D:
            tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(ptrs, x, mask=rows[:, None] < n_rows)


@triton_or_shim.jit
def load_row(ptrs, rows, n_rows, EVEN: tl.constexpr):
    """Per-row fp32 statistic (lse, delta); out-of-range rows read 0 (they stay inert)."""
    if EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=rows < n_rows, other=0.0)
    return x


# ----------------------------------------------------------------------------- launch helpers


def _set_dq_block(nargs):
    # The host-side descriptor's box must match this config's tile.
    nargs["DQ_DESC"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_D"]]


def with_dq_desc_hook(table):
    return (
        {
            b: [
                triton_or_shim.Config(
                    dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=_set_dq_block
                )
                for c in cfgs
            ]
            for b, cfgs in table.items()
        }
        if triton is not None
        else table
    )


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())
