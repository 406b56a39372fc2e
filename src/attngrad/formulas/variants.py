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
Top-k (TK1-TK5) and the lse (LS1-LS4) join the same catalogue: ``idx`` (B, H, Lq, K), the
slots of each row, and ``Gamma`` (B, H, Lq), the lse's upstream gradient (``kv_indices=``,
``dlse=`` in ``variant_env``'s options).  The gated output (GA1-GA5) is a layer option: its
catalogue (``"variant:gate"``, :mod:`.gate`) is the self-attention layer with the gate.
"""


from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..core.dropout import dropout_mask
from ..core.masks import make_mask_spec
from ..core.variants import (
    ALL_VARIANTS,
    LAYER_ONLY_VARIANTS,
    VARIANT_DEFAULTS,
    VARIANTS,
    parse_all_variants,
)
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
from .sparse_nodes import GatherRows as Gather
from .sparse_nodes import LogSumExp, ScatterKeys, ScatterRows, Slots, SlotsFilled
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
    """The catalogue key of a set of variants: ``"variant:sinks,softcap"``.  Names from
    core.variants.ALL_VARIANTS ("all": V1-V7); "gate" (a layer option) alone: ``"variant:gate"``."""
    names = parse_all_variants(names, VARIANTS)
    if set(names) & set(LAYER_ONLY_VARIANTS) and len(names) > 1:
        raise ValueError(
            f"variants {', '.join(names)}: gate is an option of the layer (mha_forward), the others of "
            "sdpa_forward's attention core; give gate alone (variant_keys splits a mixed set)"
        )
    return PREFIX + ",".join(names)


def variant_keys(names) -> tuple:
    """The catalogue keys a set of variants prints: the attention core of one head with the
    sdpa variants, then the gated layer (GA1-GA5) when "gate" is among them."""
    names = parse_all_variants(names, VARIANTS)
    core = [n for n in names if n not in LAYER_ONLY_VARIANTS]
    layer = [n for n in names if n in LAYER_ONLY_VARIANTS]
    return tuple(PREFIX + ",".join(part) for part in (core, layer) if part)


def is_variant_key(flavor) -> bool:
    return isinstance(flavor, str) and flavor.startswith(PREFIX)


def _sym(S, name, tex, txt, meaning, shape=""):
    S[name] = Sym(name, tex, txt, meaning, shape)
    return S[name]


def variant_catalogue(key: str, cat_cls, section_cls):
    """The catalogue of ``key`` (see :func:`variant_key`), built with the given record classes."""
    names = parse_all_variants(tuple(key[len(PREFIX):].split(",")), VARIANTS)
    if "gate" in names:
        from .gate import gate_catalogue

        if len(names) > 1:
            raise ValueError(f"variants {', '.join(names)}: gate (a layer option) cannot share a catalogue "
                             "with the attention core's variants")
        return gate_catalogue(key, cat_cls, section_cls)
    on = set(names)
    topk, lse = "topk" in on, "lse" in on
    LK = "(Lq, K)" if topk else "(Lq, Lk)"  # the logits' shape: K slots per row under top-k
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
    if topk:
        Kg = sy("Kg_h", r"\hat{K}_h", "K̂_h", "the keys each slot names: K̂_h[i, s] = K_h[j_s] (j_s = idx[b, h // G, i, s])", "(Lq, K, D)")
        Vg = sy("Vg_h", r"\hat{V}_h", "V̂_h", "the values each slot names: V̂_h[i, s] = V_h[j_s]", "(Lq, K, Dv)")
        fwd.append(F("(TK1)", Kg, Gather(K), kind="forward"))
        fwd.append(F("(TK1)", Vg, Gather(V), kind="forward"))
        fwd.append(F("(TK2)", S0, Scale(s, Einsum("is", [(Q, "id"), (Kg, "isd")])), index="is", kind="forward"))
    else:
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
        if topk:
            fwd.append(F("(TK2)", Sf, cur + Slots(Bias) - PerHead(a, Slots(D_)), kind="forward"))
        else:
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
    if topk:
        vld = sy("valid", r"\mathcal{V}", "𝓥", "valid slots: the slot names a key (j_s ≥ 0) that 𝓜 allows (True = attend)", "(Lq, K)")
        fwd.append(F("(TK1)", vld, And(SlotsFilled(), Slots(mask)), kind="forward"))
        mask = vld
    P = sy("P_h", "P_h", "P_h", "attention probabilities of head h; 0 where 𝓜 is False" if not topk else
           "attention probabilities of head h's slots; 0 where 𝓥 is False (a key listed twice: two slots)", LK)
    if "sinks" in on:
        z = sy("z", "z", "z", "learned sink logits, one per head (gpt-oss)", "(H,)")
        Ps = sy("Psink_h", r"P^{\mathrm{sink}}_h", "Pˢⁱⁿᵏ_h", "the sink's probability in each row (1 on a row with no allowed key)", "(Lq,)")
        fwd.append(F("(V2)", P, SinkSoftmax(Sf, mask, z), kind="forward"))
        fwd.append(F("(V2)", Ps, OneMinus(RowSum(P)), kind="forward"))
    else:
        fwd.append(F("(TK3)" if topk else "(A2)", P, MaskedSoftmax(Sf, mask), kind="forward"))
    if lse:
        ls = sy("lse_h", r"\mathrm{lse}_h", "lse_h", "log of each row's softmax denominator (allowed keys and the sink); −∞ for a row with nothing to attend", "(Lq,)")
        Gm = sy("Gamma", r"\Gamma", "Γ", "upstream gradient ∂L/∂lse (sdpa_backward's dlse)", "(Lq,)")
        fwd.append(F("(LS1)", ls, LogSumExp(Sf, mask, z) if "sinks" in on else LogSumExp(Sf, mask), kind="forward"))
    Pv = P
    if "dropout" in on:
        Z = sy("Z", "Z_h", "Z_h", "dropout keep mask (attngrad.dropout_mask: a hash of seed, b, h, i, j)", "(Lq, Lk)")
        kap = sy("kappa", r"\kappa", "κ", "1/(1 − p), dropout's rescaling (p the dropout rate)", "scalar")
        Pv = sy("Pt_h", r"\tilde{P}_h", "P̃_h", "probabilities after dropout", "(Lq, Lk)")
        fwd.append(F("(TK4)" if topk else "(V3)", Pv, Scale(kap, Had(Slots(Z) if topk else Z, P)), kind="forward"))
    O = sy("O_h", "O_h", "O_h", "attention output of head h", "(Lq, Dv)")
    if topk:
        fwd.append(F("(TK4)", O, Einsum("ie", [(Pv, "is"), (Vg, "ise")]), index="ie", kind="forward"))
    else:
        fwd.append(F("(A3)", O, Pv @ V, kind="forward"))
    loss = Einsum("", [(G, "bhie"), (O, "bhie")], batched=False)
    if lse:
        fwd.append(F("(LS3)", L, loss + Einsum("", [(Gm, "bhi"), (ls, "bhi")], batched=False), kind="forward"))
    else:
        fwd.append(F("(L1)", L, loss, kind="forward"))

    def dsym(base: Sym, shape: str):
        return sy("d" + base.name, "d" + base.tex, "d" + base.txt, f"∂L/∂{base.txt}", shape)

    dO, dV = dsym(O, "(Lq, Dv)"), dsym(V, "(Lk, Dv)")
    dP, dS = dsym(P, LK), dsym(Sf, LK)
    delta = sy("delta_h", r"\delta_h", "δ_h", "per-row correction: δ_i = Σ_j P_ij dP_ij = Σ_e dO_ie O_ie", "(Lq,)")
    bwd.append(F("(L1)", dO, G))
    if topk:
        bwd.append(F("(TK5)", dV, ScatterRows(Einsum("ise", [(Pv, "is"), (dO, "ie")]))))
    else:
        bwd.append(F("(A4)" if Pv is P else "(V3)", dV, Pv.T @ dO))
    dP_rhs = Einsum("is", [(dO, "ie"), (Vg, "ise")]) if topk else dO @ V.T
    if "dropout" in on:
        dPv = dsym(Pv, LK)
        bwd.append(F("(TK5)" if topk else "(A5)", dPv, dP_rhs, index="is" if topk else ""))
        bwd.append(F("(V3)", dP, Scale(kap, Had(Slots(Z) if topk else Z, dPv))))
    else:
        bwd.append(F("(TK5)" if topk else "(A5)", dP, dP_rhs, index="is" if topk else ""))
    bwd.append(F("(A6)", delta, RowSum(Had(dO, O))))
    row = delta
    if lse:
        row = sy("deltal_h", r"\delta'_h", "δ′_h", "per-row correction with the lse's gradient: δ′ = δ − Γ", "(Lq,)")
        bwd.append(F("(LS3)", row, delta - Gm))
    bwd.append(F("(LS3)" if lse else "(A7)", dS, Had(P, dP - ColOnes(row))))
    if "sinks" in on:
        bwd.append(F("(LS3)" if lse else "(V2)", dsym(z, "(H,)"), Neg(IndexSum(Had(Ps, row), "b,i"))))
    if "alibi" in on:
        if topk:
            bwd.append(F("(TK5)", dsym(Bias, "(Lq, Lk)"), BatchSum(ScatterKeys(dS))))
            bwd.append(F("(TK5)", dsym(a, "(H,)"), Neg(IndexSum(Had(dS, Slots(D_)), "b,i,s"))))
        else:
            bwd.append(F("(A10)", dsym(Bias, "(Lq, Lk)"), BatchSum(dS)))
            bwd.append(F("(V4)", dsym(a, "(H,)"), Neg(IndexSum(Had(dS, D_), "b,i,j"))))
    cur_d = dS
    if "alibi" in on and "softcap" in on:
        dS1 = dsym(S1, LK)
        bwd.append(F("(V4)", dS1, dS))  # + Bias − a Δ passes dS through
        cur_d = dS1
    if "softcap" in on:
        dS0 = dsym(S0, LK)
        bwd.append(F("(V1)", dS0, Had(cur_d, OneMinus(Had(T, T)))))
        cur_d = dS0
    elif "alibi" in on:
        dS0 = dsym(S0, LK)
        bwd.append(F("(V4)", dS0, dS))
        cur_d = dS0
    dQ, dK = dsym(Q, "(Lq, D)"), dsym(K, "(Lk, D)")
    if topk:
        bwd.append(F("(TK5)", dQ, Scale(s, Einsum("id", [(cur_d, "is"), (Kg, "isd")])), index="id"))
        bwd.append(F("(TK5)", dK, Scale(s, ScatterRows(Einsum("isd", [(cur_d, "is"), (Q, "id")])))))
    else:
        bwd.append(F("(A8)", dQ, Scale(s, cur_d @ K)))
        bwd.append(F("(A9)", dK, Scale(s, cur_d.T @ Q)))
    if "scale" in on:
        dS0K = Einsum("id", [(cur_d, "is"), (Kg, "isd")]) if topk else cur_d @ K
        bwd.append(F("(V7)", dsym(s, "scalar"), IndexSum(Had(Q, dS0K), "b,h,i,d", keep_heads=False)))

    sections = [section_cls("forward", "Forward equations", _FORWARD_INTRO, tuple(fwd))]
    if "sinks" in on:
        J = sy("J_h", "J", "J", "Jacobian of one row's key probabilities: J_i[k, j] = ∂P_ik/∂S_ij",
               "(Lq, K, K)" if topk else "(Lq, Lk, Lk)")
        Jz = sy("Jz_h", r"\partial P_h / \partial z_h", "∂P_h/∂z_h", "derivative of the probabilities by the sink logit", LK)
        soft.append(F("(V2)", J, SoftmaxJacobian(P), index="i"))
        soft.append(F("(V2)", Jz, Neg(Had(ColOnes(Ps), P))))
        if lse:  # (LS2): ∂lse/∂S = P, ∂lse/∂z = P^sink join the chain rule
            soft.append(F("(LS2)", dS, Einsum("ij", [(J, "ikj"), (dP, "ik")]) + Had(P, ColOnes(Gm)), index="ij", defines=False))
            soft.append(F("(LS2)", dsym(z, "(H,)"), IndexSum(Had(Jz, dP), "b,i,j") + IndexSum(Had(Ps, Gm), "b,i"), defines=False))
        else:
            soft.append(F("(V2)", dS, Einsum("ij", [(J, "ikj"), (dP, "ik")]), index="ij", defines=False))
            soft.append(F("(V2)", dsym(z, "(H,)"), IndexSum(Had(Jz, dP), "b,i,j"), defines=False))
        sections.append(section_cls("softmax", "The softmax with a sink: its Jacobian", _SINK_INTRO, tuple(soft)))
    if "softcap" in on:
        Tp = sy("Tp_h", r"\partial S^{1}_h / \partial S^{0}_h", "∂S¹_h/∂S⁰_h", "the soft-cap's local derivative, elementwise", LK)
        chain.append(F("(V1)", Tp, OneMinus(Had(T, T))))
        sech2 = Func("sech²", r"\operatorname{sech}^2", Over(S0, c), lambda x: 1.0 / np.cosh(x) ** 2)
        chain.append(F("(V1)", dS0, Had(dS1 if "alibi" in on else dS, sech2), defines=False))
        sections.append(section_cls("chain", "The soft-cap's chain rule", _CAP_INTRO, tuple(chain)))
    sections.append(section_cls("backward", "Gradients (one head; Σ_b, Σ_h where a quantity is shared)", _BACKWARD_INTRO, tuple(bwd)))
    used = {sym.name for sec in sections for f in sec.formulas for sym in f.symbols()}
    title = "today's attention variants (" + ", ".join(n for n in ALL_VARIANTS if n in on) + "), one head"
    notes, notation = NOTES, VARIANT_NOTATION
    if topk:
        notes += " " + TOPK_NOTES
        notation += TOPK_NOTATION
    if lse:
        notes += " " + LSE_NOTES
        notation += LSE_NOTATION
    return cat_cls(key, {n: sym for n, sym in S.items() if n in used}, tuple(sections), title, notes, notation)


TOPK_NOTATION = (
    ("A[j_s]", r"A\left[j_s\right]", "row j_s of A: the key slot s of row i names (j_s = idx[b, h // G, i, s], −1 empty)"),
    ("A[i, j_s]", r"A\left[i, j_s\right]", "an (Lq, Lk) structure read at row i's slots"),
    ("Σ_{i,s: j_s = j}", r"\sum_{i,s:\, j_s = j}", "scatter-add: every slot's term added into the key it names"),
)
TOPK_NOTES = (
    "Top-k (TK1-TK5): each row attends its K slots, gather semantics: a key listed twice is two "
    "terms of the softmax and its dK, dV are the sum over both (the scatter-add); an empty slot "
    "(−1) or one the mask forbids is not valid; a row with every slot empty has O = 0 and zero "
    "gradients. Every (Lq, Lk) rule (mask, bias, ALiBi's distance, dropout's Z) is read at the slots."
)
LSE_NOTATION = (
    ("logsumexp_{𝓜,z}(S)", r"\operatorname{logsumexp}_{\mathcal{M},z}(S)",
     "log(exp(z_h) + Σ_j 𝓜_ij exp(S_ij)) per row (no sink term without sinks); −∞ with nothing allowed"),
)
LSE_NOTES = (
    "The log-sum-exp as an output (LS1-LS4): ∂lse_i/∂S_ij = P_ij and ∂lse_i/∂z_h = P^sink_i, so "
    "the loss ⟨O, G⟩ + ⟨lse, Γ⟩ changes only δ into δ′ = δ − Γ in (A7) and in dz; dV is unchanged."
)


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
    on = set(parse_all_variants(names, VARIANTS)) - set(LAYER_ONLY_VARIANTS)
    o = {**VARIANT_DEFAULTS, "kv_indices": None, "dlse": None, "scale": None, "key_lengths": None, "causal": False, **(options or {})}
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
    if "topk" in on:  # (B, Hkv or 1, Lq, K) -> one list per query head (B, H, Lq, K)
        idx = np.asarray(o["kv_indices"])
        env["idx"] = np.repeat(idx, h // idx.shape[1], axis=1) if idx.shape[1] != h else idx
    if "lse" in on:
        env["Gamma"] = np.asarray(o["dlse"], dtype=np.float64)
    return env
