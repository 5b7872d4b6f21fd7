"""Which checkpoint to trust, for a resume (checkpoint_io) and for a run's weights
(models.run_checkpoint): its stored step, whether it is intact (single files: the zip CRC of
every member, which ``torch.load`` never checks; sharded folders: the size and crc32 of every
file against ``manifest.json``), which one of a folder to take; and reading a sharded one as
data only (DCP's ``.metadata`` and non-tensor entries through allowlists, where DCP itself
would unpickle anything).

``read_sharded_tensors`` reads chosen tensors of a sharded folder (e.g. a run's model weights,
not its optimizer state) into full tensors in one process, without a process group. Torch
alone: models/ imports this module without Lightning."""

from __future__ import annotations

import io
import json
import pickle
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

MANIFEST_NAME = "manifest.json"
METADATA_NAME = "metadata.pt"  # rank 0's ``metadata`` dict (trainer progress, hparams, step)
MANIFEST_FORMAT = "longctx-sharded-checkpoint"
DCP_METADATA_NAME = ".metadata"
_CHUNK = 1 << 23

PathLike = Union[str, Path]


class CorruptCheckpointError(RuntimeError):
    """A checkpoint failed its integrity check; the message names the bad file."""


def size_and_crc32(path: Path) -> tuple[int, int]:
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return size, crc


def _file_problem(path: Path, member_crcs: bool) -> Optional[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(n.endswith("data.pkl") for n in archive.namelist()):
                return "not a torch.save archive (no data.pkl)"
            bad_member = archive.testzip() if member_crcs else None
    except Exception as exc:  # noqa: BLE001 - any way a damaged archive fails to parse
        return f"unreadable archive ({type(exc).__name__}: {exc})"
    if bad_member is not None:
        return f"CRC mismatch in member {bad_member} (the data is corrupted)"
    return None


def read_manifest(path: Path) -> dict:
    manifest_file = path / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_file.read_text())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{manifest_file} is missing (the save did not finish)") from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{manifest_file} is unreadable ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(files, dict)
        or not isinstance(manifest.get("global_step"), int)
    ):
        raise CorruptCheckpointError(f"{manifest_file} is not a {MANIFEST_FORMAT} manifest")
    for name in files:  # flat names only: a manifest must not point outside its folder
        if Path(name).name != name or name in (".", ".."):
            raise CorruptCheckpointError(f"{manifest_file} lists a file outside the folder: {name!r}")
    for required in (DCP_METADATA_NAME, METADATA_NAME):
        if required not in files:
            raise CorruptCheckpointError(f"{manifest_file} does not list {required}")
    return manifest


def sharded_problem(path: Path, rank: int = 0, world_size: int = 1, *, shard_crcs: bool = True) -> Optional[str]:
    """The first problem with ``path``'s files (this rank's share of them), or None.

    ``shard_crcs=False``: the DCP shard files (``*.distcp``) are checked for their size only,
    the others (``.metadata``, ``metadata.pt``) for size and crc32 as always; a reader of part
    of the shards (the model weights, not the optimizer state) then reads no more than it uses.
    """
    try:
        files = read_manifest(path)["files"]
    except CorruptCheckpointError as exc:
        return str(exc)
    for name in sorted(files)[rank::world_size]:
        expected, file = files[name], path / name
        try:
            if shard_crcs or not name.endswith(".distcp"):
                size, crc = size_and_crc32(file)
            else:
                size, crc = file.stat().st_size, expected.get("crc32")
        except FileNotFoundError:
            return f"{file} is missing (the manifest lists it)"
        except OSError as exc:
            return f"{file} is unreadable ({exc})"
        if size != expected.get("size"):
            return f"{file} has {size} bytes, the manifest says {expected.get('size')}"
        if crc != expected.get("crc32"):
            return f"{file} is corrupted (crc32 {crc:#010x}, the manifest says {expected.get('crc32'):#010x})"
    return None


def checkpoint_problem(path: PathLike, *, data_crcs: bool = True) -> Optional[str]:
    """Why ``path`` (a checkpoint file or sharded folder) cannot be trusted, or None if intact.

    Reads the whole checkpoint (every CRC). ``data_crcs=False``: not the tensor data's CRCs (a
    file's zip members, a folder's shards: ``sharded_problem(shard_crcs=False)``), so a reader
    of part of it reads no more than it uses.
    """
    path = Path(path)
    if path.is_dir():
        return sharded_problem(path, shard_crcs=data_crcs)
    return _file_problem(path, data_crcs)


def is_complete_checkpoint(path: PathLike) -> bool:
    """True when ``path`` is an intact checkpoint file or sharded folder."""
    return checkpoint_problem(path) is None


def is_sharded_checkpoint(path: Path) -> bool:
    """A folder torch.distributed.checkpoint wrote (train.py's FSDP2 checkpoints)."""
    return path.is_dir() and ((path / MANIFEST_NAME).exists() or (path / DCP_METADATA_NAME).exists())


def is_checkpoint(path: Path) -> bool:
    """A checkpoint, intact or not: a ``.ckpt`` file, a sharded folder, or a ``.ckpt`` folder
    (a sharded save that died before its metadata)."""
    if path.is_file():
        return path.suffix == ".ckpt"
    return (path.is_dir() and path.suffix == ".ckpt") or is_sharded_checkpoint(path)


def checkpoint_step(path: PathLike) -> int:
    """The training step a checkpoint was saved at (its ``global_step``; -1 when absent)."""
    path = Path(path)
    if path.is_dir():
        return read_manifest(path)["global_step"]
    # mmap: only the small pickle is read, not the tensors.
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    step = ckpt.get("global_step", -1) if isinstance(ckpt, dict) else -1
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def pick_checkpoint(
    folders: Iterable[Path], *, last_first: bool = False, data_crcs: bool = True, exclude: Optional[Path] = None
) -> tuple[Optional[Path], list[str]]:
    """The newest intact checkpoint in ``folders`` (None where there is none), and why each one
    passed over was skipped (``PATH: unreadable (...)`` or ``PATH: incomplete or corrupt (...)``).

    Newest: the highest stored step, never file time; a ``last`` checkpoint wins a tie, or
    comes first whatever its step with ``last_first``. Hidden entries (temp files/folders of
    saves) and ``exclude`` are no candidates. ``data_crcs``: as for ``checkpoint_problem``.
    """
    ranked, skipped = [], []
    for d in folders:
        if not d.is_dir():
            continue
        for candidate in sorted(d.iterdir()):
            if candidate.name.startswith(".") or candidate == exclude or not is_checkpoint(candidate):
                continue
            try:
                step = checkpoint_step(candidate)
            except Exception as exc:  # noqa: BLE001 - an unreadable candidate is skipped, loudly
                skipped.append(f"{candidate}: unreadable ({type(exc).__name__}: {exc})")
                continue
            last = candidate.stem == "last"
            ranked.append(((last and last_first, step, last, candidate.name), candidate))
    for _, candidate in sorted(ranked, key=lambda r: r[0], reverse=True):
        problem = checkpoint_problem(candidate, data_crcs=data_crcs)
        if problem is None:
            return candidate, skipped
        skipped.append(f"{candidate}: incomplete or corrupt ({problem})")
    return None, skipped


# DCP reads its ``.metadata`` with a bare pickle.load and non-tensor entries with
# torch.load(weights_only=False); both would run code from a crafted checkpoint.
_DCP_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not a checkpoint metadata type")


def read_dcp_metadata(path: Path) -> Any:
    file = path / DCP_METADATA_NAME
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(f"{file}: {exc}") from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # Only the global metadata file: we always write it (no per-rank fallback).
        metadata = read_dcp_metadata(Path(self.path))
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


class SafeLoadPlanner(_WeightsOnlyBytes, dcp.DefaultLoadPlanner):
    pass


# Fills an empty dict from the checkpoint's own metadata (what torch's dcp_to_torch_save
# uses: the public dcp.load only fills the keys it is given).
class SafeConsolidatePlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass


def read_checkpoint_metadata(path: PathLike) -> dict[str, Any]:
    """A sharded folder's ``metadata.pt`` (trainer progress, ``hyper_parameters``, the step),
    read as data only (``weights_only=True``)."""
    file = Path(path) / METADATA_NAME
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(f"{file}: holds objects other than plain data ({exc})") from None


def read_sharded_tensors(path: PathLike, select: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors of the sharded folder ``path`` whose DCP names ``select``
    accepts (e.g. ``state_dict.model.embed.weight``), in the dtype they were saved in; one
    process, no process group.

    Verified first (``CorruptCheckpointError`` naming the bad file): the manifest, every file's
    size, the crc32 of ``.metadata`` and ``metadata.pt`` (``sharded_problem(shard_crcs=False)``:
    the shard files hold the entries not selected too, an optimizer's state three times a
    model's, and a whole-file crc32 would read them all). Only the selected entries' bytes are
    read; ``.metadata`` through the allowlist of ``read_dcp_metadata``.
    """
    path = Path(path)
    problem = sharded_problem(path, shard_crcs=False)
    if problem is not None:
        raise CorruptCheckpointError(f"sharded checkpoint {path} failed verification: {problem}")
    metadata = read_dcp_metadata(path)
    state = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and select(name)
    }
    if state:
        with warnings.catch_warnings():  # "no process group: assuming one process", meant
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return state
