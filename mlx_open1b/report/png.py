"""PNG figures without a plotting library: a small anti-aliased rasterizer of a Plot (plot.py) into a
numpy RGB canvas, and a minimal PNG encoder (signature, IHDR, IDAT, IEND; zlib + CRC-32).

`rasterize(plot, scale)` draws what `Plot.svg()` draws, in the same geometry (scaled): grid, frame,
tick labels, axis labels, title, the clipped items (lines with dashes and opacity, points,
vertical/horizontal markers, bars) and the legend. Text uses a built-in 3x5 bitmap font (upper
case, digits, the punctuation of the report's labels; other characters print as "?").
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from .axes import thin, tick_label

_GLYPHS = (  # char:rows, each row an octal digit (bits left to right = 4, 2, 1)
    "0:75557 1:26227 2:71747 3:71317 4:55711 5:74717 6:74757 7:71122 8:75757 9:75717 A:25755 B:65656 "
    "C:34443 D:65556 E:74647 F:74644 G:34553 H:55755 I:72227 J:11152 K:55655 L:44447 M:57755 N:65555 "
    "O:25552 P:65644 Q:25563 R:65655 S:34216 T:72222 U:55557 V:55552 W:55775 X:55255 Y:55222 Z:71247 "
    ".:00002 ,:00024 -:00700 +:02720 (:12221 ):42224 /:11244 ::02020 =:07070 %:51245 |:22222 _:00007 "
    "':22000 ·:00200 ×:05250 ‖:55555 Δ:22557 ²:61270 …:00005 ?:71302")
FONT = {g[0]: np.array([[(int(o) >> (2 - b)) & 1 for b in range(3)] for o in g[-5:]], bool)
        for g in _GLYPHS.split(" ")}
FONT[" "] = np.zeros((5, 3), bool)


def rgb(color: str) -> np.ndarray:
    c = color.lstrip("#")
    if len(c) == 3:
        c = "".join(ch * 2 for ch in c)
    return np.array([int(c[i:i + 2], 16) for i in (0, 2, 4)], np.float32)


def text_mask(s: str, fs: int) -> np.ndarray:
    """The bitmap of s, fs pixels per font pixel: (5 fs, (4 len - 1) fs) bool."""
    if not s:
        return np.zeros((5 * fs, 0), bool)
    cols = []
    for ch in s.upper():
        cols += [FONT.get(ch, FONT["?"]), np.zeros((5, 1), bool)]
    return np.hstack(cols[:-1]).repeat(fs, 0).repeat(fs, 1)


class Canvas:
    """An RGB float canvas; every drawing call builds a coverage mask in [0, 1], then blends it."""

    def __init__(self, w: int, h: int, bg: str = "#ffffff"):
        self.w, self.h = w, h
        self.px = np.empty((h, w, 3), np.float32)
        self.px[:] = rgb(bg)

    def mask(self) -> np.ndarray:
        return np.zeros((self.h, self.w), np.float32)

    def blend(self, m: np.ndarray, color: str, opacity: float = 1.0, clip=None):
        """Paints color with alpha m * opacity (m: a mask()), only inside clip (x0, y0, x1, y1) if given."""
        x0, y0, x1, y1 = (max(0, int(round(v))) for v in (clip or (0, 0, self.w, self.h)))
        m = m[y0:y1, x0:x1]
        rows, cols = np.flatnonzero(m.any(1)), np.flatnonzero(m.any(0))
        if rows.size:
            r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
            self._paint(m[r0:r1, c0:c1] * np.float32(opacity), x0 + c0, y0 + r0, color)

    def _paint(self, a: np.ndarray, x: int, y: int, color: str):
        sub = self.px[y:y + a.shape[0], x:x + a.shape[1]]
        sub[:] = sub * (1 - a[..., None]) + rgb(color) * a[..., None]

    def _box(self, x0, y0, x1, y1):
        ix0, iy0 = max(0, int(np.floor(x0))), max(0, int(np.floor(y0)))
        ix1, iy1 = min(self.w, int(np.ceil(x1)) + 1), min(self.h, int(np.ceil(y1)) + 1)
        if ix1 <= ix0 or iy1 <= iy0:
            return None
        return ix0, iy0, np.arange(ix0, ix1, dtype=np.float64) + 0.5, np.arange(iy0, iy1, dtype=np.float64)[:, None] + 0.5

    def polyline(self, m, pts, width: float, dash=None):
        """Adds the stroke of pts [(x, y)] (round joins and caps; dash: lengths on, off, ...) to m."""
        hw = width / 2
        cum = np.cumsum(dash) if dash else None
        s0 = 0.0
        for (xa, ya), (xb, yb) in zip(pts, pts[1:] if len(pts) > 1 else pts):
            dx, dy = xb - xa, yb - ya
            n2 = dx * dx + dy * dy
            b = self._box(min(xa, xb) - hw - 1, min(ya, yb) - hw - 1, max(xa, xb) + hw + 1, max(ya, yb) + hw + 1)
            if b is not None:
                ix, iy, X, Y = b
                t = np.clip(((X - xa) * dx + (Y - ya) * dy) / n2, 0, 1) if n2 > 0 else np.zeros_like(X + Y)
                d = np.hypot(X - xa - t * dx, Y - ya - t * dy)
                cov = np.clip(hw + 0.5 - d, 0, 1)
                if cum is not None:
                    pos = (s0 + t * np.sqrt(n2)) % cum[-1]
                    cov = cov * (np.searchsorted(cum, pos, side="right") % 2 == 0)
                sub = m[iy:iy + cov.shape[0], ix:ix + cov.shape[1]]
                np.maximum(sub, cov, out=sub)
            s0 += float(np.sqrt(n2))

    def disc(self, m, x, y, r):
        b = self._box(x - r - 1, y - r - 1, x + r + 1, y + r + 1)
        if b is not None:
            ix, iy, X, Y = b
            cov = np.clip(r + 0.5 - np.hypot(X - x, Y - y), 0, 1)
            sub = m[iy:iy + cov.shape[0], ix:ix + cov.shape[1]]
            np.maximum(sub, cov, out=sub)

    def rect(self, m, x, y, w, h):
        ix0, iy0 = int(round(x)), int(round(y))
        ix1, iy1 = max(ix0 + 1, int(round(x + w))), max(iy0 + 1, int(round(y + h)))
        m[max(0, iy0):max(0, iy1), max(0, ix0):max(0, ix1)] = 1

    def text(self, s, x, y, fs, color="#222222", anchor="start", rotate=False):
        """s with its baseline at y (the centre line at x when rotated), anchored at x."""
        t = text_mask(s, fs)
        if rotate:
            t = np.rot90(t)
            h = t.shape[0]
            top = y - {"start": h, "middle": h / 2, "end": 0}[anchor]
            left = x - t.shape[1] / 2
        else:
            top = y - t.shape[0]
            left = x - {"start": 0, "middle": t.shape[1] / 2, "end": t.shape[1]}[anchor]
        top, left = int(round(top)), int(round(left))
        y0, x0 = max(0, top), max(0, left)
        y1, x1 = min(self.h, top + t.shape[0]), min(self.w, left + t.shape[1])
        if y1 > y0 and x1 > x0:
            self._paint(t[y0 - top:y1 - top, x0 - left:x1 - left].astype(np.float32), x0, y0, color)

    def image(self) -> np.ndarray:
        return np.clip(np.rint(self.px), 0, 255).astype(np.uint8)


def _dash(d, s):
    return [float(v) * s for v in d.split(",")] if d else None


def rasterize(plot, scale: int = 2) -> np.ndarray:
    """The plot as an (H, W, 3) uint8 image, `scale` pixels per SVG unit."""
    s = scale
    fr = plot.frame()
    L, T, pw, ph, sx, sy = fr["L"], fr["T"], fr["pw"], fr["ph"], fr["sx"], fr["sy"]
    c = Canvas(plot.W * s, plot.H * s)
    fs = max(1, round(1.5 * s))
    box = (L * s, T * s, (L + pw) * s, (T + ph) * s)
    grid = c.mask()
    for t in fr["yticks"]:
        c.polyline(grid, [(L * s, sy(t) * s), ((L + pw) * s, sy(t) * s)], s)
        c.text(tick_label(t), (L - 5) * s, (sy(t) + 4) * s, fs, anchor="end")
    c.blend(grid, "#e6e6e6")
    grid = c.mask()
    for t in fr["xticks"]:
        c.polyline(grid, [(sx(t) * s, T * s), (sx(t) * s, (T + ph) * s)], s)
        c.text(tick_label(t), sx(t) * s, (T + ph + 15) * s, fs, anchor="middle")
    c.blend(grid, "#f0f0f0")
    for it in plot.items:
        m, kind = c.mask(), it[0]
        if kind == "line":
            _, xs, ys, _, color, width, op, dash = it
            xs, ys = thin(xs, ys)
            ok = np.isfinite(ys) & ((ys > 0) if plot.logy else True)
            pts = [(sx(a) * s, sy(b) * s) for a, b in zip(xs[ok], ys[ok])]
            if pts:
                c.polyline(m, pts, width * s, _dash(dash, s))
        elif kind == "points":
            _, xs, ys, _, color, r = it
            op = 1.0
            for a, b in zip(xs, ys):
                if np.isfinite(b) and (b > 0 or not plot.logy):
                    c.disc(m, sx(a) * s, sy(b) * s, r * s)
        elif kind == "vlines":
            _, xs, _, color, dash = it
            op = 1.0
            for a in xs:
                c.polyline(m, [(sx(a) * s, T * s), (sx(a) * s, (T + ph) * s)], s, _dash(dash, s))
        elif kind == "hline":
            _, y, _, color, dash = it
            op = 1.0
            if not plot.logy or y > 0:
                c.polyline(m, [(L * s, sy(y) * s), ((L + pw) * s, sy(y) * s)], s, _dash(dash, s))
        elif kind == "bars":
            _, edges, hs, _, color, op = it
            base = sy(fr["y0"]) if plot.logy else sy(max(fr["y0"], 0.0))
            for a, b, h in zip(edges[:-1], edges[1:], hs):
                if h > 0:
                    top = sy(h)
                    c.rect(m, sx(a) * s, top * s, max(0.5, sx(b) - sx(a)) * s, max(0.0, base - top) * s)
        c.blend(m, color, op, clip=box)
    frame = c.mask()
    x0, y0, x1, y1 = box
    c.polyline(frame, [(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)], s)
    c.blend(frame, "#888888")
    c.text(plot.title, L * s, 18 * s, fs + 1)
    c.text(plot.xlabel, (L + pw / 2) * s, (plot.H - 8) * s, fs, anchor="middle")
    c.text(plot.ylabel, 14 * s, (T + ph / 2) * s, fs, anchor="middle", rotate=True)
    lx, ly = L + pw + 12, T + 6
    for kind, label, color, dash, op in plot.legend():
        m = c.mask()
        if kind == "line":
            c.polyline(m, [(lx * s, ly * s), ((lx + 18) * s, ly * s)], 2 * s, _dash(dash, s))
        elif kind == "point":
            c.disc(m, (lx + 9) * s, ly * s, 3 * s)
        else:
            c.rect(m, lx * s, (ly - 5) * s, 18 * s, 10 * s)
        c.blend(m, color, op)
        c.text(label, (lx + 24) * s, (ly + 4) * s, fs)
        ly += 16
    return c.image()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(img: np.ndarray) -> bytes:
    """(H, W, 3) uint8 -> PNG bytes (8-bit RGB, filter 0 on every row)."""
    img = np.ascontiguousarray(img, np.uint8)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) image, got {img.shape}")
    h, w, _ = img.shape
    raw = np.hstack([np.zeros((h, 1), np.uint8), img.reshape(h, w * 3)]).tobytes()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b""))
