"""The README's "train on your own data" walkthrough, run line by line as written (between the
<!-- walkthrough --> markers) on a small generated corpus: every command exits 0, the run takes its
vocabulary from the tokenizer trained on the corpus, and the report shows the step times."""
import json
import pathlib
import random
import re
import shlex

from click.testing import CliRunner

from mlx_open1b.cli.main import cli
from mlx_open1b.data.tokenizer import Tokenizer
from mlx_open1b.rundir import RunDir

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def walkthrough() -> list[str]:
    text = README.read_text()
    start, end = text.index("<!-- walkthrough -->"), text.index("<!-- /walkthrough -->")
    return [line.strip() for line in text[start:end].splitlines()[1:] if line.strip()]


def test_readme_walkthrough(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    words = "the a model data token train step loss river mountain city book light water stone garden".split()
    (tmp_path / "mydocs").mkdir()
    for f in range(2):
        with open(tmp_path / "mydocs" / f"part{f}.jsonl", "w") as fh:
            for _ in range(60):
                fh.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(40, 120)))}) + "\n")
    lines = walkthrough()
    assert [ln.split()[1] for ln in lines] == ["data", "data", "config", "config", "train", "generate", "report",
                                               "export", "audit"]
    assert lines[0].startswith("open1b data tokenizer train") and "--tokenizer mytok.json" in lines[4]
    r = CliRunner()
    for line in lines:
        args = shlex.split(line)
        assert args[0] == "open1b", line
        out = None
        if ">" in args:                                  # the one shell redirect the walkthrough uses
            args, out = args[:args.index(">")], args[args.index(">") + 1]
        res = r.invoke(cli, args[1:])
        assert res.exit_code == 0, f"{line}\n{res.output}"
        if out is not None:
            (tmp_path / out).write_text(res.stdout)
    assert (tmp_path / "runs/mine/report/index.html").exists() and (tmp_path / "runs/mine-hf").is_dir()
    assert "certified: steps 3-3" in res.output
    # the run's vocabulary is the tokenizer's (a small corpus trains fewer tokens than --vocab asks)
    vocab = Tokenizer.load(tmp_path / "mytok.json").vocab_size
    assert vocab < 1000 and RunDir(tmp_path / "runs/mine").info().config.model.vocab_size == vocab
    # step times beside the ledger fill the report's median step time
    assert len((tmp_path / "runs/mine/timing.jsonl").read_text().splitlines()) == 4
    page = (tmp_path / "runs/mine/report/index.html").read_text()
    median = re.search(r'<tr data-key="median_step_seconds"><th>[^<]*</th><td class="n">([^<]*)</td>', page)
    assert median and float(median.group(1)) > 0
