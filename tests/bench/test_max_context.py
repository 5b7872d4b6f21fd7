"""benchmarks/max_context.py on the CPU: grid, fits, decisions, trace attribution (longctx.bench),
a dry-run job and the plot (the script's command line)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from longctx.bench import max_context_fit, peak_trace

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "max_context.py"
K = 1024


@pytest.fixture(scope="module")
def mc():
    """The benchmark's pure parts, as one namespace."""
    return types.SimpleNamespace(**{**vars(max_context_fit), **vars(peak_trace)})


def _script(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_grid_and_decisions(mc):
    assert mc.grid_lengths(64 * K, 256 * K) == [64 * K, 96 * K, 128 * K, 192 * K, 256 * K]
    assert mc.grid_lengths(1, 16, 4) == [4, 8, 12, 16]
    grid = mc.grid_lengths(16 * K, 4 * K * K, 8)
    assert mc.next_grid(grid, 128 * K) == 192 * K and mc.prev_grid(grid, 128 * K) == 96 * K
    assert mc.next_grid(grid, grid[-1]) is None and mc.prev_grid(grid, grid[0]) is None
    # memory: exact line through the points; the boundary length itself fits
    a, b = 6e9, 2.5e5
    xs = [4 * K, 8 * K, 16 * K]
    fa, fb, res = mc.fit_linear(xs, [a + b * x for x in xs])
    assert fa == pytest.approx(a) and fb == pytest.approx(b) and res < 1e-12
    budget = a + b * (192 * K) / 2
    assert mc.predict_max(a, b, 2, budget, grid) == 192 * K
    assert mc.predict_max(a, b, 2, budget - 1, grid) == 128 * K
    assert mc.predict_max(a, b, 2, a, grid) is None
    with pytest.raises(ValueError, match="distinct"):
        mc.fit_linear([4 * K, 4 * K], [1.0, 2.0])
    # time: t = c1 S/P + c2 (S/P) S, recovered exactly; noise that would make c1 < 0 falls back
    c1, c2 = 3e-6, 4e-11
    pts = [(sl, sl * 4, c1 * sl + c2 * sl * sl * 4) for sl in (8 * K, 16 * K, 32 * K)]
    assert mc.fit_time(pts) == pytest.approx((c1, c2))
    assert mc.predict_time((c1, c2), 1 << 20, 4) == pytest.approx(c1 * (1 << 18) + c2 * (1 << 38))
    coef = mc.fit_time([(1, 1, 1.0), (2, 4, 1.0), (3, 9, 1.0)])
    assert min(coef) >= 0
    # extension: the largest length beyond the measured ones that the time cap allows
    ext = mc.extension_length(grid, 4 * K * K, 4, (c1, c2), 45.0, 128 * K)
    assert ext is not None and mc.predict_time((c1, c2), ext, 4) <= 45.0
    assert mc.predict_time((c1, c2), mc.next_grid(grid, ext), 4) > 45.0


def test_attribute_peak_replays_to_the_peak(mc):
    roots = {"/x/longctx/": "longctx/", "/x/models/": "models/"}
    me = "/y/benchmarks/max_context_job.py"
    torch_frame = {"filename": "/site/torch/autograd/__init__.py", "line": 1, "name": "backward"}
    ring = {"filename": "/x/longctx/ring.py", "line": 20, "name": "_ring_backward"}
    mlp = {"filename": "/x/models/gpt.py", "line": 7, "name": "forward"}
    step = {"filename": me, "line": 3, "name": "step"}
    trace = [
        dict(action="alloc", addr=1, size=100, frames=[mlp, step]),
        dict(action="alloc", addr=2, size=50, frames=[torch_frame, ring, step]),
        dict(action="free_requested", addr=1, size=100),
        dict(action="free_completed", addr=1, size=100),
        dict(action="alloc", addr=3, size=200, frames=[torch_frame, step]),  # peak: 1000 + 50 + 200
        dict(action="free_completed", addr=99, size=30),  # a block from before the trace
        dict(action="free_completed", addr=2, size=50),
        dict(action="free_completed", addr=3, size=200),
    ]
    out = mc.attribute_peak(trace, 1000, s_local=10, n_layer=2, roots=roots, bench_files=("max_context_job.py",))
    assert out["peak_bytes_replayed"] == 1250 and out["resident_before_step_bytes"] == 1000
    sites = {r["site"]: r for r in out["sites"]}
    assert set(sites) == {"longctx/ring.py:20:_ring_backward", "benchmark:step (autograd: gradients, temporaries)"}
    assert sites["longctx/ring.py:20:_ring_backward"]["bytes"] == 50
    assert sites["longctx/ring.py:20:_ring_backward"]["bytes_per_token_per_layer"] == 2.5
    assert out["peak_event"].startswith("benchmark:step")
    # the shared training step (longctx.bench.step) is the benchmark's step, not a library site
    helper = {"filename": mc.STEP_FILE, "line": 40, "name": "train_step"}
    own = ("max_context_job.py",)
    assert mc.site_label([torch_frame, helper, step], roots, own) == "benchmark:step (autograd: gradients, temporaries)"
    assert mc.site_label([mlp, helper, step], roots, own) == "models/gpt.py:7:forward"


def _records(p, ckpt, a, b, budget, lengths, extra=()):
    meta = dict(kind="meta", p=p, ckpt=ckpt, budget_bytes=budget, total_bytes=budget / 0.92, n_layer=24)
    pts = [
        dict(
            kind="measure",
            p=p,
            ckpt=ckpt,
            phase="fit",
            s_total=s,
            s_local=s // p,
            peak_alloc=a + b * s // p,
            step_s=1e-6 * s // p + 1e-11 * s * s // p,
        )
        for s in lengths
    ]
    return [meta] + pts + list(extra)


def test_summarize_statuses_and_plot(mc, tmp_path):
    a, b = 6 * 2**30, 200 * K
    budget = a + b * 96 * K + 1000  # 96K tokens per GPU fit, not one grid length more
    meta = dict(preset="gpt-350m", grid_min=16 * K, grid_max=1 << 25)
    recs = []
    # P=1: 96K verified, 128K out of memory -> measured bracket
    recs += _records(
        1,
        False,
        a,
        b,
        budget,
        [4 * K, 8 * K, 16 * K],
        [
            dict(
                kind="measure",
                p=1,
                ckpt=False,
                phase="verify",
                s_total=96 * K,
                s_local=96 * K,
                peak_alloc=a + b * 96 * K,
                step_s=3.0,
            ),
            dict(kind="oom", p=1, ckpt=False, phase="probe", s_total=128 * K),
        ],
    )
    # P=2: prediction 192K verified, next length not tried
    recs += _records(
        2,
        False,
        a,
        b,
        budget,
        [8 * K, 16 * K, 32 * K],
        [
            dict(
                kind="measure",
                p=2,
                ckpt=False,
                phase="verify",
                s_total=192 * K,
                s_local=96 * K,
                peak_alloc=a + b * 96 * K,
                step_s=5.0,
            )
        ],
    )
    # P=4: the prediction (384K) ran out of memory, no retry: only the fit lengths are known
    recs += _records(
        4,
        False,
        a,
        b,
        budget,
        [32 * K, 64 * K, 128 * K],
        [dict(kind="oom", p=4, ckpt=False, phase="verify", s_total=384 * K)],
    )
    # P=1 with checkpointing: only fit points -> predicted
    recs += _records(1, True, a, b / 10, budget, [8 * K, 16 * K, 32 * K])
    out = mc.summarize(recs, meta)
    rows = {(r["P"], r["checkpointing"]): r for r in out["table"]}
    assert rows[1, False]["status"].startswith("measured") and rows[1, False]["max_seq_len"] == 96 * K
    assert rows[2, False]["status"].startswith("verified") and rows[2, False]["max_seq_len"] == 192 * K
    assert rows[4, False]["status"].startswith("prediction too high") and rows[4, False]["max_seq_len"] == 128 * K
    assert rows[1, True]["status"].startswith("predicted") and rows[1, True]["max_seq_len"] == 768 * K
    assert rows[1, False]["bytes_per_token_per_layer"] == pytest.approx(b / 24)
    assert out["scaling_vs_1gpu"]["no_ckpt"] == {"1": 1.0, "2": 2.0, "4": pytest.approx(128 / 96)}
    path = tmp_path / "max_context_ws4.json"
    path.write_text(json.dumps(out))
    png = _script("--plot", str(path)).strip().splitlines()[-1]
    assert png == str(path.with_suffix(".png")) and Path(png).stat().st_size > 10_000


def test_dry_run_job_brackets_the_maximum(mc, tmp_path):
    records = tmp_path / "P1_nockpt.jsonl"
    grid_min, grid_max = 128, 1 << 18  # the dry run's --grid-max default
    _script(
        "--dry-run",
        "--job",
        "P1_nockpt",
        "--p",
        "1",
        "--ckpt",
        "0",
        "--records",
        str(records),
        "--dry-run-mem-mib",
        "26",
        "--verify-max-s",
        "20",
        "--fit-lengths-off",
        "64,128,256",
        "--grid-min",
        str(grid_min),
    )
    recs = mc.read_records(tmp_path)
    kinds = [(r["kind"], r.get("phase")) for r in recs]
    assert kinds[0] == ("meta", None) and kinds.count(("measure", "fit")) == 3
    assert ("oom", "probe") in kinds, kinds  # caught in-process for P=1, and the job went on to finish
    assert all(r["loss_finite"] for r in recs if r["kind"] == "measure")
    row = mc.summarize(recs, dict(preset="tiny", grid_min=grid_min, grid_max=grid_max))["table"][0]
    assert row["status"].startswith("measured"), row
    oom = next(r["s_total"] for r in recs if r["kind"] == "oom")
    assert mc.next_grid(mc.grid_lengths(grid_min, grid_max, 2), row["max_seq_len"]) == oom
