"""The run report (`open1b report RUN`): one self-contained HTML page with the paper's diagnostics.

Everything is read from the run's verified artifacts: run.json (the config), the ledger (chain
verified first; a broken ledger is an error, never a partial page) and the checkpoints (each one's
parameter hash checked against the ledger before its weights are used). Each figure is a Plot (the
data, geometry, ticks and legend of one panel) drawn by matplotlib where it is installed (the
`report` extra: PNGs shown in the page as data URIs) or, without it, by the built-in SVG writer
and rasterizer (inline SVG in the page); either way the page is one file (no scripts, no external
files) and the same panels are PNGs next to it (OUT/<figure id>.png; each caption links its PNG).
One job per module:

    data      the run read and checked (load_run_data); the tables' numbers (summarize, milestones,
              grad_stats)
    plot      Plot: one panel as SVG or PNG (axes: ticks, labels and thinning both draw alike;
              png: the rasterizer and encoder)
    mpl       a Plot drawn by matplotlib (Agg), deterministic PNG bytes
    figures   the paper's figures of a run (figure ids and captions)
    page      the HTML page and the files next to it (render, write_report, the figure engines)
"""
from .data import (ReportError, checkpoint_norms, gnmr_active, grad_stats, load_run_data, milestones, summarize,
                   trailing_mean, windows)
from .figures import FIGURE_IDS, figures
from .page import FIGURE_ENGINES, figure_engine, render, write_report
from .axes import thin
from .plot import PALETTE, Plot, shade

__all__ = ["FIGURE_ENGINES", "FIGURE_IDS", "PALETTE", "Plot", "ReportError", "checkpoint_norms", "figure_engine",
           "figures", "gnmr_active", "grad_stats", "load_run_data", "milestones", "render", "shade", "summarize", "thin",
           "trailing_mean", "windows", "write_report"]
