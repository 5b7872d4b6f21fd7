"""Runs of train.py for benchmarks/faults.py: start one (a plain launch or under torchrun)
through benchmarks/fault_inject.py, follow its ranks through the probe, signal them, wait
for the end, and find what it left behind (processes, GPU memory).

Every run is a session of its own whose processes carry ``LONGCTX_FAULTS_RUN=<id>`` in their
environment: what is left of a run is found by that mark (not by name), and only those
processes are ever killed.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
INJECT = HERE / "fault_inject.py"
MARK_ENV = "LONGCTX_FAULTS_RUN"


def _environ(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not reaped, does not count)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked(mark: str) -> list[int]:
    """The live processes whose environment carries ``mark``."""
    needle = f"{MARK_ENV}={mark}\0".encode()
    return [
        int(e.name)
        for e in Path("/proc").iterdir()
        if e.name.isdigit() and needle in _environ(int(e.name)) and alive(int(e.name))
    ]


def gpu_pids() -> Optional[list[int]]:
    """PIDs holding GPU memory (nvidia-smi), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [int(x) for x in out.split() if x.strip().isdigit()]


def gpu_held(settle: float = 10.0) -> Optional[list[int]]:
    """Every process nvidia-smi lists as holding GPU memory, after waiting up to ``settle``
    seconds for none; None without nvidia-smi."""
    deadline = time.monotonic() + settle
    while (held := gpu_pids()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return held


class Run:
    """One launch of train.py (``flags``) with ``fault`` injected (see fault_inject.py)."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        flags: list[str],
        *,
        fault: Optional[dict] = None,
        launcher: str = "plain",
        nproc: int = 2,
        env: Optional[dict] = None,
    ):
        self.name, self.launcher = name, launcher
        self.probe = workdir / f"{name}.probe"
        shutil.rmtree(self.probe, ignore_errors=True)
        self.probe.mkdir(parents=True)
        self.log_path = workdir / f"{name}.log"
        self.mark = f"{name}-{os.getpid()}-{time.monotonic_ns()}"
        run_env = {
            k: v
            for k, v in (env or os.environ).items()
            if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "NODE_RANK")
        }
        run_env.update(
            {
                MARK_ENV: self.mark,
                "LONGCTX_FAULTS_PROBE": str(self.probe),
                "LONGCTX_FAULT": json.dumps(fault or {}),
                "PYTHONUNBUFFERED": "1",
            }
        )
        script = [str(INJECT), str(REPO / "train.py"), *flags]
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
        else:
            cmd = [sys.executable, *script]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=run_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.seen: set[int] = {self.proc.pid}
        self._watching = True
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while self._watching:
            self.seen.update(marked(self.mark))
            time.sleep(0.25)

    # -- what the run shows --------------------------------------------------------------

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid(self, rank: int) -> Optional[int]:
        path = self.probe / f"rank{rank}.pid"
        return int(path.read_text().split()[0]) if path.exists() else None

    def steps(self, rank: int = 0) -> list[list[str]]:
        path = self.probe / f"rank{rank}.steps"
        return [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def completed(self, rank: int = 0) -> int:
        """The last optimizer step ``rank`` completed (0: none)."""
        rows = self.steps(rank)
        return int(rows[-1][0]) if rows else 0

    def fit_started(self, ranks: int = 2) -> bool:
        return all((self.probe / f"rank{r}.fit").exists() for r in range(ranks))

    def wait_for(self, condition, timeout: float, what: str) -> None:
        """Wait until ``condition()``; raise naming ``what`` if the run ended or time ran out first."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: exited ({self.proc.returncode}) before {what}: {last_lines(self.log(), 6)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {what} after {timeout:.0f}s: {last_lines(self.log(), 6)}")
            time.sleep(0.05)

    def wait_step(self, step: int, timeout: float) -> None:
        self.wait_for(lambda: self.completed() >= step, timeout, f"step {step}")

    # -- ending ----------------------------------------------------------------------------

    def signal(self, target: str, signum: int) -> int:
        """Send ``signum`` to ``target`` ("launcher", "rank0"/"rank1", or "all": every process of
        the run, as a terminal's Ctrl-C reaches them, the run being a session of its own); returns
        the pid (of the launcher for "all")."""
        if target == "all":
            os.killpg(self.proc.pid, signum)
            return self.proc.pid
        pid = self.proc.pid if target == "launcher" else self.pid(int(target.removeprefix("rank")))
        if pid is None:
            raise RuntimeError(f"{self.name}: no pid for {target}")
        os.kill(pid, signum)
        return pid

    def wait_end(self, timeout: float) -> tuple[Optional[int], float]:
        """Wait for the launcher and every marked process to end: (launcher's exit code or
        None if it still runs, seconds since ``self.started``). The rest is ``leftovers()``."""
        deadline = time.monotonic() + timeout
        try:
            rc = self.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - self.started
        while marked(self.mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        return rc, time.monotonic() - self.started

    def leftovers(self, settle: float = 2.0) -> list[int]:
        """Processes of this run still alive ``settle`` seconds after the launcher ended."""
        deadline = time.monotonic() + settle
        while (left := marked(self.mark)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def gpu_left(self, settle: float = 5.0) -> Optional[list[int]]:
        """This run's processes (PIDs as nvidia-smi lists them) still holding GPU memory,
        waiting ``settle`` seconds for the driver to release it; None without nvidia-smi.
        (Other runs may hold GPU memory meanwhile: faults.py checks for none at the end.)"""
        deadline = time.monotonic() + settle
        while (held := sorted(set(gpu_pids() or []) & self.seen)) and time.monotonic() < deadline:
            time.sleep(0.25)
        return held if gpu_pids() is not None else None

    def finish(self) -> None:
        """Stop following the run; SIGKILL whatever of it is left (by pid, marked only)."""
        self._watching = False
        for pid in marked(self.mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()


# -- reading a run's outputs ----------------------------------------------------------------


def last_lines(text: str, n: int) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-1500:]


def find_line(text: str, *patterns: str) -> str:
    """The first line matching one of ``patterns`` (tried in order), else ''."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in patterns:
        for line in lines:
            if re.search(pattern, line):
                return line[:500]
    return ""


def losses(out: Path) -> dict[int, float]:
    """step -> train_loss of a run's metrics.csv (the whole run, over its launches)."""
    path = out / "metrics.csv"
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}


def compare(run: dict[int, float], reference: dict[int, float], steps) -> Optional[float]:
    """Largest |difference| of the losses at ``steps`` (None if a step is missing in either)."""
    steps = list(steps)
    if not steps or any(s not in run or s not in reference for s in steps):
        return None
    return max(abs(run[s] - reference[s]) for s in steps)
