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


def comparisons(row: dict, pred: MemoryEstimate) -> list[tuple[str, int, int, str]]:
    """``(what, measured, predicted, phase)`` for each measurement a stored row holds: a
    steady step's peak (``measured_gpu``) against the model's peak, and a full run's first
    step (``measured_first_step_gpu``, taken before the first optimizer step creates AdamW's
    states) against the model's first step."""
    out = []
    if row.get("measured_first_step_gpu"):
        out.append(("step 1", row["measured_first_step_gpu"], pred.first_step_allocated_bytes, "the first step"))
    if row.get("measured_gpu"):
        out.append(("steady", row["measured_gpu"], pred.allocated_bytes, pred.phase))
    return out


def recheck(path, attention_kernel: str) -> list[dict]:
    """The stored measurements of ``path`` (a results JSON memory_validate.py or
    memory_full_table.py wrote) against the memory model as it is now: ``(case, measured,
    predicted, ratio, phase)`` per measurement (a full run's first step is its case name with
    " (step 1)"). ``attention_kernel``: what
    ``backend="auto"`` ran in a memory_validate.py run whose ``meta`` does not name it
    (before 2026-11-25)."""
    data = json.loads(Path(path).read_text())
    rows = []
    for r in data["rows"]:
        if "model" not in r:  # a run that did not start
            continue
        pred = predict(r, data["meta"], attention_kernel)
        for what, measured, predicted, phase in comparisons(r, pred):
            case = r["case"] if what == "steady" else f"{r['case']} ({what})"
            rows.append(
                dict(case=case, measured=measured, predicted=predicted, ratio=measured / predicted, phase=phase)
            )
    return rows
