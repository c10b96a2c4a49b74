"""A distributed run's checkpoints are streamed to rank 0 in pieces, each owner in turn: in pieces
far smaller than a range (many per owner, cut inside Merkle chunks) the run directory is still one
process's, byte for byte, and it resumes at another worker count; a write that fails on rank 0
mid-stream stops every worker with the checkpoint named (none waits for ever on a writer that gave
up) and leaves the previous checkpoint the newest, nothing half-written. Real workers on gloo."""
import errno
import json

import pytest

pytest.importorskip("torch.distributed")

from test_distributed import dist_cfg, ledger, torchrun, tree  # noqa: E402

from mlx_open1b.train import Trainer  # noqa: E402

_WORKER = """
import errno, json, sys
from mlx_open1b.config import RunConfig
from mlx_open1b.distributed import worker_main
from mlx_open1b.distributed.trainer import DistributedTrainer
a = json.loads(sys.argv[1])
DistributedTrainer.PIECE_BYTES = a["piece"]
if a.get("fail_step") is not None:          # rank 0's disk fills up in the middle of that checkpoint
    from mlx_open1b import fsutil
    real, calls = fsutil.write_all, []

    def write_all(f, data):
        if f".ckpt-{a['fail_step']:08d}.tmp-" in str(getattr(f, "name", "")):
            calls.append(1)
            if len(calls) == 5:
                raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data)
    fsutil.write_all = write_all
cfg = RunConfig.from_json(a["cfg"]) if a.get("cfg") else None
worker_main(a["run"], cfg, a.get("corpus"), steps=a["steps"], resume=a.get("resume", False), timeout=30.0)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    f = tmp_path_factory.mktemp("ckpt_stream_worker") / "worker.py"
    f.write_text(_WORKER)
    return f


def _args(run, cfg=None, corpus=None, steps=4, resume=False, piece=1000, fail_step=None):
    return json.dumps({"run": str(run), "cfg": cfg.to_json() if cfg else None,
                       "corpus": str(corpus) if corpus else None, "steps": steps, "resume": resume,
                       "piece": piece, "fail_step": fail_step})


def test_small_pieces_same_run_directory_and_resume(tmp_path, corpus, script):
    """Pieces of 1000 bytes (250 moments: every owner sends hundreds, each Merkle chunk arrives cut):
    2 workers write the checkpoints of steps 0 and 2, 3 workers resume from step 2 (reading it in
    such pieces) and write step 3's; the run directory is one process's, byte for byte."""
    cfg = dist_cfg(checkpoint_every=2, eval_every=0)
    single = tmp_path / "single"
    Trainer(single, cfg, corpus).train(3)
    run = tmp_path / "run"
    r = torchrun(2, script, _args(run, cfg, corpus, steps=2))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-00000000", "ckpt-00000002"]
    r = torchrun(3, script, _args(run, resume=True, steps=3))
    assert r.returncode == 0, r.stderr[-3000:]
    assert ledger(run) == ledger(single)
    assert tree(run) == tree(single)


@pytest.mark.slow
def test_rank0_write_fails_mid_stream(tmp_path, corpus, script):
    """Rank 0's fifth write into the checkpoint of step 2 fails (ENOSPC) while the owners still
    stream: every worker stops with the error naming that checkpoint; the run keeps the checkpoint
    of step 0 and nothing half-written."""
    cfg = dist_cfg(checkpoint_every=2, eval_every=0)
    run = tmp_path / "run"
    r = torchrun(3, script, _args(run, cfg, corpus, steps=4, fail_step=2))
    assert r.returncode != 0
    for rank in range(3):
        assert (f"error: [rank {rank}/3] writing the checkpoint of step 2 failed: rank 0: cannot write checkpoint "
                f"{run}/ckpt-00000002 (state.safetensors: No space left on device, ENOSPC) (the checkpoint of step 0 "
                f"is intact)") in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in run.iterdir() if "ckpt" in p.name) == ["ckpt-00000000"]
    assert len(ledger(run).splitlines()) == 2


@pytest.mark.slow
def test_resume_from_a_corrupt_checkpoint_stops_before_any_step(tmp_path, corpus, script):
    """A bit flipped in the second moments of the newest checkpoint (step 2's; the ledger has 3
    records): the streamed resume at 2
    workers finds it as the pieces pass (after rank 1 has received its range) and every worker
    stops before any step, naming the tensor; the ledger is not cut back (nothing was resumed)."""
    cfg = dist_cfg(checkpoint_every=2, eval_every=0)
    run = tmp_path / "run"
    r = torchrun(2, script, _args(run, cfg, corpus, steps=3))
    assert r.returncode == 0, r.stderr[-3000:]
    before = ledger(run)
    assert len(before.splitlines()) == 3
    import shutil
    shutil.rmtree(run / "ckpt-00000003")   # the newest is step 2's: a resume would cut the ledger back to it
    sp = run / "ckpt-00000002" / "state.safetensors"
    data = bytearray(sp.read_bytes())
    base = 8 + int.from_bytes(data[:8], "little")
    P = (len(data) - base) // 10           # the file holds m, v, params: 4 + 4 + 2 bytes a parameter
    data[base + 4 * P + 2 * P] ^= 0x01     # in the middle of v
    sp.write_bytes(bytes(data))
    r = torchrun(2, script, _args(run, resume=True, steps=5))
    assert r.returncode != 0
    for rank in range(2):
        assert (f"error: [rank {rank}/2] reading the checkpoint of step 2 (before any training step) failed: rank 0: "
                f"{sp}: corrupt: tensor 'v' differs from the recorded hash") in r.stderr, r.stderr[-3000:]
    assert ledger(run) == before
