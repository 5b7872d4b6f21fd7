"""longctx.memory: the per-rank memory model, max_seq_len and the fit check (pure arithmetic)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from longctx import ParallelPlan
from longctx.memory import GiB, estimate
from longctx.memory_fit import LIGHTER_MODE_HEADROOM, check_fits, host_memory_bytes, max_seq_len
from longctx.models import GPTConfig

K = 1024
ONE_B = GPTConfig.from_preset("llama3.2-1b")
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def test_items_add_up_and_the_config_is_duck_typed():
    e = estimate(ONE_B, 128 * K, plan=ParallelPlan(activation_checkpointing="full"))
    assert sum(e.items.values()) == e.gpu_bytes and sum(e.host_items.values()) == e.host_bytes
    assert e.allocated_bytes == e.gpu_bytes - e.items["allocator_slack"] - e.items["cuda_context"]
    assert e.params == ONE_B.num_params() and e.tokens_per_rank == 128 * K
    assert "GiB" in e.summary() and e.phase

    class HFLike:  # a Hugging Face Llama config's names
        num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads = 16, 2048, 32, 8
        head_dim, intermediate_size, vocab_size, tie_word_embeddings = 64, 8192, 128256, True

    assert estimate(HFLike(), 128 * K, plan={"activation_checkpointing": "full"}).gpu_bytes == e.gpu_bytes


def test_grows_with_sequence_and_layers_and_checkpointing_orders():
    full = ParallelPlan(activation_checkpointing="full")
    sizes = [estimate(ONE_B, s, plan=full).gpu_bytes for s in (32 * K, 64 * K, 128 * K, 256 * K)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    deeper = estimate(ONE_B.replace(n_layer=32), 128 * K, plan=full).items["saved_block_inputs"]
    assert deeper == 2 * estimate(ONE_B, 128 * K, plan=full).items["saved_block_inputs"]
    by_mode = {
        m: estimate(ONE_B, 64 * K, plan=ParallelPlan(activation_checkpointing=m)).gpu_bytes
        for m in ("none", "selective", "full")
    }
    assert by_mode["full"] < by_mode["selective"] < by_mode["none"]
    # the tiled MLP and the offload only ever lower the GPU peak; the offload raises host memory
    tiled = estimate(ONE_B, 512 * K, plan=ParallelPlan(activation_checkpointing="full", mlp_tile_size=8192))
    assert tiled.gpu_bytes < estimate(ONE_B, 512 * K, plan=full).gpu_bytes
    off = estimate(
        ONE_B, 512 * K, plan=ParallelPlan(activation_checkpointing="full", mlp_tile_size=8192, offload_activations=8)
    )
    assert off.gpu_bytes < tiled.gpu_bytes and off.host_bytes > tiled.host_bytes
    assert off.host_items["offloaded_activations"] == 8 * 512 * K * 2048 * 2  # bf16 block inputs, pinned


def test_fsdp_divides_the_state_by_the_world_and_cp_divides_tokens():
    plan = ParallelPlan(activation_checkpointing="full")
    one = estimate(ONE_B, 128 * K, plan=plan, cp=1, dp=1)
    eight = estimate(ONE_B, 128 * K, plan=plan, cp=2, dp=4)
    assert eight.items["adamw_states"] == one.items["adamw_states"] // 8
    assert eight.items["params"] == one.items["params"] // 8
    assert eight.tokens_per_rank == 64 * K
    ddp = estimate(ONE_B, 128 * K, plan=plan, cp=2, dp=4, data_parallel="ddp", precision="bf16-mixed")
    assert ddp.items.get("adamw_states") == 8 * ONE_B.num_params() and ddp.items["ddp_buckets"] > 0
    off = estimate(ONE_B, 128 * K, plan=plan, cpu_offload=True)
    assert "adamw_states" not in off.items and off.host_items["params_grads_adamw"] == 16 * ONE_B.num_params()
    with pytest.raises(ValueError, match="cpu_offload"):
        estimate(ONE_B, 128 * K, data_parallel="ddp", cpu_offload=True)
    with pytest.raises(ValueError, match="seq_len"):
        estimate(ONE_B, 0)


def test_max_seq_len_is_monotone_and_fits():
    plan = ParallelPlan(activation_checkpointing="full")
    lens = [max_seq_len(ONE_B, g * GiB, plan=plan) for g in (40, 80, 140)]
    assert 0 < lens[0] < lens[1] < lens[2]
    for g, n in zip((40, 80, 140), lens):
        assert estimate(ONE_B, n, plan=plan).gpu_bytes <= g * GiB < estimate(ONE_B, n + 2, plan=plan).gpu_bytes
    assert max_seq_len(ONE_B, 140 * GiB, plan=plan, cp=4) > 3 * lens[2]
    assert max_seq_len(ONE_B, 1 * GiB, plan=plan) == 0
    tiled = ParallelPlan(activation_checkpointing="full", mlp_tile_size=8192)
    assert max_seq_len(ONE_B, 140 * GiB, plan=tiled) > lens[2]


def test_check_fits_raises_one_line_naming_the_fix():
    plan = ParallelPlan(activation_checkpointing="full")
    est = check_fits(ONE_B, 128 * K, plan=plan, gpu_total=140 * GiB, host_total=125 * GiB)
    assert est.gpu_bytes < 140 * GiB
    with pytest.raises(ValueError) as err:
        check_fits(ONE_B, 512 * K, plan=plan, gpu_total=80 * GiB)
    msg = str(err.value)
    assert "\n" not in msg and "mlp_tile_size" in msg and "memory_check=False" in msg, msg
    with pytest.raises(ValueError, match="activation_checkpointing='full'"):
        check_fits(ONE_B, 128 * K, plan=ParallelPlan(activation_checkpointing="none"), gpu_total=80 * GiB)
    with pytest.raises(ValueError, match="context-parallel size"):
        check_fits(ONE_B, 4096 * K, plan=plan, gpu_total=80 * GiB, host_total=16 * GiB)
    with pytest.raises(ValueError, match="host"):
        check_fits(
            ONE_B,
            512 * K,
            plan=ParallelPlan(activation_checkpointing="full", offload_activations=True),
            gpu_total=None,
            host_total=8 * GiB,
        )
    assert host_memory_bytes() > GiB


def test_lightning_module_prints_the_prediction_before_the_first_step(capsys, monkeypatch):
    import torch
    from helpers.tiny_fit import cpu_trainer, tiny_batches, tiny_module

    loader = torch.utils.data.DataLoader(tiny_batches(2), batch_size=1)
    cpu_trainer(max_steps=1).fit(tiny_module(memory_check=True), loader)
    assert "memory (predicted, per rank)" in capsys.readouterr().out
    cpu_trainer(max_steps=1).fit(tiny_module(), loader)
    assert "memory (predicted" not in capsys.readouterr().out


def test_readme_memory_snippet_runs():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Memory: how long a sequence fits", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_train_fit_renders_a_refused_run_as_one_line_rc2(capsys):
    """train.py's fit step: the memory model's refusal before step 1 is one line, exit code 2."""
    import types

    from longctx.lightning.training import fit
    from longctx.memory_fit import PredictedOutOfMemory

    def refuse(*args, **kwargs):
        raise PredictedOutOfMemory("predicted not to fit: 1,048,576 tokens at cp=1 need GPU 200.0 GiB > 139.8 GiB")

    trainer = types.SimpleNamespace(fit=refuse, strategy=types.SimpleNamespace(received_signal=None))
    assert fit(trainer, None, None, None) == (None, 2)
    err = capsys.readouterr().err.strip()
    assert err.startswith("train.py: error: predicted not to fit") and "\n" not in err


def test_fitting_plan_takes_the_cheapest_change_that_fits():
    """Untouched where it fits; the MLP tiled next; then the fewest attention head chunks;
    then the most chunks and the fewest offloaded blocks; None where nothing fits; settings
    the user chose are not changed."""
    from longctx import ParallelPlan
    from longctx.memory import GiB, estimate
    from longctx.memory_fit import fitting_plan
    from longctx.models import GPTConfig

    cfg = GPTConfig.from_dict(dict(preset="llama3.2-1b"))
    seq, kw = 1 << 20, dict(cp=1, dp=1, data_parallel="fsdp", attention_kernel="fa4")
    full = ParallelPlan(activation_checkpointing="full")
    need = estimate(cfg, seq, plan=full, **kw).gpu_bytes
    assert fitting_plan(cfg, seq, plan=full, gpu_total=need, **kw) == full
    tiled = fitting_plan(cfg, seq, plan=full, gpu_total=need - 1, **kw)
    assert tiled.mlp_tile_size is not None and estimate(cfg, seq, plan=tiled, **kw).gpu_bytes < need
    assert tiled.attention_head_chunks == 1 and not tiled.offload_activations
    tight = estimate(cfg, seq, plan=tiled, **kw).gpu_bytes - 1
    chunked = fitting_plan(cfg, seq, plan=full, gpu_total=tight, **kw)
    c = chunked.attention_head_chunks
    assert c > 1 and not chunked.offload_activations and estimate(cfg, seq, plan=chunked, **kw).gpu_bytes <= tight
    for fewer in (f for f in range(2, c) if cfg.n_kv_head % f == 0):  # the fewest chunks that fit
        p = ParallelPlan.from_dict({**tiled.to_dict(), "attention_head_chunks": fewer})
        assert estimate(cfg, seq, plan=p, **kw).gpu_bytes > tight
    most = ParallelPlan.from_dict({**tiled.to_dict(), "attention_head_chunks": cfg.n_kv_head})
    tight = estimate(cfg, seq, plan=most, **kw).gpu_bytes - 1
    chosen = fitting_plan(cfg, seq, plan=full, gpu_total=tight, **kw)
    assert chosen.attention_head_chunks == cfg.n_kv_head
    n = chosen.offload_activations
    assert isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= cfg.n_layer
    assert estimate(cfg, seq, plan=chosen, **kw).gpu_bytes <= tight
    if n > 1:  # one block fewer would not fit: the smallest n
        fewer = ParallelPlan.from_dict({**chosen.to_dict(), "offload_activations": n - 1})
        assert estimate(cfg, seq, plan=fewer, **kw).gpu_bytes > tight
    assert fitting_plan(cfg, seq, plan=full, gpu_total=1 * GiB, **kw) is None
    assert fitting_plan(cfg, seq, plan=full, gpu_total=tight, host_total=1 * GiB, **kw) is None
    chosen_by_user = ParallelPlan(activation_checkpointing="full", mlp_tile_size=4096, offload_activations=2)
    got = fitting_plan(cfg, seq, plan=chosen_by_user, gpu_total=tight, **kw)
    assert got is None or {**got.to_dict(), "attention_head_chunks": 1} == chosen_by_user.to_dict()


@pytest.mark.parametrize(
    "results",
    [
        "memory_validate_h200.json",
        "memory_validate_cp2_h100x2.json",
        "memory_validate_periods_h100.json",
        *sorted(p.name for p in RESULTS.glob("memory_full*.json")),
    ],
)
def test_the_model_bounds_the_committed_measurements(results):
    """Every GPU measurement committed under benchmarks/results/ (one H200; CP=2 over two
    H100s; FlashAttention-4 blocks; the full-depth train.py runs of device_memory_full.sh)
    lies within 10% below the model's prediction as the model is now: a change to the model
    that stops predicting them fails here."""
    from longctx.bench.memory_recheck import recheck

    rows = recheck(RESULTS / results, "fa4")
    assert rows  # a file with no measured row would check nothing
    for r in rows:
        assert 0.9 <= r["ratio"] <= 1.0, r


def test_the_fitting_plan_is_decided_before_the_model_is_built(monkeypatch, capsys):
    """A run predicted not to fit takes the fitting plan in ``setup`` (before configure_model),
    from the data module's shapes: the run plan printed at start, ``hparams["parallel"]`` (what the
    checkpoint and train.py's config.yaml record) and the settings the parallelized model
    runs with are the same plan; a second module given that plan resolves to it unchanged."""
    from types import SimpleNamespace

    import torch

    from longctx.lightning.module import CausalLMModule
    from longctx.parallel import ParallelDims

    gpu = 9 * 2**30  # a small "GPU": the 1M-token tiny run fits only with the MLP tiled
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gpu, gpu))

    def run(parallel):
        module = CausalLMModule(dict(preset="tiny", vocab_size=256), parallel=parallel, attention="causal")
        trainer = SimpleNamespace(
            strategy=SimpleNamespace(root_device=torch.device("cuda"), cp_size=1, parallel_dims=ParallelDims()),
            datamodule=SimpleNamespace(seq_len=1 << 20, batch_size=1),
            precision="bf16-mixed",
            world_size=1,
            num_devices=1,
            global_rank=0,
        )
        module._trainer = trainer
        module.setup("fit")
        module.configure_model()
        return module

    module = run({"activation_checkpointing": "full"})
    printed = capsys.readouterr().out
    assert "does not fit; running with" in printed
    assert module.run_plan.line() in printed.splitlines()  # printed at start: the plan it runs with
    assert module.plan == module.run_plan.model and module.plan.mlp_tile_size is not None
    assert module.hparams["parallel"] == module.plan.to_dict()
    assert {block.mlp.tile_size for block in module.model.blocks} == {module.plan.mlp_tile_size}
    assert module.model.offload_activations == module.plan.offload_activations
    again = run(module.hparams["parallel"])  # the run's config.yaml / checkpoint, loaded back
    assert again.plan == module.plan and "does not fit" not in capsys.readouterr().out
    assert again.run_plan == module.run_plan


def test_auto_checkpointing_takes_the_least_recompute_that_fits(monkeypatch, capsys):
    """activation_checkpointing="auto" is decided in ``setup`` from the memory model: of no
    checkpointing, selective and full, each untiled or with the MLP tiled, and the checkpointed
    modes on any number of the first blocks (the rest keeping everything), the one that
    recomputes least among those that fit (checked against every such plan of the tiny shape at
    262,144 dense tokens), else full (then the fitting ladder); the decided mode, blocks and tile
    are what the run plan prints, ``hparams["parallel"]`` records and the blocks run, and
    resolving that record again gives the same plan. Without a GPU to check it is "full"."""
    from types import SimpleNamespace

    import torch

    from longctx.lightning.module import CausalLMModule
    from longctx.memory_fit import DEFAULT_MLP_TILE, recomputed_flops_per_token
    from longctx.parallel import ParallelDims

    def run(parallel, gpu=None, seq_len=1 << 18):
        if gpu is not None:
            monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gpu, gpu))
        module = CausalLMModule(dict(preset="tiny", vocab_size=256), parallel=parallel, attention="causal")
        device = torch.device("cuda" if gpu is not None else "cpu")
        module._trainer = SimpleNamespace(
            strategy=SimpleNamespace(root_device=device, cp_size=1, parallel_dims=ParallelDims()),
            datamodule=SimpleNamespace(seq_len=seq_len, batch_size=1),
            precision="bf16-mixed" if gpu is not None else "32-true",
            world_size=1,
            num_devices=1,
            global_rank=0,
        )
        module.setup("fit")
        module.configure_model()
        return module

    huge = 1 << 50
    config = GPTConfig.from_dict(dict(preset="tiny", vocab_size=256))
    n_layer = config.n_layer

    # Every plan "auto" may take, in its order of preference at equal cost: (mode, tile, blocks).
    choices = [
        (m, t, b)
        for m in ("none", "selective", "full")
        for t in (None, DEFAULT_MLP_TILE)
        for b in ([None] if m == "none" else [*range(1, n_layer), None])
    ]

    def plan_of(choice):
        m, t, b = choice
        return {"activation_checkpointing": m, "mlp_tile_size": t, "checkpointed_blocks": b}

    def cost(choice):
        plan = ParallelPlan(**plan_of(choice))
        return recomputed_flops_per_token(config, 1 << 18, plan, tokens_per_rank=1 << 18)

    need = {c: run(plan_of(c), huge).run_plan.estimate.gpu_bytes for c in choices}
    assert need[("none", None, None)] > need[("selective", None, None)] > need[("full", None, None)]
    capsys.readouterr()

    def gpu_for(choice):  # the smallest GPU on which it fits with the headroom "auto" keeps
        return math.ceil(need[choice] / (1 - LIGHTER_MODE_HEADROOM))

    def expected_for(gpu):  # by brute force: the least cost among those that fit, earliest first
        fitting = [c for c in choices if gpu_for(c) <= gpu and not (c[0] == "full" and c[1] is not None)]
        return min(fitting, key=cost) if fitting else None

    sizes = sorted({gpu_for(c) for c in choices} | {gpu_for(c) - 2 for c in choices}, reverse=True)
    taken = set()
    for gpu in sizes:
        expected = expected_for(gpu)
        module = run({"activation_checkpointing": "auto"}, gpu)
        printed = capsys.readouterr().out
        got = (module.plan.activation_checkpointing, module.plan.mlp_tile_size, module.plan.checkpointed_blocks)
        if expected is None:  # nothing fits with the headroom: full, and the fitting ladder's tile
            expected = ("full", got[1], None)
        taken.add(expected)
        assert got == expected, (gpu, printed)
        mode, tile, blocks = expected
        on = f" on the first {blocks} of {n_layer} blocks" if blocks is not None else ""
        assert f"activation_checkpointing auto -> {mode}{on}" in printed
        assert module.hparams["parallel"]["activation_checkpointing"] == mode
        assert module.hparams["parallel"]["mlp_tile_size"] == tile
        assert module.hparams["parallel"]["checkpointed_blocks"] == blocks
        modes = [block.activation_checkpointing for block in module.model.blocks]
        assert modes == [mode if blocks is None or i < blocks else "none" for i in range(n_layer)]
        assert {block.mlp.tile_size for block in module.model.blocks} == {tile}
        assert run(module.hparams["parallel"], gpu).run_plan == module.run_plan
    assert ("none", None, None) in taken and ("selective", None, 1) in taken and len(taken) >= 4
    assert any(c[0] == "full" for c in taken)
    # CPU: no lighter mode checked (at a length that fits the host, which a CPU run is checked against)
    assert run({"activation_checkpointing": "auto"}, seq_len=1 << 12).plan.activation_checkpointing == "full"
    assert "auto -> full (no GPU memory to check" in capsys.readouterr().out


def test_recompute_cost_counts_what_each_plan_runs_again():
    """``recomputed_flops_per_token``, by hand for the tiny shape (d 128, 4 heads of 32, 2 KV
    heads, MLP 352, 2 blocks): q/k/v 65,536, out 32,768, MLP 270,336 FLOPs a token a block;
    causal attention at 4,096 tokens 4 x 128 x 2,048; tiles add gate and up where
    shorter than the rank's tokens, but not the projections that end a tile (q/k/v, down_proj);
    a checkpoint's recompute skips down_proj, the block's last matmul; selective with tiles
    recomputes in the tiles only (o_proj joins them), full with tiles both; with documents the
    attention counts as none. (What the model really runs again:
    tests/model/test_tiled_mlp.py counts it.)"""
    from longctx.memory_fit import recomputed_flops_per_token

    cfg = GPTConfig.from_dict(dict(preset="tiny", vocab_size=256))
    qkv, out, mlp, attention = 65_536, 32_768, 270_336, 4 * 128 * 2048

    def cost(mode, tile=None, tokens=4096, documents=False):
        plan = ParallelPlan(activation_checkpointing=mode, mlp_tile_size=tile)
        return recomputed_flops_per_token(cfg, 4096, plan, tokens_per_rank=tokens, documents=documents)

    assert cost("none") == 0
    assert cost("none", 1024) == 2 * (mlp - mlp // 3)  # gate and up: q/k/v and down_proj end a tile
    assert cost("none", 4096) == 0  # one tile holds every token: nothing tiled
    down = mlp // 3  # the block's last matmul: a checkpoint's recompute stops before it
    assert cost("selective") == 2 * (qkv + out + mlp - down)
    assert cost("selective", 1024) == 2 * (out + mlp - down)
    assert cost("full") == 2 * (qkv + out + mlp - down + attention)
    assert cost("full", 1024) == 2 * (qkv + out + mlp + attention + out + mlp - down)
    assert cost("full", documents=True) == cost("selective")


def test_auto_checkpointing_is_decided_before_estimate_and_parallelize():
    """The memory model and ``parallelize`` take only a decided mode (one line each); for
    transformers' blocks (no selective mode) ``least_recompute`` goes from none to full."""
    from longctx import ParallelPlan, parallelize
    from longctx.memory import estimate
    from longctx.memory_fit import least_recompute
    from longctx.models import GPT, GPTConfig
    from longctx.parallel import ParallelDims

    cfg = GPTConfig.from_dict(dict(preset="llama3.2-1b"))
    auto = ParallelPlan(activation_checkpointing="auto")
    with pytest.raises(ValueError, match="decided activation_checkpointing"):
        estimate(cfg, 1 << 17, plan=auto)
    with pytest.raises(ValueError, match="decided before the model is built"):
        parallelize(GPT(GPTConfig.from_dict(dict(preset="tiny", vocab_size=64))), ParallelDims(), auto)
    kw = dict(cp=1, dp=1, data_parallel="fsdp", attention_kernel="fa4", hf_modules=True)
    none = estimate(cfg, 1 << 17, plan=ParallelPlan(), **kw).gpu_bytes
    room = math.ceil(none / (1 - LIGHTER_MODE_HEADROOM))
    picked = [least_recompute(cfg, 1 << 17, plan=auto, gpu_total=g, **kw) for g in (room, room - 2, none)]
    assert [p.activation_checkpointing for p in picked] == ["none", "full", "full"]  # none: only with headroom


def test_gradients_are_freed_right_after_the_optimizer_step(tmp_path):
    """The memory model counts no gradients in the forward: CausalLMModule frees them after
    each optimizer step (Lightning alone would keep them through the next step's forward),
    still accumulating across the micro-batches of one step; it logs each step's time."""
    import csv

    import torch
    from helpers.tiny_fit import cpu_trainer, tiny_batches, tiny_module
    from lightning.pytorch.loggers import CSVLogger

    from longctx.lightning.module import CausalLMModule

    class Recording(CausalLMModule):
        def training_step(self, batch, batch_idx):
            self.grads_at_forward.append(any(p.grad is not None for p in self.parameters()))
            return super().training_step(batch, batch_idx)

    module = tiny_module(Recording)
    module.grads_at_forward = []
    cpu_trainer(max_steps=2, accumulate_grad_batches=2, logger=CSVLogger(tmp_path), log_every_n_steps=1).fit(
        module, torch.utils.data.DataLoader(tiny_batches(4), batch_size=1)
    )
    assert module.grads_at_forward == [False, True, False, True]
    assert all(p.grad is None for p in module.parameters())
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    steps = [float(r["step_s"]) for r in rows if r.get("step_s")]
    assert len(steps) == 2 and all(s > 0 for s in steps)


def _saved_bytes(run, exclude) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs, less ``exclude``'s."""
    import torch

    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def test_one_layers_saved_tensors_are_the_models_count():
    """What one block saves for its backward (bf16 weights as FSDP2 gathers them, no
    checkpointing), measured on the CPU, against the model's per-layer term: our GPT's
    block exactly; transformers' Llama layer (``hf_modules``: its RMSNorms keep an fp32 copy
    of their input and the normalised tensor before the gain) exactly, less the bf16 block
    input, which it does not keep (the checkpoint of a "full" run does)."""
    import torch

    transformers = pytest.importorskip("transformers")
    import longctx.hf  # noqa: F401 - registers the longctx attention for transformers
    from longctx import parallelize
    from longctx.models import GPT
    from longctx.models.gpt import rope_cos_sin

    cfg = GPTConfig(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, head_dim=16)
    T = 256
    per_layer = {
        hf: estimate(
            cfg, T, plan=ParallelPlan(activation_checkpointing="none"), attention_kernel="triton", hf_modules=hf
        ).items["saved_block_inputs"]
        for hf in (False, True)
    }
    torch.manual_seed(0)
    x = torch.randn(1, T, cfg.n_embd, dtype=torch.bfloat16, requires_grad=True)

    gpt = parallelize(GPT(cfg), plan=ParallelPlan(attention_backend="torch")).to(torch.bfloat16)
    rope = rope_cos_sin(torch.arange(T)[None], cfg.head_dim, cfg.rope_theta)
    shared = {t.untyped_storage().data_ptr() for t in (*gpt.parameters(), *rope)}
    assert _saved_bytes(lambda: gpt.blocks[0](x, rope=rope), shared) == per_layer[False]

    hc = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="longctx_ring",
    )
    hf = transformers.LlamaForCausalLM(hc).to(torch.bfloat16)
    pos = torch.arange(T)[None]
    cos, sin = hf.model.rotary_emb(x, pos)
    shared = {t.untyped_storage().data_ptr() for t in (*hf.parameters(), cos, sin)}
    got = _saved_bytes(
        lambda: hf.model.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin)), shared
    )
    assert got == per_layer[True] - 2 * cfg.n_embd * T


def test_device_memory_full_commands_pass_train_checks_and_tabulate(tmp_path, monkeypatch):
    """Each train.py command of benchmarks/device/device_memory_full.sh (longctx.bench.memory_cases)
    passes train.py's checks (as the GPU machine would run it); each limit fits one device call
    (the default cases together); each run's config.yaml (as train.py writes it, the kernels
    resolved to FlashAttention-4) and a metrics.csv become a row of memory_full_table.py's JSON
    whose prediction is the model's, and ``recheck`` (memory_validate.py --recheck) reads that
    JSON back to the same numbers."""
    import json

    from helpers.train_script import load_train

    from longctx.bench.memory_cases import BUDGET_S, CALL_S, CASES, DEFAULT_CASES, RESERVE_S
    from longctx.bench.memory_recheck import recheck
    from longctx.bench.memory_runs import table_main

    train = load_train("train_memory_full")
    cases = {name: (limit, args.split()) for name, (limit, args) in CASES.items()}
    assert set(cases) == {"8b_128k", "8b_128k_auto", "hf_1b_128k", "1b_1m", "8b_512k"}
    assert BUDGET_S <= CALL_S and all(limit + RESERVE_S <= BUDGET_S for limit, _ in cases.values())
    assert sum(cases[name][0] for name in DEFAULT_CASES) + RESERVE_S <= BUDGET_S  # they share one call
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    for name, (_, args) in cases.items():
        run = tmp_path / "runs" / name / "run"
        argv = [a.replace("STEPS", "3") for a in args] + [
            "--output-dir",
            str(run),
            "--checkpoint-every",
            "0",
            "--trainer.enable_progress_bar",
            "false",
        ]
        assert train.prepare(argv, device_checks=False).trainer is None
        resolved = train.resolve_config(argv)
        resolved.config.model.parallel.attention_backend = "fa4"
        resolved.config.model.parallel.document_backend = "fa4"
        if resolved.config.model.parallel.activation_checkpointing == "auto":  # what an H200 decides
            resolved.config.model.parallel.activation_checkpointing = "selective"
        if resolved.config.model.parallel.fuse_pointwise is None:  # a GPU's default, as its config.yaml records it
            resolved.config.model.parallel.fuse_pointwise = True
        if resolved.config.trainer.precision is None:
            resolved.config.trainer.precision = "bf16-mixed"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(resolved.dump())
        (run.parent / "train.log").write_text("run plan: parallel(data_parallel=fsdp, cp=2, dp=1)\n")
        (run.parent / "rc").write_text("0\n")
    out = tmp_path / "memory_full.json"
    table_main([str(tmp_path / "runs"), "--out", str(out), "--cases", " ".join(cases)])
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert abs(rows["8b_128k"]["predicted_gpu"] / GiB - 79.37) < 0.01  # fused, FA4, CP 2, FSDP2 over 2
    assert rows["hf_1b_128k"]["hf_modules"] and rows["hf_1b_128k"]["model"]["n_layer"] == 16
    assert rows["8b_512k"]["attention"] == "document" and rows["8b_512k"]["seq_len"] == 512 * K
    assert {r["cp"] for r in rows.values()} == {2} and {r["attention_kernel"] for r in rows.values()} == {"fa4"}
    for name, r in rows.items():  # measured 5% under the predictions: step 1 (no AdamW states yet), then steady
        first_step_lacks = (r["predicted_gpu"] - r["predicted_first_step_gpu"]) / GiB
        assert abs(first_step_lacks - r["predicted_items"]["adamw_states"]) < 0.01  # AdamW's states, 8 B/param
        steps = 3 if "128k" in name else 1
        peaks = [0.95 * (r["predicted_first_step_gpu"] if i == 0 else r["predicted_gpu"]) / GiB for i in range(steps)]
        lines = ["step,peak_mem_gib,train_loss,tokens_per_s,mfu,step_s"]
        lines += [f"{i},{p},{10.0 - i},{1000.0 * (i + 1)},0.4,{2.0 + i}" for i, p in enumerate(peaks)]
        (tmp_path / "runs" / name / "run" / "metrics.csv").write_text("\n".join(lines) + "\n")
    table_main([str(tmp_path / "runs"), "--out", str(out), "--cases", " ".join(cases), "--readme"])
    rows = json.loads(out.read_text())["rows"]
    assert all(r["passed"] and r["loss_finite"] for r in rows)
    assert all(abs(ratio - 0.95) < 1e-6 for r in rows for ratio in r["ratios"].values())
    assert all(list(r["ratios"]) == (["step 1", "steady"] if "128k" in r["case"] else ["step 1"]) for r in rows)
    assert rows[0]["tokens_per_s"] == 3000.0 and len(rows[0]["measured_steps_gib"]) == 3
    again = {r["case"]: r for r in recheck(out, "fa4")}
    assert {name: again[name]["predicted"] for name in cases if "128k" in name} == {
        r["case"]: r["predicted_gpu"] for r in rows if "128k" in r["case"]
    }
    assert {name: again[f"{name} (step 1)"]["predicted"] for name in cases} == {
        r["case"]: r["predicted_first_step_gpu"] for r in rows
    }


def test_checkpointed_blocks_save_by_block():
    """``checkpointed_blocks=n``: at the loss backward (every block's saved tensors on the GPU)
    the prediction moves in equal steps from "none" (n = 0) to the mode on every block (n = L);
    the mode's own recompute transient shows only while a checkpointed block is differentiated."""
    config = GPTConfig.from_preset("llama3-8b", vocab_size=128256, max_seq_len=128 * K)
    kw = dict(cp=4, attention_kernel="fa4")

    def loss_phase(**plan):
        return estimate(config, 128 * K, plan=ParallelPlan(fuse_pointwise=True, **plan), **kw).phases[
            "the loss backward"
        ]

    L = config.n_layer
    none, selective = loss_phase(activation_checkpointing="none"), loss_phase(activation_checkpointing="selective")
    for n in (1, 8, 15, 31):
        mixed = loss_phase(activation_checkpointing="selective", checkpointed_blocks=n)
        assert abs(mixed * L - (selective * L + (L - n) * (none - selective))) <= 64 * L, n
    assert loss_phase(activation_checkpointing="selective", checkpointed_blocks=L) == selective
