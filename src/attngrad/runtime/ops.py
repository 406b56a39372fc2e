"""Shape plumbing the layers share: heads and projections, each written once.

    split_heads   (..., B, L, heads*D) -> (..., B, heads, L, D): head h takes columns h*D ... (M1)
    merge_heads   (..., B, heads, L, D) -> (..., B, L, heads*D), their concatenation        (M3)
    project       Y = X W + b, X (..., in), as one 2-D GEMM                          (F1) (M1) (M4)
    weight_grad   dW = X^T dY summed over every leading axis                         (F2) (M5) (M7)
    matmul        op(A) op(B) for 2-D arrays; pool=True: large NumPy ones on the tiled path's workers
    matmuls       several of them at once (one hand-out to those workers)

Used by the attention layer (``layers/mha.py``), the affine layer (``layers/linear.py``), the
closed-form JVPs/HVPs (``jacobian/``) and the formula catalogue (``formulas/expr.py``).
Every function works in the namespace of the arrays it is given (NumPy, or PyTorch
tensors through array-api-compat).  The attention core does not import this module.
"""

from __future__ import annotations

import math

import numpy as np

from . import fused, products
from ._xp import Array

_SUMMED = (np.dtype(np.float32), np.dtype(np.float64))  # the dtypes fused.column_sums takes


def _shape_ops(xp, x):
    """(reshape, permute_dims) for ``x``: the ndarray methods for a NumPy array (the
    np.reshape / np.permute_dims wrappers cost ~1 us a call, most of a small layer's
    plumbing), else the namespace's functions."""
    if type(x) is np.ndarray:
        return np.ndarray.reshape, np.ndarray.transpose
    return xp.reshape, xp.permute_dims


def split_heads(xp, x: Array, heads: int) -> Array:
    """(..., B, L, heads*D) -> (..., B, heads, L, D)."""
    reshape, permute_dims = _shape_ops(xp, x)
    *lead, n_l, hd = x.shape
    y = reshape(x, (*lead, n_l, heads, hd // heads))  # (..., B, L, heads, D)
    n = len(lead)
    return permute_dims(y, (*range(n), n + 1, n, n + 2))  # (..., B, heads, L, D)


def merge_heads(xp, x: Array) -> Array:
    """(..., B, heads, L, D) -> (..., B, L, heads*D)."""
    reshape, permute_dims = _shape_ops(xp, x)
    *lead, h, n_l, d = x.shape
    n = len(lead)
    y = permute_dims(x, (*range(n), n + 1, n, n + 2))  # (..., B, L, heads, D)
    return reshape(y, (*lead, n_l, h * d))  # (..., B, L, heads*D)


def matmul(xp, a: Array, b: Array, *, trans_a: bool = False, trans_b: bool = False,
           pool: bool = False) -> Array:
    """op(A) op(B) for 2-D A, B, op = the transpose where asked (a flag, not a copy).
    NumPy arrays go to :func:`attngrad.runtime.products.matmul`: a small product as one
    call of the private BLAS on the calling thread, a large one in blocks on attngrad's
    workers (no product on NumPy's own threaded BLAS, whose threads would spin beside
    attngrad's); other arrays ``@``.  ``pool`` changes nothing here (the route depends on
    the shapes alone); the layers pass it.  Returns a new array."""
    if type(a) is np.ndarray:  # small: one call of the private BLAS; large: on the workers
        return products.matmul(a, b, trans_a=trans_a, trans_b=trans_b)
    return (xp.matrix_transpose(a) if trans_a else a) @ (xp.matrix_transpose(b) if trans_b else b)


def matmuls(xp, jobs, *, pool: bool = False) -> list:
    """:func:`matmul` of each ``(a, b, trans_a, trans_b)`` of ``jobs``, in order; NumPy
    arrays in one hand-out to the workers where they go there
    (:func:`attngrad.runtime.products.matmuls`: one wake-up for all of them; each C
    bitwise what it would be alone)."""
    if all(type(j[0]) is np.ndarray for j in jobs):
        return products.matmuls(jobs)
    return [matmul(xp, a, b, trans_a=ta, trans_b=tb) for a, b, ta, tb in jobs]


def project(xp, x: Array, w: Array, b: Array | None = None, *, pool: bool = False) -> Array:
    """X (..., in) @ W (in, out) + b -> (..., out), as one 2-D GEMM over all leading axes
    (faster than a batched one; ``pool`` as :func:`matmul`).  Returns a new array."""
    reshape = _shape_ops(xp, x)[0]
    *lead, n_in = x.shape
    x2 = reshape(x, (math.prod(lead), n_in))  # (N, in)
    if products.pooled(x2, w, bias=b):  # the bias added inside each block of rows
        return reshape(products.matmul(x2, w, bias=b), (*lead, w.shape[1]))  # (F1) (..., out)
    if b is not None and type(x2) is np.ndarray:
        y = products.with_bias(x2, w, b)  # the bias written first, the GEMM adding to it
        if y is not None:
            return reshape(y, (*lead, w.shape[1]))  # (F1) (..., out)
    y = reshape(matmul(xp, x2, w, pool=pool), (*lead, w.shape[1]))  # (F1) (..., out)
    if b is None:
        return y
    if isinstance(y, np.ndarray) and y.dtype == np.result_type(y, b):
        return np.add(y, b, out=y)  # (F1) in place: y is the GEMM's fresh result
    return y + b  # (F1)


def weight_grad(xp, x: Array, dy: Array, *, pool: bool = False) -> Array:
    """X^T dY for X (..., in), dY (..., out), summed over every leading axis: (in, out)
    (``pool`` as :func:`matmul`).

    One 2-D GEMM over all rows, the transpose passed to BLAS as a flag (no copy): faster
    than summing partial products over blocks of rows at every size tried
    (docs/benchmarks-archive.md).
    """
    return matmuls(xp, [weight_grad_product(xp, x, dy)], pool=pool)[0]  # (F2) (in, out)


def weight_grad_product(xp, x: Array, dy: Array) -> tuple:
    """(F2) dW = X^T dY as a product for :func:`matmuls`: ``(X2, dY2, True, False)``, X
    and dY seen as (N, in), (N, out) over all their leading axes (views, no copy)."""
    *lead, n_in = x.shape
    n, n_out = math.prod(lead), dy.shape[-1]
    x2 = xp.reshape(x, (n, n_in))  # (N, in)
    dy2 = xp.reshape(dy, (n, n_out))  # (N, out)
    return x2, dy2, True, False  # (F2) X^T dY: (in, out)


def bias_grad(xp, dy: Array) -> Array:
    """dY (..., out) summed over every leading axis: (out,), in dY's dtype.

    Summed in float64: a float32 sum over many rows (B * L can be 10^5) loses digits that
    a float32 PyTorch reduction keeps (FlashAttention's 2x rule, RELIABILITY 24).
    """
    n_out = dy.shape[-1]
    dy2 = xp.reshape(dy, (-1, n_out))  # (N, out)
    if isinstance(dy2, np.ndarray):  # float64 sum, no float64 copy of dY
        if dy2.dtype in _SUMMED and fused.enabled():
            return fused.column_sums(dy2).astype(dy.dtype)  # (F2) (out,) compiled, rows in order
        return np.einsum("ij->j", dy2, dtype=np.float64).astype(dy.dtype)  # (F2) (out,) less overhead than reduce
    return xp.astype(xp.sum(dy2, axis=0, dtype=xp.float64), dy.dtype)  # (F2) (out,)


__all__ = ["bias_grad", "merge_heads", "project", "split_heads", "weight_grad"]
