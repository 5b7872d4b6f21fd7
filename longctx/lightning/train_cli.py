"""train.py's LightningCLI: the parser over ``CausalLMModule`` (``model``),
``LongDocumentDataModule`` (``data``), ``ContextParallelStrategy`` (``strategy``), the
``Trainer`` (``trainer``), ``NonFiniteGuard`` (``nonfinite``), ``LongContextEvaluation``
(``eval``) and ``RunOptions`` (``run``); it builds what it parses, and renders every refusal
as one line.

The classes' signatures are the options: their ``Literal`` types and defaults are what the
parser checks and ``--help`` lists; the values a type allows but a class refuses are refused
by the class as it is built. ``TrainCLI`` builds every object before any data work (run
options, guard, strategy, data module, Trainer; the model's arguments checked), each inside
its section, so a refusal is said of that section's option (``model.lr must be ...``). The
model itself is built once the data module's tokenizer exists (``instantiate_model``): the
tokenizer decides its vocabulary.

This module imports Lightning; train.py reaches it through ``cli.cli_class``, after its own
fast checks.
"""

from __future__ import annotations

import inspect
import os
from argparse import RawDescriptionHelpFormatter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from jsonargparse import DefaultHelpFormatter
from jsonargparse.typing import NonNegativeFloat, PositiveInt
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from torch.nn.parallel import DistributedDataParallel

from longctx.data import LongDocumentDataModule

from .cli_args import check_sections, expand_short_flags, flag_values, hf_model_drops_config_models
from .cli_settings import (
    UnreadTokenizer,
    flatten,
    launched_world,
    layout_of,
    model_vocab,
    resolve_accelerator,
    resolve_devices,
)
from .eval_callback import LongContextEvaluation
from .health import NonFiniteGuard
from .module import CausalLMModule, deferred_parameters
from .resume import MODEL_SHAPE_KEYS, changes_what_is_trained, earlier_checkpoints, run_dir_of
from .strategy import ContextParallelStrategy, check_divisible
from .training import RunOptions

# Trainer arguments train.py derives itself (from the strategy section, the run options
# and its callbacks), so they are not options.
TRAINER_DERIVED = (
    "strategy",
    "logger",
    "callbacks",
    "enable_checkpointing",
    "val_check_interval",
    "check_val_every_n_epoch",
    "limit_val_batches",
    "num_sanity_val_steps",
    "max_epochs",
    "enable_model_summary",
    "default_root_dir",
)

# Trainer options a run needs bounded (Lightning's own types allow an endless -1,
# zero micro-batches, ...): typed here, so the parser refuses the rest.
BOUNDED = {
    "max_steps": PositiveInt,
    "accumulate_grad_batches": PositiveInt,
    "num_nodes": PositiveInt,
    "log_every_n_steps": Optional[PositiveInt],
    "gradient_clip_val": Optional[NonNegativeFloat],
}


@contextmanager
def refused_as(section: str, options: Any) -> Iterator[None]:
    """A class's refusal, raised while building ``section``, said of that section's option
    ``section.ARGUMENT`` where it refused one of its ``options`` (an ``ArgumentValueError``
    naming it, or an argument nested in it: ``parallel.cp_attention``), else of the section
    as a whole: ``section: message``."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from ..validation import ArgumentValueError

    try:
        yield
    except ArgumentValueError as e:
        # A callee's refusal of its own argument is not this section's option: said of the section.
        option = f"{section}.{e.argument}" if e.argument.split(".", 1)[0] in options else None
        raise ValueError(f"{option} {e.complaint}" if option else f"{section}: {e}") from None
    except (ValueError, TypeError, FileNotFoundError, MisconfigurationException) as e:
        raise ValueError(f"{section}: {e}") from None


class HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """Keeps the epilog's table of short flags as written."""


class TrainCLI(LightningCLI):
    """train.py's LightningCLI (see the module's doc); ``cli_class`` sets the three ``cli_``
    attributes: the program's description, its short flags, its default config file."""

    cli_description: str = ""
    cli_short_flags: dict[str, str] = {}
    cli_default_config: Path

    @property
    def cli_repo(self) -> Path:
        return self.cli_default_config.resolve().parents[1]

    def __init__(self, args: list[str], *, instantiate: bool = True, device_checks: bool = True) -> None:
        self._instantiate, self.device_checks = instantiate, device_checks
        self.resume_checkpoint: Optional[Path] = None
        self.run_config: Optional[Any] = None  # the resumed run's own config.yaml, parsed
        self.overrides: dict = {}  # dotted key -> (run's value, value now), on resume
        self.trainer = self.datamodule = self.model = self.run_lock = None
        self.run_plan: Optional[Any] = None  # check_fit's: handed to the model (instantiate_model)
        super().__init__(
            CausalLMModule,
            LongDocumentDataModule,
            save_config_callback=None,
            run=False,
            auto_configure_optimizers=False,
            load_from_checkpoint_support=False,
            args=args,
            parser_kwargs={
                "prog": "train.py",
                "exit_on_error": False,
                "description": self.cli_description,
                "formatter_class": HelpFormatter,
                "epilog": "short flags:\n"
                + "\n".join(f"  {flag:26} --{key}" for flag, key in self.cli_short_flags.items()),
            },
        )

    # -- the parser ----------------------------------------------------------------------

    def add_default_arguments_to_parser(self, parser) -> None:
        pass  # no --seed_everything: train.py seeds everything from data.seed

    def _set_seed(self) -> None:
        pass  # seeded from data.seed once the options passed their checks

    def add_core_arguments_to_parser(self, parser) -> None:
        parser.add_class_arguments(
            Trainer,
            "trainer",
            skip=set(TRAINER_DERIVED) | set(BOUNDED),
            fail_untyped=False,
            instantiate=False,
            sub_configs=True,
        )
        defaults = inspect.signature(Trainer.__init__).parameters
        for name, kind in BOUNDED.items():
            default = defaults[name].default
            # Lightning's default max_steps (-1, endless) is no default for a run: a config sets it.
            parser.add_argument(
                f"--trainer.{name}",
                type=kind,
                default=None if name == "max_steps" else default,
                help=f"Trainer's {name} (see lightning.pytorch.Trainer)",
            )
        # CausalLMModule's ``model`` also takes a GPTConfig; as an option it is the mapping
        # only: jsonargparse would turn it into a GPTConfig and drop ``preset``. The module is
        # built by instantiate_model, after the tokenizer: not by the parser.
        parser.add_class_arguments(
            self.model_class, "model", skip={"model"}, fail_untyped=False, instantiate=False, sub_configs=True
        )
        parser.add_argument(
            "--model.model",
            type=Optional[dict[str, Any]],
            default=None,
            help="the GPT: GPTConfig fields plus `preset` (tiny, gpt-125m, llama3-8b, ...); "
            "with init_from, overrides of non-size fields",
        )
        parser.add_lightning_class_args(self.datamodule_class, "data")

    def add_arguments_to_parser(self, parser) -> None:
        # **ddp_kwargs would bring every DistributedDataParallel argument along: not ours.
        ddp = set(inspect.signature(DistributedDataParallel.__init__).parameters)
        parser.add_class_arguments(ContextParallelStrategy, "strategy", skip=ddp)
        parser.add_class_arguments(NonFiniteGuard, "nonfinite", skip={"group"})
        # The evaluation during training: off unless eval.every_n_steps is set; its JSON
        # goes into the run's folder, its tokenizer is the data module's.
        parser.add_class_arguments(LongContextEvaluation, "eval", skip={"tokenizer", "output_dir"})
        parser.set_defaults({"eval.every_n_steps": 0})
        parser.add_class_arguments(RunOptions, "run")
        parser.add_argument(
            "--resume",
            type=Optional[str],
            default=None,
            help="checkpoint, checkpoint directory or run directory (its newest complete "
            "checkpoint); continues from the run's own config.yaml",
        )
        # One value, set once: the data splits like the strategy; the module's FLOPs use the data's length.
        parser.link_arguments("strategy.context_parallel_size", "data.context_parallel_size")
        # On instantiation: the strategy is built (and its world checked) before the data module.
        parser.link_arguments("strategy", "data.layout", compute_fn=layout_of, apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.seq_len")

    def parse_arguments(self, parser, args) -> None:
        """On ``--resume`` flags not repeated keep the run's values; an explicit ``--config``
        and flags given then are overrides (reported)."""
        # A Hugging Face model comes from its directory: the GPT sizes of configs read before
        # it are dropped (sizes given as flags are kept, and refused with it).
        args = hf_model_drops_config_models(expand_short_flags(list(args), self.cli_short_flags, self.cli_repo))
        configs = flag_values(args, "--config", "-c")
        for path in configs:
            check_sections(path)
        resume = flag_values(args, "--resume")
        run_yaml = None
        if resume and resume[-1] not in ("null", "None"):
            from .checkpoint_io import find_resume_checkpoint

            self.resume_checkpoint = find_resume_checkpoint(resume[-1])
            run_yaml = run_dir_of(self.resume_checkpoint) / "config.yaml"
            run_yaml = run_yaml if run_yaml.exists() else None
            if run_yaml is not None:
                check_sections(str(run_yaml))  # a run from before train.py's LightningCLI: flat keys
        base = run_yaml or (None if configs else self.cli_default_config)
        self.config = self._parse(parser, [*(["--config", str(base)] if base else []), *args])
        self.name = Path(configs[-1]).stem if configs else self.cli_default_config.stem
        if run_yaml is not None:
            self.run_config = self._parse(parser, ["--config", str(run_yaml)])
            before, now = flatten(self.run_config), flatten(self.config)
            self.overrides = {
                k: (before.get(k), v)
                for k, v in now.items()
                if k not in ("config", "resume", "run.output_dir") and before.get(k) != v
            }
            if self.config.run.output_dir == self.run_config.run.output_dir:  # not given now: where it is
                self.config.run.output_dir = str(run_dir_of(self.resume_checkpoint))

    @staticmethod
    def _parse(parser, args: list[str]):
        config = parser.parse_args(args)  # (LightningCLI's own warns when sys.argv is also set)
        for name in BOUNDED:  # jsonargparse's restricted numbers subclass int/float: YAML cannot dump them
            value = config.trainer[name]
            if value is not None:
                config.trainer[name] = float(value) if isinstance(value, float) else int(value)
        return config

    def dump(self) -> str:
        """The config as YAML (every option): ``--config`` reads it back to the same run."""
        return self.parser.dump(self.config, skip_unset=False)

    # -- building ------------------------------------------------------------------------

    def before_instantiate_classes(self) -> None:
        """The model's arguments, the resume, and the settings left to the run (pinned in its
        config.yaml), all before anything is built."""
        if not self._instantiate:
            return
        cfg = self.config
        with refused_as("model", cfg.model.as_dict()):
            CausalLMModule.check_arguments(**cfg.model.as_dict())
        if cfg.model.init_from is not None and self.device_checks:
            from longctx.models.checkpoint_import import check_init_from

            # The checkpoint's files checked and its sizes against the config's, before the
            # tokenizer and the data: its tensors are read (and their values checked) with the model.
            check_init_from(cfg.model.init_from, cfg.model.model, configs=self.cli_default_config.parent)
        if self.resume_checkpoint is not None:
            self.check_resume()
        trainer = cfg.trainer
        if self.device_checks or trainer.accelerator not in ("gpu", "cuda"):
            trainer.accelerator = resolve_accelerator(trainer.accelerator)
        else:
            trainer.accelerator = "gpu"  # checked only: this machine may have none
        trainer.devices = resolve_devices(trainer.devices, trainer.accelerator, cfg.strategy.context_parallel_size)
        if trainer.precision is None:
            trainer.precision = "bf16-mixed" if trainer.accelerator == "gpu" else "32-true"
        if cfg.model.decay_steps is None:  # pinned: extending max_steps on resume keeps the schedule
            cfg.model.decay_steps = trainer.max_steps
        # An HF model comes from its directory: a config's GPT sizes do not apply to it.
        cfg.model.model = None if cfg.model.hf_model is not None else dict(cfg.model.model or {})
        # A tokenizer trained on the corpus, its size left at the data module's default, is
        # trained to the model's vocabulary (an HF model's, capped at 32768).
        default_vocab = self.parser.get_defaults().data.vocab_size
        if cfg.data.tokenizer is None and cfg.model.init_from is None and cfg.data.vocab_size == default_vocab:
            cfg.data.vocab_size = model_vocab(cfg.model)
        self._choose_output_dir()

    def _choose_output_dir(self) -> None:
        """A resumed run continues in its own folder; a new one never writes into a folder
        that holds another run: the default one (``runs/<config name>``) moves on to
        ``runs/<config name>-2``, ... (said once), a given one is refused."""
        from .launcher import LAUNCHER_PID_ENV
        from .run_dir import fresh_run_dir, run_outputs
        from .training import say

        run, ckpt = self.config.run, self.resume_checkpoint
        own = run_dir_of(ckpt) if ckpt is not None else None
        if run.output_dir is None:
            if own is not None:
                run.output_dir = str(own)
                return
            default = Path("runs") / self.name
            out = fresh_run_dir(default)
            if out != default:
                say(
                    f"output: {default} holds an earlier run, so this one writes to {out} "
                    f"(--resume {default} continues that one; --output-dir DIR picks the folder)"
                )
            run.output_dir = str(out)
            return
        out = Path(run.output_dir)
        if own is not None and out.resolve() == own.resolve():
            return
        if LAUNCHER_PID_ENV in os.environ:
            return  # a rank that rank 0 launched: rank 0 checked the folder before it
        found = run_outputs(out)
        if found:
            raise ValueError(
                f"run.output_dir {out} already holds a run ({', '.join(found)}); a new run there would "
                f"overwrite it: continue it with --resume {out}, or pass another --output-dir"
            )

    def _check_world(self) -> None:
        """``world``: the one the command asks for (the launcher's, else devices x nodes; None
        where unknown), checked against the CP size as the strategy checks it, before any
        process starts."""
        devices, nodes = self.config.trainer.devices, self.config.trainer.num_nodes
        if devices == "auto" and self.device_checks and self.config.trainer.accelerator == "gpu":
            import torch

            devices = torch.cuda.device_count()
        per_node = len(devices) if isinstance(devices, (list, tuple)) else devices
        per_node = per_node if isinstance(per_node, int) else None
        world = launched_world()
        if world is not None and per_node is not None and per_node * nodes != world:
            raise ValueError(
                f"trainer.devices {devices} x num_nodes {nodes} does not match the launcher's world "
                f"of {world} processes"
            )
        world = world if world is not None else None if per_node is None else per_node * nodes
        cp = self.config.strategy.context_parallel_size
        if world is not None and cp is not None:
            with refused_as("strategy", self.config.strategy.as_dict()):
                check_divisible(world, cp, per_node, nodes)
        self.world = world

    def instantiate_classes(self) -> None:
        """Run options, guard, strategy (then the world checked against it) and data module as
        jsonargparse builds them, each refusal said of its section; then the Trainer, the
        model's arguments checked on its device, the run directory locked (rank 0)."""
        if not self._instantiate:
            return
        from .run_dir import lock_run_dir, make_run_dir
        from .training import launch_rank

        cfg = self.config
        self.config_init = self.parser.instantiate(
            cfg,
            instantiators=[
                (self._instantiator("run"), RunOptions, False),
                (self._instantiator("nonfinite"), NonFiniteGuard, False),
                (self._instantiator("eval", given=self._eval_arguments), LongContextEvaluation, False),
                (self._instantiator("strategy", then=self._check_world), ContextParallelStrategy, False),
                (self._instantiator("data", given=self._data_arguments), LongDocumentDataModule, False),
            ],
        )
        self.datamodule = self.config_init.data
        self.check_evaluation()
        self.out = Path(self.config_init.run.output_dir)
        if self.device_checks:
            self.trainer = self.instantiate_trainer()
            with refused_as("model", cfg.model.as_dict()):
                CausalLMModule.check_arguments(**cfg.model.as_dict(), device=self.trainer.strategy.root_device)
            self._check_memory()
            if launch_rank() == 0:
                self.run_lock = lock_run_dir(self.out)
            else:  # every rank writes there (sharded checkpoints): each one refuses alike
                make_run_dir(self.out)

    def _check_memory(self) -> None:
        """The memory model's refusal of the run (``CausalLMModule.check_fit``), before any data
        work: on this rank's GPU and in the memory this host has available now, shared by its
        ranks (checked by the launching process, before it starts the others). The plan it
        resolves is kept (``run_plan``): the fit takes it instead of resolving it again."""
        from longctx.memory_fit import host_available_bytes

        from .launcher import LAUNCHER_PID_ENV

        self.run_plan = CausalLMModule.check_fit(
            self.trainer,
            self.datamodule,
            host_total=None if LAUNCHER_PID_ENV in os.environ else host_available_bytes(),
            **self.config.model.as_dict(),
        )

    @staticmethod
    def _instantiator(section: str, given: Any = dict, then: Any = None):
        """Builds a section's class with its parsed arguments (and those ``given()`` adds);
        ``then`` checks what needs the object."""

        def build(cls, *args: Any, **kwargs: Any):
            with refused_as(section, kwargs):
                built = cls(*args, **{**kwargs, **given()})
            if then is not None:
                then()
            return built

        return build

    def _eval_arguments(self) -> dict:
        return {"output_dir": str(Path(self.config.run.output_dir) / "eval")}

    @property
    def evaluation(self) -> Optional[Any]:
        """The built ``LongContextEvaluation`` where the run evaluates (``--eval-every N``), else None."""
        evaluation = self.config_init.eval
        return evaluation if evaluation.every_n_steps else None

    def check_evaluation(self, tokenizer: Any = None) -> None:
        """The evaluation's lengths against the training length and the CP layout (before any
        data work) and, given the data module's tokenizer, against the needle, which it then
        says: the callback's own check at the start of the fit, so the same line."""
        from .training import say

        evaluation, data = self.evaluation, self.datamodule
        if evaluation is None:
            return
        cp = data.context_parallel_size or 1
        with refused_as("eval", self.config.eval.as_dict()):
            lengths = evaluation.passkey_lengths(tokenizer, data.seq_len, cp, data.layout)
        if tokenizer is not None:
            say(f"eval: {evaluation.describe(lengths, data.seq_len)}")

    @property
    def data_parallel_size(self) -> int:
        """The run's data-parallel size where the command decides it (world / CP), else 1."""
        world, cp = getattr(self, "world", None), self.config.strategy.context_parallel_size
        return world // cp if world and cp and world % cp == 0 else 1

    def _data_arguments(self) -> dict:
        # The data module checks its sequence length against the CP size the strategy will
        # have (the world's, where the strategy's is null) and reads the model's own
        # tokenizer where none is given.
        cp = self.config.strategy.context_parallel_size or self.world
        return {"context_parallel_size": cp, "tokenizer": self._tokenizer()}

    def _tokenizer(self) -> Any:
        """The data module's tokenizer: see training.data_tokenizer; checked only: a GGUF one
        named, not read."""
        from .training import data_tokenizer

        cfg = self.config
        spec = cfg.data.tokenizer if cfg.data.tokenizer is not None else cfg.model.init_from
        if not self.device_checks:
            from longctx.models import GGUFTokenizer
            from longctx.models.checkpoint_import import check_checkpoint_spec

            if GGUFTokenizer.accepts(spec):
                check_checkpoint_spec("tokenizer", spec)
                return UnreadTokenizer()
        return data_tokenizer(cfg.data.tokenizer, cfg.model.init_from, cfg.model.hf_model)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The run's Trainer (training.build_trainer) around the built strategy; Lightning's
        refusals said of ``trainer``."""
        from .training import build_trainer

        init, trainer = self.config_init, self.config.trainer.as_dict()
        with refused_as("trainer", trainer):
            callbacks = [init.nonfinite, *([self.evaluation] if self.evaluation is not None else [])]
            return build_trainer(
                trainer, init.strategy, init.run, self.out, callbacks, on_train_start=self._write_config
            )

    def _write_config(self, trainer: Any, module: Any) -> None:
        # At train start, i.e. after a resumed checkpoint was accepted: a rejected resume
        # leaves the run's config.yaml as it was. Without ``resume``: loaded with --config it
        # starts the same run afresh.
        from .run_dir import write_atomic

        if trainer.is_global_zero:
            self.config.resume = None
            # The run plan as resolved (every "auto" decided): loaded back, it resolves the same.
            for key, value in module.run_plan.config_entries().items():
                self.config[key] = value
            write_atomic(self.out / "config.yaml", self.dump())

    def instantiate_model(self) -> Any:
        """The module, once the data module's tokenizer exists: a fresh GPT gets the tokenizer's
        vocabulary (a configured one kept where larger: a Llama-shaped preset beside a smaller
        trained tokenizer); config.yaml records it. It gets the run plan ``check_fit`` resolved
        (``use_run_plan``) where that was made for its shape: not where the vocabulary grew."""
        from longctx.models import GPTConfig

        cfg = self.config.model
        vocab = self.datamodule.get_tokenizer().vocab_size
        grown = False  # check_fit planned the configured vocabulary
        if cfg.init_from is None and cfg.hf_model is None:
            configured = GPTConfig.from_dict(cfg.model).vocab_size
            grown = vocab > configured
            cfg.model = {**cfg.model, "vocab_size": max(vocab, configured)}
        with deferred_parameters():  # each rank draws its parameters once launched, all at once
            self.model = CausalLMModule(**cfg.as_dict())
        if self.model.config.vocab_size < vocab:
            raise ValueError(f"the tokenizer has {vocab} tokens but the model only {self.model.config.vocab_size}")
        if self.run_plan is not None and not grown:
            self.model.use_run_plan(self.run_plan)
        return self.model

    def check_resume(self) -> None:
        """Refuse a resume that cannot continue the run, and say what a flag changes."""
        from longctx.checkpoint_verify import checkpoint_step

        from .checkpoint_io import nonfinite_entry
        from .training import say

        cfg, ckpt = self.config, self.resume_checkpoint
        changed = [
            f"{k} {before} -> {now}"
            for k in MODEL_SHAPE_KEYS
            for before, now in [self.overrides.get(f"model.model.{k}", (None, None))]
            if before != now
        ]
        if changed:
            raise ValueError(
                f"--resume {ckpt}: the checkpoint holds another model shape than asked for "
                f"({', '.join(changed)}); resume with the run's model (drop those flags)"
            )
        changed = [f"{k} {a!r} -> {b!r}" for k, (a, b) in self.overrides.items() if changes_what_is_trained(k)]
        if changed:
            raise ValueError(
                f"--resume {ckpt}: the run was trained with other data, tokenizer or model settings than "
                f"asked for here ({', '.join(changed)}); continuing it with them would train something else "
                "on the run's weights: drop those flags to continue the run, or start a new run "
                "(another --output-dir)"
            )
        step = checkpoint_step(ckpt)  # the checkpoint was verified when parsing picked it
        nonfinite = nonfinite_entry(ckpt)
        if nonfinite:
            earlier = earlier_checkpoints(ckpt, step)
            raise ValueError(
                f"--resume {ckpt}: the checkpoint (step {step}) holds NaN/Inf in {nonfinite}, so training on "
                "from it gives NaN: resume from a checkpoint saved before the values broke"
                + (f" (--resume {earlier[0]})" if earlier else "")
                + " (a lower --lr, or --nonfinite.policy skip, may keep them finite)"
            )
        max_steps = cfg.trainer.max_steps
        if step >= 0 and step >= max_steps:
            decay = cfg.model.decay_steps or max_steps
            raise ValueError(
                f"--resume {ckpt}: that run already finished (step {step} of --max-steps {max_steps}); to "
                f"train it further pass --max-steps N with N > {step} (the lr schedule still ends at step "
                f"{decay}: add --decay-steps N to stretch it)"
            )
        where = run_dir_of(ckpt) / "config.yaml"
        if self.run_config is None:
            say(f"resume: {where} not found; using --config and flags as given")
            return
        changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self.overrides.items())
        say(f"resume: the run's own config {where}" + (f"; overridden here: {changes}" if changes else ""))
        if "data.seq_len" in self.overrides:
            say(
                "resume: data.seq_len changed, so the corpus is cut into other sequences: the data order "
                "restarts its epoch from the beginning (the weights and optimizer state continue)"
            )
        if "trainer.max_steps" in self.overrides and "model.decay_steps" not in self.overrides:
            say(f"resume: the lr schedule keeps ending at step {cfg.model.decay_steps} (--decay-steps N changes it)")
