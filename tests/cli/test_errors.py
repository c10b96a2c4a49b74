"""One error base (mlx_open1b.errors.Open1bError) carrying the exit code, and one place in the
command line (mlx_open1b.cli.fail) that prints `error: ...` and exits with it."""
import pathlib
import re

import click
import pytest
from click.testing import CliRunner

from mlx_open1b.audit.run import AttestError
from mlx_open1b.backend import BackendUnavailable
from mlx_open1b.cli import fail
from mlx_open1b.config import ConfigError
from mlx_open1b.data.format import DataError
from mlx_open1b.distributed.collectives import DistError
from mlx_open1b.errors import Open1bError
from mlx_open1b.evaluate import EvalError
from mlx_open1b.export import ExportError
from mlx_open1b.golden import GoldenError
from mlx_open1b.report.data import ReportError
from mlx_open1b.rundir import RunDirError
from mlx_open1b.selftest import SelftestRefused
from mlx_open1b.step import TrainError

CLI = pathlib.Path(__file__).resolve().parents[2] / "cli"

# (class, its default exit code, the builtin base callers may still catch it by)
ERRORS = [(TrainError, 3, RuntimeError), (BackendUnavailable, 2, RuntimeError), (SelftestRefused, 3, RuntimeError),
          (GoldenError, 2, ValueError), (ConfigError, 2, ValueError), (DataError, 2, Exception),
          (AttestError, 2, Exception), (ExportError, 2, Exception), (EvalError, 2, Exception),
          (ReportError, 2, Exception), (RunDirError, 2, Exception), (DistError, 2, RuntimeError)]


@pytest.mark.parametrize("cls,code,base", ERRORS, ids=[e[0].__name__ for e in ERRORS])
def test_each_error_is_an_open1b_error_with_its_code(cls, code, base):
    e = cls("the message")
    assert isinstance(e, Open1bError) and isinstance(e, base)
    assert str(e) == "the message" and e.exit_code == code
    assert cls("m", exit_code=1).exit_code == 1 and cls("m").exit_code == code   # per raise, not per class


def _run(f):
    @click.command()
    def cmd():
        f()
    return CliRunner().invoke(cmd, [])


def test_fail_prints_the_message_and_exits_with_the_errors_code():
    r = _run(lambda: fail(AttestError("run/ledger.jsonl: broken", exit_code=1)))
    assert (r.exit_code, r.output) == (1, "error: run/ledger.jsonl: broken\n")
    r = _run(lambda: fail(TrainError("step 3: non-finite loss")))
    assert (r.exit_code, r.output) == (3, "error: step 3: non-finite loss\n")
    r = _run(lambda: fail("--steps: expected A-B"))
    assert (r.exit_code, r.output) == (2, "error: --steps: expected A-B\n")
    r = _run(lambda: fail(TrainError("x"), 1))
    assert r.exit_code == 1


def test_no_command_module_has_its_own_copy_of_fail():
    copies = []
    for f in sorted(CLI.glob("*.py")):
        if f.name == "__init__.py":
            continue
        src = f.read_text()
        copies += [f"{f.name}: {m.group(0)}" for m in
                   re.finditer(r"def _(fail|die)\(|[\"']error: ", src)]
    assert not copies, copies
