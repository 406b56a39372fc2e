"""The top-k path's scatter-add of dK and dV rows (TK5) as a compiled loop (numba, the
``fast`` extra; :func:`attngrad.runtime.fused.enabled`), else None and :mod:`.topk` uses
its NumPy form.  Both add the rows in one fixed order, so each is bitwise deterministic
at any thread count; the compiled loop adds them in the slots' own order (query rows, then
slots), the NumPy form after a stable sort by key: the two may differ in the last bits."""

from __future__ import annotations

from ..runtime import fused

_KERNEL = None


def scatter_kernel():
    """The compiled ``scatter(dst, keys, vals)``: dst[keys[n]] += vals[n] for n in order;
    None without numba (or with ``ATTNGRAD_NO_NUMBA`` set)."""
    global _KERNEL
    if not fused.enabled():
        return None
    if _KERNEL is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def scatter(dst, keys, vals):  # (TK5) in the slots' order
            for n in range(keys.shape[0]):
                row = dst[keys[n]]
                src = vals[n]
                for d in range(src.shape[0]):
                    row[d] += src[d]

        _KERNEL = scatter
    return _KERNEL
