"""pytest plugin for device calls (``-p pytest_live_log``, with this folder on PYTHONPATH): each
test's result, duration and failure text written the moment it lands, to
``$LIVE_LOG`` (default ``live.log``), so a run that a call's time limit kills still says which
tests failed, why, and where the time went. Under pytest-xdist it writes from the controller."""

from __future__ import annotations

import os
import time

_start = time.monotonic()
_log = None


def pytest_configure(config):
    global _log
    if not hasattr(config, "workerinput"):  # an xdist worker: the controller gets its reports
        _log = open(os.environ.get("LIVE_LOG", "live.log"), "a", buffering=1)


def pytest_runtest_logreport(report):
    if _log is None or (report.when != "call" and not report.failed and not report.skipped):
        return
    outcome = "FAILED" if report.failed else ("SKIPPED" if report.skipped else "PASSED")
    if report.failed and report.when != "call":
        outcome = f"ERROR({report.when})"
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "-")
    _log.write(f"{time.monotonic() - _start:7.1f}s {report.duration:7.1f}s {worker:>5} {outcome} {report.nodeid}\n")
    if report.failed:
        _log.write("".join("    " + line + "\n" for line in report.longreprtext.splitlines()[-60:]))
