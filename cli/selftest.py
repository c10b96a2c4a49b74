"""`open1b selftest`: prove backends bit-exact against the shipped golden known answers, offline."""
from __future__ import annotations

import os
import pathlib
import sys
import time

import click

from mlx_open1b.cli import Path, fail
from mlx_open1b.data.format import DataError
from mlx_open1b.fsutil import write_bytes_atomic

# What only a command runs is imported inside it: the self-test, the golden set and the parity harness;
# `open1b --help` and the other commands start without loading it.

CHOICES = ("auto", "cpu_ref", "metal", "cuda", "all")


def _backends(choice: str) -> list[str]:
    """auto: the backend --backend auto trains on (a real device, else cpu_ref); a name: that backend,
    emulated where it has no device; all: every backend, emulated ones included."""
    from mlx_open1b.selftest import ALL, resolve
    if choice == "all":
        return list(ALL)
    return [resolve(choice)]


def _check_writable(path: str, option: str) -> None:
    """Exit 2 now, not after the checking, when `path` cannot be written (atomically: a temporary
    file beside it, renamed; missing folders are created)."""
    p = pathlib.Path(path)
    if p.is_dir():
        fail(f"{option} {path}: is a directory")
    folder = p.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        fail(f"{option} {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        fail(f"{option} {path}: the folder {folder} is not writable")


def _check_corpus(data_dir: str, genesis: str | None) -> None:
    """Exit 2 unless --data is a prepared corpus (with genesis: the golden run's corpus)."""
    from mlx_open1b import golden as G
    try:
        G.check_corpus(data_dir, genesis)
    except DataError as e:
        fail(f"--data {data_dir}: {e}")


def _bundle_path(path: str, backend: str, several: bool) -> str:
    if not several:
        return path
    p = pathlib.Path(path)
    return str(p.with_name(f"{p.stem}.{backend}{p.suffix or '.json'}"))


@click.command()
@click.option("--backend", type=click.Choice(CHOICES), default="auto", show_default=True,
              help="auto: the backend training would use here (a real Metal or CUDA device, else cpu_ref); "
                   "cpu_ref, metal, cuda: that backend (metal and cuda run on their CPU emulators where no "
                   "device is present); all: every backend")
@click.option("--full", is_flag=True,
              help="every golden case, and the first training steps of the tiny preset compared record by record "
                   "(minutes; the default quick set takes seconds on a GPU)")
@click.option("--bundle", "bundle_path", type=Path(dir_okay=False), default=None,
              help="also write what each backend computed as a parity bundle (for `open1b parity compare`); with "
                   "several backends FILE.<backend>.json")
@click.option("--data", "data_dir", type=Path(file_okay=False, exists=True), default=None,
              help="with --full: the prepared default corpus to train on (default: prepared in a temporary "
                   "directory, ~10 s)")
@click.option("--golden", "golden_path", type=Path(dir_okay=False), default=None,
              help="the golden file to check against (default: the one shipped in the package)")
@click.option("--regenerate", is_flag=True,
              help="instead of checking: recompute the golden file on cpu_ref and write it (to --out)")
@click.option("--out", type=Path(dir_okay=False), default=None,
              help="with --regenerate: where to write (default: the package's golden file)")
def selftest(backend, full, bundle_path, data_dir, golden_path, regenerate, out):
    """Check backends against the golden known answers shipped with the package.

    Prints one line per op (equal, the first differing element with both values in hex, or why it
    did not run), where each backend ran (hardware or emulated) and how long it took. Exits 0 when
    everything that ran is equal, 1 on any difference, 2 on bad usage or a missing or broken
    golden file."""
    from mlx_open1b import golden as G
    from mlx_open1b import selftest as S
    tty = sys.stderr.isatty()
    if regenerate:
        if bundle_path or full or golden_path or backend != "auto":
            fail("--regenerate takes only --out (and --data)")
        path = out if out is not None else str(G.FILE)
        _check_writable(path, "--out")
        if data_dir:
            _check_corpus(data_dir, None)
        data = G.dumps(G.compute(data_dir, log=lambda m: click.echo(m, err=True)))
        try:
            write_bytes_atomic(path, data)
        except OSError as e:
            fail(f"--out {path}: cannot write it ({e.strerror or e})")
        click.echo(f"wrote {path}")
        return
    if out:
        fail("--out is for --regenerate (the golden file to write); --bundle writes a parity bundle")
    if data_dir and not full:
        fail("--data is for --full (the training steps)")
    try:
        golden = G.load(golden_path)
    except G.GoldenError as e:
        fail(e)
    if data_dir:
        _check_corpus(data_dir, golden.training["genesis"])
    names = _backends(backend)
    if bundle_path:
        for name in names:
            _check_writable(_bundle_path(bundle_path, name, len(names) > 1), "--bundle")
    if backend not in ("auto", "all"):
        from mlx_open1b.parity.backends import BackendUnavailable, load
        try:
            load(names[0])
        except BackendUnavailable as e:
            fail(f"--backend {backend}: {e}")

    last = [time.monotonic()]

    def progress(msg: str) -> None:
        now = time.monotonic()
        if tty:
            click.echo("\r" + msg[:100].ljust(100), err=True, nl=False)
        elif "training step" in msg or now - last[0] > 30:       # long work: a line now and then
            click.echo(msg, err=True)
            last[0] = now

    cases = S._Cases(golden, full)
    cases.prepare(progress)
    reports = []
    try:
        for name in names:
            if not tty:
                click.echo(f"selftest: {name} ...", err=True)
            reports.append(S.run_backend(name, golden, full, cases=cases, data_dir=data_dir, progress=progress))
    except G.GoldenError as e:          # the file is at fault, not a backend: no verdict
        if tty:
            click.echo("", err=True)
        fail(e)
    except DataError as e:              # the corpus, not a backend
        if tty:
            click.echo("", err=True)
        fail(f"--data {data_dir}: {e}" if data_dir else f"the default corpus: {e}")
    if tty:
        click.echo("\r" + " " * 100 + "\r", err=True, nl=False)
    click.echo(S.format_report(reports, golden, full))
    if bundle_path:
        ran = [r for r in reports if not r.not_run]
        for r in ran:
            p = _bundle_path(bundle_path, r.backend, len(ran) > 1)
            try:
                S.write_bundle(p, r, golden)
            except OSError as e:
                fail(f"--bundle {p}: cannot write it ({e.strerror or e})")
            click.echo(f"bundle {p} ({r.backend})", err=True)
    sys.exit(0 if all(r.ok for r in reports if not r.not_run) else 1)
