"""A training run's folder: its lock, atomic writes, the metrics and loss plot, and the
checkpoint callback whose last.ckpt is always the newest step.

Used by train.py; usable by any Lightning script that keeps its outputs in one directory.
"""

from __future__ import annotations

import csv
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = [
    "FinalCheckpoint",
    "file_lock",
    "flatten_metrics",
    "fresh_run_dir",
    "lock_run_dir",
    "make_run_dir",
    "plot_loss",
    "run_outputs",
    "write_atomic",
]

# What a run leaves in its folder (a folder with none of them holds no run: an empty one, or
# one whose run was refused before it wrote anything).
RUN_OUTPUTS = ("config.yaml", "metrics.csv", "checkpoints", "logs")


def run_outputs(out: Path) -> list[str]:
    """The outputs of a run that ``out`` already holds (none: no run there)."""
    found = []
    for name in RUN_OUTPUTS:
        path = out / name
        try:
            if path.is_dir():
                if any(not p.name.startswith(".") for p in path.iterdir()):
                    found.append(f"{name}/")
            elif path.exists():
                found.append(name)
        except OSError:  # unreadable: making the run's folder will say why
            continue
    return found


def fresh_run_dir(default: Path) -> Path:
    """``default``, or where it holds a run already the first of ``default-2``, ``default-3``,
    ... that holds none: a second run of the same command never overwrites the first.

    Every process of a job picks the same folder: the launching rank writes nothing there
    but its lock before the others have joined it (the outputs come after the rendezvous)."""
    candidate, n = default, 1
    while run_outputs(candidate):
        n += 1
        candidate = default.with_name(f"{default.name}-{n}")
    return candidate


def make_run_dir(out: Path) -> None:
    """Create ``out`` (and its parents) and check a file can be written in it; where not, one
    ``ValueError`` naming the folder and why (read-only, a file in the way), not an OSError."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if isinstance(e, FileExistsError) or out.exists() and not out.is_dir():
            why = f"{out} is a file, not a folder"
        elif isinstance(e, NotADirectoryError) or isinstance(e, FileNotFoundError) and e.filename != str(out):
            parent = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
            why = f"{parent} is a file, not a folder" if parent else (e.strerror or str(e))
        else:
            why = f"{e.strerror or e}: {e.filename}" if e.filename else str(e)
        raise ValueError(f"run.output_dir {out} cannot be written ({why}); pass a writable --output-dir") from None


def lock_run_dir(out: Path):
    """Hold an exclusive lock on the run directory: a second run there is an error, not a mix."""
    make_run_dir(out)
    handle = open(out / ".run.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        raise ValueError(
            f"output dir {out} is in use by another run (pid {owner}); two runs there would mix their "
            "config, metrics and checkpoints: pick another --output-dir or wait for that run to end"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


@contextmanager
def file_lock(path: Path):
    """Exclusive lock across processes of a node: one builds the caches, the others reuse them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def flatten_metrics(log_root: Path, current: Path, out_csv: Path, resumed: bool) -> list[dict]:
    """Lightning's CSVs (one version directory per launch) -> OUTPUT_DIR/metrics.csv, one row
    per step (a step's training and validation values, logged apart, in one row).

    A resumed run adds the earlier versions of the run directory: each version's rows replace
    the older rows from its first step on (steps redone after the checkpoint), so the file
    tells the whole story of the run even when an earlier launch was killed. A resumed launch
    starts with the row of its checkpoint's step (``FinalCheckpoint`` keeps it in the
    checkpoint: a launch killed right after that save never logged it); what the earlier launch
    logged for that step after the save (its validation) stays in the row."""
    versions = sorted(log_root.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    if not resumed:
        versions = [current] if current.exists() else []
    by_step: dict[int, dict] = {}
    for path in versions:
        new: dict[int, dict] = {}
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                step = _step_of(r)
                if step is not None:  # a line cut short by a kill has no usable step
                    new.setdefault(step, {}).update({k: v for k, v in r.items() if k and v not in ("", None)})
        if not new:
            continue
        first = min(new)
        merged = {**by_step.get(first, {}), **new[first]}
        by_step = {**{s: r for s, r in by_step.items() if s < first}, **new, first: merged}
    rows = [{**by_step[s], "step": str(s)} for s in sorted(by_step)]
    keys = ["step"] + sorted({k for r in rows for k in r} - {"step"})
    tmp = out_csv.with_name(f".{out_csv.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, out_csv)
    return rows


def _step_of(row: dict) -> Optional[int]:
    try:
        return int(row.get("step") or "")
    except ValueError:
        return None


def plot_loss(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r.get("train_loss")]
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps, values = zip(*train)
        ax.plot(steps, values, label="train loss (global token mean)", lw=0.8, alpha=0.45)
        smooth, ema = [], values[0]
        for v in values:  # EMA: the trend through the step-to-step noise of small batches
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        ax.plot(steps, smooth, label="train loss (EMA 0.9)", lw=1.8, color="C0")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", ms=4, color="C1")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


METRICS_ROW_KEY = "longctx_metrics_row"  # in a checkpoint: the row of its step, logged after the save


class FinalCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose last.ckpt is also written at the final step, and whose checkpoints
    carry the metrics row of their step.

    Lightning writes last.ckpt only on its every_n schedule (and at train end only if
    it never wrote one), so a run ending between two saves would resume from stale
    weights. It saves in ``on_train_batch_end``, before that step's metrics reach the logger:
    a launch killed right after the save would lose the step's row for good (the resumed one
    starts after it), so the row goes into the checkpoint and the resumed launch logs it first.
    """

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        row = _pending_metrics_row(trainer)
        if row is not None:
            checkpoint[METRICS_ROW_KEY] = row

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        self._restored_row = checkpoint.get(METRICS_ROW_KEY)

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        row, self._restored_row = getattr(self, "_restored_row", None), None
        if isinstance(row, dict) and trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(dict(row["metrics"]), step=int(row["step"]))
            trainer.logger.save()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)


def _pending_metrics_row(trainer) -> Optional[dict]:
    """The metrics row the logger is about to write for the running training batch (a save in
    ``on_train_batch_end`` comes before it), as ``{"step": int, "metrics": {name: float}}``;
    None outside a training batch or where this step logs nothing."""
    from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars

    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress.current
    connector = trainer._logger_connector
    if trainer.logger is None or progress.completed >= progress.processed or not connector.should_update_logs:
        return None
    metrics = convert_tensors_to_scalars(connector.metrics["log"])
    metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    if not metrics:
        return None
    metrics.setdefault("epoch", trainer.current_epoch)  # as Lightning adds it
    return {"step": int(loop._batches_that_stepped), "metrics": metrics}
