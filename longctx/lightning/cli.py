"""train.py's LightningCLI: the parser over ``CausalLMModule`` (``model``),
``LongDocumentDataModule`` (``data``), ``ContextParallelStrategy`` (``strategy``), the
``Trainer`` (``trainer``), ``NonFiniteGuard`` (``nonfinite``) and ``RunOptions`` (``run``),
with the helpers that read its configs and render its errors as one line each.

The classes' signatures are the options: their ``Literal`` types and defaults are what the
parser checks and ``--help`` lists; the values a type allows but a class refuses are refused
by the class as it is built (train.py builds them before any data work).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

# The sections of a config, as of the command line (``--model.lr`` = model: lr:).
SECTIONS = ("trainer", "model", "data", "strategy", "nonfinite", "run")
# Trainer arguments train.py derives itself (from the strategy section, the run options
# and its callbacks), so they are not options.
TRAINER_DERIVED = (
    "strategy", "logger", "callbacks", "enable_checkpointing", "val_check_interval", "check_val_every_n_epoch",
    "limit_val_batches", "num_sanity_val_steps", "max_epochs", "enable_model_summary", "default_root_dir",
)



def cli_class(description: str, short_flags: dict[str, str]):
    """The LightningCLI subclass, built lazily: Lightning's import is the slow part of an error."""
    import inspect
    from argparse import RawDescriptionHelpFormatter

    from jsonargparse import DefaultHelpFormatter
    from jsonargparse.typing import NonNegativeFloat, PositiveInt
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningCLI
    from torch.nn.parallel import DistributedDataParallel

    from longctx.data import LongDocumentDataModule
    from longctx.models.lit_module import CausalLMModule

    from .health import NonFiniteGuard
    from .strategy import ContextParallelStrategy
    from .training import RunOptions

    # Trainer options a run needs bounded (Lightning's own types allow an endless -1,
    # zero micro-batches, ...): typed here, so the parser refuses the rest.
    bounded = {"max_steps": PositiveInt, "accumulate_grad_batches": PositiveInt, "num_nodes": PositiveInt,
               "log_every_n_steps": Optional[PositiveInt], "gradient_clip_val": Optional[NonNegativeFloat]}

    class HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
        """Keeps the epilog's table of short flags as written."""

    class TrainCLI(LightningCLI):
        """Parses and checks the options only: train.py builds the objects after its own
        checks, data first (the tokenizer fixes a fresh model's vocabulary)."""

        def __init__(self, args: list[str]) -> None:
            super().__init__(
                CausalLMModule, LongDocumentDataModule, save_config_callback=None, run=False,
                auto_configure_optimizers=False, load_from_checkpoint_support=False, args=args,
                parser_kwargs={"prog": "train.py", "exit_on_error": False, "description": description,
                               "formatter_class": HelpFormatter, "epilog": "short flags:\n" + "\n".join(
                                   f"  {flag:26} --{key}" for flag, key in short_flags.items())},
            )

        def add_default_arguments_to_parser(self, parser) -> None:
            pass  # no --seed_everything: train.py seeds everything from data.seed

        def _set_seed(self) -> None:
            pass  # seeded from data.seed once the options passed their checks

        def add_core_arguments_to_parser(self, parser) -> None:
            parser.add_class_arguments(Trainer, "trainer", skip=set(TRAINER_DERIVED) | set(bounded),
                                       fail_untyped=False, instantiate=False, sub_configs=True)
            defaults = inspect.signature(Trainer.__init__).parameters
            for name, kind in bounded.items():
                default = defaults[name].default
                # Lightning's default max_steps (-1, endless) is no default for a run: a config sets it.
                parser.add_argument(f"--trainer.{name}", type=kind, default=None if name == "max_steps" else default,
                                    help=f"Trainer's {name} (see lightning.pytorch.Trainer)")
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
            for name in bounded:  # jsonargparse's restricted numbers subclass int/float: YAML cannot dump them
                value = self.config.trainer[name]
                if value is not None:
                    self.config.trainer[name] = float(value) if isinstance(value, float) else int(value)

        def instantiate_classes(self) -> None:
            pass

    return TrainCLI


def flag_values(argv: list[str], *names: str) -> list[str]:
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


def _yaml_model(path: str) -> dict:
    import yaml

    try:
        top = yaml.safe_load(Path(path).read_text()) if Path(path).is_file() else None
    except yaml.YAMLError:
        return {}  # jsonargparse says what is wrong with it
    model = top.get("model") if isinstance(top, dict) else None
    return model if isinstance(model, dict) else {}


def _null(value: Any) -> bool:
    return value is None or str(value).strip().lower() in ("null", "none", "")


def hf_model_drops_config_models(args: list[str]) -> list[str]:
    """``args`` with ``--model.model null`` before each place that sets ``model.hf_model`` (a
    flag, or a ``--config`` file), so that a Hugging Face model, which comes from its
    directory, drops the GPT sizes (``model.model``) of the configs read before it (the
    default base, a config like configs/llama3.2-1b-128k.yaml that trains either model).
    Sizes given as flags are the user's: kept, so ``CausalLMModule`` refuses them with the
    HF model; so is a config file that sets both itself."""
    flags = [arg.partition("=")[0] for arg in args]
    if any(flag == "--model.model" or flag.startswith("--model.model.") for flag in flags):
        return args
    out = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        value = value if eq else (args[i + 1] if i + 1 < len(args) else None)
        if i and args[i - 1] in ("--config", "-c"):  # the file after --config: decided at --config
            out.append(arg)
            continue
        sets_hf = False
        if flag == "--model.hf_model":
            sets_hf = not _null(value)
        elif flag in ("--config", "-c") and value is not None:
            model = _yaml_model(value)
            sets_hf = not _null(model.get("hf_model")) and not model.get("model")
        if sets_hf:
            out += ["--model.model", "null"]
        out.append(arg)
    return out


def check_sections(path: str) -> None:
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


def one_line(error: BaseException) -> str:
    """An error as one line; jsonargparse's type errors (a key, the types tried, each one's
    complaint, the value) shortened to the key, the types and the value, and a value outside
    a Literal's choices said as the classes say it (``strategy.layout must be one of ...``)."""
    import ast
    import re

    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    fields = dict(line.split(": ", 1) for line in lines if line.startswith(("Subtypes: ", "Given value: ")))
    key = re.fullmatch(r'Parser key "(.+)":', lines[0]) if lines else None
    choice = re.fullmatch(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)", " ".join(lines[1:]))
    if key and choice:
        choices = ast.literal_eval(f"({choice[1]},)")
        try:
            value = ast.literal_eval(choice[2])
        except (ValueError, SyntaxError):
            value = choice[2]
        return f"{key[1]} must be one of {', '.join(map(str, choices))}, got {value!r}"
    if key and "Given value" in fields:
        expected = f" expected {fields['Subtypes']}," if "Subtypes" in fields else ""
        return f"{lines[0]}{expected} got {fields['Given value']!r}"
    return " ".join(lines)


def expand_short_flags(argv: list[str], short_flags: dict[str, str], repo: Path) -> list[str]:
    """Short flags -> their options; config paths found from the repo too; --print_config
    last (it prints what the arguments after it set as well)."""
    out, print_config = [], []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in short_flags:
            arg = f"--{short_flags[flag]}{eq}{value}"
        elif flag == "--print_config":
            print_config.append(arg)
            continue
        elif i and argv[i - 1] in ("--config", "-c") and not Path(arg).exists() and (repo / arg).exists():
            arg = str(repo / arg)
        out.append(arg)
    return out + print_config


def run_dir_of(checkpoint: Path) -> Path:
    parent = checkpoint.parent
    return parent.parent if parent.name == "checkpoints" else parent


def resolve_accelerator(accelerator: str) -> str:
    """"auto" as the machine has it; a GPU asked for where none is: one line, not Lightning's."""
    import torch

    resolved = "gpu" if accelerator == "cuda" or accelerator == "auto" and torch.cuda.is_available() else accelerator
    resolved = "cpu" if resolved == "auto" else resolved
    if resolved == "gpu" and not torch.cuda.is_available():
        raise ValueError(f"accelerator {accelerator!r} needs a CUDA GPU and none is visible here; "
                         "run on a GPU machine or pass --accelerator cpu (and a CPU-sized --config)")
    return resolved


def resolve_devices(cfg, accelerator: str) -> Any:
    """Processes per node: as given; on CPU "auto" is one process per CP rank."""
    devices = cfg.trainer.devices
    if isinstance(devices, str) and devices.isdigit():
        return int(devices)
    if devices == "auto" and accelerator == "cpu":
        return cfg.strategy.context_parallel_size or 1
    return devices


MODEL_SHAPE_KEYS = ("preset", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size",
                    "head_dim", "tie_embeddings")


class _UnreadTokenizer:
    """A GGUF tokenizer named (and its spec checked) but not read: reading it is data work."""
    vocab_size, eos_id, bos_id = 1, 0, None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("checked only: the GGUF tokenizer was not read")

    decode = encode


def launched_world() -> Optional[int]:
    """The world an external launcher (torchrun) set up, if any."""
    return int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None
