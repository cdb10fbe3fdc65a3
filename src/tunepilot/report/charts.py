"""The geometry of the report's inline-SVG charts (report/templates/charts.html.j2 draws it).

Every chart has a title, labelled axes with units, a legend for every series, and the numbers
the tables show; projected series are hatched. Pure arithmetic: no markup here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac"]
WIDTH = 760


def nice_max(v: float) -> float:
    """The next 1, 2, 2.5, 5 x 10^k at or above v."""
    if v <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return m * exp
    return 10 * exp


def ticks(vmax: float, n: int = 4) -> list[float]:
    return [vmax * i / n for i in range(n + 1)]


@dataclass
class Chart:
    title: str
    width: int
    height: int
    x_label: str = ""
    y_label: str = ""
    shapes: list[dict] = field(default_factory=list)
    legend: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.3g}"


def stacked_bars(title: str, bars: list[dict], components: list[str], unit: str,
                 scale_bytes: float) -> Chart:
    """Horizontal stacked bars. bars: [{label, values: {component: bytes}, markers: [{label,
    value}], projected, total_text}] drawn in ``unit`` (= scale_bytes bytes); total_text (the
    table's own words for the bar's sum) is written at its end. The axis fits the bars: a
    capacity mark beyond 4x the largest bar is written at the right edge, not drawn off scale."""
    row_h, left, right, top = 34, 200, 150, 30
    height = top + row_h * len(bars) + 70
    largest = max([sum(b["values"].values()) for b in bars] + [1e-9]) / scale_bytes
    near = [m["value"] / scale_bytes for b in bars for m in b.get("markers", [])
            if m["value"] / scale_bytes <= 4 * largest]
    vmax = nice_max(max([largest * 1.1] + near))
    k = (WIDTH - left - right) / vmax
    c = Chart(title, WIDTH, height, x_label=f"{unit} per device",
              legend=[{"label": comp, "color": PALETTE[j % len(PALETTE)]}
                      for j, comp in enumerate(components)])
    for i, b in enumerate(bars):
        y = top + i * row_h
        c.shapes.append({"kind": "text", "x": left - 6, "y": y + 16, "anchor": "end",
                         "text": b["label"]})
        x = float(left)
        for j, comp in enumerate(components):
            v = (b["values"].get(comp) or 0) / scale_bytes
            if v <= 0:
                continue
            w = max(v * k, 1.0)  # a component too small to see still shows as a sliver
            c.shapes.append({"kind": "rect", "x": x, "y": y + 4, "w": w, "h": 18,
                             "fill": PALETTE[j % len(PALETTE)], "hatch": b.get("projected"),
                             "tip": f"{comp}: {_num(v)} {unit}"})
            x += w
        total = sum(b["values"].values()) / scale_bytes
        c.shapes.append({"kind": "text", "x": x + 4, "y": y + 17, "anchor": "start",
                         "text": b.get("total_text") or f"{_num(total)} {unit}"})
        for m in b.get("markers", []):
            mv = m["value"] / scale_bytes
            if mv <= vmax:
                mx = left + mv * k
                c.shapes.append({"kind": "line", "x1": mx, "y1": y, "x2": mx, "y2": y + 26,
                                 "stroke": m.get("color", "#000"), "dash": m.get("dash", ""),
                                 "tip": f"{m['label']}: {_num(mv)} {unit}"})
            else:
                c.notes.append(f"{b['label']}: {m['label']} {_num(mv)} {unit} is off the scale "
                               f"({mv / max(total, 1e-12):,.0f}x the peak)")
    _x_axis(c, left, top + row_h * len(bars) + 4, WIDTH - left - right, vmax, unit)
    return c


def _x_axis(c: Chart, left: float, y: float, width: float, vmax: float, unit: str) -> None:
    c.shapes.append({"kind": "line", "x1": left, "y1": y, "x2": left + width, "y2": y,
                     "stroke": "#666", "dash": ""})
    for t in ticks(vmax):
        x = left + width * t / vmax
        c.shapes.append({"kind": "line", "x1": x, "y1": y, "x2": x, "y2": y + 4,
                         "stroke": "#666", "dash": ""})
        c.shapes.append({"kind": "text", "x": x, "y": y + 16, "anchor": "middle",
                         "text": _num(t)})
    c.shapes.append({"kind": "text", "x": left + width / 2, "y": y + 32, "anchor": "middle",
                     "text": c.x_label})


def histogram(title: str, values: list[float], markers: dict[str, float], unit: str,
              x_label: str, bins: int = 20, y_label: str = "steps") -> Chart:
    """A histogram of values with labelled vertical markers (p50/p90/p99, a sequence length)."""
    left, bottom, top, height = 60, 48, 28, 240
    c = Chart(title, WIDTH, height, x_label=x_label, y_label=y_label)
    if not values:
        c.notes.append("no data")
        return c
    lo, hi = min(values), max(values + list(markers.values()))
    hi = hi if hi > lo else lo + 1e-9
    step = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / step))] += 1
    return _bars_of(c, counts, lo, step, markers, unit, left, top, bottom)


def binned(title: str, edges: list[tuple[int, int, int]], markers: dict[str, float], unit: str,
           x_label: str, y_label: str) -> Chart:
    """A histogram already binned: [(lo, hi, count)] (the dataset's length profile)."""
    c = Chart(title, WIDTH, 240, x_label=x_label, y_label=y_label)
    if not edges:
        c.notes.append("no data")
        return c
    lo, hi = edges[0][0], max([edges[-1][1]] + list(markers.values()))
    step = (edges[-1][1] - lo) / len(edges)
    c = _bars_of(c, [n for _, _, n in edges], lo, step, markers, unit, 60, 28, 48, hi=hi)
    return c


LABEL_ROW_PX = 13  # one marker label per row, above the plot: never over a bar or a label
CHAR_PX = 6  # about one character of the 11 px sans-serif the charts are drawn in


def _bars_of(c: Chart, counts: list[int], lo: float, step: float, markers: dict[str, float],
             unit: str, left: int, top: int, bottom: int, hi: float | None = None) -> Chart:
    hi = hi if hi is not None else lo + step * len(counts)
    cmax = max(counts) or 1
    band = top + 4
    top = band + LABEL_ROW_PX * len(markers)  # the plot starts below the labels' band
    pw, ph = c.width - left - 20, c.height - top - bottom
    span = max(hi - lo, 1e-12)
    bw = pw * step / span
    for i, n in enumerate(counts):
        h = ph * n / cmax
        c.shapes.append({"kind": "rect", "x": left + i * bw, "y": top + ph - h,
                         "w": max(bw - 1, 0.5), "h": h, "fill": PALETTE[0], "hatch": False,
                         "tip": f"{_num(lo + i * step)}-{_num(lo + (i + 1) * step)} {unit}: {n}"})
    for k, (name, v) in enumerate(markers.items()):
        x = left + (v - lo) / span * pw
        y = band + LABEL_ROW_PX * k + 10
        c.shapes.append({"kind": "line", "x1": x, "y1": y + 2, "x2": x, "y2": top + ph,
                         "stroke": PALETTE[2 + k], "dash": ""})
        text = f"{name} {_num(v)} {unit}"
        fits_right = x + 3 + len(text) * CHAR_PX <= c.width - 2
        c.shapes.append({"kind": "text", "x": x + 3 if fits_right else x - 3, "y": y,
                         "anchor": "start" if fits_right else "end", "text": text})
        c.legend.append({"label": name, "color": PALETTE[2 + k]})
    base = top + ph
    c.shapes += [{"kind": "text", "x": left, "y": base + 14, "anchor": "start",
                  "text": f"{_num(lo)} {unit}"},
                 {"kind": "text", "x": left + pw, "y": base + 14, "anchor": "end",
                  "text": f"{_num(hi)} {unit}"},
                 {"kind": "text", "x": left + pw / 2, "y": base + 34, "anchor": "middle",
                  "text": c.x_label},
                 {"kind": "text", "x": left - 6, "y": top + 8, "anchor": "end",
                  "text": str(cmax)},
                 {"kind": "text", "x": left - 6, "y": base, "anchor": "end", "text": "0"},
                 {"kind": "vtext", "x": 14, "y": top + ph / 2, "text": c.y_label}]
    return c


def series(title: str, ys: list[float], flagged: list[int], unit: str, y_label: str) -> Chart:
    """A per-step line with flagged points (data-loader stalls) in red."""
    left, bottom, top, height = 60, 44, 28, 210
    c = Chart(title, WIDTH, height, x_label="measured step", y_label=y_label,
              legend=[{"label": y_label, "color": PALETTE[0]},
                      {"label": "stall", "color": PALETTE[2]}])
    if not ys:
        c.notes.append("no data")
        return c
    vmax = nice_max(max(ys))
    pw, ph = WIDTH - left - 20, height - top - bottom
    n = max(len(ys) - 1, 1)

    def pt(i: int, v: float) -> tuple[float, float]:
        return left + pw * i / n, top + ph - ph * v / vmax

    c.shapes.append({"kind": "polyline", "points": " ".join(
        f"{x:.1f},{y:.1f}" for x, y in (pt(i, v) for i, v in enumerate(ys))),
        "stroke": PALETTE[0]})
    for i in flagged:
        x, y = pt(i, ys[i])
        c.shapes.append({"kind": "circle", "x": x, "y": y, "r": 4, "fill": PALETTE[2],
                         "tip": f"step {i}: {_num(ys[i])} {unit} (stall)"})
    c.shapes += [{"kind": "text", "x": left - 6, "y": top + 8, "anchor": "end",
                  "text": f"{_num(vmax)} {unit}"},
                 {"kind": "text", "x": left - 6, "y": top + ph, "anchor": "end", "text": "0"},
                 {"kind": "text", "x": left, "y": height - 24, "anchor": "start",
                  "text": "step 0"},
                 {"kind": "text", "x": left + pw, "y": height - 24, "anchor": "end",
                  "text": f"step {len(ys) - 1}"},
                 {"kind": "text", "x": left + pw / 2, "y": height - 8, "anchor": "middle",
                  "text": c.x_label},
                 {"kind": "vtext", "x": 14, "y": top + ph / 2, "text": f"{y_label} ({unit})"}]
    return c


def bars(title: str, items: list[dict], unit: str, x_label: str) -> Chart:
    """Horizontal bars: items [{label, value, text, projected}]; projected ones hatched."""
    row_h, left, top = 28, 230, 28
    height = top + row_h * max(len(items), 1) + 56
    vmax = nice_max(max([i["value"] or 0 for i in items] + [1e-9]))
    k = (WIDTH - left - 170) / vmax
    c = Chart(title, WIDTH, height, x_label=x_label,
              legend=[{"label": "measured", "color": PALETTE[0]},
                      {"label": "projected (hatched)", "color": PALETTE[1]}])
    for j, it in enumerate(items):
        y = top + j * row_h
        v = it["value"] or 0
        w = max(v * k, 1.0) if v > 0 else 0
        c.shapes.append({"kind": "text", "x": left - 6, "y": y + 15, "anchor": "end",
                         "text": it["label"]})
        c.shapes.append({"kind": "rect", "x": left, "y": y + 3, "w": w, "h": 16,
                         "fill": PALETTE[1] if it.get("projected") else PALETTE[0],
                         "hatch": it.get("projected"), "tip": it.get("text") or _num(v)})
        kind = "projected" if it.get("projected") else "measured"
        c.shapes.append({"kind": "text", "x": left + w + 4, "y": y + 15, "anchor": "start",
                         "text": f"{it.get('text') or _num(v)} {unit} ({kind})"})
    _x_axis(c, left, top + row_h * max(len(items), 1) + 2, WIDTH - left - 170, vmax, unit)
    return c
