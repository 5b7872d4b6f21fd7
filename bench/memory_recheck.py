"""benchmarks/memory_validate.py's stored GPU measurements (benchmarks/results/memory_validate*.json)
against the memory model as it is now: what the script's recheck option prints, and the test
that keeps the model above every committed measurement."""
from __future__ import annotations

import json
from pathlib import Path

from longctx import ParallelPlan
from longctx.memory import estimate
from longctx.models import GPTConfig


def recheck(path, attention_kernel: str) -> list[dict]:
    """The stored measurements of ``path`` (a results JSON memory_validate.py wrote) against the
    memory model as it is now: ``(case, measured, predicted, ratio)`` per measured row.
    ``attention_kernel``: what ``backend="auto"`` ran in that run (the JSON's ``meta`` names
    it from 2026-11-25 on)."""
    data = json.loads(Path(path).read_text())
    cp = data["meta"].get("cp", 1)
    kernel = data["meta"].get("attention_kernel", attention_kernel)
    rows = []
    for r in data["rows"]:
        if "measured_gpu" not in r:
            continue
        pred = estimate(GPTConfig.from_dict(r["model"]), r["seq_len"], plan=ParallelPlan(**r["plan"]), cp=cp, dp=1,
                        data_parallel="fsdp", attention_kernel=kernel)
        rows.append(dict(case=r["case"], measured=r["measured_gpu"], predicted=pred.allocated_bytes,
                         ratio=r["measured_gpu"] / pred.allocated_bytes, phase=pred.phase))
    return rows
