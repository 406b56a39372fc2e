"""Import from and export to ``torch.nn.MultiheadAttention``'s state_dict.

PyTorch stores ``in_proj_weight`` (3E, E) — or ``q_proj_weight`` (E, E),
``k_proj_weight`` (E, kdim), ``v_proj_weight`` (E, vdim) when kdim or vdim differ from
E — ``in_proj_bias`` (3E), ``out_proj.weight`` (E, E) and ``out_proj.bias`` (E), and
computes ``x @ weight.T``.  attngrad's weights are the transposes: W_q = q_weight.T.

PyTorch's ``key_padding_mask`` means True = *ignore*; attngrad's ``key_mask`` means
True = attend.  :func:`key_mask_from_torch` converts at this edge, and only here.
"""

from __future__ import annotations

import numpy as np

from .mha import BIASES


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


def params_from_torch(state_dict, *, dtype=None) -> dict:
    """attngrad parameters (NumPy arrays) from a MultiheadAttention state_dict or module."""
    if hasattr(state_dict, "state_dict"):
        state_dict = state_dict.state_dict()
    sd = {k: _np(v) for k, v in state_dict.items()}
    for unsupported in ("bias_k", "bias_v"):
        if unsupported in sd:
            raise ValueError(
                f"state_dict has {unsupported!r} (add_bias_kv=True), which attngrad does not support"
            )
    if "in_proj_weight" in sd:
        e = sd["in_proj_weight"].shape[0] // 3
        wq, wk, wv = (sd["in_proj_weight"][i * e : (i + 1) * e] for i in range(3))
    elif all(k in sd for k in ("q_proj_weight", "k_proj_weight", "v_proj_weight")):
        wq, wk, wv = sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"]
        e = wq.shape[0]
    else:
        raise ValueError(
            "state_dict must hold 'in_proj_weight' or 'q_proj_weight', 'k_proj_weight' and "
            f"'v_proj_weight'; got keys {sorted(sd)}"
        )
    if "out_proj.weight" not in sd:
        raise ValueError(f"state_dict must hold 'out_proj.weight'; got keys {sorted(sd)}")
    params = {"W_q": wq.T, "W_k": wk.T, "W_v": wv.T, "W_o": sd["out_proj.weight"].T}
    if "in_proj_bias" in sd:
        b = sd["in_proj_bias"]
        params.update(b_q=b[:e], b_k=b[e : 2 * e], b_v=b[2 * e :])
    if "out_proj.bias" in sd:
        params["b_o"] = sd["out_proj.bias"]
    return {k: np.array(v, dtype=dtype or v.dtype) for k, v in params.items()}


def params_to_torch(params) -> dict:
    """A state_dict (torch tensors) that ``torch.nn.MultiheadAttention`` loads.

    Uses ``in_proj_weight`` when kdim == vdim == E, else the separate projections.  Build
    the module with ``bias=True`` when the parameters have any bias (missing ones export
    as zeros) and with ``kdim``/``vdim`` matching W_k and W_v.
    """
    import torch

    wq, wk, wv, wo = (np.asarray(params[w]) for w in ("W_q", "W_k", "W_v", "W_o"))
    e = wq.shape[0]
    if wq.shape != (e, e) or wk.shape[1] != e or wv.shape[1] != e or wo.shape != (e, e):
        raise ValueError(
            "torch.nn.MultiheadAttention needs H*D = H*Dv = E and Hkv = H; got W_q "
            f"{wq.shape}, W_k {wk.shape}, W_v {wv.shape}, W_o {wo.shape}"
        )
    sd = {}
    if wk.shape[0] == e and wv.shape[0] == e:
        sd["in_proj_weight"] = np.concatenate([wq.T, wk.T, wv.T])
    else:
        sd.update(q_proj_weight=wq.T, k_proj_weight=wk.T, v_proj_weight=wv.T)
    if any(b in params for b in BIASES):
        z = np.zeros(e, dtype=wq.dtype)
        sd["in_proj_bias"] = np.concatenate([np.asarray(params.get(b, z)) for b in BIASES[:3]])
        sd["out_proj.bias"] = np.asarray(params.get("b_o", z))
    sd["out_proj.weight"] = wo.T
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def key_mask_from_torch(key_padding_mask):
    """PyTorch's key_padding_mask (True = ignore) -> attngrad's key_mask (True = attend)."""
    kind = str(key_padding_mask.dtype).rsplit(".", 1)[-1]
    if kind != "bool":
        raise TypeError(f"key_padding_mask must be boolean; got dtype {kind}")
    return ~key_padding_mask
