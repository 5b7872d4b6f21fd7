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

from helpers import pythonpath


def _fix_interpreter_scalar_index() -> None:
    """Make the interpreter's ``tensor.__index__`` accept its own scalars under numpy >= 2.5.

    The interpreter holds a scalar (program_id, a scalar kernel argument, anything derived
    from them) as a 1-element 1-D numpy array, and Triton 3.6 (and older) implements
    ``__index__`` (a ``range()`` bound in a kernel: every ``for start_n in range(lo, hi,
    BLOCK_N)`` with runtime bounds) as ``int(self.handle.data)``. numpy 2.5 turned that
    conversion of an ndim > 0 array (deprecated since 1.25) into "TypeError: only
    0-dimensional arrays can be converted to Python scalars" (triton-lang/triton#9171).
    Newer Triton squeezes first; this installs the same ``int(data.squeeze())`` after the
    interpreter's own per-launch patch (and is undone with it). No effect on compiled
    kernels; arrays of more than one element still raise.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_longctx_scalar_index", False):
        return

    def index(self):
        return int(self.handle.data.squeeze())

    def patched(tensor, *args, **kwargs):
        patch(tensor, *args, **kwargs)
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None:  # restored with the interpreter's own patches after the launch
            scope.set_attr(tensor, "__index__", index)
        else:  # older triton patches tensor for good, without a scope
            tensor.__index__ = index

    patched._longctx_scalar_index = True
    interpreter._patch_lang_tensor = patched


def print_results(cases, run_case) -> None:
    """The worker side: run every case, report errors as results (the test shows them)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _fix_interpreter_scalar_index()
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
        env = dict(os.environ, TRITON_INTERPRET="1", LONGCTX_TRITON_INTERP_TILES=tiles, PYTHONPATH=pythonpath())
        procs.append(
            (
                tiles,
                subprocess.Popen(
                    [sys.executable, os.path.abspath(test_file)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        )
    results = {}
    for tiles, proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"interpreter worker (tiles {tiles}) timed out")
        lines = [line for line in stdout.splitlines() if line.startswith("RESULTS ")]
        assert proc.returncode == 0 and lines, f"worker (tiles {tiles}) failed:\n{stdout}\n{stderr}"
        results[tiles] = json.loads(lines[-1][len("RESULTS ") :])
    return results
