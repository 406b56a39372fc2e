"""Targets: the attention implementations ``attngrad conform`` checks, and the reference.

A :class:`Target` runs one :class:`~attngrad.conform.inputs.CaseInputs` in the problem's dtype
and returns the output and the gradients of L = sum(out * dout) as float64 NumPy arrays.
Built-in targets are named (``torch.sdpa``, ``torch.sdpa:math``, ``torch.sdpa:flash``,
``torch.naive``, ``torch.flex``, ``jax.dpa``, ``attngrad.dense``, ``attngrad.tiled``); a
user's function is loaded from ``module:function`` or ``path/to/file.py:function`` and
called through one of the protocols registered in ``protocols.REGISTRY`` (``sdpa``, ``flash``,
``flash_varlen``, ``explicit``, ``flex``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from ..core.sdpa import sdpa_forward
from ..core.variants import VARIANT_FEATURES, VARIANT_OPTIONS, variant_of_feature
from .cases import FEATURES
from .jax_target import jax_dpa
from .packing import attngrad_varlen
from .protocols import BASE, MASKING, OPT_IN, REGISTRY, protocol
from .reference import attngrad_runner
from .result import Result, Target
from .torch_targets import _torch, flex_runner, sdpa_runner, torch_naive

__all__ = [
    "BUILTINS",
    "CUDA_BUILTINS",
    "OPT_IN",
    "PROTOCOLS",
    "Result",
    "Target",
    "available_builtins",
    "check_device",
    "check_features",
    "default_features",
    "grad_names",
    "parse_features",
    "protocol_lacks",
    "reference_lacks",
    "reference_signature",
    "resolve_target",
]

# The registry's names at import (protocols.REGISTRY is what the code reads, so a protocol
# registered later is known everywhere; these stay for the names they always were).
PROTOCOLS = tuple(REGISTRY)
PROTOCOL_FEATURES = {name: set(p.features) for name, p in REGISTRY.items()}
CANNOT = {name: dict(p.cannot) for name, p in REGISTRY.items()}


def cannot(protocol_name: str | None) -> dict:
    """feature -> why protocol ``protocol_name`` cannot express it ({} for none or a built-in's own)."""
    p = REGISTRY.get(protocol_name)
    return dict(p.cannot) if p is not None else {}


def default_features(protocol_name: str) -> frozenset:
    """What a target of ``protocol_name`` that declares nothing is checked on: everything the
    protocol can express but the opt-in features it does not keep."""
    p = protocol(protocol_name)
    return frozenset(p.features - (OPT_IN - p.keep))


BUILTINS = ("torch.sdpa", "torch.sdpa:math", "torch.sdpa:flash", "torch.naive", "torch.flex",
            "jax.dpa", "attngrad.dense", "attngrad.tiled", "attngrad.varlen")
CUDA_BUILTINS = ("torch.sdpa:efficient", "torch.sdpa:cudnn")  # listed only where CUDA is available
SDPA_BACKENDS = {"torch.sdpa": None, "torch.sdpa:math": "MATH", "torch.sdpa:flash": "FLASH_ATTENTION",
                 "torch.sdpa:efficient": "EFFICIENT_ATTENTION", "torch.sdpa:cudnn": "CUDNN_ATTENTION"}
NUMPY_NOTE = "runs on NumPy, on the CPU"


def cuda_available() -> bool:
    """True where torch sees a CUDA device (False without torch)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def available_builtins() -> tuple:
    """The built-in targets this machine can run: the CUDA backends only where CUDA is."""
    return BUILTINS + (CUDA_BUILTINS if cuda_available() else ())


def check_features(names, where: str = "features", protocol: str | None = None) -> frozenset:
    """The declared feature names, checked: unknown names and (for a protocol) names it cannot
    express raise ValueError naming them; "all" means everything the protocol can express."""
    names = set(names)
    if "all" in names:
        names = (names - {"all"}) | set(REGISTRY[protocol].features if protocol in REGISTRY else FEATURES)
    bad = sorted(names - set(FEATURES))
    if bad:
        raise ValueError(f"{where}: unknown feature(s) {', '.join(bad)}; known: {', '.join(FEATURES)}")
    why = cannot(protocol)
    refused = [n for n in sorted(names) if n in why]
    if refused:
        n = refused[0]
        more = f" (also {', '.join(refused[1:])})" if len(refused) > 1 else ""
        raise ValueError(f"{where}: the {protocol} protocol cannot express feature {n}{more}: {why[n]}")
    return frozenset(names)


def parse_features(names, base, where: str = "features", protocol: str | None = None) -> frozenset:
    """Feature names as declared: plain names (and "all") replace ``base``; "+name" adds to
    it and "-name" takes away (``{"+lse"}``: ``base`` and the lse).  Checked as
    :func:`check_features` checks them; a string is one comma list."""
    if isinstance(names, str):
        names = names.split(",")
    try:
        items = [str(n).strip() for n in names]
    except TypeError:
        raise TypeError(f"{where} must be a collection of feature names; got {type(names).__name__}") from None
    plain = {n for n in items if n and n[0] not in "+-"}
    plus = {n[1:].strip() for n in items if n.startswith("+")}
    minus = {n[1:].strip() for n in items if n.startswith("-")}
    chosen = set(check_features(plain, where, protocol)) if plain else set(base)
    chosen |= check_features(plus, where, protocol)
    chosen -= check_features(minus, where, None)
    return frozenset(chosen)


def protocol_lacks(protocol_name: str, case) -> str | None:
    """Why ``protocol_name`` cannot express ``case`` although the target declares its
    features (a per-case limit, or a layout it cannot pass); None when it can."""
    p = REGISTRY.get(protocol_name)
    if p is None:  # a built-in's own calling convention (jax.dpa): JAX arrays have no strides
        if case.layout != "contiguous":
            return f"the {protocol_name} target copies its inputs into arrays of its own (no layout to probe)"
        return None
    if case.layout not in p.layouts:
        why = "torch tensors have no negative strides" if case.layout == "flipped" else "it has no such views"
        return f"the {protocol_name} protocol cannot pass layout {case.layout} ({why})"
    if p.lacks is not None:
        why = p.lacks(case)
        if why:
            return f"the {protocol_name} protocol cannot express this case: {why}"
    return None


def check_device(device) -> str:
    """The torch device string ``device`` names; ValueError unless torch has it here."""
    text = str(device)
    if text == "cpu":
        return text
    if importlib.util.find_spec("torch") is None:
        raise ValueError(f"device {text!r} needs PyTorch, which is not installed")
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be a torch device (cpu, cuda, cuda:N, mps); got {text!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r}: CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {text!r}: MPS is not available here")
    elif dev.type != "cpu":
        raise ValueError(f"device must be cpu, cuda, cuda:N or mps; got {text!r}")
    return text


# --------------------------------------------------------------------------- reference


def reference_signature() -> set:
    """The keyword options attngrad's sdpa_forward takes."""
    return set(inspect.signature(sdpa_forward).parameters)


def _reference_has(feature: str, params: set) -> bool:
    return set(VARIANT_OPTIONS[variant_of_feature(feature)]) <= params


def reference_lacks(case) -> str | None:
    """The first variant feature of ``case`` that attngrad's sdpa_forward cannot express."""
    params = reference_signature()
    if case.topk and "kv_indices" not in params:
        return "topk"
    return next((f for f in case.variants if not _reference_has(f, params)), None)


def grad_names(case) -> tuple:
    """The tensors compared for ``case``: out, dQ, dK, dV and the learned parameters."""
    names = ["out", *(["lse"] if case.lse else []), "q", "k", "v", *case.learned]
    if case.sinks:
        names.append("sinks")
    if case.scale_grad:
        names.append("scale")
    return tuple(names)


def _attngrad_target(impl: str) -> Target:
    params = reference_signature()
    variants = {f for f in VARIANT_FEATURES.values() if _reference_has(f, params)}
    if "alibi" in variants:
        variants.add("alibi_grad")
    feats = BASE - {"bfloat16"} | MASKING | {"bias", "bias_grad", "topk", "lse", "varlen"} | variants
    if impl == "varlen":  # sdpa_varlen_forward under the flash_varlen protocol
        feats = REGISTRY["flash_varlen"].features - {"bfloat16"}
        return Target("attngrad.varlen", "flash_varlen", frozenset(feats), attngrad_varlen,
                      "attngrad.sdpa_varlen_forward/sdpa_varlen_backward as flash_attn_varlen_func, "
                      "NumPy (no bfloat16 in NumPy)")
    return Target(f"attngrad.{impl}", "explicit", frozenset(feats), attngrad_runner(impl),
                  "attngrad.sdpa_forward/sdpa_backward (sdpa_varlen_* for varlen), NumPy (no bfloat16 in NumPy)")


def _cpu_only(name: str, device: str, why: str = NUMPY_NOTE) -> None:
    if device != "cpu":
        raise ValueError(f"target {name} {why}; --device {device} needs a torch target (sdpa or flash protocol)")


# --------------------------------------------------------------------------- loading


def _builtin(name: str, device: str = "cpu") -> Target:
    if name.startswith("attngrad."):
        _cpu_only(name, device)
        return _attngrad_target(name.split(".", 1)[1])
    if name == "jax.dpa":
        _cpu_only(name, device, "runs through JAX on its own default device")
        if importlib.util.find_spec("jax") is None:
            raise ValueError("target jax.dpa needs JAX, which is not importable here (pip install jax)")
        # causal and local windows are top-left aligned; key padding as key_value_seq_lengths
        feats = BASE | {"mask", "padding", "fully_masked", "causal", "causal_top_left", "window",
                        "bias", "bias_grad"}
        return Target(name, "jax", frozenset(feats), jax_dpa, "jax.nn.dot_product_attention (xla)")
    _torch()
    at = "" if device == "cpu" else f", on {device}"
    if name == "torch.naive":
        feats = BASE | MASKING | {"bias", "bias_grad", *VARIANT_FEATURES.values(), "alibi_grad"}
        return Target(name, "sdpa", frozenset(feats), lambda p: torch_naive(p, device),
                      "plain torch ops, autograd, float32 arithmetic for half inputs" + at)
    if name == "torch.flex":
        feats = BASE | MASKING | {"bias", "softcap", "alibi", "window", "segments"}
        return Target(name, "sdpa", frozenset(feats), flex_runner(device),
                      "torch.nn.attention.flex_attention, rules as a score_mod"
                      + (", compiled" if device.startswith("cuda") else "") + at)
    if name in CUDA_BUILTINS and not cuda_available():
        raise ValueError(f"target {name} needs CUDA, which is not available here")
    if name in CUDA_BUILTINS and not device.startswith("cuda"):
        raise ValueError(f"target {name} runs on CUDA only; add --device cuda")
    import torch.nn.functional as F

    backend = SDPA_BACKENDS[name]
    feats = default_features("sdpa")  # scaled_dot_product_attention returns no lse
    return Target(name, "sdpa", frozenset(feats),
                  sdpa_runner(F.scaled_dot_product_attention, backend, device, builtin=True),
                  "torch.nn.functional.scaled_dot_product_attention"
                  + (f", backend {backend}" if backend else ", default backend") + at)


def _load_object(spec: str):
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(
            f"target must be a built-in ({', '.join(available_builtins())}), module:function or "
            f"path/to/file.py:function; got {spec!r}"
        )
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"target file {where!r} does not exist")
        folder = str(path.resolve().parent)  # its own modules import as they do when it runs
        if folder not in sys.path:
            sys.path.insert(0, folder)
        mod_name = f"_attngrad_conform_target_{abs(hash(str(path.resolve())))}"
        mspec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module
        try:
            mspec.loader.exec_module(module)
        except Exception as exc:
            raise ValueError(f"target file {where!r} failed to import: {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise ValueError(f"target module {where!r} failed to import: {type(exc).__name__}: {exc}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"target {spec!r}: {where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_target(target, *, protocol: str | None = None, features=None, device: str = "cpu") -> Target:
    """A :class:`Target` from a built-in name, ``module:function``, ``file.py:function``,
    a callable or an explicit-protocol object.  ``features`` replaces what it declares
    ("+name" items add to it, "-name" items take away: :func:`parse_features`); in an
    ``attngrad_features`` attribute "+name" items add to the protocol's defaults.  A declared
    feature its protocol cannot express raises ValueError naming it.  ``device``: where the
    target's inputs are created (torch targets)."""
    if protocol is not None and protocol not in REGISTRY:
        raise ValueError(f"protocol must be one of {', '.join(REGISTRY)}; got {protocol!r}")
    device = check_device(device)
    if isinstance(target, Target):
        t = target
    elif isinstance(target, str) and target in BUILTINS + CUDA_BUILTINS:
        if protocol is not None:
            raise ValueError(f"--protocol applies to a user's function, not the built-in {target}")
        t = _builtin(target, device)
    else:
        obj = _load_object(target) if isinstance(target, str) else target
        name = target if isinstance(target, str) else getattr(obj, "__name__", type(obj).__name__)
        if inspect.isclass(obj) and hasattr(obj, "forward") and hasattr(obj, "backward"):
            obj = obj()
        proto = protocol or getattr(obj, "attngrad_protocol", None)
        if proto is None:
            proto = "explicit" if hasattr(obj, "forward") and hasattr(obj, "backward") else "sdpa"
        if proto not in REGISTRY:
            raise ValueError(f"{name}: attngrad_protocol must be one of {', '.join(REGISTRY)}; got {proto!r}")
        spec = REGISTRY[proto]
        if spec.numpy:
            if not (callable(getattr(obj, "forward", None)) and callable(getattr(obj, "backward", None))):
                raise ValueError(f"{name}: the {proto} protocol needs forward() and backward() methods")
            _cpu_only(name, device, f"uses the {proto} protocol, which " + NUMPY_NOTE)
        elif not callable(obj):
            raise ValueError(f"{name}: the {proto} protocol needs a callable; got {type(obj).__name__}")
        run = spec.runner(obj, device)
        declared = getattr(obj, "attngrad_features", None)
        feats = default_features(proto) if declared is None else parse_features(
            declared, default_features(proto), f"{name}.attngrad_features", proto)
        at = "" if device == "cpu" else f", on {device}"
        t = Target(name, proto, frozenset(feats), run, "a user's function" + at)
    if features is not None:
        proto = t.protocol if t.protocol in REGISTRY else None
        t = Target(t.name, t.protocol, parse_features(features, t.features, "features", proto), t.run, t.note)
    return t
