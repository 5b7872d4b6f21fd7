#!/usr/bin/env python
"""Train a GPT with ring-attention context parallelism in a Lightning loop.

    python train.py                                   # tiny model, CP=2 on 2 CPU processes
    python train.py --config configs/gpt-350m-128k.yaml --context-parallel 8 --devices 8
    torchrun --nproc-per-node 8 train.py --config ... --devices 8   # or under SLURM (srun)

A LightningCLI over ``CausalLMModule`` (section ``model``), ``LongDocumentDataModule``
(``data``), ``ContextParallelStrategy`` (``strategy``), the ``Trainer`` (``trainer``), the
``NonFiniteGuard`` callback (``nonfinite``) and train.py's own ``run`` options: every option
is ``--SECTION.ARGUMENT`` (``--model.lr 1e-3``, ``--model.model.n_layer 4``), with the
class's default and docstring; YAML configs have the same shape. The short flags people
type are aliases of those keys (``--help`` lists both). ``--config`` files and flags apply
in order; without ``--config`` the base is configs/tiny-cpu.yaml. ``--print_config`` prints
the resolved config (loadable with ``--config``) and exits.

Outputs: OUTPUT_DIR/config.yaml (the resolved config, loadable with ``--config``),
metrics.csv, checkpoints/ (last.ckpt always the newest complete one), loss.png.
``--resume`` takes a checkpoint, a checkpoint directory or a run directory and continues
exactly where that checkpoint left off, from the run's own config.yaml (flags given then are
printed overrides). Every input mistake visible before launch is one ``train.py: error:``
line with exit code 2; a run folder is locked while a run writes to it.

Launching: with ``--devices N`` and no external launcher, Lightning starts the other N-1
processes itself by re-running this script (each re-run finds the tokenizer and corpus
caches ready). Under torchrun/SLURM the processes already exist and Lightning joins them.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from longctx.lightning.cli import (
    MODEL_SHAPE_KEYS,
    _UnreadTokenizer,
    check_sections,
    cli_class,
    expand_short_flags,
    flag_values,
    flatten,
    hf_model_drops_config_models,
    launched_world,
    one_line,
    resolve_accelerator,
    resolve_devices,
    run_dir_of,
)
from longctx.lightning.training import say

REPO = Path(__file__).resolve().parent
DEFAULT_CONFIG = REPO / "configs" / "tiny-cpu.yaml"

# The short flags people type -> the option each one sets.
SHORT_FLAGS = {
    "--context-parallel": "strategy.context_parallel_size",
    "--data-parallel": "strategy.data_parallel",
    "--layout": "strategy.layout",
    "--failure-timeout": "strategy.failure_timeout",
    "--stop-grace-period": "strategy.stop_grace_period",
    "--devices": "trainer.devices",
    "--num-nodes": "trainer.num_nodes",
    "--accelerator": "trainer.accelerator",
    "--precision": "trainer.precision",
    "--max-steps": "trainer.max_steps",
    "--accumulate-grad-batches": "trainer.accumulate_grad_batches",
    "--seq-len": "data.seq_len",
    "--batch-size": "data.batch_size",
    "--seed": "data.seed",
    "--data": "data.data_path",
    "--tokenizer": "data.tokenizer",
    "--preset": "model.model.preset",
    "--init-from": "model.init_from",
    "--hf-model": "model.hf_model",
    "--attention": "model.attention",
    "--lr": "model.lr",
    "--warmup-steps": "model.warmup_steps",
    "--decay-steps": "model.decay_steps",
    "--output-dir": "run.output_dir",
    "--val-every": "run.val_every",
    "--checkpoint-every": "run.checkpoint_every",
}
# ---- configuration -------------------------------------------------------------------------


@dataclass
class Resolved:
    config: Any  # the parsed options (a jsonargparse Namespace)
    parser: Any  # the CLI's parser: dumps ``config`` as YAML
    name: str  # the config file's stem: names the default output directory
    resume_checkpoint: Optional[Path] = None
    run_config: Optional[Any] = None  # the resumed run's own config.yaml, parsed
    overrides: dict = field(default_factory=dict)  # dotted key -> (run's value, value now), on resume

    def dump(self) -> str:
        return self.parser.dump(self.config, skip_unset=False)


def resolve_config(argv: list[str]) -> Resolved:
    """The options: configs/tiny-cpu.yaml (or a resumed run's own config.yaml) <- --config
    files <- flags, in order. On ``--resume`` flags not repeated keep the run's values; an
    explicit ``--config`` and flags given then are overrides (reported)."""
    # A Hugging Face model comes from its directory: the GPT sizes of configs read before it
    # are dropped (sizes given as flags are kept, and refused with it).
    args = hf_model_drops_config_models(expand_short_flags(argv, SHORT_FLAGS, REPO))
    configs = flag_values(args, "--config", "-c")
    for path in configs:
        check_sections(path)
    resume = flag_values(args, "--resume")
    resume_ckpt, run_yaml = None, None
    if resume and resume[-1] not in ("null", "None"):
        from longctx.lightning.checkpoint_io import find_resume_checkpoint

        resume_ckpt = find_resume_checkpoint(resume[-1])
        run_yaml = run_dir_of(resume_ckpt) / "config.yaml"
        run_yaml = run_yaml if run_yaml.exists() else None
        if run_yaml is not None:
            check_sections(str(run_yaml))  # a run from before train.py's LightningCLI: flat keys
    base = run_yaml or (None if configs else DEFAULT_CONFIG)
    cli = cli_class(__doc__.split("\n\n")[0], SHORT_FLAGS)([*(["--config", str(base)] if base else []), *args])
    cfg = cli.config
    run_cfg, overrides = None, {}
    if run_yaml is not None:
        run_cfg = cli.parser.parse_args(["--config", str(run_yaml)])
        before, now = flatten(run_cfg), flatten(cfg)
        overrides = {k: (before.get(k), v) for k, v in now.items()
                     if k not in ("config", "resume", "run.output_dir") and before.get(k) != v}
        if cfg.run.output_dir == run_cfg.run.output_dir:  # not given now: the folder the run is in
            cfg.run.output_dir = str(run_dir_of(resume_ckpt))
    name = Path(configs[-1]).stem if configs else DEFAULT_CONFIG.stem
    return Resolved(cfg, cli.parser, name, resume_ckpt, run_cfg, overrides)


def check_resume(resolved: Resolved) -> None:
    """Refuse a resume that cannot continue the run, and say what a flag changes."""
    cfg, ckpt, run = resolved.config, resolved.resume_checkpoint, resolved.run_config
    where = run_dir_of(ckpt) / "config.yaml"
    changed = [f"{k} {before} -> {now}" for k in MODEL_SHAPE_KEYS
               for before, now in [resolved.overrides.get(f"model.model.{k}", (None, None))] if before != now]
    if changed:
        raise ValueError(f"--resume {ckpt}: the checkpoint holds another model shape than asked for "
                         f"({', '.join(changed)}); resume with the run's model (drop those flags)")
    from longctx.lightning.checkpoint_io import checkpoint_step

    step = checkpoint_step(ckpt)  # the checkpoint was verified when resolve_config picked it
    max_steps = cfg.trainer.max_steps
    if step >= 0 and step >= max_steps:
        decay = cfg.model.decay_steps or max_steps
        raise ValueError(
            f"--resume {ckpt}: that run already finished (step {step} of --max-steps {max_steps}); to "
            f"train it further pass --max-steps N with N > {step} (the lr schedule still ends at step {decay}: "
            "add --decay-steps N to stretch it)"
        )
    if run is None:
        say(f"resume: {where} not found; using --config and flags as given")
        return
    changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in resolved.overrides.items())
    say(f"resume: the run's own config {where}" + (f"; overridden here: {changes}" if changes else ""))
    if "trainer.max_steps" in resolved.overrides and "model.decay_steps" not in resolved.overrides:
        say(f"resume: the lr schedule keeps ending at step {cfg.model.decay_steps} (--decay-steps N changes it)")


# ---- main -----------------------------------------------------------------------------------


@dataclass
class Prepared:
    """A run checked and built up to its data work: what main() goes on with."""
    resolved: Resolved
    out: Path
    run_lock: Any  # the run directory's lock (rank 0), held while this lives; None: checked only
    trainer: Any  # None: checked only (``device_checks=False``)
    datamodule: Any


def prepare(argv: list[str], *, device_checks: bool = True) -> Prepared:
    """Every mistake the command line can show, as one ValueError/FileNotFoundError/ArgumentError
    before any data work: jsonargparse's types first, then each component refusing its own
    values as it is built, its message said of the option (``model.lr must be ...``). The
    model is only checked here: it is built once the tokenizer fixes its vocabulary.

    ``device_checks=False`` checks what the command itself decides, on any machine (a GPU
    command on a CPU machine: tests/test_readme_commands.py): no CUDA needed for a GPU
    accelerator, no Trainer (so none of Lightning's device checks): the world is the
    launcher's (``WORLD_SIZE``) or devices x nodes, checked against the CP size as the
    strategy checks it; the model without the plan's kernel checks; no GGUF tokenizer read,
    no run directory locked."""
    resolved = resolve_config(argv)
    cfg = resolved.config
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from longctx.data import LongDocumentDataModule
    from longctx.lightning.health import NonFiniteGuard
    from longctx.lightning.run_dir import lock_run_dir, write_atomic
    from longctx.lightning.strategy import ContextParallelStrategy, _check_divisible
    from longctx.lightning.training import RunOptions, build_trainer, data_tokenizer, launch_rank
    from longctx.models import GGUFTokenizer, GPTConfig
    from longctx.models.checkpoint_import import check_checkpoint_spec
    from longctx.models.lit_module import CausalLMModule

    def build(sections: tuple[str, ...], make):
        try:
            return make()
        except (ValueError, TypeError, FileNotFoundError, MisconfigurationException) as e:
            message = str(e)
            option = message.split(" ", 1)[0].split(".")[0]  # parallel.cp_attention: of model.parallel
            section = next((s for s in sections if option in cfg[s].as_dict()), None)
            raise ValueError(f"{section}.{message}" if section else f"{sections[0]}: {message}") from None

    run = build(("run",), lambda: RunOptions(**cfg.run.as_dict()))
    guard = build(("nonfinite",), lambda: NonFiniteGuard(**cfg.nonfinite.as_dict()))
    build(("model",), lambda: CausalLMModule.check_arguments(**cfg.model.as_dict()))
    if resolved.resume_checkpoint is not None:
        check_resume(resolved)

    # The settings left to the run, pinned in its config.yaml.
    if device_checks or cfg.trainer.accelerator not in ("gpu", "cuda"):
        cfg.trainer.accelerator = resolve_accelerator(cfg.trainer.accelerator)
    else:
        cfg.trainer.accelerator = "gpu"  # checked only: this machine may have none
    accelerator = cfg.trainer.accelerator
    cfg.trainer.devices = resolve_devices(cfg, accelerator)
    if cfg.trainer.precision is None:
        cfg.trainer.precision = "bf16-mixed" if accelerator == "gpu" else "32-true"
    if cfg.model.decay_steps is None:  # pinned: extending max_steps on resume keeps the schedule
        cfg.model.decay_steps = cfg.trainer.max_steps
    # An HF model comes from its directory: a config's GPT sizes do not apply to it.
    cfg.model.model = None if cfg.model.hf_model is not None else dict(cfg.model.model or {})
    # A tokenizer trained on the corpus: its vocabulary, left at the data module's default,
    # follows the model's (an HF model: its own, capped at 32768).
    default_vocab = resolved.parser.get_defaults().data.vocab_size
    if cfg.data.tokenizer is None and cfg.model.init_from is None and cfg.data.vocab_size == default_vocab:
        if cfg.model.hf_model is not None:
            import json

            hf_vocab = json.loads((Path(cfg.model.hf_model) / "config.json").read_text())["vocab_size"]
            cfg.data.vocab_size = min(hf_vocab, 32768)
        else:
            cfg.data.vocab_size = GPTConfig.from_dict(cfg.model.model).vocab_size
    if cfg.run.output_dir is None:  # a resumed run continues in its own directory
        ckpt = resolved.resume_checkpoint
        cfg.run.output_dir = run.output_dir = str(run_dir_of(ckpt) if ckpt else Path("runs") / resolved.name)
    out = Path(run.output_dir)

    def write_config(trainer, _module) -> None:
        # At train start, i.e. after a resumed checkpoint was accepted: a rejected resume
        # leaves the run's config.yaml as it was. Without ``resume``: loaded with --config it
        # starts the same run afresh.
        if trainer.is_global_zero:
            cfg.resume = None
            cfg.model.parallel = _module.plan.to_dict()  # as the run decided it (memory check)
            write_atomic(out / "config.yaml", resolved.dump())

    # The world is known once the Trainer exists: a CP size that does not divide it is
    # refused there (by the strategy), before any process starts.
    strategy = build(("strategy",), lambda: ContextParallelStrategy(**cfg.strategy.as_dict()))
    tokenizer = lambda: data_tokenizer(cfg.data.tokenizer, cfg.model.init_from, cfg.model.hf_model)  # noqa: E731
    if device_checks:
        trainer = build(("strategy", "trainer"), lambda: build_trainer(
            cfg.trainer.as_dict(), strategy, run, out, [guard], on_train_start=write_config))
        build(("model",), lambda: CausalLMModule.check_arguments(**cfg.model.as_dict(),
                                                                  device=trainer.strategy.root_device))
        cp_size = strategy.cp_size
    else:  # the world as the command asks for it; the strategy's own check on it
        trainer, devices, nodes = None, cfg.trainer.devices, cfg.trainer.num_nodes
        per_node = len(devices) if isinstance(devices, (list, tuple)) else devices if isinstance(devices, int) else None
        world = launched_world()
        if world is not None and per_node is not None and per_node * nodes != world:
            raise ValueError(f"trainer.devices {devices} x num_nodes {nodes} does not match the launcher's world "
                             f"of {world} processes")
        world = world if world is not None else None if per_node is None else per_node * nodes
        if world is not None and cfg.strategy.context_parallel_size is not None:
            build(("strategy",), lambda: _check_divisible(world, cfg.strategy.context_parallel_size,
                                                          per_node, nodes))
        cp_size = cfg.strategy.context_parallel_size or world
        spec = cfg.data.tokenizer if cfg.data.tokenizer is not None else cfg.model.init_from
        if GGUFTokenizer.accepts(spec):
            tokenizer = lambda: (check_checkpoint_spec("tokenizer", spec), _UnreadTokenizer())[1]  # noqa: E731
    # The data module checks its sequence length against the CP size the strategy resolved.
    datamodule = build(("data",), lambda: LongDocumentDataModule(**{
        **cfg.data.as_dict(), "context_parallel_size": cp_size, "tokenizer": tokenizer()}))
    lock = lock_run_dir(out) if device_checks and launch_rank() == 0 else None
    return Prepared(resolved, out, lock, trainer, datamodule)


def main(argv: Optional[list[str]] = None) -> int:
    from argparse import ArgumentError

    try:  # every mistake the command line can show: one line, rc 2, before any data work
        run = prepare(list(sys.argv[1:] if argv is None else argv))
    except (ValueError, FileNotFoundError, ArgumentError) as e:
        print(f"train.py: error: {one_line(e)}", file=sys.stderr)
        return 2
    resolved, out, trainer, dm = run.resolved, run.out, run.trainer, run.datamodule
    cfg, resume = resolved.config, resolved.resume_checkpoint
    # Lightning noise that says nothing about this run: the logged values are already global
    # (so no sync_dist), and a pytree deprecation inside Lightning itself.
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # CausalLMModule's own hook computes per-document positions on the full batch: meant.
    warnings.filterwarnings("ignore", message=".*overridden `on_after_batch_transfer`.*")

    import lightning as L

    from longctx.lightning.run_dir import file_lock
    from longctx.lightning.training import describe_run, fit, say, summarize_run
    from longctx.models import GPTConfig
    from longctx.models.lit_module import CausalLMModule

    L.seed_everything(cfg.data.seed, workers=True, verbose=False)
    try:  # data first: the tokenizer fixes the vocabulary of a freshly initialised model
        with file_lock(dm.cache_dir / ".train-prepare.lock"):
            dm.prepare_data()  # tokenizer + tokenized corpus, cached: re-launched ranks hit the cache
    except (ValueError, FileNotFoundError) as e:  # the corpus or tokenizer cannot be used
        message = one_line(e)
        if "sentences_.empty()" in message:  # SentencePiece skipped every (over-long) line
            message += (" (every sampled line is longer than SentencePiece's 16384-byte sentence limit: "
                        "is the corpus one huge line? break it into lines)")
        print(f"train.py: error: data: {message}", file=sys.stderr)
        return 2
    vocab = dm.get_tokenizer().vocab_size
    model_args = cfg.model.as_dict()
    if cfg.model.init_from is None and cfg.model.hf_model is None:
        # The tokenizer may come out smaller than asked for (a small corpus); a model vocabulary
        # set larger than the tokenizer's (e.g. a Llama-shaped preset) is kept as configured.
        model_args["model"] = {**model_args["model"],
                               "vocab_size": max(vocab, GPTConfig.from_dict(model_args["model"]).vocab_size)}
    module = CausalLMModule(**model_args)
    if module.config.vocab_size < vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens but the model only {module.config.vocab_size}")
    if cfg.model.hf_model is None:
        cfg.model.model = {**cfg.model.model, "vocab_size": module.config.vocab_size}

    say(describe_run(trainer, module, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size, out=out,
                     resume=resume))
    stopped, code = fit(trainer, module, dm, resume)
    if code is not None:
        return code
    if trainer.is_global_zero:
        strategy = trainer.strategy
        title = f"{resolved.name}: dp {strategy.dp_size} x cp {strategy.cp_size}, seq_len {cfg.data.seq_len:,}"
        print(summarize_run(trainer, out, title=title, resumed=resume is not None, stopped=stopped), flush=True)
    return 0 if stopped is None else stopped.code


if __name__ == "__main__":
    sys.exit(main())
