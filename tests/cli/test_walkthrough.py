"""The README's "train on your own data" walkthrough, run line by line as written (between the
<!-- walkthrough --> markers) on a small generated corpus: every command exits 0."""
import json
import pathlib
import random
import shlex

from click.testing import CliRunner

from mlx_open1b.cli.main import cli

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
    assert [ln.split()[1] for ln in lines] == ["data", "config", "config", "train", "generate", "report", "export",
                                               "audit"]
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
