"""attngrad inside PyTorch: drop-ins whose backward is attngrad's closed form.

    from attngrad.torch import scaled_dot_product_attention, MultiheadAttention

``scaled_dot_product_attention`` replaces ``torch.nn.functional.scaled_dot_product_attention``
and ``MultiheadAttention`` replaces ``torch.nn.MultiheadAttention`` (same constructor,
parameters, state_dict keys, forward signature and mask conventions).  Their forward and
backward are computed by attngrad: the ``attngrad::sdpa`` custom op (:mod:`.ops`, opcheck-
and ``torch.compile(fullgraph=True)``-clean) and :func:`attngrad.mha_forward` /
:func:`attngrad.mha_backward`.  CPU tensors run on zero-copy NumPy views with
``impl="auto"`` (the tiled/compiled path where it pays); other devices the dense path.
``scaled_dot_product_attention`` also takes ``kv_indices=`` (top-k attention) and
``return_lse=True``; ``varlen_attention`` takes packed sequences (``flash_attn_varlen_func``'s
layout, the ``attngrad::varlen`` op); ``flex_attention`` replaces
``torch.nn.attention.flex_attention.flex_attention`` on CPU with a backward attngrad derives
from the score function (the ``attngrad::flex`` op).

Needs the ``torch`` extra: ``pip install 'attngrad[torch]'``.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (absolute: PyTorch itself, not this package)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attngrad.torch needs PyTorch; install it with: pip install 'attngrad[torch]'"
    ) from exc

from attngrad.torch.flex import flex_attention
from attngrad.torch.mha import MultiheadAttention
from attngrad.torch.sdpa import scaled_dot_product_attention
from attngrad.torch.varlen import varlen_attention

__all__ = ["MultiheadAttention", "flex_attention", "scaled_dot_product_attention", "varlen_attention"]
