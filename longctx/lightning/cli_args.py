"""train.py's command line before jsonargparse reads it: short flags expanded and config
paths found from the repo (``expand_short_flags``), a config file's top level checked
(``check_sections``), a Hugging Face model dropping the GPT sizes of the configs read before
it (``hf_model_drops_config_models``), and the values of a flag (``flag_values``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The sections of a config, as of the command line (``--model.lr`` = model: lr:).
SECTIONS = ("trainer", "model", "data", "strategy", "nonfinite", "eval", "run")


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
        raise ValueError(
            f"config {path}: unknown top-level key(s) {unknown}; a config has the sections "
            f"{', '.join(SECTIONS)}, like the options (`python train.py --print_config` shows one)"
        )


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
