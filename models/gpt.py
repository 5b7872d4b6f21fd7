"""A Llama-style GPT whose attention is ring attention, readable top to bottom.

RMSNorm -> rotary embeddings -> RingSelfAttention (GQA) -> SwiGLU MLP ->
TransformerBlock -> GPT (embedding, blocks, final norm, LM head, chunked loss); the
elementwise pieces (RMSNorm, RoPE, the SwiGLU gate, their fusion) are in pointwise.py.

Context parallelism: each rank holds a shard of every sequence (the zigzag layout by
default). Nothing in the model depends on that except two things:

* attention, whose core (``longctx.ContextParallelAttention``) calls
  ``longctx.ring_attention`` with the CP context ``longctx.parallelize`` handed it (none:
  ordinary attention through the same kernel seam), and
* RoPE, which rotates by the *global* position of each token, taken from
  ``position_ids`` (or derived from the layout when none are given). The cos/sin of the
  positions this rank holds are computed once per forward and passed to every block.

The model is architecture only (``GPTConfig`` holds sizes and RoPE); checkpointing,
fusion, the loss chunk and FSDP2 are applied from outside by ``longctx.parallelize``.

Everything else (norms, MLP, embedding, the loss) is per-token and runs unchanged on a
shard. The blocks are plain ``nn.Module``s and work inside any module or
LightningModule.

Saved for the backward (eager path): RMSNorm keeps only its input and one fp32 ``rstd`` per
token, recomputing the normalised tensor (``lean_rms_norm``); with ``mlp_tile_size`` the MLP
norm and SwiGLU run as one sequence-tiled function that keeps only the residual stream, and
so do the attention norm and the q/k/v projections.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from longctx.layouts import position_ids as layout_position_ids
from longctx.offload import BlockOffloader, offload_count
from longctx.parallel import CHECKPOINTING, ContextParallelAttention, CPContext
from longctx.tiled import check_tile_size, grad_only_linear, spans_tiles, tiled_apply, tiled_sum
from longctx.validation import check_choice

from .config import GPTConfig
from .pointwise import RMSNorm, apply_rope_qk, fused, rope_cos_sin, swiglu_gate

IGNORE_INDEX = -100
# A block draws no random numbers, so its checkpoints save no RNG state. That also lets a CPU
# run on a GPU host compile inside one: torch.compile's first call initializes CUDA, which a
# checkpoint that saved the device RNG states refuses.
_CHECKPOINT_OPTIONS = dict(use_reentrant=False, preserve_rng_state=False)


# ---- positions --------------------------------------------------------------------------


def default_position_ids(local_len: int, cp: CPContext, device: torch.device) -> torch.Tensor:
    """Global positions of this rank's tokens when the caller gave none: the layout decides."""
    if cp.size == 1:
        return torch.arange(local_len, device=device)
    return layout_position_ids(local_len * cp.size, rank=cp.rank, world_size=cp.size, layout=cp.layout, device=device)


Rope = tuple[torch.Tensor, torch.Tensor]


# ---- attention -------------------------------------------------------------------------


class RingSelfAttention(nn.Module):
    """Causal grouped-query self-attention over a context-parallel group.

    Input ``x`` is this rank's shard ``(B, S_local, n_embd)``; ``rope`` the cos/sin of the
    global positions of those tokens (``rope_cos_sin``). Only ``n_kv_head`` heads of K/V
    travel the ring. ``self.core`` (``longctx.ContextParallelAttention``) holds the CP
    context and the ring/Ulysses choice; ``longctx.parallelize`` sets them.
    """

    def __init__(self, n_embd: int, n_head: int, n_kv_head: Optional[int] = None, head_dim: Optional[int] = None):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        head_dim = n_embd // n_head if head_dim is None else head_dim
        if n_head % n_kv_head != 0:
            raise ValueError(f"n_head={n_head} must be a multiple of n_kv_head={n_kv_head}")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.q_proj = nn.Linear(n_embd, n_head * head_dim, bias=False)
        self.k_proj = nn.Linear(n_embd, n_kv_head * head_dim, bias=False)
        self.v_proj = nn.Linear(n_embd, n_kv_head * head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * head_dim, n_embd, bias=False)
        self.core = ContextParallelAttention(n_head, n_kv_head)
        self.fuse_pointwise = False

    def forward(self, x: torch.Tensor, rope: Rope, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.o_proj(self.attend(*self.qkv(x, rope), document_ids))

    def qkv(self, x: torch.Tensor, rope: Rope):
        """Projections and RoPE: ``(q, k, v)``, each ``(B, S_local, heads, head_dim)``."""
        return self.rotate(self.q_proj(x), self.k_proj(x), self.v_proj(x), rope)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope):
        """Projected ``(B, S_local, width)`` q, k, v split into heads, RoPE on q and k."""
        B, S, _ = q.shape
        cos, sin = rope
        if cos.shape[1] != S:
            raise ValueError(f"rope tables cover {cos.shape[1]} tokens but the input has {S}")
        q = q.view(B, S, self.n_head, self.head_dim)
        k = k.view(B, S, self.n_kv_head, self.head_dim)
        v = v.view(B, S, self.n_kv_head, self.head_dim)
        q, k = (fused(apply_rope_qk) if self.fuse_pointwise else apply_rope_qk)(q, k, cos, sin)
        return q, k, v

    @property
    def projection_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_proj.weight, self.k_proj.weight, self.v_proj.weight

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Attention over the CP group: ``(B, S_local, n_head * head_dim)``, before o_proj."""
        return self.core(q, k, v, document_ids).flatten(2)


# The tiled functions below take ``last``: their final projections, ``F.linear`` in the
# forward and ``longctx.tiled.grad_only_linear`` in the tiles' backward recompute, where only
# the graph of those outputs is needed (``tiled_apply``'s ``backward_fn``).


def swiglu_mlp(
    x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, last=F.linear
) -> torch.Tensor:
    return last(swiglu_gate(F.linear(x, gate_w), F.linear(x, up_w)), down_w)


def swiglu_mlp_fused(
    x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, last=F.linear
) -> torch.Tensor:
    return last(fused(swiglu_gate)(F.linear(x, gate_w), F.linear(x, up_w)), down_w)


def norm_then_projections(
    norm,
    eps: float,
    x: torch.Tensor,
    norm_w: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    v_w: torch.Tensor,
    last=F.linear,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v projections of ``norm(x)``, every weight an argument, as ``tiled_apply`` calls it."""
    h = norm(x, norm_w, eps)
    return last(h, q_w), last(h, k_w), last(h, v_w)


def norm_then_mlp(
    norm,
    eps: float,
    mlp,
    x: torch.Tensor,
    norm_w: torch.Tensor,
    gate_w: torch.Tensor,
    up_w: torch.Tensor,
    down_w: torch.Tensor,
    last=F.linear,
) -> torch.Tensor:
    """``mlp(norm(x))`` with every weight an argument, as ``tiled_apply`` calls it."""
    return mlp(norm(x, norm_w, eps), gate_w, up_w, down_w, last=last)


def after_attention(
    norm, eps: float, mlp, x: torch.Tensor, y: torch.Tensor, o_w: torch.Tensor, *norm_and_mlp_w, last=F.linear
) -> torch.Tensor:
    """A block's output from its input ``x`` and the attention's output ``y``: o_proj, the
    residual, ``norm_then_mlp`` (weights: the norm's, gate, up, down) and the residual, as
    ``tiled_apply`` calls it (``y`` a token argument)."""
    h = x + F.linear(y, o_w)
    return h + norm_then_mlp(norm, eps, mlp, h, *norm_and_mlp_w, last=last)


def _tiled(fn, x: torch.Tensor, weights, tile_size, token_args=()):
    """``tiled_apply`` of one of the functions above, whose backward recompute skips the last
    projections' matmuls (``grad_only_linear``)."""
    return tiled_apply(fn, x, weights, tile_size, token_args=token_args, backward_fn=partial(fn, last=grad_only_linear))


class SwiGLU(nn.Module):
    """``tile_size`` (set by ``longctx.parallelize`` from ``ParallelPlan.mlp_tile_size``):
    None computes all tokens at once and saves its (tokens x hidden) intermediates for the
    backward; n computes n tokens at a time, forward and backward (``longctx.tiled``): exact,
    only the input is saved, and no (tokens x hidden) intermediate larger than n x hidden
    exists. In a ``TransformerBlock`` the norm before the MLP runs inside the same tiles, so
    the one tensor saved is the residual stream, not its normalised copy."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, n_embd, bias=False)
        self.fuse_pointwise = False
        self.tile_size: Optional[int] = None

    def function(self):
        """``fn(x, gate_w, up_w, down_w)``, the gate compiled with fusion on."""
        return swiglu_mlp_fused if self.fuse_pointwise else swiglu_mlp

    @property
    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_size is not None:
            return _tiled(self.function(), x, self.weights, self.tile_size)
        gate = fused(swiglu_gate) if self.fuse_pointwise else swiglu_gate
        return self.down_proj(gate(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block on a (possibly sharded) sequence.

    ``forward(x, position_ids=None, *, rope=None, document_ids=None)``: pass the global
    ``position_ids`` of the tokens, or the ``rope`` tables computed from them once for all
    blocks (``GPT`` does). ``activation_checkpointing`` (``"none"``, ``"full"``,
    ``"selective"``) is set from outside (``longctx.parallelize``).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.attn_norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.attn = RingSelfAttention(config.n_embd, config.n_head, config.n_kv_head, config.head_dim)
        self.mlp_norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.mlp = SwiGLU(config.n_embd, config.intermediate_size)
        self.activation_checkpointing = "none"

    def rope(self, x: torch.Tensor, position_ids: Optional[torch.Tensor]) -> Rope:
        if position_ids is None:
            position_ids = default_position_ids(x.shape[1], self.attn.core.cp, x.device)
        c = self.config
        return rope_cos_sin(position_ids, c.head_dim, c.rope_theta, c.rope_scaling)

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        if mlp.tile_size is None:
            return mlp(self.mlp_norm(x))
        # Norm and MLP as one tiled function of x: the full-length normalised tensor is never
        # saved (it would be the tiles' input), only x itself.
        norm = self.mlp_norm
        fn = partial(norm_then_mlp, norm.function(), norm.eps, mlp.function())
        return _tiled(fn, x, (norm.weight, *mlp.weights), mlp.tile_size)

    def _before_attention(self, x: torch.Tensor, rope: Rope):
        tile = self.mlp.tile_size
        if tile is None:
            return self.attn.qkv(self.attn_norm(x), rope)
        # Tiled like the MLP, norm included: the normalised input the projections would
        # save for their weight gradients is never materialised at full length.
        norm = self.attn_norm
        fn = partial(norm_then_projections, norm.function(), norm.eps)
        return self.attn.rotate(*_tiled(fn, x, (norm.weight, *self.attn.projection_weights), tile), rope)

    def _forward(self, x: torch.Tensor, rope: Rope, document_ids: Optional[torch.Tensor]) -> torch.Tensor:
        y = self.attn.attend(*self._before_attention(x, rope), document_ids)
        return self._after_attention(x, y)

    def _after_attention(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tile = self.mlp.tile_size
        if self.activation_checkpointing == "none" or not spans_tiles(x, tile):
            x = x + self.attn.o_proj(y)
            return x + self._mlp_branch(x)
        # Checkpointed and tiled: o_proj joins the tiles, which then save only x and y (kept
        # anyway: the block's input and the attention's output), not the residual between.
        norm, mlp = self.mlp_norm, self.mlp
        fn = partial(after_attention, norm.function(), norm.eps, mlp.function())
        return _tiled(fn, x, (self.attn.o_proj.weight, norm.weight, *mlp.weights), tile, token_args=(y,))

    def forward(
        self,
        x: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        *,
        rope: Optional[Rope] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if rope is None:
            rope = self.rope(x, position_ids)
        mode = self.activation_checkpointing
        if mode == "none" or not torch.is_grad_enabled():
            return self._forward(x, rope, document_ids)
        # Non-reentrant checkpoints: they work with autocast, kwargs and inputs that need no
        # grad. Every rank recomputes the blocks in the same order, so the P2P sequence of
        # a recomputed ring forward stays matched across the group.
        if mode == "selective":
            if spans_tiles(x, self.mlp.tile_size):
                # Every per-token part runs in tiles that save only their inputs (x, and the
                # attention's output) and recompute themselves in the backward: what the
                # checkpoints below would keep and recompute, without a third forward.
                return self._forward(x, rope, document_ids)
            # The ring runs once: q, k, v and its output are kept (the ring saves them for
            # its own backward anyway); the per-token parts around it are recomputed.
            q, k, v = checkpoint(self._before_attention, x, rope, **_CHECKPOINT_OPTIONS)
            y = self.attn.attend(q, k, v, document_ids)
            return checkpoint(self._after_attention, x, y, **_CHECKPOINT_OPTIONS)
        return checkpoint(self._forward, x, rope, document_ids, **_CHECKPOINT_OPTIONS)


# ---- loss --------------------------------------------------------------------------------


def _chunk_loss(h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h, weight)
    logits = logits if logits.dtype == torch.float64 else logits.float()  # at least fp32
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _norm_chunk_loss(
    norm, eps: float, x: torch.Tensor, labels: torch.Tensor, norm_w: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    return _chunk_loss(norm(x, norm_w, eps), labels, weight)


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, norm=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy of ``hidden @ weight.T`` and the number of counted tokens.

    The fp32 logits of at most ``chunk_size`` tokens exist at once: chunks are computed
    one at a time (``longctx.tiled.tiled_sum``), forward and backward, where each chunk is
    recomputed and differentiated; the input gradient is written chunk by chunk. ``norm``:
    ``(fn, weight, eps)`` of a final norm applied per chunk first (``GPT`` passes its
    RMSNorm, so the normalised hidden states never exist at full length). Labels equal to
    -100 are ignored. Returns ``(loss_sum scalar, n_tokens int64 scalar)``, the loss in
    fp32 (float64 for float64 inputs).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match tokens {tuple(hidden.shape[:-1])}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if norm is None:
        fn, weights = _chunk_loss, (weight,)
    else:
        norm_fn, norm_w, eps = norm
        fn, weights = partial(_norm_chunk_loss, norm_fn, eps), (norm_w, weight)
    n_tokens = (labels != IGNORE_INDEX).sum()
    if labels.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=hidden.device), n_tokens
    return tiled_sum(fn, hidden, (labels,), weights, chunk_size), n_tokens


# ---- the model ---------------------------------------------------------------------------


def draw_init_seed() -> int:
    """The host generators' base seed ``GPT.reset_parameters`` draws from the global RNG: drawn
    ahead by a caller that initialises the model later (the same parameters as a build now)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def _normal_on_threads(params: list, seed: int) -> None:
    """``normal_(0, std)`` of each host ``(tensor, std)``, parameter i from its own generator
    seeded ``seed + i`` (the same values whatever the thread count), several at once."""
    from concurrent.futures import ThreadPoolExecutor

    def draw(i):
        p, p_std = params[i]
        with torch.no_grad():
            p.normal_(0.0, p_std, generator=torch.Generator().manual_seed(seed + i))

    workers = max(1, min(len(params), torch.get_num_threads(), 32))
    if workers == 1:
        for i in range(len(params)):
            draw(i)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(draw, range(len(params))))


class GPT(nn.Module):
    """Embedding, blocks, final norm, LM head. Architecture only: how it runs (CP context,
    checkpointing, fusion, FSDP2, loss chunk) is applied from outside by ``longctx.parallelize``.
    """

    # Hugging Face's name for "the repeated block": parallelize shards per block.
    _no_split_modules = ("TransformerBlock",)

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        # Built on the meta device, then allocated where the caller asked (the default device)
        # and initialised once by reset_parameters: the layers' own default init would be a
        # second full pass of the host's serial RNG, the longest part of building a large model.
        device = torch.get_default_device()
        with torch.device("meta"):
            self.embed = nn.Embedding(config.vocab_size, config.n_embd)
            self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
            self.norm = RMSNorm(config.n_embd, config.rms_norm_eps)
            self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.to_empty(device=device)
        self.loss_chunk_size = 4096
        self.offload_activations = False
        self.reset_parameters()

    def reset_parameters(self, seed: Optional[int] = None) -> None:
        """GPT-2-style initialisation; works on sharded (DTensor) parameters too.

        Host tensors draw from one generator each, seeded from ``seed`` or else from the global
        RNG (``draw_init_seed``: a seed still fixes the model), on a thread pool: the host's RNG
        is serial, and one generator would draw a large model's values one at a time. Other
        tensors draw from the global RNG."""
        std = self.config.init_std
        host = []
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if p.dim() == 1:  # norm gains
                nn.init.ones_(p)
                continue
            p_std = std
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                # GPT-2: residual-stream writers scaled by 1/sqrt(2 * n_layer).
                p_std = std / math.sqrt(2 * self.config.n_layer)
            if type(p.data) is torch.Tensor and p.device.type == "cpu":
                if seed is None:
                    seed = draw_init_seed()
                host.append((p, p_std))
            else:
                nn.init.normal_(p, 0.0, p_std)
        if host:
            _normal_on_threads(host, seed)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> Optional[nn.Linear]:
        """The untied head; None when tied (the embedding's weight is the head's)."""
        return self.lm_head

    @property
    def cp(self) -> CPContext:
        """The context-parallel context the attention layers were handed (``parallelize``)."""
        return self.blocks[0].attn.core.cp

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() dedups tied weights

    def set_pointwise_fusion(self, enabled: bool) -> None:
        """Run RMSNorm, RoPE and the SwiGLU gate through torch.compile (see ``fused``)."""
        for m in self.modules():
            if hasattr(m, "fuse_pointwise"):
                m.fuse_pointwise = bool(enabled)

    def set_mlp_tile_size(self, tile_size: Optional[int]) -> None:
        """Tokens per tile of the sequence-tiled MLP (``longctx.tiled``); None: untiled."""
        check_tile_size(tile_size)
        for block in self.blocks:
            block.mlp.tile_size = tile_size

    def set_activation_checkpointing(self, mode: str, blocks: Optional[int] = None) -> None:
        """``"none"``, ``"full"`` (recompute whole blocks) or ``"selective"`` (never the ring),
        for the first ``blocks`` blocks (None: all); the later ones keep everything."""
        check_choice("activation_checkpointing", mode, CHECKPOINTING)
        n = len(self.blocks)
        if blocks is not None and not (isinstance(blocks, int) and not isinstance(blocks, bool) and 0 <= blocks <= n):
            raise ValueError(f"checkpointed_blocks must be an integer in [0, {n}] (the model's blocks), got {blocks!r}")
        for i, block in enumerate(self.blocks):
            block.activation_checkpointing = mode if blocks is None or i < blocks else "none"

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (B, S_local, n_embd) of this rank's tokens."""
        return self.norm(self.residual_stream(input_ids, position_ids, document_ids))

    def residual_stream(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The last block's output (B, S_local, n_embd), before the final norm."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = default_position_ids(input_ids.shape[1], self.cp, input_ids.device)
        if position_ids.shape[-1] != input_ids.shape[1]:
            raise ValueError(
                f"position_ids cover {position_ids.shape[-1]} tokens but input_ids has {input_ids.shape[1]}"
            )
        if position_ids.is_floating_point():
            raise TypeError(f"position_ids must be integers, got dtype {position_ids.dtype}")
        c = self.config
        rope = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, c.rope_scaling)  # once for all blocks
        x = self.embed(input_ids)
        n_off = offload_count(self.offload_activations, len(self.blocks)) if torch.is_grad_enabled() else 0
        if n_off == 0:
            for block in self.blocks:
                x = block(x, rope=rope, document_ids=document_ids)
            return x
        # The first n_off blocks' saved tensors go to pinned host memory on a side stream and
        # come back one block ahead of the backward (longctx.offload); the shared RoPE tables
        # and document ids stay.
        offloader = BlockOffloader(keep=(*rope, document_ids))
        for i, block in enumerate(self.blocks):
            if i > n_off:  # no hook needed: block n_off's marker already starts the prefetch
                x = block(x, rope=rope, document_ids=document_ids)
                continue
            with offloader.block(i, i < n_off):
                x = block(x, rope=rope, document_ids=document_ids)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ):
        """Logits ``(B, S_local, vocab)``; with ``labels`` (already shifted, -100 ignored) the
        pair ``(loss_sum fp32, n_tokens int64)`` over this rank's tokens instead, from the
        chunked loss that never holds all logits. The training entry point is this method
        (not a side door), so FSDP2's hooks on the root run."""
        if labels is None:
            return F.linear(self.hidden_states(input_ids, position_ids, document_ids), self.lm_head_weight)
        x = self.residual_stream(input_ids, position_ids, document_ids)
        norm = (self.norm.function(), self.norm.weight, self.norm.eps)  # per chunk, inside the loss
        return chunked_cross_entropy(x, self.lm_head_weight, labels, self.loss_chunk_size, norm=norm)

    def loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum fp32, n_tokens int64)`` over this rank's tokens; labels -100 ignored.

        Labels are already shifted (on the full sequence, before sharding).
        """
        return self(input_ids, position_ids, labels=labels, document_ids=document_ids)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        eos_id: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> torch.Tensor:
        """Greedy (temperature 0) or sampled continuation; no KV cache (a check, not a server).
        ``longctx.models.generate``: KV-cached, over a CP group too."""
        if self.cp.size > 1:
            raise RuntimeError(
                "GPT.generate() runs on one device; with a CP group use longctx.models.generate.generate "
                "(K/V cached and left sharded over the group)"
            )
        ids = input_ids
        for _ in range(max_new_tokens):
            logits = self(ids)[:, -1, :].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            else:
                nxt = logits.argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if eos_id is not None and bool((nxt == eos_id).all()):
                break
        return ids
