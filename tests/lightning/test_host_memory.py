"""A run on CPU: its memory is the host's (issue 44, "runs that cannot work are not refused").

* the memory model's host prediction for a CPU run (``estimate(device="cpu")``: the process,
  the step's tensors, the reference kernel's score matrices, what the allocator keeps) holds
  against train.py's measured peak RSS of its fullest rank (metrics.csv ``peak_rss_gib``);
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longctx import ParallelPlan
from longctx.memory import GiB, estimate, model_shape
from longctx.models import GPTConfig

REPO = Path(__file__).resolve().parents[2]


def test_a_cpu_runs_step_is_host_memory():
    """On a CPU the step's tensors are the process's: no GPU bytes, the host is the process plus
    the step's peak plus what the allocator keeps; the reference kernel's score matrices (4 of
    them, fp32, every query head) span a sequence's shard, or with documents every sequence of
    the shard at once."""
    from longctx.memory import CPU_PROCESS_BYTES, REFERENCE_SCORE_COPIES

    cfg = GPTConfig.from_preset("tiny")
    kw = dict(plan=ParallelPlan("none", False), cp=2, dp=1, data_parallel="ddp", precision="32-true")
    plain = estimate(cfg, 4096, batch_size=2, device="cpu", **kw)
    documents = estimate(cfg, 4096, batch_size=2, device="cpu", documents=True, **kw)
    assert plain.gpu_bytes == 0 and not plain.items
    assert sum(plain.host_items.values()) == plain.host_bytes and plain.host_items["process"] == CPU_PROCESS_BYTES
    assert "host" in plain.summary() and "GPU" not in plain.summary()
    rows = 4096 // 2
    scores = REFERENCE_SCORE_COPIES * 4 * cfg.n_head
    assert documents.host_bytes - plain.host_bytes == pytest.approx(
        1.05 * scores * ((2 * rows) ** 2 - 2 * rows**2), rel=1e-6
    )
    gpu = estimate(cfg, 4096, batch_size=2, **kw)  # the GPU model is unchanged by the CPU's terms
    assert gpu.host_items == {"process": 3 * GiB} and gpu.gpu_bytes > 0


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_the_reference_kernels_scores_are_the_models_count():
    """``reference_scores_bytes`` is what ``longctx.kernels.reference``'s backward holds at once:
    the process's peak RSS over one backward call, measured."""
    from longctx.kernels import attention_backward, attention_forward
    from longctx.memory import reference_scores_bytes

    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    cfg = GPTConfig.from_preset("tiny")
    torch.manual_seed(0)
    rows = 2048
    q = torch.randn(1, rows, cfg.n_head, cfg.head_dim)
    k, v = (torch.randn(1, rows, cfg.n_kv_head, cfg.head_dim) for _ in range(2))
    out, lse = attention_forward(q, k, v, causal=True, backend="torch")
    dout = torch.randn_like(out)
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    grads = attention_backward(dout, q, k, v, out, lse, causal=True, backend="torch")
    measured = status("VmHWM") - before
    del grads
    counted = reference_scores_bytes(model_shape(cfg), rows, 1, 1, documents=False, ulysses=False)
    assert 0.95 <= measured / counted <= 1.1, (measured, counted)


@pytest.mark.slow
def test_train_py_host_prediction_holds_on_cpu(tmp_path):
    """train.py on CPU (tiny preset, CP 2 over gloo, 4,096 tokens of 2 sequences): the host memory
    it predicts per rank is the fullest rank's measured peak RSS within 10%."""
    env = {**os.environ, "LONGCTX_CACHE_DIR": str(tmp_path / "cache")}
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = tmp_path / "run"
    argv = [
        *("--data", "stdlib:json,email,http,logging,xml", "--preset", "tiny", "--model.model.vocab_size", "512"),
        *("--seq-len", "4096", "--batch-size", "2", "--attention", "causal", "--context-parallel", "2"),
        *("--max-steps", "1", "--val-every", "0", "--checkpoint-every", "0", "--output-dir", str(out)),
        *("--trainer.enable_progress_bar", "false"),
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("memory (predicted, per rank)"))
    predicted = float(re.search(r"host ([0-9.]+) GiB", summary).group(1))
    with open(out / "metrics.csv", newline="") as f:
        measured = max(float(r["peak_rss_gib"]) for r in csv.DictReader(f) if r.get("peak_rss_gib"))
    assert 0.9 <= measured / predicted <= 1.1, (measured, predicted)
