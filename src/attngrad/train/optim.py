"""AdamW, its learning-rate schedule and global-norm clipping (docs/training.md, O1-O7).

    c = min(1, max_norm / (||g||_2 + 1e-6)),   g <- c g          (O1)  clipping, global norm
    lr_t = lr * t / warmup                       for t <= warmup (O2)  linear warmup
    lr_t = lr * (r + (1 - r) (1 + cos(pi s)) / 2), s = (t - warmup) / (T - warmup)   (O3)
    theta <- theta (1 - lr_t wd)       (decoupled weight decay; matrices only)        (O4)
    m <- m + (1 - b1)(g - m),   v <- b2 v + (1 - b2) g^2                              (O5)
    theta <- theta - (lr_t / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)          (O6)
    lr_t = lr r + (lr_k - lr r)(1 + cos(pi s)) / 2,  s = (t - k) / (T - k),  t >= k      (O7)

(O7) is the schedule of a run resumed at step k > warmup with another total T than it
had: it goes on from lr_k, the rate of step k, down the same cosine shape to the same floor
lr r at the new last step, so the rate never jumps (a run resumed inside the warmup needs
nothing: the cosine starts at the warmup's end whatever T is).  ``restart`` = (k, lr_k).

Exactly the operations of ``torch.optim.AdamW`` (single-tensor path) and
``torch.nn.utils.clip_grad_norm_``.  Pure functions: new dicts come back, inputs are
never written into.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..runtime import fused


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW, its schedule and clipping.  The defaults are `attngrad train`'s (TrainConfig
    holds one of these: the optimizer's options are declared here only)."""

    lr: float = 2e-3  # peak learning rate
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-9
    weight_decay: float = 0.01
    warmup: int = 100  # linear warmup steps
    min_lr_ratio: float = 0.05  # the cosine ends at lr * min_lr_ratio
    clip: float = 1.0  # max global gradient norm; 0 = no clipping

    def __post_init__(self):
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be finite and > 0; got {self.lr!r}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1); got {getattr(self, name)!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0; got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0; got {self.weight_decay!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0; got {self.warmup!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio!r}")
        if not self.clip >= 0:
            raise ValueError(f"clip must be >= 0 (0 = off); got {self.clip!r}")


def lr_at(step: int, total: int, cfg: AdamWConfig, restart=None) -> float:
    """Learning rate of update number ``step`` (1-based) out of ``total`` (O2, O3); after
    ``restart`` = (k, lr_k), the continued cosine of a changed total (O7)."""
    if restart is not None and step >= restart[0]:  # (at k itself: lr_k)
        k, lr_k = int(restart[0]), float(restart[1])
        s = min((step - k) / max(total - k, 1), 1.0)
        floor = cfg.lr * cfg.min_lr_ratio
        return floor + (lr_k - floor) * 0.5 * (1.0 + math.cos(math.pi * s))  # (O7)
    if cfg.warmup and step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup  # (O2)
    span = max(total - cfg.warmup, 1)
    s = min(max(step - cfg.warmup, 0) / span, 1.0)
    r = cfg.min_lr_ratio
    return cfg.lr * (r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * s)))  # (O3)


def global_norm(grads) -> float:
    """sqrt of the sum of squares of every gradient entry (computed in float64).

    NumPy gradients: one float64 vector of every entry, one dot product (einsum: no BLAS
    threads, the same bits whatever the thread count) instead of a reduction per array.
    """
    vals = list(grads.values())
    if vals and all(isinstance(g, np.ndarray) for g in vals):
        flat = np.concatenate([g.reshape(-1) for g in vals], dtype=np.float64)  # (n,)
        return math.sqrt(float(np.einsum("i,i->", flat, flat)))
    return math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in vals))


def clip_by_global_norm(grads, max_norm: float) -> tuple[dict, float]:
    """(clipped gradients, norm before clipping) (O1).  max_norm = 0: no clipping."""
    norm = global_norm(grads)
    if not math.isfinite(norm):
        raise FloatingPointError(f"gradient norm is {norm}; refusing to update")
    if max_norm <= 0:
        return dict(grads), norm
    coef = min(1.0, max_norm / (norm + 1e-6))  # (O1)
    if coef >= 1.0:
        return dict(grads), norm
    return {k: g * g.dtype.type(coef) for k, g in grads.items()}, norm  # (O1)


def decays(name: str, value) -> bool:
    """Weight decay applies to matrices (linear and attention weights, embeddings)."""
    return value.ndim >= 2


def adamw_init(params) -> dict:
    """Optimizer state: step count t and the moments m, v (same keys as the parameters)."""
    return {
        "t": 0,
        "m": {k: np.zeros_like(v) for k, v in params.items()},
        "v": {k: np.zeros_like(v) for k, v in params.items()},
    }


def adamw_step(params, grads, state, *, lr: float, cfg: AdamWConfig) -> tuple[dict, dict]:
    """One AdamW update (O4-O6).  Returns (new params, new state)."""
    if grads.keys() != params.keys():
        raise ValueError(
            f"grads must have the keys of params; missing {sorted(set(params) - set(grads))}, "
            f"unexpected {sorted(set(grads) - set(params))}"
        )
    t = state["t"] + 1
    b1, b2 = cfg.beta1, cfg.beta2
    bc1 = 1.0 - b1**t
    bc2_sqrt = math.sqrt(1.0 - b2**t)
    step_size = lr / bc1
    new_p, new_m, new_v = {}, {}, {}
    kernel = _kernel()
    coefs = {}  # (dtype, decayed) -> the kernel's scalars
    for k, p in params.items():
        g = grads[k]
        dt = p.dtype.type
        m, v = state["m"][k], state["v"][k]
        if kernel is not None and _same_arrays(p, g, m, v):
            decayed = bool(cfg.weight_decay) and decays(k, p)
            key = (p.dtype, decayed)
            if key not in coefs:
                decay = 1.0 - lr * cfg.weight_decay if decayed else 1.0
                coefs[key] = np.array([decay, 1.0 - b1, b2, 1.0 - b2, bc2_sqrt, cfg.eps, step_size],
                                      dtype=p.dtype)  # each rounded to the dtype once, as dt(...) below
            out = kernel(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1),
                         coefs[key])  # (O4)-(O6), the same bits as the lines below
            new_p[k], new_m[k], new_v[k] = (a.reshape(p.shape) for a in out)
            continue
        if cfg.weight_decay and decays(k, p):
            p = p * dt(1.0 - lr * cfg.weight_decay)  # (O4)
        m = m + dt(1.0 - b1) * (g - m)  # (O5) lerp, as torch
        v = v * dt(b2) + dt(1.0 - b2) * (g * g)  # (O5)
        denom = np.sqrt(v) / dt(bc2_sqrt) + dt(cfg.eps)  # (O6)
        new_p[k] = p - dt(step_size) * (m / denom)  # (O6)
        new_m[k], new_v[k] = m, v
    return new_p, {"t": t, "m": new_m, "v": new_v}


def _same_arrays(p, g, m, v) -> bool:
    """NumPy float32/float64 arrays of one dtype and shape (the compiled update's domain)."""
    return (all(isinstance(a, np.ndarray) for a in (p, g, m, v))
            and p.dtype in (np.float32, np.float64)
            and p.dtype == g.dtype == m.dtype == v.dtype and p.shape == g.shape == m.shape == v.shape)


_KERNEL = None  # the compiled update, False when unavailable


def _kernel():
    """:func:`._adamw_kernel.adamw_update` when the fused kernels are enabled (numba
    importable, ``ATTNGRAD_NO_NUMBA`` unset, as :func:`attngrad.runtime.fused.enabled`), else None."""
    global _KERNEL
    if not fused.enabled():
        return None
    if _KERNEL is None:
        try:
            from ._adamw_kernel import adamw_update
        except ImportError:  # pragma: no cover - numba missing
            _KERNEL = False
        else:
            _KERNEL = adamw_update
    return _KERNEL or None
