"""train.py end to end (CPU, CP=2 over gloo, Lightning launching its own processes).

* a short run of the tiny preset writes metrics.csv (step, train_loss), config.yaml,
  loss.png and complete checkpoints, and prints the layout;
* resume exactness: the run above checkpoints at step 3 of 6; resuming from that
  checkpoint in a fresh directory reproduces the losses of steps 3..5 bit for bit;
* an unknown config key is a clear error before anything starts;
* atomic checkpoints: a save killed (SIGKILL) mid-write leaves the previous last.ckpt whole,
  and resume picks the newest complete checkpoint.

One tokenised corpus cache (a small stdlib subset) is shared by all runs of the session.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"
SMALL = [
    "--data", "stdlib:json,email,http,logging,xml",
    "--preset", "tiny", "--set", "model.vocab_size=512",
    "--seq-len", "64", "--batch-size", "2", "--max-steps", "6", "--lr", "3e-3", "--warmup-steps", "2",
    "--context-parallel", "2", "--devices", "2", "--accelerator", "cpu", "--precision", "32-true",
    "--checkpoint-every", "3", "--set", "keep_checkpoints=-1",
    "--set", "val_every=3", "--set", "val_batches=2", "--set", "progress_bar=false",
]


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory) -> dict:
    env = dict(os.environ)
    env["LONGCTX_CACHE_DIR"] = str(tmp_path_factory.mktemp("longctx-cache"))
    env.pop("LOCAL_RANK", None)
    return env


def _train(args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(TRAIN), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc


def _losses(path: Path) -> dict[int, str]:
    with open(path, newline="") as f:
        return {int(r["step"]): r["train_loss"] for r in csv.DictReader(f) if r["train_loss"]}


@pytest.fixture(scope="session")
def full_run(tmp_path_factory, cache_env) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("run-full")
    proc = _train([*SMALL, "--output-dir", str(out)], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc


@pytest.mark.slow
def test_end_to_end_outputs(full_run):
    from longctx.lightning.checkpoint_io import is_complete_checkpoint

    out, proc = full_run
    assert "world 2 = dp 1 x cp 2" in proc.stdout and "tokens per step 128" in proc.stdout
    assert str(out / "metrics.csv") in proc.stdout  # says where things went
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {"step", "train_loss", "val_loss", "lr", "tokens_per_s"} <= set(rows[0])
    losses = _losses(out / "metrics.csv")
    assert sorted(losses) == list(range(6))
    values = torch.tensor([float(v) for v in losses.values()])
    assert torch.isfinite(values).all() and values[-1] < values[0]
    assert any(r["val_loss"] for r in rows)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["seq_len"] == 64 and cfg["context_parallel"] == 2 and cfg["model"]["vocab_size"] == 512
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("last.ckpt", "step000003.ckpt", "step000006.ckpt"):
        assert is_complete_checkpoint(out / "checkpoints" / name), name
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


@pytest.mark.slow
def test_same_seed_gives_bit_identical_losses(full_run, tmp_path, cache_env):
    """Seeded mode: a second run with the same seed logs the same losses, bit for bit."""
    out, _ = full_run
    proc = _train([*SMALL, "--output-dir", str(tmp_path / "again")], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    first, second = _losses(out / "metrics.csv"), _losses(tmp_path / "again" / "metrics.csv")
    assert len(first) == 6 and first == second


@pytest.mark.slow
def test_resume_is_exact(full_run, tmp_path, cache_env):
    out, _ = full_run
    resumed = tmp_path / "resumed"
    proc = _train([*SMALL, "--output-dir", str(resumed), "--resume", str(out / "checkpoints" / "step000003.ckpt")],
                  cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    full, again = _losses(out / "metrics.csv"), _losses(resumed / "metrics.csv")
    assert sorted(again) == [3, 4, 5], again
    # Exact: the CSV holds the logged fp32 values; identical strings = identical bits.
    assert {s: full[s] for s in again} == again


def test_unknown_config_key(tmp_path, cache_env):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_len: 64\nsequence_length: 128\n")
    proc = _train(["--config", str(bad)], cache_env, timeout=60)
    assert proc.returncode != 0
    assert "unknown config key(s) ['sequence_length']" in proc.stderr
    proc = _train(["--set", "model.n_layers=3", "--max-steps", "1"], cache_env, timeout=120)
    assert proc.returncode != 0 and "n_layers" in proc.stderr


@pytest.mark.slow
def test_checkpoint_of_another_shape_is_refused(full_run):
    from longctx.models.lit_module import CausalLMModule

    out, _ = full_run
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    same = CausalLMModule(ckpt["hyper_parameters"]["model"])
    same.on_load_checkpoint(ckpt)  # same shape: accepted
    other = CausalLMModule({**ckpt["hyper_parameters"]["model"], "n_layer": 3})
    with pytest.raises(ValueError, match="different model shape .*n_layer: checkpoint 2 vs model 3"):
        other.on_load_checkpoint(ckpt)


def test_lr_schedule():
    from longctx.models.lit_module import lr_lambda

    f = lr_lambda(warmup_steps=2, decay_steps=10, min_lr_ratio=0.1)
    values = [f(s) for s in range(12)]
    assert values[:3] == [0.5, 1.0, 1.0]  # linear warmup, then the cosine starts at the peak
    assert all(a > b for a, b in zip(values[2:10], values[3:11]))  # decays to the floor...
    assert values[10] == values[11] == pytest.approx(0.1)  # ...and stays there


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_resolves(path):
    """A config in configs/ with a misspelt or stale key would only fail on a GPU job."""
    import importlib.util

    from longctx.models import GPTConfig

    spec = importlib.util.spec_from_file_location("train_cli", TRAIN)
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train  # its dataclasses look their module up there
    spec.loader.exec_module(train)
    cfg = train.resolve_config(train.parse_args(["--config", str(path)])).config
    train.check_config({**cfg, "accelerator": "cpu"})  # every value valid (GPU presence aside)
    config = GPTConfig.from_dict(cfg["model"])
    assert config.n_layer > 0


@pytest.mark.slow
def test_resume_extends_the_run_in_its_own_folder(full_run, tmp_path, cache_env):
    """--resume RUN --max-steps 8: the run's own config (only the override printed), the lr
    schedule kept, metrics.csv covering all 8 steps, the summary naming its val step."""
    import shutil

    out, _ = full_run
    run = tmp_path / "run"
    shutil.copytree(out, run)  # a moved run folder: its config.yaml still names the old place
    proc = _train(["--resume", str(run), "--max-steps", "8"], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "overridden here: max_steps 6 -> 8" in proc.stdout and "keeps ending at step 6" in proc.stdout
    losses = _losses(run / "metrics.csv")
    assert sorted(losses) == list(range(8))
    assert {s: losses[s] for s in range(6)} == _losses(out / "metrics.csv")  # earlier steps kept as logged
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["output_dir"] == str(run) and cfg["max_steps"] == 8 and cfg["decay_steps"] == 6 and cfg["lr"] == 3e-3 and cfg["warmup_steps"] == 2
    with open(run / "metrics.csv", newline="") as f:
        last_val = [r for r in csv.DictReader(f) if r["val_loss"]][-1]
    assert f"val loss {float(last_val['val_loss']):.3f} at step {last_val['step']}" in proc.stdout
    assert "train loss " + f"{float(losses[0]):.3f}" in proc.stdout  # the summary starts at step 0


@pytest.mark.slow
def test_context_parallel_8_on_cpu(tmp_path, cache_env):
    """The headline command on a CPU machine: devices follow --context-parallel."""
    small_data = ["--data", "stdlib:json,email,http,logging,xml", "--set", "model.vocab_size=512",
                  "--seq-len", "128", "--batch-size", "1", "--set", "progress_bar=false"]
    proc = _train(["--context-parallel", "8", "--max-steps", "3", *small_data, "--output-dir", str(tmp_path)],
                  cache_env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "world 8 = dp 1 x cp 8" in proc.stdout
    assert sorted(_losses(tmp_path / "metrics.csv")) == [0, 1, 2]


def test_one_peak_flops_table():
    """MFU in the training module and both benchmarks reads one table."""
    import importlib.util

    from longctx.models import GPTConfig
    from longctx.models.lit_module import peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756.0e12 and peak_bf16_flops("Tesla T4") is None
    spec = importlib.util.spec_from_file_location("max_context_peak", REPO / "benchmarks" / "max_context.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = GPTConfig.from_preset("tiny")
    pcie, sxm = (bench.attention_time_floor(cfg, False, name) for name in ("NVIDIA H100 PCIe", "NVIDIA H100"))
    assert pcie == pytest.approx(sxm * 989.4 / 756.0) and bench.attention_time_floor(cfg, False, "cpu") == 0.0
    assert "PEAK_BF16" not in (REPO / "benchmarks" / "train_throughput.py").read_text()
