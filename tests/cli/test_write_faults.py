"""Full disks and I/O errors at every write site: the ledger append, a checkpoint, run.json, a
corpus shard, the report, an export, an attestation, an audit plan, a parity bundle. Each is
injected as an OSError (ENOSPC, EIO, EACCES) into fsutil.write_all or fsutil.fsync_file, which every
byte the package writes passes through (test_every_write_goes_through_fsutil holds the package to
that); the command must end with exit code 3 and a message naming the file, what is intact and how
to continue, no traceback, and leave no partial file; where work can continue, continuing gives the
bits of a run that never failed."""
import errno
import fnmatch
import os
import pathlib
import re

import pytest
from click.testing import CliRunner

from mlx_open1b import fsutil
from mlx_open1b.cli.main import cli
from mlx_open1b.rundir import RunDir
from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import micro_cfg

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUIET = dict(log=lambda m: None)


@pytest.fixture()
def corpus(tmp_path):
    d = tmp_path / "corpus"
    make_corpus(d, MICRO_MIX)
    return d


@pytest.fixture()
def run(tmp_path, corpus):
    """A micro run of 2 steps: checkpoints 0 and 2, ledger records 0-1."""
    path = tmp_path / "run"
    Trainer.new(path, micro_cfg(), corpus, **QUIET).train(2)
    return path


def inject(monkeypatch, pattern: str, code: int = errno.ENOSPC, at: str = "write"):
    """Fail every write (at="write") or fsync (at="fsync") of a file whose path matches the glob
    `pattern`; returns the list of paths that failed."""
    hit = []
    real = fsutil.write_all if at == "write" else fsutil.fsync_file

    def failing(f, *a):
        name = str(getattr(f, "name", ""))
        if fnmatch.fnmatch(name, pattern):
            hit.append(name)
            raise OSError(code, os.strerror(code), name)
        return real(f, *a)

    monkeypatch.setattr(fsutil, "write_all" if at == "write" else "fsync_file", failing)
    return hit


def invoke(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res


def leftovers(d) -> list[str]:
    """Temporary files and directories of an interrupted write under d."""
    return [str(p) for p in pathlib.Path(d).rglob("*") if re.search(r"\.tmp(-|$)|\.tmp\.", p.name)]


def full_run_hash(tmp_path, corpus, steps) -> str:
    return Trainer.new(tmp_path / "reference", micro_cfg(), corpus, **QUIET).train(steps)


def test_ledger_append_fails_and_resume_loses_nothing(tmp_path, corpus, run, monkeypatch):
    before = (run / "ledger.jsonl").read_bytes()
    hit = inject(monkeypatch, "*/ledger.jsonl")
    res = invoke("train", "--resume", "--out", run, "--steps", 5, "--backend", "cpu_ref", "--skip-selftest")
    assert hit and res.exit_code == 3, res.output
    msg = res.output
    assert f"cannot write {run / 'ledger.jsonl'} (No space left on device, ENOSPC)" in msg
    assert "intact: run.json, the ledger through step 1" in msg and "checkpoints at steps 0, 2" in msg
    assert f"free space on the disk, then continue with `open1b train --resume --out {run}`" in msg
    assert (run / "ledger.jsonl").read_bytes() == before
    monkeypatch.undo()
    res = invoke("train", "--resume", "--out", run, "--steps", 5, "--backend", "cpu_ref", "--skip-selftest")
    assert res.exit_code == 0, res.output
    assert res.output.split()[-1] == full_run_hash(tmp_path, corpus, 5)


def test_ledger_fsync_fails_and_the_line_is_cut_back(run, monkeypatch):
    before = (run / "ledger.jsonl").read_bytes()
    inject(monkeypatch, "*/ledger.jsonl", errno.EIO, at="fsync")
    res = invoke("train", "--resume", "--out", run, "--steps", 4, "--backend", "cpu_ref", "--skip-selftest")
    assert res.exit_code == 3 and "(Input/output error, EIO)" in res.output and "check the disk" in res.output
    assert (run / "ledger.jsonl").read_bytes() == before          # the record that was not durable is gone


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_checkpoint_fails_and_resume_loses_nothing(tmp_path, corpus, run, monkeypatch, code):
    hit = inject(monkeypatch, "*/.ckpt-00000004.tmp-*/state.safetensors", code)
    res = invoke("train", "--resume", "--out", run, "--steps", 5, "--backend", "cpu_ref", "--skip-selftest")
    assert hit and res.exit_code == 3, res.output
    assert f"cannot write checkpoint {run / 'ckpt-00000004'} (state.safetensors: {os.strerror(code)}" in res.output
    assert "the ledger through step 3" in res.output and "checkpoints at steps 0, 2;" in res.output
    assert not (run / "ckpt-00000004").exists() and leftovers(run) == []
    monkeypatch.undo()
    res = invoke("train", "--resume", "--out", run, "--steps", 5, "--backend", "cpu_ref", "--skip-selftest")
    assert res.exit_code == 0, res.output
    assert res.output.split()[-1] == full_run_hash(tmp_path, corpus, 5)


@pytest.mark.parametrize("site", ["run.json", ".ckpt-00000000.tmp-*/meta.json"])
def test_a_new_run_that_cannot_start_leaves_no_run(tmp_path, corpus, monkeypatch, site):
    """The first checkpoint or run.json (written last): no run.json stays behind, so the same command
    starts the run again (a complete checkpoint 0 without a run.json is replaced)."""
    from mlx_open1b.fsutil import WriteError
    path = tmp_path / "new"
    inject(monkeypatch, f"*/new/{'.run.json.*' if site == 'run.json' else site}")
    with pytest.raises(WriteError) as e:
        Trainer.new(path, micro_cfg(), corpus, **QUIET)
    assert e.value.exit_code == 3 and e.value.disk_full
    assert not RunDir(path).exists() and leftovers(path) == []
    assert RunDir(path).checkpoints() == ([(0, path / "ckpt-00000000")] if site == "run.json" else [])
    monkeypatch.undo()
    assert Trainer.new(path, micro_cfg(), corpus, **QUIET).train(2) == full_run_hash(tmp_path, corpus, 2)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES])
def test_corpus_prepare(tmp_path, monkeypatch, code):
    src = tmp_path / "texts"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(f"document {i} " * (20 + i))
    out = tmp_path / "prepared"
    args = ("data", "prepare", "--source", f"web={src}/*.txt", "--heldout-tokens", 0, "--out", out)
    inject(monkeypatch, "*.arrow*", code)
    res = invoke(*args)
    assert res.exit_code == 3, res.output
    assert f"cannot write {out / 'web'}" in res.output and f"({os.strerror(code)}" in res.output
    assert "run the same `open1b data prepare` command again" in res.output
    assert not (out / "manifest.json").exists() and leftovers(out) == []
    monkeypatch.undo()
    assert invoke(*args).exit_code == 0
    again = tmp_path / "clean"
    assert invoke(*args[:-1], again).exit_code == 0
    assert (out / "manifest.json").read_bytes() == (again / "manifest.json").read_bytes()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES])
def test_report_export_plan(tmp_path, run, monkeypatch, code):
    inject(monkeypatch, "*/report/.index.html.*", code)
    res = invoke("report", run, "--out", tmp_path / "report", "--no-png")
    assert res.exit_code == 3 and f"cannot write {tmp_path / 'report' / 'index.html'}" in res.output, res.output
    assert "intact: the run (a report only reads it)" in res.output
    assert not (tmp_path / "report" / "index.html").exists() and leftovers(tmp_path / "report") == []

    inject(monkeypatch, "*/.exported.tmp-*/weights.safetensors", code)
    res = invoke("export", run, "--out", tmp_path / "exported")
    assert res.exit_code == 3 and f"cannot write the export {tmp_path / 'exported'} (weights.safetensors:" \
        in res.output, res.output
    assert f"run `open1b export {run} --format mlx --out {tmp_path / 'exported'}` again" in res.output
    assert not (tmp_path / "exported").exists() and leftovers(tmp_path) == []

    inject(monkeypatch, "*/.plan.json.*", code)
    res = invoke("audit", "plan", run, "--auditors", 1, "--out", tmp_path / "plan.json")
    assert res.exit_code == 3 and f"cannot write {tmp_path / 'plan.json'}" in res.output, res.output
    assert not (tmp_path / "plan.json").exists() and leftovers(tmp_path) == []


def test_attestation_names_the_verdict_it_could_not_record(tmp_path, run, monkeypatch):
    inject(monkeypatch, "*/.att.json.*", errno.ENOSPC)
    res = invoke("audit", run, "--steps", "0-1", "--out", tmp_path / "att.json", "--backend", "cpu_ref",
                 "--skip-selftest")
    assert res.exit_code == 3, res.output
    assert f"cannot write {tmp_path / 'att.json'}" in res.output
    assert "(the attestation of steps 0-1: certified)" in res.output
    assert not (tmp_path / "att.json").exists() and leftovers(tmp_path) == []


def test_parity_bundle(tmp_path, monkeypatch):
    inject(monkeypatch, "*/.bundle.json.*", errno.EACCES)
    res = invoke("parity", "export", tmp_path / "bundle.json", "--cases", 1, "--steps", 0, "--ops", "rmsnorm_forward")
    assert res.exit_code == 3, res.output
    assert f"cannot write {tmp_path / 'bundle.json'} (Permission denied, EACCES)" in res.output
    assert "make it writable, then run the same `open1b parity export` again" in res.output
    assert not (tmp_path / "bundle.json").exists() and leftovers(tmp_path) == []


# what may write without fsutil, and why (a pattern matched against "path:line text")
_ALLOWED = {
    r"^mlx_open1b/rundir\.py:.*os\.(open|pwrite)": "the writer lock's pid note (best effort, never read as data)",
    r"^mlx_open1b/data/prepare\.py:.*os\.open\(out / LOCK": "the corpus lock file (no data)",
    r"^mlx_open1b/data/prepare\.py:.*\.lock\", \"w\"\)": "the default corpus's lock file (no data)",
    r"^(metal|cuda)/emu/__init__\.py:.*src\.write_text": "the emulators' build cache (rebuilt when missing)",
    r"^mlx_open1b/checkpoint\.py:.*open\(self\.tmp / STATE_FILE, \"wb\"": "the streamed checkpoint's file in its "
    "temporary directory: written by fsutil.write_all, every OSError a WriteError naming the checkpoint "
    "(StreamedCheckpoint._fail), published by rename",
}
_WRITES = re.compile(r"\.write_text\(|\.write_bytes\(|os\.write\(|os\.pwrite\(|open\([^)]*[\"'][wax]b?\+?[\"']|"
                     r"shutil\.copy|np\.save|\.tofile\(|os\.open\([^)]*O_(WRONLY|RDWR|CREAT|APPEND)|"
                     r"pa\.OSFile\([^)]*[\"']w|ipc\.new_file\([^)]*str\(")


def test_every_write_goes_through_fsutil():
    found = []
    for top in ("mlx_open1b", "cli", "parity", "metal", "cuda", "cpu_ref"):
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel == "mlx_open1b/fsutil.py":
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                where = f"{rel}:{line.strip()}"
                if _WRITES.search(line) and not any(re.search(a, where) for a in _ALLOWED):
                    found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "writes that bypass fsutil (a failure there would not be reported):\n" + "\n".join(found)
