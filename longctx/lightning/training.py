"""A training run in one output directory, as train.py runs it: its own options
(``RunOptions``), the Trainer around a ``ContextParallelStrategy`` with the run's callbacks,
the tokenizer the data module gets, the banner, ``fit`` that ends cleanly on SIGTERM and Ctrl-C, and
the end-of-run summary. Usable by any script that keeps train.py's folder layout."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, get_args

from ..validation import check_choice, check_number

KeepCheckpoints = Literal[-1, 0, 1]


@dataclass
class RunOptions:
    """train.py's own settings: where outputs go, validation and checkpoint cadence.

    Args:
        output_dir: metrics.csv, checkpoints/, config.yaml, loss.png; None: runs/<config
            name>, or the run a --resume points into.
        val_every: optimizer steps between validations; None: once, at the end; 0: never.
        val_batches: batches per validation.
        checkpoint_every: optimizer steps between checkpoints; 0: no checkpoints at all
            (benchmark runs).
        keep_checkpoints: step-stamped checkpoints kept besides last.ckpt: -1 (all), 0 or 1.
    """

    output_dir: Optional[str] = None
    val_every: Optional[int] = None
    val_batches: int = 8
    checkpoint_every: int = 50
    keep_checkpoints: KeepCheckpoints = 1

    def __post_init__(self) -> None:
        check_number(
            "val_every", self.val_every, low=0, integer=True, optional=True, hint=" (0: never; null: once, at the end)"
        )
        check_number("val_batches", self.val_batches, low=1, integer=True)
        check_number("checkpoint_every", self.checkpoint_every, low=0, integer=True)
        check_choice("keep_checkpoints", self.keep_checkpoints, get_args(KeepCheckpoints))


def launch_rank() -> int:
    """This process's global rank as far as the environment tells before Lightning sets up."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and int(os.environ["SLURM_NTASKS"]) > 1:
        return int(os.environ["SLURM_PROCID"])
    return int(os.environ.get("LOCAL_RANK", 0)) + int(os.environ.get("NODE_RANK", 0))


def say(*msg: Any) -> None:
    """Print on the launching rank only."""
    if launch_rank() == 0:
        print(*msg, flush=True)


def build_trainer(
    trainer_args: dict, strategy: Any, run: RunOptions, out: Path, callbacks: list, on_train_start: Callable
) -> Any:
    """The Trainer of a run in ``out``: checkpoints and metrics there, validation every
    ``run.val_every`` optimizer steps. Building it checks the world against the strategy's
    CP size (before any process starts)."""
    import lightning as L
    from lightning.pytorch.callbacks import LambdaCallback, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from .run_dir import FinalCheckpoint

    # A run ends: Lightning's endless max_steps=-1 (or a config without it) is no run.
    check_number("max_steps", trainer_args["max_steps"], low=1, integer=True)
    val_every = run.val_every if run.val_every is not None else trainer_args["max_steps"]
    checkpoint = FinalCheckpoint(
        dirpath=out / "checkpoints",
        filename="step{step:06d}",
        every_n_train_steps=run.checkpoint_every,
        save_last=True,
        save_top_k=run.keep_checkpoints,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    callbacks = [
        *([checkpoint] if run.checkpoint_every else []),
        *callbacks,
        LambdaCallback(on_train_start=on_train_start),
        *([TQDMProgressBar(refresh_rate=1)] if trainer_args.get("enable_progress_bar") is not False else []),
    ]
    return L.Trainer(
        **trainer_args,
        strategy=strategy,
        val_check_interval=(val_every * trainer_args["accumulate_grad_batches"]) if val_every else None,
        check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=run.val_batches if val_every else 0,
        num_sanity_val_steps=0,
        logger=CSVLogger(save_dir=str(out), name="logs", flush_logs_every_n_steps=1),
        callbacks=callbacks,
        enable_model_summary=False,
        max_epochs=-1,
        enable_checkpointing=bool(run.checkpoint_every),
    )


def data_tokenizer(tokenizer: Any, init_from: Optional[str], hf_model: Optional[str]) -> Any:
    """What the data module tokenizes with: the one given, else the model's own (a checkpoint's,
    a Hugging Face directory's, a train.py run's), a GGUF spec read into a ``GGUFTokenizer``;
    None: train one."""
    from longctx.models import GGUFTokenizer
    from longctx.models.run_checkpoint import is_run_checkpoint, run_tokenizer

    if tokenizer is None:
        tokenizer = init_from
    if is_run_checkpoint(tokenizer):  # a train.py run folder or .ckpt: the tokenizer that run used
        return run_tokenizer(tokenizer)
    hf_dir = Path(hf_model) if hf_model else None
    has_tokenizer = hf_dir is not None and any((hf_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model"))
    if tokenizer is None and has_tokenizer:
        tokenizer = str(hf_dir)
    return GGUFTokenizer.from_gguf(tokenizer) if GGUFTokenizer.accepts(tokenizer) else tokenizer


def describe_run(trainer: Any, module: Any, *, seq_len: int, batch_size: int, out: Path, resume: Optional[Path]) -> str:
    """The banner: the (dp, cp) layout, the model, the tokens per rank and step."""
    strategy, config, accumulate = trainer.strategy, module.config, trainer.accumulate_grad_batches
    world, cp, dp = strategy.world_size, strategy.cp_size, strategy.dp_size
    accelerator = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
    return (
        f"longctx | world {world} = dp {dp} x cp {cp} ({accelerator}, "
        f"{trainer.precision}, layout {strategy.layout}, data parallel {strategy.data_parallel})\n"
        f"        | model {module.model.num_params() / 1e6:.2f}M parameters ({config.n_layer} layers x "
        f"{config.n_embd}, vocab {config.vocab_size})\n"
        f"        | seq_len {seq_len:,}: {seq_len // cp:,} tokens per rank per sequence; "
        f"{batch_size} sequence(s) per dp rank x {accumulate} micro-batch(es)\n"
        f"        | tokens per step {seq_len * batch_size * dp * accumulate:,} (global), per rank "
        f"{seq_len // cp * batch_size:,} per micro-batch; {trainer.max_steps} steps\n"
        + (f"        | resuming from {resume}\n" if resume else "")
        + f"        | output {out}"
    )


def fit(trainer: Any, module: Any, datamodule: Any, resume: Optional[Path]) -> tuple[Optional[Any], Optional[int]]:
    """``trainer.fit``; a SIGTERM or Ctrl-C stop is an outcome, not an error: (the ``StoppedBySignal``
    or None, None), or (None, exit code) where another rank left first during the stop, or
    (None, 2) with one line printed where the memory model refused the run before step 1."""
    from longctx.memory_fit import PredictedOutOfMemory

    from .preemption import StoppedBySignal, signal_name

    strategy = trainer.strategy
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume) if resume else None)
    except StoppedBySignal as stop:  # SIGTERM (preemption, timeout) or Ctrl-C: every rank stopped at one step
        return stop, None
    except PredictedOutOfMemory as error:  # CausalLMModule's check before the first step
        print(f"train.py: error: {error}", file=sys.stderr, flush=True)  # one line by construction
        return None, 2
    except Exception as error:
        if strategy.received_signal is None:
            raise
        # Another rank left first during the stop (its grace period ran out): no failure of ours.
        print(
            f"train.py: stopped by {signal_name(strategy.received_signal)} before a checkpoint of the "
            f"current step ({type(error).__name__}: {str(error)[:300]})",
            file=sys.stderr,
            flush=True,
        )
        return None, 128 + strategy.received_signal
    return None, None


def summarize_run(trainer: Any, out: Path, *, title: str, resumed: bool, stopped: Optional[Any]) -> str:
    """metrics.csv and loss.png written; the lines that say where everything is."""
    from .preemption import signal_name
    from .run_dir import flatten_metrics, plot_loss

    rows = flatten_metrics(out / "logs", Path(trainer.logger.log_dir) / "metrics.csv", out / "metrics.csv", resumed)
    plot_loss(rows, out / "loss.png", title)
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    summary = f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no train loss logged"
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    if val:  # with its step: after a resume the newest validation may be the earlier launch's
        step, loss = val[-1]
        summary += f"; val loss {loss:.3f} at step {step} (ppl {math.exp(min(loss, 50.0)):.1f})"
    speed = speed_line(rows)
    last = out / "checkpoints" / "last.ckpt"
    if stopped is None:
        checkpoint = f"  checkpoint {last}\n" if last.exists() else "  checkpoint none (--checkpoint-every 0)\n"
    elif stopped.checkpoint:
        checkpoint = f"  checkpoint {stopped.checkpoint} (continue: --resume {out})\n"
    else:
        checkpoint = "  checkpoint none saved at this step\n"
    text = (
        (f"stopped by {signal_name(stopped.signum)}" if stopped else "done")
        + f": {trainer.global_step} steps; {summary}\n"
        + (f"  speed      {speed}\n" if speed else "")
        + f"  metrics    {out / 'metrics.csv'}\n"
        + checkpoint
        + f"  loss plot  {out / 'loss.png'}\n  config     {out / 'config.yaml'}"
    )
    return text if stopped is None else f"{text}\n{stop_line(stopped, out)}"


def speed_line(rows: list, first: int = 3) -> Optional[str]:
    """The run's medians from metrics.csv rows: tokens/s, seconds a step and MFU over steps
    ``first``.. (1-based: the first steps compile and allocate), or all where it has fewer;
    the peak memory of any step; the start-up before the first step. None where no step
    logged its rate."""
    import statistics

    timed = [r for r in rows if r.get("tokens_per_s")]
    if not timed:
        return None
    steady = [r for r in timed if int(r["step"]) >= first - 1] or timed

    def median(name):
        values = [float(r[name]) for r in steady if r.get(name)]
        return statistics.median(values) if values else None

    steps = sorted(int(r["step"]) + 1 for r in steady)
    tokens_per_s, step_s, mfu = median("tokens_per_s"), median("step_s"), median("mfu")
    parts = [f"{tokens_per_s:,.0f} tokens/s"]
    if step_s is not None:
        parts.append(f"{step_s:.2f} s a step")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    span = f"step {steps[0]}" if steps[0] == steps[-1] else f"median of steps {steps[0]}-{steps[-1]}"
    text = ", ".join(parts) + f" ({span})"
    for name, label in (("peak_mem_gib", "GPU"), ("peak_rss_gib", "host")):
        peaks = [float(r[name]) for r in rows if r.get(name)]
        if peaks:
            text += f"; peak {label} memory {max(peaks):.1f} GiB"
    startups = [float(r["startup_s"]) for r in rows if r.get("startup_s")]
    if startups:  # the latest launch's (a resumed run logs one per launch)
        text += f"; start-up {startups[-1]:.1f} s"
    return text


def stop_line(stopped: Any, out: Path) -> str:
    """The last line of a run stopped by a signal: what stopped it, its exit code, how to go on."""
    import signal

    from .preemption import signal_name

    name = signal_name(stopped.signum) + (" (Ctrl-C)" if stopped.signum == signal.SIGINT else "")
    where = "its checkpoint" if stopped.checkpoint else "the newest checkpoint saved before it"
    return (
        f"stopped by {name} at step {stopped.step}, exit code {stopped.code}; to continue from {where}: "
        f"python train.py --resume {out}"
    )
