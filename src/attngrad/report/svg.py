"""Figures as inline SVG with NumPy only: heatmaps (with a colour bar, a title and labelled
axes) and line charts (with ticks, axis labels and a legend).

A heatmap's cells are one small PNG (encoded here with zlib, no imaging library) inside
the SVG as a ``data:`` URI, upscaled by whole pixels so that cells stay sharp; everything
else (axes, ticks, text, colour bar frame) is vector.  No matplotlib is needed.
"""

from __future__ import annotations

import base64
import math
import struct
import zlib
from html import escape

import numpy as np

# colour stops: viridis (sequential) and a red-blue diverging map (negative blue, 0 white)
VIRIDIS = ("#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725")
DIVERGING = ("#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7", "#fddbc7", "#f4a582", "#d6604d", "#b2182b")
FONT = 'font-family="DejaVu Sans, Helvetica, Arial, sans-serif"'


def _lut(stops, n: int = 256) -> np.ndarray:
    """(n, 3) uint8: ``stops`` interpolated linearly."""
    rgb = np.array([[int(s[i : i + 2], 16) for i in (1, 3, 5)] for s in stops], dtype=np.float64)  # (S, 3)
    t = np.linspace(0, len(stops) - 1, n)  # (n,)
    lo = np.minimum(np.floor(t).astype(int), len(stops) - 2)
    w = (t - lo)[:, None]
    return np.round(rgb[lo] * (1 - w) + rgb[lo + 1] * w).astype(np.uint8)


# a tensor that is 0 up to round-off: its noise drawn in greys, lighter than any colour
MUTED = ("#9a9a9a", "#c8c8c8", "#f4f4f4", "#c8c8c8", "#9a9a9a")
_LUTS = {"sequential": _lut(VIRIDIS), "diverging": _lut(DIVERGING), "muted": _lut(MUTED)}


def png_bytes(rgb: np.ndarray) -> bytes:
    """A truecolour PNG of ``rgb`` (R, C, 3) uint8."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[i].tobytes() for i in range(h))  # filter 0 per scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _data_uri(rgb: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(rgb)).decode("ascii")


def colorize(a: np.ndarray, kind: str, vmin: float, vmax: float) -> np.ndarray:
    """(R, C) values -> (R, C, 3) uint8 colours; NaN is grey."""
    lut = _LUTS[kind]
    a = np.asarray(a, dtype=np.float64)
    span = vmax - vmin if vmax > vmin else 1.0
    idx = np.clip(np.nan_to_num((a - vmin) / span * 255, nan=0.0), 0, 255).astype(int)
    out = lut[idx]
    out[np.isnan(a)] = (200, 200, 200)
    return out


def fmt(v: float) -> str:
    if v == 0:
        return "0"
    if v == int(v) and abs(v) < 1e7:  # a step count: 1250, not 1.25e+03
        return str(int(v))
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.1e}"


def _text(x, y, s, size=11, anchor="middle", extra="") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" {FONT} {extra}>{escape(str(s))}</text>'


def heatmap(a, *, title: str, xlabel: str, ylabel: str, xlabels=None, ylabels=None,
            kind: str = "sequential", vmin=None, vmax=None, max_px: int = 220, note: str | None = None) -> str:
    """An SVG heatmap of ``a`` (R, C) (a vector is one row).  ``kind`` "sequential"
    (viridis, vmin..vmax, default the data range), "diverging" (symmetric about 0) or
    "muted" (diverging in greys: a tensor that is 0 up to round-off).  ``note``: a line
    under the title (grey, italic)."""
    if kind not in _LUTS:
        raise ValueError(f"kind must be one of {', '.join(_LUTS)}; got {kind!r}")
    a = np.asarray(a, dtype=np.float64)
    a = a.reshape(1, -1) if a.ndim == 1 else a
    if a.ndim != 2:
        raise ValueError(f"heatmap needs a matrix; got shape {a.shape}")
    rows, cols = a.shape
    finite = a[np.isfinite(a)]
    if kind in ("diverging", "muted"):
        m = float(np.max(np.abs(finite))) if finite.size else 0.0
        m = m if m > 0 else 1.0
        vmin, vmax = -m, m
    else:
        vmin = float(finite.min()) if vmin is None and finite.size else (0.0 if vmin is None else vmin)
        vmax = float(finite.max()) if vmax is None and finite.size else (1.0 if vmax is None else vmax)
    cell = int(max(2, min(22, max_px // max(rows, cols, 1))))
    w, h = cols * cell, rows * cell
    show_x = xlabels is not None and cell >= 8
    show_y = ylabels is not None and cell >= 8
    ylab_w = 7 * max((len(str(s)) for s in ylabels), default=1) if show_y else 14
    left, top = 24 + ylab_w, 30 + (14 if note else 0)
    bottom = 44 if show_x else 40
    cb_x = left + w + 12
    width, height = cb_x + 12 + 52, top + max(h, 60) + bottom
    img = np.repeat(np.repeat(colorize(a, kind, vmin, vmax), cell, axis=0), cell, axis=1)  # (h, w, 3)
    bar = np.repeat(_LUTS[kind][::-1][:, None, :], 4, axis=1)  # (256, 4, 3), top = vmax
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f"<title>{escape(title)}</title>",
           _text(width / 2, 16, title, 12, extra='font-weight="bold"'),
           *([_text(width / 2, 30, note, 10, extra='fill="#6e7781" font-style="italic"')] if note else []),
           f'<image x="{left}" y="{top}" width="{w}" height="{h}" href="{_data_uri(img)}"/>',
           f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#444" stroke-width="0.6"/>']
    # x ticks: every label when they fit, else a few indices
    xt = range(cols) if show_x else sorted({0, cols // 2, cols - 1}) if cols > 1 else [0]
    for j in xt:
        label = xlabels[j] if show_x else j
        out.append(_text(left + (j + 0.5) * cell, top + h + 12, label, 9))
    yt = range(rows) if show_y else sorted({0, rows // 2, rows - 1}) if rows > 1 else [0]
    for i in yt:
        label = ylabels[i] if show_y else i
        out.append(_text(left - 4, top + (i + 0.5) * cell + 3, label, 9, "end"))
    out.append(_text(left + w / 2, top + h + (30 if show_x else 28), xlabel, 11))
    out.append(_text(12, top + h / 2, ylabel, 11, extra=f'transform="rotate(-90 12 {top + h / 2:.1f})"'))
    bh = max(h, 60)
    out.append(f'<image x="{cb_x}" y="{top}" width="12" height="{bh}" preserveAspectRatio="none" href="{_data_uri(bar)}"/>')
    out.append(f'<rect x="{cb_x}" y="{top}" width="12" height="{bh}" fill="none" stroke="#444" stroke-width="0.6"/>')
    for frac, v in ((0.0, vmax), (0.5, (vmin + vmax) / 2), (1.0, vmin)):
        y = top + frac * bh
        out.append(f'<line x1="{cb_x + 12}" x2="{cb_x + 15}" y1="{y:.1f}" y2="{y:.1f}" stroke="#444"/>')
        out.append(_text(cb_x + 17, y + 3, fmt(v), 9, "start"))
    out.append("</svg>")
    return "".join(out)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list:
    """Round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step - 1e-9) * step
    return [round(start + k * step, 12) for k in range(int((hi - start) / step + 1e-9) + 1)]


def line_chart(series: list, *, title: str, xlabel: str, ylabel: str, logy: bool = False,
               width: int = 600, height: int = 320, legend: str = "inside") -> str:
    """An SVG line chart.  ``series``: dicts with ``label``, ``x``, ``y``, ``color`` and
    optionally ``dash`` (bool), ``marker`` (bool), ``width`` (line width).  ``legend``:
    "inside" (top right of the plot) or "below" (under the axis label: it covers nothing)."""
    series = [s for s in series if len(s["x"])]
    below = legend == "below" and bool(series)
    if below:
        height += 15 * len(series) + 6
    left, right, top, bottom = 64, 24, 30, 46 + (15 * len(series) + 6 if below else 0)
    pw, ph = width - left - right, height - top - bottom
    xs = np.concatenate([np.asarray(s["x"], dtype=np.float64) for s in series]) if series else np.zeros(1)
    ys = np.concatenate([np.asarray(s["y"], dtype=np.float64) for s in series]) if series else np.ones(1)
    ys = ys[np.isfinite(ys) & ((ys > 0) if logy else True)]
    ys = ys if ys.size else np.ones(1)
    x0, x1 = float(xs.min()), float(xs.max())
    x1 = x1 if x1 > x0 else x0 + 1
    if logy:
        y0, y1 = math.floor(math.log10(ys.min()) * 4) / 4, math.ceil(math.log10(ys.max()) * 4) / 4
        y1 = y1 if y1 > y0 else y0 + 0.25
    else:
        y0, y1 = float(ys.min()), float(ys.max())
        pad = 0.05 * (y1 - y0) if y1 > y0 else 0.5
        y0, y1 = y0 - pad, y1 + pad

    def px(x):
        return left + (x - x0) / (x1 - x0) * pw

    def py(y):
        v = math.log10(y) if logy else y
        return top + (1 - (v - y0) / (y1 - y0)) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f"<title>{escape(title)}</title>",
           _text(width / 2, 16, title, 12, extra='font-weight="bold"'),
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#444" stroke-width="0.8"/>']
    for t in nice_ticks(x0, x1, 6):
        out.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>')
        out.append(_text(px(t), top + ph + 14, fmt(t), 10))
    if logy:
        yticks = [10.0**k for k in range(math.ceil(y0), math.floor(y1) + 1)]
        if len(yticks) < 3:
            yticks = [m * 10.0**k for k in range(math.floor(y0), math.ceil(y1) + 1) for m in (1, 2, 5)
                      if y0 <= math.log10(m * 10.0**k) <= y1]
        if len(yticks) < 3:  # less than a decade: round values spread over the range
            yticks = [t for t in nice_ticks(10.0**y0, 10.0**y1, 4) if t > 0 and y0 <= math.log10(t) <= y1]
    else:
        yticks = nice_ticks(y0, y1, 5)
    for t in yticks:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>')
        out.append(_text(left - 5, py(t) + 3, fmt(t), 10, "end"))
    for s in series:
        pts = [(px(x), py(y)) for x, y in zip(s["x"], s["y"], strict=True)
               if math.isfinite(y) and (y > 0 or not logy)]
        dash = ' stroke-dasharray="5 3"' if s.get("dash") else ""
        lw = s.get("width", 1.6)
        out.append(f'<polyline fill="none" stroke="{s["color"]}" stroke-width="{lw}"{dash} points="'
                   + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
        if s.get("marker"):
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{s["color"]}"/>' for x, y in pts]
    lx, ly = (left, top + ph + 44) if below else (left + pw - 196, top + 3)
    if series and not below:
        out.append(f'<rect x="{lx}" y="{ly}" width="192" height="{15 * len(series) + 5}" '
                   'fill="#fff" fill-opacity="0.9" stroke="#ccc"/>')
    for k, s in enumerate(series):  # legend, top right (or below the axis label)
        y = ly + 9 + 15 * k
        dash = ' stroke-dasharray="5 3"' if s.get("dash") else ""
        out.append(f'<line x1="{lx + 6}" x2="{lx + 30}" y1="{y - 4}" y2="{y - 4}" '
                   f'stroke="{s["color"]}" stroke-width="2"{dash}/>')
        out.append(_text(lx + 34, y, s["label"], 10, "start"))
    out.append(_text(left + pw / 2, top + ph + 36, xlabel, 11))
    out.append(_text(14, top + ph / 2, ylabel + (" (log scale)" if logy else ""), 11,
                     extra=f'transform="rotate(-90 14 {top + ph / 2:.1f})"'))
    out.append("</svg>")
    return "".join(out)
