"""Per-rank memory model: the peak GPU and host bytes of one training step, itemised.

``estimate(config, seq_len, plan=..., cp=..., dp=...)`` counts what the code allocates
(models/gpt.py, longctx/ring.py, kernels/vendor.py, the chunked loss, ``longctx.tiled``,
``longctx.offload``) per token of this rank's shard ``T = batch x seq_len / cp``. Symbols:
d = n_embd, q = n_head x head_dim, kv = n_kv_head x head_dim, F = intermediate size,
V = vocabulary, L = layers, N = parameters, W = dp x cp, a = activation bytes (2 under bf16
autocast), r = residual stream bytes (2 under FSDP2 with bf16 parameters; 4 under autocast
with fp32 parameters, where ``x + attn(x)`` promotes to fp32).

Static, per rank (s = W under FSDP, 1 otherwise): fp32 parameters, gradients and AdamW
moments, 16N/s (``cpu_offload``: in host memory), DDP buckets 4N (W > 1), bf16 working
copies (FSDP2: the root's head or tied embedding plus two unsharded blocks; an untied
embedding is a unit of its own; autocast with fp32 weights: its cast cache).

Saved for the backward, per token per layer (``saved_block_inputs``): ``full`` r·d;
``selective`` r·d + a(2q + 2kv) + 4·Hq (+ 2a·kv for the ring's kept K/V shard at cp > 1);
``none`` everything the block's autograd saves (4aF for the SwiGLU, 3aF fused); with
``mlp_tile_size`` only the residual stream. ``hf_modules``: transformers' RMSNorm keeps an fp32
copy of its input, (4 + a)d per norm. ``offload_activations`` moves the first n layers' share
to pinned host memory, one layer in flight. ``float8`` adds its casts to each layer's
backward moment (``float8_cast_bytes``).

The peak is the largest of these moments: the loss backward (12 bytes x V per token of
``loss_chunk_size``), the last layer's backward (all saved inputs, one layer recomputed and
differentiated: the MLP's or the attention's moment, kernels' and ring's buffers divided by
``attention_head_chunks``), the first layer's (all gradients), an untied embedding's backward
under FSDP2, the optimizer step. The forward is never the peak, because ``CausalLMModule``
frees the gradients right after the optimizer step (Lightning alone would keep them through
the next forward). Outside ``max_memory_allocated``: the CUDA context and workspaces
(``cuda_context``) and fragmentation (``allocator_slack``).

On a CPU the same tensors are the process's memory: ``host_bytes`` is ``cpu_process_bytes()``
plus the step's peak plus what the C allocator keeps (``CPU_RETAINED_FRACTION``); the CPU's
reference kernel materialises each call's scores (``reference_scores_bytes``).

What fits (the longest sequence, the escalation ladder, the check before the first step) is
``longctx.memory_fit``'s job. ``longctx`` never imports ``longctx.models``: the config is read
duck-typed (GPTConfig or a Hugging Face Llama-style config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

GiB = 2**30
CUDA_CONTEXT_BYTES = int(1.5 * GiB)
SLACK_FRACTION = 0.03
HOST_BASELINE_BYTES = 3 * GiB  # Python, torch, CUDA libraries: resident before any tensor
# A CPU rank's resident memory besides the step's tensors: Python, torch, Lightning, the process
# group, the data module (0.65 GiB when train.py's fit starts), and what a run adds over its steps
# (the memory-mapped token cache's pages it touches, heap fragmentation: ~0.1 GiB over the default
# run's 200 steps). Fitted to the fullest rank's peak RSS of train.py runs of 1 to 200 steps.
CPU_PROCESS_BYTES = int(0.70 * GiB)
# A CUDA build of torch keeps its CUDA libraries resident in a CPU run too (a CPU run on a GPU
# host): fitted to the same train.py run's fullest rank there (benchmarks/NOTES.md).
CUDA_BUILD_PROCESS_BYTES = int(0.45 * GiB)
# What the C allocator keeps of the step's freed tensors (glibc's heap keeps blocks below its mmap
# threshold, up to 32 MiB: activations and gradients of small layers), as a share of the step's peak.
CPU_RETAINED_FRACTION = 0.05
REFERENCE_SCORE_COPIES = 4  # score-sized fp32 tensors the reference kernel's backward holds at once
KERNEL_FAMILIES = ("fa4", "triton", "cudnn")  # how estimate counts a block kernel's buffers (kernel_family)


@dataclass
class MemoryEstimate:
    """Predicted peak per rank. ``items`` (name -> bytes) add up to ``gpu_bytes``;
    ``host_items`` to ``host_bytes``. ``allocated_bytes`` is the part
    ``torch.cuda.max_memory_allocated`` sees (``gpu_bytes`` less context and slack).
    ``phase`` names the moment of the peak; ``phases`` maps every moment the model
    considers to its allocated bytes. ``first_step_allocated_bytes``: the first step's
    forward and backward, before AdamW's states exist (the first optimizer step creates
    them): what a one-step run's peak, taken before its optimizer step, shows."""

    gpu_bytes: int
    host_bytes: int
    items: dict = field(default_factory=dict)
    host_items: dict = field(default_factory=dict)
    allocated_bytes: int = 0
    phase: str = ""
    tokens_per_rank: int = 0
    params: int = 0
    phases: dict = field(default_factory=dict)
    first_step_allocated_bytes: int = 0

    def summary(self) -> str:
        if not self.gpu_bytes:  # a CPU run: every tensor of the step is in host memory
            top = sorted(((v, k) for k, v in self.host_items.items()), reverse=True)[:4]
            parts = ", ".join(f"{k} {v / GiB:.2f}" for v, k in top)
            return (
                f"memory (predicted, per rank): host {self.host_bytes / GiB:.2f} GiB at {self.phase} "
                f"({parts} GiB); {self.tokens_per_rank:,} tokens per rank"
            )
        top = sorted(((v, k) for k, v in self.items.items()), reverse=True)[:4]
        parts = ", ".join(f"{k} {v / GiB:.1f}" for v, k in top)
        return (
            f"memory (predicted, per rank): GPU {self.gpu_bytes / GiB:.1f} GiB "
            f"({self.allocated_bytes / GiB:.1f} allocated) at {self.phase} ({parts} GiB), "
            f"host {self.host_bytes / GiB:.1f} GiB; {self.tokens_per_rank:,} tokens per rank"
        )


@dataclass(frozen=True)
class _Shape:
    L: int
    d: int
    hq: int
    hkv: int
    hd: int
    F: int
    V: int
    tied: bool

    @property
    def q(self) -> int:
        return self.hq * self.hd

    @property
    def kv(self) -> int:
        return self.hkv * self.hd

    def layer_params(self) -> int:
        return 2 * self.d * self.q + 2 * self.d * self.kv + 3 * self.d * self.F + 2 * self.d

    def params(self) -> int:
        return self.L * self.layer_params() + self.d + self.V * self.d * (1 if self.tied else 2)


def model_shape(config: Any) -> _Shape:
    """The sizes the memory model reads, from a ``GPTConfig`` or a Hugging Face Llama-style config."""

    def get(*names, default=None):
        for n in names:
            v = getattr(config, n, None)
            if v is not None:
                return v
        if default is not None:
            return default
        raise ValueError(f"config {type(config).__name__} has none of {names}")

    d = int(get("n_embd", "hidden_size"))
    hq = int(get("n_head", "num_attention_heads"))
    hkv = int(get("n_kv_head", "num_key_value_heads", default=hq))
    hd = int(get("head_dim", default=d // hq))
    tied = bool(get("tie_embeddings", "tie_word_embeddings", default=False))
    return _Shape(
        L=int(get("n_layer", "num_hidden_layers")),
        d=d,
        hq=hq,
        hkv=hkv,
        hd=hd,
        F=int(get("intermediate_size")),
        V=int(get("vocab_size")),
        tied=tied,
    )


def as_plan(plan):
    """A ``ParallelPlan`` from a plan, its dict form, or None (the defaults)."""
    if plan is None or isinstance(plan, dict):
        from .parallel import ParallelPlan

        return ParallelPlan.from_dict(plan)
    return plan


def _offload_layers(setting, n_layer: int) -> int:
    from .offload import offload_count

    return offload_count(setting, n_layer)


def kernel_family(backend: str) -> str:
    """How the memory model counts a block kernel's buffers on a GPU: "flash" like "cudnn" (GQA
    expanded), the reference like "triton" (it runs on a GPU only where no other kernel can;
    its score matrices are counted on a CPU, where it is the kernel: ``estimate(device="cpu")``);
    "fa4" as itself."""
    return {"flash": "cudnn", "torch": "triton"}.get(backend, backend)


def auto_attention_kernel(head_dim: int = 128, seq_len: int = 128 * 1024) -> str:
    """The block kernel ``backend="auto"`` runs for bf16 causal blocks of ``seq_len`` tokens and
    ``head_dim`` on this machine's first GPU, by the kernels' own rule
    (``longctx.kernels.select_backend``), as the memory model counts it (``kernel_family``).
    Without a GPU: "triton". A run's plan resolves its kernels itself (``longctx.run_plan``)."""
    import torch

    if not torch.cuda.is_available():
        return "triton"
    from longctx.kernels import select_backend

    return kernel_family(select_backend("auto", "cuda", torch.bfloat16, head_dim, seq_len, seq_len, True))


def estimate(
    config: Any,
    seq_len: int,
    *,
    plan=None,
    cp: int = 1,
    dp: int = 1,
    data_parallel: str = "fsdp",
    cpu_offload: bool = False,
    batch_size: int = 1,
    precision: str = "bf16-mixed",
    attention_kernel: str = "auto",
    hf_modules: bool = False,
    device: str = "cuda",
    documents: bool = False,
) -> MemoryEstimate:
    """Predicted peak GPU and host bytes of one rank for one training step (forward,
    backward, AdamW step) of ``batch_size`` sequences of ``seq_len`` tokens.

    ``plan``: a ``ParallelPlan`` (or a mapping of its fields; None: the defaults).
    ``data_parallel``: ``"fsdp"`` (parameters, gradients, AdamW sharded over dp x cp),
    ``"ddp"`` or ``"none"`` (replicated). ``precision``: ``"bf16-mixed"`` (fp32 masters,
    bf16 compute) or ``"32-true"``. ``attention_kernel``: the block kernels' backward
    buffers differ: ``"cudnn"`` expands GQA K/V to every query head, ``"fa4"`` and
    ``"triton"`` take GQA natively; ``"auto"``: the plan's ``attention_backend`` (a run's
    resolved plan names it: ``longctx.run_plan``), and where that is "auto" too, what the
    kernels pick here for this head dim and shard length (``auto_attention_kernel``).
    ``hf_modules``: the blocks are transformers' eager Llama-family modules (``--hf-model``),
    which keep more than ``longctx.models.GPT``'s (see the terms below); never fused.
    ``device``: ``"cuda"``, or ``"cpu"``: a CPU run, whose step's tensors are host memory
    (``host_bytes`` = ``CPU_PROCESS_BYTES`` + the step's peak; ``gpu_bytes`` 0) and whose
    kernel is the reference, with its score matrices (``reference_scores_bytes``).
    ``documents``: document-masked attention, whose calls span the shard's rows of every
    sequence at once (it matters to the reference kernel's scores only).
    """
    _check_estimate_arguments(
        seq_len, cp, dp, batch_size, data_parallel, attention_kernel, device, precision, cpu_offload
    )
    plan = as_plan(plan).defaults_for(None)  # settings left to a run that none resolved: the plain model
    plan.check_decided("estimate")
    s = model_shape(config)
    if attention_kernel == "auto":  # the plan's backend; "auto" as the kernels will choose it
        chosen = plan.attention_backend
        attention_kernel = kernel_family(chosen) if chosen != "auto" else auto_attention_kernel(s.hd, -(-seq_len // cp))
    world = cp * dp
    T = batch_size * -(-seq_len // cp)
    mixed = precision == "bf16-mixed"
    fsdp = data_parallel == "fsdp"
    a = 2 if mixed else 4
    r = 2 if (mixed and fsdp) else 4
    d, V = s.d, s.V
    fused = bool(plan.fuse_pointwise) and not hf_modules
    tile = plan.mlp_tile_size
    tiled = tile is not None and tile < T
    ckpt = plan.activation_checkpointing
    N = s.params()
    Nl = s.layer_params()
    shard = world if fsdp else 1
    z = _Sizes(s, plan, cp, world, T, mixed, fsdp, a, r, fused, tile, tiled, ckpt, hf_modules, shard)
    layer_kw = dict(seq_len=seq_len, batch_size=batch_size, device=device, documents=documents)
    saved_layer, layer_live = _layer_bytes(z, attention_kernel, **layer_kw)
    # checkpointed_blocks: the first n blocks in the plan's mode, the later ones as "none"
    n_ckpt = s.L if plan.checkpointed_blocks is None or ckpt == "none" else min(plan.checkpointed_blocks, s.L)
    saved_plain, live_plain = (
        _layer_bytes(dataclasses.replace(z, ckpt="none"), attention_kernel, **layer_kw)
        if n_ckpt < s.L
        else (saved_layer, layer_live)
    )
    casts = float8_cast_bytes(s, T, tiled=tiled) if plan.float8 else 0

    # ---- offload: the first n layers' saved tensors in host memory. In the backward an
    # offloaded layer's tensors come back while the next one's are prefetched: two layers
    # on the GPU from block n on (one of them the last kept block's) down to block 0.
    n_off = _offload_layers(plan.offload_activations, s.L) if device == "cuda" else 0  # a no-op on CPU tensors
    per_layer_saved = saved_layer * T
    last_layers = max(s.L - n_off, 2 if n_off else 1)  # at the last layer's backward
    first_layers = 2 if n_off else 1  # late in the backward, with (nearly) every gradient
    if n_ckpt < s.L:  # (never offloaded: the plan refuses both) the last block keeps everything
        all_saved = (n_ckpt * saved_layer + (s.L - n_ckpt) * saved_plain) * T
        first = saved_layer if n_ckpt else saved_plain
        saved_at = (all_saved, all_saved, first * T)
        live_at = (live_plain, layer_live if n_ckpt else live_plain)
    else:
        saved_at = ((s.L - n_off) * per_layer_saved, last_layers * per_layer_saved, first_layers * per_layer_saved)
        live_at = (layer_live, layer_live)

    # ---- loss: one chunk's fp32 logits, their log-softmax, gradients; hidden + its grad
    c = min(plan.loss_chunk_size, T)
    head_grad_tmp = (a + 4) * V * d if mixed else 4 * V * d
    loss_chunk = 12 * V * c + a * V * c + head_grad_tmp
    hidden = 2 * r * d * T  # the last block's output and its gradient (the final norm runs per loss chunk)
    if hf_modules:  # transformers' final norm runs before the loss and keeps its own two (see norm)
        hidden += (4 + a) * d * T

    st = _static_bytes(
        z, N, Nl, data_parallel=data_parallel, cpu_offload=cpu_offload, keeps_casts=ckpt == "none" or n_ckpt < s.L
    )
    phases = _phases(
        z,
        st,
        saved_at=saved_at,
        live_at=live_at,
        loss_chunk=loss_chunk,
        hidden=hidden,
        casts=casts,
        cpu_offload=cpu_offload,
    )
    return _memory_estimate(
        phases, st, device=device, n_off=n_off, per_layer_saved=per_layer_saved, cpu_offload=cpu_offload, T=T, N=N
    )


def _check_estimate_arguments(
    seq_len: int,
    cp: int,
    dp: int,
    batch_size: int,
    data_parallel: str,
    attention_kernel: str,
    device: str,
    precision: str,
    cpu_offload: bool,
) -> None:
    for name, value in (("seq_len", seq_len), ("cp", cp), ("dp", dp), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if data_parallel not in ("fsdp", "ddp", "none"):
        raise ValueError(f"data_parallel must be 'fsdp', 'ddp' or 'none', got {data_parallel!r}")
    if attention_kernel not in ("auto", *KERNEL_FAMILIES):
        raise ValueError(f"attention_kernel must be 'auto' or one of {KERNEL_FAMILIES}, got {attention_kernel!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if precision not in ("bf16-mixed", "32-true"):
        raise ValueError(f"precision must be 'bf16-mixed' or '32-true', got {precision!r}")
    if cpu_offload and data_parallel != "fsdp":
        raise ValueError("cpu_offload needs data_parallel='fsdp'")


@dataclass(frozen=True)
class _Sizes:
    """What the parts of ``estimate`` share: the model's shape, the plan, the run's sizes and the
    bytes per element (``a``: the compute dtype's; ``r``: the residual stream's and saved inputs')."""

    s: _Shape
    plan: Any
    cp: int
    world: int
    T: int
    mixed: bool
    fsdp: bool
    a: int
    r: int
    fused: bool
    tile: Any
    tiled: bool
    ckpt: str
    hf_modules: bool
    shard: int


def ring_receive_buffers(cp: int) -> int:
    """K/V shards of receive buffers the ring's backward holds at once beyond the kept shard:
    none at cp = 2 (the kept shard is the only one), one at cp = 3, two from 4 on."""
    return min(max(cp - 2, 0), 2)


def _layer_bytes(z: _Sizes, attention_kernel: str, *, seq_len: int, batch_size: int, device: str, documents: bool):
    """One layer: the bytes it saves for the backward per token, and the most its backward holds
    at once beyond the saved tensors (recompute, gradients, the kernels' buffers)."""
    s, plan, cp, T, a, r = z.s, z.plan, z.cp, z.T, z.a, z.r
    mixed, fused, tile, tiled, ckpt, hf_modules = z.mixed, z.fused, z.tile, z.tiled, z.ckpt, z.hf_modules
    d, q, kv, F, hq = s.d, s.q, s.kv, s.F, s.hq
    # ---- one layer's tensors saved for the backward when nothing is checkpointed (per token)
    norm = 4 if not fused else 0  # RMSNorm saves its input (alive anyway) and an fp32 rstd
    if hf_modules:  # transformers' LlamaRMSNorm: the fp32 copy of its input and the normalised
        norm += 4 * d + a * d  # tensor before the gain (not the bf16 input: residual_mid is 0)
    casts_attn = 3 * 2 * d if (r == 4 and a == 2) else r * d  # each linear saves its own bf16 cast
    casts_mlp = 2 * 2 * d if (r == 4 and a == 2) else r * d
    rope = 0  # RoPE's products save only the (shared) cos/sin tables
    attn = a * (q + 2 * kv) + a * q + 4 * hq  # q, k, v, output, fp32 LSE
    ring_kept = 2 * a * kv if cp > 1 else 0  # rank+1's K/V shard, kept for the backward
    mlp_norm = norm
    if tiled:  # norm + MLP and norm + q/k/v projections tiled: they save only their inputs
        mlp, casts_mlp, mlp_norm = 0, 0, 0
        norm, casts_attn = 0, 0
    else:
        mlp = (3 if fused else 4) * a * F
    block_input = r * d
    # The residual between attention and MLP, saved as the MLP's input; not where a checkpointed
    # block's tiles take o_proj in (models.gpt's after_attention: they save x and y instead).
    o_tiled = tiled and ckpt != "none"
    residual_mid = 0 if hf_modules or o_tiled else r * d
    none_layer = block_input + norm + casts_attn + rope + attn + ring_kept + residual_mid + mlp_norm + casts_mlp + mlp
    mlp_part = mlp_norm + casts_mlp + mlp  # freed once the MLP's backward is done
    saved_layer = {
        "full": block_input,
        "selective": block_input + a * (q + 2 * kv) + a * q + 4 * hq + ring_kept,
        "none": none_layer,
    }[ckpt]

    # ---- the backward's own transients in one layer
    grad_io = r * d  # the residual stream's gradient inside the block (its input's: residual_grad)
    if tiled:
        t = min(tile, T)
        mlp_bwd_tokens = 0
        mlp_bwd_fixed = t * ((3 if fused else 4) * a * F + 2 * a * F + 2 * a * d + 4 * d) + 3 * d * F * 4 + a * d * T
        if o_tiled:  # o_proj in the tiles: the attention output's gradient and o_proj's fp32 sum
            mlp_bwd_fixed += a * q * T + 4 * d * q
    else:
        # down_proj's input gradient, then the product's two: the product itself is freed by then
        mlp_bwd_tokens, mlp_bwd_fixed = 2 * a * F, 0
    group = hq // s.hkv
    if mixed and group > 1 and attention_kernel == "cudnn":  # cuDNN takes no GQA: K/V expanded
        kernel = 2 * a * q + 2 * a * q + 8 * q + 8 * kv
    elif attention_kernel == "fa4":
        # dQ, dK, dV, FlashAttention-4's fp32 dQ accumulator and two fp32 values per query row
        # and head (dpsum, lse_log2); where query heads share K/V (GQA) also fp32 dK/dV
        # accumulators (flash_attn.cute.interface._flash_attn_bwd: dk_accum, dv_accum)
        kernel = a * q + 2 * a * kv + 4 * q + 8 * hq + (8 * kv if group > 1 else 0)
    else:
        kernel = 2 * a * q + 4 * q + 8 * kv
    if cp > 1:
        # the ring's fp32 dQ, K/V receive buffers and dK/dV accumulators (two, fp32)
        kv_buffers = ring_receive_buffers(cp)
        kernel += 4 * q + kv_buffers * 2 * a * kv + 2 * 2 * 4 * kv + 4 * hq
        if plan.cp_attention == "ulysses":
            kernel += 2 * a * (2 * q + 2 * kv)
    chunks = plan.attention_head_chunks
    attn_bwd = a * q + kernel / chunks  # dO, then the kernels' and the ring's buffers of one head group
    if chunks > 1:  # full-size dQ/dK/dV, and one group's dense copies of dO, q, k, v, out
        attn_bwd += a * (q + 2 * kv) + a * (3 * q + 2 * kv) / chunks
    scores = 0
    if device == "cpu":  # the CPU's kernel is the reference: its score matrices
        ulysses = plan.cp_attention == "ulysses" and cp > 1
        scores = reference_scores_bytes(s, seq_len, cp, batch_size, documents=documents, ulysses=ulysses) / chunks
    # In the MLP's backward the residual stream's gradient takes two paths (around and
    # through the MLP): their sum is a new tensor. By the attention's backward the MLP's
    # tensors and its saved input (residual_mid) are freed.
    grad_sum = r * d
    layer_live_mlp = (none_layer - block_input + grad_io + grad_sum + mlp_bwd_tokens) * T + mlp_bwd_fixed
    layer_live_attn = (none_layer - block_input - mlp_part - residual_mid + grad_io + attn_bwd) * T + scores
    layer_live = max(layer_live_mlp, layer_live_attn)
    if ckpt == "none":  # the layer's tensors are already counted in the saved ones
        layer_live -= saved_layer * T
    return saved_layer, layer_live


@dataclass(frozen=True)
class _StaticBytes:
    """Parameters, gradients and AdamW states, the bf16 working weights of each phase."""

    params_b: int
    grads_b: int
    adam_b: int
    root: int
    own_embedding: bool
    work_fwd_end: int
    work_bwd: int
    work_first: int
    gpu_static: dict
    gpu_head_grad: int
    gpu_grads_all: int
    gpu_grads_first: int


def _static_bytes(
    z: _Sizes, N: int, Nl: int, *, data_parallel: str, cpu_offload: bool, keeps_casts: bool
) -> _StaticBytes:
    """``keeps_casts``: some block is not checkpointed (autocast's weight casts stay cached)."""
    s, world, mixed, fsdp, shard = z.s, z.world, z.mixed, z.fsdp, z.shard
    d, V = s.d, s.V
    root = 0  # the root's unsharded weights: FSDP2 in mixed precision only
    # ---- static
    params_b = 4 * N // shard
    grads_b = 4 * N // shard
    adam_b = 8 * N // shard
    head_params = s.V * s.d * (1 if s.tied else 2) + s.d
    # FSDP2 shards an untied embedding as a unit of its own (longctx.parallel), resharded
    # after the forward until its own backward; the root keeps the head (and a tied table).
    own_embedding = fsdp and not s.tied
    if fsdp and mixed:
        in_flight_blocks = min(2, s.L)
        root = 2 * (V * d + d)  # unsharded bf16 head (or tied table) and final norm
        work_fwd_end = root + 2 * in_flight_blocks * Nl  # + current and prefetched block
        work_bwd = work_fwd_end + in_flight_blocks * (2 + 4) * Nl  # + their gradients (bf16 -> fp32)
        # Block 0's backward prefetches the unit used before it: an untied embedding's table.
        work_first = work_bwd + (2 * V * d if own_embedding else 0)
    elif mixed:
        mm = N - head_params + V * d  # matmul weights (the tied head is cast once)
        work_fwd_end = 2 * mm
        work_bwd = work_first = 2 * mm if keeps_casts else 2 * (Nl + V * d)
    else:
        work_bwd = work_first = work_fwd_end = 0
    ddp_buckets = 4 * N if (data_parallel == "ddp" and world > 1) else 0
    # The head's (the tied embedding's) gradient exists from the loss backward on (FSDP2:
    # unsharded, in the compute dtype, reduced at the end of the backward; else the fp32 .grad).
    # Under FSDP2 each block's gradient is reduced to its fp32 shard as soon as it is complete.
    gpu_head_grad = (2 if mixed else 4) * (V * d + d) if fsdp else 4 * head_params
    if cpu_offload:
        gpu_static = {}
        gpu_grads_all = gpu_grads_first = gpu_head_grad
    else:
        gpu_static = {"params": params_b, "adamw_states": adam_b}
        gpu_grads_all = (4 * s.L * Nl // shard + gpu_head_grad) if fsdp else grads_b
        # block 0's own gradient is reduced to its shard only after its backward
        gpu_grads_first = (4 * (s.L - 1) * Nl // shard + gpu_head_grad) if fsdp else grads_b
    if ddp_buckets:
        gpu_static["ddp_buckets"] = ddp_buckets
    return _StaticBytes(
        params_b,
        grads_b,
        adam_b,
        root,
        own_embedding,
        work_fwd_end,
        work_bwd,
        work_first,
        gpu_static,
        gpu_head_grad,
        gpu_grads_all,
        gpu_grads_first,
    )


def _phases(
    z: _Sizes,
    st: _StaticBytes,
    *,
    saved_at: tuple,
    live_at: tuple,
    loss_chunk: int,
    hidden: int,
    casts: int,
    cpu_offload: bool,
) -> list:
    """The step's phases, each (name, its GPU items): the loss backward, the last and the first
    layer's backward, the embedding's (FSDP2, untied), the optimizer step. ``saved_at``: the
    blocks' saved bytes on the GPU at the first three; ``live_at``: the layer being recomputed
    and differentiated at the last and the first layer's backward."""
    s, T, r, d, V, mixed, fsdp, shard = z.s, z.T, z.r, z.s.d, z.s.V, z.mixed, z.fsdp, z.shard
    N = s.params()
    gpu_static, gpu_head_grad, gpu_grads_all, gpu_grads_first = (
        st.gpu_static,
        st.gpu_head_grad,
        st.gpu_grads_all,
        st.gpu_grads_first,
    )
    work_fwd_end, work_bwd, work_first, root, own_embedding, grads_b = (
        st.work_fwd_end,
        st.work_bwd,
        st.work_first,
        st.root,
        st.own_embedding,
        st.grads_b,
    )

    def phase(name, saved, grads, working, transient_name, transient, extra=None):
        items = dict(gpu_static)
        items["gradients"] = grads
        items["bf16_working_weights"] = working
        items["saved_block_inputs"] = saved
        items["rope_tables"] = 4 * s.hd * T
        items[transient_name] = transient
        items.update(extra or {})
        return name, {k: int(v) for k, v in items.items() if v}

    phases = [
        phase(
            "the loss backward",
            saved_at[0],
            gpu_head_grad,
            work_fwd_end,
            "loss_chunk",
            loss_chunk,
            {"final_hidden": hidden},
        ),
        phase(
            "the last layer's backward",
            saved_at[1],
            gpu_head_grad,
            work_bwd,
            "layer_recompute_backward",
            live_at[0],
            {"residual_grad": r * d * T, "float8_casts": casts},
        ),
        phase(
            "the first layer's backward",
            saved_at[2],
            gpu_grads_first,
            work_first,
            "layer_recompute_backward",
            live_at[1],
            {"residual_grad": r * d * T, "float8_casts": casts},
        ),
    ]
    if own_embedding and mixed:  # the embedding gathered again, its unsharded gradient (bf16 -> fp32)
        phases.append(
            phase(
                "the embedding's backward",
                0,
                gpu_grads_all,
                root + 2 * V * d,
                "embedding_gradient",
                (2 + 4) * V * d,
                {"residual_grad": r * d * T},
            )
        )
    phases.append(
        phase(
            "the optimizer step",
            0,
            grads_b if (fsdp and not cpu_offload) else gpu_grads_all,
            0,
            "optimizer_temporaries",
            4 * N // shard if not cpu_offload else 0,
        )
    )
    for _, items in phases[3:]:  # after block 0's backward: no activations
        items.pop("saved_block_inputs", None)
        items.pop("rope_tables", None)
    return phases


def cpu_process_bytes() -> int:
    """A CPU rank's resident memory besides the step's tensors, for this build of torch."""
    import torch

    return CPU_PROCESS_BYTES + (CUDA_BUILD_PROCESS_BYTES if torch.version.cuda else 0)


def _memory_estimate(
    phases: list, st: _StaticBytes, *, device: str, n_off: int, per_layer_saved: int, cpu_offload: bool, T: int, N: int
) -> MemoryEstimate:
    """The estimate of the fullest phase: its GPU items (allocator slack, CUDA context) and the host's."""
    params_b, grads_b, adam_b = st.params_b, st.grads_b, st.adam_b
    totals = {n: sum(i.values()) for n, i in phases}
    first_step = max(sum(i.values()) - i.get("adamw_states", 0) for n, i in phases if n != "the optimizer step")
    name, items = max(phases, key=lambda p: sum(p[1].values()))
    allocated = sum(items.values())
    if device == "cpu":  # the step's tensors are the process's own memory
        host = {"process": cpu_process_bytes(), **items, "allocator_retained": int(CPU_RETAINED_FRACTION * allocated)}
        items = {}
    else:
        items["allocator_slack"] = int(SLACK_FRACTION * allocated)
        items["cuda_context"] = CUDA_CONTEXT_BYTES
        host = {"process": HOST_BASELINE_BYTES}
    gpu = sum(items.values())
    if n_off:
        host["offloaded_activations"] = n_off * _pow2(per_layer_saved)  # pinned, power-of-two blocks
    if cpu_offload:
        host["params_grads_adamw"] = params_b + grads_b + adam_b
    return MemoryEstimate(
        gpu_bytes=int(gpu),
        host_bytes=int(sum(host.values())),
        items=items,
        host_items=host,
        allocated_bytes=int(allocated),
        phase=name,
        tokens_per_rank=T,
        params=N,
        phases=totals,
        first_step_allocated_bytes=int(first_step),
    )


def reference_scores_bytes(s: _Shape, seq_len: int, cp: int, batch_size: int, *, documents: bool, ulysses: bool) -> int:
    """The reference kernel's (``backend="torch"``, ``longctx.kernels.reference``) largest
    moment: it materialises each call's (query rows x key rows) scores for every query head in
    the compute dtype (fp32), and its backward holds ``REFERENCE_SCORE_COPIES`` of them at once
    (probabilities, dP, dP - delta, dS; measured: 4.0 x, the forward 3 x). A call is one
    sequence's diagonal block under the ring (S/P rows; the off-diagonal steps are half
    blocks), the whole sequence over H/P heads under Ulysses, and with documents
    (``longctx.document_ring``) every sequence of the shard at once (B x S/P rows)."""
    rows = seq_len if ulysses else -(-seq_len // cp)
    heads = s.hq // cp if ulysses else s.hq
    pairs = (batch_size * rows) ** 2 if documents else batch_size * rows**2
    return REFERENCE_SCORE_COPIES * 4 * heads * pairs


def float8_cast_bytes(s: _Shape, T: int, *, tiled: bool) -> int:
    """The extra bytes of FP8 linears (``ParallelPlan(float8=True)``, torchao's ``Float8Linear``,
    compiled by ``longctx.float8.convert_to_float8``) at the largest moment of one layer's
    backward, counted from torchao 0.18's code.

    torchao saves the same high-precision input a bf16 linear saves (and the weight), so the
    saved activations do not change; each matmul casts its operands afresh. Compiled, a cast
    of n elements is an amax reduction and one fused scale-clamp-cast kernel: n bytes of
    result, no fp32 copy. The largest backward moment is the MLP's gate/up projections: their
    output gradient (tokens x F) cast twice (for the input and the weight gradient: 2 bytes a
    token), the input's 1-byte copy, and the weight's two 1-byte copies (as is and transposed).
    The scales are fp32 scalars (nothing at this scale). Counted conservatively (the largest of
    the layer's casts at every layer moment), and nothing counted for what FP8 saves (FSDP2's
    float8 all-gather holds 1-byte working weights where the model counts 2). With
    ``mlp_tile_size`` the tiled projections and MLP call their weights directly (bf16): only
    ``o_proj`` casts, a d x q matrix over ``T`` tokens."""
    widest = max(s.d, s.q) if tiled else max(s.F, s.d, s.q)
    weight = s.d * s.q if tiled else s.d * max(s.F, s.q)
    return int(T * (2 * widest + s.d) + 2 * weight)


def _pow2(n: int) -> int:
    """PyTorch's pinned host allocator hands out power-of-two blocks."""
    return 1 << (max(int(n), 1) - 1).bit_length()
