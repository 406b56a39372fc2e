"""Why a tensor is wrong, computed from the numbers.

Two kinds of evidence, in this order:

1. **a classic mistake reproduces it**: the layer of :mod:`.reference` is run under each
   mistake that applies to the case (one at a time; two at once where no one mistake
   explains every failing tensor), and a failing tensor
   is explained by a mistake whose tensor it equals within the grading tolerance while the
   true tensor does not.  Of several, the one that reproduces the most of the learner's
   tensors (a consistent story) wins; then one mistake before two.
2. **a relation to the true tensor**: a constant factor (−1, s, 1/s, 1/B, ...), the
   transpose, another key's true tensor (dW^Q where dW^K belongs), a missing sum over the
   batch, the other head layout, right only where the causal mask allows a key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import combinations

import numpy as np

from .case import SHAPES, GradeCase
from .reference import NONE, Mistakes, layer, merge_heads


@dataclass(frozen=True)
class Hypothesis:
    mistakes: Mistakes
    text: str  # the mistake in words, with the equation it breaks
    group: str  # one mistake per group in a pair
    parts: tuple = ()  # a pair's two single mistakes

    @property
    def count(self) -> int:
        return len(self.parts) or 1


def single_mistakes(case: GradeCase) -> list[Hypothesis]:
    """Every classic mistake that can show in ``case`` (in the order hints prefer them)."""
    s_words = "(A8) dQ = s·dS K and (A9) dK = s·dSᵀ Q"
    out = [
        Hypothesis(Mistakes(bwd_scale="1"), f"the scale s missing from {s_words}", "scale"),
        Hypothesis(Mistakes(bwd_scale="s2"), f"the scale applied twice (s² for s) in {s_words}", "scale"),
        Hypothesis(Mistakes(bwd_scale="1/s"), f"a division by s in place of the factor s of {s_words}", "scale"),
        Hypothesis(Mistakes(fwd_scale="1", bwd_scale="1"),
                   "no scale at all: (A1) S = s·QKᵀ with s = 1/√D, and (A8), (A9) carry the same s", "scale"),
        Hypothesis(Mistakes(fwd_scale="1"), "the scale missing from the logits, (A1) S = s·QKᵀ", "scale"),
        Hypothesis(Mistakes(fwd_scale="s2", bwd_scale="s2"), "the scale 1/D in place of 1/√D, (A1) (A8) (A9)",
                   "scale"),
        Hypothesis(Mistakes(delta="none"),
                   "the −δ of (A7) missing: dS = P ∘ dP, not P ∘ (dP − δ) with δ_i = Σ_j P_ij dP_ij (A6)", "delta"),
        Hypothesis(Mistakes(delta="dP"), "δ summed without P: (A6) δ_i = Σ_j P_ij dP_ij, not Σ_j dP_ij", "delta"),
        Hypothesis(Mistakes(delta="+"), "δ added, not subtracted: (A7) dS = P ∘ (dP − δ)", "delta"),
        Hypothesis(Mistakes(ds_sign=-1), "a wrong sign in (A7): dS = P ∘ (δ − dP), not P ∘ (dP − δ)", "sign"),
    ]
    square = case.m is None  # Lq = Lk: P can be used untransposed, dQ and dK have one shape
    if square:
        out.append(Hypothesis(Mistakes(dv_with_p=True), "P not transposed in (A4): dV = P dO, not Pᵀ dO", "dv"))
        out.append(Hypothesis(Mistakes(swap_qk=True),
                              "dQ and dK swapped: (A8) dQ = s·dS K, (A9) dK = s·dSᵀ Q", "swap"))
    if case.causal:
        out += [
            Hypothesis(Mistakes(mask="after"), "the mask applied after the softmax (P = softmax(S) ∘ mask, rows no "
                       "longer sum to 1): (A2) sets masked logits to −∞ before it", "mask"),
            Hypothesis(Mistakes(mask="zero"), "masked logits set to 0, not −∞ (A2): e⁰ = 1 still attends to "
                       "later keys", "mask"),
            Hypothesis(Mistakes(mask="none"), "no causal mask: (A2) hides key j > i from query i", "mask"),
        ]
    names = {"q": "Q (dQ W^Qᵀ)", "k": "K (dK W^Kᵀ)", "v": "V (dV W^Vᵀ)"}
    if case.m is None:
        for missing in ("v", "k", "q", "kv", "qv", "qk"):
            lost = " and ".join(names[r] for r in missing)
            out.append(Hypothesis(Mistakes(missing_paths=tuple(missing)),
                                  f"dX without the path through {lost}: X feeds all three projections, "
                                  "(M9) dX = dQ W^Qᵀ + dK W^Kᵀ + dV W^Vᵀ", "paths"))
    else:
        for missing in ("v", "k"):
            out.append(Hypothesis(Mistakes(missing_paths=(missing,)),
                                  f"dM without the path through {names[missing]}: M feeds K and V, "
                                  "(M10) dM = dK W^Kᵀ + dV W^Vᵀ", "paths"))
    widths = (case.params["W_q"].shape[1], case.params["W_v"].shape[1])
    for h in range(1, widths[0] + 1):
        if h != case.heads and all(w % h == 0 for w in widths):
            out.append(Hypothesis(Mistakes(heads=h), f"{h} heads, not {case.heads}: grade it with heads={h} "
                                  f"(D = {widths[0] // h}, s = 1/√{widths[0] // h})", "heads"))
    return out


def _combine(a: Hypothesis, b: Hypothesis) -> Hypothesis:
    changed = {f.name: getattr(b.mistakes, f.name) for f in fields(Mistakes)
               if getattr(b.mistakes, f.name) != getattr(NONE, f.name)}
    return Hypothesis(replace(a.mistakes, **changed), f"{a.text}; and {b.text}", f"{a.group}+{b.group}", (a, b))


def close(got: np.ndarray, want: np.ndarray, tol: float) -> bool:
    """Same shape, finite, max |got − want| <= tol."""
    return (got.shape == want.shape and bool(np.isfinite(got).all())
            and (got.size == 0 or float(np.max(np.abs(got - want))) <= tol))


def explain(case: GradeCase, answers: dict, failing: list, tol: dict) -> tuple:
    """({failing key: the Hypothesis that best reproduces it}, the best Hypothesis that
    reproduces every failing key or None).  Keys no mistake reproduces are left out.
    ``answers``: the learner's graded arrays by key; ``tol``: absolute tolerances by key."""
    found = []  # (hypothesis, keys it matches, failing keys it explains)

    def run(hypotheses):
        for hyp in hypotheses:
            alt = layer(case.params, case.x, case.m, case.dy, heads=case.heads, causal=case.causal,
                        mistakes=hyp.mistakes)
            matches = {k for k, a in answers.items() if close(a, alt[k], tol[k])}
            explains = {k for k in failing if k in matches and not close(case.truth[k], alt[k], tol[k])}
            if explains:
                found.append((hyp, matches, explains))

    singles = single_mistakes(case)
    run(singles)
    if not any(e == set(failing) for _, _, e in found):  # no one mistake explains it all: two at once
        run(_combine(a, b) for a, b in combinations(singles, 2) if a.group != b.group)
    def pick(candidates):  # the most keys reproduced, then one mistake before two, then order
        ranked = [(len(m), -h.count, -i, h) for i, (h, m, _) in candidates]
        return max(ranked, key=lambda r: r[:3])[3] if ranked else None

    best = {}
    for key in failing:
        hyp = pick([(i, f) for i, f in enumerate(found) if key in f[2]])
        if hyp is not None and hyp.parts:  # a pair: the one of its mistakes that shows here, if one does
            alone = [h for h, _, e in found if h in hyp.parts and key in e]
            hyp = alone[0] if len(alone) == 1 else hyp
        if hyp is not None:
            best[key] = hyp
    covering = pick([(i, f) for i, f in enumerate(found) if f[2] == set(failing)])
    return best, covering


def named_factor(c: float, case: GradeCase) -> str | None:
    """Words for a factor c between a tensor and its true value, where c is a classic one."""
    d = case.params["W_q"].shape[1] // case.heads
    s = 1.0 / np.sqrt(d)
    b, lq = case.x.shape[:2]
    names = [(-1.0, "minus the true tensor: a wrong sign"),
             (1.0 / s, f"the true tensor divided by s = 1/√{d}: the scale s missing"),
             (s, f"the true tensor times s = 1/√{d}: the scale applied once too often"),
             (-1.0 / s, "minus the true tensor divided by s: a wrong sign and the scale missing"),
             (-s, "minus the true tensor times s: a wrong sign and the scale once too often"),
             (s * s, "the true tensor times s²: the scale applied twice too often"),
             (1.0 / b, f"the true tensor divided by B = {b}: a mean over the batch, not a sum"),
             (1.0 / (b * lq), f"the true tensor divided by B·Lq = {b * lq}: a mean, not a sum"),
             (float(b), f"the true tensor times B = {b}"),
             (2.0, "twice the true tensor: a term counted twice"), (0.5, "half the true tensor"),
             (float(case.heads), f"the true tensor times H = {case.heads}"),
             (1.0 / case.heads, f"the true tensor divided by H = {case.heads}: a mean over the heads")]
    for value, words in names:
        if abs(c - value) <= 1e-6 * abs(value):
            return words
    return None


def relation(key: str, got: np.ndarray, case: GradeCase, tol: dict) -> str:
    """A relation between a failing tensor and the true tensors, in words ("" if none)."""
    want, t = case.truth[key], tol[key]
    if got.shape != want.shape:
        return _shape_relation(key, got, want, t)
    bad = ~np.isfinite(got)
    if bad.any():
        return f"{int(bad.sum())} entries are NaN or ±inf, the first at {list(np.argwhere(bad)[0])}"
    if not np.any(got) and np.max(np.abs(want)) > t:
        return "all zeros: not computed yet, or every path into it left out"
    ww = float(np.sum(want * want))
    if ww > 0:
        c = float(np.sum(got * want)) / ww
        if np.max(np.abs(got - c * want)) <= t:
            return named_factor(c, case) or f"the true tensor times {c:.4g}: off by a constant factor"
    if got.ndim >= 2 and got.shape[-1] == got.shape[-2] and close(got, np.swapaxes(want, -1, -2), t):
        return "the true tensor transposed (its last two axes swapped)"
    for other, w in case.truth.items():
        if other != key and w.shape == got.shape and close(got, w, tol[other]):
            return f"equal to the true {case.label(other)} {case.tag(other)}: swapped with it?"
    if case.causal and got.ndim == 4 and got.shape[-1] == got.shape[-2]:
        allowed = np.tril(np.ones(got.shape[-2:], dtype=bool))
        if close(np.where(allowed, got, 0.0), np.where(allowed, want, 0.0), t):
            if key == "dP":
                return ("right where the mask allows the key; elsewhere (A5) dP = dO Vᵀ is not 0 (harmless: "
                        "P is 0 there, so dS is too)")
            return "right where the mask allows the key, wrong where it hides it: there it must be 0"
    return ""


def _shape_relation(key: str, got: np.ndarray, want: np.ndarray, t: float) -> str:
    expected = f"expected shape {want.shape} {SHAPES.get(key, '')}".rstrip()
    if got.size and not np.any(got):
        return f"all zeros, of shape {got.shape}; {expected}"
    if got.ndim == want.ndim + 1 and got.shape[1:] == want.shape and close(got.sum(axis=0), want, t):
        return f"not summed over the batch (its sum over the first axis is right); {expected}"
    if got.ndim == want.ndim + 2 and got.shape[2:] == want.shape and close(got.sum(axis=(0, 1)), want, t):
        return f"not summed over the batch and the rows (its sum over them is right); {expected}"
    if got.ndim >= 2 and got.shape[:-2] + got.shape[:-3:-1] == want.shape and \
            close(np.swapaxes(got, -1, -2), want, t):
        return f"transposed (its last two axes swapped); {expected}"
    if want.ndim == 4 and got.ndim == 3 and got.shape == merge_heads(want).shape and close(got, merge_heads(want), t):
        return f"right, in the merged-heads layout (B, L, H·D); {expected}, per head"
    if want.ndim == 3 and got.ndim == 4 and merge_heads(got).shape == want.shape and close(merge_heads(got), want, t):
        return f"right, per head; {expected}, the heads merged"
    return expected
