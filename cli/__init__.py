"""The `open1b` command line (click)."""
from __future__ import annotations

import functools
import math
import os
import sys
from typing import NoReturn

import click

# What only a command runs is imported inside it: the device self-test (selftest and golden load the parity
# harness and the trainer) and the distributed package; `open1b --help` and the other commands start without
# loading it.

BACKENDS = ("auto", "cpu_ref", "metal", "cuda")

# the value types of options that several commands share: a bad value is refused while the command
# line is parsed (exit 2, naming the option), before any work
INT64_MAX = 2 ** 63 - 1                 # steps and counts are written into ledgers and JSON as int64
STEPS = click.IntRange(0, INT64_MAX)
STEP = click.IntRange(0, INT64_MAX)
SEED = click.IntRange(0, 2 ** 64 - 1)   # a u64, as TrainConfig.check requires
MAX_THREADS = 4096
THREADS = click.IntRange(0, MAX_THREADS)
WORKERS = click.IntRange(1, MAX_THREADS)  # processes on one machine


class Positive(click.FloatRange):
    """A finite number > 0, or >= 0 with zero=True (FloatRange lets nan and inf through)."""

    def __init__(self, name: str = "number", zero: bool = False):
        super().__init__(min=0, min_open=not zero)
        self.name = name

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite {self.name}", param, ctx)
        return rv


class Path(click.Path):
    """click.Path that also refuses an empty string (which would name the current directory)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path", param, ctx)
        return super().convert(value, param, ctx)


def step_range(text: str, option: str, sep: str = "-") -> tuple[int, int]:
    """(A, B) of "A{sep}B" or "A" (steps A..B, 0 <= A <= B); click.BadParameter naming the option
    otherwise. That B is a step of the run is for the command to check."""
    a, mid, b = text.strip().partition(sep)
    try:
        first, last = int(a), int(b if mid else a)
    except ValueError:
        raise click.BadParameter(f"expected A{sep}B or A (steps, integers), got {text!r}",
                                 param_hint=option) from None
    if first < 0:
        raise click.BadParameter(f"steps are >= 0, got {text!r}", param_hint=option)
    if first > last:
        raise click.BadParameter(f"{text!r} is a reversed range: the first step comes first ({last}{sep}{first})",
                                 param_hint=option)
    if last > INT64_MAX:
        raise click.BadParameter(f"{text!r}: step {last} is beyond any run", param_hint=option)
    return first, last


def fail(error, code: int | None = None, *, at_once: bool = False) -> NoReturn:
    """Stop the command: `error: <error>` on stderr, then exit with `code`, by default the error's
    own exit_code (an Open1bError's; 2, bad input, for a message or any other exception). Every
    command ends a failure here, so the form of the message and the codes are the same everywhere.
    at_once: leave through os._exit after flushing, for a distributed worker whose process group may
    be broken (a normal exit could wait on it forever)."""
    click.echo(f"error: {error}", err=True)
    code = getattr(error, "exit_code", 2) if code is None else code
    if at_once:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


SKIP_SELFTEST_HELP = ("skip the check of a real Metal or CUDA device against the golden known answers (it runs "
                      "before the first use of a device, driver and version, takes seconds, and is cached). Only "
                      "for backend developers debugging a kernel and for scripts that have just run `open1b "
                      "selftest` themselves: a device that fails it computes other bits than every other machine")


def backend_option(extra: tuple = (), help: str | None = None, workers: bool = False):
    """--backend (default auto: metal on Apple silicon, cuda on an NVIDIA GPU, else cpu_ref; every
    backend gives the same bits) and --skip-selftest. The command receives the resolved name, after
    the first-contact check (mlx_open1b.selftest.first_contact): a real device that fails it is
    replaced by cpu_ref under auto and stops the command (exit 3, nothing written) when named.

    workers: the command also runs distributed (train): with --nproc N the check covers every
    local device the N workers will use, before any is started; in a torchrun worker it covers the
    worker's own device (LOCAL_RANK), and a failure does not stop that worker alone: the command
    receives it as selftest_refusal (None when it passed) and every worker stops at the start-up
    agreement, so none waits for a worker that is gone."""
    def deco(f):
        @functools.wraps(f)
        def run(*args, backend, skip_selftest, **kwargs):
            refusal = None
            if backend not in extra:
                if workers:
                    backend, refusal = _first_contact_workers(backend, skip_selftest, kwargs.get("nproc"))
                else:
                    backend = _first_contact(backend, skip_selftest)
            if workers:
                kwargs["selftest_refusal"] = refusal
            return f(*args, backend=backend, **kwargs)
        run = click.option("--skip-selftest", is_flag=True, help=SKIP_SELFTEST_HELP)(run)
        return click.option("--backend", type=click.Choice(list(BACKENDS) + list(extra)), default="auto",
                            show_default=True,
                            help=help or "auto: metal on Apple silicon, cuda on an NVIDIA GPU, else cpu_ref "
                                         "(all bit-identical; metal and cuda run emulated where no GPU is "
                                         "present)")(run)
    return deco


def _first_contact_workers(requested: str, skip: bool, nproc) -> tuple[str, str | None]:
    """(backend, refusal) for a command that may run distributed (backend_option(workers=True))."""
    from mlx_open1b.distributed import in_worker_env
    from mlx_open1b.selftest import SelftestRefused, local_devices, resolve
    if not in_worker_env():
        devices = local_devices(resolve(requested), nproc=nproc) if nproc is not None else None
        return _first_contact(requested, skip, devices), None
    name = resolve(requested)
    try:
        local_rank = int(os.environ.get("LOCAL_RANK") or os.environ.get("RANK") or 0)
    except ValueError:
        local_rank = 0                   # the rendezvous reports the malformed environment
    try:
        return _first_contact(name, skip, local_devices(name, local_rank=local_rank), raise_refusal=True), None
    except SelftestRefused as e:
        why = str(e)
        if requested == "auto":
            why += (" (--backend auto: one torchrun worker cannot fall back to cpu_ref alone, so every worker "
                    "stops; `open1b train --nproc N` checks every device first and falls back for all)")
        return name, why


def _first_contact(requested: str, skip: bool, devices=None, raise_refusal: bool = False) -> str:
    from mlx_open1b.golden import GoldenError
    from mlx_open1b.selftest import SelftestRefused, first_contact
    try:
        return first_contact(requested, skip=skip, log=lambda m: click.echo(m, err=True), devices=devices)
    except SelftestRefused as e:
        if raise_refusal:
            raise
        fail(e)
    except GoldenError as e:
        fail(f"cannot check the device before using it: {e} (--skip-selftest uses it unchecked)", e.exit_code)
