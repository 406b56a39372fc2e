"""Forward caches for a block of a longer row: the backward of one (query, key) block whose
softmax was normalised over more keys than the block holds (ring attention, RG4).

The gradient of a query row depends on its whole softmax: the block's backward must take
P from the row's *global* log-sum-exp and δ from the *global* output (A6, F2), and treat as
constant only the rows with fewer than two keys in the whole row.  :func:`with_output`
gives the core's own cache of the block with those three replaced, so that callers never
edit a cache's fields.
"""

from __future__ import annotations

from .sdpa import SDPACache, TiledCache


def with_output(cache, out, lse, flat=None) -> TiledCache:
    """``cache`` (a tiled forward cache of one block) whose backward uses the given O and
    log-sum-exp in place of the block's own, and ``flat`` as its constant-softmax rows.

    out (B, H, Lq, Dv) and lse (B, H, Lq): the whole row's, in the cache's compute dtype
    (views are fine: they are read, not copied).  flat: (B, H, Lq) bool, True where the
    whole row attends fewer than two keys and has no sink (dS = 0 exactly there), or None
    when no row does.  :func:`attngrad.sdpa_backward` of the result gives the block's
    share of dQ, dK, dV (RG4).
    """
    if isinstance(cache, SDPACache):
        raise TypeError(
            "with_output takes a tiled cache (impl='tiled'): the dense cache keeps P "
            "normalised by the block's own log-sum-exp, not O and lse"
        )
    if not isinstance(cache, TiledCache):
        raise TypeError(f"cache must be the second value returned by sdpa_forward; got {type(cache).__name__}")
    for name, given, own in (("out", out, cache.out), ("lse", lse, cache.lse)):
        if getattr(given, "shape", None) != own.shape:
            raise ValueError(f"{name} must have the block's shape {own.shape}; got {getattr(given, 'shape', given)}")
    if flat is not None and flat.shape != cache.lse.shape:
        raise ValueError(f"flat must have the block's row shape {cache.lse.shape}; got {flat.shape}")
    return cache._replace(out=out, lse=lse, flat=flat)  # (RG4) global O and lse
