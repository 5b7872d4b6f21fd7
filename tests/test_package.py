"""The package face: the model, the ring, the kernels and the data pipeline import with
torch alone; the Lightning wing loads on demand and registers the strategy name."""
from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_model_and_ring_import_without_lightning():
    proc = _run(
        "import sys, longctx, longctx.models, longctx.kernels, longctx.data\n"
        "from longctx import ring_attention, parallelize, ParallelPlan\n"
        "from longctx.models import GPT, GPTConfig, TransformerBlock\n"
        "heavy = [m for m in ('lightning', 'pytorch_lightning', 'torchmetrics') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_strategy_name_registered_whatever_the_import_order():
    check = ("from lightning.pytorch.strategies import StrategyRegistry\n"
             "import longctx\n"
             "assert 'context_parallel' in StrategyRegistry, sorted(StrategyRegistry)\n"
             "assert StrategyRegistry['context_parallel']['strategy'] is longctx.ContextParallelStrategy\n")
    for first in ("import longctx\n", "import lightning\n"):
        proc = _run(first + check)
        assert proc.returncode == 0, (first, proc.stderr[-2000:])
