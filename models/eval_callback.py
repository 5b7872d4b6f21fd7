"""The long-context evaluation during training: a Lightning callback.

Every ``every_n_steps`` optimizer steps, ``LongContextEvaluation`` runs passkey retrieval
(``passkey.py``) at the training length and below, and the loss by position (``evaluation.py``)
of a few windows of the training length from the validation stream, on the model as it is,
over the run's own CP group (the prompts sharded and run with ring attention as the training
batches are). It logs, beside the training loss (train.py: metrics.csv):

* ``passkey_acc`` (mean over lengths and depths), ``passkey_acc_<L>`` per length and
  ``passkey_logprob`` (mean log-probability of the answer tokens);
* ``pos_loss_q1`` ... ``pos_loss_q4``: the mean loss of each quarter of the window (late
  quarters falling below early ones: the model uses its long context).

    from longctx.models.eval_callback import LongContextEvaluation
    trainer = L.Trainer(..., callbacks=[LongContextEvaluation(every_n_steps=100)])

The tokenizer is the data module's (``get_tokenizer()``) unless one is given; the windows
come from its ``val_dataset`` (none there: only passkey). Every rank runs it (the CP ranks
together; data-parallel replicas evaluate the same prompts) and logs the same numbers. Under
FSDP the root's parameters are gathered for the evaluation and freed after.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional, Sequence

import lightning as L
import torch

from longctx.layouts import check_seq_len, required_multiple

from .evaluation import evaluate
from .gpt import GPT
from .passkey import passkey_overhead, passkey_table


class LongContextEvaluation(L.Callback):
    """Passkey accuracy and loss by position every ``every_n_steps`` optimizer steps.

    Args:
        every_n_steps: evaluate after every this many optimizer steps.
        lengths: passkey prompt lengths; None: the training length, its half and quarter
            (rounded to what the CP layout splits, those long enough for the needle).
        depths: where the key is planted (0: start of the filler, 1: its end).
        trials: keys per (length, depth).
        max_sequences: validation windows for the loss by position (0: none).
        tokenizer: what encodes the passkey prompts; None: the data module's.
        seed: draws the keys (the same keys at every evaluation: comparable over steps).
    """

    def __init__(
        self,
        every_n_steps: int,
        *,
        lengths: Optional[Sequence[int]] = None,
        depths: Sequence[float] = (0.0, 0.5, 1.0),
        trials: int = 2,
        max_sequences: int = 2,
        tokenizer: Any = None,
        seed: int = 0,
    ):
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.depths, self.trials, self.max_sequences = tuple(depths), trials, max_sequences
        self.tokenizer, self.seed = tokenizer, seed
        self._last_step = -1

    def _setup(self, trainer: Any, pl_module: Any) -> None:
        """The tokenizer, the CP context and the lengths, checked once at the start of the fit."""
        model = pl_module.model
        if not isinstance(model, GPT):
            raise TypeError(f"LongContextEvaluation evaluates a longctx.models.GPT, got {type(model).__name__}")
        datamodule = getattr(trainer, "datamodule", None)
        self._tokenizer = self.tokenizer or datamodule.get_tokenizer()
        cp = model.cp
        self._seq_len = getattr(datamodule, "seq_len", None) or max(self.lengths or [0])
        overhead = passkey_overhead(self._tokenizer)
        multiple = required_multiple(cp.size, cp.layout) if cp.size > 1 else 1
        if self.lengths is None:  # the training length and below, long enough for a needle
            wanted = {self._seq_len // k // multiple * multiple for k in (4, 2, 1)}
            self._lengths = sorted(n for n in wanted if n >= 2 * overhead)
            return
        for n in self.lengths:
            if n <= overhead:
                raise ValueError(
                    f"LongContextEvaluation: passkey length {n} is shorter than the needle, question and "
                    f"answer ({overhead} tokens with this tokenizer)"
                )
            if cp.size > 1:
                check_seq_len(n, cp.size, cp.layout)
        self._lengths = list(self.lengths)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._setup(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or step == self._last_step:
            return  # (several micro-batches end at one optimizer step under accumulation)
        self._last_step = step
        pl_module.log_dict(self.evaluate(trainer, pl_module), on_step=True, on_epoch=False, sync_dist=False)

    @torch.no_grad()
    def evaluate(self, trainer: Any, pl_module: Any) -> dict[str, float]:
        if not hasattr(self, "_lengths"):
            self._setup(trainer, pl_module)
        model, datamodule, seq_len = pl_module.model, getattr(trainer, "datamodule", None), self._seq_len
        cp = model.cp
        group = cp.group if cp.size > 1 else None
        precision = getattr(trainer, "precision_plugin", None)
        autocast = precision.forward_context() if precision is not None else nullcontext()
        unsharded = hasattr(model, "unshard")  # FSDP2: the root's own parameters (embedding, norm)
        was_training = model.training
        model.eval()
        if unsharded:
            model.unshard()
        try:
            with autocast:
                metrics = {} if not self._lengths else self._passkey(model, group, cp.layout)
                val = getattr(datamodule, "val_dataset", None)
                if self.max_sequences and val is not None and len(val) > 0:
                    metrics.update(self._loss_by_quarter(model, val, seq_len, group, cp.layout))
        finally:
            if unsharded:
                model.reshard()
            model.train(was_training)
        return metrics

    def _passkey(self, model, group, layout: str) -> dict[str, float]:
        table = passkey_table(
            model,
            self._tokenizer,
            self._lengths,
            self.depths,
            trials=self.trials,
            seed=self.seed,
            group=group,
            layout=layout,
        )
        metrics = {
            "passkey_acc": _mean([a for row in table["accuracy"] for a in row]),
            "passkey_logprob": _mean([lp for row in table["logprob"] for lp in row]),
        }
        for length, row in zip(table["lengths"], table["accuracy"]):
            metrics[f"passkey_acc_{length}"] = _mean(row)
        return metrics

    def _loss_by_quarter(self, model, val, seq_len: int, group, layout: str) -> dict[str, float]:
        tokens, docs = val.streams()
        quarter = seq_len // 4
        edges = [quarter, 2 * quarter, 3 * quarter] if quarter > 0 else []
        (result,) = evaluate(
            model,
            tokens,
            docs,
            [seq_len],
            max_sequences=self.max_sequences,
            edges=edges,
            group=group,
            layout=layout,
            device=model.lm_head_weight.device,
        )
        return {f"pos_loss_q{i + 1}": b["loss"] for i, b in enumerate(result["buckets"]) if b["loss"] is not None}


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")
