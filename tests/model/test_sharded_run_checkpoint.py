"""A train.py run checkpoint may be a sharded ``.ckpt`` folder (FSDP2, the default on GPUs):
evaluate.py --checkpoint, train.py --init-from and longctx.models read its model weights (and
only those: never the optimizer state) in one process, verified against its manifest; a run
folder stands for checkpoints/last.ckpt, else its newest intact step*.ckpt; what cannot be
loaded is one line naming the problem (not a tokenizer library's complaint).

Fast: folders written in this process by checkpoint_io's writer around a tiny GPT. Slow: a real
train.py run with --data-parallel fsdp on CPU, evaluated and fine-tuned from.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers.train_script import TINY, clear_rendezvous, launch_env, run_train

from longctx.models import GPT, GPTConfig, load_pretrained
from longctx.models.checkpoint_import import DamagedCheckpointError, pretrained_config
from longctx.models.run_checkpoint import load_run_checkpoint, resolve_run_checkpoint

REPO = Path(__file__).resolve().parents[2]
CONFIG = GPTConfig(vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", REPO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIG)


def _save_sharded(path: Path, model: GPT, step: int) -> None:
    """What an FSDP2 run's ModelCheckpoint writes (save_training_state): Lightning's dict with
    the module's ``model.`` prefix, an optimizer state beside it."""
    from longctx.lightning.checkpoint_io import save_training_state

    weights = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    moments = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for k, v in weights.items()}
    checkpoint = {
        "state_dict": weights,
        "optimizer_states": [{"state": moments}],
        "global_step": step,
        "hyper_parameters": {"model": model.config.to_dict(), "lr": 1e-3},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: no process group, one process
        save_training_state(path, checkpoint)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_folder_gives_the_model_weights_and_reads_no_optimizer_state(tmp_path, monkeypatch):
    from longctx import checkpoint_verify

    model = _model(0)
    folder = tmp_path / "checkpoints" / "step000003.ckpt"
    _save_sharded(folder, model, 3)
    read: list[str] = []
    original = checkpoint_verify.SafeFileSystemReader.read_data

    def spy(self, plan, planner):
        read.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(checkpoint_verify.SafeFileSystemReader, "read_data", spy)
    config, state = load_run_checkpoint(folder)
    assert config == model.config and _same(state, model.state_dict())
    assert read and all(name.startswith("state_dict.model.") for name in read), read
    assert pretrained_config(folder) == model.config
    loaded = load_pretrained(folder).eval()
    ids = torch.randint(0, CONFIG.vocab_size, (1, 16))
    assert torch.equal(loaded(ids), model.eval()(ids))


def test_reading_a_sharded_folder_imports_no_lightning(tmp_path):
    folder = tmp_path / "step000001.ckpt"
    _save_sharded(folder, _model(0), 1)
    code = (
        "import sys\nfrom longctx.models.run_checkpoint import load_run_checkpoint\n"
        f"config, state = load_run_checkpoint({str(folder)!r})\n"
        "assert len(state) == 20 and 'lightning' not in sys.modules, sorted(sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_run_folder_stands_for_last_else_the_newest_intact_step(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\n")
    older, newer = _model(1), _model(2)
    _save_sharded(run / "checkpoints" / "step000003.ckpt", older, 3)
    _save_sharded(run / "checkpoints" / "step000010.ckpt", newer, 10)
    # A single file among them, ordered by the step stored in it, not by its name.
    single = {f"model.{k}": v for k, v in _model(3).state_dict().items()}
    torch.save(
        {"global_step": 7, "state_dict": single, "hyper_parameters": {"model": CONFIG.to_dict()}},
        run / "checkpoints" / "step000099.ckpt",
    )
    for spec in (run, run / "checkpoints"):
        assert resolve_run_checkpoint(spec) == run / "checkpoints" / "step000010.ckpt"
    assert _same(load_run_checkpoint(run)[1], newer.state_dict())
    # The newest damaged: the next newest (a file here), with a warning naming the skipped one.
    (run / "checkpoints" / "step000010.ckpt" / "__0_0.distcp").unlink()
    with pytest.warns(UserWarning, match=r"skipped .*step000010\.ckpt/__0_0\.distcp is missing"):
        assert resolve_run_checkpoint(run) == run / "checkpoints" / "step000099.ckpt"
    # last.ckpt (a sharded folder here) wins whatever the steps.
    _save_sharded(run / "checkpoints" / "last.ckpt", older, 4)
    assert resolve_run_checkpoint(run) == run / "checkpoints" / "last.ckpt"
    assert _same(load_run_checkpoint(run)[1], older.state_dict())


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_what_cannot_be_loaded_is_one_line(tmp_path, capsys, monkeypatch):
    clear_rendezvous(monkeypatch)
    evaluate_py, train_py = _script("evaluate"), _script("train")
    empty = tmp_path / "empty"
    empty.mkdir()
    no_checkpoint = tmp_path / "run-without-checkpoint"
    (no_checkpoint / "checkpoints").mkdir(parents=True)
    (no_checkpoint / "config.yaml").write_text("model: {}\n")
    damaged = tmp_path / "run" / "checkpoints" / "step000002.ckpt"
    _save_sharded(damaged, _model(0), 2)
    (damaged.parent.parent / "config.yaml").write_text("model: {}\n")
    shard = damaged / "__0_0.distcp"
    cases = [
        (empty, f"{empty} is neither a train.py run folder"),
        (no_checkpoint, f"{no_checkpoint} holds no checkpoint to load"),
    ]
    for spec, said in cases:
        assert evaluate_py.main(["--checkpoint", str(spec), "--lengths", "64", "--out", str(tmp_path / "e")]) == 2
        err = _one_line_error(capsys)
        assert err.startswith(f"evaluate.py: error: {said}"), err
        assert "sentencepiece" not in err and "instantiate" not in err, err  # not AutoTokenizer's guess
        assert train_py.main([*TINY, "--init-from", str(spec), "--output-dir", str(tmp_path / "t")]) == 2
        err = _one_line_error(capsys)
        assert err.startswith("train.py: error: ") and str(spec) in err and ("neither" in err or "holds no" in err), err

    # A damaged folder: the bad file named, by evaluate.py and by the loader.
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated
    assert evaluate_py.main(["--checkpoint", str(damaged), "--lengths", "64"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("evaluate.py: error: sharded checkpoint") and f"{shard} has " in err, err
    with pytest.raises(DamagedCheckpointError, match="holds no intact checkpoint.*__0_0.distcp has"):
        load_run_checkpoint(damaged.parent.parent)
    (damaged / "manifest.json").write_text("{")
    with pytest.raises(DamagedCheckpointError, match=r"manifest\.json is unreadable"):
        load_run_checkpoint(damaged)
    shutil.rmtree(damaged)
    _save_sharded(damaged, _model(0), 2)
    (damaged / "__0_0.distcp").unlink()
    with pytest.raises(DamagedCheckpointError, match=r"__0_0\.distcp is missing \(the manifest lists it\)"):
        load_run_checkpoint(damaged)


# ---- a real FSDP2 run of train.py (CPU, one process) -----------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return launch_env(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, env) -> dict:
    """A train.py run whose only checkpoint is a sharded step folder (the reported case), and
    the same weights as a single-file run checkpoint (consolidated by the reader that reads
    the whole folder, checkpoint_io.consolidate_checkpoint)."""
    from longctx.lightning.checkpoint_io import consolidate_checkpoint

    run = tmp_path_factory.mktemp("fsdp-run")
    args = [*TINY, "--data-parallel", "fsdp", "--max-steps", "2", "--checkpoint-every", "2"]
    proc = run_train([*args, "--output-dir", str(run)], env, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    step = run / "checkpoints" / "step000002.ckpt"
    assert step.is_dir() and (step / "manifest.json").is_file()
    shutil.rmtree(run / "checkpoints" / "last.ckpt", ignore_errors=True)
    whole = tmp_path_factory.mktemp("whole") / "whole.pt"
    consolidate_checkpoint(step, whole)
    full = torch.load(whole, weights_only=True)
    single = tmp_path_factory.mktemp("single-file-run")
    shutil.copy(run / "config.yaml", single / "config.yaml")
    (single / "checkpoints").mkdir()
    ckpt = {"global_step": 2, "hyper_parameters": full["metadata"]["hyper_parameters"]}
    torch.save({**ckpt, "state_dict": full["state"]["state_dict"]}, single / "checkpoints" / "last.ckpt")
    return {"run": run, "step": step, "single": single / "checkpoints" / "last.ckpt"}


@pytest.mark.slow
def test_evaluate_a_sharded_run_as_its_single_file_weights(fsdp_run, env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", env["LONGCTX_CACHE_DIR"])
    clear_rendezvous(monkeypatch)
    config, sharded = load_run_checkpoint(fsdp_run["run"])
    assert config.n_embd == 128 and _same(sharded, load_run_checkpoint(fsdp_run["single"])[1])
    evaluate_py = _script("evaluate")
    common = ["--lengths", "128", "--depths", "0,1", "--trials", "2", "--data", "stdlib:json"]
    common += ["--max-sequences", "2", "--dtype", "fp64", "--device", "cpu"]  # bit-equal numbers: one device
    records = []
    for i, spec in enumerate((fsdp_run["run"], fsdp_run["step"], fsdp_run["single"])):
        rc = evaluate_py.main(["--checkpoint", str(spec), "--out", str(tmp_path / str(i)), *common])
        assert rc == 0, capsys.readouterr().err
        records.append(json.loads((tmp_path / str(i) / "eval.json").read_text()))

    def numbers(record: dict) -> tuple:
        table = record["passkey"]
        buckets = [r["buckets"] for r in record["loss_by_position"]["results"]]
        return table["logprob"], table["accuracy"], buckets

    assert all(-30 < lp < 0 for row in records[0]["passkey"]["logprob"] for lp in row)
    for record in records[1:]:
        assert numbers(record) == numbers(records[0])  # the same fp64 weights: the same numbers


@pytest.mark.slow
def test_init_from_a_sharded_run_starts_from_its_weights(fsdp_run, env, tmp_path):
    _, before = load_run_checkpoint(fsdp_run["run"])
    out = tmp_path / "finetuned"
    args = [*TINY, "--init-from", str(fsdp_run["run"]), "--max-steps", "1", "--checkpoint-every", "1"]
    proc = run_train([*args, "--output-dir", str(out)], env, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    _, after = load_run_checkpoint(out)
    # One AdamW step of lr 2e-3 from the run's weights moves each by about the lr; a fresh
    # init (std 0.02) would differ by far more.
    w0, w1 = before["embed.weight"], after["embed.weight"]
    assert 0 < (w1 - w0).abs().max() < 1e-2 and w0.std() > 0.01
