"""A real full disk: `open1b train --resume` on a small tmpfs (mounted in a private mount namespace,
so nothing outside the test sees it) runs out of space writing a checkpoint. The command ends with
exit 3 and the message naming the checkpoint, what is intact and the command that continues; the
run's files on the full disk are intact (no partial checkpoint, no temporary leftovers, a ledger
that verifies); continued elsewhere, the run reaches the hash of a run that never failed."""
import pathlib
import shutil
import subprocess
import sys

import pytest

from mlx_open1b.rundir import RunDir
from mlx_open1b.train import Trainer

from runs import micro_cfg
from test_train import corpus  # noqa: F401 - corpus is a fixture

TESTS = pathlib.Path(__file__).resolve().parents[1]
CKPT_BYTES = 2_715_800 + 2 * 4096       # micro_cfg's state.safetensors and meta.json, in tmpfs pages (about)


def _can_mount(tmp_path) -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) to make a private mount namespace"
    probe = tmp_path / "probe"
    probe.mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k none {probe}"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"this container cannot mount a tmpfs ({r.stderr.strip()})"


def test_checkpoint_on_a_full_tmpfs(tmp_path, corpus):  # noqa: F811
    why = _can_mount(tmp_path)
    if why:
        pytest.skip(why)
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    run = disk / "run"
    size = 2 * CKPT_BYTES + (256 << 10)     # room for run.json, the ledger and checkpoints 0 and 2, not 4
    start = ("import sys; sys.path.insert(0, sys.argv[3]); from runs import micro_cfg; "
             "from mlx_open1b.train import Trainer; "
             "Trainer.new(sys.argv[1], micro_cfg(), sys.argv[2], log=lambda m: None).train(2)")
    script = (f"mount -t tmpfs -o size={size} none {disk} || exit 90\n"
              f"{sys.executable} -c '{start}' {run} {corpus} {TESTS} || exit 91\n"
              f"{sys.executable} -m mlx_open1b.cli.main train --resume --out {run} --steps 6 --backend cpu_ref "
              f"--skip-selftest\n"
              f"rc=$?\n"
              f"df -k {disk} | tail -1\n"
              f"cp -a {run} {copy}\n"
              f"exit $rc\n")
    r = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    err = r.stderr
    assert "Traceback" not in err
    assert f"cannot write checkpoint {run / 'ckpt-00000004'} (state.safetensors: No space left on device, ENOSPC)" \
        in err, err
    assert "intact: run.json, the ledger through step 3" in err and "checkpoints at steps 0, 2;" in err
    assert f"free space on the disk, then continue with `open1b train --resume --out {run}`" in err
    # what the full disk holds: the two checkpoints, the ledger through step 3, nothing half-written
    names = sorted(p.name for p in copy.iterdir())
    assert names == ["ckpt-00000000", "ckpt-00000002", "ledger.jsonl", "run.json", "timing.jsonl",
                     "writer.lock"], names
    rd = RunDir(copy)
    info = rd.info()
    assert [r["step"] for r in rd.records()] == [0, 1, 2, 3] and rd.verify_ledger(info.genesis)
    # continued (on a disk with space, as the message says): the bits of a run that never failed
    tr = Trainer.resume(copy, log=lambda m: None)
    assert tr.state.step == 2
    assert tr.train(6) == Trainer.new(tmp_path / "reference", micro_cfg(), corpus, log=lambda m: None).train(6)
