"""Shared helpers of the attention tests: random cases, mask kinds as plain data, errors.

Masks are produced here as plain data (bool arrays, lengths, a causal alignment); the
library gets them as arguments and the oracle (tests/oracle.py) builds its own
structure from the same data.  The comparison helpers below import nothing from attngrad
(the library under test); tests/test_compare.py checks that they fail on planted differences.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Hypothesis: no deadline (the first call of a test pays for imports), a moderate number
# of examples so the whole attention suite stays well under a minute on one thread.
settings.register_profile(
    "attngrad", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("attngrad-long", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "attngrad"))


@pytest.fixture(autouse=True)
def _process_state_restored():
    """Process-wide settings a test or an executed docs page may change (NumPy's print
    options and error handling, torch's default dtype and thread count) are put back after
    every test, so that the suite passes in any order (`pytest --random-order`)."""
    torch = sys.modules.get("torch")
    saved = (torch.get_default_dtype(), torch.get_num_threads()) if torch is not None else None
    with np.printoptions(**np.get_printoptions()), np.errstate(**np.geterr()):
        yield
    torch = sys.modules.get("torch")
    if torch is not None and saved is not None:
        if torch.get_default_dtype() != saved[0]:
            torch.set_default_dtype(saved[0])
        if torch.get_num_threads() != saved[1]:
            torch.set_num_threads(saved[1])


REL_TOL = 1e-10  # closed form vs autograd / the reference, float64
REL_FLOOR = 1e-4  # relative errors are floored at this fraction of the case's largest value
EPS, ATOL, RTOL = 1e-6, 1e-5, 1e-3  # central differences; torch.autograd.gradcheck's criterion

# Mask kinds of the parametrised grids: "+" combines parts by AND.
MASK_KINDS = (
    "none",
    "bool",
    "bool_bcast",
    "bool_rows",
    "key_lengths",
    "key_mask",
    "causal_top_left",
    "causal_bottom_right",
    "bool+key_lengths",
    "key_mask+causal_top_left",
    "key_lengths+causal_bottom_right",
    "bool+key_mask+causal_bottom_right",
    "bool_bcast+causal_top_left",
)


def mask_data(kind: str, rng: np.random.Generator, batch: int, heads: int, lq: int, lk: int) -> dict:
    """Keyword arguments of one mask kind as plain data (see MASK_KINDS).

    Random masks come with rows that have nothing to attend: the first (b, h) row of a
    full bool mask, the last batch element's keys for key padding.
    """
    out = {}
    for part in kind.split("+"):
        if part == "none":
            continue
        if part == "bool":  # full (B, H, Lq, Lk)
            m = rng.random((batch, heads, lq, lk)) < 0.6
            if m.size:
                m[0, 0, 0, :] = False
            out["mask"] = m
        elif part == "bool_bcast":  # (1, Lq, Lk): broadcast over batch and heads
            out["mask"] = rng.random((1, lq, lk)) < 0.7
        elif part == "bool_rows":  # (B, 1, Lq, 1): whole query rows on or off
            m = rng.random((batch, 1, lq, 1)) < 0.7
            if m.size:
                m[0, 0, 0, 0] = False
            out["mask"] = m
        elif part == "key_lengths":  # full, partial, ..., empty
            lengths = rng.integers(1, lk + 1, size=batch)
            if batch:
                lengths[0] = lk
                lengths[-1] = 0
            out["key_lengths"] = lengths
        elif part == "key_mask":
            km = rng.random((batch, lk)) < 0.6
            if batch:
                km[-1] = False
            out["key_mask"] = km
        elif part.startswith("causal_"):
            out["causal"] = part.removeprefix("causal_")
        else:
            raise ValueError(f"unknown mask kind {part!r}")
    return out


def bias_array(kind, rng: np.random.Generator, batch: int, heads: int, lq: int, lk: int):
    """None, a full (B, H, Lq, Lk) additive bias, or one broadcast along B and Lq: (H, 1, Lk)."""
    if kind is None:
        return None
    if kind == "full":
        return rng.standard_normal((batch, heads, lq, lk))
    if kind == "bcast":
        return rng.standard_normal((heads, 1, lk))
    raise ValueError(f"unknown bias kind {kind!r}")


def attention_inputs(rng, batch, heads, kv_heads, lq, lk, d, dv, dtype=np.float64) -> dict:
    """Random q, k, v and an upstream gradient dout (never all ones)."""
    return {
        "q": rng.standard_normal((batch, heads, lq, d)).astype(dtype),
        "k": rng.standard_normal((batch, kv_heads, lk, d)).astype(dtype),
        "v": rng.standard_normal((batch, kv_heads, lk, dv)).astype(dtype),
        "dout": rng.standard_normal((batch, heads, lq, dv)).astype(dtype),
    }


def errors(got, ref, floor: float = 0.0) -> tuple[float, float]:
    """(max abs err, max rel err) with rel = max|a - r| / max(max|r|, floor) (0 for empty arrays).

    A NaN anywhere in either array gives NaN errors (which fail every ``<=`` test).
    """
    a, r = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if a.shape != r.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {r.shape}")
    if a.size == 0:
        return 0.0, 0.0
    diff = np.abs(a - r)
    abs_err = float("nan") if np.isnan(diff).any() else float(np.max(diff))
    scale = max(float(np.max(np.abs(r))), floor)
    if scale > 0:
        return abs_err, abs_err / scale
    return abs_err, (0.0 if abs_err == 0 else float("inf"))


def gradcheck_close(analytic, numeric, atol: float = ATOL, rtol: float = RTOL) -> bool:
    """torch.autograd.gradcheck's elementwise criterion |a - n| <= atol + rtol |n| (NaN fails)."""
    a, n = np.asarray(analytic, dtype=np.float64), np.asarray(numeric, dtype=np.float64)
    return bool(np.all(np.abs(a - n) <= atol + rtol * np.abs(n)))


def central_difference(loss, x, eps: float = EPS) -> np.ndarray:
    """Numerical gradient of a scalar ``loss`` at ``x`` (float64), one element at a time;
    ``x`` itself is never written into."""
    x = np.array(x, dtype=np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[idx] = eps
        grad[idx] = (loss(x + step) - loss(x - step)) / (2 * eps)
    return grad


def assert_close_rel(got: dict, ref: dict, tol: float = REL_TOL, what: str = "") -> None:
    """Every entry of ``ref`` matches ``got``: max|a - r| / max(max|r|, 1e-4 S) <= tol.

    S is the largest |value| over all of ``ref`` (attngrad check's floor: a gradient that is
    zero in exact arithmetic, such as dL/db_k, is measured against the case's scale).
    """
    scale = max((float(np.max(np.abs(r))) for r in ref.values() if np.size(r)), default=0.0)
    assert set(got) >= set(ref), f"{what}: missing {sorted(set(ref) - set(got))}"
    for name, r in ref.items():
        a = np.asarray(got[name])
        assert a.shape == np.shape(r), f"{what}{name}: shape {a.shape} != {np.shape(r)}"
        assert np.all(np.isfinite(a)), f"{what}{name}: not finite"
        abs_err, rel = errors(a, r, REL_FLOOR * scale)
        assert rel <= tol, f"{what}{name}: max rel err {rel:.3e} > {tol:g} (max abs err {abs_err:.3e})"


def assert_gradcheck(analytic, numeric, what: str = "") -> None:
    """torch.autograd.gradcheck's criterion |a - n| <= atol + rtol |n| (atol 1e-5, rtol 1e-3)."""
    a, n = np.asarray(analytic, dtype=np.float64), np.asarray(numeric, dtype=np.float64)
    assert a.shape == n.shape, f"{what}: shape {a.shape} != {n.shape}"
    worst = float(np.max(np.abs(a - n) - (ATOL + RTOL * np.abs(n)), initial=-np.inf))
    assert gradcheck_close(a, n), f"{what}: gradcheck criterion exceeded by {worst:.3e}"


def directional_check(loss, x: np.ndarray, grad: np.ndarray, rng, n_dirs: int = 3, what: str = ""):
    """<grad, u> against the central difference (L(x + eps u) - L(x - eps u)) / 2 eps.

    Random unit directions u (gradcheck's fast mode, JAX's check_vjp): cheap for large x.
    """
    x = np.array(x, dtype=np.float64)
    for _ in range(n_dirs):
        u = rng.standard_normal(x.shape)
        u /= max(np.linalg.norm(u), 1e-300)
        numeric = (loss(x + EPS * u) - loss(x - EPS * u)) / (2 * EPS)
        analytic = float(np.sum(np.asarray(grad, dtype=np.float64) * u))
        assert_gradcheck(analytic, numeric, what)
