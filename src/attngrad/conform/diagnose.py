"""Hints for a failing case: what the target's answer *does* match.

The reference is re-run in float64 under alternative hypotheses, the bugs kernel authors
really make: the other causal alignment, a flipped sign, dK/dV from one query head per group,
no soft-cap derivative, sinks or bias ignored, masked keys leaking, the dropout mask
transposed.  A hypothesis is reported, as "matches the reference with ...", when every
tensor of the answer lies within the case's allowed error of it and it explains a tensor
that failed.  The alternative references are a small dense attention written here (NumPy,
float64), apart from attngrad's closed form, so that each hypothesis is one switch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..core.dropout import dropout_mask
from .inputs import CaseInputs, make_inputs
from .result import Result
from .torch_targets import _alibi_bias
from .verdict import REL_FLOOR, scale_of

QKV = ("out", "v", "q", "k")


def dense(q, k, v, dout, *, allowed, scale, add=None, softcap=0.0, sinks=None, rate=0.0,
          keep_fwd=None, keep_bwd=None, softcap_grad=True, one_head=False) -> Result:
    """Attention forward and backward in float64 with one switch per hypothesis.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), dout (B, H, Lq, Dv);
    allowed (B, H, Lq, Lk) True = attend; add: an additive term broadcast to the logits.
    """
    b, h = q.shape[:2]
    g = h // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # (B, H, Lk, D|Dv)
    s = (q @ np.swapaxes(kk, -1, -2)) * scale  # (B, H, Lq, Lk)
    t = None
    if softcap:
        t = np.tanh(s / softcap)
        s = softcap * t
    if add is not None:
        s = s + add
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)  # (B, H, Lq, 1)
    if sinks is not None:
        m = np.maximum(m, sinks[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = np.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        z = z + np.exp(sinks[None, :, None, None] - m)
    p = e / np.where(z > 0, z, 1.0)  # (B, H, Lq, Lk)
    kf = 1.0 if keep_fwd is None else keep_fwd / (1 - rate)
    kb = 1.0 if keep_bwd is None else keep_bwd / (1 - rate)
    out = (p * kf) @ vv  # (B, H, Lq, Dv)
    dvv = np.swapaxes(p * kb, -1, -2) @ dout  # (B, H, Lk, Dv)
    dp = (dout @ np.swapaxes(vv, -1, -2)) * kb  # (B, H, Lq, Lk)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    if t is not None and softcap_grad:
        ds = ds * (1 - t * t)
    dq = (ds @ kk) * scale
    dkk = (np.swapaxes(ds, -1, -2) @ q) * scale  # (B, H, Lk, D)

    def reduce(x):  # (B, H, Lk, X) -> (B, Hkv, Lk, X)
        if one_head:
            return x[:, ::g]
        return x.reshape(b, h // g, g, *x.shape[2:]).sum(axis=2)

    return Result(out, {"q": dq, "k": reduce(dkk), "v": reduce(dvv)})


def _settings(problem: CaseInputs, *, bias=True, alibi=True) -> dict:
    """The keyword arguments of :func:`dense` for ``problem`` as the reference sees it."""
    o = problem.options
    add = None
    if bias and "bias" in o:
        add = np.asarray(o["bias"], np.float64)
    if alibi and "alibi_slopes" in o:
        a = _alibi_bias(problem)
        add = a if add is None else add + a
    kw = {"allowed": problem.allowed, "scale": float(o["scale"]), "add": add,
          "softcap": float(o.get("softcap") or 0.0),
          "sinks": None if "sinks" not in o else np.asarray(o["sinks"], np.float64)}
    if o.get("dropout_p"):
        c = problem.case
        keep = np.asarray(dropout_mask(o["dropout_seed"], (c.b, c.h, c.lq, c.lk), o["dropout_p"]), np.float64)
        kw.update(rate=float(o["dropout_p"]), keep_fwd=keep, keep_bwd=keep)
    return kw


def _run(problem: CaseInputs, **kw) -> Result:
    return dense(problem.q, problem.clean_k, problem.clean_v, problem.dout, **kw)


def hypotheses(problem: CaseInputs):
    """(what, alternative Result) for every hypothesis that applies to ``problem``'s case."""
    c = problem.case
    if c.frontier:  # top-k, lse, varlen: the core's float64 reference under each hypothesis
        yield from _frontier_hypotheses(problem)
        return
    base = _settings(problem)
    if c.causal != "none" and c.lq != c.lk:
        other = {"top_left": "bottom_right", "bottom_right": "top_left"}[c.causal]
        alt = make_inputs(replace(c, causal=other))  # same seed, same draws, the other rule
        yield (f"the other causal alignment ({other.replace('_', '-')} instead of "
               f"{c.causal.replace('_', '-')})"), _run(alt, **_settings(alt))
    if c.hkv != c.h:
        yield ("dK and dV taken from one query head per group (the first) instead of summed "
               "over the group"), _run(problem, **base, one_head=True)
    if c.softcap > 0:
        yield "no soft-cap derivative (the factor 1 - tanh^2 dropped)", _run(problem, **{**base, "softcap_grad": False})
    if c.sinks:
        yield "the sinks ignored", _run(problem, **{**base, "sinks": None})
    if c.bias != "none":
        yield "the bias ignored", _run(problem, **_settings(problem, bias=False))
    if c.alibi:
        yield "ALiBi ignored", _run(problem, **_settings(problem, alibi=False))
    leaky = np.broadcast_to(problem.positional, problem.allowed.shape)
    if problem.positional is not None and not np.array_equal(leaky, problem.allowed):
        yield ("masked keys leaking (the masks, padding and segments ignored; causal and window "
               "kept)"), _run(problem, **{**base, "allowed": leaky})
    if c.dropout > 0:
        o = problem.options
        keep_t = np.swapaxes(np.asarray(dropout_mask(o["dropout_seed"], (c.b, c.h, c.lk, c.lq),
                                                     o["dropout_p"]), np.float64), -1, -2)
        yield "the dropout mask transposed", _run(problem, **{**base, "keep_fwd": keep_t, "keep_bwd": keep_t})
        yield "the dropout mask transposed in the backward", _run(problem, **{**base, "keep_bwd": keep_t})


def _frontier_hypotheses(problem: CaseInputs):
    """Hypotheses for top-k, lse and varlen cases, each the reference on altered inputs."""
    from .reference import reference

    c, o = problem.case, problem.options
    if c.causal != "none" and (c.varlen or c.lq != c.lk):
        other = {"top_left": "bottom_right", "bottom_right": "top_left"}[c.causal]
        alt = make_inputs(replace(c, causal=other))
        yield (f"the other causal alignment ({other.replace('_', '-')} instead of "
               f"{c.causal.replace('_', '-')}{', per sequence' if c.varlen else ''})"), reference(alt)
    if c.topk:
        idx = np.array(o["kv_indices"])
        once = idx.copy()
        for s in range(1, idx.shape[-1]):  # a key listed again in a row: its later slots emptied
            seen = (once[..., :s] == once[..., s:s + 1]).any(axis=-1)
            once[..., s] = np.where(seen & (once[..., s] >= 0), -1, once[..., s])
        if not np.array_equal(once, idx):
            yield "a repeated key counted once (gather semantics: each slot is a term)", \
                reference(replace(problem, options={**o, "kv_indices": once}))
        if (idx < 0).any():
            yield "-1 slots read as key 0", reference(replace(problem, options={**o, "kv_indices": np.maximum(idx, 0)}))
    if c.lse:
        yield "the lse's gradient (dlse) ignored", reference(replace(problem, dlse=np.zeros_like(problem.dlse)))


def _tensor(res: Result, name: str):
    return res.out if name == "out" else (res.grads or {}).get(name)


def hints(problem: CaseInputs, ref: Result, got: Result, errors: dict, names, *, rtol: float) -> list:
    """The hypotheses the answer ``got`` matches: "matches the reference with ..."."""
    if not errors:  # a structural failure (missing, misshapen, non-finite): no tolerance to judge by
        return []
    largest = max(scale_of(_tensor(ref, n)) for n in names)

    def tol(name) -> float:
        allowed = errors[name].allowed if name in errors else rtol
        return allowed * max(scale_of(_tensor(ref, name)), REL_FLOOR * largest)

    def close(a, b, name) -> bool:
        return a is not None and b is not None and a.shape == b.shape and \
            bool(np.max(np.abs(a - b), initial=0.0) <= tol(name))

    failed = [n for n in names if n in errors and not errors[n].ok]
    found = []
    for name in failed:  # a sign flipped
        t, r = _tensor(got, name), _tensor(ref, name)
        if scale_of(r) > 0 and close(t, -r, name):
            found.append(f"matches the reference with d{name if len(name) == 1 else '[' + name + ']'} negated")
    for what, alt in hypotheses(problem):
        compared = [n for n in QKV if n in names]
        if not all(close(_tensor(got, n), _tensor(alt, n), n) for n in compared):
            continue
        explained = [n for n in failed if n in compared and not close(_tensor(alt, n), _tensor(ref, n), n)]
        if explained:
            found.append(f"matches the reference with {what}")
    return found
