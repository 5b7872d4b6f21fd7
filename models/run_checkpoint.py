"""This project's own checkpoints as a starting point: a train.py run folder or its ``.ckpt``.

``load_run_checkpoint(spec)`` gives ``(GPTConfig, state_dict)`` like the Hugging Face and
GGUF loaders of ``checkpoint_import`` (which dispatches here, so ``--init-from runs/NAME``
and ``load_pretrained("runs/NAME/checkpoints/step000200.ckpt")`` work): the config is the
resolved one ``CausalLMModule`` saved in ``hyper_parameters["model"]``, the tensors those of
the GPT under the module's ``model.`` prefix. The file is read as data only (tensors and
plain containers); unpickling arbitrary objects, which can run code, needs ``trust_code``.

``run_tokenizer(spec)`` is the tokenizer that run trained with, from the run's config.yaml:
its ``data.tokenizer``, else its model's (``init_from`` / ``hf_model``), else the SentencePiece
model the data module trained for that corpus and settings (read from the cache, or trained
again, deterministically, where the cache is gone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch

from .config import GPTConfig

PathLike = Union[str, "Path"]

# Prefixes a wrapped GPT's keys may carry: the LightningModule attribute, DDP, torch.compile,
# Fabric. The GPT's own keys (embed., blocks., norm., lm_head.) never start with these.
WRAPPER_PREFIXES = ("model.", "module.", "_orig_mod.", "_forward_module.")


def extract_gpt_state(state: dict, wanted: set[str]) -> tuple[dict, list[str]]:
    """The GPT tensors of a (wrapped) state dict and the keys that were not the GPT's."""
    out: dict = {}
    other: list[str] = []
    for key, value in state.items():
        k = key
        while k not in wanted and k.startswith(WRAPPER_PREFIXES):
            k = k.split(".", 1)[1]
        if k in wanted and isinstance(value, torch.Tensor):
            if k in out:
                raise ValueError(f"checkpoint holds {k!r} twice (as {key!r} and another key)")
            out[k] = value
        else:
            other.append(key)
    return out, other


def torch_load_data(path: Path, *, trust_code: bool = False) -> Any:
    """``torch.load`` of data only; unpickling arbitrary objects (which can run code) only
    with the explicit ``trust_code`` opt-in."""
    if trust_code:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(
            f"{path} holds objects other than tensors and plain data, and unpickling them can run "
            f"code. Refused (evaluate.py takes --trust-checkpoint-code for a file you trust). ({exc})"
        ) from None


def _checkpoint_in(directory: Path) -> Optional[Path]:
    for candidate in (directory / "checkpoints" / "last.ckpt", directory / "last.ckpt"):
        if candidate.is_file():
            return candidate
    return None


def is_run_checkpoint(spec: Any) -> bool:
    """A ``.ckpt`` file, or a run folder (or its checkpoints/ folder) holding ``last.ckpt``."""
    if not isinstance(spec, (str, Path)):
        return False
    path = Path(spec).expanduser()
    if path.is_file():
        return path.suffix == ".ckpt"
    return path.is_dir() and _checkpoint_in(path) is not None


def resolve_run_checkpoint(spec: PathLike) -> Path:
    """The ``.ckpt`` file ``spec`` names (a run folder: its ``checkpoints/last.ckpt``)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        found = _checkpoint_in(path)
        if found is None:
            raise FileNotFoundError(f"{spec}: no checkpoints/last.ckpt or last.ckpt in this folder")
        return found
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(spec)!r} does not exist (give a .ckpt file or a run folder)")
    return path


def run_directory(checkpoint: Path) -> Optional[Path]:
    """The run folder (the one with config.yaml) a checkpoint belongs to, or None."""
    for directory in (checkpoint.parent, checkpoint.parent.parent):
        if (directory / "config.yaml").is_file():
            return directory
    return None


def _gpt_keys(config: GPTConfig) -> set[str]:
    from .gpt import GPT

    with torch.device("meta"):  # the names only: no memory, no initialisation work
        return set(GPT(config).state_dict())


def load_run_checkpoint(spec: PathLike, *, trust_code: bool = False) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of the GPT in a train.py checkpoint (``.ckpt`` or run folder)."""
    path = resolve_run_checkpoint(spec)
    ckpt = torch_load_data(path, trust_code=trust_code)
    if not isinstance(ckpt, dict):
        raise TypeError(f"{path}: expected a checkpoint dict, got {type(ckpt).__name__}")
    hparams = ckpt.get("hyper_parameters") or {}
    if hparams.get("hf_model"):
        raise ValueError(
            f"{path} trained the Hugging Face model {hparams['hf_model']!r} (hf_model), not a GPT: "
            "it cannot be loaded as one"
        )
    saved = hparams.get("model")
    if not isinstance(saved, dict):
        raise ValueError(f"{path} carries no model config (hyper_parameters['model']): not a checkpoint of train.py")
    config = GPTConfig.from_dict(dict(saved))
    state, _ = extract_gpt_state(ckpt.get("state_dict", ckpt), _gpt_keys(config))
    return config, state


def _read_run_config(run: Path) -> dict:
    import yaml

    with open(run / "config.yaml") as f:
        return yaml.safe_load(f) or {}


def run_tokenizer(spec: PathLike) -> Any:
    """The tokenizer the run at ``spec`` (run folder or ``.ckpt``) trained with."""
    from longctx.data import as_text_tokenizer

    from .gguf_tokenizer import GGUFTokenizer

    checkpoint = resolve_run_checkpoint(spec)
    run = run_directory(checkpoint)
    if run is None:
        raise ValueError(
            f"{spec}: no config.yaml beside the checkpoint to take the run's tokenizer from; give the tokenizer"
        )
    config = _read_run_config(run)
    data, model = dict(config.get("data") or {}), config.get("model") or {}
    named = data.get("tokenizer") or model.get("init_from")
    hf = model.get("hf_model")
    if named is None and hf and any((Path(hf) / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        named = hf
    if named is not None:
        if is_run_checkpoint(named):
            return run_tokenizer(named)
        return GGUFTokenizer.from_gguf(named) if GGUFTokenizer.accepts(named) else as_text_tokenizer(named)
    # Trained by the data module for that corpus and those settings: the same call finds it.
    from longctx.data import LongDocumentDataModule

    data.pop("tokenizer", None)
    return LongDocumentDataModule(**data).get_tokenizer()
