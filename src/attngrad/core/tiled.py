"""Tiled attention: O(N) memory forward and backward (FlashAttention-2's structure), NumPy.

The forward sweeps key/value tiles for each query tile with an online softmax and keeps
only the output and the row log-sum-exp (T1).  The backward recomputes the probabilities
of each tile from them (T2), with delta = rowsum(dO * O) (A6) computed once, and
accumulates dV, dK (per key/value tile) and dQ (per query tile): A4-A10 tile by tile.
No (Lq x Lk) array exists anywhere; scratch memory is a few (block_q x block_k) tiles
per worker.  Tiles that the mask rule (:class:`MaskSpec`) excludes entirely are skipped.

    (T1) lse_i = log sum_j exp(S_ij)  over allowed j;  -inf for a row with nothing allowed
    (T2) P_ij = exp(S_ij - lse_i)  for allowed j, else 0;  0 for a row with lse_i = -inf
    (T3) online softmax: m' = max(m, rowmax S_tile),  l' = l e^(m - m') + rowsum e^(S_tile - m'),
         acc' = acc e^(m - m') + e^(S_tile - m') V_tile;  O = acc / l,  lse = m + log l

Work is split across (batch, head) units on Python threads, BLAS single-threaded in each
(:mod:`attngrad.core.parallel`).  NumPy arrays only; the dense path serves other kinds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._xp import Array
from .masks import MaskSpec
from .parallel import check_threads, run_units
from .sdpa import SDPAShape, check_dout, reduce_to_shape

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256
# impl="auto" picks the tiled path for NumPy inputs when B*H*Lq*Lk reaches this many entries:
# P would take 64 MB in float32.  Below it the dense path is as fast or faster (measured with
# `attngrad bench`: dense 1.6x, tiled 2.0x SDPA's time at B=1 H=8 N=1024, non-causal); above
# it the tiled path keeps memory O(N) and is faster for causal masks (tiles skipped).
AUTO_TILED_MIN_ENTRIES = 1 << 24


class Tiling(NamedTuple):
    block_q: int  # query rows per tile
    block_k: int  # keys per tile
    threads: int  # cores to use (Python workers x BLAS threads <= threads)


class TiledCache(NamedTuple):
    """What :func:`tiled_backward` needs.

    Memory: O(N).  q, k, v and the output are kept by reference (cast only for half
    precision), plus lse, B*H*Lq values; the bias (if any) by reference.
    """

    q: Array  # (B, H, Lq, D)      compute dtype
    k: Array  # (B, Hkv, Lk, D)
    v: Array  # (B, Hkv, Lk, Dv)
    out: Array  # (B, H, Lq, Dv)    compute dtype
    lse: Array  # (B, H, Lq)        (T1), -inf where a row attends nothing
    spec: MaskSpec
    bias: Array | None  # (b, h, lq, lk), each 1 or full, compute dtype
    scale: float
    shape: SDPAShape
    bias_shape: tuple | None  # the caller's bias shape, for reducing dBias
    dtype: object  # the caller's dtype
    tiling: Tiling

    @property
    def p(self) -> Array:
        """The probabilities (B, Hkv, G*Lq, Lk), laid out as :class:`SDPACache`'s ``p``,
        rebuilt from lse on request (T2) for attention maps: O(Lq Lk) memory, only here."""
        B, H, Hkv, Lq, Lk, _, _ = self.shape
        allowed = self.spec.block(np)  # (b, h, Lq, Lk) bool or None
        s = (self.q * self.scale) @ np.swapaxes(self.k, -1, -2).repeat(self.shape.group, axis=1)  # (A1)
        if self.bias is not None:
            s = s + self.bias  # (A1) (B, H, Lq, Lk)
        lse = np.where(np.isfinite(self.lse), self.lse, np.inf)[..., None]  # (B, H, Lq, 1)
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.exp(s - lse)  # (T2)
        if allowed is not None:
            p = np.where(allowed, p, 0)  # (A2) by structure
        return p.reshape(B, Hkv, (H // Hkv if Hkv else 0) * Lq, Lk)


def make_tiling(block_q=None, block_k=None, threads=None) -> Tiling:
    """Validated tile sizes and thread count (None = defaults / every core)."""
    sizes = {"block_q": (block_q, DEFAULT_BLOCK_Q), "block_k": (block_k, DEFAULT_BLOCK_K)}
    out = []
    for name, (value, default) in sizes.items():
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be a positive integer; got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")
        out.append(int(value))
    return Tiling(out[0], out[1], check_threads(threads))


def choose_impl(xp, sh: SDPAShape) -> str:
    """impl="auto": tiled for NumPy inputs of at least AUTO_TILED_MIN_ENTRIES logits."""
    entries = sh.batch * sh.heads * sh.lq * sh.lk
    return "tiled" if xp is np and entries >= AUTO_TILED_MIN_ENTRIES else "dense"


def _index(a, b: int, h: int):
    """a[b, h] of an array whose leading axes are 1 or full."""
    return a[b if a.shape[0] > 1 else 0, h if a.shape[1] > 1 else 0]


class TileMask(NamedTuple):
    """The mask rule on one tile that is neither skipped nor fully allowed."""

    masked: Array  # (bq, bk) bool, True = masked out (the complement of MaskSpec.block)
    rows_used: Array | None  # (bq,) bool: rows with an allowed entry; None when all have
    cols_used: Array | None  # (bk,) bool: keys some row may attend; None when all may


SKIP = "skip"  # a tile with nothing allowed


class TileMasks:
    """:meth:`MaskSpec.block` per tile of head (b, h), with tile skipping.

    For a purely causal mask the tile does not depend on (b, h) and is remembered, so each
    diagonal tile is built once per call (O(N) memory: only diagonal tiles are masked).
    """

    def __init__(self, spec: MaskSpec):
        self.spec = spec
        self.memo = {} if spec.mask is None and spec.keys is None else None

    def __call__(self, b: int, h: int, q0: int, q1: int, k0: int, k1: int):
        """SKIP, None (all allowed) or a :class:`TileMask` for tile [q0, q1) x [k0, k1)."""
        spec = self.spec
        if not spec.block_may_attend(q0, q1, k0, k1):
            return SKIP
        if spec.block_all_attend(q0, q1, k0, k1):
            return None
        if self.memo is not None and (q0, k0) in self.memo:
            return self.memo[q0, k0]
        allowed = _index(spec.block(np, q0, q1, k0, k1), b, h)  # (bq|1, bk|1)
        if allowed.all():
            tile = None
        elif not allowed.any():
            tile = SKIP
        else:
            allowed = np.broadcast_to(allowed, (q1 - q0, k1 - k0))  # (bq, bk)
            rows, cols = allowed.any(axis=1), allowed.any(axis=0)  # (bq,), (bk,)
            tile = TileMask(~allowed, None if rows.all() else rows, None if cols.all() else cols)
        if self.memo is not None:
            self.memo[q0, k0] = tile
        return tile


def _bias_tile(bias, b, h, q0, q1, k0, k1):
    t = _index(bias, b, h)  # (lq|1, lk|1)
    t = t[q0:q1] if t.shape[0] > 1 else t
    return t[:, k0:k1] if t.shape[1] > 1 else t


def _used(x, used):
    """x with the rows (of a tile operand) that no allowed entry uses set to 0, so that
    NaN or inf there cannot reach the result (0 * NaN = NaN).          RELIABILITY 1, 4"""
    return x if used is None else np.where(used[:, None], x, 0)


def tiled_forward(q, k, v, spec: MaskSpec, bias, scale: float, sh: SDPAShape, bias_shape, dtype, tiling: Tiling):
    """Tiled forward on validated NumPy inputs (compute dtype).  Returns ``(out, cache)``."""
    B, H, _, Lq, Lk, _, Dv = sh
    G = sh.group
    bq, bk = min(tiling.block_q, max(Lq, 1)), min(tiling.block_k, max(Lk, 1))
    out = np.zeros((B, H, Lq, Dv), dtype=q.dtype)  # (B, H, Lq, Dv)
    lse = np.full((B, H, Lq), -np.inf, dtype=q.dtype)  # (B, H, Lq)   (T1)
    scratch = {}
    masks = TileMasks(spec)

    def work(unit: int, worker: int) -> None:
        b, h = divmod(unit, H)
        if worker not in scratch:
            scratch[worker] = np.empty((bq, bk), dtype=q.dtype)
        s_buf = scratch[worker]
        kh, vh = k[b, h // G], v[b, h // G]  # (Lk, D), (Lk, Dv)
        for q0 in range(0, Lq, bq):
            q1 = min(q0 + bq, Lq)
            qs = q[b, h, q0:q1] * scale  # (bq, D) scaled queries
            m = np.full(q1 - q0, -np.inf, dtype=q.dtype)  # (bq,) running row max   (T3)
            l = np.zeros(q1 - q0, dtype=q.dtype)  # (bq,) running row sum
            acc = out[b, h, q0:q1]  # (bq, Dv) written in place
            for k0 in range(0, Lk, bk):
                k1 = min(k0 + bk, Lk)
                tile = masks(b, h, q0, q1, k0, k1)
                if tile is SKIP:
                    continue
                s = np.matmul(qs, kh[k0:k1].T, out=s_buf[: q1 - q0, : k1 - k0])  # (A1) (bq, bk)
                if bias is not None:
                    s += _bias_tile(bias, b, h, q0, q1, k0, k1)  # (A1)
                if tile is not None:
                    np.copyto(s, -np.inf, where=tile.masked)  # (A2) by structure
                m_new = np.maximum(m, s.max(axis=1))  # (T3) (bq,)
                shift = np.where(np.isfinite(m_new), m_new, 0)  # rows with nothing yet: 0
                s -= shift[:, None]
                np.exp(s, out=s)  # (T3) e^(S - m'), 0 where masked
                alpha = np.exp(m - shift)  # (T3) (bq,) e^(m - m'); 0 when m = -inf
                l *= alpha
                l += s.sum(axis=1)
                acc *= alpha[:, None]
                acc += s @ (vh[k0:k1] if tile is None else _used(vh[k0:k1], tile.cols_used))  # (A3) (bq, Dv)
                m = m_new
            has = l > 0  # (bq,) rows that attend something
            acc /= np.where(has, l, 1)[:, None]  # (A3) O = acc / l; 0 rows stay 0
            with np.errstate(divide="ignore"):
                lse[b, h, q0:q1] = np.where(has, m + np.log(np.where(has, l, 1)), -np.inf)  # (T1)

    run_units(work, B * H, tiling.threads)
    cache = TiledCache(q, k, v, out, lse, spec, bias, scale, sh, bias_shape, dtype, tiling)
    return out.astype(dtype, copy=False), cache


def tiled_backward(dout, cache: TiledCache) -> dict:
    """Closed-form gradients (A4-A10) recomputing P tile by tile (T2).

    Returns ``{"q", "k", "v"}`` plus ``"bias"`` (reduced to the bias's shape) as
    :func:`attngrad.sdpa_backward` does.
    """
    sh = cache.shape
    B, H, Hkv, Lq, Lk, D, Dv = sh
    G = sh.group
    check_dout(dout, sh)
    if not isinstance(dout, np.ndarray):
        raise TypeError(f"dout must be a NumPy array for the tiled path; got {type(dout).__name__}")
    q, k, v, out, spec, bias, scale = cache.q, cache.k, cache.v, cache.out, cache.spec, cache.bias, cache.scale
    cdt = q.dtype
    do_all = dout.astype(cdt, copy=False)  # (B, H, Lq, Dv)
    bq, bk = min(cache.tiling.block_q, max(Lq, 1)), min(cache.tiling.block_k, max(Lk, 1))
    dq = np.zeros((B, H, Lq, D), dtype=cdt)
    dk = np.zeros((B, Hkv, Lk, D), dtype=cdt)
    dv = np.zeros((B, Hkv, Lk, Dv), dtype=cdt)
    # dBias: workers share one array when their units write disjoint parts of it.
    shared_db = bias is not None and bias.shape[0] == B and bias.shape[1] == H
    dbias = {0: np.zeros(bias.shape, dtype=cdt)} if bias is not None else {}  # worker -> partial
    scratch = {}
    masks = TileMasks(spec)

    def work(unit: int, worker: int) -> None:
        b, hk = divmod(unit, Hkv)
        if worker not in scratch:
            scratch[worker] = (np.empty((bq, bk), dtype=cdt), np.empty((bq, bk), dtype=cdt))
            if bias is not None and not shared_db and worker not in dbias:
                dbias[worker] = np.zeros(bias.shape, dtype=cdt)
        s_buf, dp_buf = scratch[worker]
        db = dbias[0 if shared_db else worker] if bias is not None else None
        kh, vh = k[b, hk], v[b, hk]  # (Lk, D), (Lk, Dv)
        dkh, dvh = dk[b, hk], dv[b, hk]  # (Lk, D), (Lk, Dv) accumulated over the group
        for h in range(hk * G, (hk + 1) * G):
            qs = q[b, h] * scale  # (Lq, D) scaled queries
            do = do_all[b, h]  # (Lq, Dv)
            delta = np.einsum("ij,ij->i", do, out[b, h])  # (A6) (Lq,) rowsum(dO * O)
            lse = cache.lse[b, h]
            lse = np.where(np.isfinite(lse), lse, np.inf)  # (T2) empty rows: P = e^-inf = 0
            dqh = dq[b, h]  # (Lq, D)
            for k0 in range(0, Lk, bk):
                k1 = min(k0 + bk, Lk)
                for q0 in range(0, Lq, bq):
                    q1 = min(q0 + bq, Lq)
                    tile = masks(b, h, q0, q1, k0, k1)
                    if tile is SKIP:
                        continue
                    qt, kt, vt = qs[q0:q1], kh[k0:k1], vh[k0:k1]  # (bq, D), (bk, D), (bk, Dv)
                    if tile is not None:
                        qt, kt, vt = _used(qt, tile.rows_used), _used(kt, tile.cols_used), _used(vt, tile.cols_used)
                    p = np.matmul(qt, kt.T, out=s_buf[: q1 - q0, : k1 - k0])  # (A1) (bq, bk)
                    if bias is not None:
                        p += _bias_tile(bias, b, h, q0, q1, k0, k1)  # (A1)
                    if tile is not None:
                        np.copyto(p, -np.inf, where=tile.masked)  # (A2) by structure
                    p -= lse[q0:q1, None]
                    np.exp(p, out=p)  # (T2) P, 0 where masked
                    dvh[k0:k1] += p.T @ do[q0:q1]  # (A4) (bk, Dv)
                    ds = np.matmul(do[q0:q1], vt.T, out=dp_buf[: q1 - q0, : k1 - k0])  # (A5) dP
                    ds -= delta[q0:q1, None]
                    ds *= p  # (A7) dS = P * (dP - delta)  (bq, bk)
                    dkh[k0:k1] += ds.T @ qt  # (A9) scale folded into qt  (bk, D)
                    dqh[q0:q1] += ds @ kt  # (A8) scale applied below  (bq, D)
                    if db is not None:
                        _add_bias_grad(db, ds, b, h, q0, q1, k0, k1)  # (A10)
            dqh *= scale  # (A8)

    run_units(work, B * Hkv, cache.tiling.threads)
    grads = {
        "q": dq.astype(cache.dtype, copy=False),
        "k": dk.astype(cache.dtype, copy=False),
        "v": dv.astype(cache.dtype, copy=False),
    }
    if bias is not None:
        total = sum(dbias.values())
        grads["bias"] = reduce_to_shape(np, total, cache.bias_shape).astype(cache.dtype, copy=False)
    return grads


def _add_bias_grad(db, ds, b, h, q0, q1, k0, k1) -> None:
    """db[b, h, q-tile, k-tile] += dS, summed over the axes along which the bias broadcasts."""
    t = _index(db, b, h)  # (lq|1, lk|1) view
    if t.shape[0] == 1:
        ds = ds.sum(axis=0, keepdims=True)
    else:
        t = t[q0:q1]
    if t.shape[1] == 1:
        t += ds.sum(axis=1, keepdims=True)
    else:
        t[:, k0:k1] += ds
