"""Runs in and out of the Hugging Face world: ``attngrad train --init-from PATH`` and
``attngrad export --run DIR -o OUTDIR``.

``--init-from`` takes a Hugging Face directory (GPT-2, Llama, Qwen2, Qwen3, Mistral:
``config.json`` + ``model.safetensors``, read by :mod:`attngrad.models.pretrained`) or an
attngrad run folder (its newest checkpoint, verified).  The source fixes the model: its
kind, sizes and the options a TrainConfig does not spell (vocabulary, positions, norm eps,
RoPE settings, biases, window) travel in ``TrainConfig.model_spec``, stored in every
checkpoint, so a resumed run needs the source no more.  Step 0's parameters are the
source's weights (cast to ``--dtype``); everything after is the ordinary loop, closed-form
gradients and AdamW.

The source fixes the tokenizer too (RELIABILITY row 36: fine-tuning never silently
re-tokenizes): a Hugging Face directory's ``tokenizer.json`` (through the ``tokenizers``
package) encodes ``--data`` (``tokenizer="pretrained"``), and a directory without one is
refused unless ``--tokenizer`` is given explicitly; a run folder's tokenizer (bytes, or its
tokenizer.json) is the new run's.  The source's config.json, generation_config.json and
tokenizer files are copied into the run folder (``source/``), for ``export``.

``export`` writes the newest checkpoint of a GPT-2 or Llama-family run as a directory
transformers loads with ``from_pretrained``: the source's config.json written back as it
was (positions, special token ids, dropouts, RoPE settings), its tokenizer and generation
files; for a run trained from scratch, a config made from the model with attngrad's special
ids (PAD 0, BOS 1, EOS 2) and the run's ``tokenizer.json``; a generation_config.json
always.  Written to a temporary folder and renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..models import MODELS
from ..models import pretrained as HF
from ..models.hf_config import module_of
from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from .data import BOS, EOS, PAD
from .runfolder import expected_arrays, newest_good_hint, stored_config

TOKENIZER_FILE = "tokenizer.json"
SOURCE_DIR = "source"  # the run folder's copy of the --init-from model's config and tokenizer files
_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")
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


# ---------------------------------------------------------------- the options a source fixes


def source_options(path) -> dict:
    """The TrainConfig options an ``--init-from`` source fixes: FIXED, ``model_spec``,
    ``init_from`` and, when the source has a tokenizer, ``tokenizer`` and ``vocab_size``.
    Reads config files only (the weights: :func:`initial_params`)."""
    from .config import TrainConfig

    p = Path(path)
    if _is_hf(p):
        kind, mcfg = HF.config_from_hf(HF.read_config(p), p, "float64")
        opts = {"model": module_of(kind), "dim": mcfg.dim, "heads": mcfg.heads, "ffn": mcfg.ffn,
                "layers": mcfg.layers}
        if kind != "gpt2":
            opts["kv_heads"] = None if mcfg.num_kv_heads == mcfg.heads else mcfg.num_kv_heads
            opts["tie_embeddings"] = mcfg.tie_embeddings
            opts["qk_norm"] = mcfg.qk_norm
        if (p / TOKENIZER_FILE).is_file():
            opts.update(tokenizer="pretrained", vocab_size=_tokenizer_size(p / TOKENIZER_FILE))
    else:
        cfg = TrainConfig.from_flat(stored_config(_newest(p, "--init-from")))
        mcfg = cfg.model_config
        opts = {n: getattr(cfg, n) for n in FIXED}
        if cfg.data is not None:
            opts.update(tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size)
    return {**opts, "model_spec": _spec(mcfg), "init_from": str(p)}


def _tokenizer_size(path: Path) -> int:
    from .tokenizer import read_tokenizer_file

    return int(read_tokenizer_file(path)[0].get_vocab_size(with_added_tokens=True))


def apply_init_from(given: dict) -> dict:
    """The command line's options with ``--init-from``'s applied: the source fixes the
    model and the tokenizer; a given option that differs is refused, naming it (an explicit
    ``--tokenizer`` of another kind excepted: the run then trains on ids the source's
    embeddings never saw, as asked, and says so).  A Hugging Face source without a
    tokenizer.json is refused for text ``--data`` unless ``--tokenizer`` is given.  The
    source's weights are read and checked here too, before any work."""
    path = given.get("init_from")
    if path is None:
        return given
    opts = source_options(path)
    for n in FIXED:
        if n in given and n in opts and given[n] != opts[n]:
            raise ValueError(f"--{n.replace('_', '-')} {given[n]!r}: the --init-from model {path} has "
                             f"{n}={opts[n]!r} (leave the option out: the source fixes it)")
    _check_weights(Path(path))
    tok = {k: opts.pop(k) for k in ("tokenizer", "vocab_size") if k in opts}
    data = given.get("data")
    if data is not None and not _names_its_tokenizer(data):
        if "tokenizer" in given and given["tokenizer"] != tok.get("tokenizer"):
            pass  # explicit: the run's own tokenizer (bytes, or a BPE fitted to --data)
        elif tok:
            if given.get("vocab_size") not in (None, tok["vocab_size"]):
                raise ValueError(f"--vocab-size {given['vocab_size']}: the --init-from tokenizer of {path} has "
                                 f"{tok['vocab_size']} ids (leave the option out: the source fixes it)")
            opts.update(tok)
        elif _is_hf(Path(path)):
            raise ValueError(
                f"--init-from {path} has no {TOKENIZER_FILE}: the token ids its embeddings know cannot be made "
                f"from --data (save its tokenizer beside it, tokenizer.save_pretrained(DIR); or pass "
                f"--tokenizer bytes to train on ids it never saw)")
    return {**given, **opts}


def _names_its_tokenizer(data) -> bool:
    """Whether ``--data`` is token shards whose tokens.json names their tokenizer."""
    from . import shards as S

    p = Path(data)
    return S.is_shards(p) and S.read_meta(p.parent if p.is_file() else p) is not None


def data_options(given: dict) -> dict:
    """``given`` with the options token shards fix (their tokens.json: ``tokenizer`` and
    ``vocab_size``); a given option that differs is refused, naming both.  Shards without
    tokens.json (nanoGPT's, llm.c's) are ids of the ``--init-from`` model's tokenizer."""
    from . import shards as S

    data = given.get("data")
    if data is None or not S.is_shards(data):
        return given
    p = Path(data)
    meta = S.read_meta(p.parent if p.is_file() else p)
    if meta is None:  # nanoGPT's or llm.c's shards: the --init-from model's ids, or bare ids
        if given.get("init_from") is not None:
            if given.get("tokenizer") != "pretrained":
                raise ValueError(f"--data {data}: token shards without tokens.json are ids of the --init-from "
                                 "model's tokenizer.json, which it does not have (write them with attngrad "
                                 "tokenize)")
            return given
        if given.get("tokenizer") not in (None, "ids"):
            raise ValueError(f"--data {data}: token shards without tokens.json name no tokenizer; "
                             f"--tokenizer {given['tokenizer']} cannot apply (they are trained on as bare ids)")
        vocab = given.get("vocab_size")
        if vocab is None:  # their largest id + 1, read once through the files
            _, _, hi = S.load_shards(p, 1, given.get("val_fraction", 0.1))
            vocab = hi + 1
        return {**given, "tokenizer": "ids", "vocab_size": vocab}
    fixed = {"tokenizer": meta["tokenizer"], "vocab_size": None if meta["tokenizer"] == "bytes" else meta["vocab"]}
    for k, v in fixed.items():
        if given.get(k) not in (None, v):
            raise ValueError(f"--data {data}: its tokens.json says {k}={v!r}; {k}={given[k]!r} cannot apply "
                             "(token shards are the ids of the tokenizer that wrote them)")
    return {**given, **fixed}


def _check_weights(p: Path) -> None:
    """Read the source's weights once, every name, shape and value checked (ValueError)."""
    if _is_hf(p):
        kind, mcfg = HF.config_from_hf(HF.read_config(p), p, "float64")
        HF.params_from_hf(kind, mcfg, HF.read_tensors(p), source=f"--init-from {p}")
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


# ---------------------------------------------------------------- the source's weights and files


def initial_params(cfg) -> dict:
    """Step 0's parameters: a fresh initialisation, or the ``--init-from`` source's weights
    (cast to ``cfg.dtype``), checked against the model ``cfg`` describes."""
    model = MODELS[cfg.model]
    if cfg.init_from is None:
        return model.init(cfg.model_config, cfg.seed)
    mcfg = cfg.model_config
    p = Path(cfg.init_from)
    if _is_hf(p):
        return HF.params_from_hf(cfg.model, mcfg, HF.read_tensors(p), source=f"--init-from {p}")
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


def source_tokenizer_file(cfg) -> Path | None:
    """The tokenizer.json the ``--init-from`` source holds (the tokenizer a run with
    ``cfg.tokenizer`` of the source's kind uses as it is), or None."""
    if cfg.init_from is None or cfg.tokenizer == "bytes":
        return None
    p = Path(cfg.init_from)
    f = p / TOKENIZER_FILE if p.is_dir() else p.parent / TOKENIZER_FILE
    if _is_hf(p):
        return f if cfg.tokenizer == "pretrained" and f.is_file() else None
    from .config import TrainConfig

    src = TrainConfig.from_flat(stored_config(_newest(p, "--init-from")))
    return f if src.tokenizer == cfg.tokenizer and f.is_file() else None


def source_eod(cfg) -> int | None:
    """The end-of-document id of the ``--init-from`` model: its config.json's
    ``eos_token_id`` (the first, when a list), or a run source's stored one."""
    if cfg.init_from is None:
        return None
    p = Path(cfg.init_from)
    config = p / "config.json" if _is_hf(p) else (p if p.is_dir() else p.parent) / SOURCE_DIR / "config.json"
    if config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        return eos if isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0 else None
    if not _is_hf(p):
        return load_checkpoint(_newest(p, "--init-from"))[1].get("eod")
    return None


def copy_source_files(cfg, out) -> None:
    """The ``--init-from`` model's config.json, generation_config.json and tokenizer files
    copied into ``out/source/`` (a run source's own ``source/``), for ``export``."""
    if cfg.init_from is None:
        return
    p = Path(cfg.init_from)
    src = p if _is_hf(p) else (p if p.is_dir() else p.parent) / SOURCE_DIR
    files = [src / "config.json", *HF.source_files(src)] if (src / "config.json").is_file() else []
    if not files:
        return
    dest = Path(out) / SOURCE_DIR
    dest.mkdir(exist_ok=True)
    for f in files:
        tmp = dest / f".{f.name}.tmp-{os.getpid()}"
        shutil.copyfile(f, tmp)
        os.replace(tmp, dest / f.name)


# ---------------------------------------------------------------- export


def load_run(run, checkpoint=None):
    """(TrainConfig, params, step, checkpoint path) of the newest checkpoint of ``run``
    (or ``checkpoint``), verified."""
    from .config import TrainConfig

    path = Path(checkpoint) if checkpoint is not None else _newest(Path(run), "--run")
    cfg = TrainConfig.from_flat(stored_config(path, "--checkpoint"))  # verified: the arrays' checksums too
    init = MODELS[cfg.model].init(cfg.model_config, 0)
    try:
        arrays, state = load_checkpoint(path, expected=expected_arrays(init))
    except CheckpointError as exc:  # whole, but not this model's
        raise CheckpointError(f"{exc}{newest_good_hint(path, '--checkpoint')}") from None
    params = {k: arrays[f"param/{k}"] for k in init}
    return cfg, params, int(state["step"]), path


def export_run(run, out, *, checkpoint=None, dtype: str = "float32") -> Path:
    """Write run ``run``'s newest checkpoint (or ``checkpoint``) to ``out`` as a Hugging Face
    directory: config.json (the ``--init-from`` source's, written back, when the run has
    one), model.safetensors, generation_config.json and the tokenizer files."""
    cfg, params, _, path = load_run(run, checkpoint)
    run = Path(run)
    src = run / SOURCE_DIR
    base = json.loads((src / "config.json").read_text(encoding="utf-8")) if (src / "config.json").is_file() else None
    kind = base.get("model_type") if base else cfg.model
    if cfg.model not in ("gpt2", "llama") or (base is not None and (kind not in HF.KINDS or
                                                                    module_of(kind) != cfg.model)):
        raise ValueError(f"{path}: a {cfg.model!r} run; export writes GPT-2 and Llama-family models "
                         "(train with --model gpt2 or --model llama, or --init-from such a model)")
    extra = HF.source_files(src) if base is not None else []
    if cfg.data is not None and cfg.tokenizer != "pretrained":  # trained on ids of its own: not the source's
        extra = [f for f in extra if f.name not in _TOKENIZER_FILES]
    tok = run / TOKENIZER_FILE
    if cfg.data is not None and cfg.tokenizer != "bytes" and tok.is_file() and TOKENIZER_FILE not in {
            f.name for f in extra}:
        extra.append(tok)
    special = None
    if base is None:  # attngrad's own ids: the toy tasks', the bytes', the BPE's
        special = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
        if cfg.data is not None and cfg.tokenizer in ("pretrained", "ids"):  # another model's ids, or bare ids
            eod = load_checkpoint(path)[1].get("eod")
            special = {"eos_token_id": eod} if eod is not None else {}
    positions = cfg.context if cfg.data is not None and cfg.model == "llama" else None
    return HF.save_pretrained(out, kind, cfg.model_config, params, dtype=dtype, extra_files=extra,
                              base_config=base, special_ids=special, positions=positions)
