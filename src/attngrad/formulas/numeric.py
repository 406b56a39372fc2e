"""Numbers you can follow: every intermediate of one case, beside its equation tag.

``numeric_walkthrough(flavor)`` builds a seeded case small enough to check by hand
(default cross-attention, Lq = 3 queries, Lk = 4 keys, one head of width D = 2, biases);
``numeric_walkthrough(x=..., m=..., params=...)`` takes yours instead (any B, H, E; the
arrays of ``mha_forward``; ``attngrad derive --numeric --inputs case.npz`` reads them from a
file, :data:`NPZ_KEYS`).  Either way it evaluates the flavor's formula trees on the case
(the very trees ``attngrad derive`` prints and the tests evaluate) and keeps each value in
data-flow order: the inputs, Q, K, V, S, P, O, Y, then dY, dW^O, dC, dV, dP, δ, the
softmax Jacobian J (S1) and J·dP (S2) beside dS (A7) with the line that shows they agree,
dQ, dK, dW^Q, db^Q, …, dX (and dM).  The same case is run through the library's own
``mha_forward`` / ``mha_backward`` and ``sdpa_forward``, and the walkthrough says how far
apart they are (round-off: ~1e-16).

``attngrad derive --numeric`` prints it (text, markdown or LaTeX); ``attngrad report``
shows it as a section; in a notebook the object displays itself (``_repr_html_``,
``_repr_markdown_``).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..core import sdpa_forward
from ..layers import init_mha_params, mha_backward, mha_forward
from ..layers.mha_params import BIASES, WEIGHTS, check_params
from . import numeric_render as R
from .catalogue import FLAVORS, catalogue, evaluate_catalogue, layer_env
from .expr import Concat, HeadSlice

# the arrays of ``derive --numeric --inputs case.npz``: key -> what it holds
NPZ_KEYS = {
    "X": "the layer input (queries; keys and values too unless cross), (B, Lq, E) or (Lq, E)",
    "M": "the encoder output, cross-attention only, (B, Lk, Em) or (Lk, Em)",
    "W_q": "the query projection, (E, H·D)", "W_k": "the key projection, (E or Em, H·D)",
    "W_v": "the value projection, (E or Em, H·Dv)", "W_o": "the output projection, (H·Dv, E_out)",
    "b_q": "the bias of W^Q, (H·D,); 0 if absent", "b_k": "the bias of W^K, (H·D,); 0 if absent",
    "b_v": "the bias of W^V, (H·Dv,); 0 if absent", "b_o": "the bias of W^O, (E_out,); 0 if absent",
    "G": "the upstream gradient dL/dY, Y's shape; drawn from --seed if absent",
    "key_lengths": "integers (B,): keys j < key_lengths[b] are real (key padding); none if absent",
    "num_heads": "the number of heads H, one integer; 1 if absent",
}
REQUIRED_KEYS = ("X", *WEIGHTS)
ROUNDOFF_REL = 1e-11  # |a| <= this × the case's largest value: 0 in exact arithmetic (e.g. dL/db^K)


def zero_up_to_roundoff(a, scale: float) -> bool:
    """Whether ``a`` is 0 up to float64 round-off, though not exactly 0: its entries are at
    most ROUNDOFF_REL × ``scale`` (the case's largest value) and one is nonzero.  dL/db^K is
    such a tensor: every row of dS sums to 0, so db^K = 0 in exact arithmetic (M7)."""
    a = np.asarray(a, dtype=np.float64)
    top = float(np.max(np.abs(a))) if a.size else 0.0
    return 0.0 < top <= ROUNDOFF_REL * scale


class Step(NamedTuple):
    """One line of the walkthrough: ``tag`` (e.g. "(A7)", "given"), the quantity's name
    (catalogue symbol, e.g. "dS_h"), its printed name ("dS_h"), the equation as text and
    LaTeX (empty for an input), its value, ``axes``: the names of its leading axes that
    the value keeps ("b" where B > 1, "h" where H > 1, "i" for J's rows), and ``kind``:
    "value", or "agree" for a line that says two formulas give the same numbers (its
    value the largest difference)."""

    tag: str
    name: str
    label: str
    equation: str
    latex: str
    value: np.ndarray
    axes: tuple = ()
    kind: str = "value"


class Walkthrough:
    """The numeric walkthrough of one case (see :func:`numeric_walkthrough`).

    ``steps``: the :class:`Step` list, in data-flow order; ``values``: name -> array (every
    quantity evaluated, Q_h and dO_h too, with the batch axis dropped where B = 1 and the
    head axis where H = 1: one sequence and one head give plain matrices);
    ``library_max_abs_diff``: name -> max |formula − library| for the forward output, P and
    every gradient (``mha_forward``/``mha_backward``/``sdpa_forward``); ``sizes``: B, H,
    D, Dv, E, Lq, Lk, s, seed, key_lengths and ``given`` (your arrays, or the seeded case)."""

    def __init__(self, flavor, sizes, steps, library_max_abs_diff, digits, values=None):
        self.flavor = flavor
        self.sizes = sizes
        self.steps = steps
        self.values = {**(values or {}), **{s.name: s.value for s in steps if s.kind == "value"}}
        self.library_max_abs_diff = library_max_abs_diff
        self.digits = digits

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def text(self) -> str:
        """The walkthrough as plain text (what ``attngrad derive --numeric`` prints)."""
        return R.text(self)

    def markdown(self) -> str:
        """Markdown: one row per step (tag, equation in $…$, value in a code span block)."""
        return R.markdown(self)

    def html(self) -> str:
        """An HTML fragment (a table; the report's "Numbers you can follow" section)."""
        return R.html(self)

    def latex(self, standalone: bool = True) -> str:
        """LaTeX: each step's equation with its tag and its value as matrices (split by
        columns where wider than the page); a whole document unless ``standalone=False``."""
        return R.latex(self, standalone)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        s = self.sizes
        return f"<Walkthrough {self.flavor}: {len(self.steps)} steps, B={s['B']}, H={s['H']}, Lq={s['Lq']}, Lk={s['Lk']}>"

    def _repr_html_(self) -> str:
        return self.html()

    def _repr_markdown_(self) -> str:
        return self.markdown()


def _integer(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}; got {v!r}")
    return int(v)


def _array(name: str, v, ndims=(2, 3)) -> np.ndarray:
    """A finite float64 copy of ``v`` with a batch axis (B, L, F) where ``ndims`` allows 2-D."""
    try:
        a = np.array(v, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be an array of real numbers; got {type(v).__name__} ({exc})") from None
    if a.ndim not in ndims:
        want = " or ".join(f"{d}-D" for d in ndims)
        raise ValueError(f"{name} must be {want}; got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite; it holds {int(np.sum(~np.isfinite(a)))} NaN or infinite entries")
    return a[None] if a.ndim == 2 and 3 in ndims else a


def _seeded_case(flavor, lq, lk, head_dim, seed):
    lq = _integer("lq", 3 if lq is None else lq, 1)
    head_dim = _integer("head_dim", 2 if head_dim is None else head_dim, 1)
    if lk is None:
        lk = 4 if flavor == "cross" else lq
    lk = _integer("lk", lk, 1)
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
    return params, x, m, g


def _given_case(flavor, x, m, params, g, num_heads, seed):
    x = _array("x", x)
    if flavor == "cross" and m is None:
        raise ValueError("flavor 'cross' needs m, the encoder output (B, Lk, Em): key M of an --inputs file")
    if flavor != "cross" and m is not None:
        raise ValueError(f"m is the encoder output of cross-attention; flavor {flavor!r} reads its keys from x")
    m = None if m is None else _array("m", m)
    if not hasattr(params, "keys"):
        raise ValueError(f"params must be a mapping of arrays (W_q, W_k, W_v, W_o, b_q, …); got {type(params).__name__}")
    unknown = sorted(set(params) - set(WEIGHTS) - set(BIASES))
    if unknown:
        raise ValueError(f"params has keys the walkthrough does not know: {unknown}; expected some of "
                         f"{[*WEIGHTS, *BIASES]} (the plain layer: no QK-norm, gate or variants)")
    missing = [w for w in WEIGHTS if w not in params]
    if missing:
        raise ValueError(f"params is missing {missing}; the walkthrough needs {list(WEIGHTS)}")
    p = {k: _array(f"params[{k!r}]", params[k], (2,) if k in WEIGHTS else (1,)) for k in params}
    check_params(p, num_heads)
    zero_biases = [b for b in BIASES if b not in p]
    for b, w, axis in zip(BIASES, WEIGHTS, (1, 1, 1, 1), strict=True):
        p.setdefault(b, np.zeros(p[w].shape[axis]))
    y_shape = (x.shape[0], x.shape[1], p["W_o"].shape[1])
    if g is None:
        g = np.random.default_rng(seed).standard_normal(y_shape)
    else:
        g = _array("g", g)
        if g.shape != y_shape:
            raise ValueError(f"g (the upstream gradient dL/dY) must have Y's shape {y_shape}; got {g.shape}")
    return p, x, m, g, zero_biases


def numeric_walkthrough(flavor: str | None = None, *, x=None, m=None, params=None, g=None, num_heads: int = 1,
                        key_lengths=None, lq: int | None = None, lk: int | None = None,
                        head_dim: int | None = None, seed: int = 0, digits: int = 4) -> Walkthrough:
    """Every intermediate of one case of ``flavor``, beside its equation tag.

    The seeded case (no ``x``): cross-attention by default, Lq = ``lq`` = 3 queries and
    Lk = ``lk`` = 4 encoder positions (self and causal attention have Lk = Lq); one head of
    width ``head_dim`` = 2 (E = D), biases, no padding; weights drawn as ``init_mha_params``
    draws them (Xavier), X, M and G standard normal, from ``seed``.

    Your case: ``x`` (B, Lq, E) or (Lq, E), ``m`` (B, Lk, Em) for cross-attention (the
    default flavor when ``m`` is given, else self), ``params`` with W_q, W_k, W_v, W_o and
    any of b_q, b_k, b_v, b_o (0 where absent) as ``mha_forward`` takes them,
    ``num_heads``, ``key_lengths`` (B,) for key padding, and ``g`` = dL/dY of Y's shape
    (drawn standard normal from ``seed`` when None).  Values are float64, printed to
    ``digits`` decimals."""
    own = x is not None or params is not None
    g_given = g is not None
    if flavor is None:
        flavor = ("cross" if m is not None else "self") if own else "cross"
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}; got {flavor!r}")
    seed, digits = _integer("seed", seed, 0), _integer("digits", digits, 1)
    num_heads = _integer("num_heads", num_heads, 1)
    if own:
        if x is None or params is None:
            raise ValueError(f"your own case needs both x and params; got only {'x' if params is None else 'params'}")
        sized = [n for n, v in (("lq", lq), ("lk", lk), ("head_dim", head_dim)) if v is not None]
        if sized:
            raise ValueError(f"{', '.join(sized)} size the seeded case; your x and params have sizes of their own")
        params, x, m, g, zero_biases = _given_case(flavor, x, m, params, g, num_heads, seed)
    else:
        for name, v in (("m", m), ("g", g), ("key_lengths", key_lengths)):
            if v is not None:
                raise ValueError(f"{name} goes with your own x and params; the seeded case draws its own")
        if num_heads != 1:
            raise ValueError(f"the seeded case has one head; num_heads={num_heads} goes with your own x and params")
        params, x, m, g = _seeded_case(flavor, lq, lk, head_dim, seed)
        zero_biases = []
    causal = flavor == "causal"
    # the library first: its checks name a bad shape or key length before any formula runs
    y, cache = mha_forward(params, x, m, num_heads=num_heads, causal=causal, key_lengths=key_lengths)
    grads_in, grads_p = mha_backward(g, cache)
    kl = None if key_lengths is None else np.asarray(key_lengths)
    env = layer_env(flavor, params, x, m, g, num_heads=num_heads, key_lengths=kl)
    cat = catalogue(flavor)
    ev = evaluate_catalogue(cat, env)
    B = x.shape[0]
    H = num_heads
    steps = _steps(cat, ev, env, B, H, params)
    diff = {"Y": float(np.max(np.abs(y - ev.env["Y"])))}
    diff.update({f"d{k}": float(np.max(np.abs(grads_p[k] - ev.env["d" + k]))) for k in grads_p})
    diff["dX"] = float(np.max(np.abs(grads_in["query"] - ev.env["dX"])))
    if flavor == "cross":
        diff["dM"] = float(np.max(np.abs(grads_in["key"] - ev.env["dM"])))
    o, _ = sdpa_forward(ev.env["Q_h"], ev.env["K_h"], ev.env["V_h"], causal=causal, key_lengths=kl)
    diff["O_h"] = float(np.max(np.abs(o - ev.env["O_h"])))
    D = params["W_q"].shape[1] // H
    sizes = {"B": B, "H": H, "D": D, "Dv": params["W_v"].shape[1] // H, "E": x.shape[2],
             "Lq": x.shape[1], "Lk": (m if m is not None else x).shape[1], "seed": seed, "s": float(env["s"]),
             "key_lengths": None if kl is None else [int(v) for v in kl], "given": own,
             "zero_biases": zero_biases, "g_given": g_given}
    values = {n: _squeeze(n, a, B, H, params) for n, a in ev.env.items() if isinstance(a, np.ndarray) and n != "mask"}
    return Walkthrough(flavor, sizes, steps, diff, digits, values)


def _squeeze(name: str, v, B: int, H: int, params) -> np.ndarray:
    """Drop the batch axis where B = 1 and the head axis of a per-head quantity where H = 1."""
    v = np.asarray(v, dtype=np.float64)
    if name in params or name[1:] in params or v.ndim == 0:  # weights and their gradients: no batch axis
        return v
    if B == 1:
        v = v[0]
    if name.endswith("_h") and H == 1:
        v = v[0]
    return v


def _axes(name: str, B: int, H: int, params) -> tuple:
    if name in params or name[1:] in params or name == "s":
        return ()
    axes = ("b",) if B > 1 else ()
    axes += ("h",) if name.endswith("_h") and H > 1 else ()
    return axes + (("i",) if name == "J_h" else ())


def _steps(cat, ev, env, B, H, params) -> list:
    """The walkthrough's steps in data-flow order: the inputs, the forward, the backward
    with the softmax Jacobian (S1), J·dP (S2) and their agreement beside (A7)."""

    def step(tag, name, label, equation, latex, value):
        return Step(tag, name, label, equation, latex, _squeeze(name, value, B, H, params),
                    _axes(name, B, H, params))

    steps = [step("given", n, cat.symbols[n].txt if n in cat.symbols else n, "", "", env[n])
             for n in ("X", "M", "W_q", "b_q", "W_k", "b_k", "W_v", "b_v", "W_o", "b_o", "G") if n in env]
    steps.append(Step("", "s", "s", "1/√D", r"s = 1/\sqrt{D}", np.asarray(float(env["s"]))))
    value = {id(f): v for f, v in ev.results}
    by_key = {sec.key: sec.formulas for sec in cat.sections}
    softmax = {f.tag: f for f in by_key["softmax"]}

    def add(f):
        if isinstance(f.rhs, HeadSlice) or (isinstance(f.rhs, Concat) and H == 1):
            return  # head h's columns of Q, K, V, dC; with one head C = O_h, dQ = dQ_h, ...
        steps.append(step(f.tag, f.lhs.name, f.lhs.txt, f.text().split(" = ", 1)[-1], f.latex(), value[id(f)]))

    for f in by_key["forward"]:
        if f.defines and f.lhs.name != "L":
            add(f)
    for f in by_key["backward"]:
        if f.tag == "(A7)":  # the softmax's Jacobian, applied to dP, beside its reduced form
            add(softmax["(S1)"])
            add(softmax["(S2)"])
            add(f)
            gap = float(np.max(np.abs(value[id(softmax["(S2)"])] - value[id(f)]))) if value[id(f)].size else 0.0
            steps.append(Step("(S2)=(A7)", "S2_A7", "max |J·dP − P ∘ (dP − δ 1ᵀ)|",
                              "J·dP (S2) equals P ∘ (dP − δ 1ᵀ) (A7) up to round-off",
                              r"\max \left| J\,dP - P \odot (dP - \delta \mathbf{1}^{\top}) \right|",
                              np.asarray(gap), (), "agree"))
        elif f.defines:
            add(f)
    return steps


def load_case(path) -> dict:
    """The keyword arguments of :func:`numeric_walkthrough` stored in an ``.npz`` file
    (``numpy.savez``; keys :data:`NPZ_KEYS`): x, m, params, g, key_lengths, num_heads.
    A missing or unknown key is a ValueError naming it and the keys expected."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--inputs: no such file: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.array(z[k]) for k in z.files}
    except (OSError, ValueError) as exc:
        raise ValueError(f"--inputs: {path} is not a readable .npz file ({exc})") from None
    unknown = sorted(set(arrays) - set(NPZ_KEYS))
    if unknown:
        raise ValueError(f"{path.name}: unknown key {unknown[0]!r}; expected some of {', '.join(NPZ_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in arrays]
    if missing:
        raise ValueError(f"{path.name}: no key {missing[0]!r} ({NPZ_KEYS[missing[0]]}); "
                         f"a walkthrough needs {', '.join(REQUIRED_KEYS)}")
    case = {"x": arrays["X"], "m": arrays.get("M"), "g": arrays.get("G"),
            "params": {k: arrays[k] for k in (*WEIGHTS, *BIASES) if k in arrays}}
    if "key_lengths" in arrays:
        kl = arrays["key_lengths"]
        if kl.dtype.kind not in "iu":
            raise ValueError(f"{path.name}: key_lengths must be integers; got dtype {kl.dtype}")
        case["key_lengths"] = kl
    if "num_heads" in arrays:
        h = arrays["num_heads"]
        if h.shape != () or h.dtype.kind not in "iu":
            raise ValueError(f"{path.name}: num_heads must be one integer (a 0-d array); got {h!r}")
        case["num_heads"] = int(h)
    return case
