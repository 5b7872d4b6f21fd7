#!/usr/bin/env python
"""Train a GPT with ring-attention context parallelism in a Lightning loop.

    python train.py                                   # tiny model, CP=2 on 2 CPU processes
    python train.py --config configs/gpt-350m-128k.yaml --context-parallel 8 --devices 8
    torchrun --nproc-per-node 8 train.py --config ... --devices 8   # or under SLURM (srun)

A LightningCLI over ``CausalLMModule`` (section ``model``), ``LongDocumentDataModule``
(``data``), ``ContextParallelStrategy`` (``strategy``), the ``Trainer`` (``trainer``), the
``NonFiniteGuard`` callback (``nonfinite``), the ``LongContextEvaluation`` callback (``eval``,
on with ``--eval-every N``) and train.py's own ``run`` options: every option
is ``--SECTION.ARGUMENT`` (``--model.lr 1e-3``, ``--model.model.n_layer 4``), with the
class's default and docstring; YAML configs have the same shape. The short flags people
type are aliases of those keys (``--help`` lists both). ``--config`` files and flags apply
in order; without ``--config`` the base is configs/tiny-cpu.yaml. ``--print_config`` prints
the resolved config (loadable with ``--config``) and exits.

Outputs: OUTPUT_DIR/config.yaml (the resolved config, loadable with ``--config``),
metrics.csv, checkpoints/ (last.ckpt always the newest complete one), loss.png; with
``--eval-every N`` the passkey and loss-by-position columns in metrics.csv and eval/stepNNNNNN.json.
``--resume`` takes a checkpoint, a checkpoint directory or a run directory and continues
exactly where that checkpoint left off, from the run's own config.yaml (flags given then are
printed overrides). Every input mistake visible before launch is one ``train.py: error:``
line with exit code 2; a run folder is locked while a run writes to it.

Launching: with ``--devices N`` and no external launcher, Lightning starts the other N-1
processes itself by re-running this script (each re-run finds the tokenizer and corpus
caches ready). Under torchrun/SLURM the processes already exist and Lightning joins them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Optional

from longctx.lightning.cli import cli_class, one_line

REPO = Path(__file__).resolve().parent
DEFAULT_CONFIG = REPO / "configs" / "tiny-cpu.yaml"

# The short flags people type -> the option each one sets.
SHORT_FLAGS = {
    "--context-parallel": "strategy.context_parallel_size",
    "--data-parallel": "strategy.data_parallel",
    "--layout": "strategy.layout",
    "--failure-timeout": "strategy.failure_timeout",
    "--stop-grace-period": "strategy.stop_grace_period",
    "--devices": "trainer.devices",
    "--num-nodes": "trainer.num_nodes",
    "--accelerator": "trainer.accelerator",
    "--precision": "trainer.precision",
    "--max-steps": "trainer.max_steps",
    "--accumulate-grad-batches": "trainer.accumulate_grad_batches",
    "--seq-len": "data.seq_len",
    "--batch-size": "data.batch_size",
    "--seed": "data.seed",
    "--data": "data.data_path",
    "--tokenizer": "data.tokenizer",
    "--preset": "model.model.preset",
    "--init-from": "model.init_from",
    "--hf-model": "model.hf_model",
    "--attention": "model.attention",
    "--lr": "model.lr",
    "--warmup-steps": "model.warmup_steps",
    "--decay-steps": "model.decay_steps",
    "--output-dir": "run.output_dir",
    "--val-every": "run.val_every",
    "--checkpoint-every": "run.checkpoint_every",
    "--eval-every": "eval.every_n_steps",
}


def resolve_config(argv: list[str]):
    """The parsed options only (``TrainCLI`` with ``.config``, ``.dump()``, ``.overrides``)."""
    return prepare(argv, instantiate=False)


def prepare(argv: list[str], *, instantiate: bool = True, device_checks: bool = True):
    """The ``TrainCLI``: parsed, and (``instantiate``) every object built before any data
    work, each refusal one ValueError/FileNotFoundError/ArgumentError (see
    longctx.lightning.train_cli)."""
    cli = cli_class(__doc__.split("\n\n")[0], SHORT_FLAGS, DEFAULT_CONFIG)
    return cli(argv, instantiate=instantiate, device_checks=device_checks)


INTERRUPTED = 128 + 2  # exit code of a run stopped by Ctrl-C (SIGINT), as a shell reports it


def main(argv: Optional[list[str]] = None) -> int:
    fitted: list[bool] = []  # set once training has run: a Ctrl-C after it interrupts the summary only
    try:
        return train(argv, fitted)
    except KeyboardInterrupt:  # Ctrl-C outside the fit, where the run's own handler stops it
        when = "after training, while writing the summary" if fitted else "before training started"
        print(f"train.py: stopped by Ctrl-C {when}", file=sys.stderr)
        return INTERRUPTED


def train(argv: Optional[list[str]] = None, fitted: Optional[list] = None) -> int:
    from argparse import ArgumentError

    try:  # every mistake the command line can show: one line, rc 2, before any data work
        cli = prepare(list(sys.argv[1:] if argv is None else argv))
    except (ValueError, FileNotFoundError, ArgumentError) as e:
        print(f"train.py: error: {one_line(e)}", file=sys.stderr)
        return 2
    cfg, trainer, dm, out, resume = cli.config, cli.trainer, cli.datamodule, cli.out, cli.resume_checkpoint
    # Lightning noise that says nothing about this run: the logged values are already global
    # (so no sync_dist), and a pytree deprecation inside Lightning itself.
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # CausalLMModule's own hook computes per-document positions on the full batch: meant.
    warnings.filterwarnings("ignore", message=".*overridden `on_after_batch_transfer`.*")

    import lightning as L

    from longctx.lightning.run_dir import file_lock
    from longctx.lightning.training import describe_run, fit, say, summarize_run

    L.seed_everything(cfg.data.seed, workers=True, verbose=False)
    try:  # data first: the tokenizer fixes the vocabulary of a freshly initialised model
        with file_lock(dm.cache_dir / ".train-prepare.lock"):
            dm.prepare_data()  # tokenizer + tokenized corpus, cached: re-launched ranks hit the cache
        dm.check_one_batch(cli.data_parallel_size)  # here, not in every rank's setup
    except (ValueError, FileNotFoundError) as e:  # the corpus or tokenizer cannot be used
        message = one_line(e)
        if "sentences_.empty()" in message:  # SentencePiece skipped every (over-long) line
            message += (
                " (every sampled line is longer than SentencePiece's 16384-byte sentence limit: "
                "is the corpus one huge line? break it into lines)"
            )
        print(f"train.py: error: data: {message}", file=sys.stderr)
        return 2
    try:  # the evaluation's passkey lengths against the tokenizer's needle
        cli.check_evaluation(dm.get_tokenizer())
    except ValueError as e:
        print(f"train.py: error: {one_line(e)}", file=sys.stderr)
        return 2
    try:  # a checkpoint to start from whose tensors show damage (longctx.models.checkpoint_import)
        module = cli.instantiate_model()
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"train.py: error: model: {one_line(e)}", file=sys.stderr)
        return 2

    say(describe_run(trainer, module, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size, out=out, resume=resume))
    stopped, code = fit(trainer, module, dm, resume)
    if fitted is not None:
        fitted.append(True)
    if code is not None:
        return code
    if trainer.is_global_zero:
        strategy = trainer.strategy
        title = f"{cli.name}: dp {strategy.dp_size} x cp {strategy.cp_size}, seq_len {cfg.data.seq_len:,}"
        print(summarize_run(trainer, out, title=title, resumed=resume is not None, stopped=stopped), flush=True)
    return 0 if stopped is None else stopped.code


if __name__ == "__main__":
    sys.exit(main())
