"""The `open1b` command line (click)."""
from __future__ import annotations

import functools
import sys

import click

BACKENDS = ("auto", "cpu_ref", "metal", "cuda")

SKIP_SELFTEST_HELP = ("skip the check of a real Metal or CUDA device against the golden known answers (it runs "
                      "before the first use of a device, driver and version, takes seconds, and is cached). Only "
                      "for backend developers debugging a kernel and for scripts that have just run `open1b "
                      "selftest` themselves: a device that fails it computes other bits than every other machine")


def backend_option(extra: tuple = (), help: str | None = None):
    """--backend (default auto: metal on Apple silicon, cuda on an NVIDIA GPU, else cpu_ref; every
    backend gives the same bits) and --skip-selftest. The command receives the resolved name, after
    the first-contact check (mlx_open1b.selftest.first_contact): a real device that fails it is
    replaced by cpu_ref under auto and stops the command (exit 3, nothing written) when named."""
    def deco(f):
        @functools.wraps(f)
        def run(*args, backend, skip_selftest, **kwargs):
            if backend not in extra:
                backend = _first_contact(backend, skip_selftest)
            return f(*args, backend=backend, **kwargs)
        run = click.option("--skip-selftest", is_flag=True, help=SKIP_SELFTEST_HELP)(run)
        return click.option("--backend", type=click.Choice(list(BACKENDS) + list(extra)), default="auto",
                            show_default=True,
                            help=help or "auto: metal on Apple silicon, cuda on an NVIDIA GPU, else cpu_ref "
                                         "(all bit-identical; metal and cuda run emulated where no GPU is "
                                         "present)")(run)
    return deco


def _first_contact(requested: str, skip: bool) -> str:
    from mlx_open1b.golden import GoldenError
    from mlx_open1b.selftest import SelftestRefused, first_contact
    try:
        return first_contact(requested, skip=skip, log=lambda m: click.echo(m, err=True))
    except SelftestRefused as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except GoldenError as e:
        click.echo(f"error: cannot check the device before using it: {e} (--skip-selftest uses it unchecked)",
                   err=True)
        sys.exit(e.exit_code)
