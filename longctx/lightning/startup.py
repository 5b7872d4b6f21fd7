"""Where a run's time before its first step goes. A large model's start can take minutes (the
model's init, the launcher's processes, sharding, kernel compiles) that no step figure shows:
``CausalLMModule`` marks each stage on rank 0 and prints one line as the first batch starts,
and logs the total as ``startup_s`` with the first step's metrics (train.py's summary prints it)."""

from __future__ import annotations

import os
import time
from typing import Optional


def process_start_time() -> Optional[float]:
    """Wall-clock time (``time.time()``) at which this process started, from ``/proc`` (Linux);
    None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22, after the command name in parentheses (which may hold spaces):
            # start time in clock ticks after boot.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class StartupClock:
    """Stages of a run's start, in order: ``mark(name)`` when one ends (the first from the
    process's start where that is known, else from the clock's creation)."""

    def __init__(self, start: Optional[float] = None) -> None:
        self.start = start if start is not None else (process_start_time() or time.time())
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str, now: Optional[float] = None) -> None:
        self.marks.append((name, time.time() if now is None else now))

    def total(self) -> float:
        return (self.marks[-1][1] if self.marks else time.time()) - self.start

    def line(self) -> str:
        """``start-up 12.3 s before the first step: model built 4.1, ...`` (seconds per stage)."""
        parts, last = [], self.start
        for name, at in self.marks:
            parts.append(f"{name} {max(at - last, 0.0):.1f}")
            last = at
        return f"start-up {self.total():.1f} s before the first step: " + ", ".join(parts)
