"""train.py --eval-every N: the long-context evaluation (longctx.lightning.eval_callback) during
training, over the run's CP group.

* end to end on CPU, CP=2 over gloo, the tiny preset: passkey and loss-by-position columns in
  metrics.csv at the evaluated steps only, one JSON per evaluation in the run's eval/, the
  ``eval`` section in config.yaml, the callback's last step in the checkpoint; a resume goes on
  evaluating without repeating the checkpoint's step;
* lengths that cannot run (one the CP layout does not split, one shorter than the needle, one
  over the training length) are one ``train.py: error: eval.lengths ...`` line, rc 2, before
  any process starts (the needle's once the tokenizer exists, the others before any data work:
  tests/lightning/test_train_errors.py): the line the callback raises from Python, with the
  section in front.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.train_script import clear_rendezvous, launch_env, load_train

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--data",
    "stdlib:json,email",
    "--preset",
    "tiny",
    "--model.model.vocab_size",
    "512",
    "--seq-len",
    "256",
    "--batch-size",
    "1",
    "--context-parallel",
    "2",
    "--devices",
    "2",
    "--accelerator",
    "cpu",
    "--val-every",
    "0",
    "--trainer.enable_progress_bar",
    "false",
]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory) -> dict:
    return launch_env(tmp_path_factory.mktemp("cache"))


def _train(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=500
    )


def _rows(run: Path) -> dict[int, dict]:
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, cache_env) -> Path:
    """4 steps of 2 micro-batches, evaluated every 2 steps; checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("eval-run")
    args = [*TINY, "--max-steps", "4", "--accumulate-grad-batches", "2", "--eval-every", "2"]
    args += ["--eval.trials", "1", "--checkpoint-every", "2", "--run.keep_checkpoints", "-1"]
    proc = _train([*args, "--output-dir", str(run)], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "eval: every 2 steps: passkey at lengths [256] x depths [0.0, 0.5, 1.0] (1 key each)" in proc.stdout
    return run


@pytest.mark.slow
def test_evaluation_beside_the_loss_with_context_parallelism(eval_run):
    rows = _rows(eval_run)
    assert sorted(rows) == [0, 1, 2, 3] and all(rows[s]["train_loss"] for s in rows)
    # The rows of the steps whose updates gave the evaluated weights (steps 2 and 4 done).
    evaluated = [s for s, r in rows.items() if r["passkey_acc"]]
    assert evaluated == [1, 3]
    for step in evaluated:
        record = json.loads((eval_run / "eval" / f"step{step + 1:06d}.json").read_text())
        table, loss = record["passkey"], record["loss_by_position"]
        assert record["step"] == step + 1 and table["lengths"] == [256] and len(table["samples"]) == 3
        assert float(rows[step]["passkey_logprob"]) == pytest.approx(
            sum(s["logprob"] for s in table["samples"]) / 3, rel=1e-6
        )
        assert [b["hi"] for b in loss["buckets"]] == [64, 128, 192, 256] and loss["n_windows"] == 2
        for q, bucket in enumerate(loss["buckets"], 1):
            assert float(rows[step][f"pos_loss_q{q}"]) == pytest.approx(bucket["loss"], rel=1e-6)
    assert sorted(p.name for p in (eval_run / "eval").iterdir()) == ["step000002.json", "step000004.json"]
    cfg = yaml.safe_load((eval_run / "config.yaml").read_text())
    assert cfg["eval"] == {
        "every_n_steps": 2,
        "lengths": None,
        "depths": [0.0, 0.5, 1.0],
        "trials": 1,
        "max_sequences": 2,
        "seed": 0,
    }
    ckpt = torch.load(eval_run / "checkpoints" / "step000002.ckpt", weights_only=True)
    assert ckpt["callbacks"]["LongContextEvaluation"] == {"last_step": 2}


@pytest.mark.slow
def test_resume_goes_on_evaluating(eval_run, cache_env, tmp_path):
    """From the step-2 checkpoint (its evaluation done), under accumulation: the first
    micro-batch after the resume ends at step 2 again, which is not evaluated twice."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(eval_run, run)
    shutil.rmtree(run / "eval")
    ckpt = run / "checkpoints" / "step000002.ckpt"
    proc = _train(["--resume", str(ckpt), "--max-steps", "6", "--output-dir", str(run)], cache_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["step000004.json", "step000006.json"]
    rows = _rows(run)
    assert sorted(rows) == list(range(6)) and [s for s, r in rows.items() if r["passkey_acc"]] == [1, 3, 5]


# ---- lengths that cannot run: one line before launch, the callback's own --------------------


@pytest.mark.slow
def test_lengths_that_cannot_run_are_one_line(eval_run, cache_env, tmp_path, monkeypatch, capsys):
    """In-process (the corpus and tokenizer cached by the run above): rc 2, one line, no
    process started; the same text as the callback raises from Python."""
    from longctx.data import LongDocumentDataModule
    from longctx.lightning.eval_callback import LongContextEvaluation

    clear_rendezvous(monkeypatch)
    monkeypatch.setenv("LONGCTX_CACHE_DIR", cache_env["LONGCTX_CACHE_DIR"])
    data = LongDocumentDataModule("stdlib:json,email", vocab_size=512, seq_len=256)
    data.prepare_data()
    tokenizer = data.get_tokenizer()
    train = load_train("train_eval_errors")
    for i, (lengths, said) in enumerate(
        (
            ([128, 254], "sequence length 254 cannot be split by layout 'zigzag' over P=2 ranks"),
            ([16, 256], "passkey length 16 is shorter than the needle, question and answer"),
            ([512], "passkey length 512 is longer than the training length 256"),
        )
    ):
        with pytest.raises(ValueError) as refused:
            LongContextEvaluation(2, lengths=lengths).passkey_lengths(tokenizer, 256, 2, "zigzag")
        out = tmp_path / f"{i}"
        eval_args = ["--eval-every", "2", "--eval.lengths", json.dumps(lengths)]
        assert train.main([*TINY, *eval_args, "--output-dir", str(out)]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("train.py: ")]  # not Lightning's INFO
        assert lines == [f"train.py: error: eval.{refused.value}"] and said in lines[0] and "Traceback" not in err
        assert not (out / "config.yaml").exists()
