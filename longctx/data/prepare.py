"""A packed batch made ready for one context-parallel rank in the data pipeline, on the host.

Everything a step needs from the full sequences — positions that restart per document, the
document balance, this rank's shard and its ``DocumentPlan`` — depends only on the batch's
ids. Done here, in the DataLoader's collate (its worker processes when ``num_workers > 0``),
it runs while the GPUs compute the previous step; the result is pinned by the loader and
reaches the GPU with non-blocking copies, and the training step reads nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ..balance import balance_documents
from ..documents import plan_documents
from ..exchange_cost import choose_plan
from ..layouts import check_layout
from ..parallel import DOCUMENT_EXCHANGES
from ..sharding import ShardedBatch, document_position_ids, shard_batch
from ..validation import check_choice, check_number


class PreparedBatch(ShardedBatch):
    """A batch that ``BatchPreparation`` made ready: sharded, balanced and planned already.
    Rebuilt by type (pinning, device transfer), it stays marked."""


@dataclass(frozen=True)
class BatchPreparation:
    """What one rank does to each full batch ``{"input_ids", "labels", "document_ids", ...}``
    (``(B, S)`` host tensors) before it goes to the device.

    ``rope_positions="document"``: ``position_ids`` restart at every document; ``balance``:
    ``balance_documents`` over the CP ranks; ``plan``: the rank's ``DocumentPlan`` (document
    masking, its ``exchange``) as ``batch["document_plan"]``, built on the host. ``exchange=
    "auto"``: per batch, the exchange and (where ``balance``) the order, balanced or as packed,
    that ``longctx.exchange_cost`` predicts fastest for attention of ``heads`` / ``kv_heads``
    heads of ``head_dim``. A batch without ``document_ids`` is only sharded.
    """

    cp_size: int = 1
    cp_rank: int = 0
    layout: str = "zigzag"
    rope_positions: str = "global"
    balance: bool = False
    plan: bool = False
    exchange: str = "ring"
    heads: int = 16
    kv_heads: Optional[int] = None
    head_dim: int = 128

    def __post_init__(self) -> None:
        check_number("cp_size", self.cp_size, low=1, integer=True)
        check_number("cp_rank", self.cp_rank, low=0, integer=True)
        if self.cp_rank >= self.cp_size:
            raise ValueError(f"BatchPreparation: cp_rank {self.cp_rank} is outside [0, {self.cp_size})")
        check_layout(self.layout)
        check_choice("rope_positions", self.rope_positions, ("document", "global"))
        check_choice("exchange", self.exchange, DOCUMENT_EXCHANGES)
        for name in ("heads", "head_dim"):
            check_number(name, getattr(self, name), low=1, integer=True)
        if self.kv_heads is not None:
            check_number("kv_heads", self.kv_heads, low=1, integer=True)

    def __call__(self, batch: Any) -> Any:
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            return batch  # not a token batch: the strategy shards it on the device as before
        full = dict(batch)
        ids = full.get("document_ids")
        plan = None
        if ids is not None:
            if self.rope_positions == "document":
                full["position_ids"] = document_position_ids(ids)
            orders = {"packed": full}
            if self.balance and self.cp_size > 1:
                orders["balanced"] = balance_documents(full, world_size=self.cp_size, layout=self.layout)
            if self.plan and self.exchange == "auto":
                shape = dict(heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
                where = dict(world_size=self.cp_size, rank=self.cp_rank, layout=self.layout, device="cpu")
                order, plan = choose_plan({k: v["document_ids"] for k, v in orders.items()}, **where, **shape)
                full = orders[order]
            else:
                full = orders["balanced" if "balanced" in orders else "packed"]
                if self.plan:
                    plan = plan_documents(
                        full["document_ids"],
                        world_size=self.cp_size,
                        rank=self.cp_rank,
                        layout=self.layout,
                        causal=True,
                        device="cpu",
                        exchange=self.exchange,
                    )
        out = PreparedBatch(shard_batch(full, rank=self.cp_rank, world_size=self.cp_size, layout=self.layout))
        if plan is not None:
            out["document_plan"] = plan
        return out


class PreparingCollate:
    """``collate_fn`` followed by a ``BatchPreparation``: a DataLoader's collate that hands
    out prepared batches (picklable, for worker processes)."""

    def __init__(self, collate_fn: Callable, preparation: BatchPreparation):
        if isinstance(collate_fn, PreparingCollate):  # set again (a second fit): replace, never stack
            collate_fn = collate_fn.collate_fn
        self.collate_fn, self.preparation = collate_fn, preparation

    def __call__(self, samples: Any) -> Any:
        return self.preparation(self.collate_fn(samples))
