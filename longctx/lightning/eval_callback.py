"""The long-context evaluation during training: a Lightning callback.

Every ``every_n_steps`` optimizer steps, ``LongContextEvaluation`` runs passkey retrieval
(``longctx.models.passkey``) at the training length and below, and the loss by position (``longctx.models.evaluation``)
of a few windows of the training length from the validation stream, on the model as it is,
over the run's own CP group (the prompts sharded and run with ring attention as the training
batches are). It logs to the Trainer's loggers, in the row of the step whose update gave the
evaluated weights (beside that step's training loss; train.py: metrics.csv), whatever the
Trainer's ``log_every_n_steps``:

* ``passkey_acc`` (mean over lengths and depths), ``passkey_acc_<L>`` per length and
  ``passkey_logprob`` (mean log-probability of the answer tokens);
* ``pos_loss_q1`` ... ``pos_loss_q4``: the mean loss of each quarter of the window (late
  quarters falling below early ones: the model uses its long context).

With ``output_dir`` each evaluation is also written whole, ``output_dir/step000100.json``
(the passkey table lengths x depths with its samples, the loss buckets).

    from longctx.lightning.eval_callback import LongContextEvaluation
    trainer = L.Trainer(..., callbacks=[LongContextEvaluation(every_n_steps=100)])

train.py installs it with ``--eval-every N`` (its section ``eval``: ``--eval.lengths``,
``--eval.depths``, ...; the JSON files in the run's ``eval/``) and checks the lengths before
launch with the same ``passkey_lengths`` the callback runs at the start of the fit, so the
refusal is the same line in both.

The tokenizer is the data module's (``get_tokenizer()``) unless one is given; the windows
come from its ``val_dataset`` (none there: only passkey). Every rank runs it (the CP ranks
together; data-parallel replicas evaluate the same prompts) and logs the same numbers. Under
FSDP the root's parameters are gathered for the evaluation and freed after. The step of the
last evaluation is kept in checkpoints: a resumed run does not evaluate that step again.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from longctx.layouts import check_seq_len, required_multiple
from longctx.models.evaluation import evaluate
from longctx.models.gpt import GPT
from longctx.models.passkey import check_passkey_length, passkey_overhead, passkey_table
from longctx.validation import ArgumentValueError, check_number


class LongContextEvaluation(L.Callback):
    """Passkey accuracy and loss by position every ``every_n_steps`` optimizer steps.

    Args:
        every_n_steps: evaluate after every this many optimizer steps; 0: never (train.py's
            default: ``--eval-every N`` turns it on).
        lengths: passkey prompt lengths (tokens), each at most the training length, split by
            the CP layout and long enough for the needle; None: the training length, its
            half and quarter (rounded down to what the CP layout splits; those with room
            for the needle twice over).
        depths: where the key is planted, each in [0, 1] (0: start of the filler, 1: its end).
        trials: keys per (length, depth).
        max_sequences: validation windows of the training length for the loss by position
            (0: none).
        seed: draws the keys (the same keys at every evaluation: comparable over steps).
        tokenizer: what encodes the passkey prompts; None: the data module's.
        output_dir: where each evaluation's JSON goes (``step000100.json``); None: none.
    """

    def __init__(
        self,
        every_n_steps: int,
        *,
        lengths: Optional[Sequence[int]] = None,
        depths: tuple[float, ...] = (0.0, 0.5, 1.0),
        trials: int = 2,
        max_sequences: int = 2,
        seed: int = 0,
        tokenizer: Any = None,
        output_dir: Optional[str] = None,
    ):
        check_number("every_n_steps", every_n_steps, low=0, integer=True, hint=" (0: never)")
        if lengths is not None and (
            isinstance(lengths, (str, bytes))
            or not lengths
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
        ):
            raise ArgumentValueError(
                "lengths", f"must be a list of token counts >= 1, or null (from the training length), got {lengths!r}"
            )
        if (
            isinstance(depths, (str, bytes))
            or not depths
            or not all(isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 1 for d in depths)
        ):
            raise ArgumentValueError("depths", f"must be a list of numbers in [0, 1], got {depths!r}")
        check_number("trials", trials, low=1, integer=True)
        check_number("max_sequences", max_sequences, low=0, integer=True, hint=" (0: no loss by position)")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ArgumentValueError("seed", f"must be an integer, got {seed!r}")
        self.every_n_steps = every_n_steps
        self.lengths = None if lengths is None else list(lengths)
        self.depths = [float(d) for d in depths]
        self.trials, self.max_sequences, self.seed = trials, max_sequences, seed
        self.tokenizer = tokenizer
        self.output_dir = None if output_dir is None else Path(output_dir)
        self._last_step = -1

    def passkey_lengths(self, tokenizer: Any, seq_len: Optional[int], cp_size: int = 1, layout: str = "zigzag") -> list:
        """The passkey lengths of a run at ``seq_len`` tokens over ``cp_size`` CP ranks; the
        given ones checked: one over ``seq_len``, one the layout cannot split or one shorter
        than the needle, question and answer is an ``ArgumentValueError`` of ``lengths``. The
        derived ones may be none (a training length too short for a needle): no passkey.
        Without a tokenizer (a check before it exists) the needle is left out of it."""
        if self.lengths is None:
            if seq_len is None:
                raise ArgumentValueError("lengths", "must be given where the data module has no seq_len to derive them")
            multiple = required_multiple(cp_size, layout) if cp_size > 1 else 1
            room = 2 * passkey_overhead(tokenizer) if tokenizer is not None else 0
            return sorted(n for n in {seq_len // k // multiple * multiple for k in (4, 2, 1)} if n >= room)
        for n in self.lengths:
            try:
                if seq_len is not None and n > seq_len:
                    raise ValueError(
                        f"passkey length {n} is longer than the training length {seq_len}: the evaluation during "
                        "training runs at the training length and below (evaluate.py takes a checkpoint further)"
                    )
                if cp_size > 1:
                    check_seq_len(n, cp_size, layout)
                if tokenizer is not None:
                    check_passkey_length(tokenizer, n)
            except ValueError as e:
                raise ArgumentValueError("lengths", f"{self.lengths}: {e}") from None
        return list(self.lengths)

    def describe(self, lengths: Sequence[int], seq_len: Optional[int]) -> str:
        """One line: what every evaluation runs, and where its numbers go."""
        keys = f"{self.trials} key{'s' * (self.trials > 1)} each"
        passkey = (
            f"passkey at lengths {list(lengths)} x depths {self.depths} ({keys})"
            if lengths
            else f"no passkey (the training length {seq_len} has no room for a needle)"
        )
        windows = f"{self.max_sequences} validation window{'s' * (self.max_sequences > 1)}"
        loss = f"the loss by position of {windows}" if self.max_sequences else ""
        where = "the loggers" + (f" and {self.output_dir}/stepNNNNNN.json" if self.output_dir is not None else "")
        return f"every {self.every_n_steps} steps: {passkey}{', ' + loss if loss else ''} -> {where}"

    # -- Lightning hooks -------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.every_n_steps:
            self._setup(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if not self.every_n_steps or step == 0 or step % self.every_n_steps or step == self._last_step:
            return  # (several micro-batches end at one optimizer step under accumulation)
        self._last_step = step
        record = self.evaluate(trainer, pl_module)
        # Straight to the loggers, in the row of the step whose update gave these weights (its
        # train_loss's): values logged through the module would be repeated in every later row.
        for logger in trainer.loggers:
            logger.log_metrics(self.metrics(record), step=step - 1)
            logger.save()
        if self.output_dir is not None and trainer.is_global_zero:
            from longctx.lightning.run_dir import write_atomic

            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.output_dir / f"step{step:06d}.json", json.dumps(record, indent=1))

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self._last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_step = int(state_dict.get("last_step", -1))

    # -- the evaluation --------------------------------------------------------------------

    def _setup(self, trainer: Any, pl_module: Any) -> None:
        """The tokenizer, the lengths (checked) and the window, once at the start of the fit."""
        model = pl_module.model
        if not isinstance(model, GPT):
            raise TypeError(f"LongContextEvaluation evaluates a longctx.models.GPT, got {type(model).__name__}")
        datamodule = getattr(trainer, "datamodule", None)
        self._tokenizer = self.tokenizer or getattr(datamodule, "get_tokenizer", lambda: None)()
        if self._tokenizer is None:
            raise ValueError("LongContextEvaluation needs tokenizer= where the data module has no get_tokenizer()")
        seq_len = getattr(datamodule, "seq_len", None)
        self._lengths = self.passkey_lengths(self._tokenizer, seq_len, model.cp.size, model.cp.layout)
        if not self._lengths:
            rank_zero_warn(f"LongContextEvaluation: {self.describe(self._lengths, seq_len)}")
        self._window = seq_len or max(self._lengths)

    @torch.no_grad()
    def evaluate(self, trainer: Any, pl_module: Any) -> dict:
        """One evaluation of the model as it is: ``{"step", "passkey": passkey_table(...),
        "loss_by_position": {"seq_len", "loss", "buckets": [...]}, "seconds"}`` (each where it ran)."""
        if not hasattr(self, "_lengths"):
            self._setup(trainer, pl_module)
        model, datamodule = pl_module.model, getattr(trainer, "datamodule", None)
        cp = model.cp
        group = cp.group if cp.size > 1 else None
        precision = getattr(trainer, "precision_plugin", None)
        autocast = precision.forward_context() if precision is not None else nullcontext()
        unsharded = hasattr(model, "unshard")  # FSDP2: the root's own parameters (embedding, norm)
        was_training = model.training
        model.eval()
        if unsharded:
            model.unshard()
        record: dict = {"step": trainer.global_step}
        start = time.perf_counter()
        try:
            with autocast:
                if self._lengths:
                    record["passkey"] = passkey_table(
                        model,
                        self._tokenizer,
                        self._lengths,
                        self.depths,
                        trials=self.trials,
                        seed=self.seed,
                        group=group,
                        layout=cp.layout,
                    )
                val = getattr(datamodule, "val_dataset", None)
                if self.max_sequences and val is not None and len(val) > 0:
                    record["loss_by_position"] = self._loss_by_quarter(model, val, group, cp.layout)
        finally:
            if unsharded:
                model.reshard()
            model.train(was_training)
        record["seconds"] = time.perf_counter() - start
        return record

    def _loss_by_quarter(self, model, val, group, layout: str) -> dict:
        tokens, docs = val.streams()
        quarter = self._window // 4
        (result,) = evaluate(
            model,
            tokens,
            docs,
            [self._window],
            max_sequences=self.max_sequences,
            edges=[quarter, 2 * quarter, 3 * quarter] if quarter > 0 else [],
            group=group,
            layout=layout,
            device=model.lm_head_weight.device,
        )
        result.pop("per_window", None)
        return result

    @staticmethod
    def metrics(record: dict) -> dict[str, float]:
        """The logged numbers of one evaluation's record."""
        metrics: dict[str, float] = {}
        table = record.get("passkey")
        if table is not None:
            metrics["passkey_acc"] = _mean([a for row in table["accuracy"] for a in row])
            metrics["passkey_logprob"] = _mean([lp for row in table["logprob"] for lp in row])
            for length, row in zip(table["lengths"], table["accuracy"]):
                metrics[f"passkey_acc_{length}"] = _mean(row)
        result = record.get("loss_by_position")
        if result is not None:
            for i, b in enumerate(result["buckets"]):
                if b["loss"] is not None:
                    metrics[f"pos_loss_q{i + 1}"] = b["loss"]
        return metrics


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")
