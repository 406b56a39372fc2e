"""Writing a Hugging Face directory (the inverse of :mod:`.pretrained`'s reading):
``config.json`` and ``model.safetensors`` through the ``safetensors`` package's NumPy API,
into a temporary folder renamed into place once complete (never a half-written directory).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .pretrained import KINDS, _hf_names, _safetensors, param_shapes


def hf_config(kind: str, mcfg, dtype: str = "float32") -> dict:
    """The config.json of ``mcfg`` for transformers (GPT2LMHeadModel / LlamaForCausalLM)."""
    if kind == "gpt2":
        p = float(mcfg.dropout)
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": mcfg.vocab,
            "n_positions": mcfg.positions, "n_embd": mcfg.dim, "n_layer": mcfg.layers, "n_head": mcfg.heads,
            "n_inner": mcfg.ffn, "activation_function": "gelu_new", "layer_norm_epsilon": float(mcfg.eps),
            "resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": mcfg.tie_embeddings, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "dtype": dtype,
        }
    if kind != "llama":
        raise ValueError(f"kind must be one of {list(KINDS)}; got {kind!r}")
    if mcfg.qk_norm is not None:
        raise ValueError(f"qk_norm={mcfg.qk_norm!r}: LlamaForCausalLM has no QK-norm; only a Llama "
                         "model without --qk-norm can be written for transformers")
    if mcfg.rope_layout != "half":
        raise ValueError(f"rope_layout={mcfg.rope_layout!r}: LlamaForCausalLM's RoPE is the 'half' layout")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": mcfg.vocab,
        "hidden_size": mcfg.dim, "intermediate_size": mcfg.ffn, "num_hidden_layers": mcfg.layers,
        "num_attention_heads": mcfg.heads, "num_key_value_heads": mcfg.num_kv_heads,
        "head_dim": mcfg.dim // mcfg.heads, "hidden_act": "silu", "rms_norm_eps": float(mcfg.eps),
        "rope_theta": float(mcfg.rope_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(mcfg.rope_base)},
        "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": mcfg.tie_embeddings, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, "dtype": dtype,
    }


def hf_tensors(kind: str, mcfg, params: dict, dtype: str = "float32") -> dict:
    """Hugging Face tensor name -> contiguous ndarray of ``dtype`` (the inverse of
    :func:`params_from_hf`; tied output weights are not written, as transformers does)."""
    names = _hf_names(kind, mcfg)
    shapes = param_shapes(kind, mcfg)
    if set(params) != set(shapes):
        missing, extra = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
        raise ValueError(f"params do not match the {kind} model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in shapes.items():
        if tuple(np.shape(params[name])) != shape:
            raise ValueError(f"params[{name!r}] has shape {tuple(np.shape(params[name]))}; the model needs {shape}")
    out, fused = {}, {}
    for name, (hf, how) in names.items():
        a = np.asarray(params[name])
        if how == "T":
            out[hf] = a.T
        elif how:
            fused.setdefault(hf, [None] * how[2])[how[1]] = a
        else:
            out[hf] = a
    for hf, parts in fused.items():
        out[hf] = np.concatenate(parts, axis=-1)
    prefix = "transformer." if kind == "gpt2" else ""
    return {(prefix + k if kind == "gpt2" and k != "lm_head.weight" else k): np.ascontiguousarray(v, dtype=dtype)
            for k, v in out.items()}


def save_pretrained(out, kind: str, config, params: dict, *, dtype: str = "float32",
                    extra_files=()) -> Path:
    """Write a Hugging Face directory transformers loads with ``from_pretrained``
    (GPT2LMHeadModel for "gpt2", LlamaForCausalLM for "llama"): config.json and
    model.safetensors (``dtype`` float32 or float64), plus ``extra_files`` (paths copied
    in, e.g. a tokenizer.json).  ``out`` must not exist or be an empty folder; the files
    are written to a temporary folder beside it and renamed into place when complete."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64'; got {dtype!r}")
    st = _safetensors()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder; choose a new output folder")
    cfg = hf_config(kind, config, dtype)
    tensors = hf_tensors(kind, config, params, dtype)
    for k, v in tensors.items():
        if not np.isfinite(v).all():
            raise ValueError(f"parameter for {k!r} holds NaN or infinite values (in {dtype})")
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        st.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in extra_files:
            shutil.copyfile(f, tmp / Path(f).name)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
