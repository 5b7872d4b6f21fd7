"""Each class refuses its own bad values, built directly from Python, with the message
train.py prints for the same value (train.py only adds the option's section)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_train_errors import _error, cache, train  # noqa: F401 (fixtures)

from longctx.data import LongDocumentDataModule
from longctx.layouts import check_seq_len
from longctx.lightning import ContextParallelStrategy, NonFiniteGuard
from longctx.lightning.eval_callback import LongContextEvaluation
from longctx.lightning.module import CausalLMModule
from longctx.lightning.train_cli import refused_as
from longctx.lightning.training import RunOptions
from longctx.validation import ArgumentValueError

# (class, its arguments, the option train.py says it of, the command line giving that value)
CASES = [
    (CausalLMModule.check_arguments, dict(lr=-1.0), "model", ["--lr", "-1"]),
    (CausalLMModule.check_arguments, dict(min_lr_ratio=2.0), "model", ["--model.min_lr_ratio", "2"]),
    (CausalLMModule.check_arguments, dict(weight_decay=-0.1), "model", ["--model.weight_decay", "-0.1"]),
    (CausalLMModule.check_arguments, dict(warmup_steps=-1), "model", ["--warmup-steps", "-1"]),
    (CausalLMModule.check_arguments, dict(decay_steps=0), "model", ["--decay-steps", "0"]),
    (CausalLMModule.check_arguments, dict(init_from="nowhere/model"), "model", ["--init-from", "nowhere/model"]),
    (
        CausalLMModule.check_arguments,
        dict(parallel={"cp_attention": "ulises"}),
        "model",
        ["--model.parallel.cp_attention", "ulises"],
    ),
    # Checked where the device is known (train.py: once the Trainer exists, before any data work).
    (
        CausalLMModule.check_arguments,
        dict(parallel={"attention_backend": "fa4"}, device="cpu"),
        "model",
        ["--model.parallel.attention_backend", "fa4", "--accelerator", "cpu"],
    ),
    (ContextParallelStrategy, dict(failure_timeout=float("nan")), "strategy", ["--failure-timeout", ".nan"]),
    (ContextParallelStrategy, dict(stop_grace_period=0.0), "strategy", ["--stop-grace-period", "0"]),
    (ContextParallelStrategy, dict(timeout=timedelta(0)), "strategy", ["--strategy.timeout", "0:00:00"]),
    (ContextParallelStrategy, dict(context_parallel_size=0), "strategy", ["--context-parallel", "0"]),
    (RunOptions, dict(val_every=-1), "run", ["--val-every", "-1"]),
    (RunOptions, dict(val_batches=0), "run", ["--run.val_batches", "0"]),
    (RunOptions, dict(checkpoint_every=-5), "run", ["--checkpoint-every", "-5"]),
    (LongContextEvaluation, dict(every_n_steps=-1), "eval", ["--eval-every", "-1"]),
    (LongContextEvaluation, dict(every_n_steps=2, trials=0), "eval", ["--eval-every", "2", "--eval.trials", "0"]),
    (LongContextEvaluation, dict(every_n_steps=0, max_sequences=-1), "eval", ["--eval.max_sequences", "-1"]),
    (LongContextEvaluation, dict(every_n_steps=2, lengths=[0, 256]), "eval", ["--eval.lengths", "[0, 256]"]),
]


@pytest.mark.parametrize("build,kwargs,section,argv", CASES, ids=[" ".join(c[3]) for c in CASES])
def test_class_and_cli_say_the_same(train, capsys, cache, build, kwargs, section, argv):  # noqa: F811
    with pytest.raises(ValueError) as refused:
        build(**kwargs)
    assert _error(train, argv, capsys, cache) == f"train.py: error: {section}.{refused.value}"


# A value outside a Literal: jsonargparse refuses it on the command line (and --help lists
# the choices); the class, built directly, refuses it in the same words.
CHOICES = [
    (ContextParallelStrategy, dict(layout="diagonal"), "strategy", ["--layout", "diagonal"]),
    (ContextParallelStrategy, dict(data_parallel="zero3"), "strategy", ["--data-parallel", "zero3"]),
    (CausalLMModule.check_arguments, dict(attention="sliding"), "model", ["--attention", "sliding"]),
    (NonFiniteGuard, dict(policy="never"), "nonfinite", ["--nonfinite.policy", "never"]),
    (RunOptions, dict(keep_checkpoints=2), "run", ["--run.keep_checkpoints", "2"]),
]


@pytest.mark.parametrize("build,kwargs,section,argv", CHOICES, ids=[" ".join(c[3]) for c in CHOICES])
def test_choices_said_alike(train, capsys, cache, build, kwargs, section, argv):  # noqa: F811
    with pytest.raises(ValueError) as refused:
        build(**kwargs)
    assert _error(train, argv, capsys, cache) == f"train.py: error: {section}.{refused.value}"


# One refusal from each section's class: the class names the argument (``.argument``, dotted
# where nested) and train.py says it of ``section.argument`` from that name alone.
NAMED = [
    (CausalLMModule.check_arguments, dict(betas=(0.9, 1.5)), "model", "betas", ["--model.betas", "[0.9, 1.5]"]),
    (
        CausalLMModule.check_arguments,
        dict(parallel={"loss_chunk_size": 0}),
        "model",
        "parallel.loss_chunk_size",
        ["--model.parallel.loss_chunk_size", "0"],
    ),
    (CausalLMModule.check_arguments, dict(hf_model="nowhere"), "model", "hf_model", ["--model.hf_model", "nowhere"]),
    (ContextParallelStrategy, dict(timeout=timedelta(0)), "strategy", "timeout", ["--strategy.timeout", "0:00:00"]),
    (LongDocumentDataModule, dict(val_fraction=1.5), "data", "val_fraction", ["--data.val_fraction", "1.5"]),
    (LongDocumentDataModule, dict(tokenizer="no/such.model"), "data", "tokenizer", ["--tokenizer", "no/such.model"]),
    (RunOptions, dict(val_batches=0), "run", "val_batches", ["--run.val_batches", "0"]),
    (NonFiniteGuard, dict(max_skips=3), "nonfinite", "max_skips", ["--nonfinite.max_skips", "3"]),
    (LongContextEvaluation, dict(every_n_steps=2, depths=(0.0, 2.0)), "eval", "depths", ["--eval.depths", "[0, 2]"]),
]


@pytest.mark.parametrize("build,kwargs,section,argument,argv", NAMED, ids=[" ".join(c[4]) for c in NAMED])
def test_sections_name_the_argument(train, capsys, cache, build, kwargs, section, argument, argv):  # noqa: F811
    with pytest.raises(ArgumentValueError) as refused:
        build(**kwargs)
    assert refused.value.argument == argument
    assert str(refused.value) == f"{argument} {refused.value.complaint}"
    line = _error(train, argv, capsys, cache)
    assert line == f"train.py: error: {section}.{argument} {refused.value.complaint}"


def test_refusals_are_placed_by_argument_not_by_text():
    options = {"lr": 1.0, "parallel": {}}
    with pytest.raises(ValueError, match=r"^model\.lr must be > 0$"):
        with refused_as("model", options):
            raise ArgumentValueError("lr", "must be > 0")
    with pytest.raises(ValueError, match=r"^model\.parallel\.cp_attention must be one of ring$"):
        with refused_as("model", options):
            raise ArgumentValueError("cp_attention", "must be one of ring").within("parallel")
    # Words that read like an option are not one: the section is named as a whole.
    with pytest.raises(ValueError, match=r"^model: lr must be > 0$"):
        with refused_as("model", options):
            raise ValueError("lr must be > 0")
    # A callee's own argument, not one of the section's options: said of the section.
    with pytest.raises(ValueError, match=r"^model: world_size must be >= 1$"):
        with refused_as("model", options):
            raise ArgumentValueError("world_size", "must be >= 1")


def test_module_refuses_before_building_a_model():
    # The new user's case: no train.py, the class itself says no.
    with pytest.raises(ValueError, match=r"lr must be a number > 0, got -1.0"):
        CausalLMModule({"preset": "tiny"}, lr=-1.0)
    with pytest.raises(ValueError, match=r"min_lr_ratio must be a number in \[0, 1\], got 2.0"):
        CausalLMModule({"preset": "tiny"}, min_lr_ratio=2.0)


def test_world_checks_where_the_world_is_known(train, capsys, cache):  # noqa: F811
    import lightning as L

    with pytest.raises(ValueError) as refused:
        L.Trainer(accelerator="cpu", devices=2, strategy=ContextParallelStrategy(context_parallel_size=3), logger=False)
    line = _error(train, ["--context-parallel", "3", "--devices", "2"], capsys, cache)
    assert line == f"train.py: error: strategy.{refused.value}"
    with pytest.raises(ValueError) as refused:
        check_seq_len(502, 2, "zigzag")
    assert _error(train, ["--seq-len", "502"], capsys, cache) == f"train.py: error: data: {refused.value}"


@pytest.mark.parametrize(
    "field, value",
    [
        ("activation_checkpointing", "full"),
        ("fuse_pointwise", True),
        ("loss_chunk_size", 1024),
        ("offload_activations", True),
        ("mlp_tile_size", 2048),
        ("attention_head_chunks", 2),
    ],
)
def test_plan_fields_a_model_cannot_take_are_refused(field, value):
    """A plan field applied to a model without the hook for it is refused (one line naming the
    field and the model), never silently ignored; the defaults apply to any model."""
    import torch.nn as nn

    from longctx import ParallelPlan, parallelize

    class Plain(nn.Module):
        def forward(self, x):
            return x

    parallelize(Plain(), plan=ParallelPlan())
    with pytest.raises(ValueError, match=rf"^Plain does not support {field}"):
        parallelize(Plain(), plan=ParallelPlan(**{field: value}))


def test_checkpointed_blocks_needs_a_model_that_takes_them():
    """``checkpointed_blocks`` on a model whose checkpointing setter takes no block count
    (transformers' models: all blocks or none) or that has none is refused in one line."""
    import torch.nn as nn

    from longctx import ParallelPlan, parallelize

    class AllOrNone(nn.Module):
        def set_activation_checkpointing(self, mode):
            self.mode = mode

        def forward(self, x):
            return x

    plan = ParallelPlan(activation_checkpointing="full", checkpointed_blocks=1)
    for model in (AllOrNone(), nn.Identity()):
        with pytest.raises(ValueError, match=rf"^{type(model).__name__} does not support checkpointed_blocks$"):
            parallelize(model, plan=plan)
    parallelize(AllOrNone(), plan=ParallelPlan(activation_checkpointing="full"))
