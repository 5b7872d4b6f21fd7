"""Which source lines hold the memory at a step's peak: an allocator trace
(``torch.cuda.memory._record_memory_history``) replayed to its peak, the live blocks grouped by
the innermost frame in the library (else in the benchmark's own files ``bench_files``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .step import train_step

STEP_FILE = train_step.__code__.co_filename  # as allocator traces name it


def library_roots() -> dict[str, str]:
    """Source directories of longctx, longctx.models, longctx.kernels -> display prefix.

    Taken from the imported packages, so frames match whether the project is installed
    editable (models/ and kernels/ at the top of the repository) or into site-packages.
    """
    import longctx
    import longctx.kernels
    import longctx.models

    return {
        str(Path(m.__file__).resolve().parent) + os.sep: name + "/"
        for m, name in ((longctx, "longctx"), (longctx.models, "models"), (longctx.kernels, "kernels"))
    }


def site_label(frames: list[dict], roots: dict[str, str], bench_files: tuple[str, ...]) -> str:
    """The innermost frame in the library (else in one of ``bench_files``): ``file:line:function``.
    The shared training step (longctx.bench.step) is the benchmark's step, not the library:
    what it allocates itself is autograd's gradients and temporaries, AdamW's state."""
    own = None
    for f in frames:  # innermost first
        fn = f.get("filename", "")
        if fn == STEP_FILE:
            own = own or "benchmark:step (autograd: gradients, temporaries)"
            continue
        for root, prefix in roots.items():
            if fn.startswith(root):
                return f"{prefix}{fn[len(root) :]}:{f.get('line')}:{f.get('name')}"
        if own is None and any(fn.endswith(os.sep + name) for name in bench_files):
            own = (
                f"benchmark:{f.get('name')} (autograd: gradients, temporaries)"
                if f.get("name") == "step"
                else f"benchmark:{f.get('name')}"
            )
    return own or "other (outside the library)"


def attribute_peak(
    trace: list[dict],
    baseline: int,
    s_local: int,
    n_layer: int,
    roots: dict[str, str],
    bench_files: tuple[str, ...],
    top: int = 14,
) -> dict:
    """Replay an allocator trace to its peak and group the live blocks by source line.

    ``baseline``: bytes allocated when recording started (weights, grads, AdamW state,
    DDP buckets, inputs); blocks from before the trace that are freed during it are
    subtracted from it.
    """

    def replay(stop: Optional[int]):
        live, cur, pre_freed, peak, peak_i = {}, baseline, 0, baseline, -1
        for i, e in enumerate(trace):
            if stop is not None and i > stop:
                break
            act, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
            if act == "alloc":
                live[addr] = (size, e.get("frames", []))
                cur += size
            elif act == "free_completed":
                if addr in live:
                    cur -= live.pop(addr)[0]
                else:
                    cur -= size
                    pre_freed += size
            if cur > peak:
                peak, peak_i = cur, i
        return live, pre_freed, peak, peak_i

    _, _, peak, peak_i = replay(None)
    live, pre_freed, _, _ = replay(peak_i)
    sites: dict[str, list[int]] = {}
    for size, frames in live.values():
        s = sites.setdefault(site_label(frames, roots, bench_files), [0, 0])
        s[0] += size
        s[1] += 1
    rows = [
        dict(
            site=k,
            bytes=v[0],
            blocks=v[1],
            bytes_per_token=v[0] / s_local,
            bytes_per_token_per_layer=v[0] / s_local / n_layer,
        )
        for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])
    ]
    rest = rows[top:]
    rows = rows[:top]
    if rest:
        b = sum(r["bytes"] for r in rest)
        rows.append(
            dict(
                site=f"other ({len(rest)} sites)",
                bytes=b,
                blocks=sum(r["blocks"] for r in rest),
                bytes_per_token=b / s_local,
                bytes_per_token_per_layer=b / s_local / n_layer,
            )
        )
    at_peak = trace[peak_i] if peak_i >= 0 else {}
    return dict(
        peak_bytes_replayed=peak,
        resident_before_step_bytes=baseline - pre_freed,
        peak_event=site_label(at_peak.get("frames", []), roots, bench_files) if at_peak else "before the step",
        trace_events=len(trace),
        s_local=s_local,
        sites=rows,
    )
