"""Generation with context parallelism: a prompt longer than one device holds.

``generate(model, prompt, max_new_tokens)`` on a ``GPT`` that ``longctx.parallelize`` gave a
CP group (or none: one process):

* prefill: the prompt is sharded over the group exactly as training shards it (the model's
  layout, zigzag by default, ``longctx.shard_sequence``) and run through the blocks with ring
  attention (the same kernels); each rank keeps the rotated K/V of its shard per layer
  (``longctx.decode.KVShard``): nothing is gathered. Prompt tokens beyond the largest length
  the layout splits (a multiple of 2 x P for zigzag) are fed one at a time like new tokens.
* decode: each new token runs on every rank (its embedding, projections and MLP are
  replicated); its K/V is appended on one rank (round robin: the n-th appended token goes to
  rank n mod P); its query attends to every rank's K/V through
  ``longctx.decode.sharded_kv_attention`` (one all-gather of the partial (out, lse) per layer,
  merged with the ring's log-sum-exp merge). Every rank thus computes the same logits; the
  token rank 0 of the group picks (greedy, or sampled with ``temperature`` / ``top_k`` /
  ``top_p`` from a generator seeded with ``seed``) is broadcast, so all ranks continue alike.

Exact: the tokens and log-probabilities equal one process's (tests/model/test_generate.py).

    from longctx.models.generate import generate
    out = generate(model, prompt_ids, 32)            # on every rank of the CP group
    out.tokens, out.logprobs                         # (B, 32) each, the same on every rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx.decode import KVShard, sharded_kv_attention
from longctx.layouts import required_multiple, shard_sequence
from longctx.parallel import CPContext

from .gpt import GPT, default_position_ids
from .pointwise import rope_cos_sin


@dataclass
class Generation:
    """``tokens``: the new tokens ``(B, n)``; ``logprobs``: each one's log-probability under the
    model (temperature 1, no filtering), ``(B, n)``, at least fp32."""

    tokens: torch.Tensor
    logprobs: torch.Tensor


@dataclass
class ShardedKVCache:
    """Every layer's K/V held by this rank, and where the sequence stands."""

    layers: list[KVShard]
    cp: CPContext
    length: int  # tokens of the sequence so far (all ranks together)
    appended: int = 0  # tokens added after the ring prefill (they went round robin)

    def owner_of_next(self) -> int:
        """The rank that keeps the next token's K/V."""
        return self.appended % self.cp.size


def _check_model(model) -> GPT:
    if not isinstance(model, GPT):
        raise TypeError(f"generate() runs a longctx.models.GPT, got {type(model).__name__}")
    return model


def _check_prompt(input_ids: torch.Tensor, cp: CPContext) -> None:
    """Every rank must hold the same prompt: shapes and a checksum, compared in one all-gather
    (a rank raising alone would leave the others waiting in the ring)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.is_floating_point():
        raise ValueError(
            f"the prompt must be integer token ids (batch, seq) with seq >= 1, got {tuple(input_ids.shape)}"
        )
    if cp.size == 1:
        return
    row = torch.tensor(
        [
            input_ids.shape[0],
            input_ids.shape[1],
            int(input_ids.long().sum()),
            int((input_ids.long() * 31 % 1009).sum()),
        ],
        dtype=torch.int64,
    )
    device = input_ids.device if dist.get_backend(cp.group) == "nccl" else torch.device("cpu")
    row = row.to(device)
    rows = [torch.empty_like(row) for _ in range(cp.size)]
    dist.all_gather(rows, row, group=cp.group)
    if not all(bool((r == rows[0]).all()) for r in rows):
        shapes = {i: tuple(r[:2].tolist()) for i, r in enumerate(rows)}
        raise ValueError(f"every rank of the CP group must pass the same prompt; got (batch, seq) per rank {shapes}")


def _embed(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    return model.embed(ids)


def _rope(model: GPT, positions: torch.Tensor):
    c = model.config
    return rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling)


def _logits(model: GPT, x: torch.Tensor) -> torch.Tensor:
    logits = F.linear(model.norm(x), model.lm_head_weight)
    return logits if logits.dtype == torch.float64 else logits.float()


def _from_rank_holding(x: torch.Tensor, mine: bool, cp: CPContext) -> torch.Tensor:
    """``x`` from the one rank where ``mine`` is True, on every rank (a sum with zeros: exact)."""
    if cp.size == 1:
        return x
    x = x.contiguous().clone() if mine else torch.zeros_like(x, memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=cp.group)
    return x


@torch.no_grad()
def prefill(model: GPT, input_ids: torch.Tensor, *, room: int = 0) -> tuple[ShardedKVCache, torch.Tensor]:
    """Run the prompt ``(B, S)`` (the full prompt, the same on every rank) over the model's CP
    group; returns this rank's cache and the logits ``(B, vocab)`` of the prompt's last token
    (the same on every rank). ``room``: tokens to be appended later (sizes the buffers)."""
    model = _check_model(model)
    cp = model.cp
    _check_prompt(input_ids, cp)
    B, S = input_ids.shape
    multiple = required_multiple(cp.size, cp.layout) if cp.size > 1 else 1
    S_ring = S // multiple * multiple
    per_rank = math.ceil((room + S - S_ring) / cp.size)
    layers: list[KVShard] = []
    last_logits = None
    if S_ring > 0:
        ids = input_ids[:, :S_ring]
        if cp.size > 1:
            ids = shard_sequence(ids, 1, rank=cp.rank, world_size=cp.size, layout=cp.layout)
        positions = default_position_ids(ids.shape[1], cp, ids.device)
        rope = _rope(model, positions)
        x = _embed(model, ids)
        for block in model.blocks:
            q, k, v = block._before_attention(x, rope)
            x = block._after_attention(x, block.attn.attend(q, k, v))
            layers.append(KVShard(k, v, capacity=k.shape[1] + per_rank))
        here = (positions == S_ring - 1).nonzero()
        last = x[:, here[0, 0]] if len(here) else x.new_zeros((B, x.shape[-1]))
        last_logits = _logits(model, _from_rank_holding(last, len(here) > 0, cp))
    else:
        c = model.config
        dtype, device = model.embed.weight.dtype, input_ids.device
        empty = torch.empty((B, 0, c.n_kv_head, c.head_dim), dtype=dtype, device=device)
        layers = [KVShard(empty, empty, capacity=per_rank) for _ in model.blocks]
    cache = ShardedKVCache(layers, cp, S_ring)
    for t in range(S_ring, S):  # what the layout could not split: token by token
        last_logits = decode_step(model, cache, input_ids[:, t : t + 1])
    return cache, last_logits


@torch.no_grad()
def decode_step(model: GPT, cache: ShardedKVCache, token: torch.Tensor) -> torch.Tensor:
    """Append ``token`` ``(B, 1)`` (the same on every rank) to the sequence; returns the logits
    ``(B, vocab)`` for the token after it, the same on every rank."""
    cp = cache.cp
    keep = cp.rank == cache.owner_of_next()
    rope = _rope(model, torch.tensor([cache.length], device=token.device))
    x = _embed(model, token)
    for block, kv in zip(model.blocks, cache.layers):
        q, k, v = block._before_attention(x, rope)
        if keep:
            kv.append(k, v)
        core = block.attn.core
        y = sharded_kv_attention(q, kv.k, kv.v, group=cp.group if cp.size > 1 else None, backend=core.backend)
        x = block._after_attention(x, y.flatten(2))
    cache.length += 1
    cache.appended += 1
    return _logits(model, x[:, -1])


def sample(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """The next token ``(B, 1)``: argmax at temperature 0, else a draw from the tempered
    distribution restricted to the ``top_k`` most likely tokens and to the smallest set whose
    probability reaches ``top_p``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    scores = logits / temperature
    if top_k is not None:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None:
        ordered, index = torch.sort(scores, dim=-1, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        # Drop a token when those before it already reach top_p (the first one always stays).
        drop = (cumulative - torch.softmax(ordered, dim=-1)) >= top_p
        scores = scores.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores.double(), dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def _same_on_every_rank(token: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """Rank 0's choice everywhere: equal logits give equal choices already, but one differing
    last bit must not make the ranks continue different sequences."""
    if cp.size == 1:
        return token
    dist.broadcast(token, src=dist.get_global_rank(cp.group, 0), group=cp.group)
    return token


@torch.no_grad()
def generate(
    model: GPT,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: int = 0,
    eos_id: Optional[int] = None,
) -> Generation:
    """Continue ``input_ids`` ``(B, S)`` by up to ``max_new_tokens`` tokens, on every rank of the
    model's CP group at once (each passes the same full prompt); see the module doc. Rows that
    emitted ``eos_id`` are padded with it; generation stops once every row has."""
    model = _check_model(model)
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    cache, logits = prefill(model, input_ids, room=max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    tokens, logprobs = [], []
    done = torch.zeros(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
    for i in range(max_new_tokens):
        token = _same_on_every_rank(
            sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator), cache.cp
        )
        if eos_id is not None:
            token = token.masked_fill(done, eos_id)
        tokens.append(token)
        logprobs.append(torch.log_softmax(logits, dim=-1).gather(-1, token))
        if eos_id is not None:
            done |= token == eos_id
            if bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            logits = decode_step(model, cache, token)
    empty = input_ids.new_zeros((input_ids.shape[0], 0))
    return Generation(
        tokens=torch.cat(tokens, dim=1) if tokens else empty,
        logprobs=torch.cat(logprobs, dim=1) if logprobs else empty.to(logits.dtype),
    )
