"""Hugging Face ``config.json`` <-> attngrad model configs, both directions in one place.

Read (:func:`config_from_hf`): ``model_type`` gpt2 -> :class:`~.gpt2.GPT2Config`; llama,
qwen2, qwen3, mistral -> :class:`~.llama.LlamaConfig` with the options each architecture
fixes:

    model_type  head_dim      attention biases          QK-norm  sliding window
    llama       E/H or given  attention_bias: q k v o   -        -
    qwen2       E/H           q k v (always)            -        use_sliding_window, layer_types
    qwen3       given (128)   attention_bias: q k v o   RMS      use_sliding_window, layer_types
    mistral     E/H or given  -                         -        sliding_window (every layer)

RoPE settings are read from ``rope_parameters`` (transformers 5) or ``rope_scaling`` and
``rope_theta`` (transformers 4): rope_type default, linear or llama3 (models/llama.py,
LL7); anything attngrad does not reproduce exactly (another rope type, a partial rotary
dim, another activation, MLP biases, ...) is refused naming the field.

Write (:func:`hf_config`): the config.json transformers builds the same model from.  With
``base`` (the source's own config.json, for a run started ``--init-from`` it) every field
of the source is written back as it was, the dtype excepted; the sizes it describes are
checked to be the run's.
"""

from __future__ import annotations

import math
from pathlib import Path

from .gpt2 import GPT2Config
from .llama import LlamaConfig

KINDS = ("gpt2", "llama", "qwen2", "qwen3", "mistral")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")  # attngrad's models/llama.py
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
_ROPE_TYPES = ("default", "linear", "llama3")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def module_of(kind: str) -> str:
    """The attngrad model (a key of ``attngrad.models.MODELS``) of a Hugging Face kind."""
    return "gpt2" if kind == "gpt2" else "llama"


def _where(source) -> str:
    return f"{Path(source) / 'config.json'}" if source is not None else "config.json"


def _get(cfg: dict, source, key: str, default=None, *, kind=int):
    v = cfg.get(key, default)
    if v is None:
        raise ValueError(f"{_where(source)}: {key} is missing")
    if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{_where(source)}: {key} must be a positive integer; got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0):
        raise ValueError(f"{_where(source)}: {key} must be a positive number; got {v!r}")
    return v


def _require(cfg: dict, source, key: str, allowed, default) -> None:
    v = cfg.get(key, default)
    if v not in allowed:
        raise ValueError(f"{_where(source)}: {key}={v!r} is not supported (attngrad "
                         f"reproduces {' or '.join(map(repr, allowed))} only)")


def hf_kind(cfg: dict, source=None) -> str:
    mt = cfg.get("model_type")
    if mt in KINDS:
        return mt
    arch = cfg.get("architectures") or []
    raise ValueError(f"{_where(source)}: model_type {mt!r} (architectures {arch}) is not one attngrad "
                     f"reads; attngrad reads model_type {', '.join(map(repr, KINDS))}")


def _rope(cfg: dict, source) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling for LlamaConfig) from rope_parameters or rope_scaling."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{_where(source)}: rope_parameters must be an object; got {rope!r}")
    if "full_attention" in rope or "sliding_attention" in rope:
        raise ValueError(f"{_where(source)}: RoPE parameters per layer type are not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"{_where(source)}: rope_type {rope_type!r} is not supported; attngrad reproduces "
                         f"{', '.join(map(repr, _ROPE_TYPES))}")
    for key in ("partial_rotary_factor",):
        v = rope.get(key, cfg.get(key, 1.0))
        if v not in (1, 1.0, None):
            raise ValueError(f"{_where(source)}: {key}={v!r} is not supported (attngrad rotates whole heads)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"{_where(source)}: rope_theta must be a positive number; got {theta!r}")
    if rope_type == "default":
        return float(theta), None
    scaling = {"rope_type": rope_type, **{k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}}
    if rope_type == "llama3" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings")
    known = {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    if rope_type == "linear":
        known = {"rope_type", "factor"}
    return float(theta), {k: v for k, v in scaling.items() if k in known}


def _windows(kind: str, cfg: dict, source, layers: int) -> tuple:
    """(window, window_layers) of LlamaConfig."""
    if kind == "llama":
        return None, None
    if kind == "mistral":
        w = cfg.get("sliding_window")
        if "layer_types" in cfg and cfg["layer_types"] is not None:
            raise ValueError(f"{_where(source)}: a Mistral config with layer_types is not supported")
        return (None if w is None else _get(cfg, source, "sliding_window")), None
    if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
        return None, None
    w = _get(cfg, source, "sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"full_attention",
                                                                                  "sliding_attention"}:
        raise ValueError(f"{_where(source)}: layer_types must list 'full_attention' or 'sliding_attention' "
                         f"for each of the {layers} layers; got {types!r}")
    on = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not on:
        return None, None
    return w, (None if len(on) == layers else on)


def config_from_hf(cfg: dict, source=None, dtype: str = "float64"):
    """(kind, model config) of a Hugging Face config.json's contents (ValueError naming the
    field for anything attngrad does not reproduce exactly)."""
    kind = hf_kind(cfg, source)
    tie = cfg.get("tie_word_embeddings", kind == "gpt2")
    if not isinstance(tie, bool):
        raise ValueError(f"{_where(source)}: tie_word_embeddings must be true or false; got {tie!r}")
    if kind == "gpt2":
        _require(cfg, source, "activation_function", _GELU_TANH, "gelu_new")
        _require(cfg, source, "scale_attn_weights", (True,), True)
        _require(cfg, source, "scale_attn_by_inverse_layer_idx", (False,), False)
        _require(cfg, source, "reorder_and_upcast_attn", (False,), False)
        _require(cfg, source, "add_cross_attention", (False,), False)
        e = _get(cfg, source, "n_embd")
        inner = cfg.get("n_inner")
        return kind, GPT2Config(
            vocab=_get(cfg, source, "vocab_size"), dim=e, heads=_get(cfg, source, "n_head"),
            ffn=4 * e if inner is None else _get(cfg, source, "n_inner"), layers=_get(cfg, source, "n_layer"),
            positions=_get(cfg, source, "n_positions", 1024),
            eps=float(_get(cfg, source, "layer_norm_epsilon", 1e-5, kind=float)), tie_embeddings=tie,
            dtype=dtype)
    _require(cfg, source, "hidden_act", ("silu",), "silu")
    _require(cfg, source, "mlp_bias", (False,), False)
    e, h = _get(cfg, source, "hidden_size"), _get(cfg, source, "num_attention_heads")
    layers = _get(cfg, source, "num_hidden_layers")
    if kind == "qwen2":
        bias = "qkv"
    elif kind == "mistral":
        _require(cfg, source, "attention_bias", (False,), False)
        bias = None
    else:
        b = cfg.get("attention_bias", False)
        if not isinstance(b, bool):
            raise ValueError(f"{_where(source)}: attention_bias must be true or false; got {b!r}")
        bias = "qkvo" if b else None
    head_dim = cfg.get("head_dim")
    if head_dim is None and kind == "qwen3":
        head_dim = 128  # Qwen3Config's default
    if head_dim is not None:
        head_dim = _get(cfg, source, "head_dim")
        if kind == "qwen2" and head_dim * h != e:
            raise ValueError(f"{_where(source)}: head_dim={head_dim} differs from hidden_size / "
                             f"num_attention_heads = {e / h:g}; Qwen2 has no head_dim of its own")
    theta, scaling = _rope(cfg, source)
    window, window_layers = _windows(kind, cfg, source, layers)
    kv = cfg.get("num_key_value_heads")
    try:
        mcfg = LlamaConfig(
            vocab=_get(cfg, source, "vocab_size"), dim=e, heads=h,
            kv_heads=None if kv is None else _get(cfg, source, "num_key_value_heads"),
            ffn=_get(cfg, source, "intermediate_size"), layers=layers,
            tie_embeddings=tie, qk_norm="rms" if kind == "qwen3" else None, rope_base=theta,
            eps=float(_get(cfg, source, "rms_norm_eps", 1e-6, kind=float)), dtype=dtype,
            head_dim=None if head_dim is None or head_dim * h == e else head_dim, attn_bias=bias,
            window=window, window_layers=window_layers, rope_scaling=scaling)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{_where(source)}: {exc}") from None
    return kind, mcfg


def check_kind(kind: str, mcfg) -> None:
    """ValueError when the ``kind`` architecture cannot hold the model ``mcfg`` describes."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}; got {kind!r}")
    if kind == "gpt2":
        if not isinstance(mcfg, GPT2Config):
            raise ValueError(f"kind 'gpt2' needs a GPT2Config; got {type(mcfg).__name__}")
        return
    if not isinstance(mcfg, LlamaConfig):
        raise ValueError(f"kind {kind!r} needs a LlamaConfig; got {type(mcfg).__name__}")
    arch = ARCHITECTURES[kind]
    if mcfg.rope_layout != "half":
        raise ValueError(f"rope_layout={mcfg.rope_layout!r}: {arch}'s RoPE is the 'half' layout")
    qk = "rms" if kind == "qwen3" else None
    if mcfg.qk_norm != qk:
        raise ValueError(f"qk_norm={mcfg.qk_norm!r}: {arch} " + ("has RMS QK-norm" if qk else
                         "has no QK-norm; only a Llama model without --qk-norm can be written for transformers"))
    biases = {"llama": (None, "qkvo"), "qwen2": ("qkv",), "qwen3": (None, "qkvo"), "mistral": (None,)}[kind]
    if mcfg.attn_bias not in biases:
        raise ValueError(f"attn_bias={mcfg.attn_bias!r}: {arch} has attention biases "
                         f"{' or '.join(map(repr, biases))} only")
    if mcfg.window is not None and (kind == "llama" or (kind == "mistral" and mcfg.window_layers is not None)):
        raise ValueError(f"a sliding window{' on some layers' if kind == 'mistral' else ''}: {arch} has none")
    if kind == "qwen2" and mcfg.head_dim is not None and mcfg.head_dim * mcfg.heads != mcfg.dim:
        raise ValueError(f"head_dim={mcfg.head_dim}: {arch} needs dim / heads")


def _rope_parameters(mcfg: LlamaConfig) -> dict:
    out = {"rope_type": "default", "rope_theta": float(mcfg.rope_base)}
    if mcfg.rope_scaling is not None:
        out.update(mcfg.rope_scaling)
        if "original_max_position_embeddings" in out:
            out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    return out


def hf_config(kind: str, mcfg, dtype: str = "float32", *, base: dict | None = None, special: dict | None = None,
              positions: int | None = None) -> dict:
    """The config.json of ``mcfg`` as a ``kind`` model.  ``base``: the source's config.json,
    written back as it was (dtype excepted) once checked to describe ``mcfg``; ``special``:
    bos/eos/pad token ids (without ``base``); ``positions``: max_position_embeddings of a
    Llama-family model without ``base`` (default 2048)."""
    check_kind(kind, mcfg)
    if base is not None:
        return _written_back(kind, mcfg, dtype, base)
    ids = {k: None for k in SPECIAL_IDS} | dict(special or {})
    if kind == "gpt2":
        p = float(mcfg.dropout)
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": mcfg.vocab,
            "n_positions": mcfg.positions, "n_embd": mcfg.dim, "n_layer": mcfg.layers, "n_head": mcfg.heads,
            "n_inner": mcfg.ffn, "activation_function": "gelu_new", "layer_norm_epsilon": float(mcfg.eps),
            "resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": mcfg.tie_embeddings, **ids, "dtype": dtype,
        }
    rope = _rope_parameters(mcfg)
    out = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": mcfg.vocab,
        "hidden_size": mcfg.dim, "intermediate_size": mcfg.ffn, "num_hidden_layers": mcfg.layers,
        "num_attention_heads": mcfg.heads, "num_key_value_heads": mcfg.num_kv_heads,
        "head_dim": mcfg.head, "hidden_act": "silu", "rms_norm_eps": float(mcfg.eps),
        "rope_theta": float(mcfg.rope_base), "rope_parameters": rope,
        "max_position_embeddings": 2048 if positions is None else int(positions),
        "tie_word_embeddings": mcfg.tie_embeddings, "attention_dropout": 0.0, **ids, "dtype": dtype,
    }
    if kind in ("llama", "qwen3"):
        out["attention_bias"] = mcfg.attn_bias == "qkvo"
    if kind == "llama":
        out["mlp_bias"] = False
    if kind == "mistral":
        out["sliding_window"] = mcfg.window
    if kind in ("qwen2", "qwen3"):
        on = mcfg.window is not None
        layers = range(mcfg.layers) if mcfg.window_layers is None else mcfg.window_layers
        out.update(use_sliding_window=on, sliding_window=mcfg.window, max_window_layers=mcfg.layers,
                   layer_types=["sliding_attention" if on and i in layers else "full_attention"
                                for i in range(mcfg.layers)])
    return out


def _comparable(mcfg) -> dict:
    return {k: v for k, v in mcfg.to_dict().items() if k not in ("dtype", "pad_id", "dropout")}


def _written_back(kind: str, mcfg, dtype: str, base: dict) -> dict:
    """The source's config.json with the dtype of the weights written, after checking that
    it describes ``mcfg`` (the run cannot change the model, but a wrong pairing would)."""
    src_kind, src = config_from_hf(base, None, mcfg.dtype)
    if src_kind != kind or _comparable(src) != _comparable(mcfg):
        diff = sorted(k for k, v in _comparable(mcfg).items() if _comparable(src).get(k) != v)
        raise ValueError(f"the source config.json describes another model than the run's "
                         f"({src_kind} vs {kind}; differing: {diff})")
    out = dict(base)
    out["dtype"] = dtype
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    out.setdefault("architectures", [ARCHITECTURES[kind]])
    return out


def generation_config(config: dict) -> dict:
    """A generation_config.json from a config.json's special token ids (what transformers'
    ``GenerationConfig.from_model_config`` keeps)."""
    out = {k: config[k] for k in SPECIAL_IDS if config.get(k) is not None}
    return {"_from_model_config": True, **out}
