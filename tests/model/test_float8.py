"""FP8 training as an option of the plan (``ParallelPlan(float8=True)``, ``longctx.float8``).

Without torchao (CI does not install it): the refusals (no sm89+ GPU, no torchao: one line
each), the memory model's extra term, the run plan's line and config entries. With torchao
(``pip install 'longctx[float8]'``; skipped otherwise): the conversion touches exactly the block
projections and MLP linears, state dicts keep the keys, shapes and dtypes of the plain model
and load both ways, and under FSDP2 with float8 all-gather (gloo, two CPU ranks) a training
step runs and the full state dict is the plain one. torch's CPU ``_scaled_mm`` runs the FP8
matmuls here; speed and the GPU kernels are not tested (no GPU).
"""

from __future__ import annotations

import pytest
import torch
from helpers.dist_harness import run_distributed

from longctx import ParallelPlan, parallelize
from longctx.validation import ArgumentValueError

PROJECTIONS = {
    "attn.q_proj",
    "attn.k_proj",
    "attn.v_proj",
    "attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
}


def _tiny(**kw):
    from longctx.models import GPTConfig

    return GPTConfig.from_dict(dict(preset="tiny", vocab_size=256, **kw))  # every projection a multiple of 16


def test_float8_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    """A CPU, a GPU below sm89, or no torchao: ``check_device`` says which, in one line naming
    the option (and the extra to install)."""
    import longctx.float8 as float8

    plan = ParallelPlan(float8=True)
    ParallelPlan().check_device("cpu")  # off: nothing to refuse
    with pytest.raises(ArgumentValueError, match=r"^parallel\.float8 cannot run on cpu: FP8 training needs an sm89\+"):
        plan.check_device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ArgumentValueError, match=r"sm89\+ GPU .*A100-SXM4-80GB is sm80$"):
        plan.check_device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(float8, "torchao_installed", lambda: False)
    with pytest.raises(ArgumentValueError) as refused:
        plan.check_device("cuda")
    assert str(refused.value).endswith("FP8 training needs torchao: pip install 'longctx[float8]'")
    assert "\n" not in str(refused.value)
    with pytest.raises(ImportError, match=r"pip install 'longctx\[float8\]'"):
        parallelize(_model(), plan=ParallelPlan(float8=True, attention_backend="torch"))
    monkeypatch.setattr(float8, "torchao_installed", lambda: True)
    plan.check_device("cuda")  # sm90 with torchao: runs
    with pytest.raises(ArgumentValueError, match="float8 must be true or false"):
        ParallelPlan(float8="yes")


def _model(seed: int = 0, **kw):
    from longctx.models import GPT

    torch.manual_seed(seed)
    return GPT(_tiny(**kw))


def test_memory_model_counts_the_casts_and_the_plan_names_float8(monkeypatch):
    """FP8 keeps the saved tensors (torchao saves the bf16 input, as a bf16 linear does) and adds
    the casts' transients to the layer's backward (``float8_casts``, the MLP's width untiled,
    o_proj's only when tiled); the run plan prints float8 and its config entries hold it, and a
    tiled run says its tiles run in bf16."""
    import longctx.float8 as float8
    from longctx.memory import estimate, float8_cast_bytes, model_shape
    from longctx.models import GPTConfig
    from longctx.run_plan import World, resolve_run

    cfg = GPTConfig.from_preset("llama3-8b")
    kw = dict(cp=4, dp=1, data_parallel="fsdp", attention_kernel="fa4")
    layer_moments = ("the last layer's backward", "the first layer's backward")
    for tile in (None, 8192):
        bf16 = estimate(cfg, 128 * 1024, plan=ParallelPlan("selective", True, mlp_tile_size=tile), **kw)
        fp8 = estimate(cfg, 128 * 1024, plan=ParallelPlan("selective", True, mlp_tile_size=tile, float8=True), **kw)
        T, F, d = 32 * 1024, cfg.intermediate_size, cfg.n_embd
        casts = float8_cast_bytes(model_shape(cfg), T, tiled=tile is not None)
        assert casts >= 2 * T * (d if tile else F)  # two 1-byte copies of T x width
        for moment in layer_moments:  # the casts join each layer moment; nothing else changes
            assert fp8.phases[moment] - bf16.phases[moment] == casts
        assert {k: v for k, v in fp8.phases.items() if k not in layer_moments} == {
            k: v for k, v in bf16.phases.items() if k not in layer_moments
        }
        assert fp8.gpu_bytes >= bf16.gpu_bytes
    untiled = float8_cast_bytes(model_shape(cfg), 32 * 1024, tiled=False)
    assert untiled > float8_cast_bytes(model_shape(cfg), 32 * 1024, tiled=True)
    monkeypatch.setattr(float8, "float8_refusal", lambda device: None)  # as on an sm90 GPU with torchao
    world = World(cp=4, dp=1, data_parallel="fsdp", local_ranks=4)
    run_kw = dict(precision="bf16-mixed", seq_len=128 * 1024, batch_size=1, documents=False, host_total=2**40)
    run = resolve_run(
        cfg, world, "cuda", requested={"float8": True, "attention_backend": "torch"}, gpu_total=2**40, **run_kw
    )
    assert run.parallel.float8 and "float8=True" in run.line()
    assert run.config_entries()["model.parallel"]["float8"] is True and run.model.float8
    tiled = resolve_run(
        cfg,
        world,
        "cuda",
        requested={"float8": True, "attention_backend": "torch", "mlp_tile_size": 8192},
        gpu_total=2**40,
        **run_kw,
    )
    assert any("run in bf16; only o_proj runs in FP8" in note for note in tiled.notes)


def _needs_torchao():
    from longctx.float8 import torchao_installed

    return pytest.mark.skipif(not torchao_installed(), reason="needs torchao (pip install 'longctx[float8]')")


@_needs_torchao()
def test_conversion_touches_the_projections_only_and_checkpoints_load_both_ways():
    """Exactly the q/k/v/o and gate/up/down linears of every block become torchao's
    Float8Linear (not the embedding, the tied head, the norms, the attention core); the state
    dict keeps every key, shape and dtype, loads into the plain model and back (strict), and
    the FP8 loss is close to the bf16 one (CPU ``_scaled_mm``)."""
    from longctx.float8 import float8_modules

    plain, fp8 = _model(), _model()
    parallelize(plain, plan=ParallelPlan(attention_backend="torch"))
    parallelize(fp8, plan=ParallelPlan(float8=True, attention_backend="torch"))
    converted = float8_modules(fp8)
    assert {name.split(".", 2)[2] for name in converted} == PROJECTIONS and len(converted) == 7 * fp8.config.n_layer
    assert not float8_modules(plain)
    a, b = plain.state_dict(), fp8.state_dict()
    assert list(a) == list(b)
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    fresh_plain, fresh_fp8 = _model(seed=1), _model(seed=1)
    parallelize(fresh_fp8, plan=ParallelPlan(float8=True, attention_backend="torch"))
    fresh_plain.load_state_dict(b, strict=True)  # an FP8 run's checkpoint, loaded without FP8
    fresh_fp8.load_state_dict(a, strict=True)  # and a bf16 run's, with FP8
    assert all(torch.equal(v, fresh_fp8.state_dict()[k]) for k, v in a.items())
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (plain, fp8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_sum, n = model(ids, labels=ids)
        (loss_sum / n).backward()
        losses.append((loss_sum / n).item())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert abs(losses[1] - losses[0]) < 0.01 * losses[0], losses


def _fsdp_float8_worker(rank: int, world_size: int):
    """One sequence with documents over a CP group of both ranks, FSDP2 over the same two
    (the dp x cp world), selective checkpointing: bf16 and FP8."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from longctx import CPContext, document_position_ids, shard_sequence
    from longctx.float8 import after_optimizer_step, float8_modules
    from longctx.parallel import ParallelDims

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, 129), generator=g)
    docs = torch.cumsum(torch.rand(1, 128, generator=g) < 0.05, dim=1)  # ~20-token documents
    shard = dict(rank=rank, world_size=world_size, layout="zigzag")
    ids, labels, pos, docs = (
        shard_sequence(t, 1, **shard) for t in (tokens[:, :-1], tokens[:, 1:], document_position_ids(docs), docs)
    )
    out = {}
    for float8 in (False, True):
        model = _model()
        dims = ParallelDims(
            cp=CPContext(dist.group.WORLD), data_parallel="fsdp", fsdp_mesh=mesh, param_dtype=torch.bfloat16
        )
        plan = ParallelPlan(float8=float8, attention_backend="torch", activation_checkpointing="selective")
        parallelize(model, dims, plan)
        weight = model.blocks[0].mlp.up_proj.weight.to_local()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(2):
            loss_sum, n = model.loss(ids, labels, pos, docs)
            loss_sum.backward()
            optimizer.step()
            optimizer.zero_grad()
            after_optimizer_step(model)  # the weights' scales in one all-reduce (float8 all-gather)
            total = torch.stack([loss_sum.detach().float(), n.float()])
            dist.all_reduce(total)
            losses.append((total[0] / total[1]).item())
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out[float8] = dict(
            losses=losses,
            converted=len(float8_modules(model)),
            weight_type=type(weight).__name__,
            state={k: (tuple(v.shape), v.dtype, type(v).__name__) for k, v in state.items()},
        )
        if rank == 0:  # the full state dict (on rank 0) loads into a plain, unsharded GPT
            _model(seed=1).load_state_dict(state, strict=True)
    return out


@pytest.mark.slow
@_needs_torchao()
def test_fsdp2_float8_all_gather_trains_and_saves_the_plain_state_dict():
    """FSDP2 over two gloo ranks with float8 all-gather (torchao's weight wrapper under the
    DTensor shards), the same ranks a CP group running ring attention over packed documents,
    selective checkpointing: two optimizer steps with the scales precomputed after each, losses
    close to the bf16 run's, and the full state dict has the plain model's keys, shapes and
    dtypes (plain tensors) and loads into a plain GPT."""
    results = run_distributed(_fsdp_float8_worker, 2)
    for rank in results:
        plain, fp8 = rank[False], rank[True]
        assert plain["converted"] == 0 and fp8["converted"] == 7 * _tiny().n_layer
        assert fp8["weight_type"] == "WeightWithDynamicFloat8CastTensor"
        assert fp8["state"] == plain["state"]
        assert all(abs(a - b) < 0.02 * a for a, b in zip(plain["losses"], fp8["losses"])), (plain, fp8)
    assert len(results[0][True]["state"]) == len(_model().state_dict())  # rank 0 holds the full one


@_needs_torchao()
def test_a_hugging_face_llama_converts_the_same_linears(tmp_path):
    """transformers' Llama blocks name their linears as GPT's do: the same seven per layer
    convert, the LM head does not, and the state dict keeps its keys and dtypes."""
    transformers = pytest.importorskip("transformers")
    from longctx.float8 import float8_modules
    from longctx.models.hf_lm import HFCausalLM

    transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path)
    plain, fp8 = HFCausalLM.from_pretrained(str(tmp_path)), HFCausalLM.from_pretrained(str(tmp_path))
    before = {k: (v.shape, v.dtype) for k, v in fp8.state_dict().items()}
    parallelize(fp8, plan=ParallelPlan(float8=True, attention_backend="torch"))
    converted = float8_modules(fp8)
    assert len(converted) == 7 * 2 and not any("lm_head" in name for name in converted)
    assert {k: (v.shape, v.dtype) for k, v in fp8.state_dict().items()} == before
    plain.load_state_dict(fp8.state_dict(), strict=True)
