"""Every formula `attngrad derive` prints, evaluated: == mha_backward == torch autograd.

The catalogue's expression trees are evaluated in NumPy (float64) for each flavor and
compared, quantity by quantity, with the library's closed-form gradients and with PyTorch
autograd on the independent reference of tests/reference.py (rel <= 1e-10).  Formulas
that restate a quantity (softmax Jacobian, index form) must equal the defining one.
"""

from __future__ import annotations

import numpy as np
import pytest

from attngrad import init_mha_params, mha_backward, mha_forward
from attngrad.formulas import FLAVORS, catalogue, derive_document, evaluate_catalogue, layer_env
from attngrad.formulas.expr import Einsum, Sym
from conftest import assert_close_rel
from oracle import allowed_structure, torch_mha

torch = pytest.importorskip("torch")

B, H, E, LQ, LK = 3, 2, 6, 4, 5
PARAM_GRADS = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o")


def _case(flavor: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = init_mha_params(E, H, rng=rng)
    x = rng.standard_normal((B, LQ, E))
    m = rng.standard_normal((B, LK, E)) if flavor == "cross" else None
    lk = LK if flavor == "cross" else LQ
    key_lengths = None if flavor == "causal" else np.array([lk, 2, 0][:B])  # full, partial, empty
    g = rng.standard_normal((B, LQ, E))  # random upstream gradient, never all ones
    return params, x, m, key_lengths, g


def _evaluate(flavor: str, seed: int = 0):
    params, x, m, key_lengths, g = _case(flavor, seed)
    env = layer_env(flavor, params, x, m, g, num_heads=H, key_lengths=key_lengths)
    return evaluate_catalogue(catalogue(flavor), env), (params, x, m, key_lengths, g)


def _torch_grads(flavor, params, x, m, key_lengths, g):
    lk = LK if flavor == "cross" else LQ
    allowed = allowed_structure(B, H, LQ, lk, key_lengths=key_lengths,
                                causal="top_left" if flavor == "causal" else None)
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    tx = torch.tensor(x, requires_grad=True)
    tm = torch.tensor(m, requires_grad=True) if m is not None else tx
    y = torch_mha(leaves, tx, tm, tm, num_heads=H, num_kv_heads=H, allowed=allowed)
    (y * torch.tensor(g)).sum().backward()
    out = {"d" + n: t.grad.numpy() for n, t in leaves.items()}
    out["dX"] = tx.grad.numpy()
    if m is not None:
        out["dM"] = tm.grad.numpy()
    return y.detach().numpy(), out


@pytest.mark.parametrize("flavor", FLAVORS)
def test_formulas_equal_library_and_autograd(flavor):
    ev, (params, x, m, key_lengths, g) = _evaluate(flavor)
    kw = {"causal": True} if flavor == "causal" else {"key_lengths": key_lengths}
    _, cache = mha_forward(params, x, m, num_heads=H, **kw)
    inputs, pgrads = mha_backward(g, cache)
    lib = {"d" + n: pgrads[n] for n in PARAM_GRADS}
    lib["dX"] = inputs["query"]
    if flavor == "cross":
        lib["dM"] = inputs["key"]
    y_t, ref = _torch_grads(flavor, params, x, m, key_lengths, g)
    formula = {n: ev.env[n] for n in ref}
    assert_close_rel({"Y": ev.env["Y"]}, {"Y": y_t}, what=f"{flavor} forward ")
    assert_close_rel(formula, ref, what=f"{flavor} formula vs torch: ")
    assert_close_rel(formula, lib, what=f"{flavor} formula vs library: ")
    assert np.isclose(ev.env["L"], np.sum(g * y_t), rtol=1e-12)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_per_head_formulas_equal_autograd(flavor):
    """dQ_h, dK_h, dV_h, dS_h, dP_h, dO_h from the formulas == autograd on retained tensors."""
    ev, (params, _, _, _, g) = _evaluate(flavor, seed=1)
    env = ev.env
    leaves = {n: torch.tensor(env[n], requires_grad=True) for n in ("Q_h", "K_h", "V_h")}
    s = env["s"] * leaves["Q_h"] @ leaves["K_h"].transpose(-1, -2)
    s.retain_grad()
    allowed = torch.as_tensor(np.array(np.broadcast_to(env["mask"], s.shape)))
    rows = allowed.any(-1, keepdim=True)
    p = torch.softmax(torch.where(allowed, s, torch.where(rows, -torch.inf, 0.0).to(s.dtype)), -1) * rows
    p.retain_grad()
    o = p @ leaves["V_h"]
    o.retain_grad()
    c = o.transpose(1, 2).reshape(B, LQ, -1)
    y = c @ torch.tensor(params["W_o"]) + torch.tensor(params["b_o"])
    (y * torch.tensor(g)).sum().backward()
    ref = {"dQ_h": leaves["Q_h"].grad, "dK_h": leaves["K_h"].grad, "dV_h": leaves["V_h"].grad,
           "dS_h": s.grad, "dP_h": p.grad, "dO_h": o.grad}
    ref = {n: t.numpy() for n, t in ref.items()}
    assert_close_rel({n: env[n] for n in ref}, ref, what=f"{flavor} per head: ")


@pytest.mark.parametrize("flavor", FLAVORS)
def test_restatements_equal_defining_formula(flavor):
    """(S2), (S3) and the index form give the same numbers as the matrix formulas."""
    ev, _ = _evaluate(flavor, seed=2)
    restated = [(f, v) for f, v in ev.results if not f.defines]
    assert len(restated) >= 10
    for f, v in restated:
        ref = ev.env[f.lhs.name]
        assert v.size == ref.size, f"{f.tag} {f.text()}"
        assert_close_rel({"x": np.reshape(v, ref.shape)}, {"x": ref}, what=f"{flavor} {f.tag} {f.text()}: ")


def test_softmax_jacobian_is_the_derivative():
    """(S1) J_i = diag(p) − p pᵀ equals torch's Jacobian of the (masked) row softmax."""
    ev, _ = _evaluate("causal", seed=3)
    s, mask, J = ev.env["S_h"], ev.env["mask"], ev.env["J_h"]
    allowed = torch.as_tensor(np.array(np.broadcast_to(mask, s.shape)))

    def sm(t):
        return torch.softmax(torch.where(allowed, t, -torch.inf), -1)

    jac = torch.func.jacrev(sm)(torch.tensor(s)).numpy()  # (B, H, Lq, Lk, B, H, Lq, Lk)
    b, h, lq, lk = s.shape
    diag = np.einsum("bhikbhij->bhikj", jac.reshape(b, h, lq, lk, b, h, lq, lk))
    assert_close_rel({"J": J}, {"J": diag}, what="(S1) ")


def test_every_printed_formula_is_evaluated_and_every_symbol_defined():
    for flavor in FLAVORS:
        cat = catalogue(flavor)
        ev, _ = _evaluate(flavor)
        evaluated = {(f.tag, f.text()) for f, _ in ev.results}
        text = derive_document(flavor, "text")
        table = text.split("Notation")[0]
        for sec in cat.sections:
            for f in sec.formulas:
                assert (f.tag, f.text()) in evaluated
                assert f.text() in text, f"{flavor}: {f.text()} not printed"
                for sym in f.symbols():
                    assert sym.meaning and sym.shape, sym.name
                    assert f"  {sym.txt} " in table, f"{flavor}: {sym.txt} used but not defined"


def test_rendering_of_small_trees():
    a = Sym("A", "A", "A", "a", "(n, n)")
    b = Sym("B", "B^{Q}", "B^Q", "b", "(n, n)")
    assert (a @ (a + b).T).text() == "A (A + B^Q)ᵀ"
    assert (a @ (a + b).T).latex() == r"A\, {\left(A + B^{Q}\right)}^{\top}"
    assert (a - (a - b)).text() == "A − (A − B^Q)"
    e = Einsum("ij", [(a, "ik"), (b, "kj")])
    assert e.text() == "Σ_k A[i,k] B^Q[k,j]"
    env = {"A": np.arange(4.0).reshape(2, 2), "B": np.eye(2) * 3}
    np.testing.assert_array_equal(e.evaluate(env), env["A"] @ env["B"])


def test_layer_env_rejects_bad_arguments():
    params, x, m, _, g = _case("cross")
    with pytest.raises(ValueError, match="flavor"):
        layer_env("decoder", params, x, m, g, num_heads=H)
    with pytest.raises(ValueError, match="encoder output"):
        layer_env("self", params, x, m, g, num_heads=H)
    with pytest.raises(ValueError, match="flavor"):
        catalogue("bidirectional")
