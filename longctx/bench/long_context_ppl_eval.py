"""The measurement of benchmarks/long_context_ppl.py, which moved to the long-context
evaluation (``longctx.models.evaluation``, evaluate.py): re-exported here for the benchmark."""

from longctx.models.evaluation import (
    bucket_edges,
    evaluate,
    evaluate_length,
    fmt_size,
    format_length,
    is_rank0,
    log,
    per_token_loss,
    ppl,
    summarise,
    window_indices,
)

__all__ = [
    "bucket_edges",
    "evaluate",
    "evaluate_length",
    "fmt_size",
    "format_length",
    "is_rank0",
    "log",
    "per_token_loss",
    "ppl",
    "summarise",
    "window_indices",
]
