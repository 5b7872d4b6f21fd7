"""The cases of benchmarks/faults.py: each runs train.py (through fault_inject.py), injects
one fault, and returns its row of the table.

A row: ``case``, ``outcome`` ("pass"/"fail"), ``why`` (the checks that failed, or what
passed), ``seconds`` (from the fault to the last process gone), ``exit_codes``, ``work_lost``
(optimizer steps completed but not in the checkpoint a resume takes), ``message`` (the
line the run printed about it), and case-specific numbers.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from fault_runs import Run, compare, find_line, last_lines, losses

from longctx.lightning.checkpoint_io import checkpoint_step, find_resume_checkpoint

WATCHDOG_LINE = r"\[longctx watchdog\]"


@dataclass
class Settings:
    """What every case shares: where runs go, train.py's flags, the limits checked."""

    workdir: Path
    flags: list[str]  # train.py flags of every run but --output-dir (CP=2 over 2 processes)
    steps: int
    checkpoint_every: int
    failure_timeout: float
    grace: float
    stall_pg_timeout: int  # seconds: the process-group timeout of the stall case
    startup_s: float  # limit for a launch to reach its first steps
    gpu: bool
    loss_tol: float  # floor of the allowed |loss difference| where runs are not bit-exact
    reference: dict = field(default_factory=dict)  # step -> loss of the uninterrupted run
    noise: Optional[float] = None  # max |loss difference| of two uninterrupted runs

    @property
    def signal_step(self) -> int:
        """Where faults hit: half-way between two checkpoints."""
        return self.checkpoint_every + max(self.checkpoint_every // 2, 1)

    def run(
        self,
        name: str,
        extra: list[str] = (),
        *,
        fault: Optional[dict] = None,
        launcher: str = "plain",
        resume: Optional[Path] = None,
        out: Optional[Path] = None,
    ) -> Run:
        out = out or self.workdir / name
        flags = (
            ["--resume", str(resume), "--output-dir", str(out)] if resume else [*self.flags, "--output-dir", str(out)]
        )
        return Run(name, self.workdir, [*flags, *extra], fault=fault, launcher=launcher)

    def tolerance(self) -> float:
        """Allowed |loss difference| of a resumed run: 0 where two runs are bit-identical."""
        return 0.0 if not self.noise else max(2 * self.noise, self.loss_tol)


class Row(dict):
    """One case's row; ``check`` records each requirement, ``outcome`` follows."""

    def __init__(self, case: str, what: str):
        super().__init__(
            case=case, what=what, outcome="pass", why="", seconds=None, exit_codes={}, work_lost=None, message=""
        )
        self._failed: list[str] = []

    def check(self, ok: bool, failure: str) -> bool:
        if not ok:
            self._failed.append(failure)
        self["outcome"] = "fail" if self._failed else "pass"
        self["why"] = "; ".join(self._failed)
        return ok


def _signal_mid_step(
    s: Settings, row: Row, name: str, launcher: str, target: str, signum: int, limit: float
) -> tuple[Run, Optional[int]]:
    """Start run ``name``, send ``signum`` to ``target`` once it reaches the fault step, and
    wait (up to ``limit`` s) for every process to end: (the finished run, its exit code)."""
    run = s.run(name, launcher=launcher)
    try:
        run.wait_step(s.signal_step, s.startup_s)
        since = time.monotonic()
        run.signal(target, signum)
        rc = _end(s, run, row, since, limit)
    finally:
        run.finish()
    return run, rc


def _end(s: Settings, run: Run, row: Row, since: float, limit: float, key: str = "launcher") -> Optional[int]:
    """Wait (at most ``limit`` s from ``since``) for the run to end; record the exit code, the
    seconds from ``since``, leftover processes and GPU memory."""
    rc, _ = run.wait_end(max(limit - (time.monotonic() - since), 1.0) + 5.0)
    row["seconds"] = round(time.monotonic() - since, 1)
    row["exit_codes"][key] = rc
    row.check(rc is not None, f"still running {limit:.0f}s after the fault (hang)")
    left = run.leftovers()
    row.check(not left, f"processes left: {left}")
    if s.gpu:
        held = run.gpu_left()
        row["gpu_pids_after"] = held
        row.check(not held, f"GPU memory still held by pids {held}")
    return rc


def _work_lost(run: Run, out: Path, row: Row, ranks: int = 2, done: Optional[int] = None) -> None:
    """Steps completed (the probe, or ``done``) minus the step of the checkpoint --resume would take."""
    done = max(run.completed(r) for r in range(ranks)) if done is None else done
    try:
        ckpt = find_resume_checkpoint(out)
        step = checkpoint_step(ckpt)
    except FileNotFoundError:
        ckpt, step = None, 0
    row.update(
        completed_steps=done,
        checkpoint_step=step,
        checkpoint=str(ckpt.relative_to(out)) if ckpt else None,
        work_lost=done - step,
    )


def _resume_matches(
    s: Settings,
    row: Row,
    out: Path,
    name: str,
    first: int = 0,
    extra: list[str] = (),
    resume: Optional[Path] = None,
    tol: Optional[float] = None,
) -> None:
    """--resume the run in ``out``; its losses from step ``first`` on must equal the
    uninterrupted run's (bit-exact, or within the measured noise)."""
    resumed = s.run(name, list(extra), resume=resume or out, out=out)
    rc, _ = resumed.wait_end(s.startup_s + 60 * s.steps)
    resumed.finish()
    row["exit_codes"]["resume"] = rc
    if not row.check(rc == 0, f"--resume exited {rc}: {last_lines(resumed.log(), 3)}"):
        return
    diff = compare(losses(out), s.reference, range(first, s.steps))
    tol = s.tolerance() if tol is None else tol
    row["loss_diff"], row["loss_tol"] = diff, tol
    row.check(diff is not None, "the resumed run's metrics.csv misses steps")
    row.check(
        diff is None or diff <= tol, f"resumed losses differ from the uninterrupted run's by {diff:.3g} > {tol:.3g}"
    )


# -- the cases --------------------------------------------------------------------------------


def baseline(s: Settings, name: str = "baseline") -> Row:
    """The uninterrupted run every resume is compared with (keeps every checkpoint)."""
    row = Row(name, "uninterrupted run (the reference losses)")
    run = s.run(name, ["--run.keep_checkpoints", "-1"])
    rc, seconds = run.wait_end(s.startup_s + 60 * s.steps)
    run.finish()
    row.update(seconds=round(seconds, 1), exit_codes={"launcher": rc}, work_lost=0)
    row.check(rc == 0, f"exited {rc}: {last_lines(run.log(), 3)}")
    found = losses(s.workdir / name)
    row.check(len(found) == s.steps, f"{len(found)} losses logged of {s.steps}")
    row["message"] = find_line(run.log(), r"^done: ")
    row["run_plan"] = find_line(run.log(), r"^run plan: ")  # which kernels the suite ran
    row["losses"] = found
    return row


def sigterm(target: str) -> Callable[[Settings], Row]:
    launcher = "torchrun" if target == "launcher" else "plain"

    def case(s: Settings) -> Row:
        name = f"sigterm_{target}"
        what = (
            f"SIGTERM to {target} mid-step"
            if launcher == "plain"
            else "SIGTERM to the launching process (torchrun's agent) mid-step"
        )
        row = Row(name, what)
        out = s.workdir / name
        run, rc = _signal_mid_step(s, row, name, launcher, target, signal.SIGTERM, s.grace + 10)
        log = run.log()
        row["message"] = find_line(log, r"\[longctx\] stopped by SIGTERM at step", r"stopped by SIGTERM")
        if launcher == "plain":
            row.check(rc == 143, f"exit code {rc}, not 143")
        else:  # torchrun exits 1 when a signal ends it; each worker's code is in its summary
            codes = [int(c) for c in _torchrun_exit_codes(log)]
            row["exit_codes"]["workers"] = codes
            row.check(
                codes == [143, 143] or "stopped by SIGTERM at step" in log and not codes,
                f"workers exited {codes}, not 143",
            )
        _stopped_cleanly(s, row, run, out, name, log)
        return row

    case.__name__ = f"sigterm_{target}"
    return case


def _stopped_cleanly(s: Settings, row: Row, run, out, name: str, log: str) -> None:
    """What every requested stop (SIGTERM, SIGINT) must show: within the grace period, every
    rank after the same step, no work lost, nobody reported failed, and the resume continuing
    the uninterrupted run's losses."""
    row.check(
        row["seconds"] is not None and row["seconds"] <= s.grace,
        f"took {row['seconds']}s > the {s.grace:g}s grace period",
    )
    ends = [run.completed(r) for r in range(2)]
    row.check(ends[0] == ends[1], f"ranks stopped at different steps {ends}")
    _work_lost(run, out, row)
    row.check(row["work_lost"] == 0, f"{row['work_lost']} steps lost (the stop saves its own step)")
    row.check(" failed" not in log, "a rank was reported failed")
    _resume_matches(s, row, out, f"{name}_resume")


def sigint(target: str, launcher: str = "plain") -> Callable[[Settings], Row]:
    """Ctrl-C: SIGINT to the launching process only (``kill -INT``; under a plain launch that is
    rank 0) or to every process of the job (``all``: what a terminal does; under torchrun its
    agent also passes it on). Like SIGTERM: every rank stops after the same step with a
    checkpoint of it, exit code 130, and the resumed losses continue the uninterrupted run's."""
    suffix = "_torchrun" if launcher == "torchrun" else ""

    def case(s: Settings) -> Row:
        name = f"sigint_{target}{suffix}"
        to = "every process (a terminal's Ctrl-C)" if target == "all" else "the launching process (kill -INT)"
        row = Row(name, f"SIGINT to {to} mid-step" + (", under torchrun" if suffix else ""))
        out = s.workdir / name
        run, rc = _signal_mid_step(s, row, name, launcher, target, signal.SIGINT, s.grace + 10)
        log = run.log()
        row["message"] = find_line(log, r"^stopped by SIGINT \(Ctrl-C\) at step", r"stopped by SIGINT")
        if launcher == "plain":
            row.check(rc == 130, f"exit code {rc}, not 130")
        else:
            codes = [int(c) for c in _torchrun_exit_codes(log)]
            row["exit_codes"]["workers"] = codes
            row.check(codes in ([130, 130], []) and "stopped by SIGINT at step" in log, f"workers exited {codes}")
        row.check("KeyboardInterrupt" not in log, "a rank was reported failed (KeyboardInterrupt)")
        _stopped_cleanly(s, row, run, out, name, log)
        return row

    case.__name__ = f"sigint_{target}{suffix}"
    return case


def _torchrun_exit_codes(log: str) -> list[str]:
    return re.findall(r"exitcode\s*:\s*(-?\d+)", log)


def sigkill(target: str, launcher: str = "plain") -> Callable[[Settings], Row]:
    def case(s: Settings) -> Row:
        name = f"sigkill_{target}" + ("_torchrun" if launcher == "torchrun" else "")
        under = " (under torchrun)" if launcher == "torchrun" else ""
        row = Row(name, f"SIGKILL of {target} during training{under}")
        # Bound: the watchdog's timeout + its lingering, or the launcher's 10 s wait for the
        # watchdog's message, whichever is first; plus a second of polling.
        run, rc = _signal_mid_step(s, row, name, launcher, target, signal.SIGKILL, s.failure_timeout + 15)
        log = run.log()
        dead = target.removeprefix("rank")
        if launcher == "torchrun":
            cause = log.split("Root Cause")[-1]
            named = re.search(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", cause)
            row["message"] = f"torchrun's root cause: rank {named[1]}, exit code {named[2]}" if named else ""
            row.check(bool(named) and named[1] == dead, f"torchrun's root cause is not rank {dead}")
        elif target == "rank0":  # rank 0 is the launcher: rank 1 dies with it (PR_SET_PDEATHSIG)
            row["message"] = "(rank 1 is killed with its launcher by PR_SET_PDEATHSIG: nothing left to print)"
        else:
            row["message"] = find_line(log, rf"{WATCHDOG_LINE}.*rank {dead} ", rf"rank {dead} \(pid \d+\) ended")
            row.check(bool(row["message"]), f"no line names rank {dead}")
        row.check(rc is not None and rc != 0, f"exit code {rc}")
        row.check(
            row["seconds"] is not None and row["seconds"] <= s.failure_timeout + 15,
            f"took {row['seconds']}s > failure timeout {s.failure_timeout:g}s + 15s",
        )
        _work_lost(run, s.workdir / name, row)
        row.check(row["work_lost"] < s.checkpoint_every, f"{row['work_lost']} steps lost")
        return row

    case.__name__ = f"sigkill_{target}" + ("_torchrun" if launcher == "torchrun" else "")
    return case


def sigkill_in_save(s: Settings) -> Row:
    """Rank 1 is SIGKILLed while it writes its shard of a checkpoint: rank 0, waiting in the
    save's collectives, must name rank 1 (not report its own failed save), and the half-written
    checkpoint must stay invisible to --resume."""
    name, at = "sigkill_rank1_in_save", 2 * s.checkpoint_every
    row = Row(name, f"SIGKILL of rank 1 while it writes its shard of the checkpoint at step {at}")
    out = s.workdir / name
    run = s.run(name, fault={"kind": "sigkill_in_save", "rank": 1, "step": at})
    limit = s.failure_timeout + 15  # as for a SIGKILL during a step
    try:
        run.wait_for(lambda: (run.probe / "rank1.fault").exists(), s.startup_s + 60 * s.steps, "the kill")
        since = time.monotonic()
        rc = _end(s, run, row, since, limit)
    finally:
        run.finish()
    row["message"] = find_line(run.log(), rf"{WATCHDOG_LINE}.*rank 1 ", r"rank 1 \(pid \d+\) ended")
    row.check(bool(row["message"]), "no line names rank 1")
    row.check(rc is not None and rc != 0, f"exit code {rc}")
    row.check(row["seconds"] is not None and row["seconds"] <= limit, f"took {row['seconds']}s > {limit:.0f}s")
    _work_lost(run, out, row, done=at)  # the save killed is step `at`'s (the probe logs after the saves)
    row.check(
        row["checkpoint_step"] == s.checkpoint_every,
        f"--resume would take step {row['checkpoint_step']}, not {s.checkpoint_every}",
    )
    return row


def stall(launcher: str = "plain") -> Callable[[Settings], Row]:
    def case(s: Settings) -> Row:
        name = "stall_rank1" + ("_torchrun" if launcher == "torchrun" else "")
        under = ", under torchrun" if launcher == "torchrun" else ""
        row = Row(name, f"rank 1 sleeps inside a ring step (process-group timeout {s.stall_pg_timeout}s{under})")
        run = s.run(
            name,
            ["--strategy.timeout", f"0:00:{s.stall_pg_timeout:02d}"],
            launcher=launcher,
            fault={"kind": "stall", "rank": 1, "step": s.signal_step, "seconds": 3600},
        )
        # Bound: rank 0's next collective waits the process-group timeout for rank 1, then the
        # watchdog names rank 1 and every rank exits within ~5 polls (both backends: under NCCL
        # the timeout raises nothing in Python); NCCL's own teardown of rank 0, the backstop,
        # comes at the timeout + the failure timeout + 5 polls (longctx.lightning.failures).
        limit = s.stall_pg_timeout + s.failure_timeout + 10
        try:
            run.wait_for(lambda: (run.probe / "rank1.fault").exists(), s.startup_s, "the stall")
            since = time.monotonic()
            rc = _end(s, run, row, since, limit)
        finally:
            run.finish()
        row["message"] = find_line(
            run.log(), rf"{WATCHDOG_LINE}.*rank 1 is stalled", WATCHDOG_LINE, r"[Tt]imed? ?out", r"Watchdog caught"
        )
        row.check(rc is not None and rc != 0, f"exit code {rc}")
        row.check(row["seconds"] is not None and row["seconds"] <= limit, f"took {row['seconds']}s > {limit:.0f}s")
        row.check("rank 1 is stalled" in row["message"], "no watchdog line names rank 1 as stalled")
        _work_lost(run, s.workdir / name, row)
        return row

    case.__name__ = "stall_rank1" + ("_torchrun" if launcher == "torchrun" else "")
    return case


def store_lost(when: str) -> Callable[[Settings], Row]:
    def case(s: Settings) -> Row:
        name = f"store_lost_{when}"
        row = Row(name, f"the rendezvous store's host (torchrun's agent) SIGKILLed {when} training")
        fault = {"kind": "pause", "seconds": 10} if when == "before" else None
        run = s.run(name, launcher="torchrun", fault=fault)
        try:
            if when == "before":  # every rank in its pause after on_fit_start: watchdog up, no step yet
                run.wait_for(lambda: run.fit_started(2), s.startup_s, "on_fit_start on both ranks")
            else:
                run.wait_step(s.signal_step, s.startup_s)
            since = time.monotonic()
            run.signal("launcher", signal.SIGKILL)
            rc = _end(s, run, row, since, s.failure_timeout + 10)
        finally:
            run.finish()
        row["message"] = find_line(run.log(), rf"{WATCHDOG_LINE}.*(store|agent)", WATCHDOG_LINE)
        row.check(rc == -signal.SIGKILL, f"launcher exit {rc}")
        row.check("agent" in row["message"], "no line names the torchrun agent / store")
        row.check(row["seconds"] is not None and row["seconds"] <= s.failure_timeout + 10, f"took {row['seconds']}s")
        _work_lost(run, s.workdir / name, row)
        if when == "before":
            row.check(row["completed_steps"] == 0, f"{row['completed_steps']} steps ran before the kill")
        return row

    case.__name__ = f"store_lost_{when}"
    return case


def nan_gradient(s: Settings) -> Row:
    name, at = "nan_rank1", s.signal_step
    row = Row(name, "NaN in rank 1's gradient shard under FSDP2 (--nonfinite.policy skip)")
    run = s.run(name, ["--nonfinite.policy", "skip"], fault={"kind": "nan", "rank": 1, "step": at, "checksums": True})
    try:
        since = time.monotonic()
        rc = _end(s, run, row, since, s.startup_s + 60 * s.steps)
    finally:
        run.finish()
    row["seconds"] = None  # the run goes on: no exit to time
    row["work_lost"] = 0
    row.check(rc == 0, f"exited {rc}: {last_lines(run.log(), 3)}")
    rows = [{int(r[0]): r[1:] for r in run.steps(rank)} for rank in range(2)]
    skips = [r.get(at, ["?"])[0] for r in rows]
    row["skips_per_rank"] = skips
    row.check(skips == ["1", "1"], f"skip counts at step {at}: {skips} (rank 0, rank 1)")
    for rank, r in enumerate(rows):
        if at in r and at - 1 in r and at + 1 in r:
            row.check(r[at][1] == r[at - 1][1], f"rank {rank}'s parameter shard changed at the skipped step")
            row.check(r[at + 1][1] != r[at][1], f"rank {rank}'s parameters did not move after the skip")
        else:
            row.check(False, f"rank {rank}: steps {at - 1}..{at + 1} not probed")
    same = all(rows[0][k][2] == rows[1][k][2] for k in rows[0] if k in rows[1])
    row["full_checksums_equal"] = same
    row.check(same, "full parameters differ across ranks")
    line = find_line(run.log(), r"skipping optimizer step")
    row["message"] = line[line.find("skipping") :]  # without the warning's file:line prefix
    final = losses(s.workdir / name)
    row.check(len(final) == s.steps and all(v == v for v in final.values()), "losses missing or NaN")
    return row


def disk_full(s: Settings) -> Row:
    name, at = "enospc_rank1", 2 * s.checkpoint_every
    row = Row(name, f"ENOSPC on rank 1 during the sharded checkpoint save at step {at}")
    out = s.workdir / name
    run = s.run(name, fault={"kind": "enospc", "rank": 1, "step": at})
    try:
        run.wait_for(lambda: (run.probe / "rank1.fault").exists(), s.startup_s + 60 * s.steps, "the failed save")
        since = time.monotonic()
        rc = _end(s, run, row, since, s.failure_timeout + 20)
    finally:
        run.finish()
    log = run.log()
    row["message"] = find_line(log, r"cannot save .*checkpoint", r"No space left", r"CheckpointException")
    row.check(rc is not None and rc != 0, f"exit code {rc}")
    visible = sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").exists() else []
    row["checkpoints_left"] = visible
    row.check(f"step{at:06d}.ckpt" not in visible, f"a half-written step{at:06d}.ckpt is visible")
    _work_lost(run, out, row, done=at)  # the failed save is step `at`'s (the probe logs after the saves)
    row.check(
        row["checkpoint_step"] == s.checkpoint_every,
        f"--resume would take step {row['checkpoint_step']}, not {s.checkpoint_every}",
    )
    row.check(
        "checkpoints saved before are intact" in row["message"], "no line says the earlier checkpoints are intact"
    )
    _resume_matches(s, row, out, f"{name}_resume")
    return row


def reshard(direction: str) -> Callable[[Settings], Row]:
    def case(s: Settings) -> Row:
        name, at = f"reshard_{direction.replace('>', 'to')}", 2 * s.checkpoint_every
        row = Row(name, f"--resume at CP {direction.replace('>', ' -> ')} (world size alike) from a sharded checkpoint")
        out = s.workdir / name
        tol = max(s.loss_tol, 2 * (s.noise or 0.0))  # another CP size: another summation order
        one = ["--context-parallel", "1", "--devices", "1"]
        if direction == "2>1":  # the uninterrupted run's checkpoint at step `at`, resumed on one process
            resume, extra = s.workdir / "baseline" / "checkpoints" / f"step{at:06d}.ckpt", one
        else:  # a one-process run to step `at`, resumed on two
            first = s.run(f"{name}_first", [*one, "--max-steps", str(at)], out=out)
            rc, _ = first.wait_end(s.startup_s + 60 * s.steps)
            first.finish()
            row["exit_codes"]["first"] = rc
            if not row.check(rc == 0, f"the CP=1 run exited {rc}: {last_lines(first.log(), 3)}"):
                return row
            diff = compare(losses(out), s.reference, range(at))
            row["first_loss_diff"] = diff
            row.check(diff is not None and diff <= tol, f"CP=1 losses differ from CP=2 by {diff}")
            resume, extra = out, ["--context-parallel", "2", "--devices", "2", "--max-steps", str(s.steps)]
        resumed = s.run(f"{name}_resume", extra, resume=resume, out=out)
        rc, _ = resumed.wait_end(s.startup_s + 60 * s.steps)
        resumed.finish()
        log = resumed.log()
        row["exit_codes"]["resume"] = rc
        row["work_lost"] = 0
        if rc == 2 and "train.py: error:" in log:  # refused: must be one line, before any step
            row["message"] = find_line(log, r"train.py: error:")
            row.check(resumed.completed(0) == 0, "refused after training steps")
            return row
        row["message"] = find_line(log, r"^resume: ", r"resuming from")
        row.check(rc == 0, f"exited {rc}: {last_lines(log, 3)}")
        diff = compare(losses(out), s.reference, range(at, s.steps))
        row["loss_diff"], row["loss_tol"] = diff, tol
        row.check(diff is not None and diff <= tol, f"resumed losses differ from the CP=2 run's by {diff} > {tol:.3g}")
        return row

    case.__name__ = f"reshard_{direction.replace('>', 'to')}"
    return case


CASES: dict[str, Callable[[Settings], Row]] = {
    "sigterm_rank1": sigterm("rank1"),
    "sigterm_rank0": sigterm("rank0"),
    "sigterm_launcher": sigterm("launcher"),
    "sigint_launcher": sigint("launcher"),
    "sigint_all": sigint("all"),
    "sigint_all_torchrun": sigint("all", "torchrun"),
    "sigkill_rank1": sigkill("rank1"),
    "sigkill_rank0": sigkill("rank0"),
    "sigkill_rank0_torchrun": sigkill("rank0", "torchrun"),
    "sigkill_rank1_in_save": sigkill_in_save,
    "stall_rank1": stall(),
    "stall_rank1_torchrun": stall("torchrun"),
    "store_lost_before": store_lost("before"),
    "store_lost_during": store_lost("during"),
    "nan_rank1": nan_gradient,
    "enospc_rank1": disk_full,
    "reshard_2to1": reshard("2>1"),
    "reshard_1to2": reshard("1>2"),
}
# Cases that compare losses with the uninterrupted run (or resume its checkpoints).
NEEDS_REFERENCE = {
    "sigterm_rank1",
    "sigterm_rank0",
    "sigterm_launcher",
    "sigint_launcher",
    "sigint_all",
    "sigint_all_torchrun",
    "enospc_rank1",
    "reshard_2to1",
    "reshard_1to2",
}
