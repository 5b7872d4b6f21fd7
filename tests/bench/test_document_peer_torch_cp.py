"""benchmarks/document_peer_torch_cp.py on the CPU over gloo (2 processes, ~35 s): PyTorch's own
context parallel with a flex_attention document mask (torchtitan's route) gives out and grads
equal to a float64 explicit-mask reference under the PTRR and head-tail load balancers, the
per-document head-tail balancer is refused in one line for documents it cannot split, and the
JSON says which API path ran. Skipped when this torch lacks that API (the JSON says what is missing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cp_flex_documents_match_float64_on_cpu(tmp_path):
    # mean1k at 2048 tokens, seed 2: documents of 585, 674 and 789 tokens (no block or
    # shard boundary aligned, none a multiple of 4).
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "benchmarks" / "document_peer_torch_cp.py"),
        "--device",
        "cpu",
        "--seq",
        "2048",
        "--heads",
        "2",
        "--dim",
        "16",
        "--dtype",
        "float64",
        "--mixes",
        "mean1k",
        "--seed",
        "2",
        "--balancers",
        "ptrr,headtail,perdoc",
        "--check",
        "--check-seq",
        "2048",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    path = tmp_path / "document_peer_torch_cp_ws2.json"
    assert run.returncode == 0 and path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(path.read_text())
    if report["api"]["path"] is None:
        pytest.skip(f"this torch cannot run context parallel with flex_attention: {report['api']['reason']}")
    (row,) = report["mixes"]
    assert "error" not in row, row.get("traceback")
    assert row["documents"] == 3 and row["torch"] == report["torch"]
    for name in ("ptrr", "headtail"):
        got = row["check"][name]
        assert got["ok"], got
        assert max(got["rel_err"].values()) < 1e-9 and got["flex_forward_rel_err"] < 1e-9
        cell = row["balancers"][name]
        assert cell["ms"] > 0 and len(cell["ms_per_rank"]) == 2, cell
        assert sum(cell["blocks_per_rank"]) > 0 and cell["pair_imbalance"] >= 1.0
    # PTRR deals the mask's blocks by their work: at least as even as head-tail here.
    assert row["balancers"]["ptrr"]["block_imbalance"] <= row["balancers"]["headtail"]["block_imbalance"]
    for where in (row["check"]["perdoc"], row["balancers"]["perdoc"]):
        assert "multiple of 2 x 2 tokens" in where["error"], where
    assert row["balancer"] in ("ptrr", "headtail") and row["ms"] == row["balancers"][row["balancer"]]["ms"]
    assert "no backward" in row["one_gpu_flex"]["error"]
