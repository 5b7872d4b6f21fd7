"""Sequence-tiled MLP (ParallelPlan.mlp_tile_size), the norm before it inside the same tiles:
exact in float64, with and without activation checkpointing, sequence lengths that are not a
multiple of the tile, with pointwise fusion; the full-length normalised tensor is not saved;
the argument is validated."""

from __future__ import annotations

import copy

import pytest
import torch

from longctx import ParallelPlan, parallelize
from longctx.models import GPT, GPTConfig, TransformerBlock, rope_cos_sin
from longctx.tiled import tiled_apply


def _config(**kw) -> GPTConfig:
    base = dict(
        vocab_size=96,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        intermediate_size=48,
        rope_theta=500.0,
        init_std=0.15,
    )
    base.update(kw)
    return GPTConfig(**base)


def _batch(seq_len: int, vocab: int, seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
    return tokens[:, :-1], labels


def _loss_and_grads(model, ids, labels):
    loss, _ = model.loss(ids, labels)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("seq_len,tile", [(24, 8), (23, 5), (9, 64)])
def test_tiled_mlp_equals_untiled_float64(checkpointing, seq_len, tile):
    torch.manual_seed(0)
    model = GPT(_config()).double()
    tiled = copy.deepcopy(model)
    plan = dict(
        loss_chunk_size=7, attention_backend="torch", activation_checkpointing=checkpointing, fuse_pointwise=False
    )
    parallelize(model, plan=ParallelPlan(**plan))
    parallelize(tiled, plan=ParallelPlan(**plan, mlp_tile_size=tile))
    assert all(b.mlp.tile_size == tile for b in tiled.blocks)
    ids, labels = _batch(seq_len, 96, seed=3)
    ref_loss, ref = _loss_and_grads(model, ids, labels)
    loss, got = _loss_and_grads(tiled, ids, labels)
    assert torch.allclose(loss, ref_loss, rtol=1e-13, atol=0)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-11, atol=1e-14), k
    # Inference (no autograd) through the same tiles: equal logits.
    with torch.no_grad():
        assert torch.allclose(tiled(ids), model(ids), rtol=1e-13, atol=1e-14)


def test_tiled_mlp_with_pointwise_fusion(monkeypatch):
    """fuse_pointwise: the tiles run the compiled norm and gate, same loss and grads as untiled."""
    import longctx.models.pointwise as pointwise

    monkeypatch.setattr(pointwise, "COMPILE_BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = GPT(_config()).double()
    tiled = copy.deepcopy(model)
    plan = dict(loss_chunk_size=7, attention_backend="torch", fuse_pointwise=True)
    parallelize(model, plan=ParallelPlan(**plan))
    parallelize(tiled, plan=ParallelPlan(**plan, mlp_tile_size=5))
    ids, labels = _batch(23, 96, seed=4)
    ref_loss, ref = _loss_and_grads(model, ids, labels)
    loss, got = _loss_and_grads(tiled, ids, labels)
    assert torch.allclose(loss, ref_loss, rtol=1e-13, atol=0)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-11, atol=1e-14), k


def _saved_activation_bytes(block, x, rope) -> int:
    """Bytes the block's autograd saves, each storage once, less parameters and RoPE tables."""
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *rope)}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope=rope)
    return sum(saved.values())


def test_tiled_block_does_not_save_the_normalised_tensor(monkeypatch):
    """bf16, no checkpointing: with tiles the block saves neither the MLP's intermediates nor
    the norms' full-length outputs (the tiled functions' input is the residual stream)."""
    torch.manual_seed(0)
    config = _config(n_layer=1, n_embd=64, intermediate_size=160)
    model = parallelize(GPT(config).to(torch.bfloat16), plan=ParallelPlan(attention_backend="torch"))
    block = model.blocks[0]
    B, S, d, elt = 2, 64, config.n_embd, 2
    x = torch.randn(B, S, d, dtype=torch.bfloat16, requires_grad=True)
    rope = rope_cos_sin(torch.arange(S), config.head_dim, config.rope_theta)
    untiled = _saved_activation_bytes(block, x, rope)
    model.set_mlp_tile_size(16)
    tiled = _saved_activation_bytes(block, x, rope)
    # The norm outside the tiles (the SwiGLU-only tiling) saves its output as the tiles' input.
    monkeypatch.setattr(TransformerBlock, "_mlp_branch", lambda self, h: self.mlp(self.mlp_norm(h)))
    norm_outside = _saved_activation_bytes(block, x, rope)
    assert tiled <= norm_outside - B * S * d * elt, (tiled, norm_outside)
    # ... and the attention's input norm and q/k/v projections run tiled too: their
    # normalised input is not saved either.
    assert tiled <= untiled - B * S * (2 * d + 3 * config.intermediate_size) * elt, (tiled, untiled)


def test_tiled_apply_input_and_weight_gradients():
    """The generic tiling: every tile's input gradient lands in its slice, weight gradients
    summed once (one AccumulateGrad per weight), leading dims of any shape."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w1 = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(4, 11, dtype=torch.float64, generator=g, requires_grad=True)
    fn = lambda t, a, b: torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(t, a)), b)  # noqa: E731
    dout = torch.randn(3, 7, 4, dtype=torch.float64, generator=g)
    ref = torch.autograd.grad(fn(x, w1, w2), (x, w1, w2), dout)
    calls = []
    w1.register_hook(lambda grad: calls.append(1))
    y = tiled_apply(fn, x, (w1, w2), 4)  # 21 tokens: tiles of 4, the last of 1
    assert torch.allclose(y, fn(x, w1, w2), rtol=1e-14, atol=0)
    got = torch.autograd.grad(y, (x, w1, w2), dout)
    assert len(calls) == 1
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    # frozen weights: only the input gradient
    (gx,) = torch.autograd.grad(tiled_apply(fn, x, (w1.detach(), w2.detach()), 4), (x,), dout)
    assert torch.allclose(gx, ref[0], rtol=1e-12, atol=1e-14)


def test_tiled_mlp_under_cpu_autocast_matches_its_own_recompute():
    """bf16 autocast: the backward recomputes each tile under the forward's autocast state."""
    torch.manual_seed(0)
    model = GPT(_config())
    tiled = copy.deepcopy(model)
    parallelize(model, plan=ParallelPlan(attention_backend="torch", activation_checkpointing="full"))
    parallelize(tiled, plan=ParallelPlan(attention_backend="torch", activation_checkpointing="full", mlp_tile_size=8))
    ids, labels = _batch(32, 96, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = _loss_and_grads(model, ids, labels)
        loss, got = _loss_and_grads(tiled, ids, labels)
    assert torch.allclose(loss, ref_loss, rtol=2e-2)
    for k in ref:
        rel = ((got[k] - ref[k]).norm() / ref[k].norm()).item()
        assert rel < 3e-2, (k, rel)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_mlp_tile_size_is_validated(bad):
    with pytest.raises(ValueError, match="mlp_tile_size"):
        ParallelPlan(mlp_tile_size=bad)
    assert ParallelPlan(mlp_tile_size=None).mlp_tile_size is None
    assert ParallelPlan.from_dict({"mlp_tile_size": 4096}).mlp_tile_size == 4096


def test_tiled_apply_with_several_outputs():
    """A function returning a tuple (the q, k, v projections): every output and every
    gradient equal to the untiled call in float64, also where only some outputs are used."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w1, w2 = (torch.randn(n, 5, dtype=torch.float64, generator=g, requires_grad=True) for n in (4, 2))

    def fn(h, a, b):
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return torch.nn.functional.linear(h, a), torch.nn.functional.linear(h, b)

    g1 = torch.randn(3, 7, 4, dtype=torch.float64, generator=g)
    g2 = torch.randn(3, 7, 2, dtype=torch.float64, generator=g)
    for both in (True, False):
        results = []
        for out in (fn(x, w1, w2), tiled_apply(fn, x, (w1, w2), 4)):
            loss = (out[0] * g1).sum() + ((out[1] * g2).sum() if both else 0)
            grads = torch.autograd.grad(loss, (x, w1, w2), allow_unused=True)
            results.append((*out, *(torch.zeros_like(w) if d is None else d for d, w in zip(grads, (x, w1, w2)))))
        for ref, got in zip(*results):
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("checkpointing, tile", [("none", 5), ("selective", None), ("selective", 5), ("full", 5)])
def test_recompute_is_what_the_memory_model_counts(checkpointing, tile):
    """The matmul FLOPs a step runs beyond the plain one (no checkpointing, untiled), counted
    by PyTorch's FLOP counter, equal ``recomputed_flops_per_token`` x tokens: selective with
    tiles recomputes the per-token parts once (the tiles are its recompute: no checkpoint runs
    them a third time). Full's attention forward, which the reference kernel computes over the
    whole square, is taken from the counter (full against selective, untiled)."""
    from torch.utils.flop_counter import FlopCounterMode

    from longctx.memory_fit import recomputed_flops_per_token

    config = _config()
    B, S = 2, 24
    ids, labels = _batch(S, 96, seed=6, batch=B)

    def step_flops(mode, tile_size):
        torch.manual_seed(0)
        model = GPT(config).double()
        plan = dict(loss_chunk_size=7, attention_backend="torch", fuse_pointwise=False)
        parallelize(model, plan=ParallelPlan(**plan, activation_checkpointing=mode, mlp_tile_size=tile_size))
        with FlopCounterMode(display=False) as counter:
            model.loss(ids, labels)[0].backward()
        return counter.get_total_flops()

    plan = ParallelPlan(activation_checkpointing=checkpointing, mlp_tile_size=tile)
    # documents=True: the formula's attention term is 0, the rest is the per-token parts
    expected = recomputed_flops_per_token(config, S, plan, tokens_per_rank=B * S, documents=True) * B * S
    if checkpointing == "full":
        expected += step_flops("full", None) - step_flops("selective", None)
    assert expected > 0
    assert step_flops(checkpointing, tile) - step_flops("none", None) == expected


def test_checkpointed_tiled_block_saves_its_input_and_the_attention_only():
    """bf16, tiles: selective runs no checkpoint (its recompute is the tiles'), and the block
    saves exactly what no checkpointing with tiles saves less the residual between attention
    and MLP (o_proj joins the tiles, which save x and the attention's output instead)."""
    torch.manual_seed(0)
    config = _config(n_layer=1, n_embd=64, intermediate_size=160)
    model = parallelize(GPT(config).to(torch.bfloat16), plan=ParallelPlan(attention_backend="torch"))
    model.set_mlp_tile_size(16)
    block = model.blocks[0]
    B, S, d, elt = 2, 64, config.n_embd, 2
    x = torch.randn(B, S, d, dtype=torch.bfloat16, requires_grad=True)
    rope = rope_cos_sin(torch.arange(S), config.head_dim, config.rope_theta)
    none_tiled = _saved_activation_bytes(block, x, rope)
    model.set_activation_checkpointing("selective")
    selective_tiled = _saved_activation_bytes(block, x, rope)
    assert selective_tiled == none_tiled - B * S * d * elt, (selective_tiled, none_tiled)


def test_tiled_apply_token_arguments_get_their_gradients():
    """A second per-token input (``token_args``): sliced with x's tokens, its gradient written
    tile by tile; every gradient equals the untiled call's in float64, NaN in it shows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randn(3, 7, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)

    def fn(t, u, a):
        h = t + torch.nn.functional.linear(u, a)
        return h * torch.sigmoid(h)

    dout = torch.randn(3, 7, 5, dtype=torch.float64, generator=g)
    ref = torch.autograd.grad(fn(x, y, w), (x, y, w), dout)
    out = tiled_apply(fn, x, (w,), 4, token_args=(y,))
    assert torch.allclose(out, fn(x, y, w), rtol=1e-14, atol=0)
    for got, want in zip(torch.autograd.grad(out, (x, y, w), dout), ref):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    # only the token argument's gradient wanted
    (gy,) = torch.autograd.grad(tiled_apply(fn, x.detach(), (w.detach(),), 4, token_args=(y,)), (y,), dout)
    assert torch.allclose(gy, ref[1], rtol=1e-12, atol=1e-14)
    bad = y.detach().clone()
    bad[1, 2, 0] = float("nan")
    bad.requires_grad_(True)
    (gy,) = torch.autograd.grad(tiled_apply(fn, x.detach(), (w.detach(),), 4, token_args=(bad,)), (bad,), dout)
    assert torch.isnan(gy[1, 2]).all() and not torch.isnan(gy[0]).any()


def test_grad_only_linear_has_the_linears_gradients():
    """``grad_only_linear``: the gradients of ``F.linear`` (float64; bf16 autocast on CPU, bit
    for bit), no matmul in its forward (PyTorch's FLOP counter counts only the backward's two),
    NaN in an input or the incoming gradient shows in the gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    from longctx.tiled import grad_only_linear

    g = torch.Generator().manual_seed(4)
    z = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    dout = torch.randn(9, 5, dtype=torch.float64, generator=g)
    ref = torch.autograd.grad(torch.nn.functional.linear(z, w), (z, w), dout)
    with FlopCounterMode(display=False) as counter:
        out = grad_only_linear(z, w)
        assert out.shape == (9, 5) and out.dtype == torch.float64
        assert counter.get_total_flops() == 0
        got = torch.autograd.grad(out, (z, w), dout)
    assert counter.get_total_flops() == 2 * (2 * 9 * 6 * 5)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-14, atol=0)
    zf, wf = z.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.autograd.grad(torch.nn.functional.linear(zf, wf), (zf, wf), dout.bfloat16())
        got = torch.autograd.grad(grad_only_linear(zf, wf), (zf, wf), dout.bfloat16())
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    bad = z.detach().clone()
    bad[3, 2] = float("nan")
    bad.requires_grad_(True)
    dz, dw = torch.autograd.grad(grad_only_linear(bad, w), (bad, w), dout)
    assert torch.isnan(dw[:, 2]).all() and not torch.isnan(dw[:, :2]).any() and not torch.isnan(dz).any()
    dout_bad = dout.clone()
    dout_bad[1, 0] = float("nan")
    dz, _ = torch.autograd.grad(grad_only_linear(z, w), (z, w), dout_bad)
    assert torch.isnan(dz[1]).all() and not torch.isnan(dz[0]).any()


def _sharded_tiles_worker(rank: int, world_size: int):
    """One sequence over a CP group of both ranks, FSDP2 over the same two (fp32): the plain
    plan and selective / full with tiles on the first block only; the loss and the full
    gradients (gathered) of each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from longctx import CPContext, shard_sequence
    from longctx.parallel import ParallelDims

    mesh = init_device_mesh("cpu", (world_size,))
    tokens = torch.randint(0, 96, (1, 49), generator=torch.Generator().manual_seed(0))
    shard = dict(rank=rank, world_size=world_size, layout="zigzag")
    ids, labels = (shard_sequence(t, 1, **shard) for t in (tokens[:, :-1], tokens[:, 1:]))
    out = {}
    for mode, blocks, tile in (("none", None, None), ("selective", 1, 5), ("full", 1, 5), ("selective", None, 5)):
        torch.manual_seed(0)
        model = GPT(_config(n_layer=3))
        dims = ParallelDims(cp=CPContext(dist.group.WORLD), data_parallel="fsdp", fsdp_mesh=mesh)
        plan = ParallelPlan(
            attention_backend="torch",
            activation_checkpointing=mode,
            checkpointed_blocks=blocks,
            mlp_tile_size=tile,
            fuse_pointwise=False,
        )
        parallelize(model, dims, plan)
        loss_sum, n = model.loss(ids, labels)
        loss_sum.backward()
        total = torch.stack([loss_sum.detach(), n.to(loss_sum.dtype)])
        dist.all_reduce(total)
        grads = {
            k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for k, p in model.named_parameters()
        }
        out[(mode, blocks, tile)] = (total[0].item(), {k: g.clone() for k, g in grads.items()})
    return out


@pytest.mark.slow
def test_tiled_checkpointed_blocks_under_fsdp2_and_cp_equal_the_plain_plan():
    """FSDP2 and ring attention over two gloo ranks: selective and full with the MLP tiled
    (o_proj in the tiles, the last projections' recompute gradient-only), on the first block
    or on all, give the plain plan's loss and gradients (fp32, 1e-5)."""
    from helpers.dist_harness import run_distributed

    for rank_out in run_distributed(_sharded_tiles_worker, 2):
        ref_loss, ref = rank_out[("none", None, None)]
        for key, (loss, grads) in rank_out.items():
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), key
            for k, g in ref.items():
                err = ((grads[k] - g).norm() / g.norm()).item()
                assert err < 1e-5, (key, k, err)
