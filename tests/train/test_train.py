"""The trainer end to end on a micro model: resume gives the same ledger, tampering is located,
killed runs resume to the same bits, bad input fails clearly."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mlx_open1b.audit import audit, run_hash
from mlx_open1b.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from mlx_open1b.config import ModelConfig, RunConfig, TrainConfig
from mlx_open1b.data.format import read_shard, write_shard
from mlx_open1b.data.stream import Stream
from mlx_open1b.ledger import LedgerError, verify_chain
from mlx_open1b.train import TrainError, Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import micro_cfg




@pytest.fixture()
def corpus(tmp_path):
    d = tmp_path / "corpus"
    make_corpus(d, MICRO_MIX)
    return d


def ledger_bytes(run):
    return (run / "ledger.jsonl").read_bytes()


def test_resume_gives_identical_ledger(tmp_path, corpus):
    cfg = micro_cfg()
    full = tmp_path / "full"
    Trainer(full, cfg, corpus).train(12)
    recs = [json.loads(l) for l in ledger_bytes(full).splitlines()]
    assert any(r["skipped"] for r in recs) and any(r["spike"] for r in recs)   # the spike protocol ran
    assert any(r["microbatches"] == 3 for r in recs)                           # a batch phase change
    skipped_steps = [r["step"] for r in recs if r["skipped"]]
    # stop at several points (one right after a skipped step), resume in a new Trainer each time
    stops = sorted({3, 6, skipped_steps[0] + 1, 9})
    part = tmp_path / "part"
    tr = Trainer(part, cfg, corpus)
    for s in stops:
        tr.train(s)
        tr = Trainer(part, resume=True)
    tr.train(12)
    assert ledger_bytes(part) == ledger_bytes(full)


def test_resume_after_crash_past_last_checkpoint(tmp_path, corpus):
    cfg = micro_cfg(checkpoint_every=4)
    full = tmp_path / "full"
    Trainer(full, cfg, corpus).train(10)
    part = tmp_path / "part"
    tr = Trainer(part, cfg, corpus)
    for _ in range(6):        # steps 0..5; the last checkpoint is at 4: steps 4, 5 are in the ledger only
        tr.step()
    tr = Trainer(part, resume=True)
    assert tr.state.step == 4
    tr.train(10)
    assert ledger_bytes(part) == ledger_bytes(full)


def test_audit_certifies_and_hash_recomputes(tmp_path, corpus):
    run = tmp_path / "run"
    h = Trainer(run, micro_cfg(), corpus).train(8)
    assert run_hash(run)["run_hash"] == h == verify_chain(run / "ledger.jsonl", json.loads((run / "run.json").read_text())["genesis"])
    att = audit(run, 5, 7, out=tmp_path / "att.json")
    assert att["verdict"] == "certified" and sorted(att["certified_steps"]) == ["5", "6", "7"]
    assert att["replayed_from_checkpoint_step"] == 4
    assert json.loads((tmp_path / "att.json").read_text())["verdict"] == "certified"


def test_tampered_checkpoint_is_caught(tmp_path, corpus):
    run = tmp_path / "run"
    Trainer(run, micro_cfg(), corpus).train(6)
    step, path = list_checkpoints(run)[-2]             # ckpt-4: the one an audit of step 5 starts from
    assert step == 4
    f = path / "state.safetensors"
    b = bytearray(f.read_bytes())
    b[-5] ^= 0x10                                      # one bit of the last tensor's data
    f.write_bytes(bytes(b))
    with pytest.raises(CheckpointError, match="state.safetensors"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="state.safetensors"):
        audit(run, 5, 5)


def test_replaced_document_is_located_at_its_step(tmp_path, corpus):
    run = tmp_path / "run"
    cfg = micro_cfg()
    Trainer(run, cfg, corpus).train(8)
    # the first document of step 5's windows: change its tokens in the shard (same length)
    recs = [json.loads(l) for l in ledger_bytes(run).splitlines()]
    w0 = recs[5]["windows"][0]
    stream = Stream(corpus, cfg.train.seed, cfg.model.seq_len)
    name, shard, doc, start, end = stream.window_sources(w0)[-1]
    src = stream.manifest.source(name)
    tokens, offsets = read_shard(corpus / src.shards[shard].file)
    docs = [np.array(tokens[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]
    docs[doc] = (docs[doc] + 1).astype(np.uint32)
    write_shard(corpus / src.shards[shard].file, docs)
    earlier = [r["step"] for r in recs if r["step"] < 5 and any(
        p[:3] == (name, shard, doc) for w in range(*r["windows"]) for p in stream.window_sources(w))]
    att = audit(run, 0, 7)
    assert att["verdict"] == "mismatch"
    m = att["first_mismatch"]
    assert m["component"] == "batch" and m["step"] == (earlier[0] if earlier else 5)


def test_edited_ledger_line_is_located(tmp_path, corpus):
    run = tmp_path / "run"
    Trainer(run, micro_cfg(), corpus).train(6)
    lines = ledger_bytes(run).decode().splitlines()
    rec = json.loads(lines[3])
    rec["loss"] = rec["loss"] + 1.0
    lines[3] = json.dumps(rec, separators=(",", ":"), sort_keys=True)
    (run / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(LedgerError, match="line 4.*step 3|step 3.*line 4"):
        run_hash(run)
    att = audit(run, 4, 5)
    assert att["verdict"] == "mismatch" and "line 4" in att["error"]


_KILLED_RUN = """
import sys
sys.path.insert(0, {tests!r})
from runs import micro_cfg
from mlx_open1b.train import Trainer
import pathlib
run = pathlib.Path({run!r})
tr = Trainer(run, resume=True) if (run / "run.json").exists() else Trainer(run, micro_cfg(checkpoint_every=1), {corpus!r})
tr.train(40)
"""


KILL_STEPS = 40


def _complete_records(run) -> int:
    f = run / "ledger.jsonl"
    return f.read_bytes().count(b"\n") if f.exists() else 0


def _checkpoint_writes(run) -> list:
    """Temporary checkpoint directories: a save in progress (or one a kill interrupted)."""
    return [p for p in run.iterdir() if p.name.startswith(".ckpt-") and ".tmp-" in p.name] if run.exists() else []


def _kill_mid_run(code, run, mode, rng, attempts=6):
    """Start (or resume) the run in a child and SIGKILL it mid-run: in "step" mode once the ledger
    holds 1-4 records more than the checkpoint it resumed from, after a random part of a step; in
    "checkpoint" mode as soon as a checkpoint is being written. A kill that landed too early or too
    late (the write already renamed, the run already over) is retried with a fresh child, up to
    `attempts` times. Returns (records before, records after) the kill that landed."""
    for _ in range(attempts):
        ckpts = list_checkpoints(run)
        start = ckpts[-1][0] if ckpts else 0                       # where the child resumes
        target = start + int(rng.integers(1, 5))
        stale = set(_checkpoint_writes(run))                       # left by an earlier kill
        p = subprocess.Popen([sys.executable, "-c", code])
        try:
            deadline, t_step = time.monotonic() + 120, None
            while time.monotonic() < deadline and p.poll() is None:
                n = _complete_records(run)
                if mode == "checkpoint" and set(_checkpoint_writes(run)) - stale:
                    break
                if mode == "step" and n >= target:
                    time.sleep(float(rng.uniform(0.0, t_step or 0.05)))     # into the next step
                    break
                if mode == "step" and n > start and t_step is None:
                    t_step, t0 = 0.0, time.monotonic()
                elif t_step == 0.0 and n > start + 1:
                    t_step = time.monotonic() - t0                          # one step, measured
                time.sleep(0.0005)
            p.send_signal(signal.SIGKILL)
            p.wait(30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        after = _complete_records(run)
        if p.returncode != -signal.SIGKILL:
            continue                                                # exited before the kill
        if mode == "checkpoint" and not set(_checkpoint_writes(run)) - stale:
            continue                                                # the write had completed
        if start < after < KILL_STEPS or mode == "checkpoint":
            return start, after
    pytest.fail(f"no kill landed mid-run ({mode}) in {attempts} attempts")


def test_killed_run_resumes_to_the_same_bits(tmp_path, corpus):
    full = tmp_path / "full"
    Trainer(full, micro_cfg(checkpoint_every=1), corpus).train(KILL_STEPS)
    run = tmp_path / "killed"
    code = _KILLED_RUN.format(tests=os.path.dirname(os.path.dirname(__file__)), run=str(run), corpus=str(corpus))
    rng = np.random.default_rng(0)
    for mode in ("step", "checkpoint", "step"):
        start, after = _kill_mid_run(code, run, mode, rng)
        assert start < after < KILL_STEPS or mode == "checkpoint", (mode, start, after)
        steps = [s for s, _ in list_checkpoints(run)]
        assert steps and steps[-1] <= after                     # no checkpoint ahead of the ledger
        load_checkpoint(list_checkpoints(run)[-1][1])           # the newest checkpoint is loadable
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert ledger_bytes(run) == ledger_bytes(full)


def test_heldout_mixture_ce_falls_on_the_default_corpus(tmp_path, default_corpus):
    from mlx_open1b.config import preset
    import dataclasses
    cfg = preset("tiny")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=30, checkpoint_every=1000))
    tr = Trainer(tmp_path / "tiny", cfg, default_corpus)
    start = tr.heldout_ce()["mixture"]
    tr.train(30)
    end = json.loads(ledger_bytes(tmp_path / "tiny").splitlines()[-1])["eval"]["mixture"]
    assert start > 8.9 and end < start - 1.0, (start, end)


def test_bad_input(tmp_path, corpus):
    run = tmp_path / "run"
    Trainer(run, micro_cfg(), corpus).train(2)
    with pytest.raises(TrainError, match="already exists"):
        Trainer(run, micro_cfg(), corpus)
    with pytest.raises(TrainError, match="no run to resume"):
        Trainer(tmp_path / "none", resume=True)
    info = json.loads((run / "run.json").read_text())
    info["contract_version"] = 0
    (run / "run.json").write_text(json.dumps(info))
    with pytest.raises(TrainError, match="contract v0"):
        Trainer(run, resume=True)
    other = tmp_path / "other_corpus"
    make_corpus(other, {"web": (1.0, 10, 10)})
    m = json.loads((other / "manifest.json").read_text())
    m["vocab_size"] = 999
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TrainError, match="vocabulary 999"):
        Trainer(tmp_path / "r2", micro_cfg(), other)
    from mlx_open1b.config import ConfigError
    with pytest.raises(ConfigError, match="window"):
        Trainer(tmp_path / "r3", RunConfig(ModelConfig(seq_len=8, window=16), TrainConfig()), corpus)


def test_nan_loss_stops_with_checkpoint_intact(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    tr = Trainer(run, micro_cfg(), corpus)
    tr.train(4)
    before = ledger_bytes(run)
    real = tr.model.loss_and_grad

    def poisoned(params, windows):
        loss, ce, zl, g = real(params, windows)
        return float("nan"), ce, zl, g
    monkeypatch.setattr(tr.model, "loss_and_grad", poisoned)
    with pytest.raises(TrainError, match="step 4: loss is nan"):
        tr.step()
    assert ledger_bytes(run) == before
    step, path = list_checkpoints(run)[-1]
    assert step == 4
    load_checkpoint(path)


def test_a_replay_cannot_take_training_steps(tmp_path, corpus):
    run = tmp_path / "run"
    Trainer(run, micro_cfg(), corpus).train(3)
    before = {p.name: p.stat().st_mtime_ns for p in run.rglob("*")}
    replay = Trainer.replay(run, at_step=2, log=lambda m: None)
    with pytest.raises(TrainError, match="read-only"):
        replay.step()
    assert {p.name: p.stat().st_mtime_ns for p in run.rglob("*")} == before
