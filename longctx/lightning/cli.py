"""train.py's command line: ``cli_class`` (the LightningCLI of ``train_cli``, imported on first
use: Lightning's import is the slow part of an error) and ``one_line`` (an error as train.py
prints it)."""

from __future__ import annotations

from pathlib import Path


def cli_class(description: str, short_flags: dict[str, str], default_config: Path):
    """The LightningCLI subclass of train.py: ``train_cli.TrainCLI`` with its description, short
    flags and default config.

    ``TrainCLI(argv)`` parses (configs/``default_config`` or a resumed run's own config.yaml
    <- ``--config`` files <- flags, in order) and builds every object before any data work;
    ``instantiate=False``: parses only; ``device_checks=False``: checks what the command itself
    decides, on any machine (a GPU command on a CPU machine: tests/lightning/test_readme_commands.py):
    no CUDA needed for a GPU accelerator, no Trainer (so none of Lightning's device checks),
    the model without the plan's kernel checks, no GGUF tokenizer or --init-from checkpoint
    read, no run directory locked."""
    from .train_cli import TrainCLI

    attributes = dict(cli_description=description, cli_short_flags=dict(short_flags), cli_default_config=default_config)
    return type("TrainCLI", (TrainCLI,), attributes)


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
