"""GPT model: context-parallel forward/backward equals one device, RoPE on zigzag shards,
chunked cross-entropy, block reuse, configs."""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers.dist_harness import run_distributed

from longctx import (
    CPContext,
    ParallelDims,
    ParallelPlan,
    document_position_ids,
    parallelize,
    position_ids,
    shard_sequence,
    unshard_sequence,
)
from longctx.models import (
    GPT,
    PRESETS,
    GPTConfig,
    TransformerBlock,
    apply_rope,
    chunked_cross_entropy,
    rope_cos_sin,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def small_config(**kw) -> GPTConfig:
    base = dict(
        vocab_size=96,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        intermediate_size=48,
        rope_theta=500.0,
        # Larger than a real init so attention (and RoPE) move the logits visibly.
        init_std=0.15,
    )
    base.update(kw)
    return GPTConfig(**base)


def small_plan(**kw) -> ParallelPlan:
    return ParallelPlan(**{"loss_chunk_size": 7, "attention_backend": "torch", **kw})


def make_batch(seq_len: int, vocab: int, seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    input_ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[torch.rand(labels.shape, generator=g) < 0.2] = -100  # ignored positions
    labels[0, -1] = -100
    return input_ids, labels


# ---- context parallel == single device ---------------------------------------------------


def _cp_worker(rank: int, world: int, seq_len: int) -> dict:
    """Per rank: CP forward/backward for several settings vs a float64 single-device reference."""
    cp = dist.new_group(list(range(world)))
    errors = {}
    for case, (layout, ckpt, explicit_pos, seed, documents) in {
        "zigzag": ("zigzag", "none", True, 1, False),
        "zigzag+checkpointing+default_pos": ("zigzag", "full", False, 2, False),
        "contiguous": ("contiguous", "none", True, 3, False),
        "zigzag+selective_checkpointing": ("zigzag", "selective", True, 4, False),
        # Packed documents crossing shard boundaries, RoPE restarting per document.
        "zigzag+documents": ("zigzag", "selective", True, 5, True),
    }.items():
        torch.manual_seed(seed)
        config = small_config()
        model = GPT(config)
        input_ids, labels = make_batch(seq_len, config.vocab_size, seed=100 + seed)

        docs = full_pos = None
        if documents:
            g = torch.Generator().manual_seed(seed)
            docs = torch.cumsum(torch.rand(input_ids.shape, generator=g) < 0.2, dim=1)  # ~5-token documents
            full_pos = document_position_ids(docs)

        # Reference: the whole sequence on one device, float64.
        ref = parallelize(copy.deepcopy(model).double(), plan=small_plan())
        ref_logits = ref(input_ids, full_pos, document_ids=docs)
        if documents:  # the mask matters here: without it the logits differ
            with torch.no_grad():
                assert rel_err(ref(input_ids, full_pos), ref_logits.detach()) > 1e-3
        ref_sum, ref_n = ref.loss(input_ids, labels, full_pos, docs)
        ref_sum.backward()

        # CP: this rank's shard, fp32.
        parallelize(model, ParallelDims(cp=CPContext(cp, layout)), small_plan(activation_checkpointing=ckpt))
        shard = dict(rank=rank, world_size=world, layout=layout)
        ids_l, lab_l = shard_sequence(input_ids, 1, **shard), shard_sequence(labels, 1, **shard)
        pos = position_ids(seq_len, **shard) if explicit_pos else None
        docs_l = None
        if documents:
            pos, docs_l = shard_sequence(full_pos, 1, **shard), shard_sequence(docs, 1, **shard)
        logits_l = model(ids_l, pos, document_ids=docs_l)
        loss_l, n_l = model.loss(ids_l, lab_l, pos, docs_l)
        loss_l.backward()
        assert loss_l.dtype == torch.float32 and n_l.dtype == torch.int64

        # Each rank holds part of the tokens: the sum-loss's gradient is the SUM of the
        # per-rank gradients; the loss sum and token count add up likewise.
        totals = torch.stack([loss_l.detach().double(), n_l.double()])
        dist.all_reduce(totals, group=cp)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=cp)
            grads[name] = g
        logits = unshard_sequence(logits_l.detach(), 1, group=cp, layout=layout)

        errors[f"{case}/logits"] = rel_err(logits, ref_logits.detach())
        errors[f"{case}/loss_sum"] = abs(totals[0].item() - ref_sum.item()) / abs(ref_sum.item())
        errors[f"{case}/n_tokens"] = abs(totals[1].item() - ref_n.item())
        ref_grads = dict(ref.named_parameters())
        errors[f"{case}/grad_max"] = max(rel_err(grads[k], ref_grads[k].grad) for k in grads)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_single_device(world):
    seq_len = 8 * world  # 4 tokens per zigzag chunk
    results = run_distributed(_cp_worker, world, seq_len)
    for rank, errors in enumerate(results):
        for key, err in errors.items():
            assert err <= 1e-5, f"P={world} rank {rank} {key}: relative error {err:.2e}"
    assert len(results[0]) == 20  # 5 cases x (logits, loss_sum, n_tokens, grad_max)


# ---- RoPE ----------------------------------------------------------------------------------


def _rope_reference(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """float64 RoPE as a complex rotation of the pairs (i, i + D/2)."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    angle = pos.double()[:, None] * inv_freq  # (S, D/2)
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_on_zigzag_shards_equals_rope_then_shard():
    torch.manual_seed(0)
    seq_len, d, theta = 48, 16, 10000.0
    x = torch.randn(2, seq_len, 3, d)
    pos = torch.arange(seq_len)
    cos, sin = rope_cos_sin(pos, d, theta)
    full = apply_rope(x, cos, sin)
    assert rel_err(full, _rope_reference(x, pos, theta)) < 1e-6
    for world in (2, 3, 4):
        for layout in ("zigzag", "contiguous"):
            for rank in range(world):
                s = dict(rank=rank, world_size=world, layout=layout)
                p_local = position_ids(seq_len, **s)
                c, sn = rope_cos_sin(p_local, d, theta)
                local = apply_rope(shard_sequence(x, 1, **s), c, sn)
                assert torch.equal(local, shard_sequence(full, 1, **s)), (world, layout, rank)
    # Batched (B, S) position ids (e.g. per-document resets) broadcast per sample.
    bpos = torch.stack([pos, pos.flip(0)])
    c, sn = rope_cos_sin(bpos, d, theta)
    assert torch.equal(apply_rope(x, c, sn)[1], apply_rope(x[1:], *rope_cos_sin(pos.flip(0), d, theta))[0])


def test_rope_scaling():
    torch.manual_seed(0)
    d, theta = 16, 10000.0
    x = torch.randn(1, 20, 2, d)
    pos = torch.arange(20) * 3
    # Linear: positions divided by the factor.
    lin = apply_rope(x, *rope_cos_sin(pos, d, theta, {"type": "linear", "factor": 4.0}))
    assert rel_err(lin, _rope_reference(x, pos / 4.0, theta)) < 1e-6
    # NTK: base theta * f ** (d / (d - 2)).
    ntk = apply_rope(x, *rope_cos_sin(pos, d, theta, {"type": "ntk", "factor": 8.0}))
    assert rel_err(ntk, _rope_reference(x, pos, theta * 8.0 ** (d / (d - 2)))) < 1e-6
    with pytest.raises(ValueError, match="rope_scaling"):
        GPTConfig(rope_scaling={"type": "yarn", "factor": 2.0})


# ---- chunked cross-entropy -------------------------------------------------------------------


def test_chunked_cross_entropy_equals_plain():
    torch.manual_seed(0)
    n_tok, dim, vocab = 23, 16, 50
    hidden = torch.randn(2, n_tok, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (2, n_tok))
    labels[0, :5] = -100
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = F.cross_entropy((h64 @ w64.T).reshape(-1, vocab), labels.reshape(-1), ignore_index=-100, reduction="sum")
    ref.backward()
    for chunk in (1, 5, 46, 1000):
        hidden.grad = weight.grad = None
        loss, n = chunked_cross_entropy(hidden, weight, labels, chunk)
        loss.backward()
        assert loss.dtype == torch.float32 and n.dtype == torch.int64 and n.item() == 41
        assert abs(loss.item() - ref.item()) / ref.item() < 1e-6, chunk
        assert rel_err(hidden.grad, h64.grad) < 1e-5 and rel_err(weight.grad, w64.grad) < 1e-5, chunk
    # All ignored: zero loss, zero tokens, zero (finite) gradients.
    loss, n = chunked_cross_entropy(hidden, weight, torch.full_like(labels, -100), 8)
    loss.backward()
    assert loss.item() == 0.0 and n.item() == 0 and torch.isfinite(hidden.grad).all()
    with pytest.raises(ValueError, match="labels shape"):
        chunked_cross_entropy(hidden, weight, labels[:, 1:], 8)


def test_chunked_cross_entropy_with_the_final_norm_inside_float64():
    """norm=(fn, weight, eps): the norm runs per chunk inside the loss; loss and every
    gradient (input, norm gain, head) equal to norm-then-plain-loss in float64, NaN shows."""
    from longctx.models.pointwise import lean_rms_norm

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 23, 16, dtype=torch.float64, generator=g, requires_grad=True)
    gain = (1 + 0.1 * torch.randn(16, dtype=torch.float64, generator=g)).requires_grad_()
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 23), generator=g)
    labels[1, 3:9] = -100
    h = lean_rms_norm(x, gain, 1e-5)
    ref = F.cross_entropy((h @ weight.T).reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")
    want = torch.autograd.grad(ref, (x, gain, weight))
    for chunk in (1, 7, 100):
        loss, n = chunked_cross_entropy(x, weight, labels, chunk, norm=(lean_rms_norm, gain, 1e-5))
        got = torch.autograd.grad(loss, (x, gain, weight))
        assert n.item() == 40 and torch.allclose(loss, ref, rtol=1e-13, atol=0)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-11, atol=1e-13), chunk
    bad = x.detach().clone()
    bad[0, 4, 2] = float("nan")
    loss, _ = chunked_cross_entropy(bad, weight, labels, 7, norm=(lean_rms_norm, gain, 1e-5))
    assert torch.isnan(loss)


def test_chunked_loss_keeps_no_full_logits():
    """The backward graph holds no (tokens x vocab) tensor: logits are recomputed per chunk."""
    torch.manual_seed(0)
    n_tok, dim, vocab, chunk = 64, 8, 512, 16
    hidden = torch.randn(1, n_tok, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (1, n_tok))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = chunked_cross_entropy(hidden, weight, labels, chunk)
    # Inputs (hidden slices, the weight, labels) are kept; no chunk of logits is.
    assert max(saved) < chunk * vocab, saved
    loss.backward()
    assert torch.isfinite(weight.grad).all()


# ---- model: loss path, block reuse, checkpointing -------------------------------------------


def test_loss_matches_logits_and_checkpointing_matches():
    torch.manual_seed(0)
    config = small_config()
    model = parallelize(GPT(config), plan=small_plan())
    input_ids, labels = make_batch(20, config.vocab_size, seed=5)
    logits = model(input_ids)
    assert logits.shape == (2, 20, config.vocab_size)
    plain = F.cross_entropy(
        logits.reshape(-1, config.vocab_size).double(), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    loss, n = model.loss(input_ids, labels)
    assert abs(loss.item() - plain.item()) / plain.item() < 1e-5
    assert n.item() == int((labels != -100).sum())
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model.set_activation_checkpointing("full")
    loss2, _ = model.loss(input_ids, labels)
    loss2.backward()
    for k, p in model.named_parameters():
        assert rel_err(p.grad, grads[k]) < 1e-6, k
    # Tied embeddings: the head is the embedding; untied adds one vocab x n_embd matrix.
    assert model.lm_head is None and model.num_params() == config.num_params()
    untied = GPT(small_config(tie_embeddings=False))
    assert untied.num_params() == untied.config.num_params() == config.num_params() + 96 * 32


def test_offloaded_activations_give_the_same_gradients():
    """offload_activations keeps what the backward needs in host memory: same loss and grads."""
    torch.manual_seed(0)
    model = GPT(small_config())
    offloaded = copy.deepcopy(model)
    parallelize(model, plan=small_plan(activation_checkpointing="full"))
    parallelize(offloaded, plan=small_plan(activation_checkpointing="full", offload_activations=True))
    input_ids, labels = make_batch(20, model.config.vocab_size, seed=9)
    for m in (model, offloaded):
        loss, _ = m.loss(input_ids, labels)
        loss.backward()
    for (k, a), b in zip(model.named_parameters(), offloaded.parameters()):
        assert torch.equal(a.grad, b.grad), k
    assert offloaded.offload_activations and not model.offload_activations


def test_selective_checkpointing_runs_the_ring_once(monkeypatch):
    """'selective' keeps attention's inputs/output: same loss and grads as no checkpointing,
    one ring call per layer per step (full checkpointing re-runs it in the backward)."""
    import longctx.parallel as parallel_module

    calls = []
    real = parallel_module.ring_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(parallel_module, "ring_attention", counting)
    torch.manual_seed(0)
    model = parallelize(GPT(small_config()), plan=small_plan())
    input_ids, labels = make_batch(20, model.config.vocab_size, seed=7)
    results = {}
    for mode in ("none", "selective", "full"):
        model.zero_grad()
        model.set_activation_checkpointing(mode)
        calls.clear()
        loss, _ = model.loss(input_ids, labels)
        loss.backward()
        results[mode] = (loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}, len(calls))
    n_layer = model.config.n_layer
    assert [results[m][2] for m in ("none", "selective", "full")] == [n_layer, n_layer, 2 * n_layer]
    for mode in ("selective", "full"):
        assert abs(results[mode][0] - results["none"][0]) <= 1e-6 * abs(results["none"][0])
        for k, g in results["none"][1].items():
            assert rel_err(results[mode][1][k], g) < 1e-6, (mode, k)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        ParallelPlan(activation_checkpointing="sometimes")
    with pytest.raises(ValueError, match="activation_checkpointing"):  # the mode's name, as on the CLI
        ParallelPlan(activation_checkpointing=True)
    # How a model runs is not its architecture: GPTConfig refuses the old runtime keys.
    with pytest.raises(ValueError, match="ParallelPlan"):
        GPTConfig.from_preset("tiny", activation_checkpointing="full")


def test_checkpointed_blocks_checkpoint_the_first_blocks_only(monkeypatch):
    """``checkpointed_blocks=n``: the first n blocks run the plan's mode, the later ones keep
    everything; float64, the same loss and grads as no checkpointing, and full's second ring
    call in the first n blocks only. Bad values are one line each."""
    import longctx.parallel as parallel_module

    calls = []
    real = parallel_module.ring_attention
    monkeypatch.setattr(parallel_module, "ring_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    config = small_config(n_layer=3)
    model = GPT(config).double()
    input_ids, labels = make_batch(20, config.vocab_size, seed=8)
    results = {}
    for mode, blocks in (("none", None), ("full", 1), ("full", 2), ("selective", 2)):
        torch.manual_seed(0)
        plan = small_plan(activation_checkpointing=mode, checkpointed_blocks=blocks)
        m = parallelize(copy.deepcopy(model), plan=plan)
        assert [b.activation_checkpointing for b in m.blocks] == [
            mode if blocks is None or i < blocks else "none" for i in range(3)
        ]
        calls.clear()
        loss, _ = m.loss(input_ids, labels)
        loss.backward()
        results[(mode, blocks)] = (loss.detach(), {k: p.grad for k, p in m.named_parameters()}, len(calls))
    base_loss, base_grads, _ = results[("none", None)]
    assert [results[k][2] for k in results] == [3, 4, 5, 3]
    for key, (loss, grads, _) in results.items():
        assert torch.allclose(loss, base_loss, rtol=1e-12, atol=0), key
        for k, g in base_grads.items():
            assert torch.allclose(grads[k], g, rtol=1e-10, atol=1e-13), (key, k)
    for bad, match in (
        (dict(activation_checkpointing="none", checkpointed_blocks=2), "needs activation_checkpointing"),
        (dict(activation_checkpointing="auto", checkpointed_blocks=2), "'auto' chooses the count itself"),
        (dict(activation_checkpointing="full", checkpointed_blocks=-1), "integer >= 0"),
        (dict(activation_checkpointing="full", checkpointed_blocks=True), "integer >= 0"),
        (dict(activation_checkpointing="full", checkpointed_blocks=2, offload_activations=1), "offload_activations"),
    ):
        with pytest.raises(ValueError, match=match) as refused:
            ParallelPlan(**bad)
        assert str(refused.value).startswith("checkpointed_blocks ") and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"checkpointed_blocks must be an integer in \[0, 3\]"):
        parallelize(GPT(config), plan=small_plan(activation_checkpointing="full", checkpointed_blocks=4))


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        pytest.param(
            "inductor",
            marks=pytest.mark.skipif(
                shutil.which("g++") is None and shutil.which("c++") is None,
                reason="inductor on CPU needs a C++ compiler",
            ),
        ),
    ],
)
def test_pointwise_fusion_matches_eager(monkeypatch, backend):
    """fuse_pointwise routes RMSNorm/RoPE/SwiGLU through torch.compile: same loss and grads,
    with activation checkpointing too (the compiled functions are re-run in the recompute)."""
    import longctx.models.pointwise as pointwise

    monkeypatch.setattr(pointwise, "COMPILE_BACKEND", backend)
    torch.manual_seed(0)
    model = parallelize(GPT(small_config()), plan=small_plan())
    fused_model = GPT(small_config())
    fused_model.load_state_dict(model.state_dict())
    parallelize(fused_model, plan=small_plan(fuse_pointwise=True, activation_checkpointing="full"))
    assert all(m.fuse_pointwise for m in fused_model.modules() if hasattr(m, "fuse_pointwise"))
    input_ids, labels = make_batch(20, model.config.vocab_size, seed=11)
    results = []
    for m in (model, fused_model):
        loss, _ = m.loss(input_ids, labels)
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.isfinite(l1) and abs(l1.item() - l0.item()) <= 1e-5 * abs(l0.item())
    for k in g0:
        assert rel_err(g1[k], g0[k]) < 1e-5, k


def test_pointwise_fusion_failure_names_the_setting(monkeypatch):
    import longctx.models.pointwise as pointwise

    def broken_backend(graph_module, example_inputs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(pointwise, "COMPILE_BACKEND", broken_backend)
    model = parallelize(GPT(small_config()), plan=small_plan(fuse_pointwise=True))
    input_ids, labels = make_batch(8, model.config.vocab_size, seed=3)
    with pytest.raises(RuntimeError, match="fuse_pointwise: false"):
        model.loss(input_ids, labels)


class _TaggerWithBlocks(nn.Module):
    """Someone else's model that reuses the block (no GPT, no Lightning, no process group)."""

    def __init__(self, config: GPTConfig, n_classes: int):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList([TransformerBlock(config), TransformerBlock(config)])
        self.head = nn.Linear(config.n_embd, n_classes)

    def forward(self, ids, pos=None):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x, pos)
        return self.head(x)


def test_block_reuse_in_plain_module():
    torch.manual_seed(0)
    config = small_config()
    tagger = _TaggerWithBlocks(config, n_classes=5)
    ids = torch.randint(0, config.vocab_size, (3, 12))
    out = tagger(ids)
    assert out.shape == (3, 12, 5)
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in tagger.parameters())
    # Causal: changing a later token leaves earlier outputs unchanged, and changes later ones.
    ids2 = ids.clone()
    ids2[:, 8] = (ids2[:, 8] + 1) % config.vocab_size
    with torch.no_grad():
        a, b = tagger(ids), tagger(ids2)
    assert torch.equal(a[:, :8], b[:, :8]) and not torch.allclose(a[:, 8:], b[:, 8:])
    # parallelize hands the CP context to the blocks' attention inside any module.
    parallelize(tagger, ParallelDims(cp=CPContext(None, "contiguous")))
    assert all(b.attn.core.cp.layout == "contiguous" for b in tagger.blocks)
    with pytest.raises(ValueError, match="layout"):
        CPContext(None, "spiral")
    with pytest.raises(RuntimeError, match="already parallelized"):
        parallelize(tagger)


def test_model_input_errors():
    model = GPT(small_config())
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.zeros(1, 6, dtype=torch.long), torch.arange(5))
    with pytest.raises(TypeError, match="position_ids must be integers"):
        model(torch.zeros(1, 6, dtype=torch.long), torch.full((6,), float("nan")))
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT({"n_layer": 2})


# ---- config ---------------------------------------------------------------------------------


def test_presets_and_param_counts():
    expected_millions = {
        "tiny": (0.5, 2),
        "gpt-125m": (115, 135),
        "gpt-350m": (330, 380),
        "gpt-1b": (950, 1250),
        "smollm2-135m": (134.4, 134.6),
        "llama3.2-1b": (1235, 1236),
        "llama3.2-3b": (3212, 3213),
        "llama3-8b": (8030, 8031),
    }
    assert set(expected_millions) == set(PRESETS)
    for name, (lo, hi) in expected_millions.items():
        c = GPTConfig.from_preset(name)
        assert lo <= c.num_params() / 1e6 <= hi, (name, c.num_params())
        n_matmul = c.num_params() - c.n_embd * (2 * c.n_layer + 1)  # minus norms
        if not c.tie_embeddings:
            n_matmul -= c.vocab_size * c.n_embd  # the embedding lookup is no matmul
        assert c.flops_per_token(1024, causal=False) == 6 * n_matmul + 12 * c.n_layer * c.q_dim * 1024
        assert c.flops_per_token(1024) < c.flops_per_token(1024, causal=False)
        # Packed documents: the attention term follows the keys a query sees on average.
        assert c.flops_per_token(1024, keys_per_token=512) == c.flops_per_token(1024)
        assert c.flops_per_token(1024, keys_per_token=64) == 6 * n_matmul + 12 * c.n_layer * c.q_dim * 64
    s = GPTConfig.from_preset("smollm2-135m")
    assert (s.n_layer, s.n_embd, s.n_head, s.n_kv_head, s.head_dim, s.intermediate_size) == (30, 576, 9, 3, 64, 1536)
    assert (s.vocab_size, s.rope_theta, s.tie_embeddings, s.rms_norm_eps) == (49152, 1e5, True, 1e-5)
    tiny = GPTConfig.from_preset("tiny")
    assert GPT(tiny).num_params() == tiny.num_params()
    # from_dict: preset + overrides; round trip; unknown keys and presets are named.
    c = GPTConfig.from_dict({"preset": "tiny", "rope_theta": 1e6, "n_layer": 3})
    assert c.rope_theta == 1e6 and c.n_layer == 3 and c.n_embd == tiny.n_embd
    assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig.from_dict({"preset": "tiny", "n_layers": 3})
    with pytest.raises(ValueError, match="unknown model preset"):
        GPTConfig.from_preset("gpt-7t")
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    assert math.isclose(GPTConfig(n_embd=30, n_head=3, n_kv_head=1).head_dim, 10)


def _rope_dtype_under_fsdp(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import DeviceMesh

    torch.manual_seed(0)
    model = GPT(small_config())
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    parallelize(model, ParallelDims(data_parallel="fsdp", fsdp_mesh=mesh, param_dtype=torch.bfloat16), small_plan())
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a, kw: seen.append(kw["rope"][0].dtype), with_kwargs=True)
    model(torch.zeros(1, 8, dtype=torch.long))
    return str(seen[0])


def test_fsdp_bf16_keeps_rope_tables_fp32():
    """FSDP2 mixed precision computes in bf16 but must not round the RoPE tables it passes on."""
    assert run_distributed(_rope_dtype_under_fsdp, 1) == ["torch.float32"]


def _untied_embedding_under_fsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    reference = GPT(small_config(tie_embeddings=False)).double()
    model = copy.deepcopy(reference)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    parallelize(model, ParallelDims(data_parallel="fsdp", fsdp_mesh=mesh), small_plan(loss_chunk_size=5))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 12), generator=g)
    labels = torch.randint(0, 96, (2, 12), generator=g)
    # While the blocks run backward the embedding is sharded again (a DTensor); the head is
    # the root's, unsharded.
    during_blocks = []

    def look(grad):
        during_blocks.append([isinstance(m.weight, DTensor) for m in (model.embed, model.lm_head)])

    model.blocks[1].register_forward_hook(
        lambda m, a, out: (out.register_hook(look) if out.requires_grad else None) and None
    )
    loss, n = model(ids, labels=labels)
    (loss / n).backward()
    ref_loss, ref_n = reference(ids, labels=labels)
    (ref_loss / ref_n).backward()
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    err = max(((grads[k] - p.grad).norm() / p.grad.norm()).item() for k, p in reference.named_parameters())
    tied = parallelize(GPT(small_config()), ParallelDims(data_parallel="fsdp", fsdp_mesh=mesh), small_plan())
    return {
        "units": [isinstance(m, FSDPModule) for m in (model.embed, model.lm_head, tied.embed)],
        "during_blocks": during_blocks,
        "loss_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
        "grad_err": err,
    }


@pytest.mark.slow
def test_fsdp_shards_an_untied_embedding_as_a_unit_of_its_own():
    """FSDP2 gives an untied embedding a unit of its own, so the unsharded (vocab x n_embd)
    table does not live through the blocks' backward; training is unchanged (float64,
    against the same model unsharded). A tied one stays with the root (it is the head)."""
    for out in run_distributed(_untied_embedding_under_fsdp, 2):
        assert out["units"] == [True, False, False]
        assert out["during_blocks"] == [[True, False]], out["during_blocks"]
        assert out["loss_err"] < 1e-12 and out["grad_err"] < 1e-10, out


def test_only_an_untied_embedding_gets_a_unit_of_its_own():
    from longctx.parallel import _untied_embedding

    untied, tied = GPT(small_config(tie_embeddings=False)), GPT(small_config())
    assert _untied_embedding(untied) is untied.embed
    assert _untied_embedding(tied) is None

    class NoEmbeddings(nn.Module):  # transformers' base class raises for models without one
        def get_input_embeddings(self):
            raise NotImplementedError

        def get_output_embeddings(self):
            return nn.Linear(2, 3)

    assert _untied_embedding(NoEmbeddings()) is None and _untied_embedding(nn.Linear(2, 2)) is None


def test_init_is_seeded_scaled_and_independent_of_threads():
    """The host init draws each matrix from its own generator on a thread pool: the seed still
    fixes every value, whatever the thread count, and the GPT-2 scales hold."""
    config = small_config(n_layer=4, n_embd=64, intermediate_size=128, init_std=0.02)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(3)
        one = GPT(config)
        torch.set_num_threads(max(2, threads))
        torch.manual_seed(3)
        many = GPT(config)
    finally:
        torch.set_num_threads(threads)
    for (name, a), b in zip(one.named_parameters(), many.parameters()):
        assert torch.equal(a, b), name
    torch.manual_seed(4)
    other = GPT(config)
    assert not torch.equal(other.embed.weight, one.embed.weight)
    params = dict(one.named_parameters())
    # distinct matrices get distinct draws (one generator each, not one seed reused)
    assert not torch.equal(params["blocks.0.attn.q_proj.weight"], params["blocks.1.attn.q_proj.weight"])
    assert torch.equal(params["blocks.0.attn_norm.weight"], torch.ones(64))
    for name, p in params.items():
        if p.dim() == 2:
            want = 0.02 / math.sqrt(8) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            assert abs(p.std().item() / want - 1) < 0.05, (name, p.std().item(), want)
            assert abs(p.mean().item()) < 0.1 * want, name


def test_model_built_under_meta_device_stays_meta():
    """``with torch.device("meta")`` builds a shape-only model (no host memory, no init)."""
    with torch.device("meta"):
        model = GPT(small_config())
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == small_config().num_params()
