"""The CPU runtime the attention maths runs on: array namespaces and argument checks
(:mod:`._xp`), the worker pool (:mod:`.parallel`), per-thread scratch (:mod:`.workspace`),
BLAS products (:mod:`.products`, :mod:`.ops`, :mod:`._blas`) and the compiled kernels
(:mod:`.fused`: numba, optional).  Nothing here knows what attention is."""
