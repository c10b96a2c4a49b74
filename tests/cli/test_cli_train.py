"""`open1b train`, `open1b hash`, `open1b audit` through the CLI: output and exit codes."""
import json

from click.testing import CliRunner

from mlx_open1b.cli.main import cli


def test_train_hash_audit_cli(tmp_path, default_corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner()
    out = tmp_path / "run"
    res = r.invoke(cli, ["train", "--steps", "3", "--out", str(out), "--data", str(default_corpus), "--threads", "2"])
    assert res.exit_code == 0, res.output
    run_hash = res.output.strip().splitlines()[-1].split()[-1]
    res = r.invoke(cli, ["hash", str(out)])
    assert res.exit_code == 0 and res.output.startswith(run_hash)
    res = r.invoke(cli, ["audit", str(out), "--steps", "1-2", "--auditor", "ci"])
    assert res.exit_code == 0 and "certified: steps 1-2" in res.output
    att = json.loads((tmp_path / "attestation-1-2.json").read_text())
    assert att["verdict"] == "certified" and att["auditor"] == "ci" and att["run_hash"] == run_hash
    res = r.invoke(cli, ["audit", str(out), "--steps", "5-9"])
    assert res.exit_code == 2 and "the run has steps 0-2" in res.output
    res = r.invoke(cli, ["train", "--steps", "5", "--out", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    res = r.invoke(cli, ["train", "--steps", "3", "--out", str(out), "--data", str(default_corpus)])
    assert res.exit_code == 2 and "already exists" in res.output
    lines = (out / "ledger.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"skipped":false', '"skipped":true')
    (out / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    res = r.invoke(cli, ["hash", str(out)])
    assert res.exit_code == 1 and "line 2" in res.output
    res = r.invoke(cli, ["audit", str(out), "--steps", "3"])
    assert res.exit_code == 1 and "NOT certified" in res.output
