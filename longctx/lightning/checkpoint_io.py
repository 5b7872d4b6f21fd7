"""Checkpoint files that a resume never trusts blindly.

Two kinds, both written so that a crash mid-save never leaves something a resume picks:

* single files (``AtomicCheckpointIO``, Lightning's ``CheckpointIO``): ``torch.save`` to
  ``.NAME.tmp-PID`` beside the target, fsync, atomic rename. Integrity = the zip CRC of
  every member (``torch.save`` writes them; ``torch.load`` never checks them);
* sharded folders (``save_sharded_checkpoint``, for FSDP2): ``torch.distributed.checkpoint``
  into ``.NAME.tmp-PID``, then ``manifest.json`` (size + crc32 of every file, the step),
  fsync, atomic rename by rank 0. Integrity = the manifest. ``save_training_state`` /
  ``load_training_state``: a Lightning checkpoint dict and an FSDP2 model with its
  optimizers, through them (what ``ContextParallelStrategy`` routes FSDP runs to).

``find_resume_checkpoint`` orders both kinds by the training step stored in them (never
by file time) and takes the newest intact one, warning about each one it skips.
Every pickle is read with ``weights_only=True`` or an allowlist: a checkpoint is data.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

MANIFEST_NAME = "manifest.json"
METADATA_NAME = "metadata.pt"  # rank 0's ``metadata`` dict (trainer progress, hparams, step)
_MANIFEST_FORMAT = "longctx-sharded-checkpoint"
_DCP_METADATA_NAME = ".metadata"
# Leftovers of interrupted saves: ``.NAME.tmp-PID`` (being written), ``.NAME.old-PID``
# (the previous folder, moved aside while a sharded save replaces it).
_LEFTOVER = re.compile(r"^\..+\.(?:tmp|old)-(\d+)$")
_CHUNK = 1 << 23

PathLike = Union[str, Path]


class CorruptCheckpointError(RuntimeError):
    """A checkpoint failed its integrity check; the message names the bad file."""


# -- shared helpers ---------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:  # makes renames durable; some filesystems cannot open directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _size_and_crc32(path: Path) -> tuple[int, int]:
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return size, crc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(folder: PathLike) -> list[Path]:
    """Delete the temp files/folders that killed saves left in ``folder``; returns them.

    Only leftovers whose writer PID is no longer alive: a save still running is left alone.
    """
    removed = []
    for entry in Path(folder).iterdir():
        match = _LEFTOVER.match(entry.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _check_weights_only(what: str, obj: Any) -> bytes:
    """``torch.save`` bytes of ``obj``, refused now if a ``weights_only`` load could not read them."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise TypeError(
            f"{what} holds objects a weights_only load refuses, so no resume could read it; keep it "
            f"to plain containers, numbers, strings and tensors, or allowlist the type with "
            f"torch.serialization.add_safe_globals ({exc})"
        ) from None
    return buffer.getvalue()


# -- single files ---------------------------------------------------------------------


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temp file beside the target, fsync, then ``os.replace``.

    Readers see either the previous complete file or the new complete file, never a partial
    one (POSIX rename is atomic within a filesystem); temp files of killed saves are removed
    by the next save in the folder. Loading verifies every zip CRC first and unpickles with
    ``weights_only=True`` only. Remote URLs fall back to Lightning's writer.
    """

    def save_checkpoint(self, checkpoint: dict, path: PathLike, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent)
        tmp = _temp_path(path)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict:
        if weights_only is False:
            raise ValueError(
                f"{type(self).__name__} loads checkpoints with weights_only=True only (a pickle can run "
                "code); allowlist extra types with torch.serialization.add_safe_globals instead"
            )
        if "://" not in str(path):
            problem = checkpoint_problem(path)
            if problem is not None:
                raise CorruptCheckpointError(f"checkpoint {path} failed verification: {problem}")
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


def _file_problem(path: Path) -> Optional[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(n.endswith("data.pkl") for n in archive.namelist()):
                return "not a torch.save archive (no data.pkl)"
            bad_member = archive.testzip()
    except Exception as exc:  # noqa: BLE001 - any way a damaged archive fails to parse
        return f"unreadable archive ({type(exc).__name__}: {exc})"
    if bad_member is not None:
        return f"CRC mismatch in member {bad_member} (the data is corrupted)"
    return None


# -- sharded folders ------------------------------------------------------------------


def _read_manifest(path: Path) -> dict:
    manifest_file = path / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_file.read_text())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{manifest_file} is missing (the save did not finish)") from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{manifest_file} is unreadable ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (manifest.get("format") != _MANIFEST_FORMAT or not isinstance(files, dict)
            or not isinstance(manifest.get("global_step"), int)):
        raise CorruptCheckpointError(f"{manifest_file} is not a {_MANIFEST_FORMAT} manifest")
    for name in files:  # flat names only: a manifest must not point outside its folder
        if Path(name).name != name or name in (".", ".."):
            raise CorruptCheckpointError(f"{manifest_file} lists a file outside the folder: {name!r}")
    for required in (_DCP_METADATA_NAME, METADATA_NAME):
        if required not in files:
            raise CorruptCheckpointError(f"{manifest_file} does not list {required}")
    return manifest


def _sharded_problem(path: Path, rank: int = 0, world_size: int = 1) -> Optional[str]:
    """The first problem with ``path``'s files (this rank's share of them), or None."""
    try:
        files = _read_manifest(path)["files"]
    except CorruptCheckpointError as exc:
        return str(exc)
    for name in sorted(files)[rank::world_size]:
        expected, file = files[name], path / name
        try:
            size, crc = _size_and_crc32(file)
        except OSError as exc:
            return f"{file} is unreadable ({exc})"
        if size != expected.get("size"):
            return f"{file} has {size} bytes, the manifest says {expected.get('size')}"
        if crc != expected.get("crc32"):
            return f"{file} is corrupted (crc32 {crc:#010x}, the manifest says {expected.get('crc32'):#010x})"
    return None


def _rank_and_world(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _from_rank0(value: Any, group: Optional[dist.ProcessGroup]) -> Any:
    if _rank_and_world(group)[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _from_all(value: Any, group: Optional[dist.ProcessGroup]) -> list:
    world = _rank_and_world(group)[1]
    if world == 1:
        return [value]
    out: list = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def _replace(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first, then deleted."""
    if not (path.exists() or path.is_symlink()):
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        return
    aside = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)  # left by an earlier failed save of this process
    os.rename(path, aside)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(aside, path)  # the previous checkpoint back under its name: never left hidden
        raise
    _fsync_dir(path.parent)
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside)
    else:
        aside.unlink()


def save_sharded_checkpoint(path: PathLike, state: dict[str, Any], metadata: dict[str, Any], *,
                            group: Optional[dist.ProcessGroup] = None) -> None:
    """Write a sharded checkpoint folder; call on every rank of ``group`` (default: world).

    ``state`` maps names to state dicts of DTensors/tensors (e.g. ``{"model": ...,
    "optimizer_0": ...}`` from ``torch.distributed.checkpoint.state_dict``); ``metadata``
    is a dict rank 0 writes (trainer progress, hparams); its ``global_step`` (an int) orders
    checkpoints for ``find_resume_checkpoint``. Without a process group this is a
    one-process save.
    """
    path = Path(path)
    rank, world = _rank_and_world(group)
    step = metadata.get("global_step") if isinstance(metadata, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"metadata must be a dict with an int global_step >= 0, got {step!r}")
    tmp, error = None, None
    if rank == 0:
        try:
            metadata_bytes = _check_weights_only("checkpoint metadata", metadata)
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(path.parent)
            tmp = _temp_path(path)
            shutil.rmtree(tmp, ignore_errors=True)  # an earlier failed save of this process
            tmp.mkdir()
        except Exception as exc:  # noqa: BLE001 - every rank must raise, not wait for rank 0
            error = f"{type(exc).__name__}: {exc}"
    tmp, error = _from_rank0((tmp, error), group)
    if error is not None:
        raise _save_failed(path, f"rank 0: {error}")
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group,
                 no_dist=world == 1)
        # Every rank checksums a share of the files, so rank 0 does not read the whole model.
        names = _from_rank0(sorted(os.listdir(tmp)) if rank == 0 else None, group)
        sums, error = {}, None
        try:
            for name in names[rank::world]:
                size, crc = _size_and_crc32(tmp / name)
                sums[name] = {"size": size, "crc32": crc}
        except OSError as exc:
            error = f"rank {rank}: {exc}"
        shares = _from_all((sums, error), group)
        if rank == 0:
            try:
                errors = [e for _, e in shares if e]
                if errors:
                    raise OSError(errors[0])
                files = {name: entry for share, _ in shares for name, entry in share.items()}
                files[METADATA_NAME] = _write_synced(tmp / METADATA_NAME, metadata_bytes)
                manifest = {"format": _MANIFEST_FORMAT, "global_step": step, "world_size": world,
                            "files": files}
                _write_synced(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
                _fsync_dir(tmp)
                _replace(tmp, path)
                error = None
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
        error = _from_rank0(error, group)
        if error is not None:
            raise _SaveFailed(f"rank 0: {error}")
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException, raised on every rank
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failed(path, _cause(exc)) from exc
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


class _SaveFailed(Exception):
    """A sharded save failed on some rank; every rank raises it (its text: the cause)."""


def _cause(error: BaseException) -> str:
    """One line: which rank failed how (DCP's exception holds every failed rank's error)."""
    if isinstance(error, _SaveFailed):
        return str(error)
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        first = failures[rank][0]
        return f"rank {rank}: {type(first).__name__}: {first}"
    return f"{type(error).__name__}: {error}"


def _save_failed(path: Path, cause: str) -> RuntimeError:
    """The error every rank raises when a sharded save fails: one line that says what
    failed and that nothing else changed (the temp folder is removed, ``path`` and every
    earlier checkpoint are untouched)."""
    cause = " ".join(cause.split())  # one line, whatever the cause's message looks like
    return RuntimeError(f"cannot save sharded checkpoint {path} ({cause}); nothing of it was kept, the "
                        "checkpoints saved before are intact and --resume takes the newest of them")


def _write_synced(path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "crc32": zlib.crc32(data)}


def load_sharded_checkpoint(path: PathLike, state: dict[str, Any], *,
                            group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
    """Verify ``path`` against its manifest, then load it into ``state`` in place; returns
    the metadata. Call on every rank of ``group``.

    ``state`` is built like the saved one (e.g. ``get_model_state_dict`` of the current
    model); DCP reshards, so the world size may differ from the one that saved. Put the
    loaded dicts back with ``set_model_state_dict`` / ``set_optimizer_state_dict``.
    Raises ``CorruptCheckpointError`` naming the bad file on every rank.
    """
    path = Path(path)
    rank, world = _rank_and_world(group)
    problems = [p for p in _from_all(_sharded_problem(path, rank, world), group) if p]
    if problems:
        raise CorruptCheckpointError(f"sharded checkpoint {path} failed verification: {problems[0]}")
    _read_dcp_metadata(path)  # a clear error here, instead of inside DCP's fallbacks
    dcp.load(state, storage_reader=_SafeFileSystemReader(path), planner=_SafeLoadPlanner(),
             process_group=group, no_dist=world == 1)
    return _load_metadata(path)


def _load_metadata(path: Path) -> dict[str, Any]:
    return torch.load(path / METADATA_NAME, map_location="cpu", weights_only=True)


def save_training_state(path: PathLike, checkpoint: dict[str, Any]) -> None:
    """Lightning's checkpoint dict of an FSDP2 run as a sharded folder: its model and optimizer
    states (taken out of ``checkpoint``) as shards, the rest as rank 0's metadata. Every rank."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optimizer_state
    save_sharded_checkpoint(path, state, checkpoint)


def load_training_state(path: PathLike, model: torch.nn.Module, optimizers: list, *,
                        strict: bool = True) -> dict[str, Any]:
    """Load a folder ``save_training_state`` wrote into an FSDP2 ``model`` and its ``optimizers``,
    in place (verified first; resharded to this world); returns the metadata. Every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"{path} is a single-file checkpoint (data_parallel='ddp'); this run shards with FSDP2 and "
            "resumes from sharded checkpoint folders. Resume it with data_parallel='ddp'"
        )
    state = {"state_dict": get_model_state_dict(model)}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer)
    metadata = load_sharded_checkpoint(path, state)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state[f"optimizer_{i}"])
    return metadata


def consolidate_checkpoint(sharded_path: PathLike, out_file: PathLike, *,
                           safetensors_model_key: Optional[str] = None) -> None:
    """One file with the full (unsharded) state of a sharded checkpoint; no process group.

    Default: a ``torch.save`` file ``{"state": {name: full state dict}, "metadata": ...}``.
    With ``safetensors_model_key`` (e.g. ``"model"``): only that entry's tensors, as
    safetensors. Needs memory for the whole state on one machine.
    """
    sharded_path, out_file = Path(sharded_path), Path(out_file)
    problem = _sharded_problem(sharded_path)
    if problem is not None:
        raise CorruptCheckpointError(f"sharded checkpoint {sharded_path} failed verification: {problem}")
    _read_dcp_metadata(sharded_path)
    full: dict[str, Any] = {}
    _load_state_dict(full, storage_reader=_SafeFileSystemReader(sharded_path),
                     planner=_SafeConsolidatePlanner(), no_dist=True)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    if safetensors_model_key is None:
        AtomicCheckpointIO().save_checkpoint({"state": full, "metadata": _load_metadata(sharded_path)}, out_file)
        return
    from safetensors.torch import save_file

    if safetensors_model_key not in full:
        raise KeyError(f"{sharded_path} has no {safetensors_model_key!r} entry (it has {sorted(full)})")
    tensors = {k: v.contiguous().clone() for k, v in full[safetensors_model_key].items() if torch.is_tensor(v)}
    tmp = _temp_path(out_file)
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)


# DCP reads its ``.metadata`` with a bare pickle.load and non-tensor entries with
# torch.load(weights_only=False); both would run code from a crafted checkpoint.
_DCP_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not a checkpoint metadata type")


def _read_dcp_metadata(path: Path) -> Any:
    file = path / _DCP_METADATA_NAME
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(f"{file}: {exc}") from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class _SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # Only the global metadata file: we always write it (no per-rank fallback).
        metadata = _read_dcp_metadata(Path(self.path))
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyBytes:
    """Mixin for DCP load planners: non-tensor entries through ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class _SafeLoadPlanner(_WeightsOnlyBytes, dcp.DefaultLoadPlanner):
    pass


# Fills an empty dict from the checkpoint's own metadata (what torch's dcp_to_torch_save
# uses: the public dcp.load only fills the keys it is given).
class _SafeConsolidatePlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass


# -- choosing a checkpoint ------------------------------------------------------------


def _looks_like_checkpoint(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".ckpt"
    return path.is_dir() and ((path / MANIFEST_NAME).exists() or (path / _DCP_METADATA_NAME).exists()
                              or path.suffix == ".ckpt")


def checkpoint_problem(path: PathLike) -> Optional[str]:
    """Why ``path`` (a checkpoint file or sharded folder) cannot be trusted, or None if intact.

    Reads the whole checkpoint (every CRC).
    """
    path = Path(path)
    if path.is_dir():
        return _sharded_problem(path)
    return _file_problem(path)


def is_complete_checkpoint(path: PathLike) -> bool:
    """True when ``path`` is an intact checkpoint file or sharded folder."""
    return checkpoint_problem(path) is None


def checkpoint_step(path: PathLike) -> int:
    """The training step a checkpoint was saved at (its ``global_step``; -1 when absent)."""
    path = Path(path)
    if path.is_dir():
        return _read_manifest(path)["global_step"]
    # mmap: only the small pickle is read, not the tensors.
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    step = ckpt.get("global_step", -1) if isinstance(ckpt, dict) else -1
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def find_resume_checkpoint(path: PathLike) -> Path:
    """The checkpoint to resume from: ``path`` itself if intact, else the newest intact one.

    ``path`` may be a checkpoint file, a sharded checkpoint folder, a checkpoint directory
    or a run directory (searched with its ``checkpoints/`` subdirectory). Newest = highest
    stored training step (``last``/``last.ckpt`` wins a tie). Temp files/folders of interrupted
    saves are never candidates; each skipped checkpoint gets a warning naming it.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--resume path {path} does not exist")
    skip: set[Path] = set()
    if _looks_like_checkpoint(path) or path.is_file():
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warnings.warn(f"checkpoint {path} is incomplete or corrupt ({problem}); "
                      "looking for the newest intact one beside it", stacklevel=2)
        search, skip = [path.parent], {path}
    else:
        search = [path, path / "checkpoints"]
    candidates = [p for d in search if d.is_dir() for p in sorted(d.iterdir())
                  if not p.name.startswith(".") and p not in skip and _looks_like_checkpoint(p)]
    ranked = []
    for candidate in candidates:
        try:
            ranked.append((checkpoint_step(candidate), candidate.stem == "last", candidate.name, candidate))
        except Exception as exc:  # noqa: BLE001 - an unreadable candidate is skipped, loudly
            warnings.warn(f"skipping checkpoint {candidate}: unreadable ({type(exc).__name__}: {exc})",
                          stacklevel=2)
    for *_, candidate in sorted(ranked, key=lambda r: r[:3], reverse=True):
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate
        warnings.warn(f"skipping checkpoint {candidate}: incomplete or corrupt ({problem})", stacklevel=2)
    raise FileNotFoundError(
        f"no intact checkpoint under {path} (found {len(candidates)} candidate(s), none intact)"
    )
