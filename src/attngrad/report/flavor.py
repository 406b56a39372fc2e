"""``attngrad report --flavor F``: one self-contained HTML page for one attention flavor.

Everything on it comes from the library, nothing is typed twice, and one case runs through
it all:
- the equations are the catalogue's formula trees (:mod:`attngrad.formulas`, the trees
  ``derive`` prints and the tests evaluate), rendered as MathML;
- the graph is ``attngrad.formulas.graph_dot`` laid out by Graphviz (``dot -Tsvg``);
- the heatmaps are those same trees *evaluated* on the seeded case of ``attngrad check``
  (``check.build_case``), and the page states how far their values are from
  ``mha_backward``'s; a tensor that is 0 up to round-off (dL/db^K) is drawn in greys and
  says so;
- the numbers (``numeric_walkthrough``) are that same case's, every intermediate;
- the check table is ``check.run_check`` on that case.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import NamedTuple

import numpy as np

from ..check import CheckConfig, build_case, closed_form_gradients, run_check
from ..check.report import PRETTY
from ..check.runner import REL_FLOOR, case_scale, errors
from ..formulas import catalogue, evaluate_catalogue, graph_dot, layer_env, numeric_walkthrough
from ..formulas.catalogue import FLAVOR_TITLES, FLAVORS
from ..formulas.document import MASKS_AND_SCALE, derive_document
from ..formulas.numeric import zero_up_to_roundoff
from ..formulas.variants import variant_keys
from .html import esc, page, table
from .mathml import formula_mathml, symbol_mathml
from .svg import heatmap

# gradient name in the check -> catalogue symbol of its formula
_GRAD_SYMBOL = {"X": "dX", "M": "dM", **{f"{p}_{s}": f"d{p}_{s}" for p in "Wb" for s in "qkvo"}}


class FlavorData(NamedTuple):
    """The evaluated formulas of one case, and how they compare with the library."""

    case: object  # check.Case
    env: dict  # every quantity by catalogue name (NumPy arrays)
    library_rel_err: dict  # gradient name -> max rel difference, formula trees vs mha_backward


def evaluate_flavor(flavor: str, cfg: CheckConfig) -> FlavorData:
    """Evaluate every formula of ``flavor`` on the seeded case of ``cfg``."""
    case = build_case(flavor, cfg)
    p64 = {k: v.astype(np.float64) for k, v in case.params.items()}
    inp = {k: v.astype(np.float64) for k, v in case.inputs.items()}
    env = layer_env(flavor, p64, inp["X"], inp.get("M"), case.upstream.astype(np.float64),
                    num_heads=case.num_heads, key_lengths=case.masks.key_lengths)
    ev = evaluate_catalogue(catalogue(flavor), env)
    lib = closed_form_gradients(case)
    floor = REL_FLOOR * case_scale(lib)  # as attngrad check: dL/db^K is 0 up to round-off
    rel = {name: errors(ev.env[_GRAD_SYMBOL[name]], g, floor)[1] for name, g in lib.items()}
    return FlavorData(case, ev.env, rel)


def graph_svg(flavor: str) -> str | None:
    """The flavor's computation graph as inline SVG, or None without Graphviz."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    res = subprocess.run([exe, "-Tsvg"], input=graph_dot(flavor), capture_output=True, text=True,
                         check=False, timeout=60)
    if res.returncode != 0:
        return None
    svg = res.stdout
    svg = svg[svg.index("<svg") :]  # drop the XML prolog and DOCTYPE (with its URL)
    return re.sub(r"<!--.*?-->", "", svg, flags=re.S)


def _equations(flavor: str) -> str:
    """The equations of a catalogue (a flavor, or a variant key of :func:`variant_keys`)."""
    cat = catalogue(flavor)
    out = [f'<details class="symbols"><summary>Symbols ({len(cat.symbols)}): what each letter means and its '
           "shape (per sequence; shapes of one head where the name has h)</summary>",
           '<div class="syms">',
           *(f'<div class="sym"><span class="s">{symbol_mathml(s)}</span><span class="shape">{esc(s.shape)}</span>'
             f"<span>{esc(s.meaning)}</span></div>" for s in cat.symbols.values()),
           "</div></details>"]
    for sec in cat.sections:
        out.append(f"<h2>{esc(sec.title)}</h2><p>{esc(sec.intro)}</p>")
        for f in sec.formulas:
            out.append(f'<div class="eq"><span class="tag">{esc(f.tag)}</span>{formula_mathml(f)}</div>')
    if flavor in MASKS_AND_SCALE:
        out.append(f"<h3>Masks and scale</h3><p>{esc(MASKS_AND_SCALE[flavor])}</p>")
    return "".join(out)


def _variants(variants) -> str:
    """The derivations ``attngrad derive --variant`` prints: the attention core of one head
    with the sdpa variants (V1-V7, top-k, the lse), then the gated layer.  As the printed
    text (their formula trees include nodes the MathML renderer does not draw)."""
    names = ",".join(variants)
    return ("<h2>Variants</h2>"
            '<p class="note">The attention core of one head with the variants asked for, as '
            f"<code>attngrad derive --variant {esc(names)}</code> prints it; the printed formulas are "
            "evaluated against the library by the tests.</p>"
            f'<pre class="derive">{esc(derive_document(variants=tuple(variants)))}</pre>')


def roundoff_note(g, scale: float) -> str | None:
    """The note of a tensor that is 0 up to round-off (None for any other)."""
    if not zero_up_to_roundoff(g, scale):
        return None
    return f"0 up to round-off: max |entry| {float(np.max(np.abs(g))):.1e}"


def _gradient_map(g, scale: float, **kw) -> str:
    """A diverging heatmap of a gradient; muted greys, with a note, where it is round-off."""
    note = roundoff_note(g, scale)
    return heatmap(g, kind="muted" if note else "diverging", note=note, **kw)


def _heatmaps(data: FlavorData, shared_scale: bool = False) -> str:
    env, case = data.env, data.case
    scale = max(float(np.max(np.abs(env[_GRAD_SYMBOL[n]]))) for n in data.library_rel_err)
    lq, lk = case.lengths()
    b, h = env["P_h"].shape[:2]
    ql, kl = [f"{i}" for i in range(lq)], [f"{j}" for j in range(lk)]
    kl_name = "key j (encoder position)" if case.flavor == "cross" else "key j"
    out = ["<h2>Attention and its gradients, per sequence and head</h2>",
           '<p class="note">P (A2), dP (A5) and dS (A7) evaluated from the formula trees above on the '
           "seeded case of <code>attngrad check</code>; masked entries of P are exactly 0, and so are "
           "those of dS. "
           + ("Every P map shares one colour scale, 0 to 1 (<code>--shared-scale</code>), so maps compare "
              "with each other. " if shared_scale else
              "P's colour scale runs from 0 to the largest probability of its map (a row of n keys "
              "averages 1/n, so a 0–1 scale would look uniformly dark; <code>--shared-scale</code> "
              "puts every map on 0–1). ")
           + "Blue negative, red positive, white 0 (dP, dS); a tensor that is 0 up to round-off "
           "(&lt; 1e-11 × the case's largest gradient) is drawn in greys and says so.</p>"]
    for bi in range(b):
        for hi in range(h):
            kl_note = "" if case.masks.key_lengths is None else f" (key length {int(case.masks.key_lengths[bi])})"
            out.append(f"<h3>sequence b = {bi}{kl_note}, head h = {hi}</h3><div class=\"figs\">")
            for name, title, kind in (("P_h", "P (probabilities)", "sequential"),
                                      ("dP_h", "dP = dO Vᵀ", "diverging"),
                                      ("dS_h", "dS = P ∘ (dP − δ 1ᵀ)", "diverging")):
                a = env[name][bi, hi]
                labels = {"title": f"{title}, b={bi} h={hi}", "xlabel": kl_name, "ylabel": "query i",
                          "xlabels": kl, "ylabels": ql}
                if kind == "sequential":
                    top = 1.0 if shared_scale else float(np.max(a))
                    out.append(heatmap(a, kind=kind, vmin=0.0, vmax=top if top > 0 else 1.0, **labels))
                else:
                    out.append(_gradient_map(a, scale, **labels))
            out.append("</div>")
    out.append("<h2>Parameter and input gradients</h2>"
               '<p class="note">Every gradient of L = Σ G ∘ Y, from the formula trees (M5, M7–M10); '
               "rows are the first index (input feature for W, row of the batch for X).</p>"
               '<div class="figs">')
    for name in ("W_q", "W_k", "W_v", "W_o"):
        g = env["d" + name]
        out.append(_gradient_map(g, scale, title=f"{PRETTY[name]} {g.shape}", xlabel="output column",
                                 ylabel="input row"))
    for name in ("b_q", "b_k", "b_v", "b_o"):
        if "d" + name in env:
            g = env["d" + name]
            out.append(_gradient_map(g, scale, title=f"{PRETTY[name]} {g.shape}", xlabel="entry", ylabel="",
                                     max_px=260))
    for name, rows in (("X", "query position"), ("M", "encoder position")):
        if "d" + name in env:
            for bi in range(b):
                g = env["d" + name][bi]
                out.append(_gradient_map(g, scale, title=f"{PRETTY[name]}, sequence b={bi}",
                                         xlabel="feature e", ylabel=rows))
    out.append("</div>")
    return "".join(out)


def _check_table(cfg: CheckConfig, data: FlavorData) -> str:
    rep = run_check(cfg)
    env = data.env
    scale = max(float(np.max(np.abs(env[_GRAD_SYMBOL[n]]))) for n in data.library_rel_err)
    roundoff = {n for n in data.library_rel_err if roundoff_note(env[_GRAD_SYMBOL[n]], scale)}
    rows, classes = [], []
    for r in rep.records:
        name = esc(PRETTY.get(r.gradient, r.gradient))
        if r.gradient in roundoff:
            name += ' <span class="roundoff">(0 up to round-off)</span>'
        rows.append([name, esc(str(tuple(r.shape))), esc(r.reference),
                     f"{r.max_abs_err:.2e}", f"{r.max_rel_err:.2e}", esc(r.tolerance),
                     "pass" if r.passed else "FAIL"])
        classes.append(["", "", "", "num", "num", "", "pass" if r.passed else "fail"])
    n_fail = sum(not r.passed for r in rep.records)
    verdict = (f"<p><b>{'all passed' if rep.passed else 'FAILED'}</b>: {len(rep.records) - n_fail} passed, "
               f"{n_fail} failed (torch {esc(rep.torch_version or 'not installed')}).</p>")
    notes = "".join(f'<p class="note">note: {esc(n)}</p>' for n in rep.notes)
    return ("<h2>Check: closed form vs PyTorch autograd and finite differences</h2>"
            '<p class="note">The library call behind <code>attngrad check</code> on this case: '
            "max rel err = max|a − r| / max(max|r|, 1e-4 · largest gradient of the case), so a "
            "gradient that is 0 up to round-off is judged against that floor.</p>"
            + table(["gradient", "shape", "reference", "max abs err", "max rel err", "tolerance", "result"],
                    rows, classes) + verdict + notes)


def default_seed(flavor: str) -> int:
    """The report's default case: the first seed (0, 1, …) whose sequences all have at least
    one real key (a sequence of padding only would blank its heatmaps).  ``attngrad
    check``'s cases pad no sequence to 0 keys, so this is seed 0, the case ``attngrad
    check`` prints."""
    for seed in range(100):
        kl = build_case(flavor, CheckConfig(flavors=(flavor,), seed=seed)).masks.key_lengths
        if kl is None or int(np.min(kl)) > 0:
            return seed
    return 0


def case_walkthrough(case):
    """The numeric walkthrough of a check case: the report's numbers are its heatmaps' case."""
    return numeric_walkthrough(case.flavor, x=case.inputs["X"], m=case.inputs.get("M"), params=case.params,
                               g=case.upstream, num_heads=case.num_heads, key_lengths=case.masks.key_lengths)


def _walkthrough(case) -> str:
    walk = case_walkthrough(case)
    return ("<h2>Numbers you can follow</h2>"
            '<p class="note">Every intermediate of the case above (the heatmaps\' and the check\'s), '
            "beside its equation tag (<code>attngrad.formulas.numeric_walkthrough</code>; "
            "<code>attngrad derive --numeric --inputs case.npz</code> prints it for a case of yours).</p>"
            f'<details class="walk"><summary>{len(walk.steps)} steps, from X to '
            f'{"dM" if case.flavor == "cross" else "dX"}</summary>{walk.html()}</details>')


def flavor_report(flavor: str, *, seed: int | None = None, check: bool = True, variants=None,
                  shared_scale: bool = False) -> str:
    """The HTML page of one flavor (a string, an :class:`~.html.HTMLPage` that a notebook
    displays).  ``seed`` None: :func:`default_seed`.  ``variants``: names of
    ``core.variants.ALL_VARIANTS`` (or "all": V1-V7) whose derivations the page adds.
    ``shared_scale``: every attention map on one 0–1 colour scale (default: each from 0 to
    its largest probability)."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}; got {flavor!r}")
    if variants is not None:
        variant_keys(variants)  # a bad name: ValueError before any work
    seed = default_seed(flavor) if seed is None else seed
    cfg = CheckConfig(flavors=(flavor,), seed=seed)
    data = evaluate_flavor(flavor, cfg)
    case = data.case
    lq, lk = case.lengths()
    kl = case.masks.key_lengths
    worst = max(data.library_rel_err.values())
    body = [f"<h1>attngrad report: {esc(FLAVOR_TITLES[flavor])}</h1>",
            f'<p>Case: B={cfg.batch}, H={cfg.heads}, E={cfg.width}, Lq={lq}, Lk={lk}, biases, float64, seed {seed}'
            + (f", key lengths {esc(kl.tolist())}" if kl is not None else "")
            + (", causal (top-left)" if flavor == "causal" else "") + ". "
            f"Upstream gradient G random. Every gradient below, evaluated from the printed formulas, "
            f"equals <code>mha_backward</code>'s to a max relative difference of {worst:.1e} "
            f"(relative to max(max|g|, 1e-4 · largest gradient), as in the check table).</p>",
            _equations(flavor),
            "<h2>Computation graph</h2>"]
    svg = graph_svg(flavor)
    if svg is None:
        body.append('<p class="note">Graphviz\'s <code>dot</code> is not installed, so the graph is not '
                    "drawn (Debian: <code>apt-get install graphviz</code>); "
                    "<code>attngrad graph --flavor " + esc(flavor) + " -o graph.dot</code> writes its source.</p>")
    else:
        body.append('<p class="note">Solid: forward, labelled with its formula; dashed red: backward, '
                    f'labelled with the local gradient.</p><div class="graph">{svg}</div>')
    body.append(_heatmaps(data, shared_scale))
    if variants is not None:
        body.append(_variants(tuple(variants) if not isinstance(variants, str) else (variants,)))
    body.append(_walkthrough(case))
    if check:
        body.append(_check_table(cfg, data))
    body.append('<p class="muted">Written by <code>attngrad report</code>. Self-contained: no script, '
                "no network; equations in MathML, figures in SVG.</p>")
    return page(f"attngrad report: {flavor}", "\n".join(body))
