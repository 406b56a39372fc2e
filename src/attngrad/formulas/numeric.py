"""Numbers you can follow: every intermediate of one tiny case, beside its equation tag.

``numeric_walkthrough(flavor)`` builds a seeded case small enough to check by hand
(default cross-attention, Lq = 3 queries, Lk = 4 keys, one head of width D = 2, biases),
evaluates the flavor's formula trees on it (the very trees ``attngrad derive`` prints and
the tests evaluate) and keeps each value in order: the inputs, Q, K, V, S, P, O, Y, then
dY, dW^O, dC, dV, dP, δ, dS, dQ, dK, dW^Q, db^Q, …, dX (and dM).  The same case is run
through the library's own ``mha_forward`` / ``mha_backward`` and ``sdpa_forward``, and
the walkthrough says how far apart they are (round-off: ~1e-16).

``attngrad derive --numeric`` prints it; ``attngrad report`` shows it as a section; in a
notebook the object displays itself (``_repr_html_``, ``_repr_markdown_``).
"""

from __future__ import annotations

from html import escape
from typing import NamedTuple

import numpy as np

from ..core import sdpa_forward
from ..layers import init_mha_params, mha_backward, mha_forward
from .catalogue import FLAVOR_TITLES, FLAVORS, catalogue, evaluate_catalogue, layer_env
from .expr import Concat, HeadSlice

_INPUT_MEANING = {
    "X": "input (queries; keys and values too unless cross)", "M": "encoder output (keys, values)",
    "W_q": "query projection", "W_k": "key projection", "W_v": "value projection",
    "W_o": "output projection", "b_q": "bias of W^Q", "b_k": "bias of W^K", "b_v": "bias of W^V",
    "b_o": "bias of W^O", "G": "upstream gradient ∂L/∂Y (random)",
}


class Step(NamedTuple):
    """One line of the walkthrough: ``tag`` (e.g. "(A7)", "input"), the quantity's name
    (catalogue symbol, e.g. "dS_h"), its printed name ("dS_h"), the equation as text and
    LaTeX (empty for an input) and its value (one sequence, one head)."""

    tag: str
    name: str
    label: str
    equation: str
    latex: str
    value: np.ndarray


class Walkthrough:
    """The numeric walkthrough of one flavor (see :func:`numeric_walkthrough`).

    ``steps``: the :class:`Step` list, in evaluation order; ``values``: name -> array
    (one sequence, one head: every quantity evaluated, Q_h and dO_h too);
    ``library_max_abs_diff``: name -> max |formula − library| for the forward output,
    P and every gradient (``mha_forward``/``mha_backward``/``sdpa_forward``)."""

    def __init__(self, flavor, sizes, steps, library_max_abs_diff, digits, values=None):
        self.flavor = flavor
        self.sizes = sizes
        self.steps = steps
        self.values = {**(values or {}), **{s.name: s.value for s in steps}}
        self.library_max_abs_diff = library_max_abs_diff
        self.digits = digits

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def _fmt(self, a) -> str:
        a = np.asarray(a, dtype=np.float64)
        if a.ndim == 0:
            return f"{float(a):.{self.digits}f}"
        a = a + 0.0  # -0.0 prints as 0.0
        return np.array2string(a, precision=self.digits, floatmode="fixed", suppress_small=True,
                               max_line_width=120, sign=" ")

    def _header(self) -> list:
        s = self.sizes
        worst = max(self.library_max_abs_diff.values())
        return [f"Case: {FLAVOR_TITLES[self.flavor].split('  ')[0]}; B = 1 sequence, H = {s['H']} head, "
                f"D = {s['D']}, E = {s['E']}, Lq = {s['Lq']}, Lk = {s['Lk']}, biases, float64, seed {s['seed']}; "
                f"s = 1/√D = {s['s']:.{self.digits}f}; L = Σ G ∘ Y.",
                f"Every value is the formula tree evaluated; mha_forward / mha_backward / sdpa_forward give "
                f"the same numbers to a max abs difference of {worst:.1e}."]

    def text(self) -> str:
        """The walkthrough as plain text (what ``attngrad derive --numeric`` prints)."""
        title = f"attngrad derive --numeric: {self.flavor}"
        out = [title, "=" * len(title), *self._header(), ""]
        for st in self.steps:
            head = f"{st.tag:<7} {st.label}" + (f" = {st.equation}" if st.equation else "")
            shape = "scalar" if st.value.ndim == 0 else str(tuple(st.value.shape))
            out.append(f"{head}    {shape}")
            out += ["        " + line for line in self._fmt(st.value).splitlines()]
            out.append("")
        return "\n".join(out)

    def markdown(self) -> str:
        """Markdown: one row per step (tag, equation in $…$, value in a code span block)."""
        out = [f"### Numeric walkthrough: {self.flavor}", "", *self._header(), "",
               "| tag | quantity | value |", "|---|---|---|"]
        for st in self.steps:
            eq = f"${st.latex}$" if st.latex else f"`{st.label}`"
            val = self._fmt(st.value).replace("\n", "<br>").replace("|", "\\|")
            out.append(f"| {st.tag} | {eq} | <code>{val}</code> |")
        return "\n".join(out) + "\n"

    def html(self) -> str:
        """An HTML fragment (a table; the report's "Numbers you can follow" section)."""
        rows = []
        for st in self.steps:
            eq = escape(st.label) + (f" = {escape(st.equation)}" if st.equation else "")
            rows.append(f'<tr><td class="tag">{escape(st.tag)}</td><td>{eq}</td>'
                        f"<td><pre>{escape(self._fmt(st.value))}</pre></td></tr>")
        head = "".join(f"<p>{escape(h)}</p>" for h in self._header())
        return (f'<div class="walkthrough">{head}<table><thead><tr><th>tag</th><th>quantity</th>'
                f'<th>value (b = 0, h = 0)</th></tr></thead><tbody>{"".join(rows)}</tbody></table></div>')

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"<Walkthrough {self.flavor}: {len(self.steps)} steps, Lq={self.sizes['Lq']}, Lk={self.sizes['Lk']}>"

    def _repr_html_(self) -> str:
        return self.html()

    def _repr_markdown_(self) -> str:
        return self.markdown()


def _squeeze(v):
    v = np.asarray(v, dtype=np.float64)
    while v.ndim > 2 and v.shape[0] == 1:  # (B=1, H=1, ...) -> one sequence, one head
        v = v[0]
    return v


def numeric_walkthrough(flavor: str = "cross", *, lq: int = 3, lk: int | None = None, head_dim: int = 2,
                        seed: int = 0, digits: int = 4) -> Walkthrough:
    """Every intermediate of a tiny seeded case of ``flavor``, beside its equation tag.

    Cross-attention defaults to Lq = 3 queries and Lk = 4 encoder positions; self and
    causal attention have Lk = Lq.  One head of width ``head_dim`` (E = D), biases, no
    padding; weights drawn as ``init_mha_params`` draws them (Xavier), X, M and G standard
    normal.  Values are float64, printed to ``digits`` decimals."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}; got {flavor!r}")
    for name, v, lo in (("lq", lq, 1), ("head_dim", head_dim, 1), ("seed", seed, 0), ("digits", digits, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}; got {v!r}")
    if lk is None:
        lk = 4 if flavor == "cross" else lq
    if isinstance(lk, bool) or not isinstance(lk, (int, np.integer)) or lk < 1:
        raise ValueError(f"lk must be an integer >= 1; got {lk!r}")
    if flavor != "cross" and lk != lq:
        raise ValueError(f"{flavor} attention reads keys from its own input: lk must equal lq={lq}; got {lk}")
    e = head_dim
    rng = np.random.default_rng(seed)
    params = init_mha_params(e, 1, bias=True, dtype="float64", rng=rng)
    params = {k: v + (0.1 * rng.standard_normal(v.shape) if k.startswith("b_") else 0.0)
              for k, v in params.items()}  # nonzero biases, so that they show
    x = rng.standard_normal((1, lq, e))
    m = rng.standard_normal((1, lk, e)) if flavor == "cross" else None
    g = rng.standard_normal((1, lq, e))
    env = layer_env(flavor, params, x, m, g, num_heads=1)
    cat = catalogue(flavor)
    ev = evaluate_catalogue(cat, env)
    steps = [Step("given", n, cat.symbols[n].txt if n in cat.symbols else n, "", "", _squeeze(env[n]))
             for n in ("X", "M", "W_q", "b_q", "W_k", "b_k", "W_v", "b_v", "W_o", "b_o", "G") if n in env]
    steps.append(Step("", "s", "s", "1/√D", r"s = 1/\sqrt{D}", np.asarray(float(env["s"]))))
    defining = [(f, v) for f, v in ev.results if f.defines and f.lhs.name != "L"]
    for f, v in defining:
        if isinstance(f.rhs, (HeadSlice, Concat)):
            continue  # one head: Q_h = Q, C = O_h, ...
        v = _squeeze(v)
        v = v.reshape(-1) if f.lhs.name == "delta_h" else v  # one per query row
        steps.append(Step(f.tag, f.lhs.name, f.lhs.txt, f.text().split(" = ", 1)[-1], f.latex(), v))
    # the library's own results on the same case
    y, cache = mha_forward(params, x, m, num_heads=1, causal=flavor == "causal")
    grads_in, grads_p = mha_backward(g, cache)
    diff = {"Y": float(np.max(np.abs(y - ev.env["Y"])))}
    diff.update({f"d{k}": float(np.max(np.abs(grads_p[k] - ev.env["d" + k]))) for k in grads_p})
    if flavor == "cross":
        diff["dX"] = float(np.max(np.abs(grads_in["query"] - ev.env["dX"])))
        diff["dM"] = float(np.max(np.abs(grads_in["key"] - ev.env["dM"])))
    else:
        diff["dX"] = float(np.max(np.abs(grads_in["query"] - ev.env["dX"])))
    o, _ = sdpa_forward(ev.env["Q_h"], ev.env["K_h"], ev.env["V_h"], causal=flavor == "causal")
    diff["O_h"] = float(np.max(np.abs(o - ev.env["O_h"])))
    sizes = {"H": 1, "D": head_dim, "E": e, "Lq": lq, "Lk": lk, "seed": seed, "s": float(env["s"])}
    values = {n: _squeeze(a) for n, a in ev.env.items() if isinstance(a, np.ndarray) and n != "mask"}
    values["delta_h"] = values["delta_h"].reshape(-1)
    return Walkthrough(flavor, sizes, steps, diff, digits, values)
