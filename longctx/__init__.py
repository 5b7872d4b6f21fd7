"""longctx: long-context training with ring-attention context parallelism in Lightning.

``import longctx`` loads torch only. The Lightning parts (``ContextParallelStrategy``,
``NonFiniteGuard``) live in ``longctx.lightning`` and load on first access of their names
here; the strategy name ``"context_parallel"`` is registered with Lightning then, or at
once when Lightning is already imported.
"""

import importlib.abc
import importlib.util
import sys

from . import checkout  # noqa: F401 - first: finds models/ and kernels/ in a source checkout
from .balance import balance_documents, balance_permutation
from .layouts import position_ids, shard_sequence, unshard_sequence
from .loss import TokenWeightedAccumulator, causal_lm_loss, global_token_loss
from .parallel import ContextParallelAttention, CPContext, ParallelDims, ParallelPlan, parallelize
from .ring import ring_attention
from .sharding import document_position_ids, is_sharded, shard_batch
from .ulysses import ulysses_attention
from .watchdog import RankWatchdog

_LIGHTNING_NAMES = ("ContextParallelStrategy", "NonFiniteGuard", "NonFiniteError")

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "shard_sequence",
    "unshard_sequence",
    "position_ids",
    "shard_batch",
    "document_position_ids",
    "balance_documents",
    "balance_permutation",
    "is_sharded",
    "CPContext",
    "ContextParallelAttention",
    "ParallelDims",
    "ParallelPlan",
    "parallelize",
    "causal_lm_loss",
    "global_token_loss",
    "TokenWeightedAccumulator",
    "RankWatchdog",
    *_LIGHTNING_NAMES,
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LIGHTNING_NAMES:
        from . import lightning as wing

        return getattr(wing, name)
    raise AttributeError(f"module 'longctx' has no attribute {name!r}")


class _RegisterWithLightning(importlib.abc.MetaPathFinder):
    """Imports the Lightning wing (registering ``strategy="context_parallel"``) right after
    ``lightning.pytorch`` finishes importing, so ``import longctx`` stays torch-only and the
    name still works in whatever order the two are imported."""

    def find_spec(self, name, path, target=None):
        if name != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from . import lightning  # noqa: F401

        spec.loader.exec_module = exec_module
        return spec


if "lightning.pytorch" in sys.modules:
    from . import lightning as _wing  # noqa: F401
else:
    sys.meta_path.insert(0, _RegisterWithLightning())
