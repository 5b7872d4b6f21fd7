"""This project's own checkpoints as a starting point: a train.py run folder or its ``.ckpt``.

A run checkpoint is a single ``.ckpt`` file (DDP runs) or a sharded ``.ckpt`` folder (FSDP2
runs, the default on GPUs: torch.distributed.checkpoint shards with a ``manifest.json``). A run
folder (or its ``checkpoints/`` folder) stands for its ``checkpoints/last.ckpt``, else for its
newest intact checkpoint (by the step stored in it; a warning names each one skipped).

``load_run_checkpoint(spec)`` gives ``(GPTConfig, state_dict)`` like the Hugging Face and
GGUF loaders of ``checkpoint_import`` (which dispatches here, so ``--init-from runs/NAME``
and ``load_pretrained("runs/NAME/checkpoints/step000200.ckpt")`` work): the config is the
resolved one ``CausalLMModule`` saved in ``hyper_parameters["model"]``, the tensors those of
the GPT under the module's ``model.`` prefix. A file is read as data only (tensors and plain
containers); unpickling arbitrary objects, which can run code, needs ``trust_code``. A sharded
folder is verified against its manifest and only its model tensors are read, full, in one
process (``longctx.checkpoint_verify.read_sharded_tensors``): not the optimizer state, and
never an arbitrary pickle (``trust_code`` changes nothing there).

``run_tokenizer(spec)`` is the tokenizer that run trained with, from the run's config.yaml:
its ``data.tokenizer``, else its model's (``init_from`` / ``hf_model``), else the SentencePiece
model the data module trained for that corpus and settings (read from the cache, or trained
again, deterministically, where the cache is gone).
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from longctx.checkpoint_verify import (
    CorruptCheckpointError,
    is_checkpoint,
    is_sharded_checkpoint,
    pick_checkpoint,
    read_checkpoint_metadata,
    read_sharded_tensors,
    sharded_problem,
)

from .config import GPTConfig

PathLike = Union[str, "Path"]

# Prefixes a wrapped GPT's keys may carry: the LightningModule attribute, DDP, torch.compile,
# Fabric. The GPT's own keys (embed., blocks., norm., lm_head.) never start with these.
WRAPPER_PREFIXES = ("model.", "module.", "_orig_mod.", "_forward_module.")


def gpt_name(key: str, wanted: set[str]) -> Optional[str]:
    """The GPT's name (one of ``wanted``) for a (wrapped) state-dict key, or None."""
    while key not in wanted and key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key if key in wanted else None


def extract_gpt_state(state: dict, wanted: set[str]) -> tuple[dict, list[str]]:
    """The GPT tensors of a (wrapped) state dict and the keys that were not the GPT's."""
    out: dict = {}
    other: list[str] = []
    for key, value in state.items():
        k = gpt_name(key, wanted)
        if k is not None and isinstance(value, torch.Tensor):
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
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(
            f"{path} holds objects other than tensors and plain data, and unpickling them can run "
            f"code. Refused (evaluate.py takes --trust-checkpoint-code for a file you trust). ({exc})"
        ) from None


class DamagedCheckpointError(ValueError):
    """A checkpoint file failed an integrity check; the message names the file (one line)."""


def _looks_like_run(path: Path) -> bool:
    """A train.py run folder or its checkpoints/ folder, whether or not a checkpoint is in it
    (not a Hugging Face directory: a config.json or tokenizer files)."""
    if any((path / name).exists() for name in HF_FILES):
        return False
    return (
        (path / "config.yaml").is_file()
        or (path / "checkpoints").is_dir()
        or any(is_checkpoint(p) for p in path.glob("*.ckpt"))
    )


# Files that make a folder a Hugging Face model or tokenizer directory, not a run.
HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def is_run_checkpoint(spec: Any) -> bool:
    """A ``.ckpt`` file or sharded ``.ckpt`` folder, or a train.py run folder (or its
    checkpoints/ folder), even one without a checkpoint (``resolve_run_checkpoint`` says so)."""
    if not isinstance(spec, (str, Path)):
        return False
    path = Path(spec).expanduser()
    if path.is_file():
        return path.suffix == ".ckpt"
    return path.is_dir() and (is_sharded_checkpoint(path) or _looks_like_run(path))


def resolve_run_checkpoint(spec: PathLike) -> Path:
    """The ``.ckpt`` file or sharded folder ``spec`` names (a run folder: its intact
    ``checkpoints/last.ckpt``, else its newest intact checkpoint)."""
    path = Path(spec).expanduser()
    if is_sharded_checkpoint(path):
        return path
    if path.is_dir():
        # No tensor data's CRCs: loading reads the model tensors only (a folder's, verified then).
        found, skipped = pick_checkpoint([path, path / "checkpoints"], last_first=True, data_crcs=False)
        if found is None and skipped:
            raise DamagedCheckpointError(
                f"{spec} holds no intact checkpoint (" + "; ".join(" ".join(s.split()) for s in skipped) + ")"
            )
        if found is None:
            raise FileNotFoundError(
                f"{spec} holds no checkpoint to load (no checkpoints/last.ckpt or checkpoints/step*.ckpt); "
                "train.py saves them with --checkpoint-every N"
            )
        for problem in skipped:
            warnings.warn(f"{spec} stands for {found}; skipped {problem}", stacklevel=2)
        return found
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {str(spec)!r} does not exist (give a .ckpt file or folder, or a run folder)"
        )
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


def _read_sharded(path: Path, read: Any) -> Any:
    """``read()`` of a sharded folder, its integrity and data-only refusals as one
    ``DamagedCheckpointError`` naming the bad file."""
    try:
        return read()
    except (CorruptCheckpointError, pickle.UnpicklingError) as exc:
        message = " ".join(str(exc).split())
        raise DamagedCheckpointError(message if str(path) in message else f"{path}: {message}") from None


def _sharded_hparams(path: Path) -> dict:
    def read() -> dict:
        problem = sharded_problem(path, shard_crcs=False)
        if problem is not None:
            raise CorruptCheckpointError(f"sharded checkpoint {path} failed verification: {problem}")
        return read_checkpoint_metadata(path)

    return _hparams(path, _read_sharded(path, read))


def _hparams(path: Path, ckpt: Any) -> dict:
    if not isinstance(ckpt, dict):
        raise TypeError(f"{path}: expected a checkpoint dict, got {type(ckpt).__name__}")
    return ckpt.get("hyper_parameters") or {}


def run_checkpoint_hparams(spec: PathLike, *, trust_code: bool = False) -> tuple[Path, dict]:
    """The checkpoint ``spec`` names and the ``hyper_parameters`` saved in it (a sharded
    folder's from its ``metadata.pt``, verified against the manifest); no tensors read."""
    path = resolve_run_checkpoint(spec)
    if path.is_dir():
        return path, _sharded_hparams(path)
    return path, _hparams(path, torch_load_data(path, trust_code=trust_code))


def _model_config(path: Path, hparams: dict) -> GPTConfig:
    if hparams.get("hf_model"):
        raise ValueError(
            f"{path} trained the Hugging Face model {hparams['hf_model']!r} (hf_model), not a GPT: "
            "it cannot be loaded as one"
        )
    saved = hparams.get("model")
    if not isinstance(saved, dict):
        raise ValueError(f"{path} carries no model config (hyper_parameters['model']): not a checkpoint of train.py")
    return GPTConfig.from_dict(dict(saved))


# A sharded folder's model tensors: Lightning's checkpoint["state_dict"], saved under this name.
SHARDED_STATE_KEY = "state_dict."


def load_run_checkpoint(spec: PathLike, *, trust_code: bool = False) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of the GPT in a train.py checkpoint (``.ckpt`` file or sharded
    folder, or a run folder). A sharded folder: its model tensors only, full, one process."""
    path = resolve_run_checkpoint(spec)
    if path.is_dir():
        config = _model_config(path, _sharded_hparams(path))
        wanted = _gpt_keys(config)

        def keep(name: str) -> bool:
            return name.startswith(SHARDED_STATE_KEY) and gpt_name(name[len(SHARDED_STATE_KEY) :], wanted) is not None

        tensors = _read_sharded(path, lambda: read_sharded_tensors(path, keep))
        state, _ = extract_gpt_state({k[len(SHARDED_STATE_KEY) :]: v for k, v in tensors.items()}, wanted)
        return config, state
    ckpt = torch_load_data(path, trust_code=trust_code)
    config = _model_config(path, _hparams(path, ckpt))
    state, _ = extract_gpt_state(ckpt.get("state_dict", ckpt), _gpt_keys(config))
    return config, state


def _read_run_config(run: Path) -> dict:
    import yaml

    with open(run / "config.yaml") as f:
        return yaml.safe_load(f) or {}


def run_tokenizer(spec: PathLike) -> Any:
    """The tokenizer the run at ``spec`` (run folder, or ``.ckpt`` file or folder) trained with."""
    from longctx.data import as_text_tokenizer

    from .gguf_tokenizer import GGUFTokenizer

    checkpoint = resolve_run_checkpoint(spec)
    if checkpoint.is_dir():
        _sharded_hparams(checkpoint)  # a damaged folder is said now, before any tokenizer work
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
