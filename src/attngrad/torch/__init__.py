"""attngrad inside PyTorch: drop-ins whose backward is attngrad's closed form.

    from attngrad.torch import scaled_dot_product_attention, MultiheadAttention

``scaled_dot_product_attention`` replaces ``torch.nn.functional.scaled_dot_product_attention``
and ``MultiheadAttention`` replaces ``torch.nn.MultiheadAttention`` (same constructor,
parameters, state_dict keys, forward signature and mask conventions).  Their forward and
backward are computed by attngrad (:func:`attngrad.sdpa_forward` / :func:`attngrad.sdpa_backward`,
:func:`attngrad.mha_forward` / :func:`attngrad.mha_backward`) on the tensors' own device,
through the array API path; torch autograd only chains them into the rest of a model.

Needs the ``torch`` extra: ``pip install 'attngrad[torch]'``.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (absolute: PyTorch itself, not this package)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attngrad.torch needs PyTorch; install it with: pip install 'attngrad[torch]'"
    ) from exc

from attngrad.torch.mha import MultiheadAttention
from attngrad.torch.sdpa import scaled_dot_product_attention

__all__ = ["MultiheadAttention", "scaled_dot_product_attention"]
