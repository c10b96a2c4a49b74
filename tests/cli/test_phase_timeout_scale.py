"""`open1b train --nproc N --phase-timeout-scale S`: the launcher passes S to every torchrun worker,
and each worker builds its phases' deadlines (PhaseTimeouts) with that scale and --dist-timeout."""
import subprocess

from click.testing import CliRunner

import mlx_open1b.distributed as distributed
from mlx_open1b.cli.main import cli

from data_helpers import make_corpus


class _Started(Exception):
    pass


def test_the_scale_reaches_every_worker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus"
    make_corpus(corpus, {"web": (1.0, 4, 20)})
    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kw: launched.append(cmd) or 0)
    out = str(tmp_path / "run")
    res = CliRunner().invoke(cli, ["train", "--nproc", "2", "--steps", "2", "--out", out, "--data", str(corpus),
                                   "--dist-timeout", "7", "--phase-timeout-scale", "2.5"])
    assert res.exit_code == 0, res.output
    (cmd,) = launched
    worker_args = cmd[cmd.index("mlx_open1b.cli.main") + 1:]
    got = []

    def run_worker(*a, phase_timeouts=None, **kw):
        got.append(phase_timeouts)
        raise _Started
    monkeypatch.setattr(distributed, "run_worker", run_worker)
    for rank in (0, 1):        # the command torchrun runs, as each worker
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        res = CliRunner().invoke(cli, worker_args, env=env)
        assert isinstance(res.exception, _Started), res.output
    assert [(p.scale, p.collective) for p in got] == [(2.5, 7.0)] * 2
