"""The long-document data pipeline: sources, tokenizer, packing, CP sampling, resume, errors.

Small and CPU-only: corpora are a few files or three stdlib packages, tokenizers are a
byte tokenizer (fast, exact) or a 512-piece SentencePiece model. Ranks are simulated by
constructing samplers with different ranks.
"""

from __future__ import annotations

import json
import pickle
import shutil
import time
import types
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.data import (
    IGNORE_INDEX,
    ContextParallelSampler,
    LongDocumentDataModule,
    ResumableDataLoader,
    SentencePieceTokenizer,
    TextTokenizer,
    as_text_tokenizer,
    build_default_corpus,
    dp_coordinates,
    list_stdlib_packages,
    resolve_corpus,
    split_documents,
)

STDLIB_SUBSET = "stdlib:json,html,tomllib"


class ByteTokenizer:
    """UTF-8 bytes as ids, plus EOS and BOS: exact and instant. No encode_batch (exercises map)."""

    vocab_size = 258
    eos_id = 256
    bos_id = 257
    fingerprint = "bytes-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def write_docs(root, docs: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, content in docs.items():
        (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())


def small_corpus(tmp_path, n=6, seed=0):
    rng = np.random.default_rng(seed)
    docs = {
        f"doc{i:02d}.txt": "".join(rng.choice(list("abcdefgh \n"), size=int(rng.integers(20, 60)))) for i in range(n)
    }
    write_docs(tmp_path / "corpus", docs)
    return tmp_path / "corpus"


def make_dm(path, tmp_path, **kw):
    args = dict(tokenizer=ByteTokenizer(), seq_len=16, batch_size=2, val_fraction=0.0, cache_dir=tmp_path / "cache")
    args.update(kw)
    return LongDocumentDataModule(path, **args)


# ---------------------------------------------------------------------------- sources
def test_text_directory_counts_bad_input(tmp_path):
    write_docs(
        tmp_path / "c",
        {
            "a.txt": "hello world\n",
            "empty.txt": "",
            "blank.txt": " \n\t\n",
            "image.bin": b"\x89PNG\x00\x00\x01",
            "latin.txt": b"caf\xe9 ok \xff\xfe end \xef\xbf\xbd genuine",  # 2 invalid runs + 1 real U+FFFD
            ".hidden": "ignored",
        },
    )
    docs, stats = resolve_corpus(tmp_path / "c").load()
    assert sorted(docs["text"]) == sorted(["hello world\n", "caf\ufffd ok \ufffd\ufffd end \ufffd genuine"])
    assert (stats.documents, stats.skipped_empty, stats.skipped_binary) == (2, 2, 1)
    assert (stats.decode_replacements, stats.files_with_replacements) == (3, 1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_corpus(tmp_path / "nope")
    (tmp_path / "void").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        resolve_corpus(tmp_path / "void")
    write_docs(tmp_path / "blank", {"x.txt": "", "y.txt": "\n\n"})
    with pytest.raises(ValueError, match="holds no text.*2 empty"):
        resolve_corpus(tmp_path / "blank").load()


def test_table_sources(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"body": ["first doc", "", "second doc", None, "third"], "n": [1, 2, 3, 4, 5]}
    ds = Dataset.from_dict(rows)
    (tmp_path / "j").mkdir()
    ds.to_json(tmp_path / "j" / "part.jsonl")
    (tmp_path / "j" / "README.md").write_text("not data")
    ds.to_parquet(tmp_path / "p.parquet")
    ds.save_to_disk(str(tmp_path / "saved"))
    shutil.copy(next((tmp_path / "saved").glob("*.arrow")), tmp_path / "a.arrow")
    DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    for src in ("j", "p.parquet", "saved", "a.arrow", "dd"):
        docs, stats = resolve_corpus(tmp_path / src, text_column="body", cache_dir=tmp_path / "cache").load()
        assert docs["text"] == ["first doc", "second doc", "third"], src
        assert stats.skipped_empty == 2 and docs.column_names == ["text"]
    docs, _ = resolve_corpus(tmp_path / "p.parquet", text_column="body", max_documents=2).load()
    assert docs["text"] == ["first doc", "second doc"]
    with pytest.raises(ValueError, match=r"no column 'text'.*\['body', 'n'\]"):
        resolve_corpus(tmp_path / "p.parquet").load()
    with pytest.raises(TypeError, match="must hold strings"):
        resolve_corpus(tmp_path / "p.parquet", text_column="n").load()


def test_stdlib_corpus_subset():
    names = list_stdlib_packages()
    assert {"<toplevel>", "json", "email", "asyncio"} <= set(names)
    assert "test" not in names and "site-packages" not in names
    docs, stats = build_default_corpus(["json", "html"])
    assert docs["name"] == ["json", "html"] and stats.documents == 2
    assert docs["text"][0].startswith("# file: json/__init__.py\n")
    assert "/test" not in "".join(docs["text"])
    with pytest.raises(ValueError, match="unknown stdlib package.*'nopkg'"):
        resolve_corpus("stdlib:json,nopkg")


def test_stdlib_corpus_file_documents(tmp_path):
    """unit='file': each .py file of the chosen packages is a document of its own."""
    packages, _ = build_default_corpus(["json"])
    files, stats = build_default_corpus(["json"], unit="file")
    assert stats.documents == len(files["name"]) > 1 and all(n.startswith("json/") for n in files["name"])
    assert "\n".join(files["text"]) == packages["text"][0]  # the same files, the same text
    by_file = resolve_corpus("stdlib:json", stdlib_documents="file")
    assert by_file.fingerprint != resolve_corpus("stdlib:json").fingerprint
    with pytest.raises(ValueError, match="stdlib document unit must be one of"):
        resolve_corpus(None, stdlib_documents="line")
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="applies to the default .stdlib. corpus only"):
        resolve_corpus(tmp_path, stdlib_documents="file")


# ---------------------------------------------------------------------------- tokenizer
@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory):
    docs, _ = build_default_corpus(["json", "html", "tomllib"])
    cache = tmp_path_factory.mktemp("spm")
    tok = SentencePieceTokenizer.train_or_load(
        lambda: docs["text"], corpus_fingerprint="fp", cache_dir=cache, vocab_size=512, max_chars=300_000
    )
    return tok, cache


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_sentencepiece_round_trips_any_text(spm_tok, text):
    tok = spm_tok[0]
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_sentencepiece_properties_and_cache(spm_tok):
    tok, cache = spm_tok
    assert isinstance(tok, TextTokenizer) and tok.vocab_size == 512
    assert tok.eos_id != tok.bos_id and tok.bos_id is not None
    code = "def f(x):\n\tif x:\r\n        return {'a': 1}  # ünïcode ✓ 😀\n"
    assert tok.decode(tok.encode(code)) == code
    assert len(tok.encode("    return value\n")) < len("    return value\n") / 2  # it learned something
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(code) == tok.encode(code) and clone.fingerprint == tok.fingerprint

    def no_text():
        raise AssertionError("a cache hit must not read the corpus")

    t0 = time.perf_counter()
    again = SentencePieceTokenizer.train_or_load(
        no_text, corpus_fingerprint="fp", cache_dir=cache, vocab_size=512, max_chars=300_000
    )
    assert again.fingerprint == tok.fingerprint and time.perf_counter() - t0 < 1.0
    path = next((cache / "tokenizers").glob("*.model"))
    assert as_text_tokenizer(str(path)).encode(code) == tok.encode(code)
    with pytest.raises(ValueError, match="vocab_size"):
        SentencePieceTokenizer.train(["abc"], vocab_size=100)


def test_as_text_tokenizer_adapts_and_rejects():
    class NoBos:
        vocab_size, eos_id = 5, 4

        def encode(self, t):
            return [0] * len(t)

        def decode(self, ids):
            return "x" * len(ids)

    wrapped = as_text_tokenizer(NoBos())
    assert wrapped.bos_id is None and wrapped.encode("ab") == [0, 0]
    tok = ByteTokenizer()
    assert as_text_tokenizer(tok) is tok
    with pytest.raises(TypeError, match=r"lacks \['encode', 'decode', 'vocab_size', 'eos_id'\]"):
        as_text_tokenizer(object())


# ---------------------------------------------------------------------------- data module
def test_default_corpus_builds_and_cache_is_reused(tmp_path):
    kw = dict(
        vocab_size=512,
        tokenizer_train_chars=300_000,
        seq_len=64,
        batch_size=4,
        val_fraction=0.1,
        cache_dir=tmp_path / "cache",
        context_parallel_size=2,
    )
    t0 = time.perf_counter()
    dm = LongDocumentDataModule(STDLIB_SUBSET, **kw)
    dm.prepare_data()
    dm.setup("fit")
    cold = time.perf_counter() - t0
    s = dm.stats
    assert s["documents"] == 3 and s["train_documents"] + s["val_documents"] == 3 and s["val_documents"] >= 1
    assert s["train_tokens"] + s["val_tokens"] == s["tokens"] + 3 * 2  # BOS + EOS per document
    assert s["train_sequences"] == (s["train_tokens"] - 1) // 64 and s["vocab_size"] == 512
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(v.shape == (4, 64) and v.dtype == torch.int64 for v in batch.values())
    assert torch.equal(batch["position_ids"], torch.arange(64).expand(4, 64))
    keep = batch["labels"][:, :-1] != IGNORE_INDEX
    assert torch.equal(batch["labels"][:, :-1][keep], batch["input_ids"][:, 1:][keep])
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape[1] == 64

    # Second run: nothing is read, trained or tokenized again; identical data.
    t0 = time.perf_counter()
    dm2 = LongDocumentDataModule(STDLIB_SUBSET, **kw)
    dm2._corpus.loader = lambda: (_ for _ in ()).throw(AssertionError("cache miss: corpus was read"))
    dm2.prepare_data()
    dm2.setup("fit")
    warm = time.perf_counter() - t0
    assert dm2.stats == dm.stats
    assert torch.equal(dm2.train_dataset[5]["input_ids"], dm.train_dataset[5]["input_ids"])
    assert warm < 3.0, (cold, warm)


def test_packing_separators_windows_and_split(tmp_path):
    """Documents shorter and longer than seq_len are packed across windows with separators."""
    corpus = small_corpus(tmp_path, n=8)  # 20..60 bytes each, seq_len 32
    S = 32
    ordered = [p.read_text() for p in sorted(corpus.iterdir())]
    assert min(map(len, ordered)) < S < max(map(len, ordered))
    dm = make_dm(corpus, tmp_path, val_fraction=0.25, seq_len=S, batch_size=1)
    dm.setup("fit")
    tok = ByteTokenizer()
    members, crossings = {}, 0
    for name, ds in (("train", dm.train_dataset), ("val", dm.val_dataset)):
        tokens, docs = ds._open()
        members[name] = set(np.unique(docs).tolist())
        expected = []
        for d in sorted(members[name]):
            expected += [tok.bos_id] + tok.encode(ordered[d]) + [tok.eos_id]
        assert tokens.tolist() == expected, name
        assert len(ds) == (len(expected) - 1) // S
        if len(ds) == 0:
            continue
        # Windows overlap by one token: inputs of all windows + the last label rebuild the stream.
        rebuilt = torch.cat([ds[i]["input_ids"] for i in range(len(ds))] + [ds[len(ds) - 1]["labels"][-1:]])
        assert rebuilt.tolist() == expected[: len(rebuilt)]
        for i in range(len(ds)):
            item = ds[i]
            here = torch.from_numpy(np.asarray(docs[i * S : i * S + S], np.int64))
            after = torch.from_numpy(np.asarray(docs[i * S + 1 : i * S + S + 1], np.int64))
            assert torch.equal(item["document_ids"], here)
            assert torch.equal(item["labels"] == IGNORE_INDEX, here != after)  # only cross-document labels
            crossings += int((here != after).sum())
    assert members["train"].isdisjoint(members["val"]) and members["train"] | members["val"] == set(range(8))
    assert len(members["val"]) >= 1 and len(dm.train_dataset) >= 3 and crossings >= 3


def test_split_documents_deterministic_by_seed():
    lengths = np.array([50, 0, 10, 200, 30, 30, 5, 80, 60, 40])
    a = split_documents(lengths, 0.2, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, split_documents(lengths, 0.2, seed=3)))
    train, val = a
    assert 1 not in train and 1 not in val and set(train) | set(val) == set(range(10)) - {1}
    assert lengths[val].sum() <= 0.2 * lengths.sum()
    assert any(not np.array_equal(val, split_documents(lengths, 0.2, seed=s)[1]) for s in range(4, 10))
    assert len(split_documents(lengths, 0.0, seed=0)[1]) == 0
    one_big = split_documents(np.array([1000, 3]), 0.01, seed=0)  # nothing fits: smallest doc goes to val
    assert one_big[1].tolist() == [1] and one_big[0].tolist() == [0]


def test_tokenize_with_processes_matches_single_process(tmp_path):
    corpus = small_corpus(tmp_path, n=10)
    one = make_dm(corpus, tmp_path / "a", num_proc=1)
    two = make_dm(corpus, tmp_path / "b", num_proc=2)
    for dm in (one, two):
        dm.setup("fit")
    assert np.array_equal(one.train_dataset._open()[0], two.train_dataset._open()[0])
    # Datasets pickle without their memory maps (workers reopen them).
    assert pickle.loads(pickle.dumps(one.train_dataset))._arrays is None


# ---------------------------------------------------------------------------- sampling
def test_cp_ranks_share_samples_dp_ranks_disjoint():
    n, world, cp = 50, 8, 2
    data = range(n)
    draws = {}
    for rank in range(world):
        dp_rank, dp_size = dp_coordinates(rank, world, cp)
        s = ContextParallelSampler(data, num_replicas=dp_size, rank=dp_rank, seed=7)
        s.set_epoch(3)
        draws[rank] = list(s)
    for rank in range(0, world, cp):
        assert all(draws[rank + c] == draws[rank] for c in range(cp))  # one CP group, one sample stream
    groups = [set(draws[r]) for r in range(0, world, cp)]
    assert all(len(g) == n // 4 for g in groups) and len(set().union(*groups)) == 4 * (n // 4)
    order = ContextParallelSampler(data, seed=7)
    order.set_epoch(3)
    assert set().union(*groups) == set(order.epoch_order()[: 4 * (n // 4)])  # consumed = a prefix
    again = ContextParallelSampler(data, num_replicas=4, rank=1, seed=7)
    again.set_epoch(3)
    assert list(again) == draws[2]
    again.set_epoch(4)
    assert list(again) != draws[2]
    with pytest.raises(ValueError, match="not divisible"):
        dp_coordinates(0, 6, 4)


def test_sampler_resume_exact_and_with_new_dp_size():
    data, batch = range(40), 3

    def loader(rank, dp, state=None):
        s = ContextParallelSampler(data, num_replicas=dp, rank=rank, seed=1)
        s.set_epoch(2)
        dl = ResumableDataLoader(torch.arange(40), batch_size=batch, sampler=s, drop_last=True)
        if state:
            dl.load_state_dict(state)
        return dl

    full = {r: [b.tolist() for b in loader(r, 2)] for r in range(2)}
    states, seen = {}, {}
    for r in range(2):
        dl = loader(r, 2)
        it = iter(dl)
        seen[r] = [next(it).tolist() for _ in range(4)]
        states[r] = dl.state_dict()
    assert states[0]["sampler"]["consumed"] == 4 * batch * 2 and states[0]["sampler"]["epoch"] == 2
    for r in range(2):
        rest = [b.tolist() for b in loader(r, 2, states[r])]
        assert seen[r] + rest == full[r]
        assert len(loader(r, 2, states[r])) == len(loader(r, 2))  # epoch length for progress accounting
    # Resuming on 4 replicas continues the same global order from the same point.
    order = ContextParallelSampler(data, seed=1)
    order.set_epoch(2)
    rest4 = [x for r in range(4) for b in loader(r, 4, states[0]) for x in b.tolist()]
    assert sorted(rest4) == sorted(order.epoch_order()[24 : 24 + len(rest4)]) and len(rest4) == 12
    # A new epoch starts from its beginning; a changed dataset restarts the epoch with a warning.
    s = ContextParallelSampler(data, seed=1)
    s.load_state_dict(states[0]["sampler"])
    s.set_epoch(3)
    assert len(list(s)) == 40
    other = ContextParallelSampler(range(30), seed=1)
    with pytest.warns(UserWarning, match="dataset_len"):
        other.load_state_dict(states[0]["sampler"])
    assert len(list(other)) == 30


def test_datamodule_state_dict_resume_without_lightning(tmp_path):
    corpus = small_corpus(tmp_path, n=10)
    dm = make_dm(corpus, tmp_path)
    dm.setup("fit")
    ref = [b["input_ids"] for b in dm.train_dataloader()]
    it = iter(dm.train_dataloader())
    head = [next(it)["input_ids"] for _ in range(3)]
    state = json.loads(json.dumps(dm.state_dict()))  # checkpoint-serialisable
    dm2 = make_dm(corpus, tmp_path)
    dm2.setup("fit")
    dm2.load_state_dict(state)
    tail = [b["input_ids"] for b in dm2.train_dataloader()]
    assert len(ref) > 4 and all(torch.equal(a, b) for a, b in zip(head + tail, ref)) and len(head + tail) == len(ref)


class _Recorder:
    """A LightningModule that records the samples each training step receives."""

    @staticmethod
    def make():
        import lightning as L

        class M(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(1))
                self.seen = []

            def training_step(self, batch, batch_idx):
                self.seen.append(batch["input_ids"].tolist())
                return (self.w**2).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return M()


def _fit(dm, ckpt_dir=None, ckpt_path=None, **trainer_kw):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = _Recorder.make()
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir,
                save_top_k=-1,
                filename="{epoch}-{step}",
                every_n_train_steps=trainer_kw.pop("every_n_train_steps", None),
                every_n_epochs=trainer_kw.pop("every_n_epochs", None),
            )
        )
    trainer = L.Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        limit_val_batches=0,
        accelerator="cpu",
        devices=1,
        **trainer_kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.parametrize("num_workers", [0, 1])
def test_lightning_resume_sees_the_same_samples(tmp_path, num_workers):
    """Checkpoint mid-epoch, at an epoch's last batch and in the next epoch; resume; compare."""
    corpus = small_corpus(tmp_path, n=6)

    def dm():
        return make_dm(corpus, tmp_path, num_workers=num_workers)

    reference = _fit(dm(), max_steps=14)
    probe = dm()
    probe.setup("fit")
    batches_per_epoch = len(probe.train_dataloader())
    assert 3 < batches_per_epoch < 13 and len(reference) == 14  # the run crosses an epoch boundary
    for k in (3, batches_per_epoch, batches_per_epoch + 1):
        ckpt_dir = tmp_path / f"ck{k}"
        first = _fit(dm(), ckpt_dir=ckpt_dir, max_steps=k, every_n_train_steps=k)
        (ckpt,) = ckpt_dir.glob(f"*step={k}.ckpt")
        rest = _fit(dm(), ckpt_path=str(ckpt), max_steps=14)
        assert first + rest == reference, f"resume after step {k}"
    # Epoch-based training resumed from an end-of-epoch checkpoint.
    ref_epochs = _fit(dm(), max_epochs=2)
    first = _fit(dm(), ckpt_dir=tmp_path / "ep", max_epochs=1, every_n_epochs=1)
    (ckpt,) = (tmp_path / "ep").glob("*.ckpt")
    assert first + _fit(dm(), ckpt_path=str(ckpt), max_epochs=2) == ref_epochs


# ---------------------------------------------------------------------------- errors
def test_arguments_are_checked_before_any_work(tmp_path):
    corpus = small_corpus(tmp_path)
    with pytest.raises(ValueError, match=r"sequence length 20 .*P=4.*multiple of 8"):
        make_dm(corpus, tmp_path, seq_len=20, context_parallel_size=4)
    for bad, match in [
        (dict(batch_size=0), "batch_size"),
        (dict(val_fraction=1.0), "val_fraction"),
        (dict(max_documents=0), "max_documents"),
        (dict(layout="diagonal"), "layout must be one of zigzag, contiguous, got"),
        (dict(num_workers=-1), "num_workers"),
        (dict(tokenizer=None, vocab_size=10), "vocab_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_dm(corpus, tmp_path, **bad)
    with pytest.raises(TypeError, match="not a tokenizer"):
        make_dm(corpus, tmp_path, tokenizer=object())
    with pytest.raises(FileNotFoundError, match="tokenizer path"):
        make_dm(corpus, tmp_path, tokenizer=str(tmp_path / "missing.model"))
    with pytest.raises(FileNotFoundError, match="corpus path"):
        make_dm(tmp_path / "missing", tmp_path)
    # The strategy's CP size (read from the trainer) is checked before the corpus is read.
    dm = make_dm(corpus, tmp_path, seq_len=20)
    dm._corpus.loader = lambda: (_ for _ in ()).throw(AssertionError("corpus read before validation"))
    dm.trainer = types.SimpleNamespace(
        strategy=types.SimpleNamespace(context_parallel_size=4), distributed_sampler_kwargs=None, is_global_zero=True
    )
    with pytest.raises(ValueError, match=r"sequence length 20 .*P=4"):
        dm.prepare_data()


def test_corpus_smaller_than_global_batch_and_bad_ids(tmp_path):
    corpus = small_corpus(tmp_path, n=3)
    dm = make_dm(corpus, tmp_path, batch_size=4)
    dm.trainer = types.SimpleNamespace(
        strategy=None, distributed_sampler_kwargs={"num_replicas": 4, "rank": 1}, is_global_zero=True
    )
    for _ in range(2):  # a failed setup leaves nothing half set up: a second call fails the same way
        with pytest.raises(ValueError, match=r"seq_len\+1=17 .*batch_size 4 x data-parallel size 4 = 16"):
            dm.setup("fit")
    small = make_dm(corpus, tmp_path, batch_size=1)
    small._corpus.loader = lambda: (_ for _ in ()).throw(AssertionError("retry re-read the corpus"))
    small.setup("fit")  # the retry reuses the tokenized corpus
    assert small.stats["train_sequences"] >= 1

    class Overflow(ByteTokenizer):
        vocab_size = 200  # bytes >= 200 fall outside
        fingerprint = "overflow"

    write_docs(tmp_path / "hi", {"a.txt": "smile \U0001f600 " * 10})  # UTF-8 lead byte 240
    with pytest.raises(ValueError, match=r"ids in \[\d+, 2\d\d\], outside its vocab_size 200"):
        make_dm(tmp_path / "hi", tmp_path, tokenizer=Overflow()).setup("fit")


def test_damaged_caches_are_rebuilt(tmp_path, caplog):
    """A packed token stream cut short on disk (np.load: "mmap length is greater than file
    size"), a truncated tokenized Arrow file, a damaged cached tokenizer: found before use,
    named in a warning, and built again, with the same data as before."""
    corpus = small_corpus(tmp_path, n=8)
    dm = make_dm(corpus, tmp_path, val_fraction=0.25)
    dm.setup("fit")
    expected = dm.train_dataset[1]["input_ids"].clone()
    packed = dm._packed_dir
    tokenized = next((tmp_path / "cache" / "tokenized").iterdir())
    stream = packed / "train.tokens.npy"
    stream.write_bytes(stream.read_bytes()[:-40])
    with pytest.raises(ValueError, match="mmap length is greater than file size"):
        np.load(stream, mmap_mode="r")  # what every rank met before
    arrow = next(tokenized.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-100])
    with caplog.at_level("WARNING", logger="longctx.data"):
        again = make_dm(corpus, tmp_path, val_fraction=0.25)
        again.setup("fit")
    damaged = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(damaged) == 2, damaged
    assert f"{arrow} has " in damaged[0] and "building it again" in damaged[0]
    assert f"{stream} does not load (mmap length is greater than file size)" in damaged[1]
    assert torch.equal(again.train_dataset[1]["input_ids"], expected)
    caplog.clear()
    with caplog.at_level("WARNING", logger="longctx.data"):  # healed: reused without a word
        make_dm(corpus, tmp_path, val_fraction=0.25).setup("fit")
    assert not caplog.records


def test_damaged_cached_tokenizer_is_trained_again(tmp_path, caplog):
    lines = [f"def f{i}(x):\n    return x + {i}\n" for i in range(300)]
    kw = dict(corpus_fingerprint="c", cache_dir=tmp_path, vocab_size=300, max_chars=100_000)
    tok = SentencePieceTokenizer.train_or_load(lambda: lines, **kw)
    (model,) = (tmp_path / "tokenizers").glob("*.model")
    intact = model.read_bytes()
    for damage in (intact[:500], intact[:-1] + bytes([intact[-1] ^ 1])):  # cut short; one bit (still parses)
        model.write_bytes(damage)
        with caplog.at_level("WARNING", logger="longctx.data"):
            again = SentencePieceTokenizer.train_or_load(lambda: lines, **kw)
        assert any(f"the cached model {model} is damaged" in m for m in caplog.messages), caplog.messages
        assert again.fingerprint == tok.fingerprint
        caplog.clear()
