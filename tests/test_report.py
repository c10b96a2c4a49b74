"""The run report (issue 9): a self-contained HTML page whose figures are all present and
well-formed SVG, and whose summary numbers are the ledger's."""
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_open1b.checkpoint import list_checkpoints, load_checkpoint
from mlx_open1b.cli.main import cli
from mlx_open1b.model import ParamLayout
from mlx_open1b.report import ReportError, load_run_data, render, write_report
from mlx_open1b.train import Trainer

from data_helpers import make_corpus
from test_train import micro_cfg

FIGURES = ["fig-loss", "fig-gradnorm", "fig-gradhist", "fig-lr", "fig-batch", "fig-update", "fig-wq", "fig-wk",
           "fig-wv", "fig-emb", "fig-zloss"]
VOID = {"meta", "br", "img", "hr", "input", "link"}


class Checker(HTMLParser):
    """Tag balance of the HTML (SVG elements included), ids, data-key table cells, figures."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.ids, self.cells, self.key, self.external = [], [], set(), {}, None, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            if a["id"] in self.ids:
                self.errors.append(f"duplicate id {a['id']}")
            self.ids.add(a["id"])
        for k in ("src", "href"):
            if k in a and not a[k].startswith("#"):
                self.external.append(a[k])
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


def check_page(text: str) -> Checker:
    c = Checker()
    c.feed(text)
    c.close()
    assert not c.errors and not c.stack, (c.errors, c.stack)
    assert not c.external, c.external                       # self-contained
    svgs = re.findall(r"<svg\b.*?</svg>", text, re.S)
    for s in svgs:
        ET.fromstring(s)                                     # well-formed XML (SVG)
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    make_corpus(root / "corpus", {"web": (0.6, 30, 20), "code": (0.4, 12, 40)})
    Trainer(root / "run", micro_cfg(checkpoint_every=4, eval_every=4), root / "corpus", log=lambda m: None).train(16)
    return root / "run"


def test_report_has_every_figure_and_the_ledgers_numbers(run, tmp_path):
    path = write_report(run, tmp_path / "rep")
    text = path.read_text()
    c = check_page(text)
    for f in FIGURES:
        assert f in c.ids and f"{f}-svg" in c.ids, f
    assert "fig-gnmr" not in c.ids and "fig-speed" not in c.ids     # no GNMR records, no step times
    recs = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    summary = json.loads(re.search(r'<script type="application/json" id="summary">(.*?)</script>', text, re.S).group(1))
    evals = [r for r in recs if "eval" in r]
    w = summary["train_ce_window"]
    want = {"steps": len(recs), "tokens": recs[-1]["tokens"], "run_hash": recs[-1]["hash"],
            "final_train_ce": recs[-1]["ce"], "final_train_ce_mean": float(np.mean([r["ce"] for r in recs[-w:]])),
            "final_heldout_ce": evals[-1]["eval"]["mixture"], "final_heldout_step": evals[-1]["step"],
            "skipped_steps": sum(r["skipped"] for r in recs), "spike_events": sum(r["spike"] for r in recs),
            "clipped_steps": sum(r["clipped"] for r in recs),
            "clip_rate": sum(r["clipped"] for r in recs) / len(recs), "median_step_seconds": None,
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
    lr_svg = re.search(r'<figure id="fig-lr">(.*?)</figure>', text, re.S).group(1)
    assert len(re.search(r'<polyline[^>]*points="([^"]*)"', lr_svg).group(1).split()) == len(recs)
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


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed here")
def test_report_renders_in_headless_chromium(run, tmp_path):
    path = write_report(run, tmp_path / "rep")
    out = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for f in FIGURES:
        assert f'id="{f}"' in out.stdout
