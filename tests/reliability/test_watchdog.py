"""A rank that raises, is SIGKILLed, freezes (SIGSTOP) or stalls (alive, sleeping) inside
ring attention ends the whole job quickly, and every surviving rank's message names the
failed rank - also when the failed rank is rank 0, whose process hosts the rendezvous store."""

from __future__ import annotations

import errno
import gc
import math
import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers.dist_harness import free_port

from longctx.watchdog import LINGER_INTERVALS, RankWatchdog, _is_communication_error

HERE = os.path.dirname(__file__)


def _run_job(mode: str, failing_rank: int, world: int = 3):
    """Start the ranks, wait (bounded) for every rank but a frozen one, then SIGKILL what
    is left. Returns (processes, [(stdout, stderr)], seconds from the failure until the
    last survivor ended): measured from the failure, so a slow start on a busy machine
    does not count."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "failure_worker.py"),
                str(r),
                str(world),
                port,
                mode,
                str(failing_rank),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outputs, ended = {}, None
    try:
        for r, p in enumerate(procs):
            if not (mode == "stop" and r == failing_rank):
                outputs[r] = p.communicate(timeout=120)
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if mode == "stop":
        outputs[failing_rank] = procs[failing_rank].communicate(timeout=30)
    failed_at = re.search(r"failing at ([0-9.]+)", outputs[failing_rank][1])
    assert failed_at, f"rank {failing_rank} never reached the failure:\n{outputs[failing_rank][1][-3000:]}"
    return procs, [outputs[r] for r in range(world)], ended - float(failed_at.group(1))


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_rank_failure_ends_every_rank(mode):
    procs, outputs, elapsed = _run_job(mode, failing_rank=1)
    # 10 s heartbeat timeout + up to 10 s of rank 0 lingering (failure_worker.py): far under the 10-minute
    # process-group timeout, with room for a busy machine
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end after the failure"
    for r, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode != 0, f"rank {r} exited 0:\n{err[-2000:]}"
        assert "finished" not in out
        if r != 1:
            assert "rank 1" in err, f"rank {r} did not name the failed rank:\n{err[-3000:]}"
    if mode == "raise":
        assert "injected failure" in outputs[1][1]
    else:
        assert procs[1].returncode == -9


def test_stalled_rank_ends_every_rank_and_is_named():
    """Rank 1 sleeps mid-ring, alive; the others wait for it in gloo's C++ (a 10-minute
    process-group timeout: nothing raises in Python, as under NCCL). Each watchdog's
    collective timeout is 6 s: rank 0 sees rank 1 stay behind its collectives that long,
    and every rank, the sleeping one too, exits from its watchdog thread naming rank 1."""
    procs, outputs, elapsed = _run_job("stall", failing_rank=1)
    # 6 s collective timeout + ~2 polls to notice + 3 polls of lingering (1 s each)
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end after the stall"
    for r, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 75, f"rank {r} exited {p.returncode}:\n{err[-3000:]}"
        assert "finished" not in out
        assert re.search(
            rf"\[longctx watchdog\] rank {r} stopping: rank 1 is stalled: alive .* has not joined "
            r"collective #\d+ of the default process group, which rank 0 has waited in for over 6s",
            err,
        ), err[-3000:]


@pytest.mark.parametrize("readers", [(1, 2), (1,)])
def test_the_store_host_lingers_until_every_rank_knows_the_failure(readers):
    """The store's host (rank 0 under a plain launch: the store dies with it) waits after a
    failure until every rank has read it, however late a busy rank polls; a rank that never
    reads it (dead) holds it LINGER_INTERVALS intervals at most."""
    interval = 0.5
    host = RankWatchdog(0, 3, timeout=5.0, interval=interval, store=dist.HashStore())
    host._hosts_store = True  # a HashStore lives in this process, as rank 0's TCPStore does

    def read_late():
        for r in readers:
            time.sleep(0.5)
            host._call("set", f"known/{r}", "1")  # what rank r's watchdog writes once it read it

    thread = threading.Thread(target=read_late)
    start = time.monotonic()
    thread.start()
    host._linger()
    took = time.monotonic() - start
    thread.join()
    bound = LINGER_INTERVALS * interval
    if len(readers) == 2:  # everyone read it: over once the last one did, well before the bound
        assert 1.0 <= took < bound, took
    else:  # rank 2 never reads it
        assert bound <= took < bound + 5.0, took


def test_the_store_host_that_reads_another_ranks_failure_waits_for_the_others_too():
    """Rank 0's own collective fails because a peer died; the failure another rank published is
    the one it reports, and as the store's host it still waits until every rank has read it
    (a rank that polls late would otherwise find the store gone and blame its host)."""
    host = RankWatchdog(0, 3, timeout=5.0, interval=0.5, store=dist.HashStore())
    host._hosts_store = True
    host._call("set", "failure", "rank 1 failed: RuntimeError: injected failure")

    def read_late():
        for r in (1, 2):
            time.sleep(0.5)
            host._call("set", f"known/{r}", "1")

    thread = threading.Thread(target=read_late)
    start = time.monotonic()
    thread.start()
    first = host.report_failure(RuntimeError("rank 0's own error"))
    took = time.monotonic() - start
    thread.join()
    assert first == "rank 1 failed: RuntimeError: injected failure"
    assert 1.0 <= took < LINGER_INTERVALS * 0.5, took
    assert host._call("check", ["known/0"])


def test_a_rank_that_knows_the_failure_does_not_blame_the_store_host_for_leaving():
    """The rank that published the failure (or read it) then finds the store gone: its host
    exited once every rank had read the failure. Its watchdog names the failure it knows, not
    the host, and only if the process has not ended a few intervals later."""
    said = []
    watchdog = RankWatchdog(1, 2, timeout=5.0, interval=0.1, store=dist.HashStore(), on_failure=said.append)
    watchdog._known_failure = "rank 1 failed: RuntimeError: injected failure"  # as report_failure leaves it

    def gone(*args, **kwargs):
        raise ConnectionResetError("Connection reset by peer")

    watchdog._call = gone
    start = time.monotonic()
    watchdog._run()
    assert said == ["rank 1 stopping: rank 1 failed: RuntimeError: injected failure"]
    assert time.monotonic() - start >= 3 * 0.1  # the thread that knows it had its chance first


def test_stall_needs_the_peer_behind_without_progress_for_the_whole_timeout():
    """The stall check alone: a peer behind this rank's collective count is stalled only once
    it has stayed at the same count for ``collective_timeout``; level, ahead or moving is not."""
    watchdog = RankWatchdog(
        0, 2, timeout=5.0, interval=0.1, store=dist.HashStore(), collective_timeout=30.0, collectives=lambda: 0
    )
    # Counts as published: the peer's count plus one (0: not published yet).
    assert watchdog._stalled(mine=850, theirs=0, now=0.0) is None  # the peer has not published yet
    assert watchdog._stalled(mine=850, theirs=851, now=1.0) is None  # level
    assert watchdog._stalled(mine=850, theirs=900, now=2.0) is None  # the peer is ahead
    assert watchdog._stalled(mine=850, theirs=850, now=3.0) is None  # behind: the clock starts
    assert watchdog._stalled(mine=851, theirs=850, now=33.0) is None  # 30 s: not over yet
    assert watchdog._stalled(mine=851, theirs=851, now=34.0) is None  # it joined #850: the clock restarts
    assert watchdog._stalled(mine=851, theirs=852, now=35.0) is None  # level again: cleared
    assert watchdog._stalled(mine=860, theirs=855, now=40.0) is None  # behind again, from here
    assert watchdog._stalled(mine=860, theirs=857, now=69.0) is None  # it moved: the clock restarts
    message = watchdog._stalled(mine=860, theirs=857, now=99.5)
    assert message == (
        "rank 1 is stalled: alive (its heartbeat moves) but it has not joined collective #857 of the "
        "default process group, which rank 0 has waited in for over 30s (the process-group timeout)"
    )
    with pytest.raises(ValueError, match="collective_timeout must be a finite number of seconds"):
        RankWatchdog(0, 2, timeout=5.0, store=dist.HashStore(), collective_timeout=math.nan, collectives=lambda: 0)
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="collective_timeout needs the default process group initialized"):
            RankWatchdog(0, 2, timeout=5.0, store=dist.HashStore(), collective_timeout=30.0)


@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_store_host_failure_ends_every_rank(mode):
    """Rank 0 SIGKILLed: the store dies with it. Rank 0 frozen: the store never answers
    (TCPStore.add has no timeout of its own). Either way the others exit on their own
    within about the failure timeout, each printing a line that names rank 0."""
    procs, outputs, elapsed = _run_job(mode, failing_rank=0, world=2)
    assert elapsed < 60, f"the surviving rank took {elapsed:.0f}s to end after the failure"
    for r in (1,):
        out, err = outputs[r]
        assert procs[r].returncode == 75, f"rank {r} exited {procs[r].returncode}:\n{err[-3000:]}"
        assert "finished" not in out
        assert re.search(
            rf"\[longctx watchdog\] rank {r} stopping: .*rank 0 \(it hosts the rendezvous "
            rf"store\) (died|is hung or dead)",
            err,
        ), err[-3000:]
    assert procs[0].returncode == -9


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0.0])
def test_non_finite_or_non_positive_timeout_is_refused(value):
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
        RankWatchdog(0, 2, timeout=value, store=dist.HashStore())
    with pytest.raises(ValueError, match="interval must be a finite number of seconds"):
        RankWatchdog(0, 2, timeout=10.0, interval=value, store=dist.HashStore())


def test_a_timeout_nobody_explains_is_reported_as_a_stalled_rank():
    """A collective timed out (a peer is alive but never joined it: its heartbeat thread
    still beats) and no rank published a cause: the message says a rank is stalled instead
    of calling the rank that waited the failed one."""
    watchdog = RankWatchdog(0, 2, timeout=0.5, interval=0.1, store=dist.HashStore())
    first = watchdog.report_failure(RuntimeError("[gloo] Timed out waiting 30000ms for send operation to complete"))
    assert first.startswith("rank 0 stopped waiting in a collective (RuntimeError: [gloo] Timed out"), first
    assert "a rank is stalled" in first and "failed:" not in first, first
    # A cause published meanwhile (the dead rank's watcher, the rank that raised) is kept.
    named = RankWatchdog(0, 2, timeout=0.5, interval=0.1, store=dist.HashStore())
    named._call("set", "failure", "rank 1 stopped responding (no heartbeat for 3s; killed or hung)")
    assert named.report_failure(RuntimeError("Connection reset by peer")).startswith("rank 1 stopped responding")


def _gloo_error_from_a_closed_peer() -> RuntimeError:
    """The RuntimeError gloo raises in a rank whose peer went away mid-job (two ranks of one
    gloo group, as threads of this process: no process to spawn)."""
    store, groups = dist.HashStore(), {}

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("closed_peer/", store), rank, 2, timedelta(seconds=10))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del groups[1]  # closes its connections, as a dying process does
    gc.collect()
    try:
        groups[0].allreduce([torch.ones(2)]).wait()
    except RuntimeError as exc:
        return exc
    finally:
        del groups[0]
    raise AssertionError("an allreduce without its peer succeeded")


def test_communication_errors_are_told_by_type_and_backend_wording():
    gloo = _gloo_error_from_a_closed_peer()
    assert "Connection closed by peer" in str(gloo) and "/gloo/" in str(gloo).split("]")[0], gloo
    store_timeout = None
    hash_store = dist.HashStore()
    hash_store.set_timeout(timedelta(milliseconds=10))
    try:
        hash_store.get("never set")
    except dist.DistStoreError as exc:
        store_timeout = exc
    communication = [
        gloo,
        store_timeout,
        RuntimeError(
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
            "Timed out waiting 3000ms for recv operation to complete"
        ),
        # NCCL's errors are DistBackendErrors (TORCH_CHECK_WITH(DistBackendError, ...) in NCCLUtils.hpp)
        dist.DistBackendError(
            "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled "
            "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3"
        ),
        dist.DistNetworkError(
            "The client socket has timed out after 1000ms while trying to connect to (10.0.0.1, 29500)."
        ),
    ]
    for error in communication:
        assert _is_communication_error(error), repr(error)


def test_a_save_that_failed_in_its_collectives_is_a_communication_error(tmp_path):
    """A peer SIGKILLed while a checkpoint is saved: rank 0's error is the save's own one line,
    raised from gloo's. It once counted as rank 0's own failure, so rank 0 published it and the
    job's message named rank 0 instead of the dead rank 1 (a CI run of the fault suite)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from longctx.lightning.checkpoint_io import _cause, _save_failed

    gloo = _gloo_error_from_a_closed_peer()
    disk_full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x.distcp"))

    def raised_from(cause: BaseException) -> RuntimeError:
        try:
            raise _save_failed(tmp_path / "step000006", _cause(cause)) from cause
        except RuntimeError as exc:
            return exc

    def dcp(*causes: BaseException) -> CheckpointException:
        return CheckpointException("save failed", {rank: (c, None) for rank, c in enumerate(causes)})

    for symptom in (raised_from(gloo), raised_from(dcp(gloo, gloo)), dcp(gloo, gloo)):
        assert str(symptom).startswith(("cannot save sharded checkpoint", "CheckpointException")), symptom
        assert _is_communication_error(symptom), repr(symptom)
    # A rank's own failure stays its own, however it is wrapped.
    for own in (raised_from(disk_full), raised_from(dcp(gloo, disk_full)), dcp(disk_full), RuntimeError("x")):
        assert not _is_communication_error(own), repr(own)
    # The symptom waits for the dead rank's watcher to name it, then every rank prints that.
    watchdog = RankWatchdog(0, 2, timeout=0.5, interval=0.1, store=dist.HashStore())
    watchdog._call("set", "failure", "rank 1 stopped responding (no heartbeat for 10s; killed or hung)")
    assert watchdog.report_failure(raised_from(gloo)).startswith("rank 1 stopped responding")


def test_a_disk_full_under_a_path_named_after_a_backend_is_no_communication_error(tmp_path):
    """A work dir called /tmp/glooall (or .../nccl-runs) once turned a disk-full checkpoint
    save into "rank 0 stopped waiting in a collective": a path says nothing about what failed."""
    ckpt = tmp_path / "glooall" / "nccl-runs" / "NCCL" / "last.ckpt"
    disk_full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(ckpt))
    with pytest.raises(RuntimeError) as missing_dir:  # torch's own wording for a bad path
        torch.save({}, str(ckpt))
    wrapped = RuntimeError(f"could not save {ckpt}: [gloo] NCCL error Connection reset by peer")
    for error in (
        disk_full,
        missing_dir.value,
        wrapped,
        OSError(errno.ECONNRESET, "Connection reset by peer", str(ckpt)),
    ):
        assert "gloo" in str(error) and not _is_communication_error(error), repr(error)
    # The message says at once that this rank failed, with its cause, instead of waiting a
    # failure timeout for another rank to name a cause.
    watchdog = RankWatchdog(0, 2, timeout=5.0, interval=0.1, store=dist.HashStore())
    start = time.monotonic()
    first = watchdog.report_failure(disk_full)
    assert time.monotonic() - start < 2.0
    assert first == f"rank 0 failed: OSError: [Errno {errno.ENOSPC}] No space left on device: '{ckpt}'", first


def test_a_later_generation_sees_none_of_an_earlier_ones_keys():
    """Two fits over one store: fit 1's failure and done keys must neither end fit 2 nor stop
    it watching its peer (here rank 1, which never beats: fit 2 declares it dead)."""
    store = dist.HashStore()
    first = RankWatchdog(0, 2, timeout=0.5, interval=0.1, store=store, generation=1)
    first.report_failure(RuntimeError("injected failure in fit 1"))
    first._call("set", "done/1", "1")
    ended = []
    second = RankWatchdog(0, 2, timeout=0.5, interval=0.1, store=store, generation=2, on_failure=ended.append).start()
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    second.stop()
    assert ended and ended[0].startswith("rank 0 stopping: rank 1 stopped responding (no heartbeat"), ended


def test_a_failure_read_before_the_store_went_away_is_the_one_named(monkeypatch):
    """A bystander rank (rank 2 of 3) whose watchdog read the job's failure lingers before it
    exits; a peer that read it earlier exits meanwhile, closing this rank's collective (gloo's
    "Connection closed by peer" in its main thread), and the store's host (rank 0) is gone too.
    The rank names the failure it read, not the store's host: test_stalled_rank_ends_every_rank_
    and_is_named saw rank 2 blame rank 0 that way. A rank that read nothing still names the host
    (here a HashStore's: "the process hosting the rendezvous store")."""
    closed = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:58292. This is typically caused by a remote worker crashing."
    )
    stalled = "rank 1 is stalled: alive (its heartbeat moves) but it has not joined collective #3"

    def store_gone(*args, **kwargs):
        raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    ended = []
    bystander = RankWatchdog(2, 3, timeout=5.0, interval=0.1, store=dist.HashStore(), on_failure=ended.append)
    bystander._call("set", "failure", stalled)
    bystander.start()
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:  # its thread read the failure (and lingered)
        time.sleep(0.05)
    assert ended == [f"rank 2 stopping: {stalled}"], ended
    monkeypatch.setattr(bystander, "_call", store_gone)
    bystander.report_failure(closed)
    assert ended[-1] == f"rank 2 stopping: {stalled}", ended
    bystander._stop.set()

    unaware = []
    other = RankWatchdog(2, 3, timeout=5.0, interval=0.1, store=dist.HashStore(), on_failure=unaware.append)
    monkeypatch.setattr(other, "_call", store_gone)
    other.report_failure(closed)
    assert len(unaware) == 1 and unaware[0].startswith("rank 2 stopping: the process hosting the rendezvous store died")
