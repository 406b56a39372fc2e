"""Writing a Hugging Face directory (the inverse of :mod:`.pretrained`'s reading):
``config.json`` (:func:`.hf_config.hf_config`), ``generation_config.json`` and
``model.safetensors`` through the ``safetensors`` package's NumPy API, into a temporary
folder renamed into place once complete (never a half-written directory).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .hf_config import generation_config, hf_config, module_of
from .pretrained import _hf_names, _safetensors, param_shapes


def hf_tensors(kind: str, mcfg, params: dict, dtype: str = "float32") -> dict:
    """Hugging Face tensor name -> contiguous ndarray of ``dtype`` (the inverse of
    :func:`params_from_hf`; tied output weights are not written, as transformers does)."""
    kind = module_of(kind)
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
                    extra_files=(), base_config: dict | None = None, special_ids: dict | None = None,
                    positions: int | None = None) -> Path:
    """Write a Hugging Face directory transformers loads with ``from_pretrained``
    (GPT2LMHeadModel for "gpt2", LlamaForCausalLM for "llama", Qwen2ForCausalLM,
    Qwen3ForCausalLM, MistralForCausalLM): config.json, generation_config.json and
    model.safetensors (``dtype`` float32 or float64), plus ``extra_files`` (paths copied
    in, e.g. a tokenizer.json; a generation_config.json among them is copied as it is).

    ``base_config``: the source's config.json, written back unchanged but for the dtype
    (positions, special token ids, dropouts, RoPE settings as they were); without it,
    ``special_ids`` (bos/eos/pad_token_id) and ``positions`` (a Llama-family model's
    max_position_embeddings) go into the config made from ``config``.  ``out`` must not
    exist or be an empty folder; the files are written to a temporary folder beside it and
    renamed into place when complete."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64'; got {dtype!r}")
    st = _safetensors()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder; choose a new output folder")
    cfg = hf_config(kind, config, dtype, base=base_config, special=special_ids, positions=positions)
    tensors = hf_tensors(kind, config, params, dtype)
    extra = [Path(f) for f in extra_files]
    names = [f.name for f in extra]
    if len(set(names)) != len(names) or {"config.json", "model.safetensors"} & set(names):
        raise ValueError(f"extra_files must have distinct names other than config.json and model.safetensors; "
                         f"got {names}")
    for k, v in tensors.items():
        if not np.isfinite(v).all():
            raise ValueError(f"parameter for {k!r} holds NaN or infinite values (in {dtype})")
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        st.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in extra:
            shutil.copyfile(f, tmp / f.name)
        if "generation_config.json" not in names:
            (tmp / "generation_config.json").write_text(json.dumps(generation_config(cfg), indent=2) + "\n",
                                                         encoding="utf-8")
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
