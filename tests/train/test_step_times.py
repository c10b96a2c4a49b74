"""Wall-clock step times beside the ledger (RUN/timing.jsonl, steptimes.py): one line per step of
the writer, never in the ledger (equal runs keep byte-identical ledgers), never written by a replay,
a failed write never stops training, and a crash's incomplete line is cut off and skipped."""
import errno
import json
import os
import shutil

import pytest

from mlx_open1b import fsutil
from mlx_open1b.report import ReportError, load_run_data, summarize
from mlx_open1b.steptimes import TIMING_FILE, StepTimes, read_step_times
from mlx_open1b.train import Trainer

from runs import micro_cfg

QUIET = dict(log=lambda m: None)


def lines(run):
    return [json.loads(x) for x in (run / TIMING_FILE).read_text().splitlines()]


def test_times_are_beside_the_ledger_not_in_it(tmp_path, corpus):
    a, b = tmp_path / "a", tmp_path / "b"
    ha = Trainer.new(a, micro_cfg(checkpoint_every=2, eval_every=2), corpus, **QUIET).train(5)
    tr = Trainer.new(b, micro_cfg(checkpoint_every=2, eval_every=2), corpus, **QUIET)
    tr.train(3)
    tr.rundir.unlock()
    shutil.rmtree(b / "ckpt-00000003")
    hb = Trainer.resume(b, **QUIET).train(5)          # resumed from step 2: steps 2.. appended again
    # the ledgers are byte-identical while their times differ: no time is in a record
    assert ha == hb and (a / "ledger.jsonl").read_bytes() == (b / "ledger.jsonl").read_bytes()
    assert (a / TIMING_FILE).read_bytes() != (b / TIMING_FILE).read_bytes()
    recs = [json.loads(x) for x in (a / "ledger.jsonl").read_text().splitlines()]
    ta = lines(a)
    assert [t["step"] for t in ta] == [r["step"] for r in recs] == list(range(5))
    assert all(t["seconds"] > 0 for t in ta)
    assert [t["tokens"] for t in ta] == [r1["tokens"] - r0 for r1, r0 in zip(recs, [0] + [r["tokens"] for r in recs])]
    assert [t["step"] for t in lines(b)] == [0, 1, 2, 2, 3, 4]
    # the report: a step's last line is its time; the median and the total are filled
    data = load_run_data(b)
    want = {t["step"]: t["seconds"] for t in lines(b)}
    assert data["times"] == want
    s = summarize(data)
    assert s["median_step_seconds"] == sorted(want.values())[2] and s["training_seconds"] == sum(want.values())
    tokens = {t["step"]: t["tokens"] for t in lines(b)}
    assert s["tokens_per_second"] == sum(tokens.values()) / sum(want.values())
    # a replay (the audit) computes steps and writes no time
    before = (b / TIMING_FILE).read_bytes()
    rp = Trainer.replay(b, at_step=2, **QUIET)
    rp.compute_step()
    assert (b / TIMING_FILE).read_bytes() == before


def test_a_failed_time_write_never_stops_training(tmp_path, corpus, monkeypatch):
    real, seen = fsutil.write_all, []

    def failing(f, data):
        if str(getattr(f, "name", "")).endswith(TIMING_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
        return real(f, data)

    monkeypatch.setattr(fsutil, "write_all", failing)
    run = tmp_path / "run"
    h = Trainer.new(run, micro_cfg(), corpus, log=seen.append).train(3)
    monkeypatch.undo()
    assert h == Trainer.new(tmp_path / "ref", micro_cfg(), corpus, **QUIET).train(3)
    warn = [m for m in seen if "step times" in m]
    assert len(warn) == 1 and "No space left on device" in warn[0], seen       # said once, not every step
    assert (run / TIMING_FILE).read_bytes() == b""                            # the failed line was cut back


def test_an_incomplete_line_is_cut_off_and_skipped(tmp_path):
    path = tmp_path / TIMING_FILE
    path.write_bytes(b'{"step":0,"seconds":0.5,"tokens":8}\n{"step":1,"sec')       # a crash mid-write
    assert read_step_times(path, ReportError) == {0: 0.5}
    st = StepTimes(path)
    st.append(1, 0.25, 8)
    st.append(2, 0.125, 8)
    assert path.read_text().splitlines() == ['{"step":0,"seconds":0.5,"tokens":8}',
                                             '{"step":1,"seconds":0.25,"tokens":8}',
                                             '{"step":2,"seconds":0.125,"tokens":8}']
    for bad in ('{"step":1}\n', '{"step":"1","seconds":1}\n', '{"step":1,"seconds":-1}\n', 'x\n'):
        path.write_text('{"step":0,"seconds":0.5}\n' + bad)
        with pytest.raises(ReportError, match=rf"{TIMING_FILE}: line 2: expected"):
            read_step_times(path, ReportError)
