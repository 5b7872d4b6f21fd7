"""longctx's Lightning wing: the strategy, checkpoint IO and the non-finite guard callback.

Everything outside this package (the ring, layouts, data, ``parallelize``, the model)
imports with torch alone; importing this package imports Lightning and registers the
strategy name ``"context_parallel"``.
"""

from .health import NonFiniteError, NonFiniteGuard
from .strategy import ContextParallelStrategy

__all__ = ["ContextParallelStrategy", "NonFiniteGuard", "NonFiniteError"]
