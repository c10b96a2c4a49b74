"""A report.Plot drawn by matplotlib (the `report` extra): the PNG figures people reuse.

The same panel as Plot.svg(), from the same data and geometry: the plot area at the frame's place,
its data ranges, the tick positions and labels of axes.py, the thinned lines, every item and the
legend on the right. A Plot unit is `scale` pixels (the figure is W·scale × H·scale pixels at
100·scale dpi, so a unit is 0.72 pt); text is DejaVu Sans (shipped with matplotlib).

Deterministic: the Agg canvas (no pyplot, no global backend), matplotlib's default style whatever
the user's matplotlibrc says, and the pixels encoded by png.encode_png (no timestamp, no software
tag, no other metadata), so one matplotlib version gives the same bytes on every run.
"""
from __future__ import annotations

import importlib.util

import numpy as np

from .axes import thin, tick_label
from .png import encode_png

PT = 0.72          # points per Plot unit

# matplotlib's defaults (style "default"), then what makes a panel look like its SVG
_RC = {"font.family": "DejaVu Sans", "font.size": 11 * PT, "lines.scale_dashes": False,
       "axes.edgecolor": "#888888", "axes.linewidth": PT, "text.color": "#222222",
       "xtick.color": "#222222", "ytick.color": "#222222", "xtick.labelcolor": "#222222",
       "ytick.labelcolor": "#222222", "path.simplify": False}


def available() -> bool:
    """matplotlib can be imported here."""
    return importlib.util.find_spec("matplotlib") is not None


def _dash(dash):
    """An SVG stroke-dasharray ("3,2", in Plot units) as a matplotlib line style."""
    return (0, tuple(float(v) * PT for v in dash.split(","))) if dash else "-"


def figure(plot, scale: int = 2):
    """The panel as a matplotlib Figure on an Agg canvas (drawn, not yet encoded)."""
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import NullLocator

    W, H = plot.W, plot.H
    fr = plot.frame()
    L, T, pw, ph = fr["L"], fr["T"], fr["pw"], fr["ph"]
    with matplotlib.style.context("default"), matplotlib.rc_context(_RC):
        fig = Figure(figsize=(W / 100, H / 100), dpi=100 * scale, facecolor="white")
        FigureCanvasAgg(fig)
        ax = fig.add_axes((L / W, 1 - (T + ph) / H, pw / W, ph / H))
        if plot.logy:
            ax.set_yscale("log")
        ax.set_xlim(fr["x0"], fr["x1"])
        ax.set_ylim(fr["y0"], fr["y1"])
        ax.set_xticks(fr["xticks"], [tick_label(t) for t in fr["xticks"]])
        ax.set_yticks(fr["yticks"], [tick_label(t) for t in fr["yticks"]])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_minor_locator(NullLocator())
        ax.tick_params(length=0, pad=5 * PT, labelsize=11 * PT)
        ax.grid(True, axis="y", color="#e6e6e6", linewidth=PT)
        ax.grid(True, axis="x", color="#f0f0f0", linewidth=PT)
        ax.set_axisbelow(True)
        fig.text(L / W, 1 - 18 / H, plot.title, fontsize=13 * PT, fontweight="bold", ha="left", va="baseline")
        fig.text((L + pw / 2) / W, 8 / H, plot.xlabel, ha="center", va="baseline")
        fig.text(14 / W, 1 - (T + ph / 2) / H, plot.ylabel, rotation=90, rotation_mode="anchor", ha="center",
                 va="baseline")
        for it in plot.items:
            _draw(ax, it, plot.logy, fr)
        handles, labels = [], []
        for kind, label, color, dash, op in plot.legend():
            if kind == "line":
                handles.append(Line2D([], [], color=color, linewidth=2 * PT, alpha=op, linestyle=_dash(dash)))
            elif kind == "point":
                handles.append(Line2D([], [], color=color, linestyle="none", marker="o", markersize=6 * PT,
                                      markeredgewidth=0))
            else:
                handles.append(Patch(facecolor=color, alpha=op, linewidth=0))
            labels.append(label)
        if handles:
            fs = 11
            fig.legend(handles, labels, loc="upper left", bbox_to_anchor=((L + pw + 12) / W, 1 - (T - 2) / H),
                       frameon=False, fontsize=fs * PT, borderpad=0, borderaxespad=0, handlelength=18 / fs,
                       handleheight=10 / fs, handletextpad=6 / fs, labelspacing=5 / fs)
    return fig


def _draw(ax, it, logy: bool, fr) -> None:
    """One Plot item, as Plot.svg() draws it (non-finite points, and on a log axis non-positive ones,
    left out; lines thinned by axes.thin)."""
    kind = it[0]
    if kind == "line":
        _, xs, ys, label, color, width, op, dash = it
        xs, ys = thin(xs, ys)
        ok = np.isfinite(ys) & ((ys > 0) if logy else True)
        if ok.any():
            ax.plot(xs[ok], ys[ok], color=color, linewidth=width * PT, alpha=op, linestyle=_dash(dash))
    elif kind == "points":
        _, xs, ys, label, color, r = it
        ok = np.isfinite(ys) & ((ys > 0) if logy else True)
        if ok.any():
            ax.plot(xs[ok], ys[ok], color=color, linestyle="none", marker="o", markersize=2 * r * PT,
                    markeredgewidth=0)
    elif kind == "vlines":
        _, xs, label, color, dash = it
        if len(xs):
            ax.vlines(xs, fr["y0"], fr["y1"], colors=color, linewidths=PT, linestyles=[_dash(dash)])
    elif kind == "hline":
        _, y, label, color, dash = it
        if not logy or y > 0:
            ax.axhline(y, color=color, linewidth=PT, linestyle=_dash(dash))
    elif kind == "bars":
        _, edges, hs, label, color, op = it
        base = fr["y0"] if logy else max(fr["y0"], 0.0)
        keep = hs > 0
        if keep.any():
            ax.bar(edges[:-1][keep], hs[keep] - base, width=np.diff(edges)[keep], bottom=base, align="edge",
                   color=color, alpha=op, linewidth=0)


def png(plot, scale: int = 2) -> bytes:
    """The panel as PNG bytes (RGB, W·scale × H·scale pixels)."""
    fig = figure(plot, scale)
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())
    return encode_png(np.ascontiguousarray(rgba[..., :3]))
