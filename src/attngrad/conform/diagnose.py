"""Hints for a failing case: what the target's answer *does* match.

Two kinds.  Tensor checks compare one wrong tensor with the reference directly: negated,
the softmax scale missing or applied twice, two gradients swapped, rows with no key to
attend not zero (or an lse that is not -inf there).  They are plain functions of arrays
(:func:`negated`, :func:`scale_off`, :func:`swapped`, :func:`empty_rows`), usable by any
grader.  Hypotheses re-run a small dense attention written here (NumPy, float64, apart from
attngrad's closed form, one switch per bug) and report "matches the reference with ..."
when every tensor of the answer lies within the case's allowed error of it and it explains a
tensor that failed: the other causal alignment, GQA heads mapped h % Hkv, delta =
rowsum(dO * O) off by a per-row amount, the scale argument ignored, a window one key too
wide, a finite mask fill, q/k/v read with heads and length exchanged, and the variants'
classics.  Reruns of the target itself (the same case shorter, or with contiguous inputs)
are the runner's: :func:`growth_hint` and :func:`layout_hint` word what they find.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import numpy as np

from ..core.dropout import dropout_mask
from .cases import parse_window
from .inputs import CaseInputs, make_inputs
from .result import Result
from .torch_targets import _alibi_bias
from .verdict import REL_FLOOR, scale_of

QKV = ("out", "v", "q", "k")
FILLS = (-1e4, -3e4, -5e4, -65504.0, -1e5, -1e6)  # finite "-inf"s kernels use


def label(name: str) -> str:
    """"out", "lse", "dq", "d[sinks]": how reports name a tensor."""
    if name in ("out", "lse"):
        return name
    return f"d{name}" if len(name) == 1 else f"d[{name}]"


# --------------------------------------------------------------------------- tensor checks


def close(a, b, tol: float) -> bool:
    """Same shape and max|a - b| <= tol (absolute)."""
    if a is None or b is None or np.shape(a) != np.shape(b):
        return False
    with np.errstate(invalid="ignore"):
        diff = np.where(a == b, 0.0, np.abs(np.asarray(a, np.float64) - b))
    return bool(np.max(diff, initial=0.0) <= tol)


def negated(got, ref, tol: float) -> bool:
    """``got`` is ``-ref`` (a flipped sign), ``ref`` not all zero."""
    return scale_of(ref) > tol and close(got, -np.asarray(ref), tol)


def scale_off(got, ref, scale: float, tol: float) -> str | None:
    """How the softmax scale is off in ``got`` against ``ref``: "missing" (got = ref / scale),
    "applied twice" (got = ref * scale), or None.  Meaningless for scale = +-1."""
    if abs(abs(scale) - 1.0) < 1e-6 or scale == 0 or scale_of(ref) <= tol:
        return None
    if close(got, np.asarray(ref) / scale, tol * max(1.0, 1 / abs(scale))):
        return "missing"
    if close(got, np.asarray(ref) * scale, tol):
        return "applied twice"
    return None


def swapped(got_a, got_b, ref_a, ref_b, tol_a: float, tol_b: float) -> bool:
    """The two answers exchanged: got_a matches ref_b and got_b matches ref_a (shapes too)."""
    return close(got_a, ref_b, tol_b) and close(got_b, ref_a, tol_a) and not close(got_a, ref_a, tol_a)


def empty_rows(out, allowed, v=None, tol: float = 0.0) -> str | None:
    """What the rows of ``out`` (B, H, Lq, Dv) with no key to attend (``allowed`` (B, H, Lq,
    Lk) all False) hold when they are not 0: the mean of V (softmax over masked keys, a finite
    fill), or just "not zero"; None when they are 0 or there are none."""
    rows = ~np.asarray(allowed).any(axis=-1)  # (B, H, Lq)
    if out is None or not rows.any() or np.shape(out)[:-1] != rows.shape:
        return None
    bad = rows & (np.abs(np.nan_to_num(out, nan=1.0)).max(axis=-1) > tol)
    if not bad.any():
        return None
    n = f"{int(bad.sum())} of {int(rows.sum())} rows with no key to attend"
    if v is not None:
        g = out.shape[1] // v.shape[1]
        mean = np.repeat(v.mean(axis=2, keepdims=True), g, axis=1)  # (B, H, 1, Dv)
        if close(np.where(bad[..., None], out, 0.0), np.where(bad[..., None], mean, 0.0), max(tol, 1e-3)):
            return f"{n} give the mean of V (a softmax over the masked keys: a finite mask fill); they must be 0"
    return f"{n} are not 0"


# --------------------------------------------------------------------------- the dense hypotheses


def dense(q, k, v, dout, *, allowed, scale, add=None, softcap=0.0, sinks=None, rate=0.0,
          keep_fwd=None, keep_bwd=None, softcap_grad=True, one_head=False, heads=None,
          reduce_heads=None, delta_shift=None, fill=None) -> Result:
    """Attention forward and backward in float64 with one switch per hypothesis.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), dout (B, H, Lq, Dv);
    allowed (B, H, Lq, Lk) True = attend; add: an additive term broadcast to the logits.
    heads: the kv head each query head reads (default h // G); reduce_heads: the kv head each
    query head's dK, dV go to (default: heads); delta_shift (B, H, Lq, 1): added to delta;
    fill: masked logits set to this finite number (rows with no key kept 0).
    """
    b, h = q.shape[:2]
    hkv = k.shape[1]
    g = h // hkv
    heads = np.arange(h) // g if heads is None else np.asarray(heads)
    reduce_heads = heads if reduce_heads is None else np.asarray(reduce_heads)
    kk, vv = k[:, heads], v[:, heads]  # (B, H, Lk, D|Dv)
    s = (q @ np.swapaxes(kk, -1, -2)) * scale  # (B, H, Lq, Lk)
    t = None
    if softcap:
        t = np.tanh(s / softcap)
        s = softcap * t
    if add is not None:
        s = s + add
    s = np.where(allowed, s, -np.inf if fill is None else fill)
    m = np.max(s, axis=-1, keepdims=True)  # (B, H, Lq, 1)
    if sinks is not None:
        m = np.maximum(m, sinks[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    if fill is not None:
        e = np.where(np.asarray(allowed).any(axis=-1, keepdims=True), e, 0.0)
    z = np.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        z = z + np.exp(sinks[None, :, None, None] - m)
    p = e / np.where(z > 0, z, 1.0)  # (B, H, Lq, Lk)
    kf = 1.0 if keep_fwd is None else keep_fwd / (1 - rate)
    kb = 1.0 if keep_bwd is None else keep_bwd / (1 - rate)
    out = (p * kf) @ vv  # (B, H, Lq, Dv)
    dvv = np.swapaxes(p * kb, -1, -2) @ dout  # (B, H, Lk, Dv)
    dp = (dout @ np.swapaxes(vv, -1, -2)) * kb  # (B, H, Lq, Lk)
    delta = np.sum(dp * p, axis=-1, keepdims=True)  # (B, H, Lq, 1) = rowsum(dO * O)
    if delta_shift is not None:
        delta = delta + delta_shift
    ds = p * (dp - delta)
    if fill is not None:  # a constant at the masked logits: no gradient reaches q, k there
        ds = np.where(allowed, ds, 0.0)
    if t is not None and softcap_grad:
        ds = ds * (1 - t * t)
    dq = (ds @ kk) * scale
    dkk = (np.swapaxes(ds, -1, -2) @ q) * scale  # (B, H, Lk, D)

    def reduce(x):  # (B, H, Lk, X) -> (B, Hkv, Lk, X)
        if one_head:
            return x[:, ::g]
        out_ = np.zeros((b, hkv, *x.shape[2:]))
        for head, to in enumerate(reduce_heads):
            out_[:, to] += x[:, head]
        return out_

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


def _delta_shift(problem: CaseInputs, base: dict, ref: Result, got: Result):
    """The per-row shift of delta that takes the reference's dQ to the answer's (least squares
    per query row: dQ moves by -shift * w, w = dQ(0) - dQ(shift 1)), or None."""
    r, t = ref.grads["q"], (got.grads or {}).get("q")
    if t is None or t.shape != r.shape:
        return None
    w = r - _run(problem, **base, delta_shift=np.ones((*r.shape[:-1], 1))).grads["q"]  # (B, H, Lq, D)
    ww = np.sum(w * w, axis=-1, keepdims=True)
    shift = np.where(ww > 0, np.sum((r - t) * w, axis=-1, keepdims=True) / np.where(ww > 0, ww, 1.0), 0.0)
    return shift if np.isfinite(shift).all() and np.abs(shift).max() > 0 else None


def hypotheses(problem: CaseInputs, ref: Result | None = None, got: Result | None = None):
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
        g = c.h // c.hkv
        yield ("dK and dV taken from one query head per group (the first) instead of summed "
               "over the group"), _run(problem, **base, one_head=True)
        mod = np.arange(c.h) % c.hkv
    if c.hkv not in (1, c.h):
        yield (f"GQA heads mapped h % Hkv instead of h // G (G = {g}): query head h reads and "
               "sends its dK, dV to kv head h % Hkv"), _run(problem, **base, heads=mod)
        yield ("dK and dV reduced over h % Hkv instead of h // G (the forward right, the backward's "
               "sum over each group wrong)"), _run(problem, **base, reduce_heads=mod)
    if ref is not None and got is not None:
        shift = _delta_shift(problem, base, ref, got)
        delta = np.sum(problem.dout * ref.out, axis=-1, keepdims=True)  # (B, H, Lq, 1) rowsum(dO * O)
        if shift is not None and c.dtype != "float64" and np.abs(shift).max() < 0.01 * np.abs(delta).max():
            shift = None  # delta's rounding (FlashAttention takes it from the rounded output), not a bug
        if shift is not None:
            what = ("delta = rowsum(dO * O) left out (dS = P * dP)" if np.allclose(shift, -delta, atol=1e-9)
                    else "delta = rowsum(dO * O) off by a per-row amount (delta from another dO or O)")
            yield what + ": out and dV right, dQ and dK wrong together", _run(problem, **base, delta_shift=shift)
    default = 1.0 / np.sqrt(c.d)
    if c.scale not in ("", "none") and not np.isclose(float(c.scale), default):
        yield f"the scale argument ignored (1/sqrt(D) = {default:.4g} used, not {c.scale})", \
            _run(problem, **{**base, "scale": default})
    if c.scale == "none":
        for what, s in ((f"1/sqrt(Dv) = {1 / np.sqrt(c.dv):.4g}", 1 / np.sqrt(c.dv)), ("1", 1.0),
                        (f"1/D = {1 / c.d:.4g}", 1.0 / c.d)):
            if not np.isclose(s, default):
                yield f"the default scale (scale left out) taken as {what}, not 1/sqrt(D)", \
                    _run(problem, **{**base, "scale": s})
    if c.window != "none":
        yield from _window_hypotheses(problem)
    if c.acts == "huge_logits" and not problem.allowed.all():
        for f in FILLS:
            yield f"masked logits filled with a finite {f:g} instead of -inf (rows with no key 0)", \
                _run(problem, **base, fill=f)
    if c.h == c.lq or (c.hkv == c.lk and c.hkv > 1):
        yield from _axes_hypotheses(problem, base)
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


def _window_hypotheses(problem: CaseInputs):
    """A window one key too wide on the left, the right, or both (the same draws otherwise)."""
    c = problem.case
    left, right = parse_window(c.window)
    wider = {"left": (None if left is None else left + 1, right),
             "right": (left, None if right is None else right + 1)}
    wider["both sides"] = (wider["left"][0], wider["right"][1])
    for side, (lo, hi) in wider.items():
        text = f"{'none' if lo is None else lo}_{'none' if hi is None else hi}"
        alt = make_inputs(replace(c, window=text))
        if text != c.window and not np.array_equal(alt.allowed, problem.allowed):
            yield f"the window one key too wide on the {side} ({text} instead of {c.window})", \
                _run(alt, **_settings(alt))


def _axes_hypotheses(problem: CaseInputs, base: dict):
    """q (H == Lq) or k and v (Hkv == Lk) read with their heads and length axes exchanged (a
    layout guessed from the shapes), the gradients flowing back through the same exchange."""
    c = problem.case

    def swap(x):
        return np.swapaxes(x, 1, 2)

    for what, on_q, on_kv in (("q", c.h == c.lq, False), ("k and v", False, c.hkv == c.lk),
                              ("q, k and v", c.h == c.lq, c.hkv == c.lk)):
        if not (on_q or on_kv) or (what == "q, k and v" and not (on_q and on_kv)):
            continue
        q = swap(problem.q) if on_q else problem.q
        k, v = (swap(problem.clean_k), swap(problem.clean_v)) if on_kv else (problem.clean_k, problem.clean_v)
        alt = dense(q, k, v, problem.dout, **base)
        grads = dict(alt.grads)
        if on_q:
            grads["q"] = swap(grads["q"])
        if on_kv:
            grads["k"], grads["v"] = swap(grads["k"]), swap(grads["v"])
        yield (f"{what} read with the heads and length axes exchanged (a layout guessed from the "
               "shapes: H == Lq or Hkv == Lk)"), Result(alt.out, grads)


def _frontier_hypotheses(problem: CaseInputs):
    """Hypotheses for top-k, lse and varlen cases, each the reference on altered inputs."""
    from .reference import reference

    c, o = problem.case, problem.options
    if c.causal != "none" and (c.varlen or c.lq != c.lk):
        other = {"top_left": "bottom_right", "bottom_right": "top_left"}[c.causal]
        alt = make_inputs(replace(c, causal=other))
        yield (f"the other causal alignment ({other.replace('_', '-')} instead of "
               f"{c.causal.replace('_', '-')}{', per sequence' if c.varlen else ''})"), reference(alt)
    if c.window != "none" and not c.topk:
        yield from _frontier_windows(problem)
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


def _frontier_windows(problem: CaseInputs):
    from .reference import reference

    c = problem.case
    left, right = parse_window(c.window)
    for side, (lo, hi) in (("left", (None if left is None else left + 1, right)),
                           ("right", (left, None if right is None else right + 1))):
        text = f"{'none' if lo is None else lo}_{'none' if hi is None else hi}"
        if text != c.window:
            yield f"the window one key too wide on the {side} ({text} instead of {c.window})", \
                reference(make_inputs(replace(c, window=text)))


# --------------------------------------------------------------------------- reruns (the runner's)


def growth_hint(points) -> str | None:
    """``points``: ((Lq, Lk), err / allowed) from shortest to the case's own; a hint when the
    ratio grows with the length (a sum kept in low precision), else None."""
    pts = [(n, r) for n, r in points if r is not None and np.isfinite(r)]
    if len(pts) < 3 or any(b[1] < 1.2 * a[1] for a, b in pairwise(pts)) \
            or pts[-1][1] < 2 * pts[0][1] or pts[-1][1] <= 1:
        return None
    steps = ", ".join(f"{r:.2g} at ({a}, {b})" for (a, b), r in pts)
    return (f"the error grows with the length (error / allowed: {steps}): a sum kept in low precision "
            "(an accumulator in the input's dtype)")


def layout_hint(ratio_contiguous: float | None, layout: str) -> str | None:
    """A hint when the same case passes with contiguous q, k, v (``ratio_contiguous``: its
    largest error / allowed)."""
    if ratio_contiguous is None or not ratio_contiguous <= 1:
        return None
    return (f"the same case passes with contiguous q, k, v: the {layout} views' strides are not honoured "
            "(the inputs read as if contiguous)")


# --------------------------------------------------------------------------- the hints


def _tensor(res: Result, name: str):
    return res.out if name == "out" else (res.grads or {}).get(name)


def structural_hints(problem: CaseInputs, ref: Result, got: Result) -> list:
    """Hints for an answer that failed before any error was measured (missing, misshapen or
    non-finite tensors): dQ and dK exchanged, empty rows."""
    found = []
    gq, gk = _tensor(got, "q"), _tensor(got, "k")
    rq, rk = _tensor(ref, "q"), _tensor(ref, "k")
    if gq is not None and gk is not None and np.shape(gq) == np.shape(rk) != np.shape(rq) \
            and np.shape(gk) == np.shape(rq):
        found.append("dq and dk exchanged (each has the other's shape)")
    return found + _empty_row_hints(problem, ref, got)


def _empty_row_hints(problem: CaseInputs, ref: Result, got: Result) -> list:
    if problem.case.varlen:
        return []
    found = []
    rows = empty_rows(got.out, problem.allowed, problem.clean_v, tol=1e-6 * max(1.0, scale_of(ref.out)))
    if rows:
        found.append(rows)
    lse = _tensor(got, "lse")
    if lse is not None and np.shape(lse) == np.shape(_tensor(ref, "lse")):
        empty = ~problem.allowed.any(axis=-1)  # (B, H, Lq)
        if problem.case.sinks:
            empty = np.zeros_like(empty)
        finite = empty & np.isfinite(lse)
        if finite.any():
            found.append(f"the lse of {int(finite.sum())} rows with no key to attend is finite "
                         f"(e.g. {float(lse[finite][0]):g}), not -inf (log of an empty sum)")
    return found


def hints(problem: CaseInputs, ref: Result, got: Result, errors: dict, names, *, rtol: float) -> list:
    """The hypotheses and tensor checks the answer ``got`` matches, worded for the report."""
    if not errors:  # a structural failure (missing, misshapen, non-finite): no tolerance to judge by
        return structural_hints(problem, ref, got)
    largest = max(scale_of(_tensor(ref, n)) for n in names)

    def tol(name) -> float:
        allowed = errors[name].allowed if name in errors else rtol
        return allowed * max(scale_of(_tensor(ref, name)), REL_FLOOR * largest)

    def near(a, b, name) -> bool:
        return close(a, b, tol(name))

    failed = [n for n in names if n in errors and not errors[n].ok]
    found = []
    scale = float(problem.options["scale"])
    for name in failed:
        t, r = _tensor(got, name), _tensor(ref, name)
        if negated(t, r, tol(name)):
            found.append(f"matches the reference with {label(name)} negated")
        off = scale_off(t, r, scale, tol(name)) if name in ("q", "k") else None
        if off:
            found.append(f"matches the reference with the softmax scale {off} in {label(name)} "
                         f"({label(name)} = {'dS' if name == 'q' else 'dS^T'} {'K' if name == 'q' else 'Q'}"
                         f"{'' if off == 'missing' else ' * scale^2'} instead of scale * ...)")
    if "q" in failed and "k" in failed and \
            swapped(_tensor(got, "q"), _tensor(got, "k"), _tensor(ref, "q"), _tensor(ref, "k"), tol("q"), tol("k")):
        found.append("matches the reference with dq and dk exchanged")
    found += [h for h in _empty_row_hints(problem, ref, got) if any(n in failed for n in ("out", "lse", "q"))]
    compared = [n for n in QKV if n in names]
    for what, alt in hypotheses(problem, ref, got):
        if not all(near(_tensor(got, n), _tensor(alt, n), n) for n in compared):
            continue
        explained = [n for n in failed if n in compared and not near(_tensor(alt, n), _tensor(ref, n), n)]
        if explained:
            found.append(f"matches the reference with {what}")
    return list(dict.fromkeys(found))
