"""Checkpoint files resume can trust (longctx.lightning.checkpoint_io).

Single files: a save killed mid-write leaves the previous file whole and its temp file is
cleaned up by the next save; corrupted data (zip CRC) is detected and skipped; newest means
highest stored step, not newest mtime; a pickle with a code payload is refused.
Sharded (FSDP2 over 2 gloo processes): resume is bit-exact, a corrupted shard is refused
by name and resume falls back to the older intact checkpoint, leftovers of killed saves are
never chosen, a world-2 checkpoint loads into world 1, consolidation equals the full state.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from helpers.dist_harness import run_distributed

from longctx.checkpoint_verify import MANIFEST_NAME, CorruptCheckpointError, is_complete_checkpoint
from longctx.lightning.checkpoint_io import (
    AtomicCheckpointIO,
    consolidate_checkpoint,
    find_resume_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _flip_tensor_byte(ckpt: Path) -> str:
    """Corrupt one byte of a tensor's data inside a torch.save archive, keeping the zip
    directory intact (what a bad disk or a torn copy does); returns the member's name."""
    with zipfile.ZipFile(ckpt) as z:
        member = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 8)
    with open(ckpt, "rb") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    _flip_byte(ckpt, member.header_offset + 30 + name_len + extra_len + 5)
    return member.filename


# -- single files -----------------------------------------------------------------------

_SAVER = textwrap.dedent(
    """
    import sys, torch
    from longctx.lightning.checkpoint_io import AtomicCheckpointIO
    io, i = AtomicCheckpointIO(), 0
    while True:  # keep writing big checkpoints until killed
        i += 1
        io.save_checkpoint({"global_step": i, "w": torch.full((8_000_000,), float(i))}, sys.argv[1])
        print(i, flush=True)
    """
)


def test_killed_save_leaves_last_checkpoint_whole(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 0, "w": torch.zeros(4)}, ckpt_dir / "step000000.ckpt")
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(last)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "1"  # one complete save done
        deadline = time.monotonic() + 60
        # Kill while the next save is half written (its temp file exists and is growing).
        while not any(p.name.startswith(".last.ckpt.tmp") and p.stat().st_size > 0 for p in ckpt_dir.iterdir()):
            assert time.monotonic() < deadline, "the saver never started a second save"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert is_complete_checkpoint(last)
    state = torch.load(last, weights_only=True)
    assert torch.equal(state["w"], torch.full((8_000_000,), float(state["global_step"])))
    assert find_resume_checkpoint(tmp_path) == last  # the temp file is not a candidate
    # A truncated checkpoint (what a plain, non-atomic writer leaves behind) is skipped.
    torn = ckpt_dir / "step000009.ckpt"
    torn.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    assert not is_complete_checkpoint(torn)
    with pytest.warns(UserWarning, match="step000009.ckpt: unreadable"):
        assert find_resume_checkpoint(ckpt_dir) == last
    with pytest.warns(UserWarning, match="incomplete"):
        assert find_resume_checkpoint(torn) == last
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_resume_checkpoint(tmp_path / "nowhere")
    # The next save in the folder removes the killed saver's temp file (its PID is dead).
    leftovers = [p for p in ckpt_dir.iterdir() if p.name.startswith(".last.ckpt.tmp")]
    assert leftovers
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, ckpt_dir / "other.ckpt")
    assert not any(p.exists() for p in leftovers)


def test_corrupted_data_is_detected_and_skipped(tmp_path):
    io = AtomicCheckpointIO()
    older, newer = tmp_path / "step000002.ckpt", tmp_path / "step000004.ckpt"
    io.save_checkpoint({"global_step": 2, "w": torch.randn(1000)}, older)
    io.save_checkpoint({"global_step": 4, "w": torch.randn(1000)}, newer)
    member = _flip_tensor_byte(newer)
    with zipfile.ZipFile(newer) as z:  # the zip directory is still fine: only the CRC tells
        assert member in z.namelist()
    torch.load(newer, weights_only=True)  # what resume did before: no error at all
    assert not is_complete_checkpoint(newer) and is_complete_checkpoint(older)
    crc = f"step000004.ckpt failed verification: CRC mismatch in member {member}"
    with pytest.raises(CorruptCheckpointError, match=crc):
        io.load_checkpoint(newer)
    with pytest.warns(UserWarning, match="step000004.ckpt: incomplete or corrupt .*CRC mismatch"):
        assert find_resume_checkpoint(tmp_path) == older
    assert io.load_checkpoint(older)["global_step"] == 2


def test_newest_is_the_highest_step_not_the_newest_file(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 7}, tmp_path / "b.ckpt")
    io.save_checkpoint({"global_step": 3}, tmp_path / "z.ckpt")
    io.save_checkpoint({"global_step": 7}, tmp_path / "last.ckpt")
    future = time.time() + 3600
    os.utime(tmp_path / "z.ckpt", (future, future))  # a `touch` must not change the choice
    assert find_resume_checkpoint(tmp_path) == tmp_path / "last.ckpt"  # wins the tie at step 7
    (tmp_path / "last.ckpt").unlink()
    assert find_resume_checkpoint(tmp_path) == tmp_path / "b.ckpt"


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker),)


def test_pickle_with_code_is_refused(tmp_path):
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil.ckpt"
    torch.save({"global_step": 1, "state_dict": {}, "x": _Payload(marker)}, evil)
    io = AtomicCheckpointIO()
    with pytest.raises(Exception, match="Weights only load failed"):
        io.load_checkpoint(evil)
    with pytest.raises(ValueError, match="weights_only=True only"):
        io.load_checkpoint(evil, weights_only=False)
    with pytest.warns(UserWarning, match="evil.ckpt: unreadable"), pytest.raises(FileNotFoundError):
        find_resume_checkpoint(tmp_path)
    assert not marker.exists()


# -- sharded (FSDP2) --------------------------------------------------------------------


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train_step(model, optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    model(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _states(model, optimizer, **options) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(**options)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optimizer_0": get_optimizer_state_dict(model, optimizer, options=opts),
    }


def _set_states(model, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer_0"])


def _flat(tree, prefix=""):
    """{path: leaf} of nested dicts/lists, DTensors as their local shards."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}/").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}{i}/").items()}
    return {prefix: tree.to_local() if hasattr(tree, "to_local") else tree}


def _assert_same(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        if torch.is_tensor(fa[key]):
            assert torch.equal(fa[key], fb[key]), key
        else:
            assert fa[key] == fb[key], key


def _fsdp_worker(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = Path(root)
    mesh = init_device_mesh("cpu", (world,))

    def build(seed):
        model = _mlp(seed)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = build(seed=0)
    for step in range(2):
        _train_step(model, optimizer, step)
    save_sharded_checkpoint(root / "step000002", _states(model, optimizer), {"global_step": 2, "note": "a"})
    save_sharded_checkpoint(root / "last", _states(model, optimizer), {"global_step": 2})
    _train_step(model, optimizer, 2)
    saved = _states(model, optimizer)
    save_sharded_checkpoint(root / "step000003", saved, {"global_step": 3, "hparams": {"lr": 1e-2}})
    full = _full(saved)  # now: the state dicts alias the live parameters (a collective)
    save_sharded_checkpoint(root / "last", saved, {"global_step": 3})  # replaces the folder

    # Resume into a differently initialised model: bit-exact state and continuation.
    resumed, resumed_optimizer = build(seed=1)
    state = _states(resumed, resumed_optimizer)
    metadata = load_sharded_checkpoint(root / "last", state)
    assert metadata == {"global_step": 3}
    _set_states(resumed, resumed_optimizer, state)
    _assert_same(_states(resumed, resumed_optimizer), saved)
    _train_step(model, optimizer, 3)
    _train_step(resumed, resumed_optimizer, 3)
    _assert_same(_states(resumed, resumed_optimizer), _states(model, optimizer))

    # A corrupted shard: every rank refuses, naming the file (whichever rank checked it).
    save_sharded_checkpoint(root / "damaged", saved, {"global_step": 1})
    if rank == 0:
        _flip_byte(root / "damaged" / "__1_0.distcp", 100)
    dist.barrier()
    try:
        load_sharded_checkpoint(root / "damaged", _states(resumed, resumed_optimizer))
        raise AssertionError("a corrupted shard was loaded")
    except CorruptCheckpointError as exc:
        assert "__1_0.distcp is corrupted" in str(exc), exc
    buffer = io.BytesIO()  # bytes: tensors would travel back as shared memory of a dead process
    torch.save(full, buffer)
    return buffer.getvalue() if rank == 0 else None


def _full(tree):
    """A copy of ``tree`` with DTensors gathered to full tensors."""
    if isinstance(tree, dict):
        return {k: _full(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_full(v) for v in tree]
    if hasattr(tree, "full_tensor"):
        return tree.full_tensor()
    return tree.clone() if torch.is_tensor(tree) else tree


def test_sharded_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    step3 = torch.load(io.BytesIO(run_distributed(_fsdp_worker, 2, str(root), timeout=120)[0]), weights_only=True)

    # Leftovers never win: a killed save's temp folder (even with a manifest claiming a
    # later step) and a folder without a manifest (a plain DCP save that died).
    dead = _dead_pid()
    shutil.copytree(root / "step000003", root / f".step000009.tmp-{dead}")
    shutil.copytree(root / "step000003", root / "step000010.ckpt")
    (root / "step000010.ckpt" / MANIFEST_NAME).unlink()
    with pytest.warns(UserWarning, match=r"step000010.ckpt: unreadable .*manifest.json is missing"):
        assert find_resume_checkpoint(root) == root / "last"
    assert find_resume_checkpoint(root / "step000003") == root / "step000003"

    # World 1 (no process group) loads the world-2 checkpoint: resharded, equal.
    model = _mlp(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = _states(model, optimizer)
    assert load_sharded_checkpoint(root / "step000003", state) == {"global_step": 3, "hparams": {"lr": 1e-2}}
    _set_states(model, optimizer, state)
    _assert_same(_states(model, optimizer), step3)

    # Consolidation: one torch file of the full state, and the model alone as safetensors.
    consolidate_checkpoint(root / "step000003", tmp_path / "full.pt")
    consolidated = torch.load(tmp_path / "full.pt", weights_only=True)
    assert consolidated["metadata"]["global_step"] == 3
    _assert_same(consolidated["state"], step3)
    from safetensors.torch import load_file

    consolidate_checkpoint(root / "step000003", tmp_path / "model.safetensors", safetensors_model_key="model")
    _assert_same(load_file(tmp_path / "model.safetensors"), step3["model"])

    # One flipped byte in a shard: load refuses naming it, resume falls back to step 2.
    _flip_byte(root / "step000003" / "__0_0.distcp", 50)
    with pytest.raises(CorruptCheckpointError, match=r"step000003/__0_0.distcp is corrupted"):
        load_sharded_checkpoint(root / "step000003", _states(model, optimizer))
    shutil.rmtree(root / "last")
    with pytest.warns(UserWarning, match=r"step000003: incomplete or corrupt .*__0_0.distcp is corrupted"):
        assert find_resume_checkpoint(root) == root / "step000002"
    assert not is_complete_checkpoint(root / "damaged")

    # The next save in the folder removes the dead writer's temp folder.
    save_sharded_checkpoint(root / "step000004", _states(model, optimizer), {"global_step": 4})
    assert not (root / f".step000009.tmp-{dead}").exists()
    assert find_resume_checkpoint(root) == root / "step000004"
    assert json.loads((root / "step000004" / MANIFEST_NAME).read_text())["global_step"] == 4


def test_sharded_metadata_and_pickles_are_data_only(tmp_path):
    state = {"model": {"w": torch.randn(4)}}
    with pytest.raises(ValueError, match="int global_step"):
        save_sharded_checkpoint(tmp_path / "a", state, {"step": 1})
    with pytest.raises(RuntimeError, match="weights_only load refuses"):
        save_sharded_checkpoint(tmp_path / "a", state, {"global_step": 1, "x": _Payload(tmp_path / "m")})
    assert not (tmp_path / "a").exists()
    # A crafted DCP .metadata with a code payload (manifest rewritten to match) is refused.
    save_sharded_checkpoint(tmp_path / "a", state, {"global_step": 1})
    payload = pickle.dumps(_Payload(tmp_path / "payload-ran"))
    (tmp_path / "a" / ".metadata").write_bytes(payload)
    manifest = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    manifest["files"][".metadata"] = {"size": len(payload), "crc32": zlib.crc32(payload)}
    (tmp_path / "a" / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(pickle.UnpicklingError, match=r"a/.metadata: refers to os.makedirs"):
        load_sharded_checkpoint(tmp_path / "a", {"model": {"w": torch.zeros(4)}})
    # A non-tensor entry with a payload (DCP itself would unpickle it with weights_only=False).
    save_sharded_checkpoint(
        tmp_path / "b", {"model": {"w": torch.randn(4), "x": _Payload(tmp_path / "payload-ran")}}, {"global_step": 1}
    )
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="unsupported GLOBAL os.makedirs"):
        load_sharded_checkpoint(tmp_path / "b", {"model": {"w": torch.zeros(4), "x": None}})
    assert not (tmp_path / "payload-ran").exists()


def _full_disk(create_stream):
    """DCP's file streams on a disk that fills up: 64 bytes fit, then ENOSPC."""
    import errno
    from contextlib import contextmanager

    @contextmanager
    def stream_on_full_disk(self, path, mode):
        with create_stream(self, path, mode) as stream:
            stream.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            yield stream  # (never reached: a generator, as contextmanager wants)

    return stream_on_full_disk


def test_disk_full_during_a_sharded_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """ENOSPC while DCP writes the shards: every rank raises one line saying what failed and
    that the earlier checkpoints are intact; the folder being replaced keeps its content, no
    temp folder is left, and a resume takes the previous checkpoint."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    save_sharded_checkpoint(tmp_path / "last", {"model": {"w": torch.arange(4.0)}}, {"global_step": 1})
    monkeypatch.setattr(FileSystem, "create_stream", _full_disk(FileSystem.create_stream))
    with pytest.raises(RuntimeError) as failed:
        save_sharded_checkpoint(tmp_path / "last", {"model": {"w": torch.zeros(4)}}, {"global_step": 2})
    monkeypatch.undo()
    message = str(failed.value)
    assert "\n" not in message and "No space left on device" in message, message
    assert "the checkpoints saved before are intact" in message, message
    assert os.listdir(tmp_path) == ["last"]
    loaded = {"model": {"w": torch.zeros(4)}}
    assert load_sharded_checkpoint(find_resume_checkpoint(tmp_path), loaded)["global_step"] == 1
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0))


def test_a_failed_swap_puts_the_previous_folder_back(tmp_path, monkeypatch):
    """The new folder cannot take the old one's name (rename fails): the old one is put back
    under its name, not left hidden as a leftover that the next save deletes."""
    import longctx.lightning.checkpoint_io as checkpoint_io

    save_sharded_checkpoint(tmp_path / "last", {"model": {"w": torch.arange(4.0)}}, {"global_step": 1})
    rename = os.rename

    def failing_rename(src, dst):
        if ".tmp-" in str(src):
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(checkpoint_io.os, "rename", failing_rename)
    with pytest.raises(RuntimeError, match="No space left on device.*checkpoints saved before are intact"):
        save_sharded_checkpoint(tmp_path / "last", {"model": {"w": torch.zeros(4)}}, {"global_step": 2})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["last"]
    assert is_complete_checkpoint(tmp_path / "last")
    assert find_resume_checkpoint(tmp_path) == tmp_path / "last"
