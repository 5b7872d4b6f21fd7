"""Passkey retrieval at depth: can the model find what it saw far back?

A random number (the key) is planted at a given depth of filler text (Mohtashami & Jaggi
2023, the passkey test of LongLoRA, YaRN and RULER's simplest needle); the prompt ends by
asking for it. Each sample is exactly ``length`` tokens:

    [bos] filler[:a] NEEDLE(key) filler[a:] QUESTION ANSWER(key)

with ``a = round(depth * filler tokens)``. The model is scored on the answer tokens with the
prompt teacher-forced, as a loss is: a sample is *retrieved* when every answer token is the
model's most likely next token (what greedy decoding would write), and its log-probability
is the mean over the answer tokens. No generation loop is needed, so one forward per batch of
samples (sharded over the CP group and run with ring attention exactly as training runs
it) scores them; the sums are all-reduced over the group, so every rank returns the same
table, and at P ranks the one process's.

``passkey_table`` returns lengths x depths of accuracy and mean log-probability (the JSON
evaluate.py writes); ``plot_passkey`` draws the accuracy heatmap.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longctx.layouts import check_seq_len, position_ids, shard_sequence

from .evaluation import fmt_size

IGNORE_INDEX = -100
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}"


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def _parts(tokenizer, key: int) -> tuple[list[int], list[int], list[int], list[int]]:
    bos = [] if getattr(tokenizer, "bos_id", None) is None else [tokenizer.bos_id]
    needle = _encode(tokenizer, " " + NEEDLE.format(key=key))
    return bos, needle, _encode(tokenizer, " " + QUESTION), _encode(tokenizer, ANSWER.format(key=key))


def passkey_overhead(tokenizer, digits: int = 5) -> int:
    """Tokens of a prompt that are not filler (bos, needle, question, answer) for a key of
    ``digits`` digits: a length must exceed it (by the filler the depths move through)."""
    return max(sum(map(len, _parts(tokenizer, int(c * digits)))) for c in "123456789")


def _too_short(length: int, fixed: int) -> ValueError:
    return ValueError(
        f"passkey length {length} is shorter than the needle, question and answer ({fixed} tokens "
        f"with this tokenizer): use lengths of at least {fixed}"
    )


def check_passkey_length(tokenizer, length: int, digits: int = 5) -> None:
    """Refuse a prompt length that cannot hold the needle, question and answer of every key."""
    fixed = passkey_overhead(tokenizer, digits)
    if length < fixed:
        raise _too_short(length, fixed)


def passkey_sample(tokenizer, length: int, depth: float, key: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, labels, needle position)`` of one sample, each ``(length,)`` tensor; the
    labels are the answer tokens (shifted), -100 elsewhere."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1], got {depth}")
    bos, needle, question, answer = _parts(tokenizer, key)
    filler_unit = _encode(tokenizer, " " + FILLER)
    fixed = len(bos) + len(needle) + len(question) + len(answer)
    n_filler = length - fixed
    if n_filler < 0 or not filler_unit:
        raise _too_short(length, fixed)
    filler = (filler_unit * (n_filler // len(filler_unit) + 1))[:n_filler]
    at = round(depth * n_filler)
    tokens = bos + filler[:at] + needle + filler[at:] + question + answer
    ids = torch.tensor(tokens, dtype=torch.int64)
    labels = torch.full_like(ids, IGNORE_INDEX)
    first = length - len(answer)  # the answer's first token, predicted at first - 1
    labels[first - 1 : length - 1] = ids[first:]
    return ids, labels, len(bos) + at


def passkey_keys(lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int, digits: int) -> dict:
    """The key of every (length, depth, trial): the same on every rank (one seeded generator)."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    return {(L, d, t): rng.randint(lo, hi) for L in lengths for d in depths for t in range(trials)}


@torch.no_grad()
def score_answers(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
) -> torch.Tensor:
    """Per row of the full ``(B, S)`` batch: ``(sum of label log-probs, correct tokens, label
    tokens)`` as a ``(B, 3)`` float64 tensor, the same on every rank. The batch is sharded over
    ``group`` as training shards it; only the labelled positions' logits are computed."""
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    device = model.lm_head_weight.device
    B, S = input_ids.shape
    if world > 1:
        ids = shard_sequence(input_ids, 1, rank=rank, world_size=world, layout=layout)
        lab = shard_sequence(labels, 1, rank=rank, world_size=world, layout=layout)
        pos = position_ids(S, rank=rank, world_size=world, layout=layout)
    else:
        ids, lab, pos = input_ids, labels, torch.arange(S)
    ids, lab, pos = ids.to(device), lab.to(device), pos.to(device)
    hidden = model.hidden_states(ids, pos.expand(B, -1))
    valid = lab != IGNORE_INDEX
    row = torch.arange(B, device=device)[:, None].expand_as(lab)[valid]
    target = lab[valid]
    logits = F.linear(hidden[valid], model.lm_head_weight)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]
    correct = logits.argmax(dim=-1) == target
    stats = torch.zeros((B, 3), dtype=torch.float64, device=device)
    stats[:, 0].index_add_(0, row, logp.double())
    stats[:, 1].index_add_(0, row, correct.double())
    stats[:, 2].index_add_(0, row, torch.ones_like(logp, dtype=torch.float64))
    if world > 1:
        dist.all_reduce(stats, group=group)
    return stats.cpu()


def check_passkey_lengths(lengths: Sequence[int], world: int, layout: str) -> None:
    for L in lengths:
        if world > 1:
            try:
                check_seq_len(L, world, layout)
            except ValueError as e:
                raise ValueError(f"passkey length: {e}") from None


def passkey_table(
    model,
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    *,
    trials: int = 2,
    seed: int = 0,
    digits: int = 5,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    batch_tokens: int = 131072,
) -> dict:
    """Accuracy and mean answer log-probability for every (length, depth), ``trials`` keys
    each; ``{"lengths", "depths", "accuracy": [[...]], "logprob": [[...]], "samples": [...]}``
    (rows: lengths, columns: depths). Every length must be one the CP group's layout splits."""
    if trials < 1:
        raise ValueError(f"passkey trials must be >= 1, got {trials}")
    world = 1 if group is None else dist.get_world_size(group)
    check_passkey_lengths(lengths, world, layout)
    keys = passkey_keys(lengths, depths, trials, seed, digits)
    samples = []
    for L in lengths:
        built = [(d, t, *passkey_sample(tokenizer, L, d, keys[(L, d, t)])) for d in depths for t in range(trials)]
        per_batch = max(1, batch_tokens // L)
        for start in range(0, len(built), per_batch):
            part = built[start : start + per_batch]
            stats = score_answers(
                model,
                torch.stack([b[2] for b in part]),
                torch.stack([b[3] for b in part]),
                group=group,
                layout=layout,
            )
            for (d, t, _, _, at), (lp, right, n) in zip(part, stats.tolist()):
                samples.append(
                    {
                        "length": L,
                        "depth": d,
                        "trial": t,
                        "key": keys[(L, d, t)],
                        "needle_at": at,
                        "retrieved": right == n,
                        "logprob": lp / n,
                    }
                )
    cell = {(s["length"], s["depth"]): [] for s in samples}
    for s in samples:
        cell[(s["length"], s["depth"])].append(s)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "lengths": list(lengths),
        "depths": list(depths),
        "trials": trials,
        "seed": seed,
        "accuracy": [[mean([float(s["retrieved"]) for s in cell[(L, d)]]) for d in depths] for L in lengths],
        "logprob": [[mean([s["logprob"] for s in cell[(L, d)]]) for d in depths] for L in lengths],
        "samples": samples,
    }


def format_passkey(table: dict) -> str:
    """The accuracy table as text, one row per length."""
    head = "length  " + " ".join(f"{d:>7.2f}" for d in table["depths"]) + "   (depth; accuracy, mean log-prob)"
    rows = [
        f"{fmt_size(L):>6}  " + " ".join(f"{a:>7.2f}" for a in acc) + f"   {sum(lp) / len(lp):8.3f}"
        for L, acc, lp in zip(table["lengths"], table["accuracy"], table["logprob"])
    ]
    return "\n".join([head, *rows])


def plot_passkey(table: dict, path, title: str = "passkey retrieval") -> None:
    """Heatmap of accuracy: lengths (rows) x depths (columns), each cell annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = table["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(table["depths"]), 1.2 + 0.5 * len(table["lengths"])))
    image = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
    ax.set_xticks(range(len(table["depths"])), [f"{d:g}" for d in table["depths"]])
    ax.set_yticks(range(len(table["lengths"])), [fmt_size(L) for L in table["lengths"]])
    for i, row in enumerate(acc):
        for j, a in enumerate(row):
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("depth of the key (0: start, 1: end of the filler)")
    ax.set_ylabel("prompt length (tokens)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
