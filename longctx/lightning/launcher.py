"""Lightning's script launcher, made to end every process it starts.

Under a plain ``python train.py --devices N`` Lightning's ``_SubprocessScriptLauncher``
re-runs the script N-1 times as children of rank 0. A child outlives a rank 0 that leaves
early (a port clash, an exception before the rendezvous, SIGKILL) and then waits in
``init_process_group`` or a collective for as long as anyone lets it, holding its memory.
Here:

* rank 0 ends its children when it exits (normally or by an exception: ``atexit``, since
  Lightning's teardown of a failed run still talks to them): after a wait for them to exit
  on their own (shorter after an exception), SIGTERM, then SIGKILL after a grace;
* every child dies with rank 0 (Linux ``PR_SET_PDEATHSIG``, else a thread watching the
  parent pid), which covers a rank 0 killed by SIGKILL (no code of it runs) and a child
  that is frozen (SIGSTOP) or stuck in C++;
* a child that exits with an error ends the job, as Lightning's own observer does, but
  only after the watchdog had time to name the cause, and never while the job is
  stopping by a signal (children then exit with 128 + signal while rank 0 still writes).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from ..watchdog import hard_exit

LAUNCHER_PID_ENV = "LONGCTX_LAUNCHER_PID"  # set in the children's environment: their rank 0
PR_SET_PDEATHSIG = 1
FAILED_EXIT_WAIT_S = 5.0  # rank 0 raised: the children usually fail the same way within seconds
FINISH_WAIT_S = 15.0  # rank 0 finished: the children finish their own copy of the script
TERM_GRACE_S = 5.0  # between SIGTERM and SIGKILL
CHILD_FAILURE_WAIT_S = 10.0  # a child failed: time for the watchdog to name the cause


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    hard_exit(f"rank 0 (pid {parent}), which launched this process, is gone: exiting with it")


def exit_with_launcher() -> None:
    """In a process started by ``ReapingScriptLauncher``: die when the launching rank 0 does.

    The kernel's parent-death signal follows the parent *thread*; Lightning launches from
    the thread that calls ``Trainer.fit``, which lives as long as the job does."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)  # not for processes this one starts
    if launcher is None:
        return
    parent = int(launcher)
    if not _set_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent,), name="longctx-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # rank 0 died before the signal was armed
        hard_exit(f"rank 0 (pid {parent}), which launched this process, is gone: exiting with it")


class ReapingScriptLauncher(_SubprocessScriptLauncher):
    """``_SubprocessScriptLauncher`` that ends every child it started (see the module doc).

    ``is_stopping`` tells whether the job is stopping by a signal (children exit non-zero
    then, by design)."""

    def __init__(self, *args: Any, is_stopping: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._is_stopping = is_stopping
        self._exit_wait = FINISH_WAIT_S

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
            try:
                self._call_children_scripts()
            finally:
                del os.environ[LAUNCHER_PID_ENV]
            atexit.register(lambda: self.end_children(self._exit_wait))
            threading.Thread(target=self._observe, name="longctx-child-observer", daemon=True).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except BaseException:
            self._exit_wait = FAILED_EXIT_WAIT_S
            raise

    def end_children(self, wait: float) -> None:
        """Let the children exit on their own for ``wait`` seconds, then SIGTERM, then SIGKILL."""
        alive = [p for p in self.procs if p.poll() is None]
        for end, seconds in ((None, wait), ("terminate", TERM_GRACE_S), ("kill", TERM_GRACE_S)):
            for proc in alive if end else ():
                getattr(proc, end)()
            deadline = time.monotonic() + seconds
            while alive and time.monotonic() < deadline:
                time.sleep(0.05)
                alive = [p for p in alive if p.poll() is None]
            if not alive:
                return

    def _observe(self) -> None:
        first_rank = self.cluster_environment.node_rank() * self.num_processes
        while True:
            time.sleep(1.0)
            codes = [p.poll() for p in self.procs]
            if all(code == 0 for code in codes):
                return
            failed = [(first_rank + i + 1, p, c) for i, (p, c) in enumerate(zip(self.procs, codes)) if c]
            if failed and not self._is_stopping():
                time.sleep(CHILD_FAILURE_WAIT_S)  # this process usually exits first, naming the cause
                if self._is_stopping():
                    continue
                rank, proc, code = failed[0]
                self.kill(signal.SIGKILL)
                hard_exit(f"rank {rank} (pid {proc.pid}) ended with {_describe_exit(code)}: ending the job")
