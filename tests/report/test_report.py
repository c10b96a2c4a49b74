"""The run report: a self-contained HTML page whose figures are all present (matplotlib PNGs as data
URIs, or inline SVG without matplotlib) and whose summary numbers are the ledger's, the same with either
figure engine; one PNG per figure that decodes; the page renders in headless Chromium."""
import base64
import html
import json
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_open1b.checkpoint import list_checkpoints, load_checkpoint
from mlx_open1b.cli.main import cli
from mlx_open1b.model import ParamLayout
from mlx_open1b.report.png import FONT, Canvas, encode_png, rasterize, rgb, text_mask
from mlx_open1b.report import ReportError, Plot, figures, load_run_data, mpl, render, write_report
from mlx_open1b.report.axes import thin, tick_label
from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import micro_cfg

FIGURES = ["fig-loss", "fig-gradnorm", "fig-gradhist", "fig-lr", "fig-batch", "fig-update", "fig-wq", "fig-wk",
           "fig-wv", "fig-emb", "fig-zloss", "fig-speed"]
VOID = {"meta", "br", "img", "hr", "input", "link"}


class Checker(HTMLParser):
    """Tag balance of the HTML (SVG elements included), ids, data-key table cells, figures."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.ids, self.cells, self.key, self.external = [], [], set(), {}, None, []
        self.imgs = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            if a["id"] in self.ids:
                self.errors.append(f"duplicate id {a['id']}")
            self.ids.add(a["id"])
        for k in ("src", "href"):
            if k in a and not a[k].startswith(("#", "data:")):
                self.external.append(a[k])
        if tag == "img":
            self.imgs[a["id"]] = a["src"]
        if tag == "tr" and "data-key" in a:
            self.key = a["data-key"]
            self.cells[self.key] = []
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()
        if tag == "tr":
            self.key = None

    def handle_data(self, data):
        if self.key is not None and self.stack and self.stack[-1] == "td":
            self.cells[self.key].append(data)


def check_page(text: str, pngs: bool = False, engine: str = "builtin") -> Checker:
    """Balanced tags, self-contained, and each figure shown once: inline SVG (builtin) or its PNG as
    a data URI that decodes (matplotlib)."""
    c = Checker()
    c.feed(text)
    c.close()
    assert not c.errors and not c.stack, (c.errors, c.stack)
    figs = re.findall(r'<figure id="([^"]+)">', text)
    # self-contained: the only references are the links to the figures' own PNG files
    assert c.external == ([f"{f}.png" for f in figs] if pngs else []), c.external
    svgs = re.findall(r"<svg\b.*?</svg>", text, re.S)
    for s in svgs:
        ET.fromstring(s)                                     # well-formed XML (SVG)
    if engine == "builtin":
        assert len(svgs) == len(figs) and not c.imgs
    else:
        assert not svgs and sorted(c.imgs) == sorted(f"{f}-png" for f in figs)
        for src in c.imgs.values():
            assert src.startswith("data:image/png;base64,")
            decode_png(base64.b64decode(src.split(",", 1)[1], validate=True))
    return c


def data_uri_png(c: Checker, fid: str) -> bytes:
    return base64.b64decode(c.imgs[f"{fid}-png"].split(",", 1)[1])


ENGINES = ["builtin", pytest.param("matplotlib", marks=pytest.mark.skipif(
    not mpl.available(), reason="matplotlib (the report extra) is not installed"))]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    make_corpus(root / "corpus", MICRO_MIX)
    Trainer(root / "run", micro_cfg(checkpoint_every=4, eval_every=4), root / "corpus", log=lambda m: None).train(16)
    return root / "run"


@pytest.fixture(scope="module")
def reports(run, tmp_path_factory):
    """{engine: the page} of the run's report with each figure engine available here (written once)."""
    root = tmp_path_factory.mktemp("reports")
    return {e: write_report(run, root / e, engine=e) for e in ("builtin", "matplotlib")
            if e == "builtin" or mpl.available()}


@pytest.mark.parametrize("engine", ENGINES)
def test_report_has_every_figure_and_the_ledgers_numbers(run, reports, engine):
    path = reports[engine]
    text = path.read_text()
    c = check_page(text, pngs=True, engine=engine)
    for f in FIGURES:
        assert f in c.ids and f"{f}-{'svg' if engine == 'builtin' else 'png'}" in c.ids, f
    assert "fig-gnmr" not in c.ids                                  # no GNMR records
    recs = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    times = (run / "timing.jsonl").read_text().splitlines()           # the trainer's, one line per step
    assert [json.loads(t)["step"] for t in times] == [r["step"] for r in recs]
    summary = json.loads(re.search(r'<script type="application/json" id="summary">(.*?)</script>', text, re.S).group(1))
    evals = [r for r in recs if "eval" in r]
    w = summary["train_ce_window"]
    want = {"steps": len(recs), "tokens": recs[-1]["tokens"], "run_hash": recs[-1]["hash"],
            "final_train_ce": recs[-1]["ce"], "final_train_ce_mean": float(np.mean([r["ce"] for r in recs[-w:]])),
            "final_heldout_ce": evals[-1]["eval"]["mixture"], "final_heldout_step": evals[-1]["step"],
            "skipped_steps": sum(r["skipped"] for r in recs), "spike_events": sum(r["spike"] for r in recs),
            "clipped_steps": sum(r["clipped"] for r in recs),
            "clip_rate": sum(r["clipped"] for r in recs) / len(recs),
            "median_step_seconds": float(np.median([json.loads(t)["seconds"] for t in times])),
            "tokens_per_second": recs[-1]["tokens"] / sum(json.loads(t)["seconds"] for t in times),
            "checkpoints": [0, 4, 8, 12, 16]}
    assert {k: summary[k] for k in want} == want
    assert want["skipped_steps"] > 0 and want["clipped_steps"] > 0       # the micro recipe exercises both
    # the table shows the same numbers
    assert c.cells["steps"] == [str(len(recs))] and c.cells["tokens"] == [f"{recs[-1]['tokens']:,}"]
    assert c.cells["final_heldout_ce"] == [f"{want['final_heldout_ce']:.4f}"]
    assert c.cells["skipped_steps"] == [str(want["skipped_steps"])]
    assert c.cells["clip_rate"] == [f"{100 * want['clip_rate']:.2f}%"]
    assert c.cells["grad-max"][0] == f"{max(r['grad_norm'] for r in recs):.4f}"
    # one point per step in the learning-rate curve; weight norms are the checkpoints' own
    if engine == "builtin":
        lr_svg = re.search(r'<figure id="fig-lr">(.*?)</figure>', text, re.S).group(1)
        assert len(re.search(r'<polyline[^>]*points="([^"]*)"', lr_svg).group(1).split()) == len(recs)
    else:      # the page shows the very PNG written next to it
        for f in FIGURES:
            assert data_uri_png(c, f) == (path.parent / f"{f}.png").read_bytes(), f
    data = load_run_data(run)
    step, ck = list_checkpoints(run)[-1]
    bits = load_checkpoint(ck)[0]["params"][0]
    spec = ParamLayout(micro_cfg().model)["layers.1.wv"]
    v = (bits[spec.offset:spec.offset + spec.size].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert data["norms"][-1]["step"] == step and data["norms"][-1]["tensors"]["layers.1.wv"] == np.linalg.norm(v)


def test_optional_figures_gnmr_and_step_times(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    lines = [json.dumps({"step": s, "seconds": 0.5 + 0.01 * s}) for s in range(16)]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    data = load_run_data(tmp_path / "run")
    for r in data["records"]:          # records of a GNMR run list the units on the recovery path
        r["gnmr"] = {"active": ["layers.0.qkv"] if r["step"] % 3 == 0 else []}
    text = render(data)
    c = check_page(text)
    assert "fig-gnmr" in c.ids and "fig-speed" in c.ids and "gnmr" in c.ids
    assert c.cells["median_step_seconds"] == [f"{np.median([0.5 + 0.01 * s for s in range(16)]):.4f}"]
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl: line 1"):
        load_run_data(tmp_path / "run")


def test_report_bad_input(run, tmp_path):
    r = CliRunner()
    res = r.invoke(cli, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "not a run directory" in res.output
    shutil.copytree(run, tmp_path / "run")
    led = tmp_path / "run" / "ledger.jsonl"
    led.write_text(led.read_text().replace('"skipped":false', '"skipped":true', 1))
    res = r.invoke(cli, ["report", str(tmp_path / "run"), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 1 and "does not verify" in res.output and not (tmp_path / "rep").exists()
    res = r.invoke(cli, ["report", str(run), "--out", str(tmp_path / "rep2")])
    assert res.exit_code == 0 and (tmp_path / "rep2" / "index.html").exists()
    assert sorted(f.stem for f in (tmp_path / "rep2").glob("*.png")) == sorted(FIGURES)
    # --no-png: no links, and the previous report's PNGs are gone (never a page beside stale figures)
    res = r.invoke(cli, ["report", str(run), "--out", str(tmp_path / "rep2"), "--no-png", "--figures", "builtin"])
    assert res.exit_code == 0 and not list((tmp_path / "rep2").glob("*.png"))
    check_page((tmp_path / "rep2" / "index.html").read_text(), pngs=False, engine="builtin")


def decode_png(data: bytes) -> np.ndarray:
    """A minimal PNG decoder (8-bit RGB, non-interlaced, filter type 0 rows, which is what we write):
    every chunk's CRC checked, IHDR first, IDATs concatenated and inflated, IEND last."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind}"
        chunks.append((kind, body))
        pos += 12 + n
    assert pos == len(data) and chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    rows = np.frombuffer(raw, np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


def _has(img, color) -> bool:
    return bool((img == rgb(color).astype(np.uint8)).all(-1).any())


@pytest.mark.parametrize("engine", ENGINES)
def test_pngs_decode_and_show_every_figure(run, reports, engine):
    path = reports[engine]
    text = path.read_text()
    figs = re.findall(r'<figure id="([^"]+)">', text)
    assert sorted(figs) == sorted(FIGURES)
    assert sorted(f.name for f in path.parent.glob("*.png")) == sorted(f"{f}.png" for f in figs)
    plots = {fid: p for fid, _, p in figures(load_run_data(run))}
    for fid in figs:
        data = (path.parent / f"{fid}.png").read_bytes()
        assert chunk_kinds(data) == [b"IHDR", b"IDAT", b"IEND"]            # no metadata: no time, no software
        img = decode_png(data)
        p = plots[fid]
        assert img.shape == (2 * p.H, 2 * p.W, 3)
        packed = (img.astype(np.uint32) << np.array([16, 8, 0], np.uint32)).sum(-1)
        assert (img[0, 0] == 255).all() and len(np.unique(packed)) > 8
        fr = p.frame()
        area = img[2 * fr["T"] + 2:2 * (fr["T"] + fr["ph"]) - 2, 2 * fr["L"] + 2:2 * (fr["L"] + fr["pw"]) - 2]
        for it in p.items:           # every opaque line and marker shows its exact color in the plot area
            shown = it[0] in ("line", "points") and (np.isfinite(it[2]) & ((it[2] > 0) if p.logy else True)).sum()
            if it[0] == "line" and it[6] == 1.0 and shown >= 2 or it[0] == "points" and shown:
                assert _has(area, it[4]), (fid, it[3], it[4])
        for kind, label, color, dash, op in p.legend():
            if op == 1.0:
                assert _has(img[:, 2 * (fr["L"] + fr["pw"]):], color), (fid, label)    # legend swatches
        # text is drawn: dark pixels where the title is, and nowhere above it
        top = img[:2 * 18 + 4, 2 * p.L:2 * (p.L + 200)].min(-1)
        assert (top < 128).sum() > 100 and (img[:4].min(-1) > 200).all(), fid
    if engine == "builtin":          # the built-in font's glyphs, at the title's place
        img = decode_png((path.parent / "fig-lr.png").read_bytes())
        t = text_mask(plots["fig-lr"].title, 4)
        top, left = 2 * 18 - t.shape[0], 2 * plots["fig-lr"].L
        assert (img[top:top + t.shape[0], left:left + t.shape[1]].min(-1) < 128)[t].all()


def chunk_kinds(data: bytes) -> list[bytes]:
    """The PNG's chunk types in order, runs of IDAT as one."""
    pos, kinds = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
        pos += 12 + n
    return kinds


@pytest.mark.skipif(not mpl.available(), reason="matplotlib (the report extra) is not installed")
def test_the_tables_are_the_same_with_either_engine(reports):
    """Only the figures' markup differs between the engines (and the time the page was written)."""
    def tables(path):
        text = re.sub(r'<figure id="[^"]+">.*?</figure>', "<figure/>", path.read_text(), flags=re.S)
        return re.sub(r"report by mlx-open1b [^,]+, [^<]+\.</p>", "", text)
    a, b = tables(reports["builtin"]), tables(reports["matplotlib"])
    assert a == b and a.count("<figure/>") == len(FIGURES) and 'data-key="median_step_seconds"' in a


@pytest.mark.skipif(not mpl.available(), reason="matplotlib (the report extra) is not installed")
def test_matplotlib_draws_each_plot_as_it_is(run, reports):
    """Each matplotlib figure is its Plot: the frame's ranges, the ticks and labels of axes.py, the
    title and axis labels, every item's data (lines thinned as the SVG's), colors and widths, and the
    legend; its PNG is the file next to the page, the same bytes every time."""
    from matplotlib.colors import to_hex
    for fid, _, p in figures(load_run_data(run)):
        fig = mpl.figure(p, 1)
        ax, fr = fig.axes[0], p.frame()
        assert ax.get_xlim() == (fr["x0"], fr["x1"]) and ax.get_ylim() == (fr["y0"], fr["y1"]), fid
        assert ax.get_yscale() == ("log" if p.logy else "linear")
        for axis, ticks in ((ax.xaxis, fr["xticks"]), (ax.yaxis, fr["yticks"])):
            assert list(axis.get_majorticklocs()) == ticks and not len(axis.get_minorticklocs()), fid
            assert [t.get_text() for t in axis.get_majorticklabels()] == [tick_label(t) for t in ticks], fid
        assert [t.get_text() for t in fig.texts] == [p.title, p.xlabel, p.ylabel]
        labels = [lab for _, lab, *_ in p.legend()]
        assert ([t.get_text() for t in fig.legends[0].get_texts()] if fig.legends else []) == labels, fid
        want, bars = [], []
        for it in p.items:
            if it[0] in ("line", "points"):
                xs, ys = thin(it[1], it[2]) if it[0] == "line" else (it[1], it[2])
                ok = np.isfinite(ys) & ((ys > 0) if p.logy else True)
                if ok.any():
                    want.append((list(xs[ok]), list(ys[ok]), it[4], it[5] * mpl.PT if it[0] == "line" else None))
            elif it[0] == "hline" and (not p.logy or it[1] > 0):
                want.append(([0, 1], [it[1], it[1]], it[3], mpl.PT))
            elif it[0] == "bars":
                bars += [(a, b - a, h) for a, b, h in zip(it[1][:-1], it[1][1:], it[2]) if h > 0]
        got = [(list(ln.get_xdata()), list(ln.get_ydata()), ln.get_color(),
                ln.get_linewidth() if ln.get_linestyle() != "None" else None) for ln in ax.lines]
        assert [(x, y, to_hex(c), w) for x, y, c, w in got] == [(x, y, to_hex(c), w) for x, y, c, w in want], fid
        base = fr["y0"] if p.logy else max(fr["y0"], 0.0)
        assert [(b.get_x(), b.get_width(), b.get_y() + b.get_height()) for b in ax.patches] == \
            [(a, w, pytest.approx(h)) for a, w, h in bars] and all(b.get_y() == base for b in ax.patches), fid
        vl = [it[1] for it in p.items if it[0] == "vlines" and len(it[1])]
        assert [[seg[0][0] for seg in c.get_segments()] for c in ax.collections] == [list(x) for x in vl], fid
    png = (reports["matplotlib"].parent / "fig-loss.png").read_bytes()
    p = next(p for fid, _, p in figures(load_run_data(run)) if fid == "fig-loss")
    assert mpl.png(p, 2) == png                            # deterministic: the same bytes when drawn again
    import matplotlib
    with matplotlib.rc_context({"lines.linewidth": 7, "font.size": 30, "axes.facecolor": "black"}):
        assert mpl.png(p, 2) == png                        # whatever the user's matplotlib settings


def test_without_matplotlib_the_builtin_figures(run, tmp_path, monkeypatch):
    """Where matplotlib is absent, "auto" falls back to the built-in figures (inline SVG, png.py's
    PNGs); asking for matplotlib there is an error naming the extra, before anything is written."""
    monkeypatch.setattr(mpl, "available", lambda: False)
    path = write_report(run, tmp_path / "rep")
    check_page(path.read_text(), pngs=True, engine="builtin")
    p = next(p for fid, _, p in figures(load_run_data(run)) if fid == "fig-lr")
    assert (path.parent / "fig-lr.png").read_bytes() == p.png(2)
    with pytest.raises(ReportError, match=r"matplotlib is not installed.*mlx-open1b\[report\]") as e:
        write_report(run, tmp_path / "rep2", engine="matplotlib")
    assert e.value.exit_code == 2 and not (tmp_path / "rep2").exists()
    # the command: a note on the fallback; --figures matplotlib refused, nothing written
    r = CliRunner()
    res = r.invoke(cli, ["report", str(run), "--out", str(tmp_path / "rep3"), "--no-png"])
    assert res.exit_code == 0 and "note: matplotlib is not installed" in res.stderr, res.output
    check_page((tmp_path / "rep3" / "index.html").read_text(), engine="builtin")
    res = r.invoke(cli, ["report", str(run), "--out", str(tmp_path / "rep4"), "--figures", "matplotlib"])
    assert res.exit_code == 2 and "pip install 'mlx-open1b[report]'" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "rep4").exists()


def test_png_rasterizer_units():
    # the encoder round-trips an arbitrary image exactly
    img = np.random.default_rng(0).integers(0, 256, (7, 5, 3)).astype(np.uint8)
    assert (decode_png(encode_png(img)) == img).all()
    with pytest.raises(ValueError):
        encode_png(img[..., 0])
    # a 3-px horizontal line: full coverage on its rows, anti-aliased edges, nothing elsewhere
    c = Canvas(20, 10)
    m = c.mask()
    c.polyline(m, [(4, 5), (16, 5)], 3)
    assert (m[4:6, 4:16] == 1).all() and 0 < m[3, 10] < 1 and m[0, 10] == 0 and m[5, 0] == m[5, 19] == 0
    d = c.mask()
    c.polyline(d, [(0, 5), (20, 5)], 2, dash=[4, 4])
    assert d[5, 1] == 1 and d[5, 6] == 0 and d[5, 9] == 1
    c.blend(m, "#d62728", clip=(0, 0, 10, 10))
    out = c.image()
    assert _has(out[:, :10], "#d62728") and not _has(out[:, 10:], "#d62728")
    assert set("0123456789.-E,") <= set(FONT) and text_mask("Ab?", 2).shape == (10, 22)
    # a Plot's PNG: every item kind, log axis, dims
    p = Plot("fig-x", "t", "x", "y", logy=True).line([1, 2, 3], [1, 10, 100], "a", "#1f77b4", 2)
    p.points([2], [10], "b", "#2ca02c").vlines([2.5], "c", "#9467bd").hline(5, "d", "#555")
    p.bars([1, 2, 3], [3, 0], "e", "#ff7f0e")
    im = rasterize(p, 1)
    assert im.shape == (300, 760, 3) and all(_has(im, col) for col in ("#1f77b4", "#2ca02c", "#9467bd", "#555555"))
    assert decode_png(p.png(1)).shape == (300, 760, 3)


# a test-only copy of the page gets this check (the page itself has no scripts): once everything has
# loaded, each image's decoded size and how many of its pixels are not opaque (the PNGs are opaque
# throughout; rows a broken or cut-short file lacks are transparent), each inline SVG's laid-out size,
# and every error event
PROBE = """<script>
const errors = [];
window.addEventListener("error", e => errors.push(e.message || (e.target && e.target.id) || e.type), true);
function holes(i) {
  const c = document.createElement("canvas");
  c.width = i.naturalWidth; c.height = i.naturalHeight;
  if (!c.width || !c.height) return -1;
  const g = c.getContext("2d");
  g.drawImage(i, 0, 0);
  const px = g.getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let k = 3; k < px.length; k += 4) n += px[k] !== 255;
  return n;
}
window.addEventListener("load", () => {
  const imgs = [...document.images].map(i => [i.id, i.complete, i.naturalWidth, i.naturalHeight, holes(i)]);
  const svgs = [...document.querySelectorAll("svg")].map(s => {
    const b = s.getBoundingClientRect(); return [s.id, b.width, b.height]; });
  const p = document.createElement("pre");
  p.id = "probe";
  p.textContent = JSON.stringify({imgs, svgs, errors});
  document.body.appendChild(p);
});
</script>"""


def chromium_probe(page, tmp_path) -> tuple[dict, list[str]]:
    """The probe's findings on the page rendered by headless Chromium, and the console lines."""
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    out = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                          "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r'<pre id="probe">(.*?)</pre>', out.stdout, re.S)
    assert found, out.stdout[-2000:]
    return json.loads(html.unescape(found.group(1))), [ln for ln in out.stderr.splitlines() if ":CONSOLE" in ln]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed here")
@pytest.mark.parametrize("engine", ENGINES)
def test_report_renders_in_headless_chromium(run, reports, tmp_path, engine):
    """The page as a browser shows it: no error event, nothing on the console, every figure there and
    drawn (an image that decodes at its PNG's size, or an inline SVG laid out at its size)."""
    got, console = chromium_probe(reports[engine], tmp_path)
    assert got["errors"] == [] and console == [], (got["errors"], console)
    plots = {fid: p for fid, _, p in figures(load_run_data(run))}
    if engine == "matplotlib":
        assert got["imgs"] == [[f"{f}-png", True, 2 * plots[f].W, 2 * plots[f].H, 0] for f in plots]
        assert not got["svgs"]
    else:
        assert got["svgs"] == [[f"{f}-svg", plots[f].W, plots[f].H] for f in plots] and not got["imgs"]
