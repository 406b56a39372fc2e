"""The formulas of today's variants, written once (docs/equations.md, V1-V7).

One catalogue per set of variants: the attention core of one head with the chosen
variants composed in FlashAttention's order,

    S⁰ = s Q Kᵀ → soft-cap (V1) → + Bias − a_h Δ (V4) → mask 𝓜⁰ ∧ window (V5) ∧ segments (V6)
      → softmax with the sink z_h (V2) → dropout (V3) → times V,

its softmax-with-sink Jacobian, the soft-cap's chain rule and every gradient, dz (V2),
da (V4), dBias (A10) and ds (V7) included.  ``attngrad derive --variant sinks,softcap``
prints one, ``attngrad graph --variant all`` draws one, and the tests evaluate the very
same trees against ``sdpa_forward`` / ``sdpa_backward`` in float64.

Catalogue key: ``"variant:" + ",".join(names)`` (names from VARIANTS, in that order).
Evaluation environment (:func:`variant_env`, from sdpa_forward's options): per-head arrays Q_h (B, H, Lq, D), K_h,
V_h (B, H, Lk, ·), G (B, H, Lq, Dv), the scale ``s``, and per variant ``c``, ``z`` (H,),
``a`` (H,), ``Bias`` (1, H, Lq, Lk), ``left``/``right``, ``qseg``/``kvseg``, ``Z`` and
``kappa``; ``mask0`` (padding and causal structure) and the position offset ``o``.
"""


from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..core.dropout import dropout_mask
from ..core.masks import make_mask_spec
from ..core.variants import VARIANT_DEFAULTS, VARIANTS, parse_variants
from ..runtime._xp import resolve_scale
from .expr import (
    BatchSum,
    ColOnes,
    Einsum,
    Formula,
    Had,
    MaskedSoftmax,
    RowSum,
    Scale,
    SoftmaxJacobian,
    Sym,
)
from .variant_nodes import (
    And,
    Band,
    Distance,
    Func,
    IndexSum,
    Neg,
    OneMinus,
    Over,
    PerHead,
    SameSegment,
    SinkSoftmax,
)

PREFIX = "variant:"

VARIANT_NOTATION = (
    ("A ∘ B", r"A \odot B", "elementwise (Hadamard) product"),
    ("Aᵀ", r"A^{\top}", "transpose"),
    ("rowsum(A)", r"\operatorname{rowsum}(A)", "the column vector of row sums of A"),
    ("1", r"\mathbf{1}", "a column of ones: v 1ᵀ repeats column v along the rows"),
    ("softmax_𝓜(S)", r"\operatorname{softmax}_{\mathcal{M}}(S)",
     "P_ij = 𝓜_ij exp(S_ij) / Σ_k 𝓜_ik exp(S_ik); a row with no allowed key is 0"),
    ("softmax_{𝓜,z}(S)", r"\operatorname{softmax}_{\mathcal{M},z}(S)",
     "P_ij = 𝓜_ij exp(S_ij) / (exp(z_h) + Σ_k 𝓜_ik exp(S_ik)): the sink joins every denominator and carries no value"),
    ("A ∧ B", r"A \wedge B", "logical AND of two boolean structures (True = attend)"),
    ("a_h A", r"a_h A", "head h's entry of a per-head vector times A"),
    ("Σ_{b,i}", r"\sum_{b,i}", "sum over the named indices (b sequence, h head, i query, j key, d feature)"),
    ("A[i,j]", r"A_{ij}", "element (i, j) of A"),
)

TITLE = "today's attention variants, one head  O = softmax_{𝓜,z}(c tanh(s Q Kᵀ / c) + Bias − a_h Δ) ∘ Z/(1 − p) V"
NOTES = (
    "The order is FlashAttention's: soft-cap, then bias and ALiBi, then the mask, the softmax with "
    "its sink, dropout. The sink adds exp(z_h) to every row's denominator and carries no value, so "
    "the rows of P sum to 1 − P^sink and O, δ and (A7) keep their form; only dz_h = −Σ P^sink δ is "
    "new (V2). A row with no allowed key attends only its sink: O = 0, P^sink = 1. The soft-cap "
    "multiplies dS by 1 − tanh² (V1) before dQ, dK and ds; ALiBi's slope gradient is −Σ dS ∘ Δ "
    "(V4); dropout's Z/(1 − p) multiplies P in the forward and dP in the backward (V3), drawn "
    "again from the seed, never stored. Windows and segments (V5, V6) only shape 𝓜: no rule of "
    "their own in the backward."
)



# ---------------------------------------------------------------- the catalogue


def variant_key(names) -> str:
    """The catalogue key of a set of variants: ``"variant:sinks,softcap"``."""
    return PREFIX + ",".join(parse_variants(names))


def is_variant_key(flavor) -> bool:
    return isinstance(flavor, str) and flavor.startswith(PREFIX)


def _sym(S, name, tex, txt, meaning, shape=""):
    S[name] = Sym(name, tex, txt, meaning, shape)
    return S[name]


def variant_catalogue(key: str, cat_cls, section_cls):
    """The catalogue of ``key`` (see :func:`variant_key`), built with the given record classes."""
    on = set(parse_variants(tuple(key[len(PREFIX):].split(","))))
    S = {}
    sy = lambda *a: _sym(S, *a)
    Q = sy("Q_h", "Q_h", "Q_h", "queries of head h", "(Lq, D)")
    K = sy("K_h", "K_h", "K_h", "keys of head h", "(Lk, D)")
    V = sy("V_h", "V_h", "V_h", "values of head h", "(Lk, Dv)")
    s = sy("s", "s", "s", "attention scale (learned: the temperature, V7)" if "scale" in on else "attention scale, default 1/√D", "scalar")
    G = sy("G", "G", "G", "upstream gradient ∂L/∂O (any array: L = Σ G ∘ O is the general linear loss)", "(Lq, Dv)")
    L = sy("L", "L", "L", "scalar loss", "scalar")
    fwd, bwd, soft, chain = [], [], [], []
    F = Formula
    last = "S_h" if not ({"softcap", "alibi"} & on) else "S0_h"
    S0 = sy(last, "S_h" if last == "S_h" else "S^{0}_h", "S_h" if last == "S_h" else "S⁰_h",
            "attention logits of head h" if last == "S_h" else "scaled scores s Q Kᵀ of head h", "(Lq, Lk)")
    fwd.append(F("(A1)", S0, Scale(s, Q @ K.T), kind="forward"))
    cur = S0
    if "softcap" in on:
        c = sy("c", "c", "c", "soft-cap (Gemma 2's logit cap), c > 0", "scalar")
        T = sy("T_h", "T_h", "T_h", "tanh(S⁰ / c), kept for the backward", "(Lq, Lk)")
        name = "S_h" if "alibi" not in on else "S1_h"
        S1 = sy(name, "S_h" if name == "S_h" else "S^{1}_h", "S_h" if name == "S_h" else "S¹_h",
                "soft-capped logits of head h" + (" (the logits)" if name == "S_h" else ""), "(Lq, Lk)")
        fwd.append(F("(V1)", T, Func("tanh", r"\tanh", Over(S0, c), np.tanh), kind="forward"))
        fwd.append(F("(V1)", S1, Scale(c, T), kind="forward"))
        cur = S1
    if "alibi" in on:
        D_ = sy("Delta", r"\Delta", "Δ", "distance |pos(i) − j| of query position pos(i) = i + o from key j", "(Lq, Lk)")
        a = sy("a", "a", "a", "learned ALiBi slopes, one per head", "(H,)")
        Bias = sy("Bias", r"\mathrm{Bias}_h", "Bias_h", "additive attention bias of head h (shared by the sequences)", "(Lq, Lk)")
        Sf = sy("S_h", "S_h", "S_h", "attention logits of head h", "(Lq, Lk)")
        fwd.append(F("(V4)", D_, Distance(), index="ij", kind="forward"))
        fwd.append(F("(V4)", Sf, cur + Bias - PerHead(a, D_), kind="forward"))
        cur = Sf
    Sf = cur
    mask0 = sy("mask0", r"\mathcal{M}^{0}", "𝓜⁰", "padding and causal structure (True = attend)", "(Lq, Lk)")
    mask = mask0
    if {"window", "segments"} & on:
        mask = sy("mask", r"\mathcal{M}", "𝓜", "allowed structure: every rule ANDed (True = attend)", "(Lq, Lk)")
        parts = [mask0]
        if "window" in on:
            Wn = sy("Win", r"\mathcal{W}", "𝓦", "sliding window (ℓ keys back, r ahead; None: unbounded)", "(Lq, Lk)")
            fwd.append(F("(V5)", Wn, Band(), index="ij", kind="forward"))
            parts.append(Wn)
        if "segments" in on:
            qs = sy("qseg", r"\mathrm{qseg}", "qseg", "segment (document) id of each query", "(Lq,)")
            ks = sy("kvseg", r"\mathrm{kvseg}", "kvseg", "segment (document) id of each key", "(Lk,)")
            Sg = sy("Seg", r"\mathcal{S}", "𝓢", "same-document structure (packed sequences)", "(Lq, Lk)")
            fwd.append(F("(V6)", Sg, SameSegment(qs, ks), index="ij", kind="forward"))
            parts.append(Sg)
        fwd.append(F("(A2)", mask, And(*parts), kind="forward"))
    P = sy("P_h", "P_h", "P_h", "attention probabilities of head h; 0 where 𝓜 is False", "(Lq, Lk)")
    if "sinks" in on:
        z = sy("z", "z", "z", "learned sink logits, one per head (gpt-oss)", "(H,)")
        Ps = sy("Psink_h", r"P^{\mathrm{sink}}_h", "Pˢⁱⁿᵏ_h", "the sink's probability in each row (1 on a row with no allowed key)", "(Lq,)")
        fwd.append(F("(V2)", P, SinkSoftmax(Sf, mask, z), kind="forward"))
        fwd.append(F("(V2)", Ps, OneMinus(RowSum(P)), kind="forward"))
    else:
        fwd.append(F("(A2)", P, MaskedSoftmax(Sf, mask), kind="forward"))
    Pv = P
    if "dropout" in on:
        Z = sy("Z", "Z_h", "Z_h", "dropout keep mask (attngrad.dropout_mask: a hash of seed, b, h, i, j)", "(Lq, Lk)")
        kap = sy("kappa", r"\kappa", "κ", "1/(1 − p), dropout's rescaling (p the dropout rate)", "scalar")
        Pv = sy("Pt_h", r"\tilde{P}_h", "P̃_h", "probabilities after dropout", "(Lq, Lk)")
        fwd.append(F("(V3)", Pv, Scale(kap, Had(Z, P)), kind="forward"))
    O = sy("O_h", "O_h", "O_h", "attention output of head h", "(Lq, Dv)")
    fwd.append(F("(A3)", O, Pv @ V, kind="forward"))
    fwd.append(F("(L1)", L, Einsum("", [(G, "bhie"), (O, "bhie")], batched=False), kind="forward"))

    def dsym(base: Sym, shape: str):
        return sy("d" + base.name, "d" + base.tex, "d" + base.txt, f"∂L/∂{base.txt}", shape)

    dO, dV = dsym(O, "(Lq, Dv)"), dsym(V, "(Lk, Dv)")
    dP, dS = dsym(P, "(Lq, Lk)"), dsym(Sf, "(Lq, Lk)")
    delta = sy("delta_h", r"\delta_h", "δ_h", "per-row correction: δ_i = Σ_j P_ij dP_ij = Σ_e dO_ie O_ie", "(Lq,)")
    bwd.append(F("(L1)", dO, G))
    bwd.append(F("(A4)" if Pv is P else "(V3)", dV, Pv.T @ dO))
    if "dropout" in on:
        dPv = dsym(Pv, "(Lq, Lk)")
        bwd.append(F("(A5)", dPv, dO @ V.T))
        bwd.append(F("(V3)", dP, Scale(kap, Had(Z, dPv))))
    else:
        bwd.append(F("(A5)", dP, dO @ V.T))
    bwd.append(F("(A6)", delta, RowSum(Had(dO, O))))
    bwd.append(F("(A7)", dS, Had(P, dP - ColOnes(delta))))
    if "sinks" in on:
        bwd.append(F("(V2)", dsym(z, "(H,)"), Neg(IndexSum(Had(Ps, delta), "b,i"))))
    if "alibi" in on:
        bwd.append(F("(A10)", dsym(Bias, "(Lq, Lk)"), BatchSum(dS)))
        bwd.append(F("(V4)", dsym(a, "(H,)"), Neg(IndexSum(Had(dS, D_), "b,i,j"))))
    cur_d = dS
    if "alibi" in on and "softcap" in on:
        dS1 = dsym(S1, "(Lq, Lk)")
        bwd.append(F("(V4)", dS1, dS))  # + Bias − a Δ passes dS through
        cur_d = dS1
    if "softcap" in on:
        dS0 = dsym(S0, "(Lq, Lk)")
        bwd.append(F("(V1)", dS0, Had(cur_d, OneMinus(Had(T, T)))))
        cur_d = dS0
    elif "alibi" in on:
        dS0 = dsym(S0, "(Lq, Lk)")
        bwd.append(F("(V4)", dS0, dS))
        cur_d = dS0
    dQ, dK = dsym(Q, "(Lq, D)"), dsym(K, "(Lk, D)")
    bwd.append(F("(A8)", dQ, Scale(s, cur_d @ K)))
    bwd.append(F("(A9)", dK, Scale(s, cur_d.T @ Q)))
    if "scale" in on:
        bwd.append(F("(V7)", dsym(s, "scalar"), IndexSum(Had(Q, cur_d @ K), "b,h,i,d", keep_heads=False)))

    sections = [section_cls("forward", "Forward equations", _FORWARD_INTRO, tuple(fwd))]
    if "sinks" in on:
        J = sy("J_h", "J", "J", "Jacobian of one row's key probabilities: J_i[k, j] = ∂P_ik/∂S_ij", "(Lq, Lk, Lk)")
        Jz = sy("Jz_h", r"\partial P_h / \partial z_h", "∂P_h/∂z_h", "derivative of the probabilities by the sink logit", "(Lq, Lk)")
        soft.append(F("(V2)", J, SoftmaxJacobian(P), index="i"))
        soft.append(F("(V2)", Jz, Neg(Had(ColOnes(Ps), P))))
        soft.append(F("(V2)", dS, Einsum("ij", [(J, "ikj"), (dP, "ik")]), index="ij", defines=False))
        soft.append(F("(V2)", dsym(z, "(H,)"), IndexSum(Had(Jz, dP), "b,i,j"), defines=False))
        sections.append(section_cls("softmax", "The softmax with a sink: its Jacobian", _SINK_INTRO, tuple(soft)))
    if "softcap" in on:
        Tp = sy("Tp_h", r"\partial S^{1}_h / \partial S^{0}_h", "∂S¹_h/∂S⁰_h", "the soft-cap's local derivative, elementwise", "(Lq, Lk)")
        chain.append(F("(V1)", Tp, OneMinus(Had(T, T))))
        sech2 = Func("sech²", r"\operatorname{sech}^2", Over(S0, c), lambda x: 1.0 / np.cosh(x) ** 2)
        chain.append(F("(V1)", dS0, Had(dS1 if "alibi" in on else dS, sech2), defines=False))
        sections.append(section_cls("chain", "The soft-cap's chain rule", _CAP_INTRO, tuple(chain)))
    sections.append(section_cls("backward", "Gradients (one head; Σ_b, Σ_h where a quantity is shared)", _BACKWARD_INTRO, tuple(bwd)))
    used = {sym.name for sec in sections for f in sec.formulas for sym in f.symbols()}
    title = "today's attention variants (" + ", ".join(n for n in VARIANTS if n in on) + "), one head"
    return cat_cls(key, {n: sym for n, sym in S.items() if n in used}, tuple(sections), title, NOTES, VARIANT_NOTATION)


_FORWARD_INTRO = (
    "One head h of one sequence b; rows are queries i, columns keys j. Query positions are "
    "pos(i) = i + o, o = 0 (top-left) or Lk − Lq (bottom-right, the default without a causal rule)."
)
_SINK_INTRO = (
    "Row i of P is the key part of a softmax over [S_i, z_h]. Its Jacobian by S_i keeps the form "
    "diag(p) − pᵀp, but p now sums to 1 − P^sink_i, and ∂P_ij/∂z_h = −P_ij P^sink_i. Contracting "
    "with dP gives back (A7) and dz_h = −Σ_i P^sink_i δ_i: the sink's gradient needs only δ."
)
_CAP_INTRO = (
    "S¹ = c tanh(S⁰/c) has the local derivative 1 − tanh²(S⁰/c) = sech²(S⁰/c), elementwise; it "
    "multiplies dS before (A8), (A9) and (V7). Keeping T = tanh(S⁰/c) from the forward makes it one product."
)
_BACKWARD_INTRO = (
    "(A4)-(A9) keep their form with the variants: P̃ in place of P under dropout, dS⁰ in place of dS "
    "in (A8), (A9). Shared quantities sum over what shares them: dz_h over sequences and rows, "
    "da_h over sequences, rows and keys, dBias_h over sequences, ds over everything."
)


# ---------------------------------------------------------------- evaluation environment


def variant_env(names, q, k, v, g, options: Mapping | None = None) -> dict:
    """The starting environment of a variant catalogue (NumPy float64, heads H = Hkv).

    ``options``: the keyword options of :func:`attngrad.sdpa_forward` the problem uses
    (scale, the variants' values, key_lengths, causal).  ``mask0`` (padding and causal) is
    built by the library's one mask rule; the window and the segments are formulas of the
    catalogue (V5, V6), as are ALiBi's distances (V4)."""
    on = set(parse_variants(names))
    o = {**VARIANT_DEFAULTS, "scale": None, "key_lengths": None, "causal": False, **(options or {})}
    b, h, lq, d = q.shape  # (B, H, Lq, D)
    lk = k.shape[2]
    spec = make_mask_spec(np, b, h, lq, lk, key_lengths=o["key_lengths"], causal=o["causal"])
    allowed = spec.block(np)
    env = {
        "Q_h": q, "K_h": k, "V_h": v, "G": g, "H": h, "Lq": lq, "Lk": lk, "o": spec.offset,
        "s": resolve_scale(o["scale"], d),
        "mask0": np.ones((1, 1, lq, lk), dtype=bool) if allowed is None else allowed,
    }
    if "softcap" in on:
        env["c"] = float(o["softcap"])
    if "sinks" in on:
        env["z"] = np.asarray(o["sinks"], dtype=np.float64)
    if "alibi" in on:
        env["a"], env["Bias"] = np.asarray(o["alibi_slopes"], dtype=np.float64), o["bias"]
    if "window" in on:
        env["left"], env["right"] = o["window"]
    if "segments" in on:
        env["qseg"], env["kvseg"] = o["q_segment_ids"], o["kv_segment_ids"]
    if "dropout" in on:
        env["Z"] = dropout_mask(o["dropout_seed"], (b, h, lq, lk), o["dropout_p"])
        env["kappa"] = 1.0 / (1.0 - o["dropout_p"])
    return env
