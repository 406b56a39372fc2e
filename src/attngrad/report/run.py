"""The report of a training run: ``report.html`` in the run folder.

``attngrad train`` saves, at every evaluation, the attention maps of one fixed held-out
example (:mod:`attngrad.train.snapshots`: ``attention/step-NNNNNNNN.npz``, plain float32
arrays, read back with ``allow_pickle=False``; ``attention/labels.json`` names their rows
and columns), and at the end writes this page from the folder alone: ``metrics.jsonl``, those snapshots and the
configuration stored in the newest checkpoint.  ``attngrad report --run DIR`` rewrites it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from ..train.snapshots import save_attention_snapshot
from .html import esc, page, write_atomic
from .svg import heatmap, line_chart

_SNAP = re.compile(r"^step-(\d{8,})\.npz$")
TITLES = {
    "encoder_self": "encoder self-attention",
    "decoder_causal": "decoder causal self-attention",
    "cross": "cross-attention (decoder queries, encoder keys)",
}
__all__ = ["load_snapshots", "run_report", "save_attention_snapshot", "write_run_report"]


def load_snapshots(out) -> list:
    """[(step, {flavor: [maps of layer 0, 1, ...]})] of a run folder, by step."""
    d = Path(out) / "attention"
    if not d.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _SNAP.match(p.name)))
    snaps = []
    for step, p in found:
        with np.load(p, allow_pickle=False) as z:
            per = {}
            for key in sorted(z.files, key=lambda s: (s.rsplit(".", 1)[0], int(s.rsplit(".", 1)[1]))):
                per.setdefault(key.rsplit(".", 1)[0], []).append(np.array(z[key]))
        snaps.append((step, per))
    return snaps


def _config(out) -> dict:
    for path in reversed(list_checkpoints(out)):
        try:
            return load_checkpoint(path)[1]["config"]
        except CheckpointError:
            continue
    return {}


def _smooth(y: np.ndarray) -> tuple[np.ndarray, int]:
    k = max(len(y) // 50, 5)
    return np.convolve(y, np.ones(k) / k, mode="valid"), k


def _chart(series, **kw) -> str:
    return line_chart(series, width=560, height=320, legend="below", **kw)


# Options shown only for the models they configure (the others ignore them)
MODEL_ONLY = {
    "activation": ("encdec", "decoder"),
    "dropout": ("encdec", "decoder", "gpt2"),
    "kv_heads": ("llama",),
    "tie_embeddings": ("llama",),
    "qk_norm": ("llama",),
}
TASK_ONLY = ("task", "symbols", "min_len", "max_len")
DATA_ONLY = ("data", "context", "val_fraction", "tokenizer", "vocab_size")


def shown_options(cfg: dict) -> dict:
    """The stored options that configure the model trained: a llama run lists no
    activation, a toy task no --data options, a byte run no vocab_size."""
    out = {}
    for k, v in cfg.items():
        if k in (TASK_ONLY if cfg.get("data") else DATA_ONLY):
            continue
        if k in MODEL_ONLY and cfg.get("model") not in MODEL_ONLY[k]:
            continue
        if k == "vocab_size" and cfg.get("tokenizer", "bytes") == "bytes":
            continue
        if (k == "grad_accum" and v == 1) or v is None:  # an option left off
            continue
        out[k] = v
    return out


def _throughput(metrics: list):
    """(steps, seconds, tokens per second) of the training records, or None."""
    rec = [r for r in metrics if "loss" in r and "time" in r]
    if not rec or rec[-1]["time"] <= 0:
        return None
    tokens = sum(r.get("tokens", 0) for r in rec)
    return rec[-1]["step"], rec[-1]["time"], tokens / rec[-1]["time"]


def _samples(out) -> list:
    p = Path(out) / "samples.json"
    try:
        got = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [g for g in got if isinstance(g, dict) and "prompt" in g and "continuation" in g] if isinstance(got, list) else []


def _curves(metrics: list, text: bool, unit: str = "byte") -> str:
    steps = np.array([r["step"] for r in metrics if "loss" in r], dtype=np.float64)
    loss = np.array([r["loss"] for r in metrics if "loss" in r], dtype=np.float64)
    series = [{"label": "training loss (per step)", "x": steps, "y": loss, "color": "#9ecae1", "width": 0.8}]
    if len(loss) >= 20:
        sm, k = _smooth(loss)
        series.append({"label": f"training loss (mean of {k})", "x": steps[k - 1 :], "y": sm, "color": "#1f77b4"})
    figs = []
    if text:
        ev = [r for r in metrics if "val_loss" in r]
        vs = [r["step"] for r in ev]
        series.append({"label": "validation loss", "x": vs, "y": [r["val_loss"] for r in ev],
                       "color": "#ff7f0e", "marker": True})
        if ev and "val_unigram_loss" in ev[-1]:
            u = ev[-1]["val_unigram_loss"]
            series.append({"label": f"unigram baseline ({u:.3f})", "x": [steps.min(), steps.max()],
                           "y": [u, u], "color": "#d62728", "dash": True})
        figs.append(_chart(series, title="Loss", xlabel="step", ylabel=f"cross-entropy (nats per {unit})",
                               logy=True))
        figs.append(_chart([{"label": "validation perplexity", "x": vs, "y": [r["val_ppl"] for r in ev],
                                 "color": "#ff7f0e", "marker": True}],
                               title="Validation perplexity", xlabel="step", ylabel="perplexity exp(loss)",
                               logy=bool(vs) and max(r["val_ppl"] for r in ev) > 10 * min(r["val_ppl"] for r in ev)))
    else:
        figs.append(_chart(series, title="Training loss", xlabel="step", ylabel="cross-entropy", logy=True))
        ev = [r for r in metrics if "eval_exact" in r]
        figs.append(_chart(
            [{"label": "exact match", "x": [r["step"] for r in ev], "y": [r["eval_exact"] for r in ev],
              "color": "#ff7f0e", "marker": True},
             {"label": "token accuracy", "x": [r["step"] for r in ev], "y": [r["eval_token_acc"] for r in ev],
              "color": "#2ca02c", "marker": True}],
            title="Held-out accuracy", xlabel="step", ylabel="fraction"))
    return '<div class="figs">' + "".join(figs) + "</div>"


def _pick(n: int, k: int = 5) -> list:
    """Up to ``k`` indices of 0..n-1 spread evenly, first and last included."""
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if n > k else list(range(n))


def _attention(out, snaps: list, shared_scale: bool = False) -> str:
    lab_path = Path(out) / "attention" / "labels.json"
    labels = json.loads(lab_path.read_text()) if lab_path.exists() else {}
    html = ["<h2>Attention maps as training goes</h2>",
            '<p class="note">One fixed held-out example, teacher-forced, at step 0 (the random '
            "start: no attention labels, only the task loss trains W^Q, W^K, W^V) and at evaluation "
            "steps; rows are queries, columns keys; each row sums to 1. "
            + ("Every map shares one colour scale, 0 to 1.</p>" if shared_scale else
               "Each map's colour scale runs from 0 to its largest weight (<code>attngrad report --run DIR "
               "--shared-scale</code>: one 0–1 scale for all).</p>")]
    chosen = [snaps[i] for i in _pick(len(snaps))]
    names = list(dict.fromkeys(n for _, per in snaps for n in per))
    for name in names:
        q, k = labels.get(name, (None, None))
        html.append(f"<h3>{esc(TITLES.get(name, name))}</h3>")
        for step, per in chosen:
            if name not in per:
                continue
            html.append(f"<p><b>step {step}</b></p><div class=\"figs\">")
            for layer, maps in enumerate(per[name]):
                for h, m in enumerate(maps):
                    top = 1.0 if shared_scale else float(np.max(m)) if m.size else 0.0  # 0..its largest weight
                    html.append(heatmap(m, title=f"step {step}: layer {layer} head {h}", xlabel="key",
                                        ylabel="query", xlabels=k, ylabels=q, vmin=0.0,
                                        vmax=top if top > 0 else 1.0, max_px=200))
            html.append("</div>")
    return "".join(html)


def run_report(out, *, shared_scale: bool = False) -> str:
    """The HTML page of the run in folder ``out``.  ``shared_scale``: every attention map on
    one 0–1 colour scale (default: each from 0 to its largest weight)."""
    out = Path(out)
    mpath = out / "metrics.jsonl"
    if not mpath.exists():
        raise ValueError(f"{out} holds no metrics.jsonl: not a training run folder")
    metrics = []
    for line in mpath.read_text().splitlines():
        try:
            metrics.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash
            continue
    cfg = _config(out)
    text = cfg.get("data") is not None or any("val_loss" in r for r in metrics)
    last = [r for r in metrics if ("val_loss" in r or "eval_exact" in r)]
    body = [f"<h1>attngrad train: {esc(out.name)}</h1>"]
    bpe = cfg.get("tokenizer", "bytes") == "bpe"
    unit = "token" if bpe else "byte"
    if cfg:
        what = (f"the {'BPE tokens' if bpe else 'bytes'} of {cfg['data']}" if cfg.get("data")
                else f"the {cfg.get('task')} task")
        body.append(f"<p>{esc(cfg.get('model'))} model trained on {esc(what)} with closed-form gradients only.</p>")
    speed = _throughput(metrics)
    if speed:
        steps, secs, tps = speed
        body.append(f"<p><b>Throughput</b>: {steps} steps in {secs:.1f} s of training, "
                    f"{tps:,.0f} tokens/s.</p>")
    if cfg:
        body.append('<p class="note">Options: ' + ", ".join(
            f"<code>{esc(k)}={esc(v)}</code>" for k, v in shown_options(cfg).items()) + "</p>")
    if last:
        ev = last[-1]
        if text:
            body.append(f"<p><b>Step {ev['step']}</b>: validation loss {ev['val_loss']:.4f} nats per {unit} "
                        f"({ev.get('val_bpb', ev['val_loss'] / np.log(2)):.3f} bits per byte), perplexity {ev['val_ppl']:.2f}"
                        + (f"; the unigram baseline is {ev['val_unigram_loss']:.4f}" if "val_unigram_loss" in ev else "")
                        + ".</p>")
        else:
            body.append(f"<p><b>Step {ev['step']}</b>: held-out exact match {ev['eval_exact']:.2%}, "
                        f"token accuracy {ev['eval_token_acc']:.2%}.</p>")
    for smp in _samples(out)[:1]:
        body.append("<p><b>Greedy sample</b> (the end of training; the prompt in grey):</p>"
                    f'<pre class="sample"><span class="muted">{esc(smp["prompt"])}</span>'
                    f'{esc(smp["continuation"])}</pre>')
    body.append("<h2>Curves</h2>" + _curves(metrics, text, unit))
    snaps = load_snapshots(out)
    if snaps:
        body.append(_attention(out, snaps, shared_scale))
    body.append('<p class="muted">Written by <code>attngrad train</code> / <code>attngrad report --run</code>. '
                "Self-contained: no script, no network.</p>")
    return page(f"attngrad train: {out.name}", "\n".join(body))


def write_run_report(out, path=None, *, shared_scale: bool = False) -> Path:
    """Write :func:`run_report` to ``path`` (default ``out/report.html``)."""
    return write_atomic(Path(out) / "report.html" if path is None else path,
                        run_report(out, shared_scale=shared_scale))
