"""train.py end to end (CPU, CP=2 over gloo, Lightning launching its own processes).

* a short run of the tiny preset writes metrics.csv (step, train_loss), config.yaml,
  loss.png and complete checkpoints, and prints the layout;
* resume exactness: the run above checkpoints at step 3 of 6; resuming from that
  checkpoint in a fresh directory reproduces the losses of steps 3..5 bit for bit; a second
  launch with the same seed, killed right after that checkpoint and resumed, logs the same
  losses bit for bit, one metrics.csv row per step (that resume, of the moved run folder,
  also extends it to 8 steps: the override printed, the lr schedule kept);
* an option reached only through a class's signature lands in the module (and its
  optimizer); ``--print_config`` prints a config that gives the same run with ``--config``;
* atomic checkpoints: a save killed (SIGKILL) mid-write leaves the previous last.ckpt whole,
  and resume picks the newest complete checkpoint.

One tokenised corpus cache (a small stdlib subset) is shared by all runs of the session; the
run above and the cache are fixtures of tests/lightning/conftest.py (test_run_defaults.py reads
that run too).
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.train_script import SMALL
from helpers.train_script import run_train as _train

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "train.py"


def _losses(path: Path) -> dict[int, str]:
    with open(path, newline="") as f:
        return {int(r["step"]): r["train_loss"] for r in csv.DictReader(f) if r["train_loss"]}


@pytest.mark.slow
def test_end_to_end_outputs(full_run):
    from longctx.checkpoint_verify import is_complete_checkpoint

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
    assert cfg["data"]["seq_len"] == 64 and cfg["strategy"]["context_parallel_size"] == 2
    assert cfg["model"]["model"] == {"preset": "tiny", "vocab_size": 512} and cfg["trainer"]["devices"] == 2
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("last.ckpt", "step000003.ckpt", "step000006.ckpt"):
        assert is_complete_checkpoint(out / "checkpoints" / name), name
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 6
    # --model.weight_decay 0.05 (default 0.1) reached the module and its AdamW (matrices only).
    assert ckpt["hyper_parameters"]["weight_decay"] == 0.05
    decays = sorted(g["weight_decay"] for g in ckpt["optimizer_states"][0]["param_groups"])
    assert decays == [0.0, 0.05]


@pytest.mark.slow
def test_resume_is_exact(full_run, tmp_path, cache_env):
    out, _ = full_run
    resumed = tmp_path / "resumed"
    proc = _train(
        [*SMALL, "--output-dir", str(resumed), "--resume", str(out / "checkpoints" / "step000003.ckpt")], cache_env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    full, again = _losses(out / "metrics.csv"), _losses(resumed / "metrics.csv")
    # Step 2's row comes with the step-3 checkpoint (logged after its save), then steps 3..5.
    assert sorted(again) == [2, 3, 4, 5], again
    # Exact: the CSV holds the logged fp32 values; identical strings = identical bits.
    assert {s: full[s] for s in again} == again


def _train_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_cli", TRAIN)
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train  # its dataclasses look their module up there
    spec.loader.exec_module(train)
    return train


def test_print_config_loads_back(tmp_path, capsys):
    """--print_config: the whole resolved config, which --config reads back to the same options."""
    from longctx.lightning.cli_settings import flatten

    train = _train_module()
    argv = [
        "--config",
        "configs/gpt-125m.yaml",
        "--context-parallel",
        "4",
        "--model.model.n_layer",
        "3",
        "--model.parallel.activation_checkpointing",
        "selective",
        "--strategy.timeout",
        "0:07:30",
        "--failure-timeout",
        "null",
        "--data.include_tests",
        "false",
        "--val-every",
        "7",
    ]
    with pytest.raises(SystemExit) as stop:
        train.resolve_config([*argv, "--print_config"])
    assert stop.value.code == 0
    printed = capsys.readouterr().out
    dumped = tmp_path / "printed.yaml"
    dumped.write_text(printed)
    direct = flatten(train.resolve_config(argv).config)
    loaded = flatten(train.resolve_config(["--config", str(dumped)]).config)
    assert {k: v for k, v in loaded.items() if k != "config"} == {k: v for k, v in direct.items() if k != "config"}
    assert direct["strategy.context_parallel_size"] == 4 and direct["model.model.n_layer"] == 3
    assert direct["strategy.failure_timeout"] is None  # a null that differs from the default survives
    assert yaml.safe_load(printed)["model"]["model"] == {"preset": "gpt-125m", "vocab_size": 32768, "n_layer": 3}


def test_option_from_a_class_signature_reaches_the_module():
    """Options without a short flag come from the classes' signatures: defaults are theirs."""
    import inspect

    from longctx.lightning.module import CausalLMModule

    train = _train_module()
    cfg = train.resolve_config(["--model.weight_decay", "0.05", "--model.betas", "[0.8, 0.9]"]).config
    module = CausalLMModule(**cfg.model.as_dict())
    assert module.hparams.weight_decay == 0.05 and tuple(module.hparams.betas) == (0.8, 0.9)
    assert module.hparams.seq_len == 512  # linked from data.seq_len (configs/tiny-cpu.yaml)
    default = train.resolve_config([]).config
    assert default.model.eps == inspect.signature(CausalLMModule.__init__).parameters["eps"].default


@pytest.mark.slow
def test_checkpoint_of_another_shape_is_refused(full_run):
    from longctx.lightning.module import CausalLMModule

    out, _ = full_run
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    same = CausalLMModule(ckpt["hyper_parameters"]["model"])
    same.on_load_checkpoint(ckpt)  # same shape: accepted
    other = CausalLMModule({**ckpt["hyper_parameters"]["model"], "n_layer": 3})
    with pytest.raises(ValueError, match="different model shape .*n_layer: checkpoint 2 vs model 3"):
        other.on_load_checkpoint(ckpt)


def test_lr_schedule():
    from longctx.lightning.module import lr_lambda

    f = lr_lambda(warmup_steps=2, decay_steps=10, min_lr_ratio=0.1)
    values = [f(s) for s in range(12)]
    assert values[:3] == [0.5, 1.0, 1.0]  # linear warmup, then the cosine starts at the peak
    assert all(a > b for a, b in zip(values[2:10], values[3:11]))  # decays to the floor...
    assert values[10] == values[11] == pytest.approx(0.1)  # ...and stays there


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_resolves(path):
    """A config in configs/ with a misspelt or stale key would only fail on a GPU job."""
    from longctx.models import GPTConfig

    train = _train_module()
    from longctx.layouts import check_seq_len
    from longctx.lightning import ContextParallelStrategy, NonFiniteGuard
    from longctx.lightning.module import CausalLMModule
    from longctx.lightning.training import RunOptions

    cfg = train.resolve_config(["--config", str(path)]).config
    # Every value valid, as each class checks it (GPU presence and the world size aside).
    RunOptions(**cfg.run.as_dict())
    NonFiniteGuard(**cfg.nonfinite.as_dict())
    ContextParallelStrategy(**cfg.strategy.as_dict())
    if not cfg.model.init_from:  # a checkpoint file may be on the GPU machine only
        CausalLMModule.check_arguments(**cfg.model.as_dict())
    if cfg.strategy.context_parallel_size:
        check_seq_len(cfg.data.seq_len, cfg.strategy.context_parallel_size, cfg.strategy.layout)
    assert cfg.trainer.max_steps >= 1
    config = GPTConfig.from_dict(cfg.model.model)
    assert config.n_layer > 0


@pytest.mark.slow
def test_context_parallel_8_on_cpu(tmp_path, cache_env):
    """The headline command on a CPU machine: devices follow --context-parallel."""
    small_data = [
        "--data",
        "stdlib:json,email,http,logging,xml",
        "--model.model.vocab_size",
        "512",
        "--seq-len",
        "128",
        "--batch-size",
        "1",
        "--trainer.enable_progress_bar",
        "false",
    ]
    proc = _train(
        # Two steps and a one-batch validation: 8 processes share 2 cores in CI.
        [
            "--context-parallel",
            "8",
            "--max-steps",
            "2",
            "--run.val_batches",
            "1",
            *small_data,
            "--output-dir",
            str(tmp_path),
        ],
        cache_env,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "world 8 = dp 1 x cp 8" in proc.stdout
    assert sorted(_losses(tmp_path / "metrics.csv")) == [0, 1]


def test_one_peak_flops_table():
    """MFU in the training module and both benchmarks reads one table."""
    from longctx.bench.max_context_fit import attention_time_floor
    from longctx.hardware import peak_bf16_flops
    from longctx.models import GPTConfig

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756.0e12 and peak_bf16_flops("Tesla T4") is None
    cfg = GPTConfig.from_preset("tiny")  # max_context.py's attention-time floor
    pcie, sxm = (attention_time_floor(cfg, False, name) for name in ("NVIDIA H100 PCIe", "NVIDIA H100"))
    assert pcie == pytest.approx(sxm * 989.4 / 756.0) and attention_time_floor(cfg, False, "cpu") == 0.0
    assert "PEAK_BF16" not in (REPO / "benchmarks" / "train_throughput.py").read_text()


KILL_AFTER_SAVE = """
import os, runpy, signal, sys
from longctx.lightning import run_dir

save = run_dir.FinalCheckpoint.on_train_batch_end

def save_then_die(self, trainer, *args):
    save(self, trainer, *args)
    if trainer.global_step == {step}:  # the checkpoint is on disk; the step's metrics row is not
        os.kill(os.getpid(), signal.SIGKILL)

run_dir.FinalCheckpoint.on_train_batch_end = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_kill_right_after_a_checkpoint_then_resume_extending_the_moved_run(full_run, tmp_path, cache_env):
    """The run above again (same seed, CP=2), SIGKILLed between step 3's checkpoint save and
    its metrics row (Lightning logs the row after the save); its folder moved (its config.yaml
    still names the old place), then ``--resume RUN --max-steps 8``: the run's own config (only
    the override printed), the lr schedule kept (decay still ends at step 6), metrics.csv with
    one row per step over all 8, that step's included, and every loss of steps 0..5 equal to
    the uninterrupted run's, bit for bit (steps 0..2 from the second launch with the same seed,
    3..5 resumed); the summary names its val step. (One launch serves the kill and the
    extension: each resume is a train.py launch of two processes.)"""
    import shutil

    out = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_SAVE.format(step=3), str(TRAIN), *SMALL, "--output-dir", str(out)],
        cwd=REPO,
        env=cache_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    with open(out / "logs" / "version_0" / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [0, 1]  # step 2's row died with the process
    run = tmp_path / "moved"
    shutil.move(out, run)
    proc = _train(["--resume", str(run), "--max-steps", "8"], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "overridden here: trainer.max_steps 6 -> 8" in proc.stdout and "keeps ending at step 6" in proc.stdout
    with open(run / "metrics.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == list(range(8)), steps
    losses = _losses(run / "metrics.csv")
    # Exact: the CSV holds the logged fp32 values; identical strings = identical bits.
    assert {s: losses[s] for s in range(6)} == _losses(full_run[0] / "metrics.csv")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["run"]["output_dir"] == str(run) and cfg["trainer"]["max_steps"] == 8
    assert cfg["model"]["decay_steps"] == 6 and cfg["model"]["lr"] == 3e-3 and cfg["model"]["warmup_steps"] == 2
    with open(run / "metrics.csv", newline="") as f:
        last_val = [r for r in csv.DictReader(f) if r["val_loss"]][-1]
    assert f"val loss {float(last_val['val_loss']):.3f} at step {last_val['step']}" in proc.stdout
    assert "train loss " + f"{float(losses[0]):.3f}" in proc.stdout  # the summary starts at step 0


def test_metrics_csv_has_one_row_per_step_over_launches(tmp_path):
    """flatten_metrics: a step's training and validation rows become one; a later launch's rows
    replace the earlier ones from its first step on (redone steps: replaced, not duplicated),
    the validation logged at that first step (after the checkpoint's save) kept; a line a kill
    cut short replaced with the rest."""
    from longctx.lightning.run_dir import flatten_metrics

    logs = tmp_path / "logs"
    for version, text in {
        0: "step,epoch,train_loss,val_loss\n0,0,9.0,\n1,0,8.0,\n1,0,,7.5\n2,0,7.0,\n3,0,6.0,\n3,0,,5.5\n"
        "4,0,5.0,\n5,0,4",  # killed while writing step 5's row
        1: "step,epoch,train_loss,val_loss\n3,0,6.0,\n4,0,4.9,\n5,0,4.1,\n5,0,,4.0\n",
    }.items():
        (logs / f"version_{version}").mkdir(parents=True)
        (logs / f"version_{version}" / "metrics.csv").write_text(text)
    rows = flatten_metrics(logs, logs / "version_1" / "metrics.csv", tmp_path / "metrics.csv", resumed=True)
    expected = [
        {"step": "0", "epoch": "0", "train_loss": "9.0"},
        {"step": "1", "epoch": "0", "train_loss": "8.0", "val_loss": "7.5"},
        {"step": "2", "epoch": "0", "train_loss": "7.0"},
        {"step": "3", "epoch": "0", "train_loss": "6.0", "val_loss": "5.5"},
        {"step": "4", "epoch": "0", "train_loss": "4.9"},
        {"step": "5", "epoch": "0", "train_loss": "4.1", "val_loss": "4.0"},
    ]
    assert rows == expected
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert [{k: v for k, v in r.items() if v} for r in csv.DictReader(f)] == expected


def test_speed_line_gives_the_runs_medians_after_its_first_steps():
    """The summary's speed line: medians of tokens/s, step_s and MFU over steps 3.. (the first
    steps compile), the largest peak; the validation-only row and a step without a rate are
    not steps; a run of fewer steps gives what it has; no rate, no line."""
    from longctx.lightning.training import speed_line

    rows = [
        dict(step="0", tokens_per_s="", step_s="20.0", peak_mem_gib="40.0"),
        dict(step="1", tokens_per_s="100", step_s="9.0", mfu="0.10", peak_mem_gib="50.0"),
        dict(step="2", tokens_per_s="300", step_s="3.0", mfu="0.40", peak_mem_gib="51.5"),
        dict(step="3", tokens_per_s="200", step_s="4.0", mfu="0.30", peak_mem_gib="51.0"),
        dict(step="4", tokens_per_s="400", step_s="2.5", mfu="0.50", peak_mem_gib="51.0"),
        dict(step="4", val_loss="3.0"),
    ]
    assert speed_line(rows) == (
        "300 tokens/s, 3.00 s a step, MFU 40.0% (median of steps 3-5); peak GPU memory 51.5 GiB"
    )
    assert speed_line(rows[:2]) == "100 tokens/s, 9.00 s a step, MFU 10.0% (step 2); peak GPU memory 50.0 GiB"
    cpu = [dict(step="0", tokens_per_s="12.5", step_s="1.0", peak_rss_gib="1.25")]
    assert speed_line(cpu) == "12 tokens/s, 1.00 s a step (step 1); peak host memory 1.2 GiB"
    assert speed_line([dict(step="0", train_loss="2.0")]) is None
    # startup_s: each launch's rows carry its start-up; the summary gives the latest launch's
    launches = [dict(cpu[0], startup_s="40.25"), dict(cpu[0], step="1", startup_s="12.5")]
    assert speed_line(launches).endswith("; peak host memory 1.2 GiB; start-up 12.5 s")
