"""The start-up's stages (``longctx.lightning.startup``): where a run's time before its first
step goes, printed once by rank 0 and logged as ``startup_s``."""

from __future__ import annotations

import csv
import time

import pytest

from longctx.lightning.startup import StartupClock, process_start_time


def test_process_start_time_is_before_now_and_after_boot():
    start = process_start_time()
    if start is None:
        pytest.skip("no /proc here")
    with open("/proc/uptime") as f:
        booted = time.time() - float(f.read().split()[0])
    assert booted - 2 <= start <= time.time()


def test_clock_line_gives_each_stage_its_own_seconds():
    clock = StartupClock(start=100.0)
    for name, at in (("model built", 104.25), ("launch and data", 110.0), ("first batch", 110.5)):
        clock.mark(name, now=at)
    assert clock.total() == 10.5
    assert clock.line() == (
        "start-up 10.5 s before the first step: model built 4.2, launch and data 5.8, first batch 0.5"
    )


def test_a_fit_prints_its_start_up_and_logs_it(tmp_path, capsys):
    """A CPU fit of the tiny model: the line names every stage in the order they run, its
    stages add up to the total, and metrics.csv has the same total on the launch's rows."""
    import torch
    from helpers.tiny_fit import cpu_trainer, tiny_batches, tiny_module
    from lightning.pytorch.loggers import CSVLogger

    cpu_trainer(max_steps=2, logger=CSVLogger(tmp_path), log_every_n_steps=1).fit(
        tiny_module(), torch.utils.data.DataLoader(tiny_batches(2), batch_size=1)
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("start-up ")]
    assert len(lines) == 1
    head, stages = lines[0].split(": ", 1)
    names = [part.rsplit(" ", 1)[0] for part in stages.split(", ")]
    assert names == [
        "model built",
        "launch and data",
        "parallelized",
        "optimizer and strategy",
        "kernel warm-up",
        "first batch",
    ]
    total = float(head.split()[1])
    assert sum(float(part.rsplit(" ", 1)[1]) for part in stages.split(", ")) == pytest.approx(total, abs=0.35)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {float(r["startup_s"]) for r in rows if r.get("startup_s")}
    assert len(logged) == 1 and logged.pop() == pytest.approx(total, abs=0.051)


def test_a_deferred_build_draws_the_same_model_once_the_processes_exist(tmp_path, capsys):
    """``deferred_parameters`` (train.py's build): the module holds meta tensors until
    ``configure_model``, which draws exactly the parameters an eager build with the same seed
    draws (and leaves the global RNG where the eager build left it); a fit of it names the
    build after the launch in its start-up line."""
    import torch
    from helpers.tiny_fit import cpu_trainer, tiny_batches, tiny_module

    from longctx.lightning.module import deferred_parameters

    torch.manual_seed(7)
    eager = tiny_module()
    after_eager = torch.rand(4)
    torch.manual_seed(7)
    with deferred_parameters():
        deferred = tiny_module()
    assert torch.equal(torch.rand(4), after_eager)
    assert all(p.is_meta for p in deferred.model.parameters())
    assert deferred.model.num_params() == eager.model.num_params()
    assert not any(p.is_meta for p in tiny_module().model.parameters())  # outside the block: eager
    deferred.configure_model()
    want, got = eager.model.state_dict(), deferred.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    torch.manual_seed(7)
    with deferred_parameters():
        module = tiny_module()
    capsys.readouterr()
    cpu_trainer(max_steps=2).fit(module, torch.utils.data.DataLoader(tiny_batches(2), batch_size=1))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("start-up "))
    names = [part.rsplit(" ", 1)[0] for part in line.split(": ", 1)[1].split(", ")]
    assert names[:3] == ["launch and data", "model built", "parallelized"]
    assert all(torch.isfinite(p).all() for p in module.model.parameters())
