"""GPU (2): whole Lightning training steps on packed documents with CP = 2 read nothing back to
the host: the batch is balanced, sharded and planned in the data pipeline (DataLoader worker),
and the step runs under ``torch.cuda.set_sync_debug_mode("error")`` (tests/sync_free_worker.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from helpers.run_if import requires_cuda

pytestmark = requires_cuda(min_gpus=2)


def test_document_training_steps_never_sync_the_host(tmp_path: Path):
    out = tmp_path / "result.json"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    worker = Path(__file__).with_name("sync_free_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["checked"] == 4  # steps 3-6 ran under the sync check
    assert len(result["losses"]) == 6 and all(math.isfinite(x) for x in result["losses"])
