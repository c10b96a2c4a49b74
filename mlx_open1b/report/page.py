"""The report page: one self-contained HTML file (no scripts, no external files) with the run
summary (paper Table 7), loss milestones (Table 8), gradient-norm statistics (Table 9), GNMR
promotions and the figures; the same figures as PNG files next to it, each caption linking its PNG.
The summary is also embedded as JSON (`<script type="application/json" id="summary">`) with exactly
the numbers computed from the ledger.

Figures (FIGURE_ENGINES): "matplotlib" (the `report` extra; mpl.py) draws each PNG, and the page
shows those very PNGs as data URIs; "builtin" (no plotting library) puts each panel in the page as
inline SVG and rasterizes the PNG files with png.py; "auto" is matplotlib where it is installed.
The tables and their numbers are the same either way.
"""
from __future__ import annotations

import base64
import datetime
import html
import json
import math
import pathlib

from .. import __version__
from ..fsutil import write_bytes_atomic
from . import mpl
from .data import ReportError, gnmr_active, grad_stats, load_run_data, milestones, summarize, windows
from .figures import FIGURE_IDS, figures

FIGURE_ENGINES = ("auto", "matplotlib", "builtin")


CSS = """body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1000px;
color:#222}h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;
font-size:13px}td.n{text-align:right;font-variant-numeric:tabular-nums}code{font-size:12px}
figure{margin:14px 0}figcaption{font-size:12px;color:#555;max-width:720px}"""


def _num(v, digits=4) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.{digits}f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


SUMMARY_ROWS = [
    ("steps", "optimizer steps"), ("tokens", "tokens consumed"), ("parameters", "parameters"),
    ("final_heldout_ce", "final held-out CE (mixture probe)"), ("final_heldout_step", "  … evaluated after step"),
    ("final_train_ce_mean", "final training CE (trailing mean)"), ("train_ce_window", "  … over the last steps"),
    ("final_train_ce", "training CE of the last step"), ("final_zloss", "z-loss of the last step"),
    ("skipped_steps", "skipped optimizer steps"), ("spike_events", "spike events (skip protocol)"),
    ("clipped_steps", "clipped steps"), ("clip_rate", "clip rate (full run)"),
    ("clip_rate_steady", "clip rate (after warmup)"), ("median_step_seconds", "median step time (s)"),
    ("training_seconds", "training time (s)"), ("tokens_per_second", "tokens per second (timed steps)"),
    ("preset", "preset"), ("precision", "precision"),
]


def render(data: dict, png_links: bool = False, figs=None, images: dict | None = None) -> str:
    """The HTML page; png_links: each figure's caption links its PNG (<id>.png next to the page);
    images: {figure id: PNG bytes} shown as data URIs (the matplotlib figures), else inline SVG."""
    recs, info = data["records"], data["info"]
    cfg = info.config
    s = summarize(data)
    e = html.escape
    h = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         f"<title>open1b run report: {e(data['dir'].name)}</title>", f"<style>{CSS}</style></head><body>",
         f"<h1>Run report: {e(str(data['dir']))}</h1>",
         f"<p>Run hash <code>{e(data['run_hash'])}</code> (ledger chain verified, {len(recs)} records); genesis "
         f"<code>{e(info.genesis)}</code>; contract v{e(str(info.contract_version))}; "
         f"report by mlx-open1b {e(__version__)}, "
         f"{e(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'))}.</p>"]
    h.append('<h2 id="summary-table">Summary</h2><table class="summary">')
    for key, label in SUMMARY_ROWS:
        v = s[key]
        if key == "clip_rate" or key == "clip_rate_steady":
            txt = "—" if v is None else f"{100 * v:.2f}%"
        else:
            txt = _num(v)
        h.append(f'<tr data-key="{key}"><th>{e(label)}</th><td class="n">{e(txt)}</td></tr>')
    if s["spike_steps"]:
        h.append(f'<tr data-key="spike_steps"><th>spike steps</th><td>{e(", ".join(map(str, s["spike_steps"][:50])))}'
                 f'{" …" if len(s["spike_steps"]) > 50 else ""}</td></tr>')
    h.append("</table>")
    h.append('<script type="application/json" id="summary">' + json.dumps(s).replace("</", "<\\/") + "</script>")
    # milestones
    h.append('<h2 id="milestones">Loss milestones</h2><table><tr><th>step</th><th>tokens</th>'
             f'<th>training CE ({windows(len(recs))[1]}-step mean)</th><th>held-out CE (mixture)</th></tr>')
    for m in milestones(recs):
        h.append(f'<tr><td class="n">{m["step"]}</td><td class="n">{m["tokens"]:,}</td>'
                 f'<td class="n">{_num(m["train_ce_mean"])}</td><td class="n">{_num(m["heldout_ce"])}</td></tr>')
    h.append("</table>")
    # gradient statistics
    warm = cfg.train.warmup_tokens
    full, steady = grad_stats(recs, cfg.train.clip_norm), grad_stats([r for r in recs if r["tokens"] > warm],
                                                                      cfg.train.clip_norm)
    h.append('<h2 id="gradstats">Pre-clip gradient-norm statistics</h2><table><tr><th></th><th>full run</th>'
             f'<th>after warmup ({warm:,} tokens)</th></tr>')
    for key, label in (("steps", "steps"), ("median", "median"), ("mean", "mean"), ("p95", "95th percentile"),
                       ("p99", "99th percentile"), ("max", "maximum"), ("max_step", "  … at step"),
                       ("clipped", "clipped steps"), ("clip_rate", "clip rate"), ("above_2", "steps with ‖g‖ > 2"),
                       ("spikes", "spike events"), ("skipped", "skipped steps")):
        cells = []
        for st in (full, steady):
            v = st.get(key)
            cells.append("—" if v is None else f"{100 * v:.2f}%" if key == "clip_rate" else _num(v))
        h.append(f'<tr data-key="grad-{key}"><th>{e(label)}</th>' + "".join(f'<td class="n">{e(c)}</td>' for c in cells)
                 + "</tr>")
    h.append("</table>")
    # GNMR promotions
    act = [a for a in (gnmr_active(r) for r in recs) if a is not None]
    if act:
        counts: dict[str, int] = {}
        for a in act:
            for u in a:
                counts[str(u)] = counts.get(str(u), 0) + 1
        n_units = None
        if cfg.gnmr is not None:
            n_units = cfg.model.n_layers * (4 if cfg.gnmr.mode == "op" else 1)
        ratio = sum(counts.values()) / (len(act) * n_units) if n_units else None
        h.append('<h2 id="gnmr">GNMR promotions</h2><table><tr><th>unit</th><th>steps on the recovery path</th></tr>')
        for u, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:20]:
            h.append(f'<tr><td>{e(u)}</td><td class="n">{c}</td></tr>')
        h.append("</table>")
        h.append(f"<p>promotion ratio (unit-steps promoted / unit-steps): {_num(ratio)}; steps with any "
                 f"promotion: {sum(1 for a in act if a)} of {len(act)}.</p>")
    h.append('<h2 id="figures">Figures</h2>')
    for fid, caption, plot in (figures(data) if figs is None else figs):
        link = f' <a href="{fid}.png">PNG</a>' if png_links else ""
        if images is not None:
            uri = "data:image/png;base64," + base64.b64encode(images[fid]).decode("ascii")
            shown = (f'<img id="{fid}-png" src="{uri}" width="{plot.W}" height="{plot.H}" '
                     f'alt="{e(plot.title)}">')
        else:
            shown = plot.svg()
        h.append(f'<figure id="{fid}">{shown}<figcaption>{e(caption)}{link}</figcaption></figure>')
    if not data["times"]:
        h.append("<p>Throughput: no step times were logged for this run (the trainer writes them beside the "
                 "ledger, in <code>timing.jsonl</code>; a <code>metrics.jsonl</code> in the run directory with lines "
                 "<code>{\"step\": t, \"seconds\": s}</code> adds them).</p>")
    h.append("</body></html>")
    return "\n".join(h) + "\n"


def figure_engine(name: str = "auto") -> str:
    """"matplotlib" or "builtin" for a FIGURE_ENGINES name; "matplotlib" where it is not installed is
    a ReportError (exit 2) naming the extra."""
    if name not in FIGURE_ENGINES:
        raise ReportError(f"figures: {name!r} is none of {', '.join(FIGURE_ENGINES)}", exit_code=2)
    if name == "auto":
        return "matplotlib" if mpl.available() else "builtin"
    if name == "matplotlib" and not mpl.available():
        raise ReportError("figures: matplotlib is not installed here (pip install 'mlx-open1b[report]'), or "
                          "use the built-in figures (--figures builtin)", exit_code=2)
    return name


def write_report(run_dir, out_dir=None, max_checkpoints: int = 64, png: bool = True,
                 png_scale: int = 2, engine: str = "auto") -> pathlib.Path:
    """Write OUT/index.html (default RUN/report/index.html) and, with png, OUT/<figure id>.png for
    every figure (png_scale pixels per Plot unit), each file atomically, the page last; returns the
    page's path. engine: FIGURE_ENGINES (module docstring). PNGs of figures this run no longer has
    (a previous report's) are removed."""
    engine = figure_engine(engine)
    data = load_run_data(run_dir, max_checkpoints)
    out = pathlib.Path(out_dir) if out_dir is not None else pathlib.Path(run_dir) / "report"
    figs = figures(data)
    images = {fid: mpl.png(plot, png_scale) for fid, _, plot in figs} if engine == "matplotlib" else None
    page = render(data, png, figs, images)
    keep = set()
    if png:
        for fid, _, plot in figs:
            write_bytes_atomic(out / f"{fid}.png", images[fid] if images is not None else plot.png(png_scale))
            keep.add(fid)
    for fid in set(FIGURE_IDS) - keep:
        (out / f"{fid}.png").unlink(missing_ok=True)
    path = out / "index.html"
    write_bytes_atomic(path, page.encode("utf-8"))
    return path
