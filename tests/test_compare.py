"""The comparison helpers of tests/conftest.py on planted differences: each must pass on equal
arrays and fail on a perturbed entry, a NaN or inf in one place, a wrong shape, a missing
gradient; and conftest imports nothing from the library it judges."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from conftest import (
    REL_TOL,
    assert_close_rel,
    assert_gradcheck,
    central_difference,
    directional_check,
    errors,
    gradcheck_close,
)

RNG = np.random.default_rng(0)
REF = {"out": RNG.standard_normal((2, 3, 4)), "q": RNG.standard_normal((2, 3, 5))}


def planted(name: str, how: str) -> dict:
    """A copy of REF with one difference planted in entry ``name``."""
    got = {n: a.copy() for n, a in REF.items()}
    a = got[name]
    if how == "rel":  # just over the tolerance, relative to the case's scale
        a[1, 2, 3] += 3 * REL_TOL * max(np.max(np.abs(r)) for r in REF.values())
    elif how == "nan":
        a[0, 1, 2] = np.nan
    elif how == "inf":
        a[0, 0, 0] = -np.inf
    elif how == "shape":
        got[name] = a[:, :, :-1]
    elif how == "transposed":
        got[name] = np.swapaxes(a, 0, 1)
    elif how == "missing":
        del got[name]
    elif how == "sign":
        got[name] = -a
    return got


def test_conftest_imports_nothing_from_the_library():
    tree = ast.parse(pathlib.Path(__file__).with_name("conftest.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "attngrad"]


def test_assert_close_rel_passes_equal_and_within_tolerance():
    assert_close_rel({n: a.copy() for n, a in REF.items()}, REF)
    got = {n: a + 0.1 * REL_TOL * a for n, a in REF.items()}
    assert_close_rel(got, REF)
    assert_close_rel(dict(REF, extra=np.zeros(3)), REF)  # extra entries in got are fine


@pytest.mark.parametrize("name", sorted(REF))
@pytest.mark.parametrize("how", ["rel", "nan", "inf", "shape", "transposed", "missing", "sign"])
def test_assert_close_rel_fails_on_a_planted_difference(name, how):
    with pytest.raises(AssertionError):
        assert_close_rel(planted(name, how), REF)


def test_assert_close_rel_floors_relative_error_at_the_case_scale():
    # an entry zero in exact arithmetic is measured against 1e-4 x the case's largest value
    ref = {"big": np.array([10.0, -5.0]), "zero": np.zeros(3)}
    assert_close_rel({"big": ref["big"].copy(), "zero": np.full(3, 1e-14)}, ref)
    with pytest.raises(AssertionError):
        assert_close_rel({"big": ref["big"].copy(), "zero": np.full(3, 1e-11)}, ref)


def test_assert_close_rel_rejects_nan_in_the_reference():
    ref = {"out": np.array([1.0, np.nan])}
    with pytest.raises(AssertionError):
        assert_close_rel({"out": np.array([1.0, 2.0])}, ref)


def test_errors():
    assert errors(np.ones(3), np.ones(3)) == (0.0, 0.0)
    assert errors(np.array([1.0, 2.5]), np.array([1.0, 2.0])) == (0.5, 0.25)
    assert errors(np.array([1e-3]), np.array([0.0]), floor=1e-2) == (1e-3, 0.1)
    assert errors(np.array([1e-3]), np.array([0.0]))[1] == np.inf
    assert errors(np.zeros(0), np.zeros(0)) == (0.0, 0.0)
    assert all(np.isnan(errors(np.array([np.nan, 1.0]), np.ones(2))))
    with pytest.raises(ValueError, match="shape"):
        errors(np.ones(3), np.ones(4))


def test_gradcheck_close_and_assert_gradcheck():
    n = np.array([1.0, -2.0, 0.0])
    assert gradcheck_close(n + 5e-6, n)
    assert_gradcheck(n + 5e-6, n)
    for a in (n + np.array([0, 0, 2e-5]), n * (1 + 2e-3), np.array([1.0, np.nan, 0.0])):
        assert not gradcheck_close(a, n)
        with pytest.raises(AssertionError):
            assert_gradcheck(a, n)
    with pytest.raises(AssertionError, match="shape"):
        assert_gradcheck(n[:2], n)


def test_central_difference_and_directional_check():
    x = RNG.standard_normal((2, 3))

    def loss(y):
        return float(np.sum(np.sin(y)) + np.sum(y**3))

    grad = np.cos(x) + 3 * x**2
    x0 = x.copy()
    assert gradcheck_close(central_difference(loss, x), grad)
    assert np.array_equal(x, x0)  # never written into
    directional_check(loss, x, grad, RNG)
    wrong = grad.copy()
    wrong[1, 2] += 1e-2
    with pytest.raises(AssertionError):
        directional_check(loss, x, wrong, np.random.default_rng(1), n_dirs=5)
