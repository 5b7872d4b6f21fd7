"""train.py loaded as a module (it is a script, not part of the package), for tests that
call its functions in-process; and launched (``run_train``), with the short runs ``SMALL`` and ``TINY``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_train(name: str):
    """A fresh module of train.py registered as ``name``."""
    spec = importlib.util.spec_from_file_location(name, REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TRAIN = REPO / "train.py"
# A short CP=2 run of the tiny preset on CPU (tests/lightning/conftest.py's ``full_run``): 6
# steps, checkpoints at 3 and 6, validation every 3.
SMALL = [
    *("--data", "stdlib:json,email,http,logging,xml", "--preset", "tiny", "--model.model.vocab_size", "512"),
    *("--seq-len", "64", "--batch-size", "2", "--max-steps", "6", "--lr", "3e-3", "--warmup-steps", "2"),
    *("--context-parallel", "2", "--devices", "2", "--accelerator", "cpu", "--precision", "32-true"),
    *("--checkpoint-every", "3", "--run.keep_checkpoints", "-1", "--val-every", "3", "--run.val_batches", "2"),
    *("--trainer.enable_progress_bar", "false"),
    *("--model.weight_decay", "0.05"),  # no short flag: the option comes from CausalLMModule's signature
]


# One process of the tiny preset on CPU, no validation: the run evaluate.py, --init-from and the
# sharded-checkpoint tests train (they add steps, checkpoints and the output folder).
TINY = [
    *("--data", "stdlib:json,email", "--preset", "tiny", "--model.model.vocab_size", "512"),
    *("--seq-len", "64", "--batch-size", "2", "--warmup-steps", "1"),
    *("--context-parallel", "1", "--devices", "1", "--accelerator", "cpu", "--val-every", "0"),
    *("--trainer.enable_progress_bar", "false"),
]


# What an in-process fit earlier in the session may have left in os.environ (its process group
# may still hold that port): a run launched or fitted afterwards must pick its own.
RENDEZVOUS_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_env(cache_dir=None, **extra: str) -> dict:
    """This process's environment for a job launched as its own: without the rendezvous
    variables, with its own tokenizer cache where ``cache_dir`` is given."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    if cache_dir is not None:
        env["LONGCTX_CACHE_DIR"] = str(cache_dir)
    return {**env, **extra}


def clear_rendezvous(monkeypatch) -> None:
    """``launch_env`` for a fit in this process (the test's ``monkeypatch`` restores them)."""
    for name in RENDEZVOUS_VARS:
        monkeypatch.delenv(name, raising=False)


def run_train(args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` from the repository's root, output captured."""
    return subprocess.run(
        [sys.executable, str(TRAIN), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
