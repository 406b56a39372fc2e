"""Hugging Face directories in and out: ``config.json`` + ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``), read with NumPy alone (:mod:`.safetensors_np`:
memory-mapped, bfloat16 read as float32; no pickle, no torch, no transformers needed) and
written with the ``safetensors`` package (:mod:`.hf_write`).

    model = load_pretrained("path/to/dir")        # GPT-2, Llama (2, 3), Qwen2, Qwen3, Mistral
    logits = model.logits(ids)                    # (B, L, V), transformers' logits
    model.save_pretrained("out-dir")              # config.json written back, same logits

The config fields each architecture sets are mapped in :mod:`.hf_config`.  The weights map
one to one (no arithmetic but transposes and a split):

GPT-2 (Conv1D weights are (in, out), as attngrad's)   attngrad (models/gpt2.py)
    wte.weight, wpe.weight                            wte.W, wpe.W
    h.{i}.ln_1.{weight,bias}                          h.{i}.ln1.{g,b}
    h.{i}.attn.c_attn.weight (E, 3E) [q | k | v]      h.{i}.attn.W_q, W_k, W_v (and the bias: b_q, b_k, b_v)
    h.{i}.attn.c_proj.{weight,bias}                   h.{i}.attn.{W_o,b_o}
    h.{i}.ln_2.{weight,bias}                          h.{i}.ln2.{g,b}
    h.{i}.mlp.c_fc.{weight,bias}, c_proj              h.{i}.ff1.{W,b}, h.{i}.ff2.{W,b}
    ln_f.{weight,bias}; lm_head.weight when untied    ln_f.{g,b}; out.W = lm_head.weight^T

Llama, Qwen2, Qwen3, Mistral (nn.Linear weights are (out, in): transposed)   (models/llama.py)
    model.embed_tokens.weight                         emb.W
    model.layers.{i}.input_layernorm.weight           layers.{i}.attn_norm.g
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  layers.{i}.attn.W_{q,k,v,o} (transposed)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.bias    layers.{i}.attn.b_{q,k,v,o} (Qwen2: q k v)
    model.layers.{i}.self_attn.{q,k}_norm.weight      layers.{i}.attn.{q,k}_norm_w (Qwen3)
    model.layers.{i}.post_attention_layernorm.weight  layers.{i}.ffn_norm.g
    model.layers.{i}.mlp.{gate,up,down}_proj.weight   layers.{i}.ffn.W_{gate,up,down} (transposed)
    model.norm.weight; lm_head.weight when untied     norm.g; out.W = lm_head.weight^T

Hugging Face's q_proj / k_proj rows are already in the rotate-half order of its RoPE, which
is attngrad's ``rope_layout="half"``: no permutation.  Anything this module cannot
reproduce exactly (another architecture, MLP biases, another RoPE scaling, exact-erf GELU,
GPT-2's scaled or upcast attention variants, a tensor of the wrong shape, a missing or
truncated file) is refused with a ValueError naming it.  Writing goes to a temporary folder
beside the destination, renamed into place once complete: never a half-written directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import gpt2, llama
from .hf_config import ARCHITECTURES, KINDS, config_from_hf, module_of
from .safetensors_np import load_file

_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old GPT-2 files

__all__ = [
    "ARCHITECTURES",
    "KINDS",
    "PretrainedModel",
    "load_pretrained",
    "param_shapes",
    "params_from_hf",
    "read_config",
    "read_tensors",
    "save_pretrained",
]


def _safetensors():
    try:
        import safetensors.numpy as st
    except ImportError:
        raise ImportError("writing Hugging Face directories needs the safetensors package: "
                          "pip install 'attngrad[hf]'") from None
    return st


# ---------------------------------------------------------------- reading


def read_config(path) -> dict:
    """The contents of ``path/config.json`` (ValueError naming the file otherwise)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such folder; expected a Hugging Face model directory "
                         "(config.json + model.safetensors)")
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder; expected a Hugging Face model directory "
                         "(config.json + model.safetensors)")
    f = path / "config.json"
    if not f.is_file():
        raise ValueError(f"{f}: missing; a Hugging Face model directory has config.json beside "
                         "model.safetensors")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{f}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object; got {type(cfg).__name__}")
    return cfg


def read_tensors(path) -> dict:
    """name -> ndarray from ``path/model.safetensors``, or from the shards of its index
    (memory-mapped; bfloat16 as float32)."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc!r})") from None
        for f in files:
            if not f.is_file():
                raise ValueError(f"{f}: missing (listed in {index.name})")
    else:
        extra = (" (pytorch_model.bin is a pickle, which attngrad does not read: convert it with "
                 "transformers' save_pretrained(..., safe_serialization=True))"
                 if (path / "pytorch_model.bin").exists() else "")
        raise ValueError(f"{single}: missing; expected the weights in safetensors format{extra}")
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


# the names this module had before read_config / read_tensors were public
_read_config, _read_tensors = read_config, read_tensors


def _config_from_hf(cfg: dict, source: Path, dtype: str):
    return config_from_hf(cfg, source, dtype)


def _hf_names(kind: str, mcfg) -> dict:
    """attngrad name -> (HF tensor name, transform) where transform is "", "T" (transpose)
    or ("split", part, of) (a column block of a fused matrix)."""
    names = {}
    if kind == "gpt2":
        names["wte.W"] = ("wte.weight", "")
        names["wpe.W"] = ("wpe.weight", "")
        for i in range(mcfg.layers):
            a, o = f"h.{i}.", f"h.{i}."
            names[a + "ln1.g"], names[a + "ln1.b"] = (o + "ln_1.weight", ""), (o + "ln_1.bias", "")
            for j, w in enumerate("qkv"):
                names[a + f"attn.W_{w}"] = (o + "attn.c_attn.weight", ("split", j, 3))
                names[a + f"attn.b_{w}"] = (o + "attn.c_attn.bias", ("split", j, 3))
            names[a + "attn.W_o"], names[a + "attn.b_o"] = (o + "attn.c_proj.weight", ""), (o + "attn.c_proj.bias", "")
            names[a + "ln2.g"], names[a + "ln2.b"] = (o + "ln_2.weight", ""), (o + "ln_2.bias", "")
            names[a + "ff1.W"], names[a + "ff1.b"] = (o + "mlp.c_fc.weight", ""), (o + "mlp.c_fc.bias", "")
            names[a + "ff2.W"], names[a + "ff2.b"] = (o + "mlp.c_proj.weight", ""), (o + "mlp.c_proj.bias", "")
        names["ln_f.g"], names["ln_f.b"] = ("ln_f.weight", ""), ("ln_f.bias", "")
        if not mcfg.tie_embeddings:
            names["out.W"] = ("lm_head.weight", "T")
        return names
    names["emb.W"] = ("model.embed_tokens.weight", "")
    biased = {None: "", "qkv": "qkv", "qkvo": "qkvo"}[mcfg.attn_bias]
    for i in range(mcfg.layers):
        a, o = f"layers.{i}.", f"model.layers.{i}."
        names[a + "attn_norm.g"] = (o + "input_layernorm.weight", "")
        for w in "qkvo":
            names[a + f"attn.W_{w}"] = (o + f"self_attn.{w}_proj.weight", "T")
            if w in biased:
                names[a + f"attn.b_{w}"] = (o + f"self_attn.{w}_proj.bias", "")
        if mcfg.qk_norm is not None:
            for w in "qk":
                names[a + f"attn.{w}_norm_w"] = (o + f"self_attn.{w}_norm.weight", "")
        names[a + "ffn_norm.g"] = (o + "post_attention_layernorm.weight", "")
        for w in ("gate", "up", "down"):
            names[a + f"ffn.W_{w}"] = (o + f"mlp.{w}_proj.weight", "T")
    names["norm.g"] = ("model.norm.weight", "")
    if not mcfg.tie_embeddings:
        names["out.W"] = ("lm_head.weight", "T")
    return names


def _canonical_gpt2(tensors: dict) -> dict:
    """GPT2LMHeadModel files prefix the body with ``transformer.``; GPT2Model files do not."""
    return {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in tensors.items()}


def params_from_hf(kind: str, mcfg, tensors: dict, source="the weights") -> dict:
    """attngrad parameters (cast to ``mcfg.dtype``) from Hugging Face tensors, every name
    and shape checked against the model ``mcfg`` describes (ValueError naming the tensor)."""
    prefix = ""
    if kind == "gpt2":
        prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
        tensors = {k: v for k, v in _canonical_gpt2(tensors).items() if not k.endswith(_GPT2_BUFFERS)}

    def label(hf):  # the name as the file spells it
        return hf if hf == "lm_head.weight" else prefix + hf

    kind = module_of(kind)
    expected = param_shapes(kind, mcfg)
    names = _hf_names(kind, mcfg)
    used = {hf for hf, _ in names.values()}
    if kind == "gpt2" and mcfg.tie_embeddings:
        used.add("lm_head.weight")  # tied: the file may hold a copy of wte
    missing = sorted({hf for hf, _ in names.values()} - set(tensors))
    if missing:
        raise ValueError(f"{source}: tensor {label(missing[0])!r} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                         + "; expected the tensors of the model its config.json describes")
    unexpected = sorted(set(tensors) - used - ({"lm_head.weight"} if kind == "llama" and mcfg.tie_embeddings else set()))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor {label(unexpected[0])!r}"
                         + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                         + "; not part of the model its config.json describes (attngrad reproduces "
                         "that model exactly, or refuses it)")
    out = {}
    for name, (hf, how) in names.items():
        t = np.asarray(tensors[hf])
        if t.dtype.kind != "f":
            raise ValueError(f"{source}: tensor {label(hf)!r} has dtype {t.dtype}; expected floating point")
        want = expected[name]
        if how == "T":
            t = t.T
        elif how:
            _, j, n = how
            axis = t.ndim - 1
            full = (*want[:-1], n * want[-1])
            if t.shape != full:
                raise ValueError(f"{source}: tensor {label(hf)!r} has shape {tuple(t.shape)}; the config "
                                 f"says {full}")
            t = np.split(t, n, axis=axis)[j]
        if tuple(t.shape) != tuple(want):
            shown = tuple(t.shape[::-1]) if how == "T" else tuple(t.shape)
            need = tuple(want[::-1]) if how == "T" else tuple(want)
            raise ValueError(f"{source}: tensor {label(hf)!r} has shape {shown}; the config says {need}")
        if not np.isfinite(t).all():
            raise ValueError(f"{source}: tensor {label(hf)!r} holds NaN or infinite values")
        out[name] = np.array(t, dtype=mcfg.dtype, order="C")
    return out


def param_shapes(kind: str, mcfg) -> dict:
    """attngrad parameter name -> shape of the ``kind`` model ``mcfg`` (no arrays made)."""
    e, f, v = mcfg.dim, mcfg.ffn, mcfg.vocab
    shapes = {}
    if module_of(kind) == "gpt2":
        shapes.update({"wte.W": (v, e), "wpe.W": (mcfg.positions, e), "ln_f.g": (e,), "ln_f.b": (e,)})
        for i in range(mcfg.layers):
            a = f"h.{i}."
            for n in ("ln1.g", "ln1.b", "ln2.g", "ln2.b", "attn.b_q", "attn.b_k", "attn.b_v", "attn.b_o", "ff2.b"):
                shapes[a + n] = (e,)
            for w in "qkvo":
                shapes[a + f"attn.W_{w}"] = (e, e)
            shapes.update({a + "ff1.W": (e, f), a + "ff1.b": (f,), a + "ff2.W": (f, e)})
    else:
        d = mcfg.head
        q, kv = mcfg.heads * d, mcfg.num_kv_heads * d
        shapes.update({"emb.W": (v, e), "norm.g": (e,)})
        for i in range(mcfg.layers):
            a = f"layers.{i}."
            shapes.update({a + "attn_norm.g": (e,), a + "ffn_norm.g": (e,), a + "attn.W_q": (e, q),
                           a + "attn.W_k": (e, kv), a + "attn.W_v": (e, kv), a + "attn.W_o": (q, e),
                           a + "ffn.W_gate": (e, f), a + "ffn.W_up": (e, f), a + "ffn.W_down": (f, e)})
            if mcfg.attn_bias is not None:
                shapes.update({a + "attn.b_q": (q,), a + "attn.b_k": (kv,), a + "attn.b_v": (kv,)})
                if mcfg.attn_bias == "qkvo":
                    shapes[a + "attn.b_o"] = (e,)
            if mcfg.qk_norm is not None:
                shapes.update({a + "attn.q_norm_w": (d,), a + "attn.k_norm_w": (d,)})
    if not mcfg.tie_embeddings:
        shapes["out.W"] = (e, v)
    return shapes


# ---------------------------------------------------------------- the model object


@dataclass
class PretrainedModel:
    """A model read from (or to be written as) a Hugging Face directory.

    ``kind``: its model_type, one of :data:`KINDS` ("gpt2", "llama", "qwen2", "qwen3",
    "mistral"); ``config``: :class:`~attngrad.models.gpt2.GPT2Config` (gpt2) or
    :class:`~attngrad.models.llama.LlamaConfig` (the others); ``params``: attngrad's
    parameters (the names of :func:`attngrad.models.gpt2.init` /
    :func:`attngrad.models.llama.init`); ``source``: the folder read, or None;
    ``hf_config``: the source's config.json (written back by :meth:`save_pretrained`)."""

    kind: str
    config: object
    params: dict
    source: Path | None = None
    hf_config: dict | None = None

    @property
    def module(self):
        return gpt2 if self.kind == "gpt2" else llama

    def forward(self, ids):
        """ids (B, L) -> (logits (B, L, V), cache for :meth:`backward`)."""
        return self.module.forward(self.params, self.config, ids)

    def backward(self, dlogits, cache) -> dict:
        """The closed-form gradient of every parameter, given dlogits (B, L, V)."""
        return self.module.backward(dlogits, cache)

    def logits(self, ids) -> np.ndarray:
        """ids (B, L) or (L,) integer token ids -> logits (B, L, V) (or (L, V))."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids must hold integer token ids; got dtype {ids.dtype}")
        if ids.ndim == 1:
            return self.module.forward(self.params, self.config, ids[None])[0][0]
        return self.module.forward(self.params, self.config, ids)[0]

    def save_pretrained(self, out, *, dtype: str = "float32", extra_files=()) -> Path:
        """Write this model as a Hugging Face directory (see :func:`save_pretrained`); a
        model read from a directory writes its config.json back, and copies its tokenizer
        and generation files."""
        if self.source is not None:
            extra_files = [*source_files(self.source), *extra_files]
        return save_pretrained(out, self.kind, self.config, self.params, dtype=dtype, extra_files=extra_files,
                               base_config=self.hf_config)


# what a model directory holds besides its weights and config.json, copied along with them
SOURCE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def source_files(path) -> list:
    """The files of :data:`SOURCE_FILES` that directory ``path`` holds."""
    return [Path(path) / n for n in SOURCE_FILES if (Path(path) / n).is_file()]


def load_pretrained(path, *, dtype: str = "float64") -> PretrainedModel:
    """A Hugging Face GPT-2, Llama (2 or 3), Qwen2, Qwen3 or Mistral directory
    (``config.json`` + ``model.safetensors``, float32, float64, float16 or bfloat16) as an
    attngrad model whose ``.logits(ids)`` are transformers' logits for the same weights.
    ``dtype``: "float64" (default) or "float32", the parameters' dtype.  ValueError naming
    the file, option or tensor for anything it cannot reproduce."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64'; got {dtype!r}")
    source = Path(path)
    hf = read_config(source)
    kind, mcfg = config_from_hf(hf, source, dtype)
    tensors = read_tensors(source)
    params = params_from_hf(kind, mcfg, tensors, source=str(source))
    return PretrainedModel(kind, mcfg, params, source, hf)


from .hf_write import save_pretrained  # noqa: E402  (writing: its own module)
