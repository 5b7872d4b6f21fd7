"""benchmarks/long_context_ppl.py (its code: longctx.bench.long_context_ppl*) on CPU: a tiny
random GPT, a 512-piece SentencePiece model, two small stdlib packages (so windows cross
document boundaries and some labels are ignored).

* world 1: the token-weighted perplexity equals a float64 reference computed from full
  logits of the same windows, and the position buckets add up to the total;
* world 2 (gloo, ring attention, zigzag shards): the same numbers as world 1 within 1e-5;
* the CLI: a Lightning-style checkpoint (``model.``-prefixed state dict, config in
  ``hyper_parameters``) -> one JSON per RoPE theta -> ``--compare`` JSON + PNG.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.dist_harness import run_distributed

from longctx.bench import long_context_ppl as cli
from longctx.bench.long_context_ppl_eval import bucket_edges, evaluate, per_token_loss, window_indices
from longctx.bench.long_context_ppl_inputs import load_checkpoint_model, load_eval_stream, tree_corpus
from longctx.models import GPT, GPTConfig

DATA = "stdlib:json,tomllib"
SEQ_LENS = [64, 128]
EVAL = dict(max_sequences=3, edges=[16, 64], base_context=32, batch_tokens=256, loss_chunk=40)


def _tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("tiny", vocab_size=512))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from longctx.data import SentencePieceTokenizer
    from longctx.data.sources import resolve_corpus

    tmp = tmp_path_factory.mktemp("lcppl")
    texts = resolve_corpus(DATA).load()[0]["text"]
    tok = SentencePieceTokenizer.train(texts, vocab_size=512, max_chars=150_000)
    tok.save(tmp / "spm.model")
    tokens, docs, info = load_eval_stream(DATA, tok, split="all", cache_dir=str(tmp / "cache"))
    assert info["documents"] == 2 and len(tokens) > 3 * 128 + 1
    # Document ids cut every 100 tokens: every window then holds boundaries whose labels are
    # ignored (the two real documents meet at one place no window need cover).
    cut = np.arange(len(tokens), dtype=np.int32) // 100
    return dict(tmp=tmp, tokens=np.array(tokens), docs=np.array(docs), docs_cut=cut)


def _eval_rank(rank: int, world: int, tokens: np.ndarray, docs: np.ndarray) -> list:
    from longctx import CPContext, ParallelDims, parallelize

    model = _tiny_model().eval()
    group = dist.group.WORLD if world > 1 else None
    parallelize(model, ParallelDims(cp=CPContext(group)))
    return evaluate(model, tokens, docs, SEQ_LENS, group=group, **EVAL)


def _reference(model: GPT, tokens, docs, seq_len: int, windows: list, edges: list) -> tuple:
    """float64 per-bucket (loss sum, count) from full logits of whole windows, no chunking."""
    from longctx.data.packing import PackedSequenceDataset

    ds = PackedSequenceDataset(tokens, docs, seq_len)
    ref = model.double()
    sums, counts = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    with torch.no_grad():
        for i in windows:
            s = ds[i]
            logits = ref(s["input_ids"][None], s["position_ids"][None])[0]
            loss = F.cross_entropy(logits, s["labels"], ignore_index=-100, reduction="none")
            valid = s["labels"] != -100
            for b in range(len(edges) - 1):
                m = valid & (s["position_ids"] >= edges[b]) & (s["position_ids"] < edges[b + 1])
                sums[b] += float(loss[m].sum())
                counts[b] += int(m.sum())
    model.float()
    return sums, counts


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_single_rank_matches_reference_and_buckets_add_up(assets):
    model = _tiny_model().eval()
    results = evaluate(model, assets["tokens"], assets["docs_cut"], SEQ_LENS, **EVAL)
    assert [r["seq_len"] for r in results] == SEQ_LENS
    for r in results:
        S = r["seq_len"]
        edges = [b["lo"] for b in r["buckets"]] + [S]
        assert edges == bucket_edges(S, EVAL["edges"], EVAL["base_context"])
        assert r["n_windows"] == 3 and len(set(r["window_indices"])) == 3
        assert r["loss"] is not None and math.isfinite(r["loss"]) and r["ppl"] > 1
        # Buckets (and the base-context split) add up, token-weighted, to the total.
        n = sum(b["n_tokens"] for b in r["buckets"])
        assert n == r["n_tokens"] > 0
        assert _rel(sum(b["loss"] * b["n_tokens"] for b in r["buckets"]) / n, r["loss"]) < 1e-12
        w, bb = r["within_base_context"], r["beyond_base_context"]
        assert w["n_tokens"] + bb["n_tokens"] == n
        assert _rel((w["loss"] * w["n_tokens"] + bb["loss"] * bb["n_tokens"]) / n, r["loss"]) < 1e-12
        assert r["n_tokens"] < 3 * S  # labels crossing a document boundary are ignored
        # Against a float64 full-logits reference, per bucket.
        sums, counts = _reference(model, assets["tokens"], assets["docs_cut"], S, r["window_indices"], edges)
        assert [b["n_tokens"] for b in r["buckets"]] == counts.astype(int).tolist()
        for b, s, c in zip(r["buckets"], sums, counts):
            assert _rel(b["loss"], s / c) < 1e-5, (S, b, s / c)
        assert _rel(r["loss"], sums.sum() / counts.sum()) < 1e-5
        # Per-window numbers (for paired comparisons) sum to the buckets.
        pw = np.asarray(r["per_window"]["n_tokens"])
        assert pw.shape == (3, len(edges) - 1) and pw.sum(0).tolist() == counts.astype(int).tolist()
    # The chunked path agrees with the model's own chunked loss on one window.
    from longctx.data.packing import PackedSequenceDataset

    s = PackedSequenceDataset(assets["tokens"], assets["docs_cut"], 64)[1]
    assert (s["labels"] == -100).any()
    with torch.no_grad():
        loss_sum, n_tok = model.loss(s["input_ids"][None], s["labels"][None], s["position_ids"][None])
        mine = per_token_loss(
            model.hidden_states(s["input_ids"][None], s["position_ids"][None]),
            model.lm_head_weight,
            s["labels"][None],
            7,
        )
    assert _rel(float(mine.sum()), float(loss_sum)) < 1e-5


def test_context_parallel_2_equals_1(assets):
    one = _eval_rank(0, 1, assets["tokens"], assets["docs_cut"])
    two = run_distributed(_eval_rank, 2, assets["tokens"], assets["docs_cut"])
    for rank_res in two:
        for a, b in zip(rank_res, one):
            assert a["window_indices"] == b["window_indices"] and a["n_tokens"] == b["n_tokens"]
            assert math.isfinite(a["loss"])
            assert _rel(a["loss"], b["loss"]) < 1e-5
            for x, y in zip(a["buckets"], b["buckets"]):
                assert x["n_tokens"] == y["n_tokens"] and _rel(x["loss"], y["loss"]) < 1e-5


def test_cli_checkpoint_thetas_and_compare(assets, capsys):
    tmp = assets["tmp"]
    model = _tiny_model()
    # What CausalLMModule's Lightning checkpoint holds: the GPT under "model.", its config in
    # hyper_parameters["model"], and module state that is not the GPT's.
    ckpt = {
        "state_dict": {
            **{f"model.{k}": v for k, v in model.state_dict().items()},
            "val_loss.mean_value": torch.zeros(()),
        },
        "hyper_parameters": {"model": model.config.to_dict(), "lr": 1e-4},
        "global_step": 7,
    }
    torch.save(ckpt, tmp / "last.ckpt")
    out = tmp / "out"
    # On the CPU on every machine: the results are compared with `direct` (CPU, fp32) below.
    common = [
        "--tokenizer",
        str(tmp / "spm.model"),
        "--data",
        DATA,
        "--cache-dir",
        str(tmp / "cache"),
        "--seq-lens",
        "64,128",
        "--max-sequences",
        "3",
        "--bucket-edges",
        "16,64",
        "--base-context",
        "32",
        "--batch-tokens",
        "256",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert cli.main(["--checkpoint", str(tmp / "last.ckpt"), "--rope-theta", "1e4,1e6", "--tag", "ft"] + common) == 0
    files = [out / "long_context_ppl_ft-theta1e4.json", out / "long_context_ppl_ft-theta1e6.json"]
    runs = [json.loads(f.read_text()) for f in files]
    assert runs[0]["rope_theta"] == 1e4 and runs[1]["rope_theta"] == 1e6
    assert runs[0]["model"]["global_step"] == 7 and runs[0]["model"]["ignored_keys"] == 1
    # theta 1e4 is the tiny preset's own: the same numbers as evaluating the model directly.
    direct = evaluate(_tiny_model().eval(), assets["tokens"], assets["docs"], SEQ_LENS, **EVAL)
    for a, b in zip(runs[0]["results"], direct):
        assert a["window_indices"] == b["window_indices"] and _rel(a["loss"], b["loss"]) < 1e-6
    assert runs[0]["results"][1]["loss"] != runs[1]["results"][1]["loss"]  # RoPE change took effect

    assert cli.main(["--compare", str(files[0]), str(files[1]), "--out", str(out)]) == 0
    report = json.loads((out / "long_context_ppl_compare.json").read_text())
    assert (out / "long_context_ppl_compare.png").stat().st_size > 1000
    row = report["lengths"]["128"]["ft-theta1e6"]
    paired = row["paired_all"]
    assert paired["n_windows"] == 3
    expect = np.mean(
        [
            sum(s) / sum(n)
            for s, n in zip(
                runs[1]["results"][1]["per_window"]["loss_sum"], runs[1]["results"][1]["per_window"]["n_tokens"]
            )
        ]
    ) - np.mean(
        [
            sum(s) / sum(n)
            for s, n in zip(
                runs[0]["results"][1]["per_window"]["loss_sum"], runs[0]["results"][1]["per_window"]["n_tokens"]
            )
        ]
    )
    assert _rel(paired["mean_delta_loss"], float(expect)) < 1e-9
    assert _rel(row["rel_delta_ppl"], runs[1]["results"][1]["ppl"] / runs[0]["results"][1]["ppl"] - 1) < 1e-12
    assert "ft-theta1e6" in capsys.readouterr().out

    # A checkpoint that lacks a GPT tensor is refused, naming it.
    del ckpt["state_dict"]["model.norm.weight"]
    torch.save(ckpt, tmp / "broken.ckpt")
    with pytest.raises(ValueError, match="norm.weight"):
        load_checkpoint_model(str(tmp / "broken.ckpt"), {})


class _Payload:
    """Unpickling this runs os.makedirs: a stand-in for a malicious checkpoint's payload."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker),)


def test_checkpoint_with_pickled_code_is_refused_without_the_opt_in(tmp_path):
    model = _tiny_model()
    marker = tmp_path / "payload-ran"
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "hyper_parameters": {"model": model.config.to_dict()},
        "callback": _Payload(marker),
    }
    torch.save(ckpt, tmp_path / "evil.ckpt")
    for argv in ([], ["--checkpoint", str(tmp_path / "evil.ckpt")]):
        if argv:  # through the CLI too: the flag defaults to off
            args = cli.parse_args(argv + ["--seq-lens", "64"])
            assert args.trust_checkpoint_code is False
            call = lambda: cli.load_model(args, {})  # noqa: E731
        else:
            call = lambda: load_checkpoint_model(str(tmp_path / "evil.ckpt"), {})  # noqa: E731
        with pytest.raises(pickle.UnpicklingError, match="evil.ckpt holds objects .* --trust-checkpoint-code"):
            call()
        assert not marker.exists()
    # The documented opt-in does unpickle it (the payload runs: that is what the flag means).
    loaded, _ = load_checkpoint_model(str(tmp_path / "evil.ckpt"), {}, trust_code=True)
    assert marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_tree_corpus_and_parsing():
    ds, _ = tree_corpus("tree:email").load()  # a package found without importing it
    assert len(ds) >= 2 and "# file: mime/text.py" in "".join(ds["text"])  # one document per subdir
    with pytest.raises(ValueError, match="neither a directory nor an installed package"):
        tree_corpus("tree:no_such_package_xyz")
    assert cli.parse_sizes("8K,512,1m") == [8192, 512, 1 << 20]
    with pytest.raises(ValueError, match="not a token count"):
        cli.parse_size("8KB")
    assert window_indices(10, 3) == [0, 4, 9] and window_indices(2, 5) == [0, 1]
    assert bucket_edges(64, [16, 64, 128], 32) == [0, 16, 32, 64]
