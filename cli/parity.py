"""`open1b parity run | export | compare | backends`: bit-for-bit parity of the backends."""
from __future__ import annotations

import sys

import click

from mlx_open1b.cli import INT64_MAX, SEED, STEPS, Path, Positive, fail
from mlx_open1b.data.format import DataError
from mlx_open1b.fsutil import WriteError, write_json_atomic
from mlx_open1b.step import TrainError

# What only a command runs is imported inside it: the parity harness; `open1b --help` and the other commands
# start without loading it.


def _split(s: str | None) -> list[str] | None:
    if s is None:
        return None
    items = [x.strip() for x in s.split(",") if x.strip()]
    return items


@click.group()
def parity() -> None:
    """Bit-for-bit parity of every contract op across backends and machines."""


@parity.command("backends")
def backends_cmd() -> None:
    """The backends this install knows, and whether each can run here."""
    from mlx_open1b.parity import status
    for name, ok, detail in status():
        click.echo(f"  {name:8s} {'available' if ok else 'unavailable':12s} {detail}")


@parity.command("run")
@click.option("--backends", "backends_opt", default=None, metavar="A,B,...",
              help="backends to compare; the first is the reference (default: every available one, cpu_ref first; "
                   "spec, the numpy implementation of the contract, when nothing else is available)")
@click.option("--ops", "ops_opt", default=None, metavar="X,Y,...", help="ops to run (default: all)")
@click.option("--cases", type=click.IntRange(1, INT64_MAX), default=20, show_default=True, help="cases per op")
@click.option("--seed", type=SEED, default=0, show_default=True, help="base seed of the cases")
@click.option("--json", "json_out", type=Path(dir_okay=False), default=None,
              help="also write the report as JSON to this file")
def run_cmd(backends_opt, ops_opt, cases, seed, json_out) -> None:
    """Run every op on seeded inputs (special values included) on each backend; compare bits.

    Prints a table per op (cases, mismatching cases, seconds per backend, first mismatch with
    its index and both values); exits 1 on any mismatch, 2 on bad arguments."""
    from mlx_open1b.parity import format_table, run
    loaded = _backends_or_fail(backends_opt)
    ops = _ops_or_fail(ops_opt)
    tty = sys.stderr.isatty()

    def progress(op, res):
        if tty:
            click.echo(f"\r{op}: {res.cases} cases, {res.mismatches} mismatching" + " " * 20, err=True, nl=False)
    report = run(loaded, ops, cases, seed, progress=progress)
    if tty:
        click.echo("\r" + " " * 70 + "\r", err=True, nl=False)
    click.echo(format_table(report))
    if json_out:
        try:
            write_json_atomic(json_out, report.to_json())
        except WriteError as e:
            fail(e.context(intact="the table printed above", then="run the same parity run with a --json that "
                                                                   "can be written"))
    sys.exit(0 if report.ok else 1)


@parity.command("fuzz")
@click.option("--seconds", type=Positive("number of seconds"), required=True, help="how long to draw cases")
@click.option("--backends", "backends_opt", default=None, metavar="A,B,...",
              help="backends to compare; the first is the reference (default: every available one, cpu_ref first; "
                   "spec when nothing else is available)")
@click.option("--ops", "ops_opt", default=None, metavar="X,Y,...", help="ops to draw (default: all, in turn)")
@click.option("--seed", type=SEED, default=None, help="base seed of the cases (default: a new one, printed)")
@click.option("--json", "json_out", type=Path(dir_okay=False), default=None, help="also write the report as JSON")
def fuzz_cmd(seconds, backends_opt, ops_opt, seed, json_out) -> None:
    """Draw parity cases for SECONDS (every op in turn: tile remainders, single rows, special values,
    random bit patterns), run them on every backend and compare bits; print cases per second and
    every mismatch with the command that reproduces it. Exit 1 on any mismatch."""
    import secrets

    from mlx_open1b.parity.fuzz import format_fuzz, fuzz
    loaded = _backends_or_fail(backends_opt)
    ops = _ops_or_fail(ops_opt)
    seed = secrets.randbits(63) if seed is None else seed
    click.echo(f"parity fuzz: seed {seed}, {seconds:g} s, backends {', '.join(n for n, _ in loaded)}", err=True)

    def progress(rep):
        click.echo(f"  {rep.seconds:.0f} s: {rep.cases} cases, "
                   f"{sum(r.mismatches for r in rep.ops.values())} mismatching", err=True)
    rep = fuzz(loaded, ops, seconds, seed, progress=progress, every=max(10.0, seconds / 20))
    click.echo(format_fuzz(rep))
    if json_out:
        from mlx_open1b.fsutil import WriteError, write_json_atomic
        try:
            write_json_atomic(json_out, rep.to_json())
        except WriteError as e:
            fail(e.context(intact="the report printed above", then="run the fuzz again with a --json that can be "
                                                                  "written"))
    sys.exit(0 if rep.ok else 1)


def _backends_or_fail(backends_opt) -> list:
    """(name, backend) of --backends (default: every available one, spec added when alone)."""
    from mlx_open1b.parity import BackendUnavailable, available, load
    names = _split(backends_opt)
    if names is None:
        names = available()
        if len(names) < 2:
            click.echo(f"note: only {', '.join(names) or 'no backend'} can run here; comparing with spec "
                       "(the numpy implementation of the contract)", err=True)
            names = names + ["spec"]
    if not names:
        fail("--backends: no backend given")
    if len(set(names)) != len(names):
        fail(f"--backends: a backend is named twice ({','.join(names)})")
    if len(names) < 2:
        fail(f"--backends: need at least two backends to compare, got {names[0]}")
    loaded = []
    for n in names:
        try:
            loaded.append((n, load(n)))
        except BackendUnavailable as e:
            fail(f"--backends: {e}")
    return loaded


def _ops_or_fail(ops_opt) -> list | None:
    from mlx_open1b.parity import OPS
    ops = _split(ops_opt)
    if ops is not None:
        unknown = [o for o in ops if o not in OPS]
        if unknown or not ops:
            fail(f"--ops: unknown op(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(OPS)}")
    return ops


@parity.command("export")
@click.argument("file", type=Path(dir_okay=False))
@click.option("--backend", default="cpu_ref", show_default=True, help="the backend whose results are exported")
@click.option("--cases", type=click.IntRange(0, INT64_MAX), default=8, show_default=True, help="cases per op")
@click.option("--steps", type=STEPS, default=3, show_default=True,
              help="steps of the tiny preset whose ledger goes into the bundle (0: none)")
@click.option("--seed", type=SEED, default=0, show_default=True, help="base seed of the cases")
@click.option("--ops", "ops_opt", default=None, metavar="X,Y,...", help="ops to export (default: all)")
@click.option("--data", "data_dir", type=Path(file_okay=False, exists=True), default=None,
              help="prepared default corpus to train on (default: prepared into a temporary directory)")
def export_cmd(file, backend, cases, steps, seed, ops_opt, data_dir) -> None:
    """Write a bundle to FILE: per op and case the seed and output hashes, and a short run's
    ledger, with machine and library information (for `open1b parity compare`)."""
    from mlx_open1b.parity import OPS, BackendUnavailable, export_bundle, load
    ops = _split(ops_opt)
    if ops is not None:
        unknown = [o for o in ops if o not in OPS]
        if unknown or not ops:
            fail(f"--ops: unknown op(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(OPS)}")
    try:
        load(backend)
    except BackendUnavailable as e:
        fail(f"--backend: {e}")
    try:
        b = export_bundle(file, backend=backend, cases=cases, steps=steps, seed=seed, ops=ops, data_dir=data_dir,
                          log=lambda m: click.echo(m, err=True) if sys.stderr.isatty() else None)
    except BackendUnavailable as e:
        fail(f"--backend: {e}")
    except WriteError as e:
        fail(e.context(intact=f"nothing under {file} (a bundle is written whole or not at all)",
                       then="run the same `open1b parity export` again"))
    except (TrainError, DataError) as e:
        fail(f"training run: {e}", e.exit_code)
    n = sum(len(v) for v in b["ops"].values())
    errs = sum(1 for v in b["ops"].values() for c in v if "error" in c)
    tr = b["training"]
    click.echo(f"wrote {file}: {backend}, contract v{b['contract_version']}, {len(b['ops'])} ops x {cases} cases "
               f"({n} cases{f', {errs} raised' if errs else ''})"
               + (f", ledger of {tr['steps']} steps (run hash {tr['run_hash']})" if tr else ", no ledger"))


@parity.command("compare")
@click.argument("a", type=Path(dir_okay=False, exists=True))
@click.argument("b", type=Path(dir_okay=False, exists=True))
def compare_cmd(a, b) -> None:
    """Compare two bundles case by case and ledger record by record.

    Exits 0 when identical, 1 on any difference, 2 when the bundles cannot be compared
    (unreadable, or made under different contract versions)."""
    from mlx_open1b.parity import BundleError, compare_bundles, format_comparison, load_bundle
    try:
        ba, bb = load_bundle(a), load_bundle(b)
    except BundleError as e:
        fail(e)
    r = compare_bundles(ba, bb)
    click.echo(format_comparison(r, ba, bb))
    if r.contract_mismatch:
        fail(f"contract versions differ: {a} is v{ba.get('contract_version')}, {b} is "
             f"v{bb.get('contract_version')}", r.exit_code)
    sys.exit(r.exit_code)
