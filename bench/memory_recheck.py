"""Stored GPU memory measurements (benchmarks/results/memory_validate*.json and the full-depth
train.py runs' memory_full*.json) against the memory model as it is now: what
memory_validate.py's recheck option prints, and the test that keeps the model above every
committed measurement."""

from __future__ import annotations

import json
from pathlib import Path

from longctx import ParallelPlan
from longctx.memory import MemoryEstimate, estimate
from longctx.models import GPTConfig


def predict(row: dict, meta: dict, attention_kernel: str = "fa4") -> MemoryEstimate:
    """The model's estimate for one stored row. A row of a full run records its own CP and
    data-parallel sizes, batch, precision, kernel and ``hf_modules``; a memory_validate.py
    row takes the file's CP size and kernel (``meta``; ``attention_kernel`` where the file
    predates that) and is one sequence under FSDP2 over the CP ranks."""
    return estimate(
        GPTConfig.from_dict(row["model"]),
        row["seq_len"],
        plan=ParallelPlan.from_dict(row["plan"]),
        cp=row.get("cp", meta.get("cp", 1)),
        dp=row.get("dp", 1),
        data_parallel=row.get("data_parallel", "fsdp"),
        batch_size=row.get("batch_size", 1),
        precision=row.get("precision", "bf16-mixed"),
        attention_kernel=row.get("attention_kernel", meta.get("attention_kernel", attention_kernel)),
        hf_modules=row.get("hf_modules", False),
    )


def recheck(path, attention_kernel: str) -> list[dict]:
    """The stored measurements of ``path`` (a results JSON memory_validate.py or
    memory_full_table.py wrote) against the memory model as it is now: ``(case, measured,
    predicted, ratio, phase)`` per measured row. ``attention_kernel``: what
    ``backend="auto"`` ran in a memory_validate.py run whose ``meta`` does not name it
    (before 2026-11-25)."""
    data = json.loads(Path(path).read_text())
    rows = []
    for r in data["rows"]:
        if not r.get("measured_gpu"):
            continue
        pred = predict(r, data["meta"], attention_kernel)
        rows.append(
            dict(
                case=r["case"],
                measured=r["measured_gpu"],
                predicted=pred.allocated_bytes,
                ratio=r["measured_gpu"] / pred.allocated_bytes,
                phase=pred.phase,
            )
        )
    return rows
