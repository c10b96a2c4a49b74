"""One writer per run directory: a second process that would write the run (train, resume) is
refused before touching it, naming the holder's pid and host; a killed holder's lock is free again;
readers never take the lock."""
import json
import os
import socket
import subprocess
import sys

import pytest

from mlx_open1b.rundir import LOCK_FILE, RunDir, RunDirError
from mlx_open1b.train import TrainError, Trainer

from runs import micro_cfg
from test_train import corpus  # noqa: F401 - corpus is a fixture

# a process that becomes the run's writer and holds it until its stdin closes (or it is killed)
_HOLDER = ("import sys; from mlx_open1b.rundir import RunDir; rd = RunDir(sys.argv[1]); rd.lock(); "
           "print('locked', flush=True); sys.stdin.read()")


@pytest.fixture()
def holder(tmp_path):
    """Start a process holding the writer lock of tmp_path/'run'; yields the Popen."""
    procs = []

    def start(run):
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "locked"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mlx_open1b.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_second_process_is_refused_naming_the_holder(tmp_path, holder):
    run = tmp_path / "run"
    p = holder(run)
    with pytest.raises(RunDirError) as e:
        RunDir(run).lock()
    assert e.value.exit_code == 2
    assert f"pid {p.pid} on host {socket.gethostname()}" in str(e.value)
    assert RunDir(run).writer() == {"pid": p.pid, "host": socket.gethostname()}
    # the trainer asks before it reads anything more than that a run is there
    (run / "run.json").write_text("{}")
    with pytest.raises(TrainError, match=f"pid {p.pid}") as e:
        Trainer.resume(run)
    assert e.value.exit_code == 2


def test_a_killed_holder_leaves_the_lock_free(tmp_path, holder):
    run = tmp_path / "run"
    p = holder(run)
    with pytest.raises(RunDirError):
        RunDir(run).lock()
    p.kill()                     # SIGKILL: no clean-up runs, the OS drops the flock
    p.wait()
    rd = RunDir(run)
    rd.lock()
    assert rd.writer() == {"pid": os.getpid(), "host": socket.gethostname()}
    rd.unlock()
    assert RunDir(run).writer() is None          # released: no pid left behind


def test_one_process_shares_its_hold(tmp_path, holder):
    """Two RunDirs of one process (a Trainer resumed where another was made) share the lock, and
    another process can take it once both let go, also by being garbage-collected."""
    run = tmp_path / "run"
    a, b = RunDir(run), RunDir(run)
    a.lock()
    b.lock()
    a.unlock()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()      # b still holds it
    del b
    holder(run)                  # would hang or fail to print 'locked' if the lock were still held


def test_train_resume_is_refused_while_a_run_trains(tmp_path, corpus):  # noqa: F811
    """The issue's case: a second `open1b train --resume` on a run being written stops at once with
    exit 2 and the writer's pid, and leaves every file as it was; `open1b hash` (a reader) still works."""
    run = tmp_path / "run"
    tr = Trainer.new(run, micro_cfg(), corpus, log=lambda m: None)
    tr.train(2)
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_FILE}
    r = _cli("train", "--resume", "--out", str(run), "--steps", "4", "--backend", "cpu_ref", "--skip-selftest")
    assert r.returncode == 2, r.stderr
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in r.stderr
    assert "Traceback" not in r.stderr
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_FILE} == before
    h = _cli("hash", str(run))
    assert h.returncode == 0, h.stderr
    assert h.stdout.split()[0] == tr.ledger.last_hash
    tr.train(3)                  # the writer goes on undisturbed
    assert RunDir(run).verify_ledger(tr.genesis) == tr.ledger.last_hash


@pytest.mark.slow
def test_distributed_rank0_is_refused_and_every_worker_stops(tmp_path, holder):
    """Rank 0 takes the lock as it opens the run: with another writer holding it, every worker stops
    before the first step with the holder's pid, and nothing in the run changes."""
    pytest.importorskip("torch.distributed")
    import test_distributed as dist
    from data_helpers import MICRO_MIX, make_corpus
    script = tmp_path / "worker.py"
    script.write_text(dist._WORKER)
    data = tmp_path / "corpus"
    make_corpus(data, MICRO_MIX)
    run = tmp_path / "run"
    tr = Trainer.new(run, dist.dist_cfg(), data, log=lambda m: None)
    tr.train(2)
    tr.rundir.unlock()
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_FILE}
    p = holder(run)
    r = dist.torchrun(2, script, dist._args(run, resume=True, steps=4, timeout=30.0))
    assert r.returncode != 0
    assert r.stderr.count(f"pid {p.pid} on host {socket.gethostname()}") >= 2, r.stderr[-3000:]   # both workers
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_FILE} == before


def test_a_reader_meeting_a_record_being_appended_is_told_so(tmp_path, corpus, holder):  # noqa: F811
    """Readers never take the lock: an incomplete last line stays an error for them, named as a
    record being appended while the writer lives, as an interrupted write once it is gone."""
    from mlx_open1b.ledger import LedgerError
    run = tmp_path / "run"
    tr = Trainer.new(run, micro_cfg(), corpus, log=lambda m: None)
    tr.train(1)
    tr.rundir.unlock()
    with open(run / "ledger.jsonl", "ab") as f:
        f.write(b'{"step":1,"half a rec')
    p = holder(run)
    with pytest.raises(LedgerError, match=f"incomplete last line .*being written \\(pid {p.pid} on host"):
        RunDir(run).verify_ledger(tr.genesis)
    p.kill()
    p.wait()
    with pytest.raises(LedgerError, match="incomplete last line") as e:
        RunDir(run).verify_ledger(tr.genesis)
    assert "being written" not in str(e.value)


def test_train_nproc_is_refused_before_any_worker_starts(tmp_path, corpus, holder):  # noqa: F811
    pytest.importorskip("torch.distributed")
    run = tmp_path / "run"
    tr = Trainer.new(run, micro_cfg(), corpus, log=lambda m: None)
    tr.rundir.unlock()
    p = holder(run)
    r = _cli("train", "--resume", "--out", str(run), "--nproc", "2", "--backend", "cpu_ref", "--skip-selftest")
    assert r.returncode == 2 and f"pid {p.pid} on host {socket.gethostname()}" in r.stderr, r.stderr
    assert "torch.distributed" not in r.stderr and "rank" not in r.stderr      # no worker was started
