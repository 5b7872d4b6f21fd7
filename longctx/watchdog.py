"""Fail fast when a rank dies: no process is left hanging in a collective or a ring hop.

A rank blocked in a NCCL/gloo receive cannot notice that its peer died until the process
group's timeout (10+ minutes by default for NCCL). The watchdog is a daemon thread in
every rank that talks to the rendezvous store, not to the process group:

* it bumps this rank's heartbeat counter every ``interval`` seconds;
* it watches ONE peer (rank + 1): if that counter stops moving for ``timeout`` seconds,
  the peer is declared dead (a SIGKILL, an OOM kill, a hung host);
* a rank that raises publishes the failure itself (``report_failure``), at once;
* every rank polls one shared ``failure`` key; whoever sees it prints the message, which
  names the failed rank, and exits the process with ``os._exit``, which works even while
  the main thread is stuck inside a C++ collective.

Store traffic is three small operations per rank per interval, independent of the
world size. Losing the store itself (the host of rank 0 died) is also a failure.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

EXIT_CODE = 75  # distinct from Python's 1, so launchers' logs show who exited by policy


def _hard_exit(message: str) -> None:
    sys.stderr.write(f"\n[longctx watchdog] {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def _is_communication_error(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return any(marker in text for marker in ("gloo", "NCCL", "Connection reset", "Connection closed"))


class RankWatchdog:
    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        timeout: float = 60.0,
        interval: float = 1.0,
        store: Optional[dist.Store] = None,
        on_failure: Callable[[str], None] = _hard_exit,
    ):
        if timeout <= interval:
            raise ValueError(f"watchdog timeout ({timeout}s) must exceed its interval ({interval}s)")
        self.rank, self.world_size = rank, world_size
        self.timeout, self.interval = timeout, interval
        self.on_failure = on_failure
        self._store = dist.PrefixStore("longctx_watchdog/", store or self._connect())
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._watched = (rank + 1) % world_size

    @staticmethod
    def _connect() -> dist.Store:
        # A store client of our own: the process group's may be busy inside a collective.
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"])
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30),
                             wait_for_workers=False)

    def start(self) -> "RankWatchdog":
        self._store.add(f"hb/{self.rank}", 1)
        self._thread = threading.Thread(target=self._run, name="longctx-watchdog", daemon=True)
        self._thread.start()
        return self

    def report_failure(self, error: BaseException | str) -> str:
        """Record why this rank is failing (call from an exception handler); returns the
        FIRST failure of the job, which is printed when it is another rank's.

        A communication error here is usually a symptom: the peer at the other end died.
        Such a rank waits (bounded by ``timeout``) for the root cause to be published by
        the rank that raised it or by the dead rank's watcher, so that the message every
        rank prints names the rank that actually failed.
        """
        text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
        mine = f"rank {self.rank} failed: {text}"[:2000]
        try:
            if isinstance(error, BaseException) and _is_communication_error(error):
                deadline = time.monotonic() + self.timeout + 3 * self.interval
                while time.monotonic() < deadline and not self._store.check(["failure"]):
                    time.sleep(self.interval / 2)
            first = self._store.compare_set("failure", "", mine).decode(errors="replace")
        except Exception:  # the store may be gone too; the heartbeat then tells the others
            return mine
        if first == mine:
            time.sleep(3 * self.interval)  # let the others read it before this process exits
        else:
            sys.stderr.write(f"\n[longctx watchdog] rank {self.rank}: first failure of the job: {first}\n")
            sys.stderr.flush()
        return first

    def stop(self) -> None:
        """Clean shutdown: the peer watching this rank must not mistake the exit for a death."""
        self._stop.set()
        try:
            self._store.set(f"done/{self.rank}", "1")
        except Exception:
            pass

    def _run(self) -> None:
        last_count, last_change = None, time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self._store.add(f"hb/{self.rank}", 1)
                if self._store.check(["failure"]):
                    self._fail(self._store.get("failure").decode(errors="replace"))
                    return
                if self.world_size == 1 or self._store.check([f"done/{self._watched}"]):
                    continue
                count = self._store.add(f"hb/{self._watched}", 0)
            except Exception as exc:  # noqa: BLE001
                if self._stop.is_set():
                    return
                self._fail(f"lost the rendezvous store ({type(exc).__name__}: {exc}); "
                           "the rank hosting it (usually rank 0) has likely died")
                return
            now = time.monotonic()
            if count != last_count:
                last_count, last_change = count, now
            elif now - last_change > self.timeout:
                message = (f"rank {self._watched} stopped responding (no heartbeat for "
                           f"{now - last_change:.0f}s; killed or hung)")
                try:
                    self._store.compare_set("failure", "", message)
                except Exception:
                    pass
                self._fail(message)
                return

    def _fail(self, message: str) -> None:
        if self._stop.is_set():
            return
        # Linger so the others can still read the message: the store usually lives in
        # rank 0's process and dies with it.
        time.sleep(3 * self.interval)
        if not self._stop.is_set():  # a clean shutdown may have begun meanwhile
            self.on_failure(f"rank {self.rank} stopping: {message}")
