"""A distributed worker that hangs (SIGSTOP) rather than dies: the others stop within the timeout,
with the message a dead worker gets, and the run resumes from its last checkpoint to the bits of a
run that never hung."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mlx_open1b.checkpoint import list_checkpoints
from mlx_open1b.train import Trainer

pytest.importorskip("torch.distributed")
import test_distributed as dist  # noqa: E402  (same area: its config, corpus and launch helpers)

_WORKER = """
import json, os, signal, sys
from mlx_open1b.config import RunConfig
from mlx_open1b.distributed import worker_main
a = json.loads(sys.argv[1])
stop = tuple(a["stop_at"]) if a.get("stop_at") else None      # (rank, step): that worker stops mid-step

def after_microbatches(rank, step):
    if (rank, step) == stop:
        os.kill(os.getpid(), signal.SIGSTOP)

worker_main(a["run"], RunConfig.from_json(a["cfg"]) if a.get("cfg") else None, a.get("corpus"), steps=a["steps"],
            resume=a.get("resume", False), timeout=a["timeout"], after_microbatches=after_microbatches)
"""


@pytest.mark.slow
def test_a_stopped_worker_stops_every_worker_within_the_timeout(tmp_path, corpus):  # noqa: F811
    cfg = dist.dist_cfg()
    single = tmp_path / "single"
    Trainer(single, cfg, corpus).train(5)
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    run, timeout, n = tmp_path / "run", 20.0, 3
    args = json.dumps({"run": str(run), "cfg": cfg.to_json(), "corpus": str(corpus), "steps": 5, "timeout": timeout,
                       "stop_at": [1, 2]})
    port, procs = dist.free_port(), []
    for r in range(n):
        e = dist._env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        while not os.path.exists(f"/proc/{procs[1].pid}/status") or \
                "T (stopped)" not in open(f"/proc/{procs[1].pid}/status").read():
            assert procs[1].poll() is None, procs[1].communicate()[1][-2000:]
            time.sleep(0.1)
        stopped = time.monotonic()
        for rank in (0, 2):
            _, err = procs[rank].communicate(timeout=timeout * 3)
            assert procs[rank].returncode == 3, err[-2000:]
            assert f"error: [rank {rank}/3] worker lost during step 2" in err, err[-2000:]
            assert "the last checkpoint (step 2) is intact" in err
        assert time.monotonic() - stopped < 2 * timeout
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate()
    assert [s for s, _ in list_checkpoints(run)] == [0, 2]
    r = dist.torchrun(2, script, json.dumps({"run": str(run), "steps": 5, "timeout": 60.0, "resume": True}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert dist.ledger(run) == dist.ledger(single)

