"""The fault suite (benchmarks/faults.py) runs on CPU over gloo: a quick subset here (a rank
SIGKILLed mid-training, one SIGKILLed while it writes a checkpoint shard, a NaN in one rank's
FSDP2 gradient shard); the whole table, GPU and CPU, is in the README's reliability section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.train_script import launch_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_fault_suite_subset_over_gloo(tmp_path):
    env = launch_env(tmp_path / "cache")
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "faults.py"),
            "--backend",
            "gloo",
            "--cases",
            "sigkill_rank1,sigkill_rank1_in_save,nan_rank1",
            # 8 steps, checkpoints every 3 (faults hit step 4): the checks are the same as at
            # the defaults (16, 4), and the NaN run trains half as long.
            "--steps",
            "8",
            "--checkpoint-every",
            "3",
            "--workdir",
            str(tmp_path / "runs"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["cases"]}
    assert set(rows) == {"sigkill_rank1", "sigkill_rank1_in_save", "nan_rank1"}, rows  # none needs a reference
    failed = [name for name, r in rows.items() if r["outcome"] != "pass"]
    logs = "".join(
        f"\n--- {name}.log (last 40 lines)\n" + "\n".join(log.read_text().splitlines()[-40:])
        for name in failed
        if (log := tmp_path / "runs" / f"{name}.log").exists()
    )
    assert not failed, proc.stdout[-3000:] + logs
    for name in ("sigkill_rank1", "sigkill_rank1_in_save"):
        killed = rows[name]
        assert killed["exit_codes"]["launcher"] not in (0, None) and killed["seconds"] <= 25, killed
        assert "rank 1" in killed["message"] and killed["work_lost"] <= 3, killed
    assert rows["sigkill_rank1_in_save"]["checkpoint_step"] == 3, rows["sigkill_rank1_in_save"]
    nan = rows["nan_rank1"]
    assert nan["skips_per_rank"] == ["1", "1"] and nan["full_checksums_equal"], nan
    assert proc.returncode == 0
