"""Signals end a Lightning-launched CP job cleanly (train.py, CP=2 over gloo, 2 CPU processes).

* SIGTERM to rank 0 (what ``timeout``, SLURM preemption and Kubernetes send): every process
  exits within seconds with 143 (128 + SIGTERM), after saving a checkpoint of the last
  completed step and metrics.csv; the message names the signal, no rank is blamed;
* SIGKILL of rank 0 while rank 1 is frozen (SIGSTOP, as a hung rank): rank 1 does not
  survive it (a running rank 1 would also exit through its broken connection);
* a port clash (MASTER_PORT held by another process): rank 0 fails at once and takes the
  rank it launched with it instead of leaving it waiting for a rendezvous forever.
* a stop that cannot finish in the grace period (a save too slow, a rank stuck) ends the
  process at the deadline, naming the signal, instead of hanging.

Each run is a session of its own, killed as a group at the end: only our own processes.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers.train_script import launch_env

from longctx.lightning.launcher import LAUNCHER_PID_ENV

REPO = Path(__file__).resolve().parents[2]
ARGS = [
    "--data",
    "stdlib:json,email",
    "--preset",
    "tiny",
    "--model.model.vocab_size",
    "512",
    "--seq-len",
    "64",
    "--batch-size",
    "2",
    "--max-steps",
    "100000",
    "--lr",
    "3e-3",
    "--context-parallel",
    "2",
    "--devices",
    "2",
    "--accelerator",
    "cpu",
    "--precision",
    "32-true",
    "--checkpoint-every",
    "1000",
    "--val-every",
    "0",
    "--trainer.enable_progress_bar",
    "false",
    "--failure-timeout",
    "10",
]
STARTUP_S = 150  # imports, tokenizer and corpus cache (first run), rendezvous, first steps


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return launch_env(tmp_path_factory.mktemp("longctx-cache"))


def _start(out: Path, env: dict, *extra: str) -> subprocess.Popen:
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *ARGS, "--output-dir", str(out), *extra],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # As in a terminal, also where pytest runs in the background (which ignores SIGINT).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _log(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text(errors="replace")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: the parent pid
                found.append(int(entry.name))
    return found


def _launched_ranks(pid: int) -> list[int]:
    """The ranks that rank 0 (``pid``) launched: its children that run train.py with its pid as
    their launcher in their environment (``LAUNCHER_PID_ENV``). Whatever else a rank starts
    (compile workers, helpers: a GPU machine's rank 0 has more children) is not counted."""
    ranks = []
    for child in _children(pid):
        try:
            cmdline = (Path("/proc") / str(child) / "cmdline").read_bytes().split(b"\0")
            environ = (Path("/proc") / str(child) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone already
        if any(arg.endswith(b"train.py") for arg in cmdline) and f"{LAUNCHER_PID_ENV}={pid}".encode() in environ:
            ranks.append(child)
    return ranks


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_training(proc: subprocess.Popen, out: Path) -> list[int]:
    """Wait for logged steps (the CSV logger's first write); return the rank rank 0 launched."""
    deadline = time.monotonic() + STARTUP_S
    while not (out / "logs" / "version_0" / "metrics.csv").exists():
        assert proc.poll() is None, f"train.py exited early ({proc.returncode}):\n{_log(out)[-4000:]}"
        assert time.monotonic() < deadline, f"no training step after {STARTUP_S}s:\n{_log(out)[-4000:]}"
        time.sleep(0.2)
    ranks = _launched_ranks(proc.pid)
    assert len(ranks) == 1, f"rank 0 launched {ranks} (of its children {_children(proc.pid)}); expected rank 1 only"
    return ranks


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _cleanup(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: rank 0 and whatever it started
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path, env):
    out = tmp_path / "run"
    proc = _start(out, env)
    try:
        children = _wait_training(proc, out)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - start
        left = _wait_gone(children, 5)
    finally:
        _cleanup(proc)
    log = _log(out)
    assert rc == 128 + signal.SIGTERM, f"rc {rc}:\n{log[-4000:]}"
    assert elapsed < 30, f"took {elapsed:.1f}s to stop:\n{log[-4000:]}"
    assert not left, f"rank 1 (pid {left}) still running after rank 0 exited"
    assert "stopped by SIGTERM" in log, log[-4000:]
    assert " failed" not in log, log[-4000:]  # a signal is not a rank's failure
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] > 0
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    assert len(rows) == ckpt["global_step"], rows  # every step up to the checkpoint's logged


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("to", ["every rank", "the launcher"])
def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path, env, to):
    """Ctrl-C as a terminal sends it (SIGINT to every process of the job) or as ``kill -INT``
    does (rank 0, the launcher, only): the step ends, a checkpoint of it is saved, every process
    exits, rank 0 with 130 and a last line that says how to resume; no rank is blamed."""
    out = tmp_path / "run"
    proc = _start(out, env)
    try:
        children = _wait_training(proc, out)
        start = time.monotonic()
        if to == "every rank":
            os.killpg(proc.pid, signal.SIGINT)  # the job's own session: rank 0 and rank 1
        else:
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - start
        left = _wait_gone(children, 5)
    finally:
        _cleanup(proc)
    log = _log(out)
    assert rc == 128 + signal.SIGINT, f"rc {rc}:\n{log[-4000:]}"
    # Within the 25 s grace period (~5 s on an idle machine: the step, the save, the summary).
    assert elapsed < 30, f"took {elapsed:.1f}s to stop:\n{log[-4000:]}"
    assert not left, f"rank 1 (pid {left}) still running after rank 0 exited"
    for wrong in (" failed", "KeyboardInterrupt", "Traceback"):
        assert wrong not in log, log[-4000:]
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    step = ckpt["global_step"]
    assert step > 0
    assert log.count("Ctrl-C: stopping after the current step") == 1, log[-4000:]
    last = log.strip().splitlines()[-1]
    assert last == (
        f"stopped by SIGINT (Ctrl-C) at step {step}, exit code 130; to continue from its checkpoint: "
        f"python train.py --resume {out}"
    ), log[-4000:]
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    assert len(rows) == step, rows  # every step up to the checkpoint's logged


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_rank_0_leaves_no_orphan(tmp_path, env):
    out = tmp_path / "run"
    proc = _start(out, env)
    try:
        children = _wait_training(proc, out)
        os.kill(children[0], signal.SIGSTOP)
        proc.kill()
        proc.wait(timeout=10)
        left = _wait_gone(children, 5)
    finally:
        _cleanup(proc)
    assert not left, f"frozen rank 1 (pid {left}) survived rank 0's SIGKILL:\n{_log(out)[-3000:]}"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_port_clash_ends_rank_0_and_its_child(tmp_path, env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = tmp_path / "run"
        proc = _start(
            out,
            {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(taken.getsockname()[1])},
            "--strategy.timeout",
            "0:10:00",
        )
        children: set[int] = set()
        try:
            deadline = time.monotonic() + STARTUP_S
            while proc.poll() is None and time.monotonic() < deadline:
                children.update(_children(proc.pid))
                time.sleep(0.2)
            rc = proc.poll()
            left = _wait_gone(sorted(children), 10)
        finally:
            _cleanup(proc)
    log = _log(out)
    assert rc is not None and rc != 0, f"rank 0 still running after {STARTUP_S}s:\n{log[-3000:]}"
    assert children, log[-3000:]
    assert not left, f"rank 1 (pid {left}) left behind after a port clash:\n{log[-3000:]}"


def test_grace_period_bounds_a_stop_that_does_not_finish():
    code = textwrap.dedent("""
        import signal, time
        from longctx.lightning.preemption import SignalStop
        stop = SignalStop(0.5, forward=lambda signum: None, before_exit=lambda: print("children ended", flush=True))
        signal.signal(signal.SIGTERM, stop.handle)
        print("signal at", time.time(), flush=True)
        signal.raise_signal(signal.SIGTERM)
        time.sleep(30)  # a stop stuck in a save or a collective
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    ended = time.time()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    # From the signal, not the start: imports take long on a busy machine.
    assert ended - float(re.search(r"signal at ([0-9.]+)", proc.stdout)[1]) < 20
    assert "children ended" in proc.stdout
    assert "stopped by SIGTERM: no checkpoint could be saved within the 0.5s grace period" in proc.stderr


def test_ctrl_c_stops_after_the_step_and_a_second_one_at_once():
    """SignalStop's SIGINT: the first records a stop (no KeyboardInterrupt, one line on rank 0);
    a repeat within INTERRUPT_REPEAT_S is the same key press (a terminal and torchrun's agent
    both deliver it); a later one ends the process and its children at once with 130."""
    code = textwrap.dedent("""
        import signal, time
        from longctx.lightning.preemption import INTERRUPT_REPEAT_S, SignalStop
        stop = SignalStop(30, forward=lambda signum: print("forwarded", flush=True),
                          before_exit=lambda: print("children ended", flush=True))
        signal.signal(signal.SIGINT, stop.handle)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the same Ctrl-C, delivered twice
        print("still running, stop requested by", stop.signum, flush=True)
        time.sleep(INTERRUPT_REPEAT_S + 0.2)
        print(time.time(), flush=True)
        signal.raise_signal(signal.SIGINT)  # a second Ctrl-C
        time.sleep(30)
        print("not reached", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    ended = time.time()
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-2000:]
    first, second_at, *rest = proc.stdout.splitlines()
    assert first == "still running, stop requested by 2" and rest == ["children ended"], proc.stdout
    assert ended - float(second_at) < 10  # at once, not after the 30 s grace period
    assert "KeyboardInterrupt" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("Ctrl-C: stopping after the current step") == 1, proc.stderr
    assert "second Ctrl-C: stopped at once" in proc.stderr


def test_a_forked_child_leaves_the_signal_to_its_rank():
    """A DataLoader worker (forked: it inherits the rank's handler, and a terminal's Ctrl-C
    reaches it too) neither records a stop nor prints; the rank's own process does, once."""
    code = textwrap.dedent("""
        import os, signal, sys
        from longctx.lightning.preemption import SignalStop
        stop = SignalStop(30, forward=lambda signum: None, before_exit=lambda: None)
        signal.signal(signal.SIGINT, stop.handle)
        pid = os.fork()
        if pid == 0:  # the worker
            signal.raise_signal(signal.SIGINT)
            os._exit(0 if stop.signum is None else 1)
        _, status = os.waitpid(pid, 0)
        signal.raise_signal(signal.SIGINT)
        print(os.waitstatus_to_exitcode(status), stop.signum, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", str(int(signal.SIGINT))], proc.stdout
    assert proc.stderr.count("Ctrl-C: stopping after the current step") == 1, proc.stderr
