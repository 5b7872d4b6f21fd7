"""longctx: long-context training with ring-attention context parallelism in Lightning."""
from .layouts import position_ids, shard_sequence, unshard_sequence
from .ring import ring_attention

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "position_ids"]
__version__ = "0.1.0"
