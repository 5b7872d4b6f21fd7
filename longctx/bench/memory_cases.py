"""The full-depth memory cases that benchmarks/device/device_memory_full.sh runs (2 GPUs, FSDP2
over both, CP=2), each under its own time limit inside one device call:

    eval "$(python -m longctx.bench.memory_cases)"   # CASE_<name>, BUDGET_S, RESERVE_S, DEFAULT_CASES

The first run on 2 x H200 (fresh machine) showed the 8B cases need a call each: 8B at 128K was
killed at 210 s just after its first step (model init and data took ~2 min), 8B at 512K was
still starting at 150 s.

Each case names the plan its recorded results ran (full checkpointing; the 1B at 1M unfused):
the configs leave those to the GPU defaults now ("auto", fusion on), and a case re-run must
measure what the README's table shows.
"""

from __future__ import annotations

import shlex

CALL_S = 540  # the device tool's limit for one command
BUDGET_S = 535  # the script's default budget: a call, less the start of the script
RESERVE_S = 15  # of the budget, kept for the table and the tarball after the last case

# name -> (time limit in s, train.py arguments; the script replaces STEPS)
CASES = {
    # Llama-3-8B shape, 131,072 tokens (tokens/s and MFU of the last step)
    "8b_128k": (
        480,
        "--config configs/llama3-8b-128k.yaml --model.parallel.activation_checkpointing full --trainer.max_steps STEPS",
    ),
    # the same with activation checkpointing "auto" (selective where it is predicted to fit)
    "8b_128k_auto": (
        480,
        "--config configs/llama3-8b-128k.yaml --model.parallel.activation_checkpointing auto --trainer.max_steps STEPS",
    ),
    # transformers' Llama-3.2-1B (--hf-model), 131,072 tokens
    "hf_1b_128k": (
        120,
        "--config configs/llama3.2-1b-128k.yaml --hf-model benchmarks/hf_configs/llama3.2-1b --devices 2"
        " --context-parallel 2 --model.parallel.activation_checkpointing full --trainer.max_steps STEPS",
    ),
    # Llama-3.2-1B shape, 1,048,576 tokens, one step on packed files (document masking: plain
    # causal attention at 1M would take ~5 minutes alone)
    "1b_1m": (
        200,
        "--config configs/llama3.2-1b-128k.yaml --devices 2 --context-parallel 2 --seq-len 1048576"
        " --data.stdlib_documents file --attention document --trainer.max_steps 1"
        " --model.parallel.activation_checkpointing full --model.parallel.fuse_pointwise false",
    ),
    # Llama-3-8B shape, 524,288 tokens, one step on packed files, with the plan the memory
    # model's fitting_plan chooses (train.py prints "memory: ... running with")
    "8b_512k": (
        510,
        "--config configs/llama3-8b-128k.yaml --seq-len 524288 --data.stdlib_documents file"
        " --attention document --trainer.max_steps 1 --model.parallel.activation_checkpointing full",
    ),
}
DEFAULT_CASES = ("hf_1b_128k", "1b_1m")  # the cases that share one call when CASES is unset


def shell() -> str:
    """The cases and budget as shell assignments."""
    lines = [f"BUDGET_S={BUDGET_S}", f"RESERVE_S={RESERVE_S}", f"DEFAULT_CASES={shlex.quote(' '.join(DEFAULT_CASES))}"]
    lines += [f"CASE_{name}={shlex.quote(f'{limit} {args}')}" for name, (limit, args) in CASES.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(shell())
