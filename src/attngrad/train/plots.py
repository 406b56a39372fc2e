"""Figures of a run: the loss curve and attention maps (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TITLES = {
    "encoder_self": "encoder self-attention",
    "decoder_causal": "decoder causal self-attention",
    "cross": "cross-attention (decoder queries, encoder keys)",
}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "plots need matplotlib: pip install 'attngrad[plot]' (or train with --no-plots)"
        ) from exc
    return plt


def plot_loss_curve(records: list, png) -> Path:
    """Training loss per step (raw and smoothed) and held-out exact match."""
    plt = _pyplot()
    steps = np.array([r["step"] for r in records if "loss" in r])
    loss = np.array([r["loss"] for r in records if "loss" in r])
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="loss")
    if len(loss) >= 20:
        k = max(len(loss) // 50, 5)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, color="tab:blue", lw=1.5, label=f"loss (mean of {k})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ev = [(r["step"], r["eval_exact"]) for r in records if "eval_exact" in r]
    if ev:
        ax2 = ax.twinx()
        ax2.plot(*zip(*ev, strict=True), "o-", color="tab:orange", label="held-out exact match")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("held-out exact match")
        ax2.legend(loc="center right", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return Path(png)


def plot_attention(maps: list, labels: tuple, title: str, png) -> Path:
    """One row per layer, one column per head: maps[l] is (H, Lq, Lk) for one sample."""
    plt = _pyplot()
    n_layers, n_heads = len(maps), maps[0].shape[0]
    qlab, klab = labels
    cell = 0.13 * max(len(qlab), len(klab)) + 0.7
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(cell * n_heads, cell * n_layers + 0.6),
                             dpi=90, squeeze=False)
    for l in range(n_layers):
        for h in range(n_heads):
            ax = axes[l][h]
            ax.imshow(maps[l][h], cmap="viridis", vmin=0, vmax=1, aspect="auto")
            ax.set_title(f"layer {l} head {h}", fontsize=8)
            ax.set_xticks(range(len(klab)), klab, fontsize=6, rotation=90)
            ax.set_yticks(range(len(qlab)), qlab, fontsize=6)
            if l == n_layers - 1:
                ax.set_xlabel("key", fontsize=7)
            if h == 0:
                ax.set_ylabel("query", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return Path(png)


def plot_attention_maps(params, cfg, x, out) -> list:
    """PNGs of every attention flavor of the model for one held-out source ``x``."""
    from .loop import attention_for

    maps, labels = attention_for(params, cfg, x)
    paths = []
    for name, per_layer in maps.items():
        qlab, klab = labels[name]
        sample = [np.asarray(p[0], dtype=np.float64)[:, : len(qlab), : len(klab)] for p in per_layer]
        paths.append(plot_attention(sample, (qlab, klab), TITLES[name], Path(out) / f"attention_{name}.png"))
    return paths
