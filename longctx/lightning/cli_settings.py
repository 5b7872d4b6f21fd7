"""What train.py's CLI decides for a run where its options leave it open (the accelerator, the
processes per node, the world a launcher set up, the vocabulary a tokenizer trained for the model
gets), and a parsed config as {dotted key: value}."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config (Namespace or dict) as {dotted key: value}."""
    if hasattr(tree, "as_dict"):
        tree = tree.as_dict()
    if not isinstance(tree, dict) or not tree and prefix:
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def layout_of(strategy: Any) -> str:
    """The layout a built strategy shards batches with (what the data module checks lengths for)."""
    return strategy.layout


def model_vocab(model: Any) -> int:
    """The vocabulary of the model section's model (a GPT's config, an HF directory's capped
    at 32768): what a tokenizer trained for it is asked for."""
    if model.hf_model is not None:
        import json

        return min(json.loads((Path(model.hf_model) / "config.json").read_text())["vocab_size"], 32768)
    from longctx.models import GPTConfig

    return GPTConfig.from_dict(model.model).vocab_size


def resolve_accelerator(accelerator: str) -> str:
    """ "auto" as the machine has it; a GPU asked for where none is: one line, not Lightning's."""
    import torch

    resolved = "gpu" if accelerator == "cuda" or accelerator == "auto" and torch.cuda.is_available() else accelerator
    resolved = "cpu" if resolved == "auto" else resolved
    if resolved == "gpu" and not torch.cuda.is_available():
        raise ValueError(
            f"accelerator {accelerator!r} needs a CUDA GPU and none is visible here; "
            "run on a GPU machine or pass --accelerator cpu (and a CPU-sized --config)"
        )
    return resolved


def resolve_devices(devices: Any, accelerator: str, context_parallel_size: Optional[int]) -> Any:
    """Processes per node: as given; on CPU "auto" is one process per CP rank."""
    if isinstance(devices, str) and devices.isdigit():
        return int(devices)
    if devices == "auto" and accelerator == "cpu":
        return context_parallel_size or 1
    return devices


def launched_world() -> Optional[int]:
    """The world an external launcher (torchrun) set up, if any."""
    return int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None


class UnreadTokenizer:
    """A GGUF tokenizer named (and its spec checked) but not read: reading it is data work."""

    vocab_size, eos_id, bos_id = 1, 0, None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("checked only: the GGUF tokenizer was not read")

    decode = encode
