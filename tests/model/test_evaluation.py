"""The long-context evaluation: passkey retrieval (longctx.models.passkey), loss by position
(longctx.models.evaluation) and evaluate.py.

Exact: at P = 2 and 4 over gloo, in float64, the passkey table and the loss by position equal
one process's. evaluate.py runs on a train.py run folder (its tokenizer comes along) and says
a bad argument in one line, exit code 2.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers.dist_harness import run_distributed
from helpers.train_script import TINY, launch_env, run_train

from longctx import CPContext, ParallelDims, parallelize
from longctx.models import GPT, GPTConfig
from longctx.models.evaluation import evaluate
from longctx.models.passkey import passkey_sample, passkey_table

REPO = Path(__file__).resolve().parents[2]
VOCAB = 97


class CharTokenizer:
    """One token per character: enough text for a passkey prompt, no training."""

    vocab_size, bos_id, eos_id = VOCAB, 1, 2

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % (VOCAB - 3) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


def _model(group=None, dtype=torch.float64) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)
    return parallelize(GPT(config).to(dtype).eval(), ParallelDims(cp=CPContext(group)))


def test_passkey_sample_places_the_key_and_labels_only_the_answer():
    tok = CharTokenizer()
    for depth in (0.0, 0.5, 1.0):
        ids, labels, at = passkey_sample(tok, 400, depth, 12345)
        assert ids.shape == labels.shape == (400,)
        answer = tok.encode(" 12345")
        assert ids[-len(answer) :].tolist() == answer
        assert labels[-len(answer) - 1 : -1].tolist() == answer and (labels[: -len(answer) - 1] == -100).all()
        needle = tok.encode(" The pass key is 12345.")
        assert ids[at : at + len(needle)].tolist() == needle
    assert passkey_sample(tok, 400, 0.0, 1)[2] == 1 < passkey_sample(tok, 400, 1.0, 1)[2]  # after bos / at the end
    with pytest.raises(ValueError, match=r"^passkey length 50 is shorter than the needle, question and answer"):
        passkey_sample(tok, 50, 0.5, 12345)
    with pytest.raises(ValueError, match="depth"):
        passkey_sample(tok, 400, 1.5, 12345)


def _stream() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB, 600).astype(np.int32)
    return tokens, (np.arange(600) // 150).astype(np.int32)  # document boundaries inside windows


PASSKEY = dict(depths=(0.0, 0.5, 1.0), trials=2, seed=3)


@torch.no_grad()
def _evaluate_both(rank: int, world: int, lengths: list) -> dict:
    group = dist.group.WORLD if world > 1 else None
    model, tok = _model(group), CharTokenizer()
    table = passkey_table(model, tok, lengths, group=group, batch_tokens=600, **PASSKEY)
    tokens, docs = _stream()
    loss = evaluate(model, tokens, docs, [64, 128], max_sequences=3, edges=[8, 32, 64], group=group)
    errors = []
    if world > 1:  # a length the CP size does not divide
        for bad in (
            lambda: passkey_table(model, tok, [258], group=group),
            lambda: evaluate(model, tokens, docs, [66], max_sequences=1, group=group),
        ):
            try:
                bad()
            except ValueError as e:
                errors.append(str(e))
    return {"passkey": table, "loss": loss, "errors": errors}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_evaluation_equals_one_process(world):
    lengths = [256, 320] if world == 2 else [256]  # 320: not a multiple of 2 x 4
    ranks = run_distributed(_evaluate_both, world, lengths)
    one = _evaluate_both(0, 1, lengths)
    for got in ranks:
        table, ref = got["passkey"], one["passkey"]
        assert table["accuracy"] == ref["accuracy"]
        assert [s["key"] for s in table["samples"]] == [s["key"] for s in ref["samples"]]
        diff = max(abs(a["logprob"] - b["logprob"]) for a, b in zip(table["samples"], ref["samples"]))
        assert diff < 1e-12, diff
        for a, b in zip(got["loss"], one["loss"]):
            assert a["window_indices"] == b["window_indices"] and a["n_tokens"] == b["n_tokens"]
            assert abs(a["loss"] - b["loss"]) < 1e-12
            for x, y in zip(a["buckets"], b["buckets"]):
                assert x["n_tokens"] == y["n_tokens"] and abs(x["loss"] - y["loss"]) < 1e-12
        assert len(got["errors"]) == 2 and all("\n" not in e for e in got["errors"])
        assert got["errors"][0].startswith("passkey length: sequence length 258 cannot be split")
        assert "sequence length 66 cannot be split" in got["errors"][1]


# ---- evaluate.py and --init-from on a train.py run ------------------------------------------


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", REPO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return launch_env(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, env) -> Path:
    run = tmp_path_factory.mktemp("tiny-run")
    proc = run_train([*TINY, "--max-steps", "2", "--checkpoint-every", "2", "--output-dir", str(run)], env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run


@pytest.mark.slow
def test_evaluate_cli_on_a_run_folder(tiny_run, env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", env["LONGCTX_CACHE_DIR"])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    evaluate_py = _script("evaluate")
    common = ["--checkpoint", str(tiny_run / "checkpoints" / "step000002.ckpt"), "--out", str(tmp_path)]
    rc = evaluate_py.main(
        [*common, "--lengths", "128,256", "--depths", "0,1", "--trials", "2", "--data", "stdlib:json"]
        + ["--max-sequences", "2", "--rope-scaling", '{"type": "linear", "factor": 2}']
    )
    assert rc == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["config"]["rope_scaling"] == {"type": "linear", "factor": 2}
    table = record["passkey"]
    assert table["lengths"] == [128, 256] and table["depths"] == [0.0, 1.0] and len(table["accuracy"]) == 2
    assert all(-30 < lp < 0 for row in table["logprob"] for lp in row)
    results = record["loss_by_position"]["results"]
    assert [r["seq_len"] for r in results] == [128, 256] and all(r["n_windows"] == 2 for r in results)
    assert [b["hi"] for b in results[1]["buckets"]] == [16, 32, 64, 128, 256]
    assert (tmp_path / "eval_passkey.png").stat().st_size > 0
    assert (tmp_path / "eval_loss_by_position.png").stat().st_size > 0
    capsys.readouterr()
    # Bad input: one line, exit code 2, before the weights load.
    for argv, said in (
        (["--lengths", "40"], "passkey length 40 is shorter than the needle"),
        (["--preset", "gpt-125m", "--lengths", "256"], "does not match preset 'gpt-125m'"),
        (["--depths", "0,2"], "--depths must be numbers in [0, 1]"),
    ):
        assert evaluate_py.main([*common, "--tasks", "passkey", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("evaluate.py: error: ") and said in err and "\n" not in err, err


@pytest.mark.slow
def test_init_from_a_run_folder_with_a_new_length_and_rope_scaling(tiny_run, env, tmp_path):
    """train.py --init-from RUN: the run's weights and tokenizer, a longer sequence and RoPE
    scaling; a size the config changes is one line naming the checkpoint's sizes."""
    out = tmp_path / "longer"
    scaled = ["--model.model.rope_scaling", '{"type": "linear", "factor": 2}', "--model.model.max_seq_len", "128"]
    args = [*TINY, "--init-from", str(tiny_run), *scaled, "--seq-len", "128", "--max-steps", "1"]
    proc = run_train([*args, "--checkpoint-every", "1", "--output-dir", str(out)], env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    before = torch.load(tiny_run / "checkpoints" / "last.ckpt", weights_only=True)
    after = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    config = after["hyper_parameters"]["model"]
    assert config["rope_scaling"] == {"type": "linear", "factor": 2} and config["max_seq_len"] == 128
    assert {k: v for k, v in config.items() if k not in ("rope_scaling", "max_seq_len")} == {
        k: v for k, v in before["hyper_parameters"]["model"].items() if k not in ("rope_scaling", "max_seq_len")
    }
    # One step of lr 2e-3 from the run's weights, not a fresh init: the weights stay close.
    w0, w1 = before["state_dict"]["model.embed.weight"], after["state_dict"]["model.embed.weight"]
    assert (w1 - w0).abs().max() < 0.05 and w0.std() > 0
    assert "train loss" in proc.stdout

    train_py = _script("train")
    with pytest.raises(ValueError) as refused:
        train_py.prepare([*args, "--model.model.n_layer", "4"], device_checks=False)
    message = train_py.one_line(refused.value)
    assert "has n_layer=2 but the config asks for n_layer=4" in message
    assert "preset 'tiny' with vocab_size=512" in message
    with pytest.raises(ValueError, match="does not match preset 'gpt-125m'.*its sizes are preset 'tiny'"):
        train_py.prepare([*args, "--preset", "gpt-125m"], device_checks=False)


def test_evaluate_refuses_a_length_the_launch_cannot_split():
    """Checked against the launch's CP size (every process of it) before anything loads; main()
    says it as one line, exit code 2, as the refusals above."""
    evaluate_py = _script("evaluate")
    args = evaluate_py.parse_args(["--preset", "tiny", "--tokenizer", "t.model", "--lengths", "1K,1026"])
    with pytest.raises(ValueError) as refused:
        evaluate_py.check_arguments(args, 2)
    assert str(refused.value) == (
        "--lengths: sequence length 1026 cannot be split by layout 'zigzag' over P=2 ranks: it must be a positive "
        "multiple of 4 (2 x P); nearest valid: 1024 or 1028 (CP = the 2 processes of the launch)"
    )
    assert evaluate_py.check_arguments(args, 1) == (["passkey", "loss"], [0.0, 0.25, 0.5, 0.75, 1.0])


# ---- the training callback ---------------------------------------------------------------


def test_callback_logs_passkey_and_loss_by_position_beside_the_loss(tmp_path):
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from longctx.data.packing import PackedSequenceDataset
    from longctx.lightning.eval_callback import LongContextEvaluation

    class Data(L.LightningDataModule):
        seq_len = 256

        def __init__(self):
            super().__init__()
            self.val_dataset = PackedSequenceDataset(*_stream(), self.seq_len)

        def get_tokenizer(self):
            return CharTokenizer()

        def train_dataloader(self):
            return DataLoader(self.val_dataset, batch_size=1)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model(dtype=torch.float32).train()

        def training_step(self, batch, _):
            loss_sum, n = self.model.loss(batch["input_ids"], batch["labels"], batch["position_ids"])
            self.log("train_loss", loss_sum / n, on_step=True)
            return loss_sum / n

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(callback, name):
        trainer = L.Trainer(
            max_steps=4,
            accelerator="cpu",
            devices=1,
            callbacks=[callback],
            logger=CSVLogger(tmp_path, name=name),
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            log_every_n_steps=1,
        )
        trainer.fit(Module(), datamodule=Data())
        return trainer

    callback = LongContextEvaluation(every_n_steps=2, trials=1, output_dir=str(tmp_path / "eval"))
    trainer = fit(callback, "default")
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("passkey_acc")]
    # In the rows of the steps whose updates gave the evaluated weights (steps 2 and 4 done),
    # and in no later row (Lightning would repeat a value logged through the module).
    assert [int(r["step"]) for r in rows] == [1, 3]
    for r in rows:  # only 256 of (64, 128, 256) fits the ~104-token needle twice over
        assert 0 <= float(r["passkey_acc"]) == float(r["passkey_acc_256"]) <= 1
        assert float(r["passkey_logprob"]) < 0
        assert all(float(r[f"pos_loss_q{q}"]) > 0 for q in (1, 2, 3, 4))
    # Each evaluation whole, as JSON: the table lengths x depths with its samples, the buckets.
    records = [json.loads((tmp_path / "eval" / f"step00000{s}.json").read_text()) for s in (2, 4)]
    assert [r["step"] for r in records] == [2, 4] and sorted(p.name for p in (tmp_path / "eval").iterdir()) == [
        "step000002.json",
        "step000004.json",
    ]
    for record, row in zip(records, rows):
        table = record["passkey"]
        assert table["lengths"] == [256] and table["depths"] == [0.0, 0.5, 1.0] and len(table["samples"]) == 3
        assert LongContextEvaluation.metrics(record)["passkey_logprob"] == pytest.approx(float(row["passkey_logprob"]))
        assert [b["hi"] for b in record["loss_by_position"]["buckets"]] == [64, 128, 192, 256]
        assert record["seconds"] > 0
    assert callback.state_dict() == {"last_step": 4}  # in the checkpoint: a resume does not evaluate step 4 again
    with pytest.raises(ValueError, match="passkey length 64 is shorter than the needle"):
        fit(LongContextEvaluation(every_n_steps=2, lengths=[64, 256]), "refused")  # at the start, no step run


def test_callback_lengths_come_from_the_training_length_or_are_checked():
    """Derived: the training length, its half and quarter, rounded down to what the CP layout
    splits, those with room for the filler. Given: each checked, one line naming the list."""
    from longctx.lightning.eval_callback import LongContextEvaluation
    from longctx.validation import ArgumentValueError

    tok = CharTokenizer()  # the needle, question and answer: 104 characters
    assert LongContextEvaluation(2).passkey_lengths(tok, 1024, 2, "zigzag") == [256, 512, 1024]
    assert LongContextEvaluation(2).passkey_lengths(tok, 1000, 4, "zigzag") == [248, 496, 1000]  # multiples of 8
    assert LongContextEvaluation(2).passkey_lengths(tok, 256) == [256]  # 64 and 128: no room for the filler
    assert LongContextEvaluation(2, lengths=[104, 256]).passkey_lengths(tok, 256, 2) == [104, 256]
    # Before the tokenizer exists (train.py, before any data work): the needle is left out.
    assert LongContextEvaluation(2, lengths=[64]).passkey_lengths(None, 256, 2) == [64]
    for lengths, said in (
        (
            [254],
            "lengths [254]: sequence length 254 cannot be split by layout 'zigzag' over P=2 ranks: it must be a "
            "positive multiple of 4 (2 x P); nearest valid: 252 or 256",
        ),
        (
            [64, 256],
            "lengths [64, 256]: passkey length 64 is shorter than the needle, question and answer (104 tokens with "
            "this tokenizer): use lengths of at least 104",
        ),
        ([128, 512], "lengths [128, 512]: passkey length 512 is longer than the training length 256: "),
    ):
        with pytest.raises(ArgumentValueError) as refused:
            LongContextEvaluation(2, lengths=lengths).passkey_lengths(tok, 256, 2, "zigzag")
        assert refused.value.argument == "lengths" and str(refused.value).startswith(said), str(refused.value)


# ---- the README's section ------------------------------------------------------------------

SECTION = "## Long-context evaluation and generation"


def _readme_section() -> str:
    return (REPO / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]


def test_readme_generation_snippet_runs(monkeypatch, capsys):
    import re

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    code = re.search(r"```python\n(.*?)```", _readme_section(), re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert "torch.Size([1, 16]) torch.Size([1, 16])" in capsys.readouterr().out


def test_readme_evaluate_commands_pass_the_argument_checks():
    import re
    import shlex

    evaluate_py = _script("evaluate")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", _readme_section(), re.S):
        for line in block.splitlines():
            words = shlex.split(line)
            if "evaluate.py" in words:
                at = words.index("evaluate.py")
                world = int(words[words.index("--nproc-per-node") + 1]) if words[0] == "torchrun" else 1
                commands.append((world, words[at + 1 :]))
    assert len(commands) == 2 and {w for w, _ in commands} == {1, 2}
    for world, argv in commands:
        args = evaluate_py.parse_args(argv)
        evaluate_py.check_arguments(args, world)


def test_evaluate_names_a_missing_checkpoint(tmp_path, capsys):
    """A --checkpoint that does not exist is named as the checkpoint (not as a tokenizer path)."""
    evaluate_py = _script("evaluate")
    missing = tmp_path / "no-such-run"
    assert evaluate_py.main(["--checkpoint", str(missing), "--lengths", "256", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"evaluate.py: error: --checkpoint {str(missing)!r} does not exist", err
