"""The long phases (opening the run, writing checkpoints, held-out evaluation) never trip the other
workers' collective timeout: each has its own deadline (phases.py), and a phase within it passes;
a rank that dies meanwhile is still reported within the collective timeout, one that is alive but
past the phase's deadline is reported naming the phase and the rank (Comm.phase: heartbeats in the
process group's store). Real worker processes on gloo, as in test_distributed."""
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch.distributed")

from test_distributed import _env, dist_cfg, free_port, ledger, tree  # noqa: E402

# The workers import torch and the package before a file barrier, so that the rendezvous, which
# runs under the short timeout these tests use, never waits for a slow import on a busy machine.
_BARRIER = """
import json, os, sys, time
import torch.distributed
import mlx_open1b.distributed
a = json.loads(sys.argv[1])
open(os.path.join(a["dir"], "ready." + os.environ["RANK"]), "w").close()
while sum(f.startswith("ready.") for f in os.listdir(a["dir"])) < int(os.environ["WORLD_SIZE"]):
    time.sleep(0.01)


def phase_hook(rank, what):         # the test's faults: a rank slow in its phases, a rank dying in one
    if a.get("slow") and rank == a["slow"][0]:
        time.sleep(a["slow"][1])
    if a.get("die") and rank == a["die"][0] and a["die"][1] in what:
        os._exit(17)
"""

_PHASE_WORKER = _BARRIER + """
from mlx_open1b.distributed.collectives import Comm, CommError
comm = Comm.init_from_env("cpu_ref", a["timeout"], phase_hook=phase_hook)
t0 = time.monotonic()
try:
    with comm.phase("writing the checkpoint of step 2", timeout=a.get("phase_timeout")):
        if comm.rank == 0:
            time.sleep(a["work"])
    got = comm.all_gather_object(comm.rank)
except CommError as e:
    os.write(2, f"error: {e} after {time.monotonic() - t0:.1f} s\\n".encode())
    os._exit(3)
print(json.dumps({"gathered": got, "waited": time.monotonic() - t0}), flush=True)
comm.close()
"""

_TRAIN_WORKER = _BARRIER + """
from mlx_open1b.config import RunConfig
from mlx_open1b.distributed import worker_main
from mlx_open1b.distributed.phases import PhaseTimeouts
cfg = RunConfig.from_json(a["cfg"]) if a.get("cfg") else None
pt = PhaseTimeouts(collective=a["timeout"], **a["phases"]) if a.get("phases") else None
worker_main(a["run"], cfg, a.get("corpus"), steps=a["steps"], timeout=a["timeout"], phase_hook=phase_hook,
            phase_timeouts=pt)
"""


def _launch(n, script, args: dict, tmp, store: str):
    """n workers with torchrun's environment; store "agent": the test process hosts the TCPStore as
    torchrun's agent would (it outlives rank 0), "rank0": rank 0 hosts it (a launch without an
    agent). [(exit code, stdout, stderr)] by rank, and the seconds until all exited."""
    import torch.distributed as dist
    tmp.mkdir(parents=True, exist_ok=True)
    args = json.dumps({**args, "dir": str(tmp)})
    (tmp / "w.py").write_text(script)
    port, extra, host = free_port(), {}, None
    if store == "agent":
        host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        extra["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    t0, procs = time.monotonic(), []
    for r in range(n):
        e = _env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)
        procs.append(subprocess.Popen([sys.executable, str(tmp / "w.py"), args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = [(p, *p.communicate(timeout=300)) for p in procs]
    del host
    return [(p.returncode, o, e) for p, o, e in out], time.monotonic() - t0


# ------------------------------------------------------------------------------ the primitive
def test_rank0_phase_longer_than_the_timeout_completes(tmp_path):
    """Rank 0 works 2.5 collective timeouts alone, within its phase's deadline; rank 1 waits on its
    heartbeat and both meet in the collective after it (without the phase, rank 1's all_gather
    times out)."""
    res, _ = _launch(2, _PHASE_WORKER, {"timeout": 4.0, "work": 10.0, "phase_timeout": 20.0}, tmp_path, "agent")
    for code, out, err in res:
        assert code == 0, err[-2000:]
        assert json.loads(out)["gathered"] == [0, 1]
    assert json.loads(res[1][1])["waited"] >= 10.0            # rank 1 did wait through rank 0's work


@pytest.mark.parametrize("store", ["agent", "rank0"])
def test_rank0_that_dies_in_a_phase_is_reported(tmp_path, store):
    """Rank 0 dies 1 s into its phase. With the store outside it (torchrun), rank 1 sees the
    heartbeat stop and reports it after the timeout; with the store inside rank 0, at once."""
    timeout = 4.0
    res, took = _launch(2, _PHASE_WORKER, {"timeout": timeout, "work": 1.0, "die": [0, "checkpoint"]}, tmp_path,
                        store)
    assert res[0][0] == 17
    code, _, err = res[1]
    assert code == 3 and "error: waiting for rank 0 (writing the checkpoint of step 2)" in err, err[-2000:]
    if store == "agent":
        assert f"no heartbeat from rank 0 for {timeout:g} s" in err, err[-2000:]
    waited = float(err.rsplit(" after ", 1)[1].split()[0])
    assert waited < 1.0 + timeout + 3.0, err                  # bounded: the timeout and a few polls


# ------------------------------------------------------------------------------ the trainer
@pytest.mark.slow
def test_slow_rank0_phases_same_run_directory(tmp_path, corpus):
    """Rank 0 takes 8 s longer (collective timeout 5 s) in each of its phases: opening the run,
    initializing the parameters and the first checkpoint, held-out evaluation, the checkpoint of
    step 2 — each within its deadline (a slow disk: bytes_per_s 1e5, init_per_s 1e4, the
    evaluation's margin 1e6 of the training rate). The run completes with the bytes of one process."""
    from mlx_open1b.train import Trainer
    cfg = dist_cfg(checkpoint_every=2, eval_every=2)
    single = tmp_path / "single"
    h = Trainer(single, cfg, corpus).train(2)
    run = tmp_path / "run"
    args = {"run": str(run), "cfg": cfg.to_json(), "corpus": str(corpus), "steps": 2, "timeout": 5.0, "slow": [0, 8],
            "phases": {"bytes_per_s": 1e5, "init_per_s": 1e4, "eval_margin": 1e6}}
    res, took = _launch(2, _TRAIN_WORKER, args, tmp_path / "w", "agent")
    for code, _, err in res:
        assert code == 0, err[-3000:]
    assert f"run hash {h}" in res[0][1]
    assert took > 3 * 8                                       # the three phases were slow
    assert ledger(run) == ledger(single)
    assert tree(run) == tree(single)


@pytest.mark.slow
def test_rank0_that_dies_writing_a_checkpoint_is_reported(tmp_path, corpus):
    cfg = dist_cfg(checkpoint_every=2, eval_every=0)
    run = tmp_path / "run"
    args = {"run": str(run), "cfg": cfg.to_json(), "corpus": str(corpus), "steps": 4, "timeout": 5.0,
            "die": [0, "checkpoint of step 2"]}
    res, took = _launch(2, _TRAIN_WORKER, args, tmp_path / "w", "agent")
    assert res[0][0] == 17
    code, _, err = res[1]
    assert code == 3, err[-3000:]
    assert ("error: [rank 1/2] worker lost during step 1: waiting for rank 0 (writing the checkpoint of step 2) "
            "failed on rank 1 of 2 (no heartbeat from rank 0 for 5 s") in err, err[-3000:]
    assert "the last checkpoint (step 0 or, if rank 0 finished writing it, the next) is intact" in err
    assert len(ledger(run).splitlines()) == 2


def test_phase_past_its_deadline_names_the_phase_and_the_rank(tmp_path):
    """Rank 0 works 8 s, alive (heartbeat on), in a phase with a 3 s deadline: rank 1 stops at the
    deadline with an error naming the phase, the rank and the deadline — not at the work's end,
    and not for a lost heartbeat."""
    res, _ = _launch(2, _PHASE_WORKER, {"timeout": 2.0, "work": 8.0, "phase_timeout": 3.0}, tmp_path, "agent")
    code, _, err = res[1]
    assert code == 3, err[-2000:]
    assert ("error: waiting for rank 0 (writing the checkpoint of step 2): rank 0 did not finish writing the "
            "checkpoint of step 2 within the phase's timeout of 3 s (alive") in err, err[-2000:]
    assert "raise --phase-timeout-scale" in err, err[-2000:]       # what to change, by the option's name
    waited = float(err.rsplit(" after ", 1)[1].split()[0])
    assert 3.0 <= waited < 6.0, err


_TURNS_WORKER = _BARRIER + """
import numpy as np
from mlx_open1b.distributed.collectives import Comm, CommError
comm = Comm.init_from_env("cpu_ref", a["timeout"])
got = []
try:
    with comm.phase("turns", busy=range(comm.world), timeout=60.0):
        if comm.rank == 0:
            for r in a["order"]:
                time.sleep(a["pause"])             # the writer is busy before each turn
                comm.give_turn(r)
                buf = np.empty(3, np.int64)
                comm.recv(buf, r)
                got.append(buf.tolist())
        else:
            comm.await_turn(0)
            comm.send(np.array([comm.rank, time.monotonic_ns() // 1000, 7], np.int64), 0)
except CommError as e:
    os.write(2, f"error: {e}\\n".encode())
    os._exit(3)
print(json.dumps(got), flush=True)
comm.close()
"""


def test_turns_in_the_writers_order_past_the_collective_timeout(tmp_path):
    """4 workers: rank 0 takes each owner's piece in the order 3, 1, 2, pausing 2.5 s before each
    (collective timeout 2 s): every owner waits its turn in the store (rank 2: 7.5 s) and its send
    meets rank 0's receive; the pieces arrive in the writer's order."""
    res, _ = _launch(4, _TURNS_WORKER, {"timeout": 2.0, "pause": 2.5, "order": [3, 1, 2]}, tmp_path, "agent")
    for code, _, err in res:
        assert code == 0, err[-2000:]
    got = json.loads(res[0][1])
    assert [g[0] for g in got] == [3, 1, 2] and all(g[2] == 7 for g in got)
    assert got[0][1] < got[1][1] < got[2][1]          # each sent only once given its turn


@pytest.mark.slow
def test_trainer_phase_past_its_deadline(tmp_path, corpus):
    """The trainer gives its phases the deadlines of PhaseTimeouts: rank 0 alive but 8 s late in
    opening the run, whose deadline is the 3 s collective timeout plus the micro model's tiny
    initialization; rank 1 stops with the phase and the rank named, before any step."""
    cfg = dist_cfg(checkpoint_every=2, eval_every=2)
    run = tmp_path / "run"
    args = {"run": str(run), "cfg": cfg.to_json(), "corpus": str(corpus), "steps": 2, "timeout": 3.0, "slow": [0, 8],
            "phases": {}}
    res, _ = _launch(2, _TRAIN_WORKER, args, tmp_path / "w", "agent")
    code, _, err = res[1]
    assert code == 3, err[-3000:]
    assert ("error: [rank 1/2] worker lost while starting the run (rank 1 of 2): waiting for rank 0 (opening the "
            "run): rank 0 did not finish opening the run within the phase's timeout of 3 s") in err, err[-3000:]
    assert not (run / "ledger.jsonl").exists() or not (run / "ledger.jsonl").read_bytes()
