"""SIGTERM and Ctrl-C end a job at a step boundary, every rank together, after a checkpoint
that fits.

SIGTERM is how ``timeout``, SLURM (preemption, time limit) and Kubernetes end a job; SIGKILL
follows after a grace period (30 s by default in both schedulers). Lightning's own handler
broadcasts inside the signal handler, which deadlocks ranks that are inside another
collective at that moment, and lets a rank raise on its own flag, which others see as
that rank failing. Here (installed by ``ContextParallelStrategy``):

* the handler only records the signal and passes it on to the ranks this process
  launched: no collective, no I/O beyond one ``os.write``;
* after every optimizer step the ranks agree (one all-reduce of the signal number), so
  all stop at the same step even when only some of them received the signal;
* they save a checkpoint of that step through the trainer's ``ModelCheckpoint`` (its
  ``last.ckpt``, unless this step is saved already), skip a validation due at that step,
  and raise ``StoppedBySignal`` as the next batch starts (so the step's metrics are
  logged), a ``SystemExit`` whose code is 128 + the signal number (what a shell reports
  for a process the signal killed);
* a timer started with the signal ends the process ``grace_period`` seconds later whatever
  it is doing (a save that does not fit, a rank stuck in a collective): better without a
  checkpoint than a hang; atomic saves keep the previous checkpoint whole.

Ctrl-C (SIGINT) is a request to stop the same way (exit code 130 = 128 + SIGINT), not a
``KeyboardInterrupt`` in whatever rank it lands in: a terminal sends it to every process of
the job, ``kill -INT`` to the launching one only; the ranks agree on it after the step as on
SIGTERM, so it is not passed on. A second Ctrl-C stops at once (no checkpoint of the current
step; the ones saved before are intact); one that comes within ``INTERRUPT_REPEAT_S`` of the
first is the same key press delivered twice (a terminal and torchrun's agent both pass it on).
The handler is this process's while a fit lasts (from ``setup_environment`` to Lightning's
teardown); a SIGINT that the process ignored when the fit began (``nohup``, ``&``) stays ignored.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ..watchdog import hard_exit

DEFAULT_GRACE_PERIOD = 25.0  # seconds: inside SLURM's and Kubernetes' default 30 s before SIGKILL
INTERRUPT_REPEAT_S = 1.0  # a second SIGINT sooner than this is the first one delivered twice


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StoppedBySignal(SystemExit):
    """Every rank stopped training at ``step`` because of signal ``signum``; ``checkpoint``
    is the checkpoint of that step (``None`` when the trainer saves none)."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    def __str__(self) -> str:
        saved = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint (none configured)"
        return f"stopped by {signal_name(self.signum)} at step {self.step}; {saved}"


class SignalStop:
    """The stop state of one process: the signal received, the grace timer.

    ``forward(signum)`` passes the signal on to the processes this one launched;
    ``before_exit()`` runs before the timer ends the process (end those processes)."""

    def __init__(self, grace_period: float, forward: Callable[[int], None], before_exit: Callable[[], None]):
        self.grace_period = grace_period
        self.rank = 0
        self._owner = os.getpid()  # set again by install (the rank's own process)
        self.signum: Optional[int] = None
        self._began_at = 0.0
        self.checkpoint_saved = False
        self._forward, self._before_exit = forward, before_exit

    def handle(self, signum: int, _frame: Optional[FrameType] = None) -> None:
        """The signal handler: record, pass on, start the clock. Nothing that can block."""
        if os.getpid() != self._owner:
            return  # a forked child (a DataLoader worker) inherited the handler: its rank decides
        if signum == signal.SIGINT:
            self._interrupt()
            return
        if self.signum is not None:
            return
        self._begin(signum)
        os.write(
            2,
            f"\n[longctx] rank {self.rank}: received {signal_name(signum)}; stopping after the current "
            f"step (checkpoint, then exit; at most {self.grace_period:g}s)\n".encode(),
        )
        self._forward(signum)

    def _interrupt(self) -> None:
        """Ctrl-C: the first one stops after the step like SIGTERM (not passed on: a terminal
        sends it to every process, and the ranks agree on it after the step); a later one
        (``INTERRUPT_REPEAT_S`` on) ends this process and those it launched at once."""
        if self.signum is None:
            self._begin(signal.SIGINT)
            if self.rank == 0:  # a terminal's Ctrl-C reaches every rank: one line is enough
                os.write(
                    2,
                    f"\n[longctx] Ctrl-C: stopping after the current step (checkpoint, then exit {128 + signal.SIGINT};"
                    f" at most {self.grace_period:g}s); press Ctrl-C again to stop at once without one\n".encode(),
                )
            return
        if time.monotonic() - self._began_at < INTERRUPT_REPEAT_S:
            return  # the same key press, delivered again (terminal + torchrun's agent)
        self._before_exit()
        if self.rank == 0:
            os.write(
                2,
                b"\n[longctx] second Ctrl-C: stopped at once, without a checkpoint of the current step; "
                b"the checkpoints saved before are intact (--resume takes the newest)\n",
            )
        os._exit(128 + signal.SIGINT)

    def _begin(self, signum: int) -> None:
        self.signum = signum
        self._began_at = time.monotonic()
        timer = threading.Timer(self.grace_period, self._expire)
        timer.daemon = True
        timer.start()

    def install(self, trainer: Any, rank: int) -> None:
        """Take over SIGTERM and SIGINT in ``trainer``'s runs and stop them through ``StopOnSignal``."""
        self.rank, self._owner = rank, os.getpid()
        if not any(isinstance(c, StopOnSignal) for c in trainer.callbacks):
            # Appended after Lightning placed the ModelCheckpoints last: a save due at the
            # stopping step has happened when this callback runs.
            trainer.callbacks.append(StopOnSignal(self))
        # Lightning's handler broadcasts inside the handler and makes ranks raise on their own
        # flags: its signal connector installs this one in its place while a run lasts.
        trainer._signal_connector._sigterm_notifier_fn = self.handle
        self._take_interrupts(trainer._signal_connector)

    def _take_interrupts(self, connector: Any) -> None:
        """SIGINT to ``handle`` from now until the connector's teardown (the end of the fit,
        also a failed one), then back to what it was; left alone where it is ignored."""
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (and only it receives signals)
        previous = signal.getsignal(signal.SIGINT)
        if previous == signal.SIG_IGN:
            return
        signal.signal(signal.SIGINT, self.handle)
        teardown = connector.teardown

        def teardown_and_restore() -> None:
            connector.teardown = teardown
            teardown()
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, previous)

        connector.teardown = teardown_and_restore

    def exit_now(self, message: str) -> None:
        """End the process (the watchdog's ``on_failure``). During a stop, ranks leaving at
        different moments look failed to each other: the message names the signal."""
        self._before_exit()
        if self.signum is None:
            hard_exit(message)
        hard_exit(f"stopped by {signal_name(self.signum)}; then: {message}", 128 + self.signum)

    def agree(self, device: torch.device) -> Optional[int]:
        """The signal any rank received (collective: every rank calls it at the same step)."""
        local = self.signum or 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([local], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            agreed = int(flag.item())
        else:
            agreed = local
        if agreed and self.signum is None:  # another rank received it: the clock starts here
            self._begin(agreed)
        return agreed or None

    def _expire(self) -> None:
        name = signal_name(self.signum)
        if self.checkpoint_saved:
            what = f"still running {self.grace_period:g}s after {name} (the grace period): exiting now"
        else:
            what = (
                f"stopped by {name}: no checkpoint could be saved within the {self.grace_period:g}s "
                "grace period (stop_grace_period / --stop-grace-period); exiting without one, the "
                "previous checkpoint stays whole"
            )
        self._before_exit()
        hard_exit(f"rank {self.rank}: {what}", 128 + self.signum)


class StopOnSignal(Callback):
    """After each optimizer step: if any rank received a signal, save, then raise
    ``StoppedBySignal`` before the next batch runs."""

    def __init__(self, stop: SignalStop):
        self.stop = stop
        self._checked_step = -1
        self._stopping: Optional[StoppedBySignal] = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._stopping is not None:
            if trainer.is_global_zero:
                print(f"[longctx] {self._stopping}", flush=True)
            raise self._stopping

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._checked_step:  # mid gradient accumulation: no optimizer step yet
            return
        self._checked_step = step
        signum = self.stop.agree(trainer.strategy.root_device)
        if signum is None:
            return
        self._stopping = StoppedBySignal(signum, step, _save_checkpoint(trainer))
        self.stop.checkpoint_saved = True
        trainer.fit_loop.epoch_loop._skip_next_val = True  # no time for it


def _save_checkpoint(trainer: Any) -> Optional[str]:
    """Save this step through the trainer's ModelCheckpoint as its own saves do; the path."""
    callback = trainer.checkpoint_callback
    if callback is None:
        return None
    if callback._last_global_step_saved != trainer.global_step:  # not saved at this step yet
        candidates = callback._monitor_candidates(trainer)
        if callback.save_last:
            callback._save_last_checkpoint(trainer, candidates)
        else:
            callback._save_topk_checkpoint(trainer, candidates)
    if callback._last_global_step_saved != trainer.global_step:
        return None  # save_last off and save_top_k=0: the user keeps no checkpoints
    return callback._last_checkpoint_saved
