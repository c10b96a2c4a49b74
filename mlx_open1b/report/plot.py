"""Figures as data: a Plot is one panel (lines, points, markers, bars, a legend) drawn as inline
SVG (Plot.svg) or as a PNG (Plot.png, through png.py) in the same geometry."""
from __future__ import annotations

import html
import math

import numpy as np

from .axes import log_ticks, nice_ticks, thin, tick_label
from .png import encode_png, rasterize

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22"]


class Plot:
    """One SVG panel: lines, points, vertical/horizontal markers and bars, a legend on the right."""

    W, H, L, R, T, B = 760, 300, 64, 200, 30, 42

    def __init__(self, fig_id: str, title: str, xlabel: str, ylabel: str, logy: bool = False, zero: bool = False):
        self.id, self.title, self.xlabel, self.ylabel, self.logy = fig_id, title, xlabel, ylabel, logy
        self.zero = zero and not logy       # the y axis starts at 0
        self.items: list[tuple] = []

    def line(self, xs, ys, label, color, width=1.5, opacity=1.0, dash=None):
        self.items.append(("line", np.asarray(xs, float), np.asarray(ys, float), label, color, width, opacity, dash))
        return self

    def points(self, xs, ys, label, color, r=3.0):
        self.items.append(("points", np.asarray(xs, float), np.asarray(ys, float), label, color, r))
        return self

    def vlines(self, xs, label, color, dash="4,3"):
        self.items.append(("vlines", np.asarray(xs, float), label, color, dash))
        return self

    def hline(self, y, label, color, dash="6,4"):
        self.items.append(("hline", float(y), label, color, dash))
        return self

    def bars(self, edges, heights, label, color, opacity=0.5):
        self.items.append(("bars", np.asarray(edges, float), np.asarray(heights, float), label, color, opacity))
        return self

    def _ranges(self):
        xs, ys = [], []
        for it in self.items:
            if it[0] in ("line", "points"):
                ok = np.isfinite(it[1]) & np.isfinite(it[2]) & ((it[2] > 0) if self.logy else True)
                xs.append(it[1][ok]), ys.append(it[2][ok])
            elif it[0] == "vlines":
                xs.append(it[1])
            elif it[0] == "hline":
                ys.append(np.array([it[1]]))
            elif it[0] == "bars":
                xs.append(it[1]), ys.append(np.concatenate([it[2], [0.0]]))
        x = np.concatenate(xs) if xs else np.array([])
        y = np.concatenate(ys) if ys else np.array([])
        if self.logy:
            y = y[y > 0]
        if not x.size:
            x = np.array([0.0, 1.0])
        if not y.size:
            y = np.array([1.0, 10.0]) if self.logy else np.array([0.0, 1.0])
        x0, x1, y0, y1 = float(x.min()), float(x.max()), float(y.min()), float(y.max())
        if self.zero:
            y0 = min(y0, 0.0)
        if x1 <= x0:
            x0, x1 = x0 - 0.5, x1 + 0.5
        if self.logy:
            if y1 <= y0:
                y0, y1 = y0 / 2, y1 * 2
            y0, y1 = y0 / (y1 / y0) ** 0.04, y1 * (y1 / y0) ** 0.04
        else:
            if y1 <= y0:
                y0, y1 = y0 - (abs(y0) or 1) * 0.1, y1 + (abs(y1) or 1) * 0.1
            pad = (y1 - y0) * 0.05
            y0, y1 = (y0 - pad if y0 < 0 or y0 - pad >= 0 else 0.0), y1 + pad
        return x0, x1, y0, y1

    def frame(self) -> dict:
        """The panel's geometry, shared by svg() and png.rasterize(): plot-area origin and size, the data
        ranges, the maps sx, sy from data to SVG units, and the tick positions."""
        L, T = self.L, self.T
        pw, ph = self.W - L - self.R, self.H - T - self.B
        x0, x1, y0, y1 = self._ranges()
        fy = (lambda v: math.log10(v)) if self.logy else (lambda v: v)
        Y0, Y1 = fy(y0), fy(y1)

        def sx(v):
            return L + (v - x0) / (x1 - x0) * pw

        def sy(v):
            return T + ph - (fy(v) - Y0) / (Y1 - Y0) * ph

        return {"L": L, "T": T, "pw": pw, "ph": ph, "x0": x0, "x1": x1, "y0": y0, "y1": y1, "sx": sx, "sy": sy,
                "yticks": log_ticks(y0, y1) if self.logy else nice_ticks(y0, y1),
                "xticks": nice_ticks(x0, x1, 6)}

    def legend(self) -> list[tuple]:
        """[(kind "line" | "point" | "bar", label, color, dash, opacity)] of the labelled items."""
        out = []
        for it in self.items:
            if it[0] == "line":
                out.append(("line", it[3], it[4], it[7], it[6]))
            elif it[0] == "points":
                out.append(("point", it[3], it[4], None, 1.0))
            elif it[0] in ("vlines", "hline"):
                out.append(("line", it[2], it[3], it[4], 1.0))
            elif it[0] == "bars":
                out.append(("bar", it[3], it[4], None, it[5]))
        return [x for x in out if x[1]]

    def png(self, scale: int = 2) -> bytes:
        """The same panel as a PNG (png.py: built-in rasterizer and encoder)."""
        return encode_png(rasterize(self, scale))

    def svg(self) -> str:
        W, H = self.W, self.H
        fr = self.frame()
        L, T, pw, ph, sx, sy, y0 = fr["L"], fr["T"], fr["pw"], fr["ph"], fr["sx"], fr["sy"], fr["y0"]
        e = html.escape
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" id="{self.id}-svg" width="{W}" height="{H}" '
               f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11" role="img" '
               f'aria-label="{e(self.title)}">',
               f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>',
               f'<text x="{L}" y="18" font-size="13" font-weight="bold">{e(self.title)}</text>',
               f'<clipPath id="{self.id}-clip"><rect x="{L}" y="{T}" width="{pw}" height="{ph}"/></clipPath>']
        for t in fr["yticks"]:
            y = sy(t)
            out.append(f'<line x1="{L}" y1="{y:.1f}" x2="{L + pw}" y2="{y:.1f}" stroke="#e6e6e6"/>')
            out.append(f'<text x="{L - 5}" y="{y + 4:.1f}" text-anchor="end">{e(tick_label(t))}</text>')
        for t in fr["xticks"]:
            x = sx(t)
            out.append(f'<line x1="{x:.1f}" y1="{T}" x2="{x:.1f}" y2="{T + ph}" stroke="#f0f0f0"/>')
            out.append(f'<text x="{x:.1f}" y="{T + ph + 15}" text-anchor="middle">{e(tick_label(t))}</text>')
        out.append(f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
        out.append(f'<text x="{L + pw / 2:.1f}" y="{H - 8}" text-anchor="middle">{e(self.xlabel)}</text>')
        out.append(f'<text transform="translate(14,{T + ph / 2:.1f}) rotate(-90)" text-anchor="middle">'
                   f'{e(self.ylabel)}</text>')
        g = [f'<g clip-path="url(#{self.id}-clip)">']
        for it in self.items:
            kind = it[0]
            if kind == "line":
                _, xs, ys, label, color, width, op, dash = it
                xs, ys = thin(xs, ys)
                ok = np.isfinite(ys) & ((ys > 0) if self.logy else True)
                pts = " ".join(f"{sx(a):.1f},{sy(b):.1f}" for a, b in zip(xs[ok], ys[ok]))
                if pts:
                    d = f' stroke-dasharray="{dash}"' if dash else ""
                    g.append(f'<polyline fill="none" stroke="{color}" stroke-width="{width}" '
                             f'stroke-opacity="{op}"{d} points="{pts}"/>')
            elif kind == "points":
                _, xs, ys, label, color, r = it
                ok = np.isfinite(ys) & ((ys > 0) if self.logy else True)
                for a, b in zip(xs[ok], ys[ok]):
                    g.append(f'<circle cx="{sx(a):.1f}" cy="{sy(b):.1f}" r="{r}" fill="{color}"/>')
            elif kind == "vlines":
                _, xs, label, color, dash = it
                for a in xs:
                    g.append(f'<line x1="{sx(a):.1f}" y1="{T}" x2="{sx(a):.1f}" y2="{T + ph}" stroke="{color}" '
                             f'stroke-dasharray="{dash}"/>')
            elif kind == "hline":
                _, y, label, color, dash = it
                if not self.logy or y > 0:
                    g.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{L + pw}" y2="{sy(y):.1f}" stroke="{color}" '
                             f'stroke-dasharray="{dash}"/>')
            elif kind == "bars":
                _, edges, hs, label, color, op = it
                base = sy(y0) if self.logy else sy(max(y0, 0.0))
                for a, b, h in zip(edges[:-1], edges[1:], hs):
                    if h > 0 and (not self.logy or h > 0):
                        top = sy(h)
                        g.append(f'<rect x="{sx(a):.1f}" y="{top:.1f}" width="{max(0.5, sx(b) - sx(a)):.1f}" '
                                 f'height="{max(0.0, base - top):.1f}" fill="{color}" fill-opacity="{op}"/>')
        g.append("</g>")
        out += g
        lx, ly = L + pw + 12, T + 6
        for kind, label, color, dash, op in self.legend():
            if kind == "line":
                d = f' stroke-dasharray="{dash}"' if dash else ""
                out.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 18}" y2="{ly}" stroke="{color}" stroke-width="2" '
                           f'stroke-opacity="{op}"{d}/>')
            elif kind == "point":
                out.append(f'<circle cx="{lx + 9}" cy="{ly}" r="3" fill="{color}"/>')
            else:
                out.append(f'<rect x="{lx}" y="{ly - 5}" width="18" height="10" fill="{color}" fill-opacity="{op}"/>')
            out.append(f'<text x="{lx + 24}" y="{ly + 4}">{e(label)}</text>')
            ly += 16
        out.append("</svg>")
        return "\n".join(out)


def shade(i: int, n: int, dark=(8, 48, 107), light=(158, 202, 225)) -> str:
    """Light (i = 0) to dark (i = n - 1): depth, as the paper's Figure 4."""
    f = i / (n - 1) if n > 1 else 1.0
    r, g, b = (round(l + (d - l) * f) for l, d in zip(light, dark))
    return f"#{r:02x}{g:02x}{b:02x}"
