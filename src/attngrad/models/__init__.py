"""Models built from attngrad.nn: encoder-decoder and decoder-only Transformers."""

from . import decoder_only, encdec
from .common import ModelConfig

MODELS = {"encdec": encdec, "decoder": decoder_only}

__all__ = ["MODELS", "ModelConfig", "decoder_only", "encdec"]
