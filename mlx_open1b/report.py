"""The run report (`open1b report RUN`): one self-contained HTML page with the paper's diagnostics.

Everything is read from the run's verified artifacts: run.json (the config), the ledger (chain
verified first; a broken ledger is an error, never a partial page) and the checkpoints (each one's
parameter hash checked against the ledger before its weights are used). No plotting library: the
figures are small SVG line plots written here, inline in the page (no scripts, no external files),
and the same panels as PNGs next to the page (OUT/<figure id>.png, drawn by mlx_open1b.png from the
same Plot data and geometry; each caption links its PNG).

Figures (ids in the page):
  fig-loss        training CE per step, its short and long trailing means, held-out mixture CE
                  (records with "eval") and per-source held-out CE                (paper Fig. 1a)
  fig-gradnorm    pre-clip global gradient norm per step and its trailing mean, the clip threshold,
                  clipped steps, spike (skip-protocol) events and skipped steps   (Fig. 2a)
  fig-gradhist    distribution of pre-clip norms, warmup vs. steady state        (Fig. 2b)
  fig-lr          learning rate per step                                           (Fig. 3a)
  fig-batch       batch schedule: tokens and microbatches per optimizer step      (Fig. 3b)
  fig-update      |Δ log ‖W‖| per 1,000 steps by branch, from checkpoints          (Fig. 3c)
  fig-wq, fig-wk, fig-wv   per-layer Frobenius norms of the Q/K/V projections      (Fig. 4a-c)
  fig-emb         Frobenius norms of the input embedding and the LM head          (Fig. 4d)
  fig-zloss       z-loss term per step
  fig-gnmr        units on GNMR's recovery path per step (only when records carry "gnmr")
  fig-speed       tokens/s (only when step times are logged: records' "seconds"/"step_seconds"
                  fields, or RUN/metrics.jsonl lines {"step": t, "seconds": s}; the trainer's
                  ledger holds no times, since they would make equal runs' ledgers differ)
Tables: the run summary (paper Table 7), loss milestones (Table 8), gradient-norm statistics
(Table 9), GNMR promotions. The summary is also embedded as JSON (`<script type="application/json"
id="summary">`) with exactly the numbers computed from the ledger.
"""
from __future__ import annotations

import datetime
import html
import json
import math
import pathlib

import numpy as np

from . import __version__

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22"]


class ReportError(Exception):
    """The run cannot be reported on; the message names the file and step."""

    def __init__(self, msg: str, exit_code: int = 2):
        super().__init__(msg)
        self.exit_code = exit_code


# ------------------------------------------------------------------------------- SVG plots
def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        m, e = f"{v:.1e}".split("e")
        return f"{m.rstrip('0').rstrip('.')}e{int(e)}"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    t = math.ceil(lo / step) * step
    out = []
    while t <= hi + step * 1e-9:
        out.append(round(t, 12))
        t += step
    return out


def _log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1,) if b - a > 3 else (1, 2, 5)
    out = [t for t in (m * 10.0 ** e for e in range(a, b + 1) for m in mults) if lo <= t <= hi]
    return out if len(out) >= 3 else _nice_ticks(lo, hi)


def thin(xs, ys, n: int = 1200):
    """At most about n points: above that, the min and max of each bucket (spikes survive)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) <= n:
        return xs, ys
    buckets = np.array_split(np.arange(len(xs)), n // 2)
    keep = []
    for b in buckets:
        yb = ys[b]
        if not np.isfinite(yb).any():
            continue
        i, j = b[np.nanargmin(yb)], b[np.nanargmax(yb)]
        keep += sorted({int(i), int(j)})
    return xs[keep], ys[keep]


def trailing_mean(ys, w: int) -> np.ndarray:
    """Mean of the last w values (fewer at the start)."""
    y = np.asarray(ys, float)
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(0, i - w)
    return (c[i] - c[lo]) / (i - lo)


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
                "yticks": _log_ticks(y0, y1) if self.logy else _nice_ticks(y0, y1),
                "xticks": _nice_ticks(x0, x1, 6)}

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
        """The same panel as a PNG (mlx_open1b.png: built-in rasterizer and encoder)."""
        from .png import encode_png, rasterize
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
            out.append(f'<text x="{L - 5}" y="{y + 4:.1f}" text-anchor="end">{e(_fmt(t))}</text>')
        for t in fr["xticks"]:
            x = sx(t)
            out.append(f'<line x1="{x:.1f}" y1="{T}" x2="{x:.1f}" y2="{T + ph}" stroke="#f0f0f0"/>')
            out.append(f'<text x="{x:.1f}" y="{T + ph + 15}" text-anchor="middle">{e(_fmt(t))}</text>')
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


# ------------------------------------------------------------------------------- data
def load_run_data(run_dir, max_checkpoints: int = 64) -> dict:
    """run.json, the verified ledger records, step times if logged, and per-checkpoint weight norms."""
    from .ledger import LedgerError, read_records, verify_chain
    from .train import LEDGER_FILE, RUN_FILE
    run = pathlib.Path(run_dir)
    rf = run / RUN_FILE
    if not rf.exists():
        raise ReportError(f"{run}: not a run directory (no {RUN_FILE})")
    try:
        info = json.loads(rf.read_text())
        info["genesis"], info["config"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ReportError(f"{rf}: malformed ({e!r})", exit_code=1) from None
    try:
        run_hash = verify_chain(run / LEDGER_FILE, info["genesis"])
    except LedgerError as e:
        raise ReportError(f"the run's ledger does not verify, no report is written: {e}", exit_code=1) from None
    records = read_records(run / LEDGER_FILE)
    if not records:
        raise ReportError(f"{run / LEDGER_FILE}: the ledger is empty: nothing to report")
    times = _step_times(run, records)
    norms = checkpoint_norms(run, info, records, max_checkpoints)
    return {"dir": run, "info": info, "records": records, "run_hash": run_hash, "times": times, "norms": norms}


def _step_times(run: pathlib.Path, records: list) -> dict[int, float]:
    out = {}
    for r in records:
        for k in ("step_seconds", "seconds"):
            if isinstance(r.get(k), (int, float)):
                out[r["step"]] = float(r[k])
                break
    mf = run / "metrics.jsonl"
    if mf.exists():
        for i, line in enumerate(mf.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                m = json.loads(line)
                out[int(m["step"])] = float(m["seconds"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ReportError(f"{mf}: line {i}: expected {{\"step\": t, \"seconds\": s}} ({e})") from None
    return out


def _branches(cfg) -> dict[str, list[str]]:
    L = cfg.n_layers
    return {"W_Q": [f"layers.{l}.wq" for l in range(L)], "W_K": [f"layers.{l}.wk" for l in range(L)],
            "W_V": [f"layers.{l}.wv" for l in range(L)],
            "FFN": [f"layers.{l}.{w}" for l in range(L) for w in ("w_gate_up", "w_down")],
            "embedding": ["wte"], "unembedding": ["lm_head"]}


def checkpoint_norms(run: pathlib.Path, info: dict, records: list, max_checkpoints: int = 64) -> list[dict]:
    """[{"step", "tensors": {name: Frobenius norm}}] for the checkpoints (at most max_checkpoints,
    evenly spaced, the first and the last always), each one's file SHA-256 and parameter hash
    checked against its meta.json and the ledger (params after step s-1) before its weights are used."""
    from .checkpoint import CheckpointError, list_checkpoints, load_checkpoint
    from .config import RunConfig
    from .model import ParamLayout
    cfg = RunConfig.from_json(info["config"]).model
    layout = ParamLayout(cfg)
    by_step = {r["step"]: r for r in records}
    out = []
    ckpts = [(s, p) for s, p in list_checkpoints(run) if s == 0 or s - 1 in by_step]   # checkable ones
    if len(ckpts) > max_checkpoints >= 2:
        keep = sorted({round(i * (len(ckpts) - 1) / (max_checkpoints - 1)) for i in range(max_checkpoints)})
        ckpts = [ckpts[i] for i in keep]
    for step, path in ckpts:
        try:
            tensors, meta = load_checkpoint(path, verify_tensors=False)
        except CheckpointError as e:
            raise ReportError(f"{e}", exit_code=1) from None
        if meta.get("genesis") != info["genesis"]:
            raise ReportError(f"{path}: belongs to another run (genesis differs)", exit_code=1)
        if step > 0 and meta.get("params_hash") != by_step[step - 1]["hashes"]["params"]:
            raise ReportError(f"{path}: parameter hash differs from the ledger's after step {step - 1}", exit_code=1)
        bits = tensors["params"][0]
        vals = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
        norms = {}
        for t in layout:
            v = vals[t.offset:t.offset + t.size].astype(np.float64)
            norms[t.name] = float(np.sqrt(np.dot(v, v)))
        out.append({"step": step, "tokens": int(meta.get("consumed", 0)), "tensors": norms})
    return out


# ------------------------------------------------------------------------------- numbers
def windows(n: int) -> tuple[int, int]:
    """Trailing-mean windows (short, long) for n steps (the paper: 100 and 2,000 of 80,957)."""
    return max(2, round(n / 100)), max(5, round(n / 20))


def _pct(a, q):
    return float(np.percentile(np.asarray(a, float), q)) if len(a) else float("nan")


def grad_stats(recs: list, clip: float) -> dict:
    g = np.array([r["grad_norm"] for r in recs], float)
    if not len(g):
        return {"steps": 0}
    i = int(np.nanargmax(g))
    return {"steps": len(g), "median": _pct(g, 50), "mean": float(np.mean(g)), "p95": _pct(g, 95),
            "p99": _pct(g, 99), "max": float(g[i]), "max_step": recs[i]["step"],
            "clipped": int(sum(r["clipped"] for r in recs)), "clip_rate": sum(r["clipped"] for r in recs) / len(g),
            "above_2": int((g > 2).sum()), "above_clip": int((g > clip).sum()),
            "skipped": int(sum(r["skipped"] for r in recs)), "spikes": int(sum(r["spike"] for r in recs))}


def summarize(data: dict) -> dict:
    """The run summary (paper Table 7) from the ledger; plain numbers."""
    from .config import RunConfig
    recs, info = data["records"], data["info"]
    cfg = RunConfig.from_json(info["config"])
    n = len(recs)
    _, wl = windows(n)
    evals = [r for r in recs if "eval" in r]
    ce = [r["ce"] for r in recs]
    times = [data["times"][r["step"]] for r in recs if r["step"] in data["times"]]
    warm = cfg.train.warmup_tokens
    steady = [r for r in recs if r["tokens"] > warm]
    s = {"run_hash": data["run_hash"], "genesis": info["genesis"], "preset": cfg.preset, "precision": cfg.precision,
         "parameters": cfg.model.n_params(), "steps": n, "first_step": recs[0]["step"], "last_step": recs[-1]["step"],
         "tokens": recs[-1]["tokens"], "final_train_ce": recs[-1]["ce"],
         "final_train_ce_mean": float(np.mean(ce[-wl:])), "train_ce_window": min(wl, n),
         "final_loss": recs[-1]["loss"], "final_zloss": recs[-1].get("zloss"),
         "final_heldout_ce": evals[-1]["eval"].get("mixture") if evals else None,
         "final_heldout_step": evals[-1]["step"] if evals else None,
         "first_heldout_ce": evals[0]["eval"].get("mixture") if evals else None,
         "skipped_steps": int(sum(r["skipped"] for r in recs)), "spike_events": int(sum(r["spike"] for r in recs)),
         "spike_steps": [r["step"] for r in recs if r["spike"]],
         "clipped_steps": int(sum(r["clipped"] for r in recs)),
         "clip_rate": sum(r["clipped"] for r in recs) / n,
         "clip_rate_steady": (sum(r["clipped"] for r in steady) / len(steady)) if steady else None,
         "median_step_seconds": float(np.median(times)) if times else None,
         "training_seconds": float(np.sum(times)) if times else None,
         "checkpoints": [c["step"] for c in data["norms"]]}
    return s


def milestones(recs: list, k: int = 8) -> list[dict]:
    """Loss milestones (paper Table 8): at k evenly spaced steps, the long trailing mean of the
    training CE and the latest held-out mixture CE."""
    n = len(recs)
    _, wl = windows(n)
    ce = trailing_mean([r["ce"] for r in recs], wl)
    out, last_eval = [], None
    idx = sorted({min(n - 1, max(0, round(n * (j + 1) / k) - 1)) for j in range(k)})
    ev = {}
    for i, r in enumerate(recs):
        if "eval" in r:
            last_eval = r["eval"].get("mixture")
        ev[i] = last_eval
    for i in idx:
        out.append({"step": recs[i]["step"], "tokens": recs[i]["tokens"], "train_ce_mean": float(ce[i]),
                    "heldout_ce": ev[i]})
    return out


def _gnmr_active(r: dict):
    g = r.get("gnmr", r.get("gnmr_active"))
    if isinstance(g, dict):
        g = g.get("active", g.get("active_set"))
    return list(g) if isinstance(g, (list, tuple)) else None


# ------------------------------------------------------------------------------- page
def figures(data: dict) -> list[tuple[str, str, Plot]]:
    """[(id, caption, plot)] of every figure the run's data supports (plot.svg() for the page,
    plot.png() for the PNG file)."""
    from .config import RunConfig
    recs, info = data["records"], data["info"]
    cfg = RunConfig.from_json(info["config"])
    steps = np.array([r["step"] for r in recs], float)
    n = len(recs)
    ws, wl = windows(n)
    figs = []
    # Figure 1: loss
    ce = np.array([r["ce"] for r in recs], float)
    p = Plot("fig-loss", "Cross-entropy: training vs. held-out", "step", "cross-entropy (nats)", logy=True)
    p.line(steps, ce, "training CE", PALETTE[0], 1.0, 0.35)
    p.line(steps, trailing_mean(ce, ws), f"{ws}-step mean", PALETTE[0], 1.5, 0.8)
    p.line(steps, trailing_mean(ce, wl), f"{wl}-step mean", PALETTE[0], 2.5)
    evals = [r for r in recs if "eval" in r]
    if evals:
        ex = [r["step"] for r in evals]
        p.line(ex, [r["eval"].get("mixture", float("nan")) for r in evals], "held-out (mixture)", PALETTE[1], 2)
        p.points(ex, [r["eval"].get("mixture", float("nan")) for r in evals], "", PALETTE[1])
        sources = sorted({k for r in evals for k in r["eval"] if k != "mixture"})
        for j, s in enumerate(sources):
            p.line(ex, [r["eval"].get(s, float("nan")) for r in evals], f"held-out {s}", PALETTE[2 + j % 7], 1, 0.7,
                   "3,2")
    figs.append(("fig-loss", "Figure 1. Training cross-entropy per step (light), its trailing means, and the "
                 "held-out cross-entropy (mixture and per source) at each evaluation (paper Fig. 1a).", p))
    # Figure 2a: gradient norm
    g = np.array([r["grad_norm"] for r in recs], float)
    clip = cfg.train.clip_norm
    p = Plot("fig-gradnorm", "Pre-clip global gradient norm", "step", "‖g‖ (pre-clip)", logy=True)
    p.line(steps, g, "per step", PALETTE[0], 1.0, 0.4)
    p.line(steps, trailing_mean(g, ws), f"{ws}-step mean", PALETTE[0], 2)
    p.hline(clip, f"clip threshold {clip:g}", "#555")
    p.hline(cfg.train.spike_threshold, f"spike threshold {cfg.train.spike_threshold:g}", PALETTE[1], "2,3")
    cl = [r for r in recs if r["clipped"]]
    p.points([r["step"] for r in cl], [r["grad_norm"] for r in cl], f"clipped ({len(cl)})", PALETTE[3], 2.0)
    sk = [r for r in recs if r["skipped"]]
    p.points([r["step"] for r in sk], [r["grad_norm"] for r in sk], f"skipped ({len(sk)})", PALETTE[4], 3.0)
    p.vlines([r["step"] for r in recs if r["spike"]], f"spike events ({sum(r['spike'] for r in recs)})", PALETTE[1])
    figs.append(("fig-gradnorm", "Figure 2a. Pre-clip gradient norm per step and its trailing mean; the clip and "
                 "spike thresholds, clipped and skipped steps, and the spike-protocol activations (dotted).", p))
    # Figure 2b: distribution
    warm = cfg.train.warmup_tokens
    gp = g[g > 0]
    p = Plot("fig-gradhist", "Distribution of pre-clip gradient norms", "log10 ‖g‖", "fraction of steps")
    if gp.size:
        lo, hi = math.log10(gp.min()), math.log10(gp.max())
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
        edges = np.linspace(lo, hi, 31)
        for j, (name, sel) in enumerate((("warmup", [r["tokens"] <= warm for r in recs]),
                                         ("steady state", [r["tokens"] > warm for r in recs]))):
            v = g[np.array(sel) & (g > 0)]
            if v.size:
                h, _ = np.histogram(np.log10(v), edges)
                p.bars(edges, h / len(g), f"{name} ({v.size})", PALETTE[j * 3], 0.5)
    figs.append(("fig-gradhist", "Figure 2b. Distribution of pre-clip gradient norms, warmup vs. steady state.",
                 p))
    # Figure 3a, 3b: schedules
    p = Plot("fig-lr", "Learning-rate schedule", "step", "learning rate", zero=True)
    p.line(steps, [r["lr"] for r in recs], "lr", PALETTE[0], 2)
    figs.append(("fig-lr", "Figure 3a. Learning rate of each step (token-anchored warmup and cosine).", p))
    tok = np.diff(np.concatenate([[0], [r["tokens"] for r in recs]]))
    if recs[0]["step"] != 0:
        tok[0] = tok[1] if len(tok) > 1 else tok[0]
    p = Plot("fig-batch", "Batch schedule", "step", "tokens per step / microbatches", zero=True)
    p.line(steps, tok, "tokens per step", PALETTE[0], 2)
    mb = np.array([r.get("microbatches", float("nan")) for r in recs], float)
    scale = float(np.nanmax(tok) / np.nanmax(mb)) if np.isfinite(mb).any() and np.nanmax(mb) > 0 else 1.0
    p.line(steps, mb * scale, f"microbatches (× {scale:,.0f})", PALETTE[1], 1.5, 1.0, "5,3")
    figs.append(("fig-batch", "Figure 3b. Batch schedule: tokens per optimizer step and microbatches per step "
                 "(scaled onto the same axis).", p))
    # Figure 3c and 4: weight norms from checkpoints
    norms = data["norms"]
    br = _branches(cfg.model)
    if len(norms) >= 2:
        p = Plot("fig-update", "Effective relative update rate by branch", "step", "|Δ log ‖W‖| per 1,000 steps",
                 logy=True)
        for j, (b, names) in enumerate(br.items()):
            tot = [math.sqrt(sum(c["tensors"][nm] ** 2 for nm in names)) for c in norms]
            xs, ys = [], []
            for c0, c1, w0, w1 in zip(norms, norms[1:], tot, tot[1:]):
                ds = c1["step"] - c0["step"]
                if ds > 0 and w0 > 0 and w1 > 0:
                    xs.append(c1["step"]), ys.append(abs(math.log(w1 / w0)) * 1000 / ds)
            p.line(xs, ys, b, PALETTE[j], 1.8)
        figs.append(("fig-update", "Figure 3c. Effective relative weight-update rate |Δ log ‖W‖| per 1,000 steps by "
                     "parameter branch (aggregated across layers), between consecutive checkpoints.", p))
    cx = [c["step"] for c in norms]
    L = cfg.model.n_layers
    for key, title in (("wq", "query"), ("wk", "key"), ("wv", "value")):
        p = Plot(f"fig-{key}", f"Per-layer ‖W_{key[1].upper()}‖ ({title} projection)", "step", "Frobenius norm")
        for l in range(L):
            label = f"layer {l}" if L <= 12 or l in (0, L // 2, L - 1) else ""
            p.line(cx, [c["tensors"][f"layers.{l}.{key}"] for c in norms], label, shade(l, L), 1.6)
            if len(norms) == 1:
                p.points(cx, [c["tensors"][f"layers.{l}.{key}"] for c in norms], "", shade(l, L))
        figs.append((f"fig-{key}", f"Figure 4{'abc'['wq wk wv'.split().index(key)]}. Frobenius norm of each layer's "
                     f"{title} projection at every checkpoint; shade encodes depth (layer 0 light).", p))
    p = Plot("fig-emb", "Embedding matrices", "step", "Frobenius norm")
    p.line(cx, [c["tensors"]["wte"] for c in norms], "input embedding (wte)", PALETTE[0], 2)
    p.line(cx, [c["tensors"]["lm_head"] for c in norms], "unembedding (lm_head)", PALETTE[1], 2)
    figs.append(("fig-emb", "Figure 4d. Frobenius norms of the input embedding and the LM head at every checkpoint.",
                 p))
    # z-loss
    p = Plot("fig-zloss", "z-loss term", "step", "z-loss (mean zcoef·lse²)", logy=True)
    p.line(steps, [r.get("zloss", float("nan")) for r in recs], "per step", PALETTE[2], 1.0, 0.4)
    p.line(steps, trailing_mean([r.get("zloss", float("nan")) for r in recs], ws), f"{ws}-step mean", PALETTE[2], 2)
    figs.append(("fig-zloss", "The z-loss term of the loss per step (the LM head's log-partition penalty).", p))
    # GNMR
    act = [(r["step"], _gnmr_active(r)) for r in recs]
    act = [(s, a) for s, a in act if a is not None]
    if act:
        p = Plot("fig-gnmr", "GNMR: units on the recovery path", "step", "active units")
        p.line([s for s, _ in act], [len(a) for _, a in act], "active units", PALETTE[4], 1.2)
        if cfg.gnmr is not None:
            p.hline(cfg.gnmr.max_o, f"budget maxO = {cfg.gnmr.max_o}", "#555")
        figs.append(("fig-gnmr", "GNMR activity: number of units on the higher-precision recovery path per step.",
                     p))
    # speed
    times = data["times"]
    if times:
        tk = {r["step"]: t for r, t in zip(recs, tok)}
        xs = sorted(s for s in times if s in tk and times[s] > 0)
        p = Plot("fig-speed", "Throughput", "step", "tokens / s")
        p.line(xs, [tk[s] / times[s] for s in xs], "tokens/s", PALETTE[5], 1.2)
        figs.append(("fig-speed", "Training throughput per step (from the logged step times).", p))
    return figs


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
    ("training_seconds", "training time (s)"), ("preset", "preset"), ("precision", "precision"),
]


def render(data: dict, png_links: bool = False, figs=None) -> str:
    """The HTML page; png_links: each figure's caption links its PNG (<id>.png next to the page)."""
    from .config import RunConfig
    recs, info = data["records"], data["info"]
    cfg = RunConfig.from_json(info["config"])
    s = summarize(data)
    e = html.escape
    h = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         f"<title>open1b run report: {e(data['dir'].name)}</title>", f"<style>{CSS}</style></head><body>",
         f"<h1>Run report: {e(str(data['dir']))}</h1>",
         f"<p>Run hash <code>{e(data['run_hash'])}</code> (ledger chain verified, {len(recs)} records); genesis "
         f"<code>{e(info['genesis'])}</code>; contract v{e(str(info.get('contract_version')))}; "
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
    act = [a for a in (_gnmr_active(r) for r in recs) if a is not None]
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
        h.append(f'<figure id="{fid}">{plot.svg()}<figcaption>{e(caption)}{link}</figcaption></figure>')
    if not data["times"]:
        h.append("<p>Throughput: no step times were logged for this run (the ledger holds no times; a "
                 "<code>metrics.jsonl</code> in the run directory with lines <code>{\"step\": t, \"seconds\": s}</code> "
                 "adds the throughput figure).</p>")
    h.append("</body></html>")
    return "\n".join(h) + "\n"


FIGURE_IDS = ("fig-loss", "fig-gradnorm", "fig-gradhist", "fig-lr", "fig-batch", "fig-update", "fig-wq", "fig-wk",
              "fig-wv", "fig-emb", "fig-zloss", "fig-gnmr", "fig-speed")


def write_report(run_dir, out_dir=None, max_checkpoints: int = 64, png: bool = True,
                 png_scale: int = 2) -> pathlib.Path:
    """Write OUT/index.html (default RUN/report/index.html) and, with png, OUT/<figure id>.png for
    every figure (png_scale pixels per SVG unit), each file atomically, the page last; returns the
    page's path. PNGs of figures this run no longer has (a previous report's) are removed."""
    from .fsutil import write_bytes_atomic
    data = load_run_data(run_dir, max_checkpoints)
    out = pathlib.Path(out_dir) if out_dir is not None else pathlib.Path(run_dir) / "report"
    figs = figures(data)
    page = render(data, png, figs)
    keep = set()
    if png:
        for fid, _, plot in figs:
            write_bytes_atomic(out / f"{fid}.png", plot.png(png_scale))
            keep.add(fid)
    for fid in set(FIGURE_IDS) - keep:
        (out / f"{fid}.png").unlink(missing_ok=True)
    path = out / "index.html"
    write_bytes_atomic(path, page.encode("utf-8"))
    return path
