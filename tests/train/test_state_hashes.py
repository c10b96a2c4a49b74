"""A step's gradient and state hashes are computed in the background while the next step computes
(mlx_open1b/state_hashes.py, step.PendingHashes, Trainer.records): the ledger and checkpoints are
byte for byte those of hashing each step in line, however late or early the hashes run; a crash
before a record is appended loses no record the ledger holds, and the resumed run writes the
uninterrupted run's ledger; on a device the hashes read reused pinned host buffers filled by
asynchronous copies."""
import json
import signal
import subprocess
import sys
from concurrent.futures import Future

import pytest

from mlx_open1b import arrays, step as step_mod
from mlx_open1b.checkpoint import list_checkpoints
from mlx_open1b.train import Trainer

from fake_cupy import fake_gpu  # noqa: F401 (a fixture)
from runs import count_clip_copies, micro_cfg

STEPS = 6


def cfg():
    # six steps: updates clipped (0, 1, 3, 5) and not (4), a spike (1) and the skipped step after it,
    # held-out CE (3), a batch phase change (4), a checkpoint every other step
    return micro_cfg(spike_threshold=4.5, clip_norm=4.0, spike_skip=1)


def run_files(run) -> dict:
    """The ledger and every checkpoint file, relative path -> bytes (timing.jsonl is wall-clock)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and (p.name == "ledger.jsonl" or p.parent.name.startswith("ckpt-"))}


@pytest.fixture(scope="module")
def inline(tmp_path_factory, corpus):
    """The run with every hash computed at once (on the caller's thread) and waited for at the end
    of its step: the order of a trainer without any overlap."""
    run = tmp_path_factory.mktemp("inline") / "run"
    mp = pytest.MonkeyPatch()
    mp.setattr(step_mod, "submit", eager_submit)
    try:
        tr = Trainer(run, cfg(), corpus)
        tr.overlap_hashes = False
        tr.train(STEPS)
    finally:
        mp.undo()
    assert tr.hash_stage.host_bytes() == 0              # each hash done before the clip: it wrote in place
    recs = [json.loads(line) for line in (run / "ledger.jsonl").read_bytes().splitlines()]
    assert [(r["clipped"], r["skipped"]) for r in recs] == [(True, False), (True, False), (False, True),
                                                           (True, False), (False, False), (True, False)]
    assert any("eval" in r for r in recs) and len({r["microbatches"] for r in recs}) == 2
    return run_files(run)


def eager_submit(fn, *args) -> Future:
    f = Future()
    f.set_result(fn(*args))
    return f


class LateFuture(Future):
    """A job that runs when its result is first asked for: the hashes read their bytes as late as
    the trainer lets them (so a write the trainer makes before settling a step is read)."""

    def __init__(self, fn, args):
        super().__init__()
        self._job = (fn, args)

    def done(self):
        return False if self._job else super().done()

    def result(self, timeout=None):
        if self._job:
            fn, args = self._job
            self._job = None
            self.set_result(fn(*args))
        return super().result(timeout)


def test_late_and_background_hashes_write_the_inline_ledger(tmp_path, corpus, inline, monkeypatch):
    tr = Trainer(tmp_path / "background", cfg(), corpus)
    tr.train(STEPS)
    assert run_files(tmp_path / "background") == inline
    monkeypatch.setattr(step_mod, "submit", lambda fn, *a: LateFuture(fn, a))
    copies, gives = count_clip_copies(monkeypatch), []
    real_give = arrays.BufferPool.give
    monkeypatch.setattr(arrays.BufferPool, "give",
                        lambda pool, a: gives.append((len(copies), id(a))) or real_give(pool, a))
    tr = Trainer(tmp_path / "late", cfg(), corpus)
    tr.train(STEPS)
    assert run_files(tmp_path / "late") == inline
    # the clip wrote a copy of the gradient while its hash was pending (numpy: in place otherwise),
    # into a free buffer of the trainer's gradient pool, given back to it at the end of the step:
    # the stage kept none of its own
    assert copies and all((k + 1, c) in gives for k, c in enumerate(copies))   # given after copy k
    assert tr.hash_stage.host_bytes() == 0
    # without the pool (Trainer.recycle_grads off), the same copies go into the stage's own buffer
    tr = Trainer(tmp_path / "late-nopool", cfg(), corpus)
    tr.recycle_grads = False
    tr.train(STEPS)
    assert run_files(tmp_path / "late-nopool") == inline
    assert tr.hash_stage.host_bytes() == 4 * tr.model_cfg.n_params()


def test_checkpoints_take_the_hashes_of_the_records(tmp_path, corpus, inline, monkeypatch):
    """A checkpoint after a step takes that step's state hashes (its record's) instead of hashing
    the state again; resuming from each checkpoint verifies them against its tensors."""
    from mlx_open1b import train as train_mod
    calls = []
    for name in ("param_hash", "opt_hash"):
        real = getattr(train_mod, name)
        monkeypatch.setattr(train_mod, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    run = tmp_path / "run"
    Trainer(run, cfg(), corpus).train(STEPS)
    assert run_files(run) == inline and len(list_checkpoints(run)) == 1 + STEPS // 2
    assert calls == ["param_hash", "opt_hash"]          # step 0's checkpoint only: no step before it
    for step, _ in list_checkpoints(run)[1:]:
        Trainer.replay(run, at_step=step, log=lambda m: None)      # load_state checks meta.json's hashes


def test_audit_replays_with_the_overlap(tmp_path, corpus, monkeypatch):
    """The audit recomputes steps through the training loop: step t's record is settled only after
    step t+1's microbatches began (from the start and from a checkpoint), and every step certifies."""
    from mlx_open1b.audit import audit
    from mlx_open1b.model import Model
    run = tmp_path / "run"
    Trainer(run, cfg(), corpus).train(STEPS)
    M = {r["step"]: r["microbatches"] for r in map(json.loads, (run / "ledger.jsonl").read_bytes().splitlines())}
    events = []
    real_settle, real_mb = step_mod.PendingHashes.settle, Model.loss_and_grad
    monkeypatch.setattr(step_mod.PendingHashes, "settle",
                        lambda self, timing: events.append(("settle", self.step)) or real_settle(self, timing))
    monkeypatch.setattr(Model, "loss_and_grad", lambda self, *a: events.append(("mb",)) or real_mb(self, *a))
    for first in (0, 2):
        events.clear()
        att = audit(run, first, STEPS - 1)
        assert att["verdict"] == "certified", att
        settled = [(i, e[1]) for i, e in enumerate(events) if e[0] == "settle"]
        assert [t for _, t in settled] == list(range(first, STEPS))
        for i, t in settled[:-1]:
            done_before = sum(1 for e in events[:i] if e[0] == "mb")
            assert done_before > sum(M[s] for s in range(first, t + 1)), (t, events)


def _crash_at(tr, k: int, exc: BaseException, monkeypatch):
    """Raise exc in step k's first microbatch (step k-1's record is then still pending)."""
    real = tr.model.loss_and_grad

    def loss_and_grad(params, windows):
        if tr.state.step == k:
            raise exc
        return real(params, windows)
    monkeypatch.setattr(tr.model, "loss_and_grad", loss_and_grad)


@pytest.mark.parametrize("exc, kept", [(KeyboardInterrupt(), 2), (RuntimeError("planted"), 3)])
def test_crash_with_a_record_pending_then_resume(tmp_path, corpus, inline, monkeypatch, exc, kept):
    """Interrupted in step 3 while step 2's record waits for its hashes: a KeyboardInterrupt leaves
    it out (records 0-1 on disk), an ordinary exception still appends it (its state is untouched);
    either way no checkpoint is ahead of the ledger, and the resumed run writes the same bytes."""
    run = tmp_path / "run"
    tr = Trainer(run, cfg(), corpus)
    _crash_at(tr, 3, exc, monkeypatch)
    with pytest.raises(type(exc)):
        tr.train(STEPS)
    lines = (run / "ledger.jsonl").read_bytes().splitlines(keepends=True)
    assert [json.loads(x)["step"] for x in lines] == list(range(kept))
    assert b"".join(lines) == inline["ledger.jsonl"][:len(b"".join(lines))]
    assert list_checkpoints(run)[-1][0] <= kept
    monkeypatch.undo()
    Trainer(run, resume=True).train(STEPS)
    assert run_files(run) == inline


_KILLED = """
import json, os, signal, sys
from mlx_open1b.config import RunConfig
from mlx_open1b import step
from mlx_open1b.train import Trainer
real = step.PendingHashes.settle
def settle(self, timing):
    if self.step == 2:            # step 2 computed and hashed, its record not yet appended
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, timing)
step.PendingHashes.settle = settle
Trainer({run!r}, RunConfig.from_json(json.loads({cfg!r})), {corpus!r}).train({steps})
"""


def test_killed_with_a_record_pending_then_resume(tmp_path, corpus, inline):
    run = tmp_path / "run"
    code = _KILLED.format(run=str(run), cfg=json.dumps(cfg().to_json()), corpus=str(corpus), steps=STEPS)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert [json.loads(x)["step"] for x in (run / "ledger.jsonl").read_bytes().splitlines()] == [0, 1]
    Trainer(run, resume=True).train(STEPS)
    assert run_files(run) == inline


def test_an_error_in_the_background_stops_the_run(tmp_path, corpus, monkeypatch):
    tr = Trainer(tmp_path / "run", cfg(), corpus)
    tr.train(2)

    def broken(fn, *args):
        f = Future()
        f.set_exception(OSError("planted"))
        return f
    monkeypatch.setattr(step_mod, "submit", broken)
    with pytest.raises(OSError, match="planted"):
        tr.step()
    assert len((tmp_path / "run" / "ledger.jsonl").read_bytes().splitlines()) == 2


# ------------------------------------------------------------------------------ device arrays
@pytest.mark.parametrize("when", ["late", pytest.param("background", marks=pytest.mark.slow)])
def test_device_hashes_read_reused_pinned_buffers(tmp_path, corpus, inline, fake_gpu, monkeypatch, when):
    """The CUDA backend on device arrays (the cupy stand-in, kernels emulated): the hashes read
    pinned host buffers, allocated once and reused, filled by copies on the copy stream that run
    only when their event is waited for (tests/fake_cupy.py): read too early they hold stale
    bytes, ordered after the clip they hold clipped ones. The ledger and checkpoints are the
    cpu_ref run's, with the hashes as late as the trainer lets them or on the background thread."""
    import cupyx
    if when == "late":
        monkeypatch.setattr(step_mod, "submit", lambda fn, *a: LateFuture(fn, a))
    run, steps = tmp_path / "cuda", 3
    tr = Trainer(run, cfg(), corpus, backend="cuda")
    tr.train(1)
    stage = tr.hash_stage
    assert {arrays.kind(a) for a in (tr.state.params, tr.state.m, tr.state.v)} == {"cupy"}
    buffers = dict(stage._host)
    assert set(buffers) == {"grads", "params", "m", "v"}
    assert all(any(b is p for p in cupyx.pinned) for b in buffers.values())
    assert not stage._stream.null and stage._stream.ran == len(stage._stream.copies) == 4
    tr.train(steps)
    assert all(stage._host[k] is b for k, b in buffers.items()) and len(cupyx.pinned) == 4    # reused
    assert stage.host_bytes() == 14 * tr.model_cfg.n_params()
    got = run_files(run)
    assert got["ledger.jsonl"] == b"".join(inline["ledger.jsonl"].splitlines(keepends=True)[:steps])
    common = {k for k in got if k.startswith("ckpt-") and k in inline}      # ckpt-0, ckpt-2
    assert {k.split("/")[0] for k in common} == {"ckpt-00000000", "ckpt-00000002"}
    assert {k: got[k] for k in common} == {k: inline[k] for k in common}


def test_memory_model_records_the_pinned_host_buffers():
    """The shape-only run (the memory model) holds the hashes' host copies in pinned buffers,
    14 bytes per parameter, tagged "pinned" in the host breakdown."""
    from mlx_open1b.shape.run import measure
    c = micro_cfg(phases=((0, 2),))
    P = c.model.n_params()
    (m,), = measure(c, 1, resolution=0)
    assert m.host.owners.get("pinned") == 14 * P, m.host.owners
    assert m.moved["d2h"] >= 14 * P


def test_a_failed_evaluation_appends_no_record_without_its_eval(tmp_path, corpus, inline, monkeypatch):
    """Held-out evaluation fails after step 3 was computed: step 2's record (complete) is appended,
    step 3's (its eval missing) is not; resuming writes the uninterrupted run's bytes."""
    run = tmp_path / "run"
    tr = Trainer(run, cfg(), corpus)

    def broken():
        raise RuntimeError("planted")
    monkeypatch.setattr(tr, "heldout_ce", broken)
    with pytest.raises(RuntimeError, match="planted"):
        tr.train(STEPS)
    ledger = (run / "ledger.jsonl").read_bytes()
    assert [json.loads(x)["step"] for x in ledger.splitlines()] == [0, 1, 2]
    assert inline["ledger.jsonl"].startswith(ledger)
    monkeypatch.undo()
    Trainer(run, resume=True).train(STEPS)
    assert run_files(run) == inline
