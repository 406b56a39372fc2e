"""Targets: the attention implementations ``attngrad conform`` checks, and the reference.

A :class:`Target` runs one :class:`~attngrad.conform.grid.Problem` in the problem's dtype
and returns the output and the gradients of L = sum(out * dout) as float64 NumPy arrays.
Built-in targets are named (``torch.sdpa``, ``torch.sdpa:math``, ``torch.sdpa:flash``,
``torch.naive``, ``torch.flex``, ``jax.dpa``, ``attngrad.dense``, ``attngrad.tiled``); a
user's function is loaded from ``module:function`` or ``path/to/file.py:function`` and
called through one of three protocols (``sdpa``, ``flash``, ``explicit``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .grid import FEATURES, VARIANT_OPTIONS, VARIANTS, Problem

PROTOCOLS = ("sdpa", "flash", "explicit")
BASE = {"gqa", "dv", "float64", "float32", "float16", "bfloat16"}
MASKING = {"mask", "padding", "fully_masked", "causal", "causal_top_left", "causal_bottom_right"}
# What each protocol can express, the default for a target that declares nothing.
PROTOCOL_FEATURES = {
    "sdpa": BASE | MASKING - {"causal_bottom_right"} | {"bias", "bias_grad"},
    "flash": BASE | {"causal", "causal_bottom_right", "window", "softcap", "alibi"},
    "explicit": BASE - {"bfloat16"} | MASKING | {"bias", "bias_grad"},
}
BUILTINS = ("torch.sdpa", "torch.sdpa:math", "torch.sdpa:flash", "torch.naive", "torch.flex",
            "jax.dpa", "attngrad.dense", "attngrad.tiled")


@dataclass
class Result:
    """A target's answer: out (B, H, Lq, Dv) and gradients, float64; or what it refused."""

    out: np.ndarray | None
    grads: dict | None
    refused: str | None = None  # set when the target raised (forward or backward)


@dataclass
class Target:
    name: str
    protocol: str
    features: frozenset
    run: Callable[[Problem], Result] = field(repr=False)
    note: str = ""


def check_features(names, where: str = "features") -> frozenset:
    names = set(names)
    if "all" in names:
        names = (names - {"all"}) | set(FEATURES)
    bad = sorted(names - set(FEATURES))
    if bad:
        raise ValueError(f"{where}: unknown feature(s) {', '.join(bad)}; known: {', '.join(FEATURES)}")
    return frozenset(names)


# --------------------------------------------------------------------------- reference


def reference_signature() -> set:
    import attngrad

    return set(inspect.signature(attngrad.sdpa_forward).parameters)


def reference_lacks(case) -> str | None:
    """The first variant of ``case`` that attngrad's sdpa_forward cannot express yet."""
    import attngrad

    params = reference_signature()
    for variant in case.variants:
        if not set(VARIANT_OPTIONS[variant]) <= params:
            return variant
        if variant == "dropout" and not hasattr(attngrad, "dropout_mask"):
            return variant
    return None


def grad_names(case) -> tuple:
    """The tensors compared for ``case``: out, dQ, dK, dV and the learned parameters."""
    names = ["out", "q", "k", "v", *case.learned]
    if case.sinks:
        names.append("sinks")
    if case.scale_grad:
        names.append("scale")
    return tuple(names)


def reference(problem: Problem) -> Result:
    """attngrad's closed form in float64, dense path, on the clean inputs."""
    import attngrad

    out, cache = attngrad.sdpa_forward(
        problem.q, problem.clean_k, problem.clean_v, impl="dense", **problem.options
    )
    grads = attngrad.sdpa_backward(problem.dout, cache)
    return Result(np.asarray(out, np.float64), {n: np.asarray(g, np.float64) for n, g in grads.items()})


def dropout_keep(problem: Problem) -> np.ndarray:
    """The reference's dropout keep mask (B, H, Lq, Lk), True = kept."""
    import attngrad

    c = problem.case
    o = problem.options
    return np.asarray(attngrad.dropout_mask(o["dropout_seed"], (c.b, c.h, c.lq, c.lk), o["dropout_p"]))


# --------------------------------------------------------------------------- attngrad


def _attngrad_target(impl: str) -> Target:
    def run(problem: Problem) -> Result:
        import attngrad

        dt = np.dtype(problem.dtype)
        opts = {n: (np.asarray(a, dt) if n in ("bias", "sinks", "alibi_slopes") else a)
                for n, a in problem.options.items()}
        out, cache = attngrad.sdpa_forward(
            problem.q.astype(dt), problem.k.astype(dt), problem.v.astype(dt), impl=impl, **opts
        )
        grads = attngrad.sdpa_backward(problem.dout.astype(dt), cache)
        return Result(np.asarray(out, np.float64), {n: np.asarray(g, np.float64) for n, g in grads.items()})

    params = reference_signature()
    variants = {v for v in VARIANTS if set(VARIANT_OPTIONS[v]) <= params}
    if "alibi" in variants:
        variants.add("alibi_grad")
    feats = BASE - {"bfloat16"} | MASKING | {"bias", "bias_grad"} | variants
    return Target(f"attngrad.{impl}", "explicit", frozenset(feats), run,
                  "attngrad.sdpa_forward/sdpa_backward, NumPy (no bfloat16 in NumPy)")


# --------------------------------------------------------------------------- explicit


def explicit_runner(obj) -> Callable[[Problem], Result]:
    """forward(q, k, v, **options) -> (out, ctx); backward(dout, ctx) -> dict, on NumPy."""

    def run(problem: Problem) -> Result:
        dt = np.dtype(problem.dtype)
        opts = {n: (np.asarray(a, dt) if n in ("bias", "sinks", "alibi_slopes") else a)
                for n, a in problem.options.items()}
        out, ctx = obj.forward(problem.q.astype(dt), problem.k.astype(dt), problem.v.astype(dt), **opts)
        grads = obj.backward(problem.dout.astype(dt), ctx)
        if not isinstance(grads, dict):
            raise TypeError(f"backward must return a dict of gradients; got {type(grads).__name__}")
        return Result(np.asarray(out, np.float64), {n: np.asarray(g, np.float64) for n, g in grads.items()})

    return run


# --------------------------------------------------------------------------- torch


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError("this target needs PyTorch, which is not installed") from None
    return torch


def _leaf(torch, x, dtype, grad=True):
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).requires_grad_(grad)


def _tdtype(torch, name: str):
    return getattr(torch, name)


def _collect(out, leaves: dict, layout_bl: bool = False) -> Result:
    """float64 NumPy out (B, H, Lq, Dv) and gradients from torch leaves."""
    if layout_bl:
        out = out.transpose(1, 2)
    grads = {}
    for name, t in leaves.items():
        g = t.grad
        if g is None:
            g = np.zeros(tuple(t.shape))
        else:
            g = g.detach().double()
            if layout_bl and name in ("q", "k", "v"):
                g = g.transpose(1, 2)
            g = g.numpy()
        grads[name] = np.array(g, dtype=np.float64)
    return Result(out.detach().double().numpy().copy(), grads)


def torch_naive(problem: Problem) -> Result:
    """Plain PyTorch ops in the problem's dtype, autograd for the gradients: every feature.

    This is also the "plain implementation in the same precision" of FlashAttention's rule.
    """
    torch = _torch()
    c, o = problem.case, problem.options
    dt = _tdtype(torch, c.dtype)
    leaves = {"q": _leaf(torch, problem.q, dt), "k": _leaf(torch, problem.k, dt),
              "v": _leaf(torch, problem.v, dt)}
    scale = o["scale"]
    if c.scale_grad:
        leaves["scale"] = torch.tensor(scale, dtype=dt, requires_grad=True)
        scale = leaves["scale"]
    g = c.h // c.hkv
    k = leaves["k"].repeat_interleave(g, dim=1)  # (B, H, Lk, D)
    v = leaves["v"].repeat_interleave(g, dim=1)  # (B, H, Lk, Dv)
    s = (leaves["q"] @ k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if c.softcap > 0:
        s = c.softcap * torch.tanh(s / c.softcap)
    if "bias" in o:
        leaves["bias"] = _leaf(torch, o["bias"], dt, "bias" in c.learned)
        s = s + leaves["bias"]
    if "alibi_slopes" in o:
        leaves["alibi_slopes"] = _leaf(torch, o["alibi_slopes"], dt, "alibi_slopes" in c.learned)
        off = c.lk - c.lq if c.causal == "bottom_right" else 0
        dist = (torch.arange(c.lq)[:, None] + off - torch.arange(c.lk)[None, :]).abs().to(dt)  # (Lq, Lk)
        s = s - leaves["alibi_slopes"][:, None, None] * dist
    allowed = torch.from_numpy(problem.allowed)  # (B, H, Lq, Lk)
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()  # (B, H, Lq, 1)
    if c.sinks:
        leaves["sinks"] = _leaf(torch, o["sinks"], dt)
        sink = leaves["sinks"][None, :, None, None]  # (1, H, 1, 1)
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)  # (B, H, Lq, Lk)
    z = e.sum(dim=-1, keepdim=True)
    if c.sinks:
        z = z + torch.exp(sink - m)
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    if c.dropout > 0:
        keep = torch.from_numpy(dropout_keep(problem))
        p = p * keep.to(dt) / (1 - c.dropout)
    out = p @ v  # (B, H, Lq, Dv)
    (out * torch.from_numpy(problem.dout).to(dt)).sum().backward()
    for name in ("bias", "alibi_slopes"):
        if name in leaves and name not in c.learned:
            del leaves[name]
    return _collect(out, leaves)


def sdpa_runner(fn, backend: str | None = None) -> Callable[[Problem], Result]:
    """torch.nn.functional.scaled_dot_product_attention's signature, autograd gradients."""

    def run(problem: Problem) -> Result:
        torch = _torch()
        c, o = problem.case, problem.options
        dt = _tdtype(torch, c.dtype)
        leaves = {"q": _leaf(torch, problem.q, dt), "k": _leaf(torch, problem.k, dt),
                  "v": _leaf(torch, problem.v, dt)}
        others = any(n in o for n in ("mask", "key_lengths", "bias"))  # causal then folds into a mask
        kwargs: dict = {"scale": o["scale"]}
        attn_mask = None
        if c.causal != "none" and not others and (c.causal == "top_left" or c.lq == c.lk):
            kwargs["is_causal"] = True
        elif c.causal == "bottom_right" and not others:
            from torch.nn.attention.bias import causal_lower_right

            attn_mask = causal_lower_right(c.lq, c.lk)
        elif others or c.causal != "none":
            attn_mask = torch.from_numpy(problem.allowed)  # (B, H, Lq, Lk) every rule folded in
        if "bias" in o:
            leaves["bias"] = _leaf(torch, o["bias"], dt, "bias" in c.learned)
            bias = leaves["bias"]
            if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
                attn_mask = torch.from_numpy(problem.allowed)
            attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))
            if "bias" not in c.learned:
                del leaves["bias"]
        if attn_mask is not None:
            kwargs["attn_mask"] = attn_mask
        if c.hkv != c.h:
            kwargs["enable_gqa"] = True
        if backend is None:
            out = fn(leaves["q"], leaves["k"], leaves["v"], **kwargs)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = fn(leaves["q"], leaves["k"], leaves["v"], **kwargs)
        if isinstance(out, tuple):  # (out, lse, ...) from kernels that return more
            out = out[0]
        (out * torch.from_numpy(problem.dout).to(dt)).sum().backward()
        return _collect(out, leaves)

    return run


def flash_runner(fn) -> Callable[[Problem], Result]:
    """FlashAttention's flash_attn_func signature on (B, L, H, D) tensors, autograd."""

    def run(problem: Problem) -> Result:
        torch = _torch()
        c, o = problem.case, problem.options
        dt = _tdtype(torch, c.dtype)
        leaves = {n: _leaf(torch, np.swapaxes(a, 1, 2), dt)
                  for n, a in (("q", problem.q), ("k", problem.k), ("v", problem.v))}
        left, right = o.get("window", (None, None))
        kwargs = {
            "dropout_p": 0.0,
            "softmax_scale": o["scale"],
            "causal": c.causal != "none",
            "window_size": (-1 if left is None else left, -1 if right is None else right),
            "softcap": float(c.softcap),
            "alibi_slopes": None,
            "deterministic": True,
            "return_attn_probs": False,
        }
        if "alibi_slopes" in o:
            slopes = torch.from_numpy(o["alibi_slopes"])  # float32 as FlashAttention wants, float64 kept
            kwargs["alibi_slopes"] = slopes if c.dtype == "float64" else slopes.float()
        out = fn(leaves["q"], leaves["k"], leaves["v"], **kwargs)
        if isinstance(out, tuple):
            out = out[0]
        dout = torch.from_numpy(np.swapaxes(problem.dout, 1, 2).copy()).to(dt)
        (out * dout).sum().backward()
        return _collect(out, leaves, layout_bl=True)

    return run


def torch_flex(problem: Problem) -> Result:
    """FlexAttention with every rule as a score_mod; gradients if the backend gives them."""
    torch = _torch()
    from torch.nn.attention.flex_attention import flex_attention

    c, o = problem.case, problem.options
    dt = _tdtype(torch, c.dtype)
    allowed = torch.from_numpy(problem.allowed)  # (B, H, Lq, Lk)
    bias = None
    if "bias" in o:
        bias = torch.from_numpy(np.broadcast_to(o["bias"], problem.allowed.shape).copy()).to(dt)
    slopes = torch.from_numpy(o["alibi_slopes"]).to(dt) if "alibi_slopes" in o else None
    off = c.lk - c.lq if c.causal == "bottom_right" else 0

    def score_mod(score, b, h, i, j):
        if c.softcap > 0:
            score = c.softcap * torch.tanh(score / c.softcap)
        if bias is not None:
            score = score + bias[b, h, i, j]
        if slopes is not None:
            score = score - slopes[h] * (i + off - j).abs()
        return torch.where(allowed[b, h, i, j], score, -float("inf"))

    def forward(grad: bool):
        leaves = {"q": _leaf(torch, problem.q, dt, grad), "k": _leaf(torch, problem.k, dt, grad),
                  "v": _leaf(torch, problem.v, dt, grad)}
        out = flex_attention(leaves["q"], leaves["k"], leaves["v"], score_mod=score_mod,
                             scale=o["scale"], enable_gqa=c.hkv != c.h)
        return out, leaves

    try:
        out, leaves = forward(True)
        (out * torch.from_numpy(problem.dout).to(dt)).sum().backward()
        return _collect(out, leaves)
    except NotImplementedError as exc:  # the backward is refused on CPU: check the forward
        out, _ = forward(False)
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Result(out.detach().double().numpy().copy(), None, f"backward refused: {why}")


# --------------------------------------------------------------------------- jax


def jax_dpa(problem: Problem) -> Result:
    """jax.nn.dot_product_attention on (B, L, H, D) arrays, gradients by jax.vjp."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    c, o = problem.case, problem.options
    dt = {"float64": jnp.float64, "float32": jnp.float32, "float16": jnp.float16,
          "bfloat16": jnp.bfloat16}[c.dtype]
    q, k, v = (jnp.asarray(np.swapaxes(a, 1, 2), dtype=dt) for a in (problem.q, problem.k, problem.v))
    kwargs: dict = {"scale": o["scale"]}
    if c.causal != "none":
        kwargs["is_causal"] = True
    if "key_lengths" in o:
        kwargs["key_value_seq_lengths"] = jnp.asarray(o["key_lengths"], dtype=jnp.int32)
    if "mask" in o:
        kwargs["mask"] = jnp.asarray(o["mask"])
    if "window" in o:
        left, right = o["window"]
        kwargs["local_window_size"] = (-1 if left is None else left, -1 if right is None else right)
    params = [q, k, v]
    if "bias" in o:
        bias = jnp.asarray(np.reshape(o["bias"], (1,) * (4 - o["bias"].ndim) + o["bias"].shape), dtype=dt)
        params.append(bias)

    def f(q, k, v, *rest):
        extra = {"bias": rest[0]} if rest else {}
        return jax.nn.dot_product_attention(q, k, v, **kwargs, **extra)

    out, vjp = jax.vjp(f, *params)
    cot = vjp(jnp.asarray(np.swapaxes(problem.dout, 1, 2), dtype=dt))
    grads = {n: np.swapaxes(np.asarray(g, np.float64), 1, 2) for n, g in zip("qkv", cot[:3], strict=True)}
    if "bias" in c.learned:
        grads["bias"] = np.reshape(np.asarray(cot[3], np.float64), o["bias"].shape)
    return Result(np.swapaxes(np.asarray(out, np.float64), 1, 2), grads)


# --------------------------------------------------------------------------- loading


def _builtin(name: str) -> Target:
    if name.startswith("attngrad."):
        return _attngrad_target(name.split(".", 1)[1])
    if name == "jax.dpa":
        if importlib.util.find_spec("jax") is None:
            raise ValueError("target jax.dpa needs JAX, which is not importable here (pip install jax)")
        # causal and local windows are top-left aligned; key padding as key_value_seq_lengths
        feats = BASE | {"mask", "padding", "fully_masked", "causal", "causal_top_left", "window",
                        "bias", "bias_grad"}
        return Target(name, "jax", frozenset(feats), jax_dpa, "jax.nn.dot_product_attention (xla)")
    _torch()
    if name == "torch.naive":
        feats = BASE | MASKING | {"bias", "bias_grad", *VARIANTS, "alibi_grad"}
        return Target(name, "sdpa", frozenset(feats), torch_naive, "plain torch ops, autograd")
    if name == "torch.flex":
        feats = BASE | MASKING | {"bias", "softcap", "alibi", "window", "segments"}
        return Target(name, "sdpa", frozenset(feats), torch_flex,
                      "torch.nn.attention.flex_attention, rules as a score_mod")
    import torch.nn.functional as F

    backend = {"torch.sdpa": None, "torch.sdpa:math": "MATH", "torch.sdpa:flash": "FLASH_ATTENTION"}[name]
    feats = PROTOCOL_FEATURES["sdpa"] | {"causal_bottom_right"}  # via causal_lower_right
    return Target(name, "sdpa", frozenset(feats), sdpa_runner(F.scaled_dot_product_attention, backend),
                  "torch.nn.functional.scaled_dot_product_attention"
                  + (f", backend {backend}" if backend else ", default backend"))


def _load_object(spec: str):
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(
            f"target must be a built-in ({', '.join(BUILTINS)}), module:function or "
            f"path/to/file.py:function; got {spec!r}"
        )
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"target file {where!r} does not exist")
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


def resolve_target(target, *, protocol: str | None = None, features=None) -> Target:
    """A :class:`Target` from a built-in name, ``module:function``, ``file.py:function``,
    a callable or an explicit-protocol object.  ``features`` replaces what it declares."""
    if protocol is not None and protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
    if isinstance(target, Target):
        t = target
    elif isinstance(target, str) and target in BUILTINS:
        if protocol is not None:
            raise ValueError(f"--protocol applies to a user's function, not the built-in {target}")
        t = _builtin(target)
    else:
        obj = _load_object(target) if isinstance(target, str) else target
        name = target if isinstance(target, str) else getattr(obj, "__name__", type(obj).__name__)
        if inspect.isclass(obj) and hasattr(obj, "forward") and hasattr(obj, "backward"):
            obj = obj()
        proto = protocol or getattr(obj, "attngrad_protocol", None)
        if proto is None:
            proto = "explicit" if hasattr(obj, "forward") and hasattr(obj, "backward") else "sdpa"
        if proto not in PROTOCOLS:
            raise ValueError(f"{name}: attngrad_protocol must be one of {', '.join(PROTOCOLS)}; got {proto!r}")
        if proto == "explicit":
            if not (callable(getattr(obj, "forward", None)) and callable(getattr(obj, "backward", None))):
                raise ValueError(f"{name}: the explicit protocol needs forward() and backward() methods")
            run = explicit_runner(obj)
        else:
            if not callable(obj):
                raise ValueError(f"{name}: the {proto} protocol needs a callable; got {type(obj).__name__}")
            run = sdpa_runner(obj) if proto == "sdpa" else flash_runner(obj)
        declared = getattr(obj, "attngrad_features", None)
        feats = PROTOCOL_FEATURES[proto] if declared is None else check_features(declared, f"{name}.attngrad_features")
        t = Target(name, proto, frozenset(feats), run, "a user's function")
    if features is not None:
        t = Target(t.name, t.protocol, check_features(features), t.run, t.note)
    return t
