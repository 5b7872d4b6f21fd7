"""longctx: long-context training with ring-attention context parallelism in Lightning.

``import longctx`` registers the Lightning strategy name ``"context_parallel"``.
"""
from .health import NonFiniteError, NonFiniteGuard
from .layouts import position_ids, shard_sequence, unshard_sequence
from .loss import TokenWeightedAccumulator, global_token_loss
from .ring import ring_attention
from .ulysses import ulysses_attention
from .sharding import is_sharded, shard_batch
from .strategy import ContextParallelStrategy, get_context_parallel_group
from .watchdog import RankWatchdog

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "shard_sequence",
    "unshard_sequence",
    "position_ids",
    "shard_batch",
    "is_sharded",
    "ContextParallelStrategy",
    "get_context_parallel_group",
    "global_token_loss",
    "TokenWeightedAccumulator",
    "NonFiniteGuard",
    "NonFiniteError",
    "RankWatchdog",
]
__version__ = "0.1.0"
