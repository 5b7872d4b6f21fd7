"""Fail fast when a rank dies: no process is left hanging in a collective or a ring hop.

A rank blocked in a NCCL/gloo receive cannot notice that its peer died until the process
group's timeout (10+ minutes by default for NCCL). The watchdog is a daemon thread in
every rank that talks to the rendezvous store, not to the process group:

* it bumps this rank's heartbeat counter every ``interval`` seconds;
* it watches ONE peer (rank + 1): if that counter stops moving for ``timeout`` seconds,
  the peer is declared dead (a SIGKILL, an OOM kill, a hung host);
* a rank that raises publishes the failure itself (``report_failure``), at once;
* with ``collective_timeout`` (the process-group timeout) it also catches a *stalled*
  peer, one that is alive (its heartbeat moves) but never joins the next collective: each
  rank publishes how many collectives it has issued on the default group, and a watched
  peer that stays behind this rank, without issuing any, for ``collective_timeout``
  seconds is stalled: this rank's collective has waited that long for it. NCCL raises
  nothing in Python then (the main thread stays blocked in CUDA until NCCL's own watchdog
  aborts the process, 60 s later by default, naming no one), so this is what names it;
* every rank polls one shared ``failure`` key; whoever sees it prints the message, which
  names the failed rank, and exits the process with ``os._exit``, which works even while
  the main thread is stuck inside a C++ collective or a CUDA wait.

Store traffic is five small operations per rank per interval (one more when this rank
issued collectives since the last), independent of the world size; a count is read with
``add(key, 0)``, which answers 0 for a key not yet written instead of waiting for it.
Losing the store itself is also a failure, and so is a store that stops
answering: under a plain launch it lives in rank 0's process, so a frozen rank 0
(SIGSTOP, a hung host) never replies, and ``TCPStore.add`` has no timeout of its own.
Every store operation therefore runs on a helper thread that callers wait for at most
``timeout`` seconds; a rank that cannot reach the store that long exits, naming its host.

One store outlives a fit (a second ``Trainer.fit``, a ``validate`` after it, two jobs in a
test process all reuse it), so each watchdog's keys live under its ``generation``: a
``done`` or ``failure`` key of an earlier fit is never seen by a later one.
"""

from __future__ import annotations

import math
import os
import queue
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

EXIT_CODE = 75  # distinct from Python's 1, so launchers' logs show who exited by policy
# The store's host waits for every rank to read the job's failure before it exits (its store
# dies with it), at most this many intervals: a dead rank never reads it.
LINGER_INTERVALS = 10


def hard_exit(message: str, exit_code: int = EXIT_CODE) -> None:
    """Print ``message`` and end the process now, from any thread, even while the main
    thread is stuck in C++ (no cleanup runs: only for giving up)."""
    sys.stderr.write(f"\n[longctx watchdog] {message}\n")
    sys.stderr.flush()
    os._exit(exit_code)


# How a backend's failure reads at the START of a plain RuntimeError: gloo's own errors lead
# with their C++ source location in gloo's tree ("[.../gloo/transport/tcp/pair.cc:553]
# Connection closed by peer ..."), torch's gloo wrapper with "Gloo ..." or "[gloo]", NCCL
# with "NCCL error". Only the start counts: a path anywhere else in a message (a checkpoint
# dir named /tmp/glooall) says nothing about what failed.
_BACKEND_FAILURE = re.compile(
    r"\[(?:gloo|[^\]\s]*/gloo/[^\]\s]+:\d+)\]|Gloo |NCCL error|Connection (?:reset|closed) by peer"
)


def _is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` is torch's report of a failed collective or store operation (often a
    symptom of a dead peer), judged by its type and how torch words it, never by a substring:
    torch's distributed errors (NCCL's included) are ``DistError``s; gloo raises plain
    ``RuntimeError``s whose message starts as ``_BACKEND_FAILURE`` says. An error raised
    *from* one (``raise ... from``: a checkpoint save that failed in its collectives) is one
    too, and so is DCP's ``CheckpointException`` whose every rank failed that way. Anything
    else, an ``OSError`` (disk full) above all, is this rank's own failure."""
    # Only ever called on a failure: DCP (half a second to import) is imported here, not with longctx.
    from torch.distributed.checkpoint.api import CheckpointException

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, dist.DistError):
            return True
        if isinstance(error, RuntimeError) and _BACKEND_FAILURE.match(str(error)) is not None:
            return True
        if isinstance(error, CheckpointException):  # failures: {rank: (exception, traceback)}
            return bool(error.failures) and all(_is_communication_error(e) for e, _ in error.failures.values())
        error = error.__cause__
    return False


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"watchdog {name} must be a finite number of seconds > 0, got {value!r}")


class StoreUnreachable(RuntimeError):
    """The rendezvous store did not answer within the failure timeout."""


class _BoundedStore:
    """Store operations on one daemon thread, so that every caller can stop waiting.

    A hung operation keeps that thread (and the ones queued behind it) forever; the
    callers get ``StoreUnreachable`` and the process exits, so nothing is leaked for long.
    """

    def __init__(self, connect: Callable[[], dist.Store], prefix: str):
        self._connect, self._prefix = connect, prefix
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="longctx-watchdog-store", daemon=True).start()

    def _serve(self) -> None:
        store = None
        while (request := self._requests.get()) is not None:
            op, args, reply = request
            try:
                if store is None:
                    store = dist.PrefixStore(self._prefix, self._connect())
                reply["value"] = getattr(store, op)(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                reply["error"] = exc
            reply["done"].set()

    def call(self, timeout: float, op: str, *args: Any) -> Any:
        reply: dict = {"done": threading.Event()}
        self._requests.put((op, args, reply))
        if not reply["done"].wait(timeout):
            raise StoreUnreachable(f"no answer to {op} within {timeout:.0f}s")
        if "error" in reply:
            raise reply["error"]
        return reply["value"]

    def close(self) -> None:
        """End the helper thread once the queued operations are done."""
        self._requests.put(None)


def _default_group_collectives() -> Callable[[], int]:
    if not dist.is_initialized():
        raise ValueError(
            "watchdog collective_timeout needs the default process group initialized first (or pass collectives=)"
        )
    group = dist.group.WORLD
    # NCCL counts collectives only, gloo point-to-point operations on this group too.
    return group._get_sequence_number_for_group


class RankWatchdog:
    """``timeout``: seconds without a heartbeat before a rank counts as dead; ``interval``:
    seconds between polls; ``collective_timeout``: seconds a peer may stay behind this rank
    in the default group's collectives before it counts as stalled (the process-group
    timeout; ``None``: no stall check); ``collectives()``: how many collectives this rank
    has issued (default: the default group's sequence number); ``generation``: which fit over
    this rendezvous store the keys belong to, the same on every rank of a fit and new for
    each fit (``longctx.lightning.failures`` counts a process's fits)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        timeout: float = 60.0,
        interval: float = 1.0,
        store: Optional[dist.Store] = None,
        on_failure: Callable[[str], None] = hard_exit,
        collective_timeout: Optional[float] = None,
        collectives: Optional[Callable[[], int]] = None,
        generation: int = 0,
    ):
        _check_seconds("timeout", timeout)
        _check_seconds("interval", interval)
        if timeout <= interval:
            raise ValueError(f"watchdog timeout ({timeout}s) must exceed its interval ({interval}s)")
        if collective_timeout is not None:
            _check_seconds("collective_timeout", collective_timeout)
            collectives = collectives or _default_group_collectives()
        self.rank, self.world_size = rank, world_size
        self.timeout, self.interval = timeout, interval
        self.collective_timeout = collective_timeout
        self._collectives = collectives if collective_timeout is not None else None
        self._published = 0  # this rank's collective count as the store has it, plus one (0: none yet)
        self._behind: Optional[tuple[int, float]] = None  # (the peer's published count, since when) while behind
        self.on_failure = on_failure
        self._store = _BoundedStore(
            (lambda: store) if store is not None else self._connect, prefix=f"longctx_watchdog/{generation}/"
        )
        self._store_host = self._describe_store_host(store)
        self._hosts_store = rank == 0 and self._store_host.startswith("rank 0")
        self._stop = threading.Event()
        # The job's failure once this process has read or published it: a thread that then
        # finds the store gone (its host exited after the others read it) repeats it instead
        # of blaming the store's host.
        self._known_failure: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._watched = (rank + 1) % world_size

    @staticmethod
    def _connect() -> dist.Store:
        # A store client of our own: the process group's may be busy inside a collective.
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"])
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)

    @staticmethod
    def _describe_store_host(store: Optional[dist.Store]) -> str:
        if store is not None and not isinstance(store, dist.TCPStore):
            return "the process hosting the rendezvous store"
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: the store lives in its agent
            return "the torchrun agent (it hosts the rendezvous store)"
        return "rank 0 (it hosts the rendezvous store)"

    def _call(self, op: str, *args: Any, timeout: Optional[float] = None) -> Any:
        return self._store.call(self.timeout if timeout is None else timeout, op, *args)

    def _store_lost(self, exc: BaseException) -> str:
        if isinstance(exc, StoreUnreachable):
            return (
                f"{self._store_host} is hung or dead: the store gave {exc.args[0]} "
                f"(failure timeout {self.timeout:.0f}s)"
            )
        return f"{self._store_host} died: lost the store ({type(exc).__name__}: {str(exc)[:300]})"

    def start(self) -> "RankWatchdog":
        # The first call connects, which can take a while on a busy host; TCPStore bounds
        # the connection itself (30 s), and the store host was alive a moment ago.
        self._call("add", f"hb/{self.rank}", 1, timeout=max(self.timeout, 60.0))
        self._thread = threading.Thread(target=self._run, name="longctx-watchdog", daemon=True)
        self._thread.start()
        return self

    def report_failure(self, error: BaseException | str) -> str:
        """Record why this rank is failing (call from an exception handler); returns the
        FIRST failure of the job, which is printed when it is another rank's.

        A communication error here is usually a symptom: the peer at the other end died.
        Such a rank waits (bounded by ``timeout``) for the root cause to be published by
        the rank that raised it or by the dead rank's watcher, so that the message every
        rank prints names the rank that actually failed. If the store itself is gone or
        does not answer, its host is the rank that failed: this rank exits naming it.
        """
        text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
        mine = f"rank {self.rank} failed: {text}"[:2000]
        symptom = isinstance(error, BaseException) and _is_communication_error(error)
        try:
            if symptom:
                deadline = time.monotonic() + self.timeout + 3 * self.interval
                while time.monotonic() < deadline and not self._call("check", ["failure"]):
                    time.sleep(self.interval / 2)
                if not self._call("check", ["failure"]):
                    # No rank raised and every heartbeat moves: a peer is alive but never joined
                    # (stalled outside the collective); this rank did not fail, it stopped waiting.
                    mine = (
                        f"rank {self.rank} stopped waiting in a collective ({text[:1500]}); no rank failed "
                        f"and every heartbeat kept moving for {self.timeout:.0f}s: a rank is stalled "
                        "(alive, not joining the collective)"
                    )
            first = self._call("compare_set", "failure", "", mine).decode(errors="replace")
            self._known_failure = first
        except Exception as exc:  # noqa: BLE001 - the store is gone or hung
            if symptom and self._known_failure is not None:
                # This rank's watchdog thread read the job's failure and is lingering before it
                # exits; meanwhile a peer that read it earlier exited (closing this rank's
                # collective) and the store's host too: the failure, not the host, is the cause.
                self.on_failure(f"rank {self.rank} stopping: {self._known_failure}")
            elif symptom:
                self.on_failure(
                    f"rank {self.rank} stopping: {self._store_lost(exc)}; this rank then failed with {text[:500]}"
                )
            return mine
        if first != mine:
            sys.stderr.write(f"\n[longctx watchdog] rank {self.rank}: first failure of the job: {first}\n")
            sys.stderr.flush()
        # A reader only says it knows; the publisher waits a little for the others to read,
        # and the store's host until they have (it exits with the store, read or not).
        self._linger(wait=first == mine)
        return first

    def stop(self) -> None:
        """Clean shutdown: the peer watching this rank must not mistake the exit for a death."""
        self._stop.set()
        try:
            self._call("set", f"done/{self.rank}", "1", timeout=min(self.timeout, 10.0))
        except Exception:  # noqa: BLE001 - the job is over; the store may be gone already
            pass
        self._store.close()

    def _run(self) -> None:
        last_count, last_change = None, time.monotonic()
        while not self._stop.wait(self.interval):
            mine = self._collective_count()
            try:
                self._call("add", f"hb/{self.rank}", 1)
                if mine is not None and mine + 1 != self._published:  # plus one: 0 is "none yet"
                    self._call("set", f"coll/{self.rank}", str(mine + 1))
                    self._published = mine + 1
                if self._call("check", ["failure"]):
                    message = self._known_failure = self._call("get", "failure").decode(errors="replace")
                    self._fail(message)
                    return
                if self.world_size == 1 or self._call("check", [f"done/{self._watched}"]):
                    continue
                count = self._call("add", f"hb/{self._watched}", 0)
                theirs = self._call("add", f"coll/{self._watched}", 0) if mine is not None else 0
            except Exception as exc:  # noqa: BLE001
                if self._known_failure is not None:
                    # This process published or read the job's failure and the store's host
                    # exited once every rank had read it: the failure, not the host, is the
                    # cause. The thread that knows it ends the process; if it has not a few
                    # intervals later, this one does, naming the failure.
                    time.sleep(3 * self.interval)
                    self._fail(self._known_failure, linger=False)
                    return
                # Nobody can read a message from a dead store: no lingering.
                self._fail(self._store_lost(exc), linger=False)
                return
            now = time.monotonic()
            if count != last_count:
                last_count, last_change = count, now
            elif now - last_change > self.timeout:
                self._declare(
                    f"rank {self._watched} stopped responding (no heartbeat for "
                    f"{now - last_change:.0f}s; killed or hung)"
                )
                return
            # A peer whose heartbeat stopped is left to the check above (dead, not stalled).
            stalled = self._stalled(mine, theirs, now) if now - last_change <= 3 * self.interval else None
            if stalled:
                self._declare(stalled)
                return

    def _collective_count(self) -> Optional[int]:
        if self._collectives is None:
            return None
        try:
            return int(self._collectives())
        except Exception as exc:  # noqa: BLE001 - a backend without sequence numbers
            self._collectives = None
            sys.stderr.write(
                f"\n[longctx watchdog] rank {self.rank}: no collective counts ({type(exc).__name__}: "
                f"{str(exc)[:200]}); a stalled rank is left to the process-group timeout\n"
            )
            return None

    def _stalled(self, mine: Optional[int], theirs: int, now: float) -> Optional[str]:
        """The message if the watched peer has stayed behind this rank's collectives, without
        issuing one, for ``collective_timeout`` seconds: this rank's next collective after
        the peer's count has waited that long (its process-group timeout is up)."""
        if mine is None or not 0 < theirs <= mine:  # not published yet, or level with / ahead of this rank
            self._behind = None
            return None
        if self._behind is None or self._behind[0] != theirs:
            self._behind = (theirs, now)
            return None
        if now - self._behind[1] <= self.collective_timeout:
            return None
        return (
            f"rank {self._watched} is stalled: alive (its heartbeat moves) but it has not joined collective "
            f"#{theirs} of the default process group, which rank {self.rank} has waited in for over "
            f"{self.collective_timeout:.0f}s (the process-group timeout)"
        )

    def _declare(self, message: str) -> None:
        """Publish ``message`` as the job's failure and end, naming the job's first failure
        (another rank may have published one meanwhile)."""
        try:
            message = self._known_failure = self._call("compare_set", "failure", "", message).decode(errors="replace")
        except Exception:  # noqa: BLE001
            pass
        self._fail(message)

    def _linger(self, wait: bool = True) -> None:
        """This rank knows the job's failure; let the others read it before this process
        exits. The store's host (rank 0 under a plain launch: the store dies with it) waits
        until every rank has said it knows (a busy rank can take several intervals to poll),
        at most ``LINGER_INTERVALS``; the others a few intervals where ``wait``."""
        try:
            self._call("set", f"known/{self.rank}", "1")
            if not self._hosts_store:
                if wait:
                    time.sleep(3 * self.interval)
                return
            everyone = [f"known/{r}" for r in range(self.world_size)]
            deadline = time.monotonic() + LINGER_INTERVALS * self.interval
            while time.monotonic() < deadline and not self._call("check", everyone):
                time.sleep(self.interval / 4)
        except Exception:  # noqa: BLE001 - the store is gone: nobody can read it any more
            pass

    def _fail(self, message: str, linger: bool = True) -> None:
        if self._stop.is_set():
            return
        if linger:
            self._linger()
        if not self._stop.is_set():  # a clean shutdown may have begun meanwhile
            self.on_failure(f"rank {self.rank} stopping: {message}")
