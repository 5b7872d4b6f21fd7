"""The run's defaults (issue 41, "fast by default"): on a GPU the fastest plan the memory model
predicts to fit, on a CPU the plain model as before; every value the run takes is in its plan
line and in its config.yaml, and a run started from that config.yaml prints the same plan.

GPU sizes are faked (``gpu_total``/``host_total``, or ``torch.cuda.mem_get_info``): nothing here
needs a GPU. The block kernel is named ("torch": it runs anywhere) so that the memory the model
counts is the same on any machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.train_script import clear_rendezvous
from test_train_errors import cache, train  # noqa: F401 (fixtures)

from longctx.parallel import ParallelPlan
from longctx.run_plan import World, resolve_run

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30
K = 1024
# The command: Llama-3.2-1B shape, 131,072 tokens, CP = 4 (FSDP2 over the 4 ranks).
ONE_B_CP4 = dict(precision="bf16-mixed", seq_len=128 * K, batch_size=1, documents=False, n_params=1_235_814_400)
WORLD = World(cp=4, dp=1, data_parallel="fsdp", local_ranks=4)
KERNEL = {"attention_backend": "torch"}


def _one_b():
    from longctx.models import GPTConfig

    return GPTConfig.from_preset("llama3.2-1b")


@pytest.mark.parametrize(
    "gpu_gib, expected, blocks, tile",
    [(80, "none", None, None), (40, "selective", 9, None), (25, "selective", 14, 8192), (20, "full", None, None)],
    ids=["80GiB-none", "40GiB-selective-9-blocks", "25GiB-selective-tiled-14-blocks", "20GiB-full"],
)
def test_gpu_defaults_take_the_least_recompute_predicted_to_fit(gpu_gib, expected, blocks, tile):
    """The documented plan for the 1B shape at 131,072 tokens over CP = 4 (predicted per rank:
    54.3 GiB without checkpointing, 25.5 with the MLP tiled, 23.4 selective, 17.2 full): an
    80 GiB GPU runs without recompute; a 40 GiB one selective on the first 9 of 16 blocks
    (37.0 GiB: the other 7 keep everything and recompute nothing); a 25 GiB one selective with
    the MLP tiled on the first 14 (23.7 GiB: the tiles recompute neither q/k/v nor down_proj,
    less than selective untiled); a 20 GiB one full; pointwise fusion on. The note says the
    mode came from the GPU default."""
    run = resolve_run(
        _one_b(), WORLD, "cuda", requested=KERNEL, gpu_total=gpu_gib * GiB, host_total=512 * GiB, **ONE_B_CP4
    )
    memory = run.memory
    assert (memory.activation_checkpointing, memory.checkpointed_blocks, memory.mlp_tile_size) == (
        expected,
        blocks,
        tile,
    )
    assert run.parallel.fuse_pointwise is True and run.parallel.float8 is False
    on = f" on the first {blocks} of 16 blocks" if blocks else ""
    tiled = f" with mlp_tile_size={tile}" if tile else ""
    assert f"activation_checkpointing auto (the GPU default) -> {expected}{on}{tiled} (" in run.notes[0]
    assert run.estimate.gpu_bytes <= 0.95 * gpu_gib * GiB  # "auto" keeps 5% of the GPU free
    line = run.line()
    assert f"activation_checkpointing={expected}" in line and "fuse_pointwise=True" in line
    assert f"checkpointed_blocks={blocks}" in line and f"mlp_tile_size={tile}" in line
    # What config.yaml gets resolves again to the same plan (the user's values now: no "auto").
    again = resolve_run(
        _one_b(),
        WORLD,
        "cuda",
        requested=run.config_entries()["model.parallel"],
        gpu_total=gpu_gib * GiB,
        host_total=512 * GiB,
        **ONE_B_CP4,
    )
    assert again == run and again.line() == line and not again.notes


def test_what_the_user_sets_wins_on_a_gpu():
    """A value given (a config's or a flag's) is kept: full stays full where none would fit,
    fusion off stays off; transformers' modules (no fusion hook) default to unfused."""
    run = resolve_run(
        _one_b(),
        WORLD,
        "cuda",
        requested={**KERNEL, "activation_checkpointing": "full", "fuse_pointwise": False},
        gpu_total=80 * GiB,
        host_total=512 * GiB,
        **ONE_B_CP4,
    )
    assert (run.memory.activation_checkpointing, run.parallel.fuse_pointwise) == ("full", False)
    assert not run.notes
    sizes = dict(gpu_total=80 * GiB, host_total=512 * GiB)
    hf = resolve_run(_one_b(), WORLD, "cuda", requested=KERNEL, hf_modules=True, **sizes, **ONE_B_CP4)
    assert hf.parallel.fuse_pointwise is False and hf.memory.activation_checkpointing in ("none", "full")


def test_cpu_keeps_the_plain_defaults():
    """On a CPU nothing changes: no checkpointing, no fusion (a CPU machine may have no
    compiler), exactly the plan of the values written out; and the one place that decides
    (``ParallelPlan.defaults_for``) says so, with the "auto" / fusion of a GPU beside it."""
    from longctx.models import GPTConfig

    cfg = GPTConfig.from_dict(dict(preset="tiny", vocab_size=256))
    kw = dict(precision="32-true", seq_len=512, batch_size=8, n_params=10**6)
    world = World(cp=2, dp=1, data_parallel="auto", local_ranks=2)
    default = resolve_run(cfg, world, "cpu", **kw)
    written = resolve_run(
        cfg, world, "cpu", requested={"activation_checkpointing": "none", "fuse_pointwise": False}, **kw
    )
    assert default == written and default.line() == written.line() and not default.notes
    assert (default.memory.activation_checkpointing, default.parallel.fuse_pointwise) == ("none", False)
    plan = ParallelPlan()
    assert (plan.activation_checkpointing, plan.fuse_pointwise) == (None, None)  # left to the run
    cpu, gpu = dict(document_exchange="ring"), dict(document_exchange="auto")
    assert plan.defaults_for("cpu") == plan.defaults_for(None) == ParallelPlan("none", False, **cpu)
    assert plan.defaults_for("cuda") == ParallelPlan("auto", True, **gpu)
    assert plan.defaults_for("cuda", fusable=False) == ParallelPlan("auto", False, **gpu)
    assert ParallelPlan("selective", False).defaults_for("cuda") == ParallelPlan("selective", False, **gpu)


def test_config_entries_hold_every_resolved_value():
    """Balance and RoPE positions are written resolved (no null), beside the whole plan."""
    from longctx.models import GPTConfig

    cfg = GPTConfig.from_dict(dict(preset="tiny", vocab_size=256))
    kw = dict(precision="32-true", seq_len=512, batch_size=8, n_params=10**6)
    documents = resolve_run(cfg, World(cp=2, data_parallel="ddp"), "cpu", documents=True, **kw)
    entries = documents.config_entries()
    assert entries["model.load_balance"] is True and entries["model.rope_positions"] == "document"
    parallel = entries["model.parallel"]  # (mlp_tile_size None is a value: untiled)
    assert None not in [parallel[k] for k in ("activation_checkpointing", "fuse_pointwise", "document_backend")]
    assert "auto" not in parallel.values()
    assert "rope_positions=document" in documents.line() and "float8=False" in documents.line()
    causal = resolve_run(cfg, World(cp=2, data_parallel="ddp"), "cpu", documents=False, **kw).config_entries()
    assert causal["model.load_balance"] is False and causal["model.rope_positions"] == "global"


def _run_plan_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("run plan:")]


@pytest.mark.slow
def test_config_yaml_reproduces_the_run_plan(full_run, cache_env, tmp_path, train, monkeypatch):  # noqa: F811
    """A tiny CPU run at the CPU defaults (tests/lightning/conftest.py's ``full_run``: CP 2,
    documents, 32-bit; its flags set no plan value): its config.yaml holds every resolved value
    (no null left for the plan, the balance or the RoPE positions), and ``--config`` that file
    resolves the run plan the run printed: train.py's own objects for that command
    (``prepare``: the Trainer, strategy and data module a launch would build), resolved as the
    fit's ``setup`` does (``CausalLMModule.check_fit``, the call train.py makes before
    launching), without a second 2-process launch."""
    from longctx.lightning.module import CausalLMModule

    out, first = full_run
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    model = cfg["model"]
    assert model["load_balance"] is True and model["rope_positions"] == "document"  # CP 2, documents
    assert None not in (model["parallel"]["activation_checkpointing"], model["parallel"]["fuse_pointwise"])
    assert model["parallel"]["activation_checkpointing"] == "none" and model["parallel"]["fuse_pointwise"] is False
    assert model["parallel"]["float8"] is False and cfg["strategy"]["data_parallel"] == "ddp"
    lines = _run_plan_lines(first.stdout)
    assert len(lines) == 1, first.stdout

    clear_rendezvous(monkeypatch)
    monkeypatch.setenv("LONGCTX_CACHE_DIR", cache_env["LONGCTX_CACHE_DIR"])
    cli = train.prepare(["--config", str(out / "config.yaml"), "--output-dir", str(tmp_path / "again")])
    cli.run_lock.close()
    again = CausalLMModule.check_fit(cli.trainer, cli.datamodule, host_total=None, **cli.config.model.as_dict())
    assert again is not None and again.line() == lines[0], (again and again.line(), lines[0])


def test_float8_on_cpu_is_one_line_and_exit_code_2_through_train_py(train, capsys, cache):  # noqa: F811
    """``--model.parallel.float8 true`` on a CPU: train.py says why in one line (the module's
    own words, said of the option), exit code 2, before any data work."""
    from test_train_errors import _error

    from longctx.lightning.module import CausalLMModule

    with pytest.raises(ValueError) as refused:
        CausalLMModule.check_arguments(parallel={"float8": True}, device="cpu")
    line = _error(train, ["--model.parallel.float8", "true", "--accelerator", "cpu"], capsys, cache)
    assert line == f"train.py: error: model.{refused.value}"
    assert "model.parallel.float8 cannot run on cpu: FP8 training needs an sm89+ GPU" in line


@pytest.mark.parametrize(
    "documents, expected, tile", [(False, "selective", 8192), (True, "selective", 8192)], ids=["dense", "documents"]
)
def test_eight_b_over_two_h200_takes_the_plan_that_recomputes_least(documents, expected, tile):
    """Llama-3-8B shape, 131,072 tokens, CP = 2 on 139.8 GiB GPUs: selective alone (132.9 GiB
    predicted) leaves less than 5% free; selective with the MLP tiled (127.9; the tiles are
    its recompute, without q/k/v or down_proj) fits, on the first 23 blocks with the rest
    keeping everything (132.5). Dense, full would repeat the attention too; with packed
    documents, where the attention counts as free, full on 26 blocks ties with it (8.29
    GFLOP a token) and the tie goes to the earlier candidate, selective, which never repeats
    the attention. An FP8 plan is not tiled by "auto" (tiles run in bf16): full."""
    from longctx.memory_fit import least_recompute
    from longctx.models import GPTConfig

    config = GPTConfig.from_dict(dict(preset="llama3-8b", vocab_size=128256, max_seq_len=128 * K))
    world = World(cp=2, dp=1, data_parallel="fsdp", local_ranks=2)
    sizes = dict(gpu_total=int(139.8 * GiB), host_total=1024 * GiB)
    run = resolve_run(
        config,
        world,
        "cuda",
        requested=KERNEL,
        precision="bf16-mixed",
        seq_len=128 * K,
        batch_size=1,
        documents=documents,
        n_params=config.num_params(),
        **sizes,
    )
    assert (run.memory.activation_checkpointing, run.memory.mlp_tile_size) == (expected, tile), run.notes
    assert run.memory.checkpointed_blocks == 23, run.notes
    fp8 = ParallelPlan(**KERNEL, activation_checkpointing="auto", float8=True)
    kw = dict(cp=2, dp=1, data_parallel="fsdp", precision="bf16-mixed", documents=documents, attention_kernel="fa4")
    picked = least_recompute(config, 128 * K, plan=fp8, **sizes, **kw)
    assert (picked.activation_checkpointing, picked.mlp_tile_size) == ("full", None)
