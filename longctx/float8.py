"""FP8 training of the block projections and MLP (``ParallelPlan(float8=True)``), through
torchao's float8 linear layers (the optional extra ``longctx[float8]``).

``convert_to_float8(model, fsdp_all_gather=...)`` swaps the ``nn.Linear`` modules named like a
Llama block's projections (q/k/v/o, gate/up/down: ``GPT``'s and transformers' Llama-family
blocks alike) for torchao's ``Float8Linear``: dynamic tensorwise scales, e4m3 for inputs and
weights, e5m2 for gradients, the matmuls through ``torch._scaled_mm``. Never attention itself
(the ring and its block kernels stay bf16) and never the LM head (the chunked loss reads its
weight directly; the vocabulary projection is where FP8 hurts the loss most). Under FSDP2
(``fsdp_all_gather``) the weights are all-gathered in float8 (torchao's
``enable_fsdp_float8_all_gather``: half the bytes of bf16), and ``after_optimizer_step``
computes every such weight's scale in one all-reduce (``precompute_float8_dynamic_scale_for_fsdp``,
as torchtitan does).

What stays as it was: parameters keep their dtype (fp32 masters) and names, so state dicts have
the same keys, shapes and dtypes as without FP8 and checkpoints load either way. The projections
inside the sequence-tiled path (``mlp_tile_size``) call their weights directly, not the modules:
they run in bf16 there (``o_proj`` stays FP8 where no checkpointing runs, and joins the tiles
otherwise); the run plan says so.

Where it runs (``float8_refusal``): a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper,
Blackwell: FP8 tensor cores) with torchao installed.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import torch.nn as nn

EXTRA = "pip install 'longctx[float8]'"
MIN_CAPABILITY = (8, 9)
# The Linear modules FP8 applies to, by their name in the block (GPT and HF Llama-family alike).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# torch._scaled_mm needs both matmul dimensions divisible by 16.
DIM_MULTIPLE = 16


def float8_refusal(device) -> Optional[str]:
    """Why FP8 training cannot run on ``device`` (no sm89+ GPU, torchao missing), or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FP8 training needs an sm89+ GPU (Ada, Hopper or newer), not {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"FP8 training needs an sm89+ GPU (Ada, Hopper or newer); {name} is sm{major}{minor}"
    if not torchao_installed():
        return f"FP8 training needs torchao: {EXTRA}"
    return None


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def is_float8_target(module: nn.Module, fqn: str) -> bool:
    """The module filter: a block projection or MLP linear whose sizes FP8 matmuls take."""
    return (
        isinstance(module, nn.Linear)
        and fqn.rsplit(".", 1)[-1] in PROJECTIONS
        and module.in_features % DIM_MULTIPLE == 0
        and module.out_features % DIM_MULTIPLE == 0
    )


def convert_to_float8(model: nn.Module, *, fsdp_all_gather: bool, compile_linears: bool = True) -> int:
    """Swap ``model``'s block projections and MLP linears for torchao's ``Float8Linear`` (in
    place; before FSDP2 wraps them), each compiled (``compile_linears``). Returns how many;
    raises one line where torchao is missing or nothing qualifies."""
    if not torchao_installed():
        raise ImportError(f"float8=True needs torchao: {EXTRA}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    targets = [name for name, m in model.named_modules() if is_float8_target(m, name)]
    if not targets:
        raise ValueError(
            f"float8=True: {type(model).__name__} has no Linear named {'/'.join(PROJECTIONS)} with sizes "
            f"divisible by {DIM_MULTIPLE}: nothing would run in FP8"
        )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather)
    convert_to_float8_training(model, module_filter_fn=is_float8_target, config=config)
    if compile_linears:
        # Eager, each dynamic scale and cast is several kernels of its own, and FP8 is slower
        # than bf16 (benchmarks/NOTES.md); compiled, they fuse (torchao and torchtitan compile).
        for module in model.modules():
            if type(module).__name__ == "Float8Linear":
                module.compile()
    return len(targets)


def float8_modules(model: nn.Module) -> list[str]:
    """Names of ``model``'s modules that run in FP8 (torchao's ``Float8Linear``)."""
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def after_optimizer_step(model: nn.Module) -> None:
    """With float8 all-gather (FSDP2): the next step's weight scales, all at once (one
    all-reduce of the weights' amaxes instead of one per weight inside the all-gathers).
    torchao's own function; for a model with float8 layers (``float8_modules``)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
