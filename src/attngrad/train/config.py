"""The options of a training run: :class:`TrainConfig`, its flat form (the checkpoint's and
the command line's spelling) and which options a resumed run may change."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..models import MODELS, ModelConfig
from ..models.gpt2 import GPT2Config
from ..models.llama import LlamaConfig
from . import data as D
from . import text as T
from . import tokenizer as K
from .optim import AdamWConfig


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run.  The defaults train reverse (lengths 8-16, 16
    symbols) to >= 99 % held-out exact match in a few minutes on 2 CPU cores."""

    task: str = "reverse"
    model: str = "encdec"
    steps: int = 1500
    batch_size: int = 64
    symbols: int = 16
    min_len: int = 8
    max_len: int = 16
    dim: int = 64
    heads: int = 4
    ffn: int = 128
    layers: int = 2  # encoder layers and decoder layers each
    activation: str = "relu"
    kv_heads: int | None = None  # llama: key/value heads (None: heads; fewer = grouped-query)
    tie_embeddings: bool = False  # llama: logits = RMSNorm(x) Emb^T
    qk_norm: str | None = None  # llama: None, "rms" or "layer" (per-head norm of q and k)
    dropout: float = 0.0
    label_smoothing: float = 0.0
    optim: AdamWConfig = field(default_factory=AdamWConfig)  # lr, warmup, schedule floor, weight decay, clipping
    seed: int = 0
    dtype: str = "float32"
    eval_every: int = 250
    eval_size: int = 512
    ckpt_every: int = 250
    keep_ckpts: int = 2
    data: str | None = None  # a UTF-8 file, a folder of .txt files or token shards: a language model (train/text.py)
    context: int = 64  # text: window length T (bytes)
    val_fraction: float = 0.1  # text: the held-out tail of the file
    tokenizer: str = "bytes"  # text: "bytes", "bpe", "pretrained" (the --init-from model's) or "ids" (train/tokenizer.py)
    vocab_size: int | None = None  # text, bpe: the vocabulary (None: 512); pretrained: the tokenizer's size
    grad_accum: int = 1  # micro-batches of batch_size per update (their token-weighted mean gradient)
    init_from: str | None = None  # a Hugging Face GPT-2/Llama folder or a run to start from (train/pretrained.py)
    model_spec: dict | None = None  # with init_from: the source model's own config (its sizes, eps, ...)

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}; got {self.model!r}")
        for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_size", "ckpt_every", "keep_ckpts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {self.seed!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1); got {self.label_smoothing!r}")
        K.check_tokenizer_options(self.tokenizer, self.vocab_size, self.data)
        if self.tokenizer == "bpe" and self.vocab_size is None:
            object.__setattr__(self, "vocab_size", K.DEFAULT_BPE_VOCAB)
        if self.data is not None:
            T.check_text_options(self.data, self.context, self.val_fraction, self.model)
        if not isinstance(self.optim, AdamWConfig):
            raise TypeError(f"optim must be an AdamWConfig; got {type(self.optim).__name__}")
        if self.model != "llama":
            only = [n for n, v in (("kv_heads", self.kv_heads), ("tie_embeddings", self.tie_embeddings),
                                   ("qk_norm", self.qk_norm)) if v not in (None, False)]
            if only:
                raise ValueError(f"{', '.join(only)}: {'an option' if len(only) == 1 else 'options'} of "
                                 f"model='llama' only; got model={self.model!r}")
        elif self.dropout:
            raise ValueError(f"model='llama' has no dropout; got dropout={self.dropout!r}")
        _ = (self.task_config, self.model_config)  # each validates its part

    def warnings(self) -> list[str]:
        """Settings that are allowed but probably not meant."""
        out = []
        if self.optim.warmup >= self.steps:
            out.append(f"warmup={self.optim.warmup} >= steps={self.steps}: the learning rate only "
                       f"ramps up and never reaches lr={self.optim.lr:g} (pass --warmup below --steps)")
        return out

    def to_flat(self) -> dict:
        """One flat JSON-able mapping (the optimizer's options beside the others): the
        form stored in checkpoints and spelled by the command line."""
        top = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "optim"}
        return {**top, **asdict(self.optim)}

    @classmethod
    def from_flat(cls, flat: dict) -> TrainConfig:
        """The inverse of :meth:`to_flat`; options missing from ``flat`` take their defaults."""
        optim = {k: v for k, v in flat.items() if k in OPTIM_FIELDS}
        return cls(**{k: v for k, v in flat.items() if k not in OPTIM_FIELDS}, optim=AdamWConfig(**optim))

    @property
    def task_config(self) -> D.TaskConfig:
        return D.TaskConfig(self.task, self.symbols, self.min_len, self.max_len)

    @property
    def vocab(self) -> int:
        """The model's vocabulary: the toy task's symbols, the bytes, or the BPE's size."""
        if self.data is None:
            return D.N_SPECIAL + self.symbols
        return T.VOCAB if self.tokenizer == "bytes" else self.vocab_size

    @property
    def model_config(self) -> ModelConfig | LlamaConfig | GPT2Config:
        length = self.context if self.data is not None else 2 * self.max_len + 3  # the longest input
        if self.model_spec is not None:  # --init-from: the source's model (train/pretrained.py)
            from .pretrained import spec_model_config

            return spec_model_config(self.model, self.model_spec, vocab=self.vocab, length=length,
                                     dtype=self.dtype, dropout=self.dropout)
        if self.model == "gpt2":
            return GPT2Config(vocab=self.vocab, dim=self.dim, heads=self.heads, ffn=self.ffn, layers=self.layers,
                              positions=length, dropout=self.dropout, pad_id=D.PAD, dtype=self.dtype)
        if self.model == "llama":
            return LlamaConfig(
                vocab=self.vocab, dim=self.dim,
                heads=self.heads, kv_heads=self.kv_heads, ffn=self.ffn, layers=self.layers,
                tie_embeddings=self.tie_embeddings, qk_norm=self.qk_norm, pad_id=D.PAD, dtype=self.dtype,
            )
        return ModelConfig(
            vocab=self.vocab, dim=self.dim, heads=self.heads, ffn=self.ffn,
            enc_layers=self.layers, dec_layers=self.layers, activation=self.activation,
            dropout=self.dropout, pad_id=D.PAD, dtype=self.dtype,
        )


OPTIM_FIELDS = tuple(f.name for f in fields(AdamWConfig))


def flat_fields() -> tuple:
    """The names of :meth:`TrainConfig.to_flat`, in order."""
    return tuple(f.name for f in fields(TrainConfig) if f.name != "optim") + OPTIM_FIELDS


# Options that may change when resuming without breaking the bitwise continuation.
RESUMABLE = ("steps", "eval_every", "eval_size", "ckpt_every", "keep_ckpts")
