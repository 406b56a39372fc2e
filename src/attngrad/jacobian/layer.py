"""Forward mode in closed form for the multi-head attention layer (J4-J5), and the
layer validated and formed as the closed-form Jacobians and the HVPs read it.

    (J4) Q̇ = Ẋ_q W^Q + X_q Ẇ^Q + ḃ^Q             (likewise K, V; split into heads)
    (J5) Ẏ = Ċ W^O + C Ẇ^O + ḃ^O,  Ċ = [Ȯ_1, …, Ȯ_H]

with (J1)-(J3) per head (:mod:`.jvp`).  One call's settings travel as a :class:`LayerCall`
(head counts, the attention options, the tool's name and kind).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ..core.options import AttentionOptions, attention_options
from ..core.problem import SDPAShape
from ..layers.mha import BIASES, WEIGHTS, check_inputs, check_params, input_sources
from ..runtime.ops import merge_heads, project, split_heads
from . import memo
from .jvp import (
    AttnJVP,
    AttnPrimal,
    _attention_structure,
    _f64,
    _tangent,
    attention_primal,
    attention_structure,
    attention_tangents,
)
from .variants import LogitVariants, refuse_unsupported


class LayerCall(NamedTuple):
    """One layer call's settings besides its arrays: what mha_forward's keywords say, and
    which tool asks (errors name ``who``; ``kind`` picks what is refused, :mod:`.variants`)."""

    num_heads: int
    num_kv_heads: int | None
    options: AttentionOptions
    who: str
    kind: str

    def values(self) -> tuple:
        """The call's settings by value, for the memo's key."""
        return (self.num_heads, self.num_kv_heads, *self.options.values())


def layer_call(who: str, kind: str, keywords: dict) -> LayerCall:
    """The :class:`LayerCall` of mha_forward's ``keywords`` (``num_heads`` required,
    ``num_kv_heads`` and the attention options optional).  TypeError for a missing
    ``num_heads`` or an unknown keyword."""
    kw = dict(keywords)
    if "num_heads" not in kw:
        raise TypeError(f"{who}() needs the keyword argument 'num_heads'")
    num_heads, num_kv_heads = kw.pop("num_heads"), kw.pop("num_kv_heads", None)
    return LayerCall(num_heads, num_kv_heads, attention_options(**kw), who, kind)


class LayerJVP(NamedTuple):
    """Primal and tangent values of one layer call (what the layer HVP reuses)."""

    sources: tuple  # (X_q, X_k, X_v) primal inputs, (B, L, ·)
    tsources: tuple  # their tangents (..., B, L, ·)
    attn: AttnJVP
    context: np.ndarray  # C (B, Lq, H*Dv)
    tcontext: np.ndarray  # Ċ (..., B, Lq, H*Dv)
    y: np.ndarray  # (B, Lq, E_out)
    ty: np.ndarray  # (..., B, Lq, E_out)


SOURCE_ROLES = ("query", "key", "value")
_PLAIN_PARAMS = frozenset(WEIGHTS + BIASES)  # the parameters of (M1)-(M4)


def _layer_key(site: str, params, query, key, value, options: tuple, exact: tuple = ()):
    """The memo's key (:func:`.memo.key`) of a layer call: the inputs given and the
    parameters by dtype and shape, the parameter names and which inputs are None exactly,
    ``options`` by value.  None (not memoised) unless ``params`` is a dict."""
    if type(params) is not dict:
        return None
    given = (query,) if key is None and value is None else tuple(a for a in (query, key, value) if a is not None)
    return memo.key((*given, *params.values()), options, (site, key is None, value is None, *params, *exact))


def check_layer(params, query, key, value, num_heads, num_kv_heads) -> tuple:
    """The layer's checks (as mha_forward) plus the Jacobian tools' own: float64 NumPy, and
    only the parameters (M1)-(M4) model.  Returns (H, Hkv, roles, (X_q, X_k, X_v)).
    Memoised (:mod:`.memo`) by the inputs' and parameters' dtypes and shapes, the
    parameter names and the head counts: none of the checks reads a value."""
    mkey = _layer_key("check_layer", params, query, key, value, (num_heads, num_kv_heads))
    kept = memo.cached(mkey, lambda: _check_layer(params, query, key, value, num_heads, num_kv_heads)[:3])
    return (*kept, input_sources(query, key, value)[1])


def _check_layer(params, query, key, value, num_heads, num_kv_heads) -> tuple:
    """:func:`check_layer` without the memo."""
    H, Hkv, _, _ = check_params(params, num_heads, num_kv_heads)
    other = sorted(set(params) - _PLAIN_PARAMS)
    if other:
        raise ValueError(
            f"params has {other}: the Jacobian tools model the plain layer (M1)-(M4), with "
            f"weights {list(WEIGHTS)} and biases {list(BIASES)} only"
        )
    for name, a in (("query", query), ("key", key), ("value", value), *params.items()):
        if a is not None or name == "query":
            _f64(name, a)
    roles, srcs = check_inputs(params, query, key, value)
    return H, Hkv, roles, srcs


def _x_dw(x, tw):
    """X Ẇ for a weight tangent (in, out) or a batch of them (..., in, out)."""
    return x @ (tw if tw.ndim == 2 else tw[..., None, :, :])  # (..., B, L, out)


def _db(tb):
    """ḃ broadcast to (..., B, L, out)."""
    return tb if tb.ndim == 1 else tb[..., None, None, :]


class LayerPrimal(NamedTuple):
    """The primal of one layer call (what the closed-form layer Jacobians read).

    Memory: the attention primal (P is B*H*Lq*Lk); the inputs by reference.  The output
    Y itself is not formed: no closed-form Jacobian reads it."""

    sources: tuple  # (X_q, X_k, X_v) primal inputs, (B, L, ·)
    attn: AttnPrimal


def _projections(params, srcs) -> tuple:
    """(M1) Q, K, V (B, L, heads*D each).  Self-attention (one source array; the three biases
    all given or all absent): one GEMM X [W^Q W^K W^V] + [b^Q b^K b^V], split by columns
    (views), in place of three (the calls, not the flops, are the cost at small sizes)."""
    ws = [params[f"W_{n}"] for n in "qkv"]
    bs = [params.get(f"b_{n}") for n in "qkv"]
    x = srcs[0]
    if not (srcs[1] is x and srcs[2] is x and sum(b is None for b in bs) in (0, 3)):
        return tuple(project(np, x, w, b) for x, w, b in zip(srcs, ws, bs, strict=True))
    y = project(np, x, np.concatenate(ws, axis=1), None if bs[0] is None else np.concatenate(bs))  # (B, L, ·)
    nq, nk = ws[0].shape[1], ws[1].shape[1]
    return y[..., :nq], y[..., nq:nq + nk], y[..., nq + nk:]


class LayerStructure(NamedTuple):
    """The validated layer before attention: what the closed-form layer Jacobians read
    besides the attention primal (the compiled row kernels of :mod:`.rows` form that
    primal themselves)."""

    sources: tuple  # (X_q, X_k, X_v) primal inputs, (B, L, ·)
    heads: tuple  # Q (B, H, Lq, D), K (B, Hkv, Lk, D), V (B, Hkv, Lk, Dv): (M1) split into heads
    allowed: np.ndarray | None  # (b|1, h|1, Lq, Lk) bool, None: all allowed
    scale: float
    variants: LogitVariants


def _heads(params, srcs, H: int, Hkv: int) -> tuple:
    """(M1) on checked params and inputs: Q, K, V split into heads."""
    q, k, v = _projections(params, srcs)  # (M1) (B, L, heads*D)
    return split_heads(np, q, H), split_heads(np, k, Hkv), split_heads(np, v, Hkv)  # (M1)


def _layer_structure(params, srcs, H: int, Hkv: int, call: LayerCall, heads=_heads,
                     structure=attention_structure) -> LayerStructure:
    """(M1) on checked params and inputs: the projections split into heads (by ``heads``:
    :func:`_heads`, or the compiled :func:`.rows.layer_heads`), and the attention's
    validated structure (by ``structure``: memoised or not)."""
    heads = heads(params, srcs, H, Hkv)
    (B, _, Lq, D), (_, _, Lk, Dv) = heads[0].shape, heads[2].shape  # consistent: check_layer checked the layer
    _, allowed, s, var = structure(*heads, call.options, who=call.who, kind=call.kind,
                                   shape=SDPAShape(B, H, Hkv, Lq, Lk, D, Dv))
    return LayerStructure(srcs, heads, allowed, s, var)


def layer_structure(params, query, key, value, call: LayerCall, heads=_heads, memoise: bool = True) -> LayerStructure:
    """The layer validated as :func:`layer_jvp_parts` validates it (no tangents), up to the
    attention's structure.  ``heads(params, sources, H, Hkv)`` forms Q, K, V split into
    heads (:func:`_heads` by default).  Memoised as one (:mod:`.memo`): a repeated call
    with inputs and parameters of the same dtypes and shapes and the same options runs
    none of the checks, only ``heads``.  ``memoise=False``: every check runs and nothing
    is kept (for a caller that keeps its own plan of the call)."""
    mkey = None if not memoise else _layer_key(
        "layer_structure", params, query, key, value, call.values(), (call.who, call.kind))
    hit = memo.get(mkey)
    if hit is not None:
        H, Hkv, allowed, s, var = hit
        srcs = input_sources(query, key, value)[1]
        return LayerStructure(srcs, heads(params, srcs, H, Hkv), allowed, s, var)
    refuse_unsupported(call.who, call.kind, call.options)  # before any other work
    H, Hkv, _, srcs = _check_layer(params, query, key, value, call.num_heads, call.num_kv_heads)
    st = _layer_structure(params, srcs, H, Hkv, call, heads, _attention_structure)
    _, _, allowed, s, var = memo.put(mkey, (H, Hkv, st.allowed, st.scale, st.variants))
    return st._replace(allowed=allowed, variants=var)


def layer_primal(params, query, key, value, call: LayerCall) -> LayerPrimal:
    """The layer's forward as the closed-form Jacobians read it: :func:`layer_structure`
    and the attention primal (A1)-(A3) per head."""
    st = layer_structure(params, query, key, value, call)
    return LayerPrimal(st.sources, attention_primal(*st.heads, st.allowed, st.scale, st.variants))


def layer_jvp_parts(params, query, key, value, call: LayerCall, tangents=None) -> LayerJVP:
    """(J4), (J1)-(J3) per head, (J5).  ``tangents``: dict with some of the keys of
    ``params`` and of the inputs ("query", "key", "value"); missing keys are 0.  The
    attention options as mha_forward's, fixed values (see :mod:`.variants`); what a tool of
    ``call.kind`` cannot honour is refused naming ``call.who``."""
    refuse_unsupported(call.who, call.kind, call.options)  # before any other work
    if tangents is not None and not isinstance(tangents, Mapping):
        raise TypeError(
            "tangents must be a mapping from parameter or input names to arrays (the direction); "
            f"got {type(tangents).__name__}"
        )
    tangents = dict(tangents or {})
    H, Hkv, roles, srcs = check_layer(params, query, key, value, call.num_heads, call.num_kv_heads)
    unknown = sorted(set(tangents) - set(params) - {r for r in SOURCE_ROLES if r in roles})
    if unknown:
        raise ValueError(f"tangents has keys {unknown} that are neither parameters nor inputs given; "
                         f"expected some of {sorted(set(params) | set(roles))}")
    t_in = {r: _tangent(r, tangents.get(r), a) for r, a in zip(roles, srcs, strict=True)}
    tsrcs = tuple(t_in[r] for r in roles)
    tp = {n: _tangent(n, tangents.get(n), a) for n, a in params.items()}
    st = _layer_structure(params, srcs, H, Hkv, call)
    lp = LayerPrimal(srcs, attention_primal(*st.heads, st.allowed, st.scale, st.variants))  # (M1)-(M2) (A1)-(A3)
    tproj = []
    for x, tx, n in zip(srcs, tsrcs, "qkv", strict=True):
        b = params.get(f"b_{n}")
        tproj.append(project(np, tx, params[f"W_{n}"]) + _x_dw(x, tp[f"W_{n}"])
                     + (_db(tp[f"b_{n}"]) if b is not None else 0.0))  # (J4) (..., B, L, heads*D)
    tq, tk, tv = tproj
    attn = attention_tangents(lp.attn, split_heads(np, tq, H), split_heads(np, tk, Hkv),
                              split_heads(np, tv, Hkv))  # (J1)-(J3) per head
    c, tc = merge_heads(np, attn.out), merge_heads(np, attn.tout)  # (M3) (..., B, Lq, H*Dv)
    wo, bo = params["W_o"], params.get("b_o")
    y = project(np, c, wo, bo)  # (M4) (B, Lq, E_out)
    ty = project(np, tc, wo) + _x_dw(c, tp["W_o"]) + (_db(tp["b_o"]) if bo is not None else 0.0)  # (J5)
    return LayerJVP(srcs, tsrcs, attn, c, tc, y, ty)


def mha_jvp(params, query, key=None, value=None, *, tangents=None, **kwargs):
    """Layer output and its directional derivative ``(y, ty)`` (keywords as mha_forward).

    ``tangents``: the direction, a dict with some of the parameter names and of "query",
    "key", "value" (missing = 0); each may carry extra leading axes (many directions)."""
    r = layer_jvp_parts(params, query, key, value, layer_call("mha_jvp", "jvp", kwargs), tangents)
    return r.y, r.ty
