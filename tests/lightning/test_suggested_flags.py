"""Every train.py flag that a message of the library suggests is one train.py takes.

Error messages and hints (longctx/, models/, kernels/; not longctx/bench, whose strings are
the benchmarks' own command lines) name CLI flags for users to pass; a renamed option must
not leave a hint behind that train.py would refuse. Each flag found in
their string constants runs through train.py's argument and config checks with a value of
its kind; refusing a value for what it means (a ValueError) is fine, an unknown option is not.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers.train_script import load_train

REPO = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_.<>-]*[a-z0-9_>])(?![\w.])")
# Flags of other programs named in library strings.
NOT_TRAIN_PY = {
    "--no-deps": "pip",
    "--sections": "benchmarks/ring.py",
    "--nproc-per-node": "torchrun",
    "--max-sequences": "evaluate.py",
    "--trust-checkpoint-code": "evaluate.py",
}
# A value of each flag's kind (a new hint names a flag missing here: add one).
VALUES = {
    "--config": ["configs/tiny-cpu.yaml"],
    "--data": ["stdlib:json"],
    "--init-from": ["runs/no-such-run"],
    "--lr": ["1e-4"],
    "--nonfinite.policy": ["skip"],
    "--preset": ["tiny"],
    "--context-parallel": ["2"],
    "--data-parallel": ["ddp"],
    "--devices": ["2"],
    "--hf-model": ["benchmarks/hf_configs/llama3.2-1b"],
    "--accelerator": ["cpu"],
    "--max-steps": ["400"],
    "--decay-steps": ["400"],
    "--model.hf_model": ["benchmarks/hf_configs/llama3.2-1b"],
    "--model.model": ["null"],
    "--model.parallel.<key>": ["--model.parallel.loss_chunk_size", "2048"],
    "--model.parallel.activation_checkpointing": ["full"],
    "--model.parallel.fuse_pointwise": ["false"],
    "--output-dir": ["runs/suggested-flag"],
    "--print_config": None,
    "--help": None,
    "--resume": None,
    "--stop-grace-period": ["30"],
    "--strategy.cpu_offload": ["true"],
    "--eval-every": ["50"],
    "--checkpoint-every": ["0"],
    "--eval.lengths": ["[256]"],
    "--eval.depths": ["[0, 1]"],
    "--seq-len": ["1024"],
    "--batch-size": ["1"],
    "--model.memory_check": ["false"],
}


def suggested_flags() -> dict:
    found = {}
    library = [p for p in (REPO / "longctx").rglob("*.py") if "bench" not in p.relative_to(REPO / "longctx").parts]
    files = [*library, *(REPO / "models").glob("*.py"), *(REPO / "kernels").glob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for flag in FLAG.findall(node.value):
                    if flag not in NOT_TRAIN_PY:
                        found.setdefault(flag, path.relative_to(REPO).as_posix())
    return found


FLAGS = suggested_flags()


def test_the_scan_finds_the_hints():
    assert {
        "--model.parallel.activation_checkpointing",
        "--strategy.cpu_offload",
        "--data-parallel",
        "--model.parallel.fuse_pointwise",
    } <= set(FLAGS)


@pytest.fixture(scope="module")
def train():
    return load_train("train_suggested_flags")


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_suggested_flag_is_an_option_of_train_py(flag, train, monkeypatch, tmp_path):
    from jsonargparse import ArgumentError

    assert flag in VALUES, f"{FLAGS[flag]} suggests {flag}: add a value of its kind to VALUES"
    value = VALUES[flag]
    if value is None:  # prints and stops, or needs a run: their own tests (test_train_cli, test_readme_commands)
        return
    monkeypatch.chdir(REPO)
    argv = value if flag.endswith("<key>") else [flag, *value]
    try:
        train.prepare(argv, device_checks=False)
    except ArgumentError as error:
        pytest.fail(f"{FLAGS[flag]} suggests {flag}, which train.py refuses: {error}")
    except ValueError:
        pass  # the option exists; this value alone is refused for what it means
