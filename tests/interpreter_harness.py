"""Run a test file's Triton cases under ``TRITON_INTERPRET=1`` in fresh processes.

The interpreter is chosen when Triton is imported, so the cases run in a subprocess per
tile set (the test file itself, executed as a script), which prints its results as one
JSON line; the fixture collects them and the tests assert on them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def print_results(cases, run_case) -> None:
    """The worker side: run every case, report errors as results (the test shows them)."""
    results = {}
    for name in cases:
        try:
            results[name] = run_case(name)
        except Exception as e:  # noqa: BLE001 - report, do not hide
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULTS " + json.dumps(results))


def interpreted_results(test_file: str, tile_sets) -> dict:
    """The test side: one interpreter worker per tile set, in parallel; results by tile set."""
    pytest.importorskip("triton")
    procs = []
    for tiles in tile_sets:
        env = dict(os.environ, TRITON_INTERPRET="1", LONGCTX_TRITON_INTERP_TILES=tiles)
        procs.append((tiles, subprocess.Popen([sys.executable, os.path.abspath(test_file)], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    results = {}
    for tiles, proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"interpreter worker (tiles {tiles}) timed out")
        lines = [line for line in stdout.splitlines() if line.startswith("RESULTS ")]
        assert proc.returncode == 0 and lines, f"worker (tiles {tiles}) failed:\n{stdout}\n{stderr}"
        results[tiles] = json.loads(lines[-1][len("RESULTS "):])
    return results
