"""Models built from attngrad.layers: encoder-decoder, decoder-only, Llama-style and GPT-2
Transformers, and Hugging Face GPT-2, Llama, Qwen2, Qwen3 and Mistral directories read and written
(:func:`load_pretrained`, :func:`save_pretrained`)."""

from . import decoder_only, encdec, gpt2, llama
from .common import ModelConfig
from .gpt2 import GPT2Config
from .pretrained import PretrainedModel, load_pretrained, save_pretrained

MODELS = {"encdec": encdec, "decoder": decoder_only, "llama": llama, "gpt2": gpt2}

__all__ = [
    "MODELS",
    "GPT2Config",
    "ModelConfig",
    "PretrainedModel",
    "decoder_only",
    "encdec",
    "gpt2",
    "llama",
    "load_pretrained",
    "save_pretrained",
]
