"""The document side of ``CausalLMModule``'s batches: what the data pipeline does to each full
batch for this rank (``preparation``, installed in the DataLoaders' collate by the strategy), the
same on the device for a batch that arrives unprepared (another strategy's, or the hook called
outside a fit), and the first batch's document plan, checked over the CP group and reported."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import lightning as L
import torch

from longctx.balance import balance_documents
from longctx.data.prepare import BatchPreparation, PreparedBatch
from longctx.documents import plan_documents
from longctx.exchange_cost import choose_plan
from longctx.sharding import document_position_ids, is_sharded

from .planning import cp_size


class DocumentBatches:
    """Document positions, balance and plan of a module's batches.

    ``heads`` / ``kv_heads`` / ``head_dim``: the model's attention, what ``longctx.exchange_cost``
    prices. Each call takes the module's ``trainer`` (None outside a fit) and its ``run_plan``
    (``longctx.run_plan.RunPlan``: the balance and the document exchange are its fields).
    """

    def __init__(
        self,
        *,
        attention: str,
        load_balance: Optional[bool],
        heads: int,
        kv_heads: Optional[int],
        head_dim: int,
    ) -> None:
        self.documents = attention == "document"
        self.load_balance = load_balance
        self.attention_shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        self.reported = False

    def preparation(self, trainer: Optional["L.Trainer"], run_plan: Any) -> Optional[BatchPreparation]:
        """What the data pipeline does to each full batch for this rank (document positions,
        balance, shard, document plan), or None where nothing is to be done there. The
        strategy installs it in the DataLoaders' collate, so it runs on the host while the
        GPUs compute the previous step, and a step reads nothing back from the device."""
        if trainer is None or run_plan is None:
            return None
        strategy = trainer.strategy
        cp = cp_size(trainer)
        return BatchPreparation(
            cp_size=cp,
            cp_rank=int(getattr(strategy, "cp_rank", 0)) if cp > 1 else 0,
            layout=getattr(strategy, "layout", "zigzag"),
            rope_positions=run_plan.parallel.rope_positions,
            balance=bool(run_plan.parallel.balance_documents),
            plan=self.documents,
            exchange=run_plan.parallel.document_exchange,
            **self.attention_shape,
        )

    def after_transfer(self, batch: Any, trainer: Optional["L.Trainer"], run_plan: Any) -> Any:
        """``batch`` on the device, before the strategy shards it: a prepared one as it is (its
        plan reported once), an unprepared one with its document positions, balance and plan."""
        if isinstance(batch, PreparedBatch):  # made ready in the data pipeline
            document_plan = batch.get("document_plan")
            if document_plan is not None and not self.reported:
                self.first_plan(document_plan, trainer)
            return batch
        # Still the full sequences here (the strategy shards after this hook): positions that
        # restart per document need the whole sequence, and so does the load balance.
        if not (isinstance(batch, Mapping) and "document_ids" in batch):
            return batch
        balance_over = self.balance_over(batch, trainer, run_plan)
        if run_plan.parallel.rope_positions == "document":
            batch = {**batch, "position_ids": document_position_ids(batch["document_ids"])}
        if balance_over is not None:
            batch = balance_documents(batch, world_size=balance_over[0], layout=balance_over[1])
        if self.documents and not is_sharded(batch):
            batch = {**batch, "document_plan": self.document_plan(batch["document_ids"], trainer, run_plan)}
        return batch

    def document_plan(self, document_ids: torch.Tensor, trainer: Optional["L.Trainer"], run_plan: Any):
        """This rank's plan of a full batch that reached the device unprepared."""
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        cp = cp_size(trainer) if trainer is not None else 1
        rank = int(getattr(strategy, "cp_rank", 0)) if cp > 1 else 0
        layout = getattr(strategy, "layout", "zigzag")
        exchange = run_plan.parallel.document_exchange
        where = dict(world_size=cp, rank=rank, layout=layout, device=document_ids.device)
        if exchange == "auto":
            _, document_plan = choose_plan({"as given": document_ids}, **where, **self.attention_shape)
        else:
            document_plan = plan_documents(document_ids, causal=True, exchange=exchange, **where)
        if not self.reported:
            self.first_plan(document_plan, trainer)
        return document_plan

    def first_plan(self, document_plan: Any, trainer: Optional["L.Trainer"]) -> None:
        """The first batch's plan: checked against the CP group's (one tiny all-gather: every
        rank must plan the same batch; later batches come from the same sampler) and reported."""
        self.reported = True
        if trainer is None:
            return
        if document_plan.world_size > 1:
            document_plan.check_group(trainer.strategy.cp_group)
        if trainer.global_rank == 0:
            print(document_report(document_plan), flush=True)

    def balance_over(
        self, batch: Mapping[str, Any], trainer: Optional["L.Trainer"], run_plan: Any
    ) -> Optional[tuple[int, str]]:
        """(CP size, layout) to balance ``batch`` for (the run plan's ``balance_documents``), None for none."""
        if trainer is None:
            return None
        cp, layout = cp_size(trainer), getattr(trainer.strategy, "layout", "zigzag")
        balance = run_plan.parallel.balance_documents
        # A batch the user sharded already cannot be reordered; only an explicit True insists (and raises).
        if not balance or (self.load_balance is None and is_sharded(batch)):
            return None
        return cp, layout


def document_report(plan) -> str:
    """One line: the batch's documents over the CP ranks (work balance, K/V moved)."""
    docs = plan.documents
    if plan.world_size == 1:
        return f"documents: {docs} in the first batch, one rank (no context parallelism)"
    if plan.one_document:
        return (
            f"documents: {docs} in the first batch over CP={plan.world_size}: every sequence is one "
            "document, so it runs as plain causal attention (the ring, no mask)"
        )
    ring_rows = plan.world_size * (plan.world_size - 1) * plan.batch * plan.local_len
    return (
        f"documents: {docs} in the first batch over CP={plan.world_size}: busiest rank "
        f"{plan.imbalance:.3f}x the mean visible pairs; K/V rows exchanged per layer "
        f"{plan.moved / ring_rows:.1%} of the plain ring's"
        + (" (every document whole on one rank: the ranks run data-parallel here)" if plan.moved == 0 else "")
    )
