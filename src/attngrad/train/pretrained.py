"""Runs in and out of the Hugging Face world: ``attngrad train --init-from PATH`` and
``attngrad export --run DIR -o OUTDIR``.

``--init-from`` takes a Hugging Face GPT-2 / Llama directory (``config.json`` +
``model.safetensors``, read by :mod:`attngrad.models.pretrained`) or an attngrad run folder
(its newest checkpoint, verified).  The source fixes the model: its kind, sizes and the
options a TrainConfig does not spell (vocabulary, positions, norm eps, RoPE base) travel in
``TrainConfig.model_spec``, stored in every checkpoint, so a resumed run needs the source
no more.  Step 0's parameters are the source's weights (cast to ``--dtype``); everything
after is the ordinary loop, closed-form gradients and AdamW.

``export`` writes the newest checkpoint of a GPT-2 or Llama run as a directory transformers
loads with ``from_pretrained`` (GPT2LMHeadModel / LlamaForCausalLM), the run's
``tokenizer.json`` beside it when there is one; written to a temporary folder and renamed.
"""

from __future__ import annotations

from pathlib import Path

from ..models import MODELS
from ..models import pretrained as HF
from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from .runfolder import expected_arrays, stored_config

TOKENIZER_FILE = "tokenizer.json"
# TrainConfig options the source fixes (its model_spec holds the rest)
FIXED = ("model", "dim", "heads", "ffn", "layers", "kv_heads", "tie_embeddings", "qk_norm", "activation")
_NOT_SPEC = ("dtype", "pad_id", "dropout")  # these follow the new run's options


def _is_hf(path: Path) -> bool:
    return (path / "config.json").is_file()


def _newest(path: Path, what: str) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"{what}: no such folder: {path}")
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        raise ValueError(f"{what}: {path / 'config.json'}: missing; a Hugging Face model directory has "
                         "config.json beside model.safetensors")
    found = list_checkpoints(path)
    if not found:
        raise ValueError(f"{what}: {path} is neither a Hugging Face model directory (config.json + "
                         "model.safetensors) nor an attngrad run folder (ckpt-*.npz)")
    return found[-1]


def _spec(mcfg) -> dict:
    return {k: v for k, v in mcfg.to_dict().items() if k not in _NOT_SPEC}


def source_options(path) -> dict:
    """The TrainConfig options an ``--init-from`` source fixes: FIXED, ``model_spec`` and
    ``init_from``.  Reads config files only (the weights: :func:`initial_params`)."""
    from .config import TrainConfig

    p = Path(path)
    if _is_hf(p):
        kind, mcfg = HF._config_from_hf(HF._read_config(p), p, "float64")
        opts = {"model": kind, "dim": mcfg.dim, "heads": mcfg.heads, "ffn": mcfg.ffn, "layers": mcfg.layers}
        if kind == "llama":
            opts["kv_heads"] = None if mcfg.num_kv_heads == mcfg.heads else mcfg.num_kv_heads
            opts["tie_embeddings"] = mcfg.tie_embeddings
    else:
        cfg = TrainConfig.from_flat(stored_config(_newest(p, "--init-from")))
        mcfg = cfg.model_config
        opts = {n: getattr(cfg, n) for n in FIXED}
    return {**opts, "model_spec": _spec(mcfg), "init_from": str(p)}


def apply_init_from(given: dict) -> dict:
    """The command line's options with ``--init-from``'s applied: the source fixes the
    model; a given option that differs is refused, naming it.  The source's weights are
    read and checked here too, before any work."""
    path = given.get("init_from")
    if path is None:
        return given
    opts = source_options(path)
    for n in FIXED:
        if n in given and n in opts and given[n] != opts[n]:
            raise ValueError(f"--{n.replace('_', '-')} {given[n]!r}: the --init-from model {path} has "
                             f"{n}={opts[n]!r} (leave the option out: the source fixes it)")
    _check_weights(Path(path))
    return {**given, **opts}


def _check_weights(p: Path) -> None:
    """Read the source's weights once, every name, shape and value checked (ValueError)."""
    if _is_hf(p):
        kind, mcfg = HF._config_from_hf(HF._read_config(p), p, "float64")
        HF.params_from_hf(kind, mcfg, HF._read_tensors(p), source=f"--init-from {p}")
    else:
        try:
            load_run(p)
        except CheckpointError as exc:
            raise ValueError(f"--init-from: {exc}") from None


def spec_model_config(model: str, spec: dict, *, vocab: int, length: int, dtype: str, dropout: float):
    """The model config of a run started ``--init-from`` a source with config ``spec``
    (:func:`source_options`): its sizes, the run's dtype and dropout.  ``vocab``: the ids the
    run's data needs; ``length``: its longest sequence (GPT-2's positions must cover it)."""
    from dataclasses import fields

    from ..models.common import ModelConfig
    from ..models.gpt2 import GPT2Config
    from ..models.llama import LlamaConfig

    cls = {"gpt2": GPT2Config, "llama": LlamaConfig}.get(model, ModelConfig)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(spec) - names)
    if unknown:
        raise ValueError(f"model_spec has options {unknown} that a {model} model does not have")
    kw = {**spec, "dtype": dtype}
    if "dropout" in names:
        kw["dropout"] = dropout
    mcfg = cls(**kw)
    if mcfg.vocab < vocab:
        raise ValueError(f"the --init-from model's vocabulary has {mcfg.vocab} ids; the run's data "
                         f"needs {vocab}")
    if model == "gpt2" and length > mcfg.positions:
        raise ValueError(f"the --init-from GPT-2 has {mcfg.positions} positions (n_positions); the run "
                         f"needs {length} (lower --context or --max-len)")
    return mcfg


def initial_params(cfg) -> dict:
    """Step 0's parameters: a fresh initialisation, or the ``--init-from`` source's weights
    (cast to ``cfg.dtype``), checked against the model ``cfg`` describes."""
    model = MODELS[cfg.model]
    if cfg.init_from is None:
        return model.init(cfg.model_config, cfg.seed)
    mcfg = cfg.model_config
    p = Path(cfg.init_from)
    if _is_hf(p):
        return HF.params_from_hf(cfg.model, mcfg, HF._read_tensors(p), source=f"--init-from {p}")
    path = _newest(p, "--init-from")
    init = model.init(mcfg, 0)
    try:
        arrays, _ = load_checkpoint(path, expected=expected_arrays(
            {k: v.astype(_stored_dtype(path)) for k, v in init.items()}))
    except CheckpointError as exc:
        raise ValueError(f"--init-from: {exc}") from None
    return {k: arrays[f"param/{k}"].astype(mcfg.dtype) for k in init}


def _stored_dtype(path: Path) -> str:
    from .config import TrainConfig

    return TrainConfig.from_flat(stored_config(path)).dtype


def load_run(run, checkpoint=None):
    """(TrainConfig, params, step, checkpoint path) of the newest checkpoint of ``run``
    (or ``checkpoint``), verified."""
    from .config import TrainConfig

    path = Path(checkpoint) if checkpoint is not None else _newest(Path(run), "--run")
    cfg = TrainConfig.from_flat(stored_config(path))
    init = MODELS[cfg.model].init(cfg.model_config, 0)
    arrays, state = load_checkpoint(path, expected=expected_arrays(init))
    params = {k: arrays[f"param/{k}"] for k in init}
    return cfg, params, int(state["step"]), path


def export_run(run, out, *, checkpoint=None, dtype: str = "float32") -> Path:
    """Write run ``run``'s newest checkpoint (or ``checkpoint``) to ``out`` as a Hugging Face
    directory (config.json, model.safetensors, and the run's tokenizer.json if any)."""
    cfg, params, _, path = load_run(run, checkpoint)
    if cfg.model not in HF.KINDS:
        raise ValueError(f"{path}: a {cfg.model!r} run; export writes GPT-2 and Llama models "
                         "(train with --model gpt2 or --model llama)")
    tok = Path(run) / TOKENIZER_FILE
    extra = [tok] if tok.is_file() else []
    return HF.save_pretrained(out, cfg.model, cfg.model_config, params, dtype=dtype, extra_files=extra)
