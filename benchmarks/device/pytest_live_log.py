"""pytest plugin for device calls (``-p pytest_live_log``, with this folder on PYTHONPATH): each
test's result, duration and failure text written the moment it lands, to
``$LIVE_LOG`` (default ``live.log``), so a run that a call's time limit kills still says which
tests failed, why, and where the time went. Under pytest-xdist it writes from the controller."""

from __future__ import annotations

import os
import time

_start = time.monotonic()


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller gets its reports
        return
    config._live_log = open(os.environ.get("LIVE_LOG", "live.log"), "a", buffering=1)


def pytest_runtest_logreport(report):
    log = getattr(_config, "_live_log", None) if _config else None
    if log is None:
        return
    failed = report.failed
    if report.when != "call" and not failed and not report.skipped:
        return
    outcome = "FAILED" if failed else ("SKIPPED" if report.skipped else "PASSED")
    if failed and report.when != "call":
        outcome = f"ERROR({report.when})"
    worker = getattr(report, "node", None)
    worker = getattr(getattr(worker, "gateway", None), "id", "-") if worker is not None else "-"
    log.write(f"{time.monotonic() - _start:7.1f}s {report.duration:7.1f}s {worker:>5} {outcome} {report.nodeid}\n")
    if failed:
        log.write("".join("    " + line + "\n" for line in report.longreprtext.splitlines()[-60:]))


_config = None


def pytest_sessionstart(session):
    global _config
    _config = session.config
