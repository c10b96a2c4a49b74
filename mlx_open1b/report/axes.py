"""What the SVG and the PNG of a report.Plot draw alike: tick positions, tick labels and the
thinning of long lines (min and max of each bucket, so spikes survive)."""
from __future__ import annotations

import math

import numpy as np


def tick_label(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        m, e = f"{v:.1e}".split("e")
        return f"{m.rstrip('0').rstrip('.')}e{int(e)}"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
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


def log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1,) if b - a > 3 else (1, 2, 5)
    out = [t for t in (m * 10.0 ** e for e in range(a, b + 1) for m in mults) if lo <= t <= hi]
    return out if len(out) >= 3 else nice_ticks(lo, hi)


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
