"""What ``train.py --resume`` may change: the settings a resume cannot change without training
something else on the run's weights, the run folder of a checkpoint and the intact checkpoints
saved before it (a way out of one holding NaN/Inf)."""

from __future__ import annotations

from pathlib import Path

from longctx.models.checkpoint_import import SIZE_FIELDS


def run_dir_of(checkpoint: Path) -> Path:
    parent = checkpoint.parent
    return parent.parent if parent.name == "checkpoints" else parent


def earlier_checkpoints(checkpoint: Path, step: int) -> list[Path]:
    """The intact checkpoints beside ``checkpoint`` saved before ``step``, newest first."""
    from longctx.checkpoint_verify import checkpoint_step, is_complete_checkpoint

    found = []
    for other in checkpoint.parent.glob("*.ckpt"):
        try:
            other_step = checkpoint_step(other)
        except Exception:  # noqa: BLE001 - an unreadable one is no way out
            continue
        if other != checkpoint and 0 <= other_step < step and is_complete_checkpoint(other):
            found.append((other_step, other))
    return [path for _, path in sorted(found, reverse=True)]


# Settings a resume cannot change without training something else on the run's weights:
# what the token stream is (corpus, tokenizer, split, order) and what the model computes.
# Everything else (steps, schedule, cadence, precision, parallel layout, world size) is applied
# and said once.
DATA_KEYS = (
    "data_path",
    "text_column",
    "tokenizer",
    "vocab_size",
    "tokenizer_model_type",
    "tokenizer_train_chars",
    "val_fraction",
    "seed",
    "max_documents",
    "include_tests",
    "stdlib_documents",
    "mask_cross_document_labels",
)


MODEL_KEYS = ("attention", "rope_positions", "init_from", "hf_model")


MODEL_INFORMATIONAL = ("max_seq_len", "init_std")  # GPTConfig fields that change nothing once trained


def changes_what_is_trained(key: str) -> bool:
    """Whether a resume that changes option ``key`` (dotted) trains something else."""
    section, _, name = key.partition(".")
    if section == "data":
        return name in DATA_KEYS
    if section == "model" and name.startswith("model."):
        return name.removeprefix("model.") not in MODEL_INFORMATIONAL
    return section == "model" and name in MODEL_KEYS


MODEL_SHAPE_KEYS = ("preset", *SIZE_FIELDS)
