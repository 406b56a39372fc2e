"""Models built from attngrad.layers: encoder-decoder, decoder-only and Llama-style Transformers."""

from . import decoder_only, encdec, llama
from .common import ModelConfig

MODELS = {"encdec": encdec, "decoder": decoder_only, "llama": llama}

__all__ = ["MODELS", "ModelConfig", "decoder_only", "encdec", "llama"]
