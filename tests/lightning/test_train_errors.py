"""Every bad input train.py can see is one line ``train.py: error: ...`` with rc 2, before
any data or tokenizer work (the corpus cache directory stays empty), in seconds.

Cases run in-process through ``train.main`` (imports paid once); one runs as a real
command to check the whole path, stderr included. jsonargparse's own errors (a value
of the wrong type, an unknown option or config key) are such lines too.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers.train_script import launch_env, load_train

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def train():
    module = load_train("train_cli_errors")
    module.resolve_config([])  # the one-time imports (torch, Lightning): timed in test_error_as_a_command
    return module


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(path))
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    return path


def _error(train, argv: list[str], capsys, cache: Path) -> str:
    start = time.monotonic()
    rc = train.main(argv)
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), err
    assert elapsed < 10, f"{argv}: {elapsed:.1f} s before the error"
    assert not any(cache.iterdir()), "data or tokenizer work started before the error"
    return lines[0]


CASES = [
    (["--layout", "diagonal"], "strategy.layout must be one of zigzag, contiguous, got 'diagonal'"),
    (
        ["--seq-len", "502"],
        "data: sequence length 502 cannot be split by layout 'zigzag' over P=2 ranks: it must be "
        "a positive multiple of 4 (2 x P); nearest valid: 500 or 504",
    ),
    (["--context-parallel", "3", "--devices", "2"], "strategy.context_parallel_size 3 does not divide the world of 2"),
    # Lightning's own check, said of the section whose object refused it.
    (["--trainer.devices", "0"], "trainer: `Trainer(devices=0)` value is not a valid input using cpu accelerator"),
    # On CPU devices follow --context-parallel: CP 3 is fine, the default 512 tokens are not.
    (["--context-parallel", "3"], "by layout 'zigzag' over P=3 ranks: it must be a positive multiple of 6"),
    (["--accumulate-grad-batches", "0"], 'Parser key "trainer.accumulate_grad_batches": Not of type PositiveInt: 0'),
    (["--strategy.timeout", "0:00:00"], "strategy.timeout must be > 0 (h:mm:ss), got 0:00:00"),
    (["--val-every", "-1"], "run.val_every must be an integer >= 0 (0: never"),
    (
        ["--failure-timeout", ".nan"],
        "strategy.failure_timeout must be a number > 0 seconds (null: no watchdog), got nan",
    ),
    (["--lr", ".inf"], "model.lr must be a number > 0, got inf"),
    (["--lr", "-1"], "model.lr must be a number > 0, got -1.0"),
    (["--max-steps", "0"], 'Parser key "trainer.max_steps": Not of type PositiveInt: 0'),
    (["--model.min_lr_ratio", "2"], "model.min_lr_ratio must be a number in [0, 1], got 2.0"),
    (["--init-from", "nowhere/model"], "model.init_from nowhere/model: no such file or directory"),
    (["--run.keep_checkpoints", "2"], "run.keep_checkpoints must be one of -1, 0, 1, got 2"),
    # The evaluation's lengths against the training length and the CP layout (the needle: once
    # the tokenizer exists, tests/lightning/test_eval_during_training.py).
    (
        ["--eval-every", "10", "--eval.lengths", "[256, 510]"],
        "eval.lengths [256, 510]: sequence length 510 cannot be split by layout 'zigzag' over P=2 ranks",
    ),
    (["--eval-every", "10", "--eval.lengths", "[1024]"], "passkey length 1024 is longer than the training length 512"),
    (["--data-parallel", "zero3"], "strategy.data_parallel must be one of auto, fsdp, ddp, got 'zero3'"),
    (["--nonfinite.policy", "never"], "nonfinite.policy must be one of skip, stop, got 'never'"),
    (["--model.model.n_layers", "3"], "unknown GPTConfig key(s) ['n_layers']"),
    (["--model.parallel.cp_attention", "ulises"], "model.parallel.cp_attention must be one of"),
    (
        ["--model.parallel.activation_checkpointing", "full", "--model.parallel.checkpointed_blocks", "5"],
        "model.parallel.checkpointed_blocks must be at most the model's 2 blocks, got 5",
    ),
    (
        ["--model.parallel.checkpointed_blocks", "1"],
        "model.parallel.checkpointed_blocks needs activation_checkpointing 'selective' or 'full'",
    ),
    # jsonargparse's own: the option, what it takes, the value given.
    (["--precision", "bf15"], 'Parser key "trainer.precision": expected ['),
    (["--failure-timeout", "soon"], "Parser key \"strategy.failure_timeout\": expected [<class 'float'>"),
    (["--lr", "fast"], "Parser key \"model.lr\": Expected a <class 'float'>. Got value: fast"),
    (["--sequence-length", "64"], "unrecognized arguments: --sequence-length 64"),
    (["--config", "configs/no-such.yaml"], "no-such.yaml"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line(train, capsys, cache, argv, message):
    assert message in _error(train, argv, capsys, cache)


def test_missing_accelerator(train, capsys, cache):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert "needs a CUDA GPU and none is visible" in _error(train, ["--accelerator", "gpu"], capsys, cache)
    gpu_config = str(REPO / "configs" / "gpt-125m.yaml")
    line = _error(train, ["--config", gpu_config, "--accelerator", "gpu"], capsys, cache)
    assert "needs a CUDA GPU" in line


def test_gguf_without_the_optional_package(train, capsys, cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    line = _error(train, ["--init-from", "x.gguf"], capsys, cache)
    assert "needs the optional 'gguf' package: pip install 'longctx[gguf]'" in line


def _tiny_gguf(path: Path) -> Path:
    pytest.importorskip("gguf")
    from test_checkpoint_import import QTYPES, random_llama, tiny_vocab, write_llama_gguf

    write_llama_gguf(path, random_llama(vocab_size=len(tiny_vocab()[0])), QTYPES)
    return path


def test_init_from_a_checkpoint_of_another_shape_or_a_damaged_one(train, capsys, cache, tmp_path):
    """--init-from is checked before the tokenizer and the data: a checkpoint whose sizes are not
    the config's (the default config's tiny preset) names each differing field and what to pass;
    a truncated one names the file."""
    gguf = _tiny_gguf(tmp_path / "tiny.gguf")
    line = _error(train, ["--init-from", str(gguf)], capsys, cache)
    assert line.startswith(f"train.py: error: model.init_from {gguf}: the checkpoint's shape differs from the config")
    assert "vocab_size 264 (config: 4096, preset tiny)" in line and "n_embd 64 (config: 128, preset tiny)" in line
    assert line.endswith("; pass --preset null to take the checkpoint's own sizes")
    line = _error(train, ["--init-from", str(gguf), "--preset", "null", "--model.model.n_layer", "3"], capsys, cache)
    assert "n_layer 2 (config: 3, given)" in line and "and drop --model.model.n_layer" in line
    gguf.write_bytes(gguf.read_bytes()[:5000])
    line = _error(train, ["--init-from", str(gguf), "--preset", "null"], capsys, cache)
    assert line.startswith(f"train.py: error: {gguf} is damaged or not a GGUF file (")


def test_init_from_a_checkpoint_with_flipped_bytes(train, capsys, cache, tmp_path):
    """Flipped bytes in a GGUF's tensor data show only in the values, read with the model (after
    the data work): still one line naming the file and the tensor, exit code 2, no training."""
    pytest.importorskip("tokenizers")
    gguf = _tiny_gguf(tmp_path / "tiny.gguf")
    data = bytearray(gguf.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    gguf.write_bytes(bytes(data))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(" ".join(f"the {j} then" for j in range(400 * i, 400 * i + 400)))
    argv = ["--init-from", str(gguf), "--preset", "null", "--data", str(corpus), "--seq-len", "64"]
    rc = train.main([*argv, "--batch-size", "1", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train.py: ")]  # not the progress bars
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"train.py: error: model: {gguf} is damaged: tensor ") and "holds a value of" in lines[0]
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_resume_of_a_file_that_is_not_a_safe_checkpoint(train, capsys, cache, tmp_path):
    """--resume FILE on a pickle that a weights_only load refuses: one line, and its code never runs."""

    class Payload:
        def __reduce__(self):
            return os.makedirs, (str(tmp_path / "payload-ran"),)

    evil = tmp_path / "evil.ckpt"
    torch.save({"global_step": 1, "state_dict": {}, "x": Payload()}, evil)
    line = _error(train, ["--resume", str(evil)], capsys, cache)
    assert line == (
        f"train.py: error: --resume path {evil} is not a checkpoint that loads as data only (unsupported GLOBAL "
        "os.makedirs whose module os is blocked); a pickle that needs more can run code, so it is not loaded: "
        "resume from a checkpoint train.py wrote"
    )
    assert not (tmp_path / "payload-ran").exists()


def test_unknown_key_in_a_config_file(train, capsys, cache, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  seq_len: 64\n  sequence_length: 128\n")
    line = _error(train, ["--config", str(bad)], capsys, cache)
    assert "'data' does not accept option 'sequence_length'" in line
    bad.write_text("seq_len: 64\nmax_steps: 3\n")  # the flat shape of configs before the CLI
    line = _error(train, ["--config", str(bad)], capsys, cache)
    assert f"config {bad}: unknown top-level key(s) ['max_steps', 'seq_len']; a config has the sections" in line


def _finished_run(train, tmp_path: Path, step: int, max_steps: int) -> Path:
    """A run directory as train.py leaves it: config.yaml and a checkpoint at ``step``."""
    run = tmp_path / "run"
    resolved = train.resolve_config(
        ["--max-steps", str(max_steps), "--decay-steps", str(max_steps), "--devices", "2", "--output-dir", str(run)]
    )
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(resolved.dump())
    torch.save({"global_step": step, "state_dict": {}}, run / "checkpoints" / "last.ckpt")
    return run


def test_resume_of_a_finished_run(train, capsys, cache, tmp_path):
    run = _finished_run(train, tmp_path, step=6, max_steps=6)
    before = (run / "config.yaml").read_text()
    line = _error(train, ["--resume", str(run)], capsys, cache)
    assert "that run already finished (step 6 of --max-steps 6)" in line
    assert "pass --max-steps N with N > 6" in line and "--decay-steps" in line
    # A shape change on resume is refused before anything starts; config.yaml stays as it was.
    line = _error(train, ["--resume", str(run), "--max-steps", "8", "--model.model.n_layer", "3"], capsys, cache)
    assert "another model shape" in line and "n_layer None -> 3" in line
    assert (run / "config.yaml").read_text() == before


def test_resume_with_other_data_tokenizer_or_model_settings_is_refused(train, capsys, cache, tmp_path):
    """--resume with a flag that changes what the run trains on (the corpus, the tokenizer, the
    split) or what its model computes: one line naming each difference, before any data work;
    steps, cadence, lr and the parallel layout are applied (said once, on rank 0)."""
    run = _finished_run(train, tmp_path, step=3, max_steps=6)
    argv = ["--resume", str(run), "--data.vocab_size", "2048", "--data", "stdlib:json"]
    argv += ["--model.model.rope_theta", "5e5"]
    line = _error(train, argv, capsys, cache)
    assert "the run was trained with other data, tokenizer or model settings than asked for here (" in line
    assert "data.vocab_size 8192 -> 2048" in line and "data.data_path None -> 'stdlib:json'" in line
    assert "model.model.rope_theta None -> 500000.0" in line and "drop those flags" in line
    assert "another --output-dir" in line
    for flags in (["--attention", "causal"], ["--tokenizer", str(run / "config.yaml")], ["--seed", "7"]):
        assert "other data, tokenizer or model settings" in _error(train, ["--resume", str(run), *flags], capsys, cache)
    safe = ["--max-steps", "9", "--val-every", "2", "--lr", "1e-3", "--model.parallel.activation_checkpointing", "full"]
    resolved = train.prepare(["--resume", str(run), *safe, "--seq-len", "128"], device_checks=False)
    out = capsys.readouterr().out
    assert resolved.config.trainer.max_steps == 9 and resolved.config.data.seq_len == 128
    assert out.count("overridden here: ") == 1 and "run.val_every 50 -> 2" in out
    assert "data.seq_len changed" in out


def test_resume_of_a_checkpoint_with_nan_weights(train, capsys, cache, tmp_path):
    """NaN in a checkpoint's weights: refused before anything starts, naming the tensor that
    holds it (not another one the non-finite guard meets later) and an earlier checkpoint."""
    run = _finished_run(train, tmp_path, step=4, max_steps=6)
    weights = {"model.embed.weight": torch.randn(8, 4), "model.blocks.1.mlp.up_proj.weight": torch.randn(4, 4)}
    torch.save({"global_step": 2, "state_dict": weights}, run / "checkpoints" / "step000002.ckpt")
    weights["model.blocks.1.mlp.up_proj.weight"][1, 2:] = float("nan")
    torch.save({"global_step": 4, "state_dict": weights}, run / "checkpoints" / "last.ckpt")
    line = _error(train, ["--resume", str(run)], capsys, cache)
    assert line == (
        f"train.py: error: --resume {run / 'checkpoints' / 'last.ckpt'}: the checkpoint (step 4) holds NaN/Inf in "
        "state_dict['model.blocks.1.mlp.up_proj.weight'] (2 of 16 values), so training on from it gives NaN: "
        f"resume from a checkpoint saved before the values broke (--resume {run / 'checkpoints' / 'step000002.ckpt'}) "
        "(a lower --lr, or --nonfinite.policy skip, may keep them finite)"
    )


def test_resume_reads_the_runs_config(train, tmp_path, cache, capsys):
    run = _finished_run(train, tmp_path, step=3, max_steps=6)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["model"].update(lr=1e-3, warmup_steps=4)
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    resolved = train.resolve_config(["--resume", str(run), "--max-steps", "9"])
    cfg = resolved.config
    # Flags not repeated keep the run's values (not the CPU defaults); the one given is an override.
    assert cfg.model.lr == 1e-3 and cfg.model.warmup_steps == 4 and cfg.run.output_dir == str(run)
    assert resolved.overrides == {"trainer.max_steps": (6, 9)}
    assert cfg.model.decay_steps == 6  # the schedule is the run's unless --decay-steps says otherwise
    resolved.check_resume()
    out = capsys.readouterr().out
    assert "overridden here: trainer.max_steps 6 -> 9" in out and "keeps ending at step 6" in out
    stretched = train.resolve_config(["--resume", str(run), "--max-steps", "9", "--decay-steps", "9"])
    assert stretched.config.model.decay_steps == 9


def test_second_run_on_the_same_output_dir(train, capsys, cache, tmp_path):
    from longctx.lightning.run_dir import lock_run_dir

    out = tmp_path / "shared"
    held = lock_run_dir(out)  # a first run holding the folder
    try:
        line = _error(train, ["--output-dir", str(out)], capsys, cache)
        assert f"output dir {out} is in use by another run (pid {os.getpid()})" in line
    finally:
        held.close()
    lock_run_dir(out).close()  # released with its process: the folder is free again


def test_a_new_run_never_writes_into_another_runs_folder(train, capsys, cache, tmp_path):
    """A fresh run (no --resume) pointed at a folder that holds a run is refused, before any
    data work, naming the folder and both ways out; the run there is left as it was."""
    run = _finished_run(train, tmp_path, step=3, max_steps=6)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    line = _error(train, ["--output-dir", str(run), "--max-steps", "3"], capsys, cache)
    assert line == (
        f"train.py: error: run.output_dir {run} already holds a run (config.yaml, checkpoints/); a new run "
        f"there would overwrite it: continue it with --resume {run}, or pass another --output-dir"
    )
    # Resuming another run into it is the same mix.
    other = _finished_run(train, tmp_path / "other", step=3, max_steps=6)
    line = _error(train, ["--resume", str(other), "--output-dir", str(run)], capsys, cache)
    assert f"run.output_dir {run} already holds a run" in line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # An empty folder, or one a refused run only locked, holds no run.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".run.lock").write_text("1")
    assert train.prepare(["--output-dir", str(tmp_path / "empty")], device_checks=False).out == tmp_path / "empty"


def test_the_default_output_folder_moves_on_to_a_fresh_one(train, capsys, cache, tmp_path, monkeypatch):
    """A second plain `python train.py` (default folder runs/tiny-cpu) writes to runs/tiny-cpu-2,
    said once, instead of overwriting the first run; --resume runs/tiny-cpu continues the first."""
    monkeypatch.chdir(tmp_path)
    assert train.prepare([], device_checks=False).out == Path("runs/tiny-cpu")
    assert capsys.readouterr().out == ""
    for name in ("tiny-cpu", "tiny-cpu-2"):
        (tmp_path / "runs" / name / "logs" / "version_0").mkdir(parents=True)
        second = train.prepare([], device_checks=False)
        assert second.out == Path(f"runs/{name}-2" if name == "tiny-cpu" else "runs/tiny-cpu-3")
        assert capsys.readouterr().out == (
            f"output: runs/tiny-cpu holds an earlier run, so this one writes to {second.out} "
            "(--resume runs/tiny-cpu continues that one; --output-dir DIR picks the folder)\n"
        )


def test_output_dir_that_cannot_be_written(train, capsys, cache, tmp_path):
    """An --output-dir under a file, a file itself, or in a folder this user may not write:
    one line naming the folder and why, exit code 2, before any data work."""
    file = tmp_path / "notes.txt"
    file.write_text("x")
    line = _error(train, ["--output-dir", str(file / "run")], capsys, cache)
    assert line == (
        f"train.py: error: run.output_dir {file / 'run'} cannot be written ({file} is a file, not a folder); "
        "pass a writable --output-dir"
    )
    line = _error(train, ["--output-dir", str(file)], capsys, cache)
    assert f"run.output_dir {file} cannot be written ({file} is a file, not a folder)" in line
    if Path("/sys/kernel").is_dir():  # sysfs refuses new folders even to root
        line = _error(train, ["--output-dir", "/sys/longctx-run"], capsys, cache)
        assert "run.output_dir /sys/longctx-run cannot be written (Operation not permitted: /sys/longctx-run)" in line
    if os.geteuid() != 0:  # root writes into read-only folders
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        line = _error(train, ["--output-dir", str(locked / "run")], capsys, cache)
        assert f"run.output_dir {locked / 'run'} cannot be written (Permission denied" in line


def test_corpus_too_small_for_one_batch_with_a_given_tokenizer(train, capsys, cache, tmp_path):
    """A tokenizer given (nothing to train) and a corpus that makes no full batch: one line with
    exit code 2 once the corpus is tokenized, before any process starts (not a traceback per rank)."""
    from longctx.data.tokenizer import SentencePieceTokenizer

    lines = [f"def f{i}(x):\n    return x + {i}\n" for i in range(300)]
    model = tmp_path / "tok.model"
    SentencePieceTokenizer.train(lines, vocab_size=300).save(model)
    corpus = tmp_path / "small.txt"
    corpus.write_text("".join(lines[:20]))
    rc = train.main(["--data", str(corpus), "--tokenizer", str(model), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train.py: ")]  # not the progress bars
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("train.py: error: data: the training split is smaller than one global batch: ")
    assert "batch_size 8 x data-parallel size 1 = 8" in lines[0]


def test_ctrl_c_before_training_is_one_line(train, capsys, cache, tmp_path, monkeypatch):
    """Ctrl-C while the corpus is prepared (before the run's own handler exists): one line and
    exit code 130, not a KeyboardInterrupt traceback."""
    from longctx.data import LongDocumentDataModule

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(LongDocumentDataModule, "prepare_data", interrupted)
    rc = train.main(["--output-dir", str(tmp_path / "out")])
    assert rc == 130
    assert capsys.readouterr().err.strip().splitlines() == ["train.py: stopped by Ctrl-C before training started"]


def test_error_as_a_command(tmp_path):
    """The whole path as a user runs it: rc 2 and a single stderr line, imports included
    (~7 s on an idle 2-core machine; the bound leaves room for a CI that shares its cores)."""
    env = launch_env(tmp_path)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--context-parallel", "3", "--devices", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - start < 30
    assert proc.returncode == 2 and proc.stdout == "" and not any(tmp_path.iterdir())
    assert proc.stderr.strip().splitlines() == [
        "train.py: error: strategy.context_parallel_size 3 does not divide the world of 2 processes "
        "(2 devices x 1 nodes); use a CP size that divides it, or a number of processes that is a multiple of 3 "
        "(data-parallel size = world size / CP size)"
    ]


def test_corpus_of_one_huge_line(train, capsys, cache, tmp_path):
    """Found only by training the tokenizer, but still one line with rc 2 that says why."""
    corpus = tmp_path / "one-line.txt"
    corpus.write_text(" ".join(f"w{i % 997}" for i in range(8000)))  # ~45 KB, no newline
    rc = train.main(["--data", str(corpus), "--model.model.vocab_size", "300", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("train.py: error: data: SentencePiece training failed") and "one huge line" in err[0]
