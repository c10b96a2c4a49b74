"""The one base of the errors a command reports: `error: <message>` on stderr and exit_code as the
process's exit status, no traceback (mlx_open1b.cli.fail). The codes mean the same in every command:
1 the run's own artifacts (ledger, checkpoint, files) are broken or disagree, 2 bad input (arguments,
files that are not what was asked for, a backend that cannot run here), 3 a device or a training
run failed while working. A subclass keeps its own default; a raise may name another."""
from __future__ import annotations


class Open1bError(Exception):
    """An error with the exit code the command line ends with."""

    exit_code: int = 2

    def __init__(self, msg: str = "", exit_code: int | None = None):
        super().__init__(msg)
        if exit_code is not None:
            self.exit_code = exit_code
