"""Where a training step's host time goes: train.py with a profiling callback.

    python benchmarks/step_profile.py --first-step 6 --steps 5 --out DIR -- TRAIN.PY ARGS...

runs train.py (from the current directory) with every Trainer given ``StepProfile`` (train.py's
CLI keeps callbacks out of its options). On global rank 0, steps ``first_step`` ..
``first_step + steps - 1`` run under cProfile, and the hooks' wall-clock times (no device
syncs added) split each step into phases: forward and backward queued (batch start -> before
the optimizer step), the optimizer step and the batch-end hooks, and the gap to the next
batch (data, transfer). Writes ``DIR/step_profile.txt`` (pstats by own time and by
cumulative time) and ``DIR/step_phases.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import runpy
import sys
import time

from lightning.pytorch.callbacks import Callback


class StepProfile(Callback):
    def __init__(self, first_step: int = 6, steps: int = 5, out: str = "."):
        self.first_step, self.steps, self.out = first_step, steps, out
        self.profile = cProfile.Profile()
        self.marks: list[dict] = []
        self._on = False

    def _active(self, trainer) -> bool:
        return trainer.is_global_zero and self.first_step <= trainer.global_step < self.first_step + self.steps

    def _mark(self, name: str) -> None:
        if self.marks:
            self.marks[-1][name] = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.marks and "batch_end" in self.marks[-1]:
            self.marks[-1]["next_batch"] = time.perf_counter()
        if self._active(trainer):
            if not self._on:
                self.profile.enable()
                self._on = True
            self.marks.append({"step": trainer.global_step, "batch_start": time.perf_counter()})
        elif self._on:
            self._finish()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._mark("before_optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._mark("batch_end")

    def on_train_end(self, trainer, pl_module):
        if self._on:
            self._finish()

    def _finish(self) -> None:
        self.profile.disable()
        self._on = False
        os.makedirs(self.out, exist_ok=True)
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(self.profile, stream=text).sort_stats(key).print_stats(45)
        with open(os.path.join(self.out, "step_profile.txt"), "w") as f:
            f.write(text.getvalue())
        phases = []
        for m in self.marks:
            if {"batch_start", "before_optimizer", "batch_end", "next_batch"} <= m.keys():
                phases.append(
                    dict(
                        step=m["step"],
                        forward_backward_queued_s=m["before_optimizer"] - m["batch_start"],
                        optimizer_and_hooks_s=m["batch_end"] - m["before_optimizer"],
                        to_next_batch_s=m["next_batch"] - m["batch_end"],
                    )
                )
        with open(os.path.join(self.out, "step_phases.json"), "w") as f:
            json.dump(phases, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--first-step", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=".")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    import lightning.pytorch as pl

    init = pl.Trainer.__init__

    @functools.wraps(init)  # the CLI reads the Trainer's signature
    def with_profile(self, *a, **kw):
        kw["callbacks"] = [*(kw.get("callbacks") or []), StepProfile(args.first_step, args.steps, args.out)]
        init(self, *a, **kw)

    pl.Trainer.__init__ = with_profile
    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    sys.path[0] = os.getcwd()  # train.py's folder, as if it were run directly
    sys.argv = ["train.py", *rest]  # Lightning's launcher re-runs sys.argv: the other ranks run plain train.py
    runpy.run_path("train.py", run_name="__main__")


if __name__ == "__main__":
    main()
