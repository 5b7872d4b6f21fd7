"""benchmarks/device/device_recipe.sh --tiny: the long-context fine-tuning recipe's whole
pipeline at toy scale on CPU, so the GPU script cannot rot between device runs.

The tiny preset trained at 64 tokens (one process), extended with --init-from and linear RoPE
scaling to 256 tokens over CP=2 (gloo) with the evaluation during training, then evaluate.py
on both checkpoints: the files a device call brings back (at most 8, plain names), the records
saying which model each one evaluated, the runs' logs and metrics in the tarball.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from helpers.train_script import launch_env

REPO = Path(__file__).resolve().parents[2]
OUTPUTS = [
    "recipe_long.json",
    "recipe_long_loss_by_position.png",
    "recipe_long_passkey.png",
    "recipe_runs.tar.gz",
    "recipe_short.json",
    "recipe_short_loss_by_position.png",
    "recipe_short_passkey.png",
]


@pytest.mark.slow
def test_recipe_runs_end_to_end_at_toy_scale(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = launch_env(tmp_path / "cache", OUT=str(out), WORK=str(work), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "device" / "device_recipe.sh"), "--tiny"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    for stage in ("short", "long", "eval_short", "eval_long"):
        assert f"[recipe] {stage}: rc 0" in proc.stdout
    # What a device call brings back: at most 8 plain files.
    assert sorted(p.name for p in out.iterdir()) == OUTPUTS
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in OUTPUTS) and len(OUTPUTS) <= 8

    short, long = (json.loads((out / f"recipe_{name}.json").read_text()) for name in ("short", "long"))
    assert short["config"]["rope_scaling"] is None and short["config"]["max_seq_len"] == 64
    assert long["config"]["rope_scaling"] == {"type": "linear", "factor": 4} and long["config"]["max_seq_len"] == 256
    for record in (short, long):
        table = record["passkey"]
        assert table["lengths"] == [128, 256] and table["depths"] == [0.0, 0.5, 1.0]
        assert all(0 <= a <= 1 for row in table["accuracy"] for a in row)
        results = record["loss_by_position"]["results"]
        assert [r["seq_len"] for r in results] == [128, 256] and all(r["loss"] > 0 for r in results)
        assert "beyond_base_context" in results[-1]  # positions past the short model's 64 tokens

    with tarfile.open(out / "recipe_runs.tar.gz") as tar:
        names = set(tar.getnames())
        assert {f"logs/{n}.log" for n in ("short", "long", "eval_short", "eval_long")} <= names
        assert {"logs/long_eval/step000002.json", "logs/short_loss.png", "logs/long_loss.png"} <= names
        config = yaml.safe_load(tar.extractfile("logs/long_config.yaml").read())
        rows = list(csv.DictReader(io.TextIOWrapper(tar.extractfile("logs/long_metrics.csv"))))
    # The fine-tune: from the short run, 256 tokens over CP=2, evaluated during training.
    assert config["model"]["init_from"] == str(work / "short") and config["data"]["seq_len"] == 256
    assert config["strategy"]["context_parallel_size"] == 2 and config["eval"]["every_n_steps"] == 2
    assert [r["step"] for r in rows if r.get("passkey_acc")] == ["1"]
