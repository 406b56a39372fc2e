"""The tiled flex path: O(N) memory, FlashAttention-2's structure with a score function.

Forward, per query head and query tile: for each key tile that the mask leaves (FX4),
S⁰ = scale q kᵀ (A1), S = f(S⁰) (FX1, :mod:`.tiles`), the mask by structure (-inf), the
online softmax (FA3) and acc += e^(S - m) V; O = acc / l and lse = m + log l (FA1).  The
per-row running maximum m is the row's largest valid score, so the per-head maximum logit
(ML1) comes for free.  Backward, per (batch, key/value head) unit, per tile: S again,
∂S/∂S⁰ and ∂S/∂θ (FX2, FX3) from the same evaluation, P = e^(S - lse) (FA2), dV += Pᵀ dO
(A4), dS = P (dP - δ) (A5-A7), dθ += scatter(dS ∘ ∂S/∂θ) (FX3), dS⁰ = dS ∘ ∂S/∂S⁰ (FX2),
dK += dS⁰ᵀ Q, dQ += dS⁰ K (A8, A9, scaled at the end).  No (Lq x Lk) array exists; the
scratch is a few (block_q x block_k) tiles per worker.

Determinism: forward units are heads (rows independent); backward units own their rows
of dQ, dK and dV; the captured tensors' gradients are summed per slot of units (a fixed
split of the units, each slot's units in order) and the slots in order, so no result
depends on the thread count.

Non-finite inputs (RELIABILITY 1, 4, 27): skipped tiles and the zeroed rows and keys of a
partial tile are exact for finite values, but the dense path (and PyTorch) also form
0 · NaN and 0 · inf on masked entries: a NaN in a key that some rows attend makes every
row's output and dQ NaN there, a NaN row of S makes that row's P NaN on every key.  So,
as the sdpa tiled path does (:mod:`attngrad.core.tiled`), where a finished result holds
a non-finite value the call runs again on the NumPy tile loop in full mode: no tile
skipped (a tile the mask leaves out enters the products as an all-masked tile, P = 0, the
score function not evaluated there), no row or key of a tile zeroed, masked entries set
by structure as before (-inf, P = 0, dS = 0 where ∂S/∂S⁰ is not the constant 1), the
backward's P NaN on the whole row where the lse is NaN or +inf; the inputs are zeroed per
head where no allowed entry uses them (:func:`structural_zeros`), as the dense path zeroes
them, so NaN or inf there still changes nothing.  The full run gives the dense path's
NaN and inf pattern in O, the lse and every gradient (captured tensors' too).  The forward
reruns where O or the lse (NaN or +inf) is non-finite; the backward runs in full mode
directly where the forward's O or lse, dO or dlse is non-finite, else reruns where a
gradient comes out non-finite.  The checks are one pass over each finished result (and
over dO), never inside the tile loop: finite inputs cost nothing more; the full run keeps
O(N) memory (zeroed copies of q, k, v) and is bitwise deterministic as the NumPy loop is.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...runtime import fused
from ...runtime._xp import Array
from ...runtime.parallel import run_units
from ...scores import scatter_add
from ..tiled.loop import preprocess_delta
from ..tiled.masks import SKIP, TileMask, used, used_by_tiles
from . import compiled
from .blocks import TileRule, index_grid
from .problem import FlexProblem
from .tiles import backward_scores, forward_scores, online_softmax, tile_dsoftmax, tile_exp

GRAD_SLOTS = 4  # units summing captured-tensor gradients into their own float64 partials
ROUTE = "auto"  # "auto": the compiled route where it applies; "numpy": always the NumPy tile loop (tests)


class Tiles(NamedTuple):
    block_q: int
    block_k: int
    threads: int


class FlexTiledCache(NamedTuple):
    """What the tiled backward needs.  Memory: O(N): q, k, v by reference (cast only for
    half precision), O (float64 for float32 work), lse, one flag per row."""

    q: Array  # (B, H, Lq, D) compute dtype
    k: Array  # (B, Hkv, Lk, D)
    v: Array  # (B, Hkv, Lk, Dv)
    out: Array  # (B, H, Lq, Dv) float64 for float32 work
    lse: Array  # (B, H, Lq) (FA1), -inf where a row attends nothing
    flat: Array | None  # (B, H, Lq) bool: rows with fewer than two allowed keys (dS = 0 there)
    problem: FlexProblem
    tiles: Tiles
    rule: TileRule  # the mask per tile (its memo serves the backward too)
    plans: object = None  # the compiled route's mask plans (compiled.Plans), None on the NumPy route
    route: str = "numpy"  # "compiled" (the score function in compiled tile loops, .compiled) or "numpy"


def _kern(prob: FlexProblem):
    return fused.kernels() if fused.enabled() and prob.cdt in (np.float32, np.float64) else None


def forward(q, k, v, prob: FlexProblem, tiles: Tiles, rule: TileRule):
    """Returns ``(cache, row_max, out)``: row_max (B, H, Lq) float64, each row's largest valid
    score, -inf for a row with none (ML1); out: O in the compute dtype, a new array the caller
    may keep, or None (then cache.out is O).  The compiled route (:mod:`.compiled`) where it
    applies, else the NumPy tile loop below."""
    found = compiled.kernels(prob) if ROUTE != "numpy" else None
    done = None if found is None else compiled.forward(q, k, v, prob, tiles, rule, found)
    if done is not None:
        out, lse, nkeys, top, plans, res = done
        if finite_forward(out, lse):
            flat = nkeys < 2
            return FlexTiledCache(q, k, v, out, lse, flat if flat.any() else None, prob, tiles, rule, plans,
                                  "compiled"), top, res
    else:
        cache, top = _forward_numpy(q, k, v, prob, tiles, rule)
        if finite_forward(cache.out, cache.lse):
            return cache, top, None
    return (*_forward_numpy(q, k, v, prob, tiles, rule, full=True), None)  # the dense NaN pattern


def finite_forward(out, lse) -> bool:
    """Whether O is finite everywhere and no lse is NaN or +inf (-inf: a row with no key)."""
    return bool(np.isfinite(out).all()) and bool((lse < np.inf).all())


def _all_finite(arrays) -> bool:
    return all(bool(np.isfinite(a).all()) for a in arrays)


def unit_dscore(prob: FlexProblem) -> bool:
    """Whether ∂S/∂S⁰ is the constant 1 (then the backward does not zero dS on masked
    entries, on the dense path neither: :func:`.tiles.backward_scores` returns 1.0)."""
    d = None if prob.score is None else prob.score.d_score
    return d is None or (d.is_const and d.data == 1)


def structural_zeros(prob: FlexProblem, tiles: Tiles, rule: TileRule, q, k, v):
    """q, k, v with the query rows that attend no key and the keys that no query of their
    group may attend set to 0, as the dense path sets them (RELIABILITY 1, 4), from the
    rule's tiles (no (Lq, Lk) array); for a full run.  New arrays where anything is zeroed."""
    if rule.trivial:
        return q, k, v
    rows, keys = used_by_tiles(prob.shape, (tiles.block_q, tiles.block_k), rule)  # (B, H, Lq), (B, Hkv, Lk)
    if rows.all() and keys.all():
        return q, k, v
    return (np.where(rows[..., None], q, 0).astype(q.dtype, copy=False),
            np.where(keys[..., None], k, 0).astype(k.dtype, copy=False),
            np.where(keys[..., None], v, 0).astype(v.dtype, copy=False))


def _full_tile(tile, shape):
    """A tile of a full run: ``(tile, void)``; a skipped tile becomes all masked (void:
    the score function is not evaluated there), a partial one keeps its masked entries
    but no row or key of it is zeroed."""
    if tile is SKIP:
        return TileMask(np.broadcast_to(np.True_, shape), None, None), True
    if tile is None:
        return None, False
    return TileMask(tile.masked, None, None), False


def _forward_numpy(q, k, v, prob: FlexProblem, tiles: Tiles, rule: TileRule, full: bool = False):
    """The NumPy tile loop's forward: ``(cache, row_max)``.  ``full``: no tile skipped and
    no row or key of a tile zeroed (the dense path's NaN pattern; see the module docstring)."""
    B, H, _, Lq, Lk, _, Dv = prob.shape
    G = prob.shape.group
    bq, bk = tiles.block_q, tiles.block_k
    cdt = prob.cdt
    cache_qkv = (q, k, v)
    if full:
        q, k, v = structural_zeros(prob, tiles, rule, q, k, v)
    odt = np.float64 if cdt == np.float32 else cdt
    out = np.zeros((B, H, Lq, Dv), odt)  # (B, H, Lq, Dv)
    lse = np.full((B, H, Lq), -np.inf, odt)  # (B, H, Lq)
    nkeys = np.zeros((B, H, Lq), np.int64)  # allowed keys per row
    top = np.full((B, H, Lq), -np.inf)  # (B, H, Lq) the largest valid score of each row (ML1)
    kern = _kern(prob)
    bufs: dict = {}

    def work(unit: int, worker: int) -> None:
        b, h = divmod(unit, H)
        if worker not in bufs:
            bufs[worker] = np.empty(bq * bk, cdt)
        buf = bufs[worker]
        qh = q[b, h] * prob.scale if prob.fold else q[b, h]  # (Lq, D)
        kh, vh = k[b, h // G], v[b, h // G]  # (Lk, D), (Lk, Dv)
        for q0 in range(0, Lq, bq):
            q1 = min(q0 + bq, Lq)
            m = np.full(q1 - q0, -np.inf, cdt)  # (bq,) running row max
            l = np.zeros(q1 - q0, cdt)  # (bq,) running row sum
            acc = out[b, h, q0:q1]  # (bq, Dv) in place
            for k0 in range(0, Lk, bk):
                k1 = min(k0 + bk, Lk)
                tile, void = rule(b, h, q0, q1, k0, k1), False
                if tile is SKIP and not full:
                    continue
                if full:
                    tile, void = _full_tile(tile, (q1 - q0, k1 - k0))
                qt, kt, vt = qh[q0:q1], kh[k0:k1], vh[k0:k1]
                if tile is not None:  # rows and keys no entry uses: 0 (RELIABILITY 1, 4)
                    qt, kt, vt = used(qt, tile.rows_used), used(kt, tile.cols_used), used(vt, tile.cols_used)
                s = buf[: (q1 - q0) * (k1 - k0)].reshape(q1 - q0, k1 - k0)
                if void:  # (FX4) every entry masked: P = 0, still times V (0 · NaN)
                    s.fill(-np.inf)
                else:
                    s = np.matmul(qt, kt.T, out=s)  # (A1)
                    if not prob.fold:
                        s *= prob.scale
                    s = forward_scores(prob, s, index_grid(b, h, q0, q1, k0, k1))  # (FX1)
                if tile is None:
                    nkeys[b, h, q0:q1] += k1 - k0
                else:
                    np.copyto(s, -np.inf, where=tile.masked)  # (FX4) by structure
                    nkeys[b, h, q0:q1] += (k1 - k0) - tile.masked.sum(axis=1)
                online_softmax(kern, s, m, l, acc)  # (FA3)
                acc += s @ vt  # (A3) (bq, Dv)
            has = ~(l <= 0)  # rows that attend something, or NaN ones
            with np.errstate(divide="ignore", invalid="ignore"):
                acc /= np.where(has, l, 1)[:, None]  # (A3) O = acc / l
                lse[b, h, q0:q1] = np.where(has, m + np.log(np.where(has, l, 1), dtype=odt), -np.inf)  # (FA1)
            top[b, h, q0:q1] = m  # (ML1) the running max is the row's largest valid score

    run_units(work, B * H, tiles.threads)
    if full:  # (ML1) a row with a NaN score has the NaN max (the fused online softmax's max passes NaN over)
        top[np.isnan(lse)] = np.nan
    flat = nkeys < 2
    cache = FlexTiledCache(*cache_qkv, out, lse, flat if flat.any() else None, prob, tiles, rule)
    return cache, top


def backward(cache: FlexTiledCache, do_all, dlse=None) -> dict:
    """Closed-form gradients: "q", "k", "v" and each captured tensor's (A4-A9, FX2, FX3),
    on the route the forward took; in full mode (the dense path's NaN pattern, see the
    module docstring) where the forward's O or lse, dO or dlse is non-finite, or where a
    gradient comes out non-finite."""
    inputs = (cache.out, do_all) if dlse is None else (cache.out, do_all, dlse)
    if not (_all_finite(inputs) and bool((cache.lse < np.inf).all())):
        return _backward_numpy(cache, do_all, dlse, full=True)
    grads = None
    if cache.route == "compiled":
        found = compiled.kernels(cache.problem)
        grads = None if found is None else compiled.backward(cache, do_all, dlse, found)
    if grads is None:
        grads = _backward_numpy(cache, do_all, dlse)
    if _all_finite(grads.values()):
        return grads
    return _backward_numpy(cache, do_all, dlse, full=True)


def _backward_numpy(cache: FlexTiledCache, do_all, dlse=None, full: bool = False) -> dict:
    """The NumPy tile loop's backward.  ``full``: no tile skipped, no row or key of a tile
    zeroed, P NaN on rows whose lse is NaN or +inf (the dense path's NaN pattern)."""
    prob, tiles = cache.problem, cache.tiles
    B, H, Hkv, Lq, Lk, D, Dv = prob.shape
    cdt = prob.cdt
    if full:
        cache = cache._replace(**dict(zip("qkv", structural_zeros(prob, tiles, cache.rule, cache.q, cache.k,
                                                                  cache.v), strict=True)))
    dq = np.zeros((B, H, Lq, D), cdt)
    dk = np.zeros((B, Hkv, Lk, D), cdt)
    dv = np.zeros((B, Hkv, Lk, Dv), cdt)
    reads = () if prob.score is None else prob.score.reads
    units = [(b, hk) for b in range(B) for hk in range(Hkv)]
    n = min(len(units), GRAD_SLOTS) if reads else len(units)
    slots = [units[s::n] for s in range(n)]
    caps = () if prob.score is None else prob.score.traced.captured
    partials = [{r.slot: np.zeros(caps[r.slot].shape) for r in reads} for _ in slots]
    kern = _kern(prob)
    bufs: dict = {}

    def work(slot: int, worker: int) -> None:
        if worker not in bufs:
            bufs[worker] = tuple(np.empty(tiles.block_q * tiles.block_k, cdt) for _ in range(3))
        for b, hk in slots[slot]:
            for h in range(hk * prob.shape.group, (hk + 1) * prob.shape.group):
                _backward_head(cache, (b, h, hk, full), do_all, dlse, (dq, dk, dv, partials[slot]),
                               (kern, *bufs[worker]))
            dk[b, hk] *= prob.scale  # (A9)

    run_units(work, len(slots), tiles.threads)
    grads = {"q": dq, "k": dk, "v": dv}
    for slot in sorted(partials[0]) if partials else ():
        total = partials[0][slot]
        for part in partials[1:]:
            total = total + part[slot]  # slot order: deterministic
        grads[caps[slot].name] = total
    return grads


def _backward_head(cache: FlexTiledCache, head: tuple, do_all, dlse, acc: tuple, work: tuple) -> None:
    """One query head h of unit (b, hk): dQ rows of h, dK and dV of hk, the partials
    (``head``: (b, h, hk, full))."""
    prob, rule = cache.problem, cache.rule
    b, h, hk, full = head
    dq, dk, dv, partial = acc
    kern, s_buf, dp_buf, p_buf = work
    Lq, Lk = prob.shape.lq, prob.shape.lk
    bq, bk = cache.tiles.block_q, cache.tiles.block_k
    reads = () if prob.score is None else prob.score.reads
    q_raw = cache.q[b, h]  # (Lq, D)
    qh = q_raw * prob.scale if prob.fold else q_raw
    kh, vh = cache.k[b, hk], cache.v[b, hk]
    do = np.ascontiguousarray(do_all[b, h])  # (Lq, Dv)
    delta = preprocess_delta(do, cache.out[b, h])  # (A6) (Lq,) float64
    dl = None if dlse is None else dlse[b, h]
    if dl is not None:
        delta = delta - dl  # (LS3) delta' = delta - dlse
    lse = _backward_lse(cache.lse[b, h], full)  # (FA2)
    flat = None if cache.flat is None else cache.flat[b, h]
    for k0 in range(0, Lk, bk):
        k1 = min(k0 + bk, Lk)
        for q0 in range(0, Lq, bq):
            q1 = min(q0 + bq, Lq)
            tile, void = rule(b, h, q0, q1, k0, k1), False
            if tile is SKIP and not full:
                continue
            if full:
                tile, void = _full_tile(tile, (q1 - q0, k1 - k0))
            qt, qr, kt, vt = qh[q0:q1], q_raw[q0:q1], kh[k0:k1], vh[k0:k1]
            if tile is not None:
                r, c = tile.rows_used, tile.cols_used
                qt, qr, kt, vt = used(qt, r), used(qr, r), used(kt, c), used(vt, c)
            n = (q1 - q0) * (k1 - k0)
            if void:  # every entry masked: P = 0 (NaN on a NaN row), dS = 0 unless ∂S/∂S⁰ is 1
                p = p_buf[:n].reshape(q1 - q0, k1 - k0)
                d_score = 1.0 if unit_dscore(prob) else 0.0
            else:
                s = np.matmul(qt, kt.T, out=s_buf[:n].reshape(q1 - q0, k1 - k0))  # (A1)
                if not prob.fold:
                    s *= prob.scale
                p, d_score, d_reads, indices = backward_scores(
                    prob, s, index_grid(b, h, q0, q1, k0, k1), p_buf[:n].reshape(s.shape))  # (FX1-FX3)
            if tile is not None:
                np.copyto(p, -np.inf, where=tile.masked)  # (FX4)
            tile_exp(kern, p, lse[q0:q1])  # (FA2) P
            dot = do[q0:q1]  # (bq, Dv)
            dv[b, hk, k0:k1] += p.T @ dot  # (A4)
            ds = np.matmul(dot, vt.T, out=dp_buf[:n].reshape(q1 - q0, k1 - k0))  # (A5) dP
            tile_dsoftmax(kern, ds, p, delta[q0:q1])  # (A7) dS = P (dP - delta)
            if flat is not None and flat[q0:q1].any():
                fl = flat[q0:q1]
                ds[fl] = 0 if dl is None else p[fl] * dl[q0:q1][fl, None]  # (A7, LS4)
            for read, d in () if void else zip(reads, d_reads, strict=True):  # (FX3) dθ += scatter(dS ∘ ∂S/∂θ)
                w = ds * d
                if tile is not None:
                    np.copyto(w, 0, where=tile.masked)
                scatter_add(partial[read.slot], indices[id(read.gather)], w)
            if not (isinstance(d_score, float) and d_score == 1.0):
                ds *= d_score  # (FX2) dS⁰ = dS ∘ ∂S/∂S⁰
                if tile is not None:
                    np.copyto(ds, 0, where=tile.masked)
            dk[b, hk, k0:k1] += ds.T @ qr  # (A9) scaled at the end
            dq[b, h, q0:q1] += ds @ kt  # (A8)
    dq[b, h] *= prob.scale  # (A8)


def _backward_lse(lse, full: bool):
    """The lse the backward subtracts (FA2), float64: +inf for rows that attend nothing
    (P = 0); in a full run NaN for rows whose lse is NaN or +inf (a NaN or +inf score), so
    that P is NaN on the whole row, masked entries too, as the dense path's softmax gives it."""
    if not full:
        return np.where(np.isfinite(lse), lse, np.inf).astype(np.float64)
    return np.where(np.isneginf(lse), np.inf, np.where(np.isfinite(lse), lse, np.nan)).astype(np.float64)
