"""longctx.run_plan: one run plan, every "auto" resolved once before configure_model.

For several configs (data parallel FSDP2 / DDP / auto, causal and document attention, ring and
Ulysses, named and "auto" kernels, memory settings), a real fit under ContextParallelStrategy:
the plan printed at start == the module's hparams == what config.yaml gets (``config_entries``)
== what the wrapped model and the strategy run with; a run started again from those entries
resolves to the same plan. Plus the pure pieces (data-parallel rule, kernel choice per block
kind, document balance) against the rules they replace.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from longctx.lightning.strategy import ContextParallelStrategy
from longctx.parallel import ContextParallelAttention, ParallelPlan
from longctx.run_plan import (
    RunPlan,
    World,
    balances_documents,
    resolve_data_parallel,
    resolve_run,
)

MODEL = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64)
SEQ = 32


class _Data(L.LightningDataModule):
    """Full-length token batches with document ids; ``seq_len``/``batch_size`` as the run's
    data module has them (the run plan reads them before the model is built)."""

    seq_len, batch_size = SEQ, 2

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, MODEL["vocab_size"], (4, SEQ + 1), generator=g)
        ids = torch.repeat_interleave(torch.arange(2), SEQ // 2)
        data = [{"input_ids": t[:-1], "labels": t[1:], "document_ids": ids} for t in tokens]
        return DataLoader(data, batch_size=self.batch_size)


def _fit(strategy_kw: dict, module_kw: dict, capsys):
    from longctx.lightning.module import CausalLMModule

    torch.manual_seed(0)
    module = CausalLMModule(MODEL, warmup_steps=1, **module_kw)
    strategy = ContextParallelStrategy(context_parallel_size=1, failure_timeout=None, **strategy_kw)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=_Data())
    return module, trainer.strategy, capsys.readouterr().out


def _runs_as(module, strategy) -> dict:
    """The settings the wrapped model and the strategy actually run with."""
    from torch.distributed.tensor import DTensor

    cores = [m for m in module.model.modules() if isinstance(m, ContextParallelAttention)]
    one = {(c.kind, c.backend, c.document_backend, c.head_chunks, c.cp.size, c.cp.layout) for c in cores}
    assert len(one) == 1, one
    kind, backend, document_backend, head_chunks, cp, layout = one.pop()
    blocks = module.model.blocks
    sharded = {isinstance(p, DTensor) for p in module.parameters()}
    assert len(sharded) == 1
    return dict(
        data_parallel="fsdp" if sharded.pop() else "ddp",
        cp=cp,
        layout=layout,
        cp_attention=kind,
        attention_backend=backend,
        document_backend=document_backend,
        activation_checkpointing=[b.activation_checkpointing for b in blocks],
        mlp_tile_size={b.mlp.tile_size for b in blocks},
        attention_head_chunks=head_chunks,
        offload_activations=module.model.offload_activations,
        loss_chunk_size=module.model.loss_chunk_size,
        strategy_data_parallel=strategy.data_parallel,
    )


CONFIGS = {
    "fsdp-document-auto-kernels": (dict(data_parallel="fsdp"), dict()),
    "ddp-causal-named-kernel-memory": (
        dict(data_parallel="ddp"),
        dict(
            attention="causal",
            parallel=dict(
                attention_backend="torch",
                activation_checkpointing="full",
                checkpointed_blocks=1,
                mlp_tile_size=8,
                attention_head_chunks=2,
                loss_chunk_size=16,
            ),
        ),
    ),
    "auto-dp-ulysses-balance-off": (
        dict(data_parallel="auto"),
        dict(
            load_balance=False, parallel=dict(cp_attention="ulysses", document_backend="torch", offload_activations=1)
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_printed_plan_is_the_recorded_plan_is_the_plan_the_model_runs(name, capsys):
    strategy_kw, module_kw = CONFIGS[name]
    module, strategy, printed = _fit(strategy_kw, module_kw, capsys)
    run: RunPlan = module.run_plan
    assert run.line() in printed.splitlines()  # printed at start
    plan = run.model
    assert module.plan == plan and module.hparams["parallel"] == plan.to_dict()  # hparams, the checkpoint
    entries = run.config_entries()  # what train.py writes into the run's config.yaml
    assert entries["model.parallel"] == plan.to_dict()
    assert entries["strategy.data_parallel"] == run.parallel.data_parallel
    p, m = run.parallel, run.memory
    assert "auto" not in (p.data_parallel, p.attention_backend, p.document_backend)  # every "auto" resolved
    assert p.attention_backend == p.document_backend == "torch"  # the kernels' choice on a CPU
    assert _runs_as(module, strategy) == dict(
        data_parallel=p.data_parallel,
        cp=p.cp,
        layout=p.layout,
        cp_attention=p.cp_attention,
        attention_backend=p.attention_backend,
        document_backend=p.document_backend,
        activation_checkpointing=[
            m.activation_checkpointing if m.checkpointed_blocks is None or i < m.checkpointed_blocks else "none"
            for i in range(len(module.model.blocks))
        ],
        mlp_tile_size={m.mlp_tile_size},
        attention_head_chunks=m.attention_head_chunks,
        offload_activations=m.offload_activations,
        loss_chunk_size=m.loss_chunk_size,
        strategy_data_parallel=p.data_parallel,
    )
    if strategy_kw["data_parallel"] != "auto":
        assert p.data_parallel == strategy_kw["data_parallel"]
    else:
        assert p.data_parallel == "ddp"  # auto on a CPU
    assert p.balance_documents is False  # CP = 1: nothing to balance

    # Started again from the run's config.yaml: the same plan.
    resumed_strategy = {**strategy_kw, "data_parallel": entries["strategy.data_parallel"]}
    resumed_module = {**module_kw, "parallel": entries["model.parallel"]}
    again, _, printed = _fit(resumed_strategy, resumed_module, capsys)
    assert again.run_plan == run and run.line() in printed.splitlines()


def test_resolution_is_its_own_fixed_point():
    """Resolving a resolved plan's own entries gives it back, also where the memory model
    escalated it (a small "GPU"), and the kernels are named per block kind."""
    from longctx.models import GPTConfig

    cfg = GPTConfig.from_dict(dict(preset="tiny", vocab_size=256))
    world = World(cp=1, dp=1, data_parallel="auto")
    kw = dict(precision="32-true", seq_len=1 << 20, batch_size=1, n_params=10**6)
    first = resolve_run(cfg, world, "cpu", requested={"activation_checkpointing": "full"}, **kw)
    assert first.parallel.attention_backend == first.parallel.document_backend == "torch"
    assert first.estimate is not None and first.memory.mlp_tile_size is None  # CPU: predicted, not escalated
    again = resolve_run(
        cfg,
        World(data_parallel=first.config_entries()["strategy.data_parallel"]),
        "cpu",
        requested=first.config_entries()["model.parallel"],
        **kw,
    )
    assert again == first


def test_the_pure_rules():
    # data parallel "auto": FSDP2 where the replicated state would fill a quarter of the GPU
    gib = 2**30
    assert (
        resolve_data_parallel("auto", n_params=2 * 10**9, device_type="cuda", gpu_total=80 * gib, parallelizes=True)
        == "fsdp"
    )
    assert (
        resolve_data_parallel("auto", n_params=10**8, device_type="cuda", gpu_total=80 * gib, parallelizes=True)
        == "ddp"
    )
    assert (
        resolve_data_parallel("auto", n_params=2 * 10**9, device_type="cuda", gpu_total=80 * gib, parallelizes=False)
        == "ddp"
    )
    assert resolve_data_parallel("auto", n_params=10**12, device_type="cpu", gpu_total=None, parallelizes=True) == "ddp"
    assert resolve_data_parallel("fsdp", n_params=1, device_type="cpu", gpu_total=None, parallelizes=True) == "fsdp"
    # document balance: on by default under the ring and zigzag, with CP and documents
    rule = dict(documents=True, cp=2, layout="zigzag", cp_attention="ring")
    assert balances_documents(None, **rule) and balances_documents(True, **rule)
    assert not balances_documents(False, **rule)
    assert not balances_documents(None, **{**rule, "cp_attention": "ulysses"})
    assert balances_documents(True, **{**rule, "cp_attention": "ulysses"})
    assert not balances_documents(None, **{**rule, "layout": "contiguous"})
    assert not balances_documents(True, **{**rule, "cp": 1}) and not balances_documents(
        True, **{**rule, "documents": False}
    )


def test_kernels_per_block_kind_follow_the_kernels_rule(monkeypatch):
    """On a (pretended) GPU the plan names, per block kind, what the kernels would pick per call:
    the selection table for plain blocks of this rank's shard length, fa4-else-triton for
    document-masked ones; a named vendor kernel leaves document blocks to triton."""
    import longctx.kernels as kernels
    from longctx.kernels import selection
    from longctx.models import GPTConfig

    cfg = GPTConfig.from_dict(dict(preset="tiny", vocab_size=256))  # head_dim 32
    monkeypatch.setattr(kernels, "backend_available", lambda name, device: name != "fa4")
    monkeypatch.setattr(kernels, "_fa4_refusal", lambda device, dtype, head_dim: "not installed")
    monkeypatch.setattr(ParallelPlan, "check_device", lambda self, device: None)
    seen = []

    def choose(device, dtype, head_dim, seq_q, seq_k, causal):
        seen.append((dtype, head_dim, seq_q, seq_k, causal))
        return "cudnn"

    monkeypatch.setattr(selection, "choose_backend", choose)
    world = World(cp=4, dp=1, data_parallel="ddp")
    run = resolve_run(cfg, world, "cuda", precision="bf16-mixed", seq_len=4096, batch_size=1, memory_check=False)
    assert (run.parallel.attention_backend, run.parallel.document_backend) == ("cudnn", "triton")
    assert seen == [(torch.bfloat16, 32, 1024, 1024, True)]  # the ring's blocks: this rank's shard
    with pytest.warns(UserWarning, match="no document mask"):
        named = resolve_run(
            cfg,
            world,
            "cuda",
            requested=dict(attention_backend="cudnn"),
            precision="bf16-mixed",
            seq_len=4096,
            batch_size=1,
            memory_check=False,
        )
    assert (named.parallel.attention_backend, named.parallel.document_backend) == ("cudnn", "triton")
    unknown = resolve_run(cfg, world, "cuda", precision="bf16-mixed", memory_check=False)  # no seq_len yet
    assert unknown.parallel.attention_backend == "auto" and unknown.parallel.document_backend == "triton"


def _counting_plan_run(monkeypatch) -> list:
    """``plan_run`` where the module (its ``setup``, ``check_fit`` and batch hook) looks it up,
    counting: the plans it resolved, in order."""
    import longctx.lightning.module as module_py

    resolved, plan_run = [], module_py.plan_run

    def counting(*args, **kwargs):
        resolved.append(plan_run(*args, **kwargs))
        return resolved[-1]

    monkeypatch.setattr(module_py, "plan_run", counting)
    return resolved


def test_train_py_resolves_the_plan_once(tmp_path, monkeypatch, capsys):
    """A train.py run in this process (one rank, CPU): the plan ``check_fit`` resolves before any
    data work is the one the fit sets up (printed, recorded in config.yaml), not resolved again
    in ``setup`` (issue 43)."""
    import yaml
    from helpers.train_script import TINY, clear_rendezvous, load_train

    train = load_train("train_plan_once")
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    clear_rendezvous(monkeypatch)
    resolved = _counting_plan_run(monkeypatch)
    out = tmp_path / "run"
    assert train.main([*TINY, "--max-steps", "1", "--checkpoint-every", "0", "--output-dir", str(out)]) == 0
    assert len(resolved) == 1, [run.line() for run in resolved]
    (run,) = resolved
    assert run.line() in capsys.readouterr().out.splitlines()
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["model"]["parallel"] == run.config_entries()["model.parallel"]


def test_the_batch_hook_resolves_a_missing_plan_once(monkeypatch):
    """Without ``setup`` (the hook called outside a fit) the batch hook resolves its plan on the
    first batch and keeps it: not one per batch; a plan handed over (``use_run_plan``) is the one
    ``setup`` sets up, resolving nothing."""
    from types import SimpleNamespace

    from longctx.lightning.module import CausalLMModule

    resolved = _counting_plan_run(monkeypatch)
    module = CausalLMModule(MODEL)
    strategy = SimpleNamespace(cp_size=2, layout="zigzag", cp_rank=0, cp_group=None)
    module._trainer = SimpleNamespace(strategy=strategy, global_rank=1)  # rank 1: no report printed
    ids = torch.repeat_interleave(torch.arange(2), SEQ // 2)[None]
    batch = {"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "document_ids": ids}
    first = module.on_after_batch_transfer(dict(batch), 0)
    for _ in range(3):
        again = module.on_after_batch_transfer(dict(batch), 0)
        assert torch.equal(again["position_ids"], first["position_ids"])
    assert len(resolved) == 1 and module.run_plan is None  # the hook's, not the fit's

    planned = resolved[0]
    module.use_run_plan(planned)
    module.setup("fit")
    assert module.run_plan is planned and len(resolved) == 1
    assert module.hparams["parallel"] == planned.model.to_dict()
    with pytest.raises(RuntimeError, match="hand one over before the fit"):
        module.use_run_plan(planned)


def test_the_host_memory_checked_is_not_the_one_planned_for():
    """``host_check`` (train.py's launching process: the memory available now) only refuses: a
    run that fits gets the plan made for ``host_total`` (every process's, ``setup``'s)."""
    from longctx.memory_fit import PredictedOutOfMemory
    from longctx.models import GPTConfig

    gib = 2**30
    cfg = GPTConfig.from_dict(dict(preset="tiny", vocab_size=256))
    kw = dict(precision="32-true", seq_len=4096, batch_size=1, n_params=10**6, host_total=64 * gib)
    planned = resolve_run(cfg, World(), "cpu", **kw)
    assert resolve_run(cfg, World(), "cpu", host_check=32 * gib, **kw) == planned
    with pytest.raises(PredictedOutOfMemory, match=r"\(0\.5 GiB available here over 1 rank\)"):
        resolve_run(cfg, World(), "cpu", host_check=gib // 2, **kw)
