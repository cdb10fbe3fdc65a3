"""Small inline-SVG charts for the self-contained HTML report (no network, no JS, no matplotlib).

Each function returns an `<svg>` string with a <title> and text labels, so the chart reads without
colour too. Measured series are drawn solid; projected ones hatched (the `projected` flag).
"""

from __future__ import annotations

from html import escape

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac"]
HATCH = ('<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
         'patternTransform="rotate(45)"><rect width="6" height="6" fill="white"/>'
         '<line x1="0" y1="0" x2="0" y2="6" stroke="#666" stroke-width="3"/></pattern></defs>')


def _svg(width: int, height: int, body: str, title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" '
            f'font-size="11"><title>{escape(title)}</title>{HATCH}{body}</svg>')


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    import math

    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return m * exp
    return 10 * exp


def stacked_bars(title: str, bars: list[dict], components: list[str], unit: str = "GiB",
                 width: int = 760) -> str:
    """Horizontal stacked bars. bars: [{label, values: {component: number}, markers: [{label,
    value, color}], projected: bool}]; markers are vertical ticks (capacity, headroom)."""
    row_h, left, right, top = 34, 190, 30, 30
    height = top + row_h * len(bars) + 60
    vmax = _nice_max(max([sum(b["values"].values()) for b in bars]
                         + [m["value"] for b in bars for m in b.get("markers", [])] + [1e-9]))
    scale = (width - left - right) / vmax
    parts = [f'<text x="{left}" y="16" font-weight="bold">{escape(title)}</text>']
    for i, b in enumerate(bars):
        y = top + i * row_h
        parts.append(f'<text x="{left - 6}" y="{y + 16}" text-anchor="end">{escape(b["label"])}'
                     f'</text>')
        x = left
        for j, comp in enumerate(components):
            v = b["values"].get(comp, 0) or 0
            w = v * scale
            if w <= 0:
                continue
            fill = PALETTE[j % len(PALETTE)]
            parts.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="18" '
                         f'fill="{fill}"><title>{escape(comp)}: {v:,.2f} {unit}</title></rect>')
            if b.get("projected"):
                parts.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{w:.1f}" height="18" '
                             f'fill="url(#hatch)" opacity="0.35"/>')
            x += w
        total = sum(v or 0 for v in b["values"].values())
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 17}">{total:,.1f} {unit}</text>')
        for m in b.get("markers", []):
            mx = left + m["value"] * scale
            parts.append(f'<line x1="{mx:.1f}" y1="{y}" x2="{mx:.1f}" y2="{y + 26}" '
                         f'stroke="{m.get("color", "#000")}" stroke-width="2" '
                         f'stroke-dasharray="{m.get("dash", "")}"><title>{escape(m["label"])}: '
                         f'{m["value"]:,.1f} {unit}</title></line>')
    ly = top + row_h * len(bars) + 14
    lx = left
    for j, comp in enumerate(components):
        parts.append(f'<rect x="{lx}" y="{ly}" width="10" height="10" '
                     f'fill="{PALETTE[j % len(PALETTE)]}"/><text x="{lx + 13}" y="{ly + 9}">'
                     f'{escape(comp)}</text>')
        lx += 14 + 7 * len(comp) + 12
    parts.append(f'<text x="{left}" y="{ly + 30}">axis: 0 to {vmax:,.0f} {unit}; ticks: '
                 'capacity (solid) and capacity less headroom (dashed); hatched = projected'
                 '</text>')
    return _svg(width, height, "".join(parts), title)


def histogram(title: str, values: list[float], markers: dict[str, float], unit: str = "ms",
              bins: int = 20, width: int = 760, height: int = 220) -> str:
    """A histogram of values with labelled vertical markers (p50, p90, p99)."""
    left, bottom, top = 50, 40, 28
    if not values:
        return _svg(width, 60, f'<text x="10" y="30">{escape(title)}: no data</text>', title)
    lo, hi = min(values), max(values)
    if hi <= lo:
        hi = lo + 1e-9
    step = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / step))] += 1
    cmax = max(counts)
    pw, ph = width - left - 20, height - top - bottom
    parts = [f'<text x="{left}" y="16" font-weight="bold">{escape(title)}</text>']
    bw = pw / bins
    for i, c in enumerate(counts):
        h = ph * c / cmax
        parts.append(f'<rect x="{left + i * bw:.1f}" y="{top + ph - h:.1f}" width="{bw - 1:.1f}" '
                     f'height="{h:.1f}" fill="{PALETTE[0]}"><title>{lo + i * step:.3g}-'
                     f'{lo + (i + 1) * step:.3g} {unit}: {c}</title></rect>')
    for k, (name, v) in enumerate(markers.items()):
        x = left + (v - lo) / (hi - lo) * pw
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" '
                     f'stroke="{PALETTE[2 + k]}" stroke-width="2"/>'
                     f'<text x="{x + 3:.1f}" y="{top + 10 + 12 * k}">{escape(name)} {v:.3g} '
                     f'{unit}</text>')
    parts.append(f'<text x="{left}" y="{height - 12}">{lo:.3g} {unit}</text>'
                 f'<text x="{left + pw}" y="{height - 12}" text-anchor="end">{hi:.3g} {unit}'
                 f'</text><text x="{left - 6}" y="{top + 8}" text-anchor="end">{cmax}</text>')
    return _svg(width, height, "".join(parts), title)


def series(title: str, ys: list[float], flagged: list[int], unit: str = "ms",
           width: int = 760, height: int = 200, threshold: float | None = None) -> str:
    """A per-step line with flagged points (e.g. data-loader stalls) in red."""
    left, bottom, top = 50, 34, 28
    if not ys:
        return _svg(width, 60, f'<text x="10" y="30">{escape(title)}: no data</text>', title)
    vmax = _nice_max(max(ys + ([threshold] if threshold else [])))
    pw, ph = width - left - 20, height - top - bottom
    n = max(len(ys) - 1, 1)

    def pt(i: int, v: float) -> tuple[float, float]:
        return left + pw * i / n, top + ph - ph * v / vmax

    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (pt(i, v) for i, v in enumerate(ys)))
    parts = [f'<text x="{left}" y="16" font-weight="bold">{escape(title)}</text>',
             f'<polyline fill="none" stroke="{PALETTE[0]}" stroke-width="1.5" points="{path}"/>']
    for i in flagged:
        x, y = pt(i, ys[i])
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{PALETTE[2]}">'
                     f'<title>step {i}: {ys[i]:.3g} {unit} (stall)</title></circle>')
    if threshold:
        _, ty = pt(0, threshold)
        parts.append(f'<line x1="{left}" y1="{ty:.1f}" x2="{left + pw}" y2="{ty:.1f}" '
                     f'stroke="{PALETTE[2]}" stroke-dasharray="4 3"/><text x="{left + pw}" '
                     f'y="{ty - 3:.1f}" text-anchor="end">stall threshold {threshold:.3g} {unit}'
                     '</text>')
    parts.append(f'<text x="{left - 6}" y="{top + 8}" text-anchor="end">{vmax:.3g}</text>'
                 f'<text x="{left - 6}" y="{top + ph}" text-anchor="end">0</text>'
                 f'<text x="{left}" y="{height - 10}">step 0</text><text x="{left + pw}" '
                 f'y="{height - 10}" text-anchor="end">step {len(ys) - 1} ({unit})</text>')
    return _svg(width, height, "".join(parts), title)


def bars(title: str, items: list[dict], unit: str, width: int = 760) -> str:
    """Horizontal bars: items [{label, value, projected: bool, note}]; projected ones hatched."""
    row_h, left, top = 28, 230, 28
    height = top + row_h * max(len(items), 1) + 30
    vmax = _nice_max(max([i["value"] or 0 for i in items] + [1e-9]))
    scale = (width - left - 120) / vmax
    parts = [f'<text x="{left}" y="16" font-weight="bold">{escape(title)}</text>']
    for k, it in enumerate(items):
        y = top + k * row_h
        v = it["value"] or 0
        w = v * scale
        kind = "projected" if it.get("projected") else "measured"
        parts.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end">{escape(it["label"])}'
                     f'</text><rect x="{left}" y="{y + 3}" width="{w:.1f}" height="16" '
                     f'fill="{PALETTE[1] if it.get("projected") else PALETTE[0]}"/>')
        if it.get("projected"):
            parts.append(f'<rect x="{left}" y="{y + 3}" width="{w:.1f}" height="16" '
                         f'fill="url(#hatch)" opacity="0.5"/>')
        shown = it.get("text") or f"{v:,.4g}"
        parts.append(f'<text x="{left + w + 4:.1f}" y="{y + 15}">{escape(shown)} {escape(unit)} '
                     f'({kind})</text>')
    parts.append(f'<text x="{left}" y="{height - 8}">solid = measured, hatched = projected</text>')
    return _svg(width, height, "".join(parts), title)
