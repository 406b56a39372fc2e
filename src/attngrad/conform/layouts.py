"""How q, k, v and dOut reach a target: the layout probes (RELIABILITY 31).

A kernel that reads its inputs as if contiguous is right on contiguous tensors and wrong on
the views real models pass (FlashAttention #2541: NaN dV on views of a fused QKV).  A case's
``layout`` rebuilds the same values as views of fresh buffers, in the protocol's own order
(``bhld``: (B, H, L, X), the sdpa and explicit protocols; ``blhd``: (B, L, H, X), flash;
``packed``: (total, H, X), flash_varlen):

- ``fused``: q, k, v slices of one (tokens, H*D + Hkv*D + Hkv*Dv) projection output (K and V
  alone when Lq != Lk), viewed per head;
- ``transposed``: each stored with its heads and length axes exchanged, passed transposed;
- ``expand``: K and V a zero-stride view over the kv heads (the case's values are the same
  in every kv head);
- ``flipped``: a negative stride on the last axis (NumPy only; torch has none).

:func:`views` builds NumPy views; :func:`torch_views` the same views (same strides, same
sharing) of torch buffers, each a non-leaf whose ``.grad`` is retained.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .cases import LAYOUT_TEXT

HEADS = {"bhld": 1, "blhd": 2, "packed": 1}  # the heads axis of each order
LENGTH = {"bhld": 2, "blhd": 1, "packed": 0}


class View(NamedTuple):
    array: np.ndarray  # the view
    owner: np.ndarray  # the contiguous buffer it reads (shared by views of one buffer)


def _token_major(x: np.ndarray, order: str) -> np.ndarray:
    """(B, H, L, X) -> (B, L, H, X); the other orders are token-major already."""
    return x.transpose(0, 2, 1, 3) if order == "bhld" else x


def _fused(arrays: dict, order: str) -> dict:
    names = [n for n in ("q", "k", "v") if n in arrays]
    tm = {n: _token_major(arrays[n], order) for n in names}  # (..., L, H, X) token-major
    groups = [names]
    if tm["q"].shape[:-2] != tm["k"].shape[:-2]:  # Lq != Lk: q from a projection of its own
        groups = [["q"], ["k", "v"]]
    out = {}
    for group in groups:
        lead = tm[group[0]].shape[:-2]  # (B, L) or (T,)
        widths = [tm[n].shape[-2] * tm[n].shape[-1] for n in group]
        owner = np.empty((*lead, sum(widths)), dtype=tm[group[0]].dtype)  # (..., L, H*D + ...)
        start = 0
        for n, w in zip(group, widths, strict=True):
            owner[..., start:start + w] = tm[n].reshape(*lead, w)
            piece = owner[..., start:start + w].reshape(tm[n].shape)  # (..., L, H, X) a view
            assert np.shares_memory(piece, owner)
            out[n] = View(piece.transpose(0, 2, 1, 3) if order == "bhld" else piece, owner)
            start += w
    return out


def views(arrays: dict, layout: str, order: str) -> dict:
    """``arrays`` (name -> array in ``order``) as :class:`View` objects of ``layout``; dout and
    anything the layout does not touch stay contiguous copies."""
    if layout not in LAYOUT_TEXT and layout != "contiguous":
        raise ValueError(f"layout must be one of contiguous, {', '.join(LAYOUT_TEXT)}; got {layout!r}")
    out = {}
    if layout == "fused":
        out = _fused(arrays, order)
    for name, x in arrays.items():
        if name in out:
            continue
        if layout == "transposed":
            h, n = HEADS[order], LENGTH[order]
            axes = list(range(x.ndim))
            axes[h], axes[n] = axes[n], axes[h]
            owner = np.ascontiguousarray(x.transpose(axes))
            out[name] = View(owner.transpose(axes), owner)
        elif layout == "expand" and name in ("k", "v"):
            owner = np.ascontiguousarray(np.take(x, [0], axis=HEADS[order]))
            view = np.broadcast_to(owner, x.shape)  # read-only, as torch's expand refuses writes
            if not np.array_equal(view, x):
                raise ValueError("layout expand needs K and V equal in every kv head")
            out[name] = View(view, owner)
        elif layout == "flipped":
            owner = np.ascontiguousarray(x[..., ::-1])
            out[name] = View(owner[..., ::-1], owner)
        else:
            owner = np.ascontiguousarray(x)
            out[name] = View(owner, owner)
    return out


def arrays_of(vs: dict) -> dict:
    """name -> the NumPy view."""
    return {n: v.array for n, v in vs.items()}


def _geometry(view: View) -> tuple:
    """(shape, strides, offset) of a view in elements of its owner."""
    size = view.array.itemsize
    if any(s < 0 for s in view.array.strides):
        raise ValueError("torch tensors cannot have negative strides (layout flipped is NumPy only)")
    offset = (view.array.__array_interface__["data"][0] - view.owner.__array_interface__["data"][0]) // size
    return view.array.shape, tuple(s // size for s in view.array.strides), int(offset)


def torch_views(torch, vs: dict, dtype, device="cpu", grad=("q", "k", "v")) -> dict:
    """name -> a torch view of the same geometry, on buffers of ``dtype`` on ``device`` (one
    buffer per NumPy owner, so fused views share memory); the names in ``grad`` require grad
    and retain it (their ``.grad`` is the gradient of the view itself)."""
    owners: dict = {}
    out = {}
    for name, v in vs.items():
        key = id(v.owner)
        if key not in owners:
            base = torch.from_numpy(np.ascontiguousarray(v.owner)).to(dtype).to(device)
            if any(n in grad and vs[n].owner is v.owner for n in vs):
                base.requires_grad_()
            owners[key] = base
        base = owners[key]
        shape, strides, offset = _geometry(v)
        t = base.as_strided(shape, strides, offset)
        if name in grad and t.requires_grad:
            t.retain_grad()
        out[name] = t
    return out
