"""longctx.models: a Llama-style GPT with ring attention, checkpoint import/export, GGUF tokenizer.

Torch only: the LightningModule that trains it is ``longctx.lightning.module.CausalLMModule``.
"""

from .checkpoint_import import find_smollm2_gguf, load_checkpoint, load_pretrained, resolve_checkpoint_path
from .config import PRESETS, GPTConfig
from .gguf_tokenizer import GGUFTokenizer
from .gpt import GPT, RingSelfAttention, SwiGLU, TransformerBlock, chunked_cross_entropy
from .hf_export import save_hf_checkpoint
from .pointwise import RMSNorm, apply_rope, rope_cos_sin

__all__ = [
    "GPT",
    "GPTConfig",
    "PRESETS",
    "RingSelfAttention",
    "RMSNorm",
    "SwiGLU",
    "TransformerBlock",
    "apply_rope",
    "chunked_cross_entropy",
    "rope_cos_sin",
    "find_smollm2_gguf",
    "load_checkpoint",
    "load_pretrained",
    "resolve_checkpoint_path",
    "GGUFTokenizer",
    "save_hf_checkpoint",
]
