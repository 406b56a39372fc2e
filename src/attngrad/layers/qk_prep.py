"""What the attention layer does to its per-head queries and keys between the projection
(M1) and the attention core (A1): QK-norm, then RoPE (docs/equations.md, QN1-QN6, R1-R5).

    Q_h <- RoPE(norm(Q_h; q_norm_w), q_positions)                           (QN7)
    K_h <- RoPE(norm(K_h; k_norm_w), k_positions)
backward, read bottom-up:
    dQ_h <- norm_backward(RoPE_backward(dQ_h))                              (QN8)
    dq_norm_w = sum over batch, heads and rows of (QN4); likewise K

norm is RMSNorm or weight-only LayerNorm over the head dim D; the weights q_norm_w and
k_norm_w (D,) are shared by every head, as in OLMo-2, Qwen3 and Gemma-3.  Either step may
be off.  With grouped-query attention the keys have Hkv heads; nothing changes.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.rope import RoPE, RoPECache, check_positions, make_rope, rope_backward, rope_forward
from .norm import NormCache, check_eps, check_kind, norm_backward, norm_forward

NORM_WEIGHTS = ("q_norm_w", "k_norm_w")


class QKPrepCache(NamedTuple):
    """Records of the norms and rotations.  Memory: the norms' xhat (the size of Q and K)
    and the rotations' cos/sin tables ((L, R/2) each)."""

    q_norm: NormCache | None
    k_norm: NormCache | None
    q_rope: RoPECache | None
    k_rope: RoPECache | None


class QKOptions(NamedTuple):
    rope: RoPE | None
    qk_norm: str | None  # None, "rms" or "layer"
    eps: float

    @property
    def active(self) -> bool:
        return self.rope is not None or self.qk_norm is not None


def check_qk_options(params, rope, qk_norm, qk_norm_eps, head_dim: int) -> QKOptions:
    """Validate ``rope=``, ``qk_norm=``, ``qk_norm_eps=`` against the parameters."""
    rope = make_rope(rope)
    if qk_norm is not None:
        check_kind(qk_norm, "qk_norm")
    eps = check_eps(qk_norm_eps, "qk_norm_eps")
    have = [w for w in NORM_WEIGHTS if w in params]
    if qk_norm is None and have:
        raise ValueError(f"params has {have} but qk_norm is None; pass qk_norm='rms' or 'layer'")
    if qk_norm is not None:
        missing = [w for w in NORM_WEIGHTS if w not in params]
        if missing:
            raise ValueError(
                f"qk_norm={qk_norm!r} needs params {list(NORM_WEIGHTS)} of shape (D,) = "
                f"({head_dim},); missing {missing}"
            )
        for w in NORM_WEIGHTS:
            if tuple(params[w].shape) != (head_dim,):
                raise ValueError(
                    f"params[{w!r}] must have shape (D,) = ({head_dim},); got {tuple(params[w].shape)}"
                )
    return QKOptions(rope, qk_norm, eps)


def qk_prep_forward(params, q, k, opts: QKOptions):
    """q (B, H, Lq, D), k (B, Hkv, Lk, D) -> (q', k', cache)."""
    qn = kn = qr = kr = None
    if opts.qk_norm is not None:
        q, qn = norm_forward(q, params["q_norm_w"], kind=opts.qk_norm, eps=opts.eps,
                             x_name="q", w_name="params['q_norm_w']")  # (QN7) (B, H, Lq, D)
        k, kn = norm_forward(k, params["k_norm_w"], kind=opts.qk_norm, eps=opts.eps,
                             x_name="k", w_name="params['k_norm_w']")  # (QN7) (B, Hkv, Lk, D)
    if opts.rope is not None:
        r = opts.rope
        b = q.shape[0]
        qpos = check_positions(r.q_positions, b, q.shape[2], "rope q_positions")  # (Lq,) or (B, Lq)
        kpos = check_positions(r.k_positions, b, k.shape[2], "rope k_positions")  # (Lk,) or (B, Lk)
        kw = dict(rotary_dim=r.rotary_dim, base=r.base, layout=r.layout, frequencies=r.frequencies)
        q, qr = rope_forward(q, qpos, **kw)  # (QN7) (B, H, Lq, D)
        k, kr = rope_forward(k, kpos, **kw)  # (QN7) (B, Hkv, Lk, D)
    return q, k, QKPrepCache(qn, kn, qr, kr)


def qk_prep_backward(dq, dk, cache: QKPrepCache):
    """dq (B, H, Lq, D), dk (B, Hkv, Lk, D) -> (dq, dk, grads of q_norm_w / k_norm_w)."""
    grads = {}
    if cache.q_rope is not None:
        dq = rope_backward(dq, cache.q_rope)  # (QN8) (R5) (B, H, Lq, D)
        dk = rope_backward(dk, cache.k_rope)  # (QN8) (R5) (B, Hkv, Lk, D)
    if cache.q_norm is not None:
        dq, grads["q_norm_w"] = norm_backward(dq, cache.q_norm, dy_name="dq")  # (QN8) (QN4-QN6)
        dk, grads["k_norm_w"] = norm_backward(dk, cache.k_norm, dy_name="dk")  # (QN8) (QN4-QN6)
    return dq, dk, grads
