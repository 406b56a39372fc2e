"""What a check run will cost, decided before it starts.

Finite differences element by element cost two forward passes per entry of every input
and parameter: right for the small default case (a few hundred entries), hopeless at
``--lq 128 --lk 128`` (22 s) and beyond.  Above ``FULL_FD_MAX`` entries per case the check
runs along ``DIRECTIONS`` random unit directions per gradient instead (finite_diff.py).

The estimates are rough on purpose (a small factor either way): they tell a run of
seconds from a run of hours, and a case that fits in memory from one that cannot, so
that the second kind is refused with the estimate before any work.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.tiled import AUTO_TILED_MIN_ENTRIES  # impl="auto" keeps P below this many logits
from .cases import SDPA_SUFFIX, CheckConfig

FULL_FD_MAX = 1024  # entries (inputs + parameters) of a case checked element by element
DIRECTIONS = 4  # random directions per gradient above that
SECONDS_PER_CALL = 2e-3  # Python and NumPy overhead of one small forward (1-2 ms)
FLOPS_PER_SECOND = 1e9  # float64, one core, conservative
TIME_LIMIT = 1800.0  # refuse runs estimated to take longer than this (seconds)


class CheckBudget(NamedTuple):
    memory: float  # peak bytes, estimate
    seconds: float  # wall time, estimate
    full_fd: dict  # case label (flavor, or "flavor (sdpa)") -> True (element by element) or False (random directions)


def entries(cfg: CheckConfig, flavor: str) -> int:
    """Entries of the inputs and parameters of ``flavor``'s case (what finite differences perturb);
    ``"self (sdpa)"``: of the flavor's sdpa-level case (q, k, v and the learned variants)."""
    sdpa = flavor.endswith(SDPA_SUFFIX)
    flavor = flavor.removesuffix(SDPA_SUFFIX)
    lq, lk = cfg.lengths(flavor)
    e, hkv, h = cfg.width, cfg.num_kv_heads, cfg.heads
    learned = {"sinks": h, "alibi": h + h * lq * lk, "scale": 1}  # sinks, slopes + Bias, scale (V1-V7)
    if sdpa:
        d = e // h
        return cfg.batch * d * (h * lq + 2 * hkv * lk) + sum(learned.get(v, 0) for v in cfg.variants)
    ekv = e // h * hkv  # K and V projection widths under grouped-query attention
    params = e * e * 2 + e * ekv * 2 + ((e * 2 + ekv * 2) if cfg.bias else 0)
    inputs = cfg.batch * lq * e + (cfg.batch * lk * e if flavor == "cross" else 0)
    if "gate" in cfg.variants:  # W_g, b_g: (E, H) headwise, (E, E) elementwise
        params += (e + 1) * (h if flavor != "cross" else e)
    return params + inputs + sum(learned.get(v, 0) for v in cfg.variants)


def _forward_flops(cfg: CheckConfig, flavor: str) -> float:
    lq, lk = cfg.lengths(flavor)
    b, e, h = cfg.batch, cfg.width, cfg.heads
    projections = 4.0 * b * e * e * (lq + lk)
    attention = 4.0 * b * lq * lk * e + 20.0 * b * h * lq * lk  # QK^T, PV, softmax
    return projections + attention


def estimate(cfg: CheckConfig, *, torch: bool) -> CheckBudget:
    """Memory and time of ``run_check(cfg)``, and which finite-difference mode each flavor gets."""
    seconds, memory, full = 0.0, 0.0, {}
    item = 8  # the finite differences and the float64 reference work in float64 whatever the dtype
    for label in (lab for f in cfg.flavors for lab in cfg.case_labels(f)):
        flavor = label.removesuffix(SDPA_SUFFIX)
        lq, lk = cfg.lengths(flavor)
        logits = cfg.batch * cfg.heads * lq * lk
        n = entries(cfg, label)
        full[label] = n <= FULL_FD_MAX
        call = SECONDS_PER_CALL + _forward_flops(cfg, flavor) / FLOPS_PER_SECOND
        seconds += 3 * call  # closed-form forward + backward
        if torch:
            seconds += 4 * call
        if cfg.dtype == "float64":
            calls = 2 * n if full[label] else 2 * DIRECTIONS * 10  # at most 10 gradients
            seconds += calls * call
        per_logit = (4 * item if logits < AUTO_TILED_MIN_ENTRIES else 0)  # the dense path: S, P, dP, dS
        per_logit += 6 * item + 2 if torch else 0  # autograd keeps scores, probabilities, masks, grads
        per_logit += item + 1 if "random" in cfg.masks else 0  # the random mask and its draw
        tiles = 16 * cfg.batch * cfg.heads * (lq + lk) * (cfg.width // cfg.heads) * item  # tiled path
        arrays = 12 * n * item  # parameters, inputs, gradients, references, perturbed copies
        memory = max(memory, logits * per_logit + tiles + arrays)
    return CheckBudget(float(memory), float(seconds), full)
