"""Figures of a run: the loss curve and attention maps (matplotlib, optional)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

TITLES = {
    "encoder_self": "encoder self-attention",
    "decoder_causal": "decoder causal self-attention",
    "cross": "cross-attention (decoder queries, encoder keys)",
}


MISSING = "the figures need matplotlib: pip install 'attngrad[plot]' (or train with --no-plots)"


def require_matplotlib() -> None:
    """ImportError saying which extra to install, before a run that will draw figures."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(MISSING)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    return plt


def _plain_log_ticks(ax) -> None:
    """Log-scale y ticks written as plain numbers (2, 3, 5), not as 2 x 10^0; the minor
    ticks labelled only as far as they do not pile up (axis spans of a decade or more: none;
    under a decade: 2, 3, 5; under a third of one: every one)."""
    import math

    from matplotlib.ticker import FuncFormatter

    def minor(v, _):
        lo, hi = ax.get_ylim()
        span = math.log10(hi / lo) if lo > 0 and hi > lo else 1.0
        if v <= 0 or span >= 1.0:
            return ""
        m = round(v / 10 ** math.floor(math.log10(v) + 1e-9), 6)
        return f"{v:g}" if span < 0.35 or m in (2.0, 3.0, 5.0) else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _legend_below(ax) -> None:
    """The legend under the axes, where it covers no curve."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, fontsize=8, frameon=False)


def plot_loss_curve(records: list, png, unit: str = "byte") -> Path:
    """Training loss per step (raw and smoothed) with the held-out metric: exact match for
    the toy tasks; for a text run (--data) validation loss, the unigram baseline and, in a
    second panel, validation perplexity."""
    plt = _pyplot()
    steps = np.array([r["step"] for r in records if "loss" in r])
    loss = np.array([r["loss"] for r in records if "loss" in r])
    val = [r for r in records if "val_loss" in r]
    fig, axes = plt.subplots(1, 2 if val else 1, figsize=(10.5 if val else 6.4, 4.4), dpi=100,
                             squeeze=False, layout="constrained")
    ax = axes[0][0]
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="training loss (per step)")
    if len(loss) >= 20:
        k = max(len(loss) // 50, 5)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, color="tab:blue", lw=1.5, label=f"training loss (mean of {k})")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.set_xlabel("step")
    ax.grid(True, which="both", alpha=0.25)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color="tab:orange",
                label="validation loss")
        if "val_unigram_loss" in val[-1]:
            u = val[-1]["val_unigram_loss"]
            ax.axhline(u, color="tab:red", ls="--", lw=1, label=f"unigram baseline ({u:.3f})")
        ax.set_ylabel(f"cross-entropy (nats per {unit})")
        ax.set_title("Loss of the language model")
        _legend_below(ax)
        ax2 = axes[0][1]
        ax2.plot([r["step"] for r in val], [r["val_ppl"] for r in val], "o-", color="tab:orange")
        ax2.set_yscale("log")
        _plain_log_ticks(ax2)
        ax2.set_xlabel("step")
        ax2.set_ylabel("validation perplexity exp(loss)")
        ax2.set_title(f"Validation perplexity (last {val[-1]['val_ppl']:.2f})")
        ax2.grid(True, which="both", alpha=0.25)
    else:
        ax.set_ylabel("cross-entropy (nats per token)")
        ax.set_title("Training loss and held-out exact match")
        ev = [(r["step"], r["eval_exact"]) for r in records if "eval_exact" in r]
        if ev:
            ax2 = ax.twinx()
            ax2.plot(*zip(*ev, strict=True), "o-", color="tab:orange", label="held-out exact match")
            ax2.set_ylim(0, 1.02)
            ax2.set_ylabel("held-out exact match")
            ax2.legend(loc="upper center", bbox_to_anchor=(0.8, -0.16), fontsize=8, frameon=False)
        ax.legend(loc="upper center", bbox_to_anchor=(0.3, -0.16), fontsize=8, frameon=False)
    fig.savefig(png)
    plt.close(fig)
    return Path(png)


def plot_attention(maps: list, labels: tuple, title: str, png) -> Path:
    """One row per layer, one column per head: maps[l] is (H, Lq, Lk) for one sample."""
    plt = _pyplot()
    n_layers, n_heads = len(maps), maps[0].shape[0]
    qlab, klab = labels
    cell = 0.13 * max(len(qlab), len(klab)) + 0.7
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(cell * n_heads + 1.0, cell * n_layers + 0.6),
                             dpi=90, squeeze=False, layout="constrained")
    for l in range(n_layers):
        for h in range(n_heads):
            ax = axes[l][h]
            im = ax.imshow(maps[l][h], cmap="viridis", vmin=0, vmax=1, aspect="auto")
            ax.set_title(f"layer {l} head {h}", fontsize=8)
            ax.set_xticks(range(len(klab)), klab, fontsize=6, rotation=90)
            ax.set_yticks(range(len(qlab)), qlab, fontsize=6)
            if l == n_layers - 1:
                ax.set_xlabel("key", fontsize=7)
            if h == 0:
                ax.set_ylabel("query", fontsize=7)
    fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight P[query, key]")
    fig.suptitle(title, fontsize=10)
    fig.savefig(png)
    plt.close(fig)
    return Path(png)


def plot_attention_maps(maps: dict, labels: dict, out) -> list:
    """PNGs of every attention flavor of one sample: ``maps[name]`` holds one (B, H, Lq, Lk)
    array per layer (the first sample is drawn), ``labels[name]`` its (query, key) labels
    (as :func:`attngrad.train.loop.attention_for` returns them)."""
    paths = []
    for name, per_layer in maps.items():
        qlab, klab = labels[name]
        sample = [np.asarray(p[0], dtype=np.float64)[:, : len(qlab), : len(klab)] for p in per_layer]
        paths.append(plot_attention(sample, (qlab, klab), TITLES[name], Path(out) / f"attention_{name}.png"))
    return paths
