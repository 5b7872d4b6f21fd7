"""Every ``train.py`` command in README.md passes train.py's argument and config checks.

The commands are read from the README's code blocks (``python train.py ...`` and
``torchrun ... train.py ...``, also inside ``a && b`` chains and across ``\\`` line
continuations) and run, in-process, through ``train.prepare(argv, device_checks=False)``:
the parse, every component's own checks, the resume, the CP size against the world the
command asks for, the data module's sequence length: all that train.py checks before any
data work, less what needs the machine (a GPU command is checked on a CPU machine as the
GPU machine would see it). So a README command that train.py would refuse fails here.

``torchrun --nproc-per-node N [--nnodes M]`` sets ``WORLD_SIZE`` as torchrun does. A
``--resume runs/NAME`` command continues the run the README made before it: a run folder
as train.py leaves it (its config.yaml and a checkpoint halfway) stands in for it.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest
import torch
from helpers.train_script import load_train

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def readme_commands(text: str) -> list[list[str]]:
    """The argument lists of train.py in the README's code blocks (after ``train.py``),
    with the torchrun launch, if any, as ``["torchrun", nproc, nnodes]`` in front."""
    commands = []
    for block in BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;|\|", line):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                at = next((i for i, w in enumerate(words) if w == "train.py" or w.endswith("/train.py")), None)
                if at is None or at == 0:
                    continue  # prose in a code block (a file tree): not a command
                launcher = words[:at]
                if launcher[0] in ("python", "python3") and len(launcher) == 1:
                    commands.append((None, words[at + 1 :]))
                elif launcher[0] == "torchrun":
                    commands.append((_torchrun_world(launcher[1:]), words[at + 1 :]))
                else:
                    raise AssertionError(f"README runs train.py in a way this test does not know: {part!r}")
    return commands


def _torchrun_world(args: list[str]) -> int:
    options = {}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag.startswith("--"):
            options[flag.replace("_", "-")] = value if eq else args[i + 1]
    nnodes = options.get("--nnodes", "1").split(":")[-1]
    return int(options.get("--nproc-per-node", "1")) * int(nnodes)


COMMANDS = readme_commands((REPO / "README.md").read_text())


def _id(command) -> str:
    world, argv = command
    return (f"torchrun-{world} " if world else "") + " ".join(argv) or "(no arguments)"


def test_the_readme_has_train_commands():
    assert len(COMMANDS) >= 10, COMMANDS
    assert any(world for world, _ in COMMANDS), "no torchrun command found"
    assert (None, []) in COMMANDS, "the plain `python train.py` is among them"


@pytest.fixture(scope="module")
def train():
    module = load_train("train_readme_commands")
    return module


@pytest.fixture(scope="module")
def made_runs(train, tmp_path_factory) -> dict[str, Path]:
    """``runs/NAME`` of the commands that resume one: that run halfway, as train.py leaves it."""
    made = {}
    for _, argv in COMMANDS:
        for i, arg in enumerate(argv[:-1]):
            if arg == "--resume" and argv[i + 1] not in made:
                name = argv[i + 1]
                run = tmp_path_factory.mktemp("readme-run") / Path(name).name
                config = REPO / "configs" / f"{Path(name).name}.yaml"
                resolved = train.resolve_config(["--config", str(config)] if config.exists() else [])
                cfg = resolved.config
                cfg.run.output_dir = str(run)
                cfg.model.decay_steps = cfg.model.decay_steps or cfg.trainer.max_steps
                (run / "checkpoints").mkdir(parents=True)
                (run / "config.yaml").write_text(resolved.dump())
                torch.save(
                    {"global_step": cfg.trainer.max_steps // 2, "state_dict": {}}, run / "checkpoints" / "last.ckpt"
                )
                made[name] = run
    return made


@pytest.mark.parametrize("command", COMMANDS, ids=[_id(c) for c in COMMANDS])
def test_readme_command_passes_the_checks(train, made_runs, command, tmp_path, monkeypatch, capsys):
    world, argv = command
    argv = [str(made_runs.get(arg, arg)) if i and argv[i - 1] == "--resume" else arg for i, arg in enumerate(argv)]
    monkeypatch.chdir(REPO)  # the README's paths are the checkout's
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    if world is not None:  # what torchrun gives its rank 0
        for name, value in (("WORLD_SIZE", world), ("RANK", 0), ("LOCAL_RANK", 0), ("GROUP_RANK", 0)):
            monkeypatch.setenv(name, str(value))
    print_config = "--print_config" in argv
    start = time.monotonic()
    try:
        prepared = train.prepare(argv, device_checks=False)
    except SystemExit as e:  # --print_config prints and exits, as jsonargparse does
        assert print_config and e.code in (0, None), f"train.py {' '.join(argv)}: exit {e.code}"
        assert "model:" in capsys.readouterr().out
        return
    except Exception as e:  # what train.py would print as `train.py: error: ...`
        raise AssertionError(
            f"README command refused: train.py {' '.join(argv)}\ntrain.py: error: {train.one_line(e)}"
        ) from None
    assert not print_config, "--print_config should have printed and exited"
    assert prepared.trainer is None and prepared.run_lock is None  # checked only: nothing built or locked
    assert time.monotonic() - start < 20
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), "data work started"


@pytest.mark.parametrize(
    "sizes", [["--preset", "tiny"], ["--model.model.n_layer", "2"], ["--model.model", "{preset: tiny}"]]
)
def test_hf_model_with_model_sizes_given_as_flags_is_refused(train, sizes, monkeypatch):
    """A config's GPT sizes give way to --hf-model (the README pairing above); sizes the user
    gives on the command line with it are refused, before or after it."""
    monkeypatch.chdir(REPO)
    hf = ["--hf-model", "benchmarks/hf_configs/llama3.2-1b"]
    for argv in ([*hf, *sizes], [*sizes, *hf], ["--config", "configs/llama3.2-1b-128k.yaml", *hf, *sizes]):
        with pytest.raises(ValueError, match="hf_model takes the model from its directory"):
            train.prepare(argv, device_checks=False)
    cfg = train.resolve_config(["--config", "configs/llama3.2-1b-128k.yaml", *hf]).config
    assert cfg.model.model is None and cfg.model.hf_model == hf[1]
    assert train.resolve_config(["--config", "configs/llama3.2-1b-128k.yaml"]).config.model.model == {
        "preset": "llama3.2-1b"
    }
