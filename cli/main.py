"""`open1b`: the command-line tool; each command group lives in its own module and is added here."""
from __future__ import annotations

import importlib.metadata
import platform

import click

from mlx_open1b import __version__, backend
from mlx_open1b.cli import fail
from mlx_open1b.contract import CONTRACT_VERSION
from mlx_open1b.errors import Open1bError


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_features() -> str:
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8", "asimd", "sve"]
    return " ".join(f for f in wanted if f in flags) or platform.machine()


class _Open1b(click.Group):
    """The command tree's root: an Open1bError that a command does not catch and explain itself
    (a write that failed somewhere below it: fsutil.WriteError) ends in fail too, with its message
    and exit code, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Open1bError as e:
            fail(e)


@click.group(cls=_Open1b, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="open1b")
def cli() -> None:
    """Auditable, bitwise-reproducible training of decoder-only language models."""


@cli.command()
def info() -> None:
    """Backends, contract version, library versions and CPU features in use."""
    click.echo(f"open1b {__version__}  (arithmetic contract v{CONTRACT_VERSION})")
    click.echo(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    click.echo("backends:")
    rows = backend.status()
    for name, status, detail in rows:
        click.echo(f"  {name:8s} {status:12s} {detail}")
    auto = backend.resolve("auto")
    click.echo(f"  default (--backend auto): {auto}; 'emulated' backends run their kernel "
               "sources on the CPU (bit-identical, slow)")
    if auto == "cpu_ref":
        click.echo(f"  cuda not picked: {dict((r[0], r[2]) for r in rows)['cuda']}")
    try:
        cpu_ref, broken = backend.load("cpu_ref"), None
    except backend.BackendUnavailable as e:
        cpu_ref, broken = None, e
    if cpu_ref is not None:
        click.echo(f"cpu features: {_cpu_features()} (kernels use: {cpu_ref.simd_name()})")
    click.echo("libraries:")
    for dist in ("numpy", "click", "mlx", "cupy-cuda12x", "cupy-cuda13x", "torch", "pyarrow", "tokenizers"):
        click.echo(f"  {dist:14s} {_version(dist) or '-'}")
    if broken is not None:          # the reference every other backend is held to: a broken install
        fail(broken)


from mlx_open1b.cli.data import data  # noqa: E402

cli.add_command(data)

from mlx_open1b.cli.train import hash_, train  # noqa: E402
from mlx_open1b.cli.audit import audit  # noqa: E402  (the group; `audit RUN --steps A-B` still works)

for _cmd in (train, audit, hash_):
    cli.add_command(_cmd)

from mlx_open1b.cli.parity import parity  # noqa: E402

cli.add_command(parity)

from mlx_open1b.cli.publish import eval_, export, report  # noqa: E402
from mlx_open1b.cli.gnmr import gnmr  # noqa: E402

cli.add_command(gnmr)

from mlx_open1b.cli.selftest import selftest  # noqa: E402

cli.add_command(selftest)

from mlx_open1b.cli.config_cmd import config  # noqa: E402

cli.add_command(config)

from mlx_open1b.cli.generate import generate  # noqa: E402

cli.add_command(generate)

for _cmd in (report, export, eval_):
    cli.add_command(_cmd)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
