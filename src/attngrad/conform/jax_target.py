"""The JAX target: jax.nn.dot_product_attention, gradients by jax.vjp."""

from __future__ import annotations

import numpy as np

from .inputs import CaseInputs
from .result import Result


def jax_dpa(problem: CaseInputs) -> Result:
    """jax.nn.dot_product_attention on (B, L, H, D) arrays, gradients by jax.vjp."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    c, o = problem.case, problem.options
    dt = {"float64": jnp.float64, "float32": jnp.float32, "float16": jnp.float16,
          "bfloat16": jnp.bfloat16}[c.dtype]
    q, k, v = (jnp.asarray(np.swapaxes(a, 1, 2), dtype=dt) for a in (problem.q, problem.k, problem.v))
    kwargs: dict = {"scale": o["scale"]}
    if c.causal != "none":
        kwargs["is_causal"] = True
    if "key_lengths" in o:
        kwargs["key_value_seq_lengths"] = jnp.asarray(o["key_lengths"], dtype=jnp.int32)
    if "mask" in o:
        kwargs["mask"] = jnp.asarray(o["mask"])
    if "window" in o:
        left, right = o["window"]
        kwargs["local_window_size"] = (-1 if left is None else left, -1 if right is None else right)
    params = [q, k, v]
    if "bias" in o:
        bias = jnp.asarray(np.reshape(o["bias"], (1,) * (4 - o["bias"].ndim) + o["bias"].shape), dtype=dt)
        params.append(bias)

    def f(q, k, v, *rest):
        extra = {"bias": rest[0]} if rest else {}
        return jax.nn.dot_product_attention(q, k, v, **kwargs, **extra)

    out, vjp = jax.vjp(f, *params)
    cot = vjp(jnp.asarray(np.swapaxes(problem.dout, 1, 2), dtype=dt))
    grads = {n: np.swapaxes(np.asarray(g, np.float64), 1, 2) for n, g in zip("qkv", cot[:3], strict=True)}
    if "bias" in c.learned:
        grads["bias"] = np.reshape(np.asarray(cot[3], np.float64), o["bias"].shape)
    return Result(np.swapaxes(np.asarray(out, np.float64), 1, 2), grads)

