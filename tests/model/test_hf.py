"""Hugging Face models on longctx attention (longctx.hf) and the GPT -> HF Llama export.

The sharded runs (one spawned group of 4 gloo processes, many cases): tiny random Llama,
Qwen2 (attention biases) and Mistral models with attn_implementation="longctx_ring" /
"longctx_ulysses", P = 1, 2, 4, both layouts, against the same weights under "sdpa" on
one process: logits (gathered) and every parameter gradient (summed over the group).
"""

from __future__ import annotations

import copy
import inspect
import json
import random
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers.run_if import requires_cuda

transformers = pytest.importorskip("transformers")

from helpers.dist_harness import run_distributed  # noqa: E402
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config  # noqa: E402

from longctx import (  # noqa: E402
    document_position_ids,
    position_ids,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from longctx.hf import RING, ULYSSES, set_context_parallel_group  # noqa: E402
from longctx.kernels import BACKENDS, backend_available  # noqa: E402
from longctx.models import GPT, GPTConfig, load_pretrained, save_hf_checkpoint  # noqa: E402

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
VOCAB, BATCH, SEQ = 97, 2, 32
LOGITS_TOL, GRAD_TOL = 1e-4, 1e-3
DOCUMENT_IDS = {
    RING: "document_ids" in inspect.signature(ring_attention).parameters,
    ULYSSES: "document_ids" in inspect.signature(ulysses_attention).parameters,
}


def tiny_config(arch: str, **overrides):
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        initializer_range=0.1,
        use_cache=False,
    )
    return CONFIGS[arch](**{**sizes, **overrides})


def model_pair(arch: str, implementation: str, seed: int = 0, **overrides):
    """(reference under sdpa, model under ``implementation``) with equal random weights."""
    torch.manual_seed(seed)
    # One config object each: from_config records the implementation on the config.
    reference = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("bias"):  # transformers zero-initialises biases: make Qwen2's count
                p.normal_(0.0, 0.1)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation=implementation)
    assert reference.config._attn_implementation == "sdpa"
    model.load_state_dict(reference.state_dict())
    return reference, model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def document_mask(docs: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) bool: causal and same document, the 4-D mask sdpa takes as is."""
    s = docs.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def reference_run(model, ids, weight, **kwargs):
    model.zero_grad()
    logits = model(input_ids=ids, **kwargs).logits
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def sharded_run(model, ids, weight, group, layout, docs=None, plan=False):
    """Each rank: its shard of ids/weights and positions (global ones; with documents, each
    document's own, as packed training uses them); logits gathered, grads summed. ``plan``:
    the documents as the step's DocumentPlan (as CausalLMModule passes them), not ids."""
    from longctx.documents import plan_documents

    world = dist.get_world_size(group)
    where = dict(rank=dist.get_rank(group), world_size=world, layout=layout)
    if docs is None:
        extra = {"position_ids": position_ids(SEQ, **where).unsqueeze(0)}
    else:
        extra = {
            "document_ids": plan_documents(docs, **where) if plan else shard_sequence(docs, 1, **where),
            "position_ids": shard_sequence(document_position_ids(docs), 1, **where),
        }
    set_context_parallel_group(model, group, layout=layout)
    model.zero_grad()
    logits = model(input_ids=shard_sequence(ids, 1, **where), **extra).logits
    (logits * shard_sequence(weight, 1, **where)).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)
        grads[name] = p.grad
    return unshard_sequence(logits.detach(), 1, group=group, layout=layout), grads


def compare(case, logits, grads, ref_logits, ref_grads) -> list:
    errors = [(case, "logits", rel_err(logits, ref_logits), LOGITS_TOL)]
    errors += [(case, name, rel_err(grads[name], g), GRAD_TOL) for name, g in ref_grads.items()]
    return [(case, what, err, tol) for case, what, err, tol in errors if not err < tol]


def _groups(rank: int, world: int):
    """For P = 1, 2, 4: the group of size P this rank belongs to (every rank creates all)."""
    out = {}
    for size in (1, 2, 4):
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                out[size] = group
    return out


def _sharded_equals_sdpa(rank, world, seed):
    groups = _groups(rank, world)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    weight = torch.randn(BATCH, SEQ, VOCAB, generator=g)
    # Three documents per row, boundaries differing between rows.
    docs = torch.stack([torch.bucketize(torch.arange(SEQ), torch.tensor(b)) for b in ([5, 20], [13, 14])])
    bad = []
    for arch in CONFIGS:
        for implementation in (RING, ULYSSES):
            reference, model = model_pair(arch, implementation, seed)
            ref = reference_run(reference, ids, weight)
            ref_docs = reference_run(
                reference, ids, weight, attention_mask=document_mask(docs), position_ids=document_position_ids(docs)
            )
            for size, group in groups.items():
                for layout in ("zigzag", "contiguous"):
                    case = (arch, implementation, size, layout)
                    bad += compare(case, *sharded_run(model, ids, weight, group, layout), *ref)
                    if DOCUMENT_IDS[implementation]:
                        for plan in (False, True):
                            out = sharded_run(model, ids, weight, group, layout, docs=docs, plan=plan)
                            bad += compare(case + ("document_ids", "plan" if plan else "ids"), *out, *ref_docs)
    # NaN in one token's embedding reaches exactly the logits it reaches under sdpa.
    reference, model = model_pair("llama", RING, seed)
    with torch.no_grad():
        for m in (reference, model):
            m.get_input_embeddings().weight[ids[0, 9]] = float("nan")
    ref_nan = reference(input_ids=ids).logits.isnan()
    logits, _ = sharded_run(model, ids, weight, groups[4], "zigzag")
    nan_ok = bool(ref_nan[0, 9:].all()) and torch.equal(logits.isnan(), ref_nan)
    return bad, nan_ok, _refusals(ids, weight, groups[2], seed)


def _error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def _refusals(ids, weight, group, seed) -> dict:
    """Errors at P = 2, where the shard alone would look fine, or only one rank's data is bad:
    every rank must raise (none left waiting in the ring)."""
    errors = {}
    # A window shorter than the global sequence (32) but not than the local shard (16).
    _, mistral = model_pair("mistral", RING, seed, sliding_window=24)
    errors["window"] = _error(sharded_run, mistral, ids, weight, group, "zigzag")
    _, model = model_pair("llama", RING, seed)
    set_context_parallel_group(model, group, layout="contiguous")
    rank = dist.get_rank(group)
    local = shard_sequence(ids, 1, rank=rank, world_size=2, layout="contiguous")
    # Forgotten position_ids: transformers' default arange is right on rank 0 only.
    errors["positions"] = _error(model, input_ids=local)
    # Padding in rank 1's shard only.
    mask = torch.ones_like(local)
    mask[0, 3] = 1 - rank
    positions = position_ids(SEQ, rank=rank, world_size=2, layout="contiguous")[None]
    errors["padding"] = _error(model, input_ids=local, position_ids=positions, attention_mask=mask)
    return errors


def test_sharded_hf_models_equal_sdpa():
    seed = random.randrange(1 << 30)  # fresh weights and inputs every run; printed on failure
    for rank, (bad, nan_ok, errors) in enumerate(run_distributed(_sharded_equals_sdpa, 4, seed)):
        assert not bad, f"seed {seed}, rank {rank}: " + "\n".join(
            f"{case} {what}: {err:.2e} (tol {tol})" for case, what, err, tol in bad
        )
        assert nan_ok, f"seed {seed}, rank {rank}: NaN did not propagate as under sdpa"
        assert (
            "MistralAttention in MistralForCausalLM: a sliding window of 24 tokens shorter than "
            "the sequence (32 tokens)" in (errors["window"] or "")
        ), errors
        group_rank = rank % 2
        own = {
            "positions": "not this rank's global positions (rank 1 of 2, layout 'contiguous'",
            "padding": "a padding attention_mask",
        }
        for what, message in own.items():
            expected = message if group_rank == 1 else "another rank of the context-parallel group"
            assert expected in (errors[what] or ""), (rank, what, errors[what])
            assert "LlamaForCausalLM" in errors[what]


# ---- plain attention (group None) and the clear errors --------------------------------------


def test_plain_attention_equals_sdpa_and_accepts_all_ones_mask():
    reference, model = model_pair("qwen2", RING)
    set_context_parallel_group(model, None)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    expected = reference(input_ids=ids).logits
    assert rel_err(model(input_ids=ids).logits, expected) < LOGITS_TOL
    ones = torch.ones(BATCH, SEQ, dtype=torch.long)
    assert rel_err(model(input_ids=ids, attention_mask=ones).logits, expected) < LOGITS_TOL
    # A window covering the whole sequence is full attention: accepted, and exact.
    reference, model = model_pair("mistral", RING, sliding_window=SEQ)
    assert rel_err(model(input_ids=ids).logits, reference(input_ids=ids).logits) < LOGITS_TOL


def _raises(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises((ValueError, NotImplementedError), match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


IDS = torch.arange(SEQ).remainder(VOCAB).expand(BATCH, SEQ)


@pytest.mark.parametrize(
    "name, overrides, call, match",
    [
        (
            "padding mask",
            {},
            dict(attention_mask=torch.ones(BATCH, SEQ).index_fill(1, torch.tensor([0]), 0)),
            "padding attention_mask",
        ),
        (
            "4-D mask",
            {},
            dict(attention_mask=torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).tril()),
            "custom 4-D attention_mask",
        ),
        ("output_attentions", {}, dict(output_attentions=True), "output_attentions=True"),
        ("position_bias", {}, dict(position_bias=torch.zeros(1, 8, SEQ, SEQ)), "additive attention bias"),
        ("packed positions", {}, dict(position_ids=torch.arange(SEQ).remainder(8)[None]), "not consecutive"),
        ("position gap", {}, dict(position_ids=torch.arange(SEQ).add(torch.arange(SEQ) >= 9)[None]), "not consecutive"),
        (
            "cu_seq_lens",
            {},
            dict(cu_seq_lens_q=torch.tensor([0, 16, 32]), cu_seq_lens_k=torch.tensor([0, 16, 32])),
            "cu_seq_lens_q",
        ),
        ("mistral window", dict(sliding_window=16), {}, "sliding window of 16 tokens"),
        (
            "qwen2 window",
            dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
            {},
            "sliding window of 8 tokens",
        ),
    ],
)
def test_forward_refuses(name, overrides, call, match):
    arch = "qwen2" if name.startswith("qwen2") else "mistral" if name.startswith("mistral") else "llama"
    _, model = model_pair(arch, RING, **overrides)
    set_context_parallel_group(model, None)
    message = _raises(match, model, input_ids=IDS, **call)
    assert type(model).__name__ in message and "longctx_ring" in message


def test_refuses_dropout_in_training_only():
    _, model = model_pair("llama", RING, attention_dropout=0.1)
    set_context_parallel_group(model, None)
    model.eval()
    model(input_ids=IDS)
    model.train()
    _raises(r"LlamaForCausalLM.*attention dropout \(0.1\) in training mode", model, input_ids=IDS)


def test_refuses_kv_cache():
    _, model = model_pair("llama", ULYSSES)
    set_context_parallel_group(model, None)
    past = model(input_ids=IDS[:, :16], use_cache=True).past_key_values
    _raises("KV cache", model, input_ids=IDS[:, 16:], past_key_values=past, use_cache=True)


def test_refuses_non_causal():
    _, model = model_pair("llama", RING)
    model.model.layers[1].self_attn.is_causal = False
    _raises("LlamaAttention in LlamaForCausalLM is not causal", set_context_parallel_group, model, None)
    _raises("non-causal", model, input_ids=IDS)  # never set up: the first forward says it
    _, model = model_pair("llama", RING)
    model.config.is_causal = False
    _raises("LlamaForCausalLM: config.is_causal=False", set_context_parallel_group, model, None)
    _raises("non-causal", model, input_ids=IDS)


def test_refuses_softcapping():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=RING)
    _raises("Gemma2ForCausalLM: attention logit soft-capping", set_context_parallel_group, model, None)
    _raises("soft-capping", model, input_ids=IDS)


def test_refuses_attention_sinks():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["full_attention"],
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=RING)
    _raises("GptOssForCausalLM has attention sinks", set_context_parallel_group, model, None)
    _raises("attention sinks", model, input_ids=IDS)


def test_refuses_other_implementations_and_layouts():
    reference, model = model_pair("llama", RING)
    _raises("LlamaForCausalLM runs attn_implementation='sdpa'", set_context_parallel_group, reference, None)
    _raises(
        "layout must be one of zigzag, contiguous, got 'zig'", set_context_parallel_group, model, None, layout="zig"
    )


@pytest.mark.skipif(DOCUMENT_IDS[RING], reason="ring_attention takes document_ids: tested sharded")
def test_document_ids_before_the_ring_supports_them():
    _, model = model_pair("llama", RING)
    _raises(
        "ring_attention in this longctx has no document_ids",
        model,
        input_ids=IDS,
        document_ids=torch.zeros(BATCH, SEQ, dtype=torch.long),
    )


def test_import_longctx_does_not_import_hf():
    code = (
        "import sys, longctx, longctx.models, longctx.kernels; "
        "print('longctx.hf' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout


@requires_cuda()
@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_gpu_bf16_as_close_as_sdpa(backend):
    """bf16 on one GPU through each kernel backend: logits and gradients as close to the fp32
    sdpa model as sdpa's own bf16 run (within 2x, or 1e-2)."""
    if backend != "auto" and not backend_available(backend, torch.device("cuda")):
        pytest.skip(f"backend {backend!r} not available here")
    reference, model = model_pair(
        "llama",
        RING,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.02,
    )
    reference_bf16 = copy.deepcopy(reference).to("cuda", torch.bfloat16)
    reference, model = reference.to("cuda"), model.to("cuda", torch.bfloat16)
    set_context_parallel_group(model, None, backend=backend)
    g = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    ids = torch.randint(0, VOCAB, (2, 1024), device="cuda", generator=g)
    weight = torch.randn(2, 1024, VOCAB, device="cuda", generator=g)
    exact_logits, exact_grads = reference_run(reference, ids, weight)
    logits, grads = reference_run(model, ids, weight)
    sdpa_logits, sdpa_grads = reference_run(reference_bf16, ids, weight)
    pairs = [("logits", logits, sdpa_logits, exact_logits)]
    pairs += [(name, grads[name], sdpa_grads[name], g) for name, g in exact_grads.items()]
    for name, ours, sdpa, exact in pairs:
        assert rel_err(ours, exact) <= max(2 * rel_err(sdpa, exact), 1e-2), name


# ---- export: GPT -> Hugging Face Llama directory ---------------------------------------------


@pytest.mark.parametrize(
    "tie, scaling", [(True, None), (False, {"type": "linear", "factor": 2.0}), (True, {"type": "ntk", "factor": 4.0})]
)
def test_export_loads_in_transformers_and_back(tmp_path, tie, scaling):
    torch.manual_seed(random.randrange(1 << 30))
    config = GPTConfig(
        vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        intermediate_size=96,
        rope_theta=5e4,
        rope_scaling=scaling,
        tie_embeddings=tie,
        init_std=0.1,
    )
    model = GPT(config).eval()
    save_hf_checkpoint(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["tie_word_embeddings"] is tie
    hf, info = LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    back = load_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (BATCH, 64))
    with torch.no_grad():
        expected = model(ids)
        assert rel_err(hf.eval()(input_ids=ids).logits, expected) < 1e-5
        assert rel_err(back(ids), expected) < 1e-6
    assert back.config.tie_embeddings is tie and back.config.n_kv_head == 2
