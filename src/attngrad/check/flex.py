"""``attngrad check --score-mod``: a score function's derived gradients, proved.

For a small seeded case (float64), flex_forward / flex_backward's closed form, on the dense
and the tiled path, is compared with

- PyTorch autograd of the same scores: the traced expression evaluated with torch ops
  (:func:`_torch_scores`, an evaluator of its own: no attngrad evaluation code), the mask
  taken from the mask function called on index grids, the softmax and the product in
  plain torch; every gradient, captured tensors included, at max relative error 1e-10;
- central finite differences of the loss along random directions of q, k, v and each
  captured float tensor (eps 1e-6; atol 1e-5, rtol 1e-3, torch.autograd.gradcheck's);
- the function itself: called on the case's arrays, its scores must equal the traced
  expression's (the trace is faithful).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.flex import flex_backward as closed_form_backward
from ..core.flex import forward, make_flex_problem, make_flex_run
from ..scores import FLOAT, Grid, Program, derive, trace_mask, trace_score

REL = 1e-10
FD_EPS, FD_ATOL, FD_RTOL = 1e-6, 1e-5, 1e-3


@dataclass
class FlexCheckReport:
    """The comparisons of one check: rows of (what, path, error, bound, passed)."""

    name: str
    case: str
    rows: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r[4] for r in self.rows)

    def text(self) -> str:
        head = f"attngrad check --score-mod: {self.name}"
        out = [head, "=" * len(head), self.case, "", f"  {'gradient':<16} {'against':<26} {'error':>10} {'bound':>9}  ok"]
        for what, against, err, bound, ok in self.rows:
            out.append(f"  {what:<16} {against:<26} {err:>10.2e} {bound:>9.1e}  {'yes' if ok else 'NO'}")
        out += ["", "all passed" if self.passed else "FAILED", ""]
        return "\n".join(out)

    def to_json(self) -> dict:
        return {"name": self.name, "case": self.case, "passed": self.passed,
                "rows": [{"gradient": w, "against": a, "error": e, "bound": b, "passed": ok}
                         for w, a, e, b, ok in self.rows]}


def check_score_mod(score_mod, mask_mod=None, *, batch=2, heads=2, kv_heads=None, lq=6, lk=None, d=4,
                    seed=0) -> FlexCheckReport:
    """Check a score function's derived gradients (see the module docstring)."""
    import torch

    kv_heads = heads if kv_heads is None else kv_heads
    lk = lq if lk is None else lk
    for name, value in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("lq", lq), ("lk", lk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
    traced = trace_score(score_mod)
    mask = None if mask_mod is None else trace_mask(mask_mod)
    derived = derive(traced)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, lq, d))
    k = rng.standard_normal((batch, kv_heads, lk, d))
    v = rng.standard_normal((batch, kv_heads, lk, d + 1))
    g = rng.standard_normal((batch, heads, lq, d + 1))
    caps = [np.array(_numpy(c.value), dtype=np.float64 if c.kind == FLOAT else None) for c in traced.captured]
    mask_caps = None if mask is None else [np.asarray(_numpy(c.value)) for c in mask.captured]
    report = FlexCheckReport(traced.name, f"B={batch} H={heads} Hkv={kv_heads} Lq={lq} Lk={lk} D={d} float64, seed "
                             f"{seed}, {'mask ' + mask.name if mask else 'no mask'}; L = Σ dO ∘ O, dO random")

    def run(q_, k_, v_, caps_, impl):
        prob = make_flex_problem(q_, k_, v_, traced, mask, captured=caps_, mask_captured=mask_caps)
        tiles = {} if impl == "dense" else {"block_q": 2, "block_k": 3}
        return forward(q_, k_, v_, prob, make_flex_run(impl, **tiles))

    ref_out, ref = _autograd(torch, traced, mask_mod, (q, k, v, g), caps)
    names = ["q", "k", "v", *(c.name for c in traced.captured if c.kind == FLOAT and c.requires_grad)]
    for impl in ("dense", "tiled"):
        out, cache, _ = run(q, k, v, caps, impl)
        grads = closed_form_backward(g, cache)
        report.rows.append(("O", f"torch ({impl})", _rel(out, ref_out), REL, _rel(out, ref_out) <= REL))
        for name in names:
            err = _rel(grads[name], ref[name])
            report.rows.append((f"dL/d{name}", f"autograd ({impl})", err, REL, err <= REL))
    _finite_differences(report, run, (q, k, v, g), caps, traced, grads, rng)
    _faithful(report, score_mod, traced, derived, caps, (batch, heads, lq, lk))
    return report


def _numpy(value):
    detach = getattr(value, "detach", None)
    return value if detach is None else detach().cpu().numpy()


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)) if b.size else 0.0


def _torch_scores(torch, node, leaves: dict, caps: list, memo: dict):
    """The traced expression evaluated with torch ops (autograd through the captured leaves)."""
    if id(node) in memo:
        return memo[id(node)]
    a = [_torch_scores(torch, x, leaves, caps, memo) for x in node.args]
    op = node.op
    table = {
        "add": lambda: a[0] + a[1], "sub": lambda: a[0] - a[1], "mul": lambda: a[0] * a[1], "div": lambda: a[0] / a[1],
        "neg": lambda: -a[0], "pow": lambda: torch.pow(a[0], a[1]), "floordiv": lambda: torch.div(a[0], a[1],
                                                                                               rounding_mode="floor"),
        "mod": lambda: torch.remainder(a[0], a[1]), "abs": lambda: torch.abs(a[0]), "where": lambda: torch.where(*a),
        "maximum": lambda: torch.maximum(a[0], a[1]), "minimum": lambda: torch.minimum(a[0], a[1]),
        "lt": lambda: a[0] < a[1], "le": lambda: a[0] <= a[1], "gt": lambda: a[0] > a[1], "ge": lambda: a[0] >= a[1],
        "eq": lambda: a[0] == a[1], "ne": lambda: a[0] != a[1], "and": lambda: a[0] & a[1], "or": lambda: a[0] | a[1],
        "xor": lambda: a[0] ^ a[1], "not": lambda: ~a[0], "float": lambda: a[0].to(torch.float64),
        "int": lambda: a[0].to(torch.int64), "tanh": lambda: torch.tanh(a[0]), "exp": lambda: torch.exp(a[0]),
        "log": lambda: torch.log(a[0]), "sqrt": lambda: torch.sqrt(a[0]), "rsqrt": lambda: torch.rsqrt(a[0]),
        "sigmoid": lambda: torch.sigmoid(a[0]), "sin": lambda: torch.sin(a[0]), "cos": lambda: torch.cos(a[0]),
        "log1p": lambda: torch.log1p(a[0]), "expm1": lambda: torch.expm1(a[0]), "relu": lambda: torch.relu(a[0]),
        "sign": lambda: torch.sign(a[0]),
    }
    if op == "const":
        out = torch.tensor(float(node.data) if node.kind == FLOAT else node.data,
                           dtype=torch.float64 if node.kind == FLOAT else None)
    elif op == "score":
        out = leaves["score"]
    elif op == "index":
        out = leaves[node.data]
    elif op == "gather":
        out = caps[node.data][tuple(a)] if a else caps[node.data]
    elif op == "clamp":
        lo, hi = node.data
        out = torch.clamp(a[0], None if lo is None else float(lo), None if hi is None else float(hi))
    else:
        out = table[op]()
    memo[id(node)] = out
    return out


def _autograd(torch, traced, mask_mod, arrays, caps):
    q, k, v, g = arrays
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tcaps = [torch.tensor(c, requires_grad=c.dtype == np.float64) for c in caps]
    kk, vv = tk.repeat_interleave(H // Hkv, 1), tv.repeat_interleave(H // Hkv, 1)
    s0 = tq @ kk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    leaves = {"score": s0, "b": torch.arange(B).reshape(B, 1, 1, 1), "h": torch.arange(H).reshape(1, H, 1, 1),
              "q_idx": torch.arange(Lq).reshape(Lq, 1), "kv_idx": torch.arange(Lk).reshape(1, Lk)}
    s = torch.broadcast_to(_torch_scores(torch, traced.expr, leaves, tcaps, {}), s0.shape)
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if mask_mod is not None:
        allowed = allowed & torch.as_tensor(np.asarray(_mask_on_grids(torch, mask_mod, leaves)))
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.where(allowed.any(-1, keepdim=True), torch.softmax(s, -1), torch.zeros(()))
    out = p @ vv
    (out * torch.tensor(g)).sum().backward()
    grads = {"q": tq.grad.numpy(), "k": tk.grad.numpy(), "v": tv.grad.numpy()}
    for cap, t in zip(traced.captured, tcaps, strict=True):
        if t.grad is not None:
            grads[cap.name] = t.grad.numpy()
    return out.detach().numpy(), grads


def _mask_on_grids(torch, mask_mod, leaves):
    """The mask function called on NumPy index arrays, or (a torch-style one) on tensors."""
    idx = [leaves[n] for n in ("b", "h", "q_idx", "kv_idx")]
    return _call(mask_mod, [t.numpy() for t in idx], idx, _torch_style(trace_mask(mask_mod)))


def _torch_style(traced) -> bool:
    return any(hasattr(c.value, "detach") for c in traced.captured)


def _call(fn, arrays: list, tensors: list, torch_first: bool):
    """``fn`` on NumPy arrays or (a function of torch ops: ``torch_first``, or one that
    refuses arrays) on tensors; a NumPy array."""
    for args in ((tensors, arrays) if torch_first else (arrays, tensors)):
        try:
            out = fn(*args)
        except Exception:  # the other style
            continue
        return out.detach().numpy() if hasattr(out, "detach") else np.asarray(out)
    return np.asarray(fn(*arrays))  # (raises the function's own error)


def _finite_differences(report, run, arrays, caps, traced, grads, rng):
    """<dL, u> by central differences against the closed form, along random u."""
    q, k, v, g = arrays

    def loss(q_, k_, v_, caps_):
        return float((run(q_, k_, v_, caps_, "dense")[0] * g).sum())

    float_caps = [i for i, c in enumerate(traced.captured) if c.kind == FLOAT and c.requires_grad]
    for name, i in [("q", None), ("k", None), ("v", None), *((traced.captured[j].name, j) for j in float_caps)]:
        base = {"q": q, "k": k, "v": v}.get(name) if i is None else caps[i]
        u = rng.standard_normal(base.shape)

        def shifted(sign, name=name, i=i, u=u):
            args = {"q": q, "k": k, "v": v}
            cs = list(caps)
            if i is None:
                args[name] = args[name] + sign * FD_EPS * u
            else:
                cs[i] = cs[i] + sign * FD_EPS * u
            return loss(args["q"], args["k"], args["v"], cs)

        fd = (shifted(1) - shifted(-1)) / (2 * FD_EPS)
        closed = float((grads[name] * u).sum())
        err = abs(fd - closed)
        bound = FD_ATOL + FD_RTOL * abs(fd)
        report.rows.append((f"dL/d{name}", "finite differences", err, bound, err <= bound))


def _faithful(report, score_mod, traced, derived, caps, sizes):
    """The function called on arrays equals its traced expression (scores of a grid)."""
    B, H, Lq, Lk = sizes
    rng = np.random.default_rng(1)
    s = rng.standard_normal((B, H, Lq, Lk))
    idx = {"b": np.arange(B).reshape(B, 1, 1, 1), "h": np.arange(H).reshape(1, H, 1, 1),
           "q_idx": np.arange(Lq).reshape(Lq, 1), "kv_idx": np.arange(Lk).reshape(1, Lk)}
    traced_s = np.broadcast_to(Program([traced.expr]).run(Grid(s, idx, tuple(caps), np.dtype(np.float64))).outputs[0],
                               s.shape)
    import torch

    names = ("b", "h", "q_idx", "kv_idx")
    direct = _call(score_mod, [s, *(idx[n] for n in names)], [torch.tensor(s), *(torch.tensor(idx[n]) for n in names)],
                   _torch_style(traced))
    err = _rel(traced_s, np.broadcast_to(direct, s.shape))
    report.rows.append(("S (the trace)", "the function itself", err, 1e-6, err <= 1e-6))
