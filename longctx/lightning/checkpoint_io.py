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

``find_resume_checkpoint`` takes the newest intact one by stored step, warning about each
one it skips. Every pickle is read with ``weights_only=True`` or an allowlist: a checkpoint
is data. Which checkpoint to take, the integrity checks and the data-only DCP readers (and
the names and manifest format they read) are longctx.checkpoint_verify's (Lightning-free:
models/ reads run checkpoints with it).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from longctx.checkpoint_verify import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    METADATA_NAME,
    CorruptCheckpointError,
    PathLike,
    SafeConsolidatePlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
    checkpoint_problem,
    checkpoint_step,
    is_checkpoint,
    pick_checkpoint,
    read_dcp_metadata,
    sharded_problem,
    size_and_crc32,
)

# Leftovers of interrupted saves: ``.NAME.tmp-PID`` (being written), ``.NAME.old-PID``
# (the previous folder, moved aside while a sharded save replaces it).
_LEFTOVER = re.compile(r"^\..+\.(?:tmp|old)-(\d+)$")


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

    def load_checkpoint(
        self,
        path: PathLike,
        map_location: Optional[Any] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict:
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


# -- sharded folders ------------------------------------------------------------------


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


def save_sharded_checkpoint(
    path: PathLike, state: dict[str, Any], metadata: dict[str, Any], *, group: Optional[dist.ProcessGroup] = None
) -> None:
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
        dcp.save(
            state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group, no_dist=world == 1
        )
        # Every rank checksums a share of the files, so rank 0 does not read the whole model.
        names = _from_rank0(sorted(os.listdir(tmp)) if rank == 0 else None, group)
        sums, error = {}, None
        try:
            for name in names[rank::world]:
                size, crc = size_and_crc32(tmp / name)
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
                manifest = {"format": MANIFEST_FORMAT, "global_step": step, "world_size": world, "files": files}
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
    return RuntimeError(
        f"cannot save sharded checkpoint {path} ({cause}); nothing of it was kept, the "
        "checkpoints saved before are intact and --resume takes the newest of them"
    )


def _write_synced(path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "crc32": zlib.crc32(data)}


def load_sharded_checkpoint(
    path: PathLike, state: dict[str, Any], *, group: Optional[dist.ProcessGroup] = None
) -> dict[str, Any]:
    """Verify ``path`` against its manifest, then load it into ``state`` in place; returns
    the metadata. Call on every rank of ``group``.

    ``state`` is built like the saved one (e.g. ``get_model_state_dict`` of the current
    model); DCP reshards, so the world size may differ from the one that saved. Put the
    loaded dicts back with ``set_model_state_dict`` / ``set_optimizer_state_dict``.
    Raises ``CorruptCheckpointError`` naming the bad file on every rank.
    """
    path = Path(path)
    rank, world = _rank_and_world(group)
    problems = [p for p in _from_all(sharded_problem(path, rank, world), group) if p]
    if problems:
        raise CorruptCheckpointError(f"sharded checkpoint {path} failed verification: {problems[0]}")
    read_dcp_metadata(path)  # a clear error here, instead of inside DCP's fallbacks
    dcp.load(
        state,
        storage_reader=SafeFileSystemReader(path),
        planner=SafeLoadPlanner(),
        process_group=group,
        no_dist=world == 1,
    )
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


def load_training_state(
    path: PathLike, model: torch.nn.Module, optimizers: list, *, strict: bool = True
) -> dict[str, Any]:
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


def consolidate_checkpoint(
    sharded_path: PathLike, out_file: PathLike, *, safetensors_model_key: Optional[str] = None
) -> None:
    """One file with the full (unsharded) state of a sharded checkpoint; no process group.

    Default: a ``torch.save`` file ``{"state": {name: full state dict}, "metadata": ...}``.
    With ``safetensors_model_key`` (e.g. ``"model"``): only that entry's tensors, as
    safetensors. Needs memory for the whole state on one machine.
    """
    sharded_path, out_file = Path(sharded_path), Path(out_file)
    problem = sharded_problem(sharded_path)
    if problem is not None:
        raise CorruptCheckpointError(f"sharded checkpoint {sharded_path} failed verification: {problem}")
    read_dcp_metadata(sharded_path)
    full: dict[str, Any] = {}
    _load_state_dict(
        full, storage_reader=SafeFileSystemReader(sharded_path), planner=SafeConsolidatePlanner(), no_dist=True
    )
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


# -- choosing a checkpoint ------------------------------------------------------------


def nonfinite_entry(path: PathLike) -> Optional[str]:
    """The first tensor of a single-file checkpoint's weights or optimizer state that holds NaN
    or Inf, named with its count (``state_dict['w'] (3 of 64 values)``), or None. A sharded
    folder is not read here (None)."""
    path = Path(path)
    if path.is_dir():
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(ckpt, dict):
        return None

    def walk(value: Any, where: str) -> Optional[str]:
        if torch.is_tensor(value):
            if value.is_floating_point() or value.is_complex():
                bad = int((~torch.isfinite(value)).sum())
                if bad:
                    return f"{where} ({bad} of {value.numel()} values)"
            return None
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            found = walk(item, f"{where}[{key!r}]")
            if found:
                return found
        return None

    return walk(ckpt.get("state_dict"), "state_dict") or walk(ckpt.get("optimizer_states"), "optimizer_states")


def _check_loads_as_data(path: Path) -> None:
    """A checkpoint named on purpose that a ``weights_only`` load refuses: one line, not
    torch's advice to load it with ``weights_only=False`` (which could run its code)."""
    if path.is_dir():
        return  # a sharded folder's pickles are read through allowlists when it loads
    try:
        checkpoint_step(path)
    except pickle.UnpicklingError as exc:
        found = re.search(r"(?:Trying to load |Unsupported global: )(.*?)(?:\n|$)", str(exc))
        why = found[1].strip().rstrip(".") if found else " ".join(str(exc).split())[:200]
        raise ValueError(
            f"--resume path {path} is not a checkpoint that loads as data only ({why}); a pickle that "
            "needs more can run code, so it is not loaded: resume from a checkpoint train.py wrote"
        ) from None


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
    if is_checkpoint(path) or path.is_file():
        problem = checkpoint_problem(path)
        if problem is None:
            _check_loads_as_data(path)
            return path
        warnings.warn(
            f"checkpoint {path} is incomplete or corrupt ({problem}); looking for the newest intact one beside it",
            stacklevel=2,
        )
        found, skipped = pick_checkpoint([path.parent], exclude=path)
    else:
        found, skipped = pick_checkpoint([path, path / "checkpoints"])
    for why in skipped:
        warnings.warn(f"skipping checkpoint {why}", stacklevel=2)
    if found is None:  # every candidate was skipped
        raise FileNotFoundError(f"no intact checkpoint under {path} (found {len(skipped)} candidate(s), none intact)")
    return found
