"""Import from and export to ``torch.nn.MultiheadAttention``'s state_dict.

PyTorch stores ``in_proj_weight`` (3E, E) — or ``q_proj_weight`` (E, E),
``k_proj_weight`` (E, kdim), ``v_proj_weight`` (E, vdim) when kdim or vdim differ from
E — ``in_proj_bias`` (3E), ``out_proj.weight`` (E, E) and ``out_proj.bias`` (E), and
computes ``x @ weight.T``.  attngrad's weights are the transposes: W_q = q_weight.T.

PyTorch's ``key_padding_mask`` means True = *ignore*; attngrad's ``key_mask`` means
True = attend.  :func:`key_mask_from_torch` converts at this edge, and only here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..runtime._xp import check_float_dtypes, dtype_name, is_array
from .mha import BIASES, WEIGHTS, check_dtype, check_param_arrays, check_params
from .qk_prep import NORM_WEIGHTS

_IN_PROJ = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
STATE_KEYS = ("in_proj_weight", *_IN_PROJ, "in_proj_bias", "out_proj.weight", "out_proj.bias")


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


def _state_arrays(state_dict) -> dict:
    """The state_dict's entries as NumPy arrays, each a real floating array."""
    if hasattr(state_dict, "state_dict") and callable(state_dict.state_dict):
        state_dict = state_dict.state_dict()
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "state_dict must be a torch.nn.MultiheadAttention or its state_dict (a mapping of "
            f"tensors); got {type(state_dict).__name__}"
        )
    for unsupported in ("bias_k", "bias_v"):
        if unsupported in state_dict:
            raise ValueError(
                f"state_dict has {unsupported!r} (add_bias_kv=True), which attngrad does not support"
            )
    unknown = sorted(str(k) for k in state_dict if k not in STATE_KEYS)
    if unknown:
        raise ValueError(
            f"state_dict has keys {unknown} that torch.nn.MultiheadAttention does not have; "
            f"expected some of {list(STATE_KEYS)}"
        )
    for name, t in state_dict.items():
        if not is_array(t):
            raise TypeError(f"state_dict[{name!r}] must be a tensor or array; got {type(t).__name__}")
        check_float_dtypes({f"state_dict[{name!r}]": t})
        if dtype_name(t.dtype) == "bfloat16":
            raise TypeError(f"state_dict[{name!r}] is bfloat16, which NumPy cannot hold; convert the "
                            "module or state_dict to float32 or float64 first")
    return {k: _np(v) for k, v in state_dict.items()}


def _want(sd: dict, name: str, shape: tuple, layout: str) -> np.ndarray:
    """sd[name], which must have ``shape``, or ValueError naming the key and the shape."""
    a = sd[name]
    if a.shape != shape:
        raise ValueError(
            f"state_dict[{name!r}] must have shape {layout} = {shape}; got {a.shape}"
        )
    return a


def params_from_torch(state_dict, *, dtype=None) -> dict:
    """attngrad parameters (NumPy arrays) from a MultiheadAttention state_dict or module.

    Every entry is checked against the shapes the module would have: ``in_proj_weight``
    (3E, E), or ``q_proj_weight`` (E, E), ``k_proj_weight`` (E, kdim), ``v_proj_weight``
    (E, vdim); ``in_proj_bias`` (3E,), ``out_proj.weight`` (E, E), ``out_proj.bias`` (E,).
    """
    sd = _state_arrays(state_dict)
    if dtype is not None:
        dtype = check_dtype(dtype)
    if "out_proj.weight" not in sd:
        raise ValueError(f"state_dict must hold 'out_proj.weight'; got keys {sorted(sd)}")
    wo = sd["out_proj.weight"]
    if wo.ndim != 2 or wo.shape[0] != wo.shape[1] or wo.shape[0] < 1:
        raise ValueError(f"state_dict['out_proj.weight'] must have shape (E, E); got {wo.shape}")
    e = wo.shape[0]
    separate = [k for k in _IN_PROJ if k in sd]
    if "in_proj_weight" in sd and separate:
        raise ValueError(f"state_dict holds both 'in_proj_weight' and {separate}; expected one of them")
    if "in_proj_weight" in sd:
        w = _want(sd, "in_proj_weight", (3 * e, e), "(3E, E)")
        wq, wk, wv = (w[i * e : (i + 1) * e] for i in range(3))
    elif len(separate) == 3:
        wq = _want(sd, "q_proj_weight", (e, e), "(E, E)")
        for name, dim in (("k_proj_weight", "kdim"), ("v_proj_weight", "vdim")):
            if sd[name].ndim != 2 or sd[name].shape[0] != e or sd[name].shape[1] < 1:
                raise ValueError(
                    f"state_dict[{name!r}] must have shape (E, {dim}) = ({e}, {dim}); got "
                    f"{sd[name].shape}"
                )
        wk, wv = sd["k_proj_weight"], sd["v_proj_weight"]
    else:
        raise ValueError(
            "state_dict must hold 'in_proj_weight' or 'q_proj_weight', 'k_proj_weight' and "
            f"'v_proj_weight'; got keys {sorted(sd)}"
        )
    params = {"W_q": wq.T, "W_k": wk.T, "W_v": wv.T, "W_o": wo.T}
    if "in_proj_bias" in sd:
        b = _want(sd, "in_proj_bias", (3 * e,), "(3E,)")
        params.update(b_q=b[:e], b_k=b[e : 2 * e], b_v=b[2 * e :])
    if "out_proj.bias" in sd:
        params["b_o"] = _want(sd, "out_proj.bias", (e,), "(E,)")
    # row-major copies (the weights' transposes would keep torch's layout as column-major views)
    return {k: np.array(v, dtype=dtype or v.dtype, order="C") for k, v in params.items()}


def params_to_torch(params) -> dict:
    """A state_dict (torch tensors) that ``torch.nn.MultiheadAttention`` loads.

    Uses ``in_proj_weight`` when kdim == vdim == E, else the separate projections.  Build
    the module with ``bias=True`` when the parameters have any bias (missing ones export
    as zeros) and with ``kdim``/``vdim`` matching W_k and W_v.  ``params`` is checked as
    :func:`attngrad.mha_forward` checks it (names, shapes, one floating dtype).
    """
    import torch

    check_param_arrays(params)
    if any(w in params for w in NORM_WEIGHTS):
        raise ValueError(
            "torch.nn.MultiheadAttention has no QK-norm: params with q_norm_w / k_norm_w "
            "cannot be exported to it"
        )
    other = sorted(set(params) - set(WEIGHTS + BIASES))
    if other:
        raise ValueError(
            f"params has {other}, which torch.nn.MultiheadAttention has no place for; it takes "
            f"{list(WEIGHTS)} and {list(BIASES)} only"
        )
    check_float_dtypes(dict(params))
    wq, wk, wv, wo = (_np(params[w]) for w in WEIGHTS)
    e = wq.shape[0]
    if wq.shape != (e, e) or wk.shape[1] != e or wv.shape[1] != e or wo.shape != (e, e):
        raise ValueError(
            "torch.nn.MultiheadAttention needs H*D = H*Dv = E and Hkv = H; got W_q "
            f"{wq.shape}, W_k {wk.shape}, W_v {wv.shape}, W_o {wo.shape}"
        )
    check_params(params, 1)  # the bias lengths
    sd = {}
    if wk.shape[0] == e and wv.shape[0] == e:
        sd["in_proj_weight"] = np.concatenate([wq.T, wk.T, wv.T])
    else:
        sd.update(q_proj_weight=wq.T, k_proj_weight=wk.T, v_proj_weight=wv.T)
    if any(b in params for b in BIASES):
        z = np.zeros(e, dtype=wq.dtype)
        sd["in_proj_bias"] = np.concatenate([_np(params[b]) if b in params else z for b in BIASES[:3]])
        sd["out_proj.bias"] = _np(params["b_o"]) if "b_o" in params else z
    sd["out_proj.weight"] = wo.T
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def key_mask_from_torch(key_padding_mask):
    """PyTorch's key_padding_mask (True = ignore) -> attngrad's key_mask (True = attend).

    A boolean tensor or NumPy array (B, Lk); the result is of the same kind."""
    if not is_array(key_padding_mask):
        raise TypeError(
            "key_padding_mask must be a boolean tensor or NumPy array (B, Lk); got "
            f"{type(key_padding_mask).__name__}"
        )
    kind = dtype_name(key_padding_mask.dtype)
    if kind != "bool":
        raise TypeError(f"key_padding_mask must be boolean (True = ignore); got dtype {kind}")
    return ~key_padding_mask
