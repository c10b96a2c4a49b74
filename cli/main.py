"""`open1b`: the command-line tool. Later issues add train, data, audit, parity, report."""
from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys

import click

from mlx_open1b import __version__
from mlx_open1b.contract import CONTRACT_VERSION


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _backends() -> list[tuple[str, str, str]]:
    """(name, status, detail) for every backend this install knows."""
    rows = []
    try:
        from mlx_open1b import cpu_ref
        rows.append(("cpu_ref", "available", f"C reference, {cpu_ref.get_num_threads()} threads, "
                                             f"SIMD {cpu_ref.simd_name()}"))
    except ImportError as e:   # not built
        rows.append(("cpu_ref", "unavailable", str(e)))
    try:
        mx = importlib.import_module("mlx.core")
        metal = bool(getattr(mx, "metal", None) and mx.metal.is_available())
        detail = "Apple GPU via mx.fast.metal_kernel" if metal else "mlx installed, no Metal device"
        if metal:
            from mlx_open1b.metal import runtime as metal_runtime
            why = metal_runtime.mlx_problem(mx)          # too old an mlx: the reason, not "available"
            metal, detail = why is None, why or detail
    except ImportError:
        metal, detail = False, "mlx not installed (pip install 'mlx-open1b[metal]')"
    rows.append(("metal", "available" if metal else _emulated("metal"), detail))
    try:
        from mlx_open1b.cuda import runtime as cuda_runtime
        cuda, detail = cuda_runtime.cuda_status()        # a device that compiles and runs a kernel
        if not cuda and detail.startswith("cupy is not importable"):
            detail = "cupy not installed (pip install 'mlx-open1b[cuda]')"
    except Exception as e:  # noqa: BLE001
        cuda, detail = False, str(e).splitlines()[0]
    rows.append(("cuda", "available" if cuda else _emulated("cuda"), detail))
    return rows


def _emulated(name: str) -> str:
    """'emulated' where the backend's kernel sources run on its CPU emulator (for tests and parity
    checks, not speed), else 'unavailable'."""
    try:
        ok, _ = importlib.import_module(f"mlx_open1b.{name}.ops").available()
    except Exception:   # noqa: BLE001
        ok = False
    return "emulated" if ok else "unavailable"


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="open1b")
def cli() -> None:
    """Auditable, bitwise-reproducible training of decoder-only language models."""


@cli.command()
def info() -> None:
    """Backends, contract version, library versions and CPU features in use."""
    click.echo(f"open1b {__version__}  (arithmetic contract v{CONTRACT_VERSION})")
    click.echo(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    click.echo("backends:")
    for name, status, detail in _backends():
        click.echo(f"  {name:8s} {status:12s} {detail}")
    from mlx_open1b.train import resolve_backend
    auto = resolve_backend('auto')
    click.echo(f"  default (--backend auto): {auto}; 'emulated' backends run their kernel "
               "sources on the CPU (bit-identical, slow)")
    if auto == "cpu_ref":
        click.echo(f"  cuda not picked: {dict((r[0], r[2]) for r in _backends())['cuda']}")
    try:
        from mlx_open1b import cpu_ref
        if cpu_ref.contract_version() != CONTRACT_VERSION:
            click.echo(f"error: C reference implements contract v{cpu_ref.contract_version()}, "
                       f"the package v{CONTRACT_VERSION}; rebuild with `pip install -e .`", err=True)
            sys.exit(2)
        click.echo(f"cpu features: {_cpu_features()} (kernels use: {cpu_ref.simd_name()})")
    except ImportError:
        pass
    click.echo("libraries:")
    for dist in ("numpy", "click", "mlx", "cupy-cuda12x", "cupy-cuda13x", "torch", "pyarrow", "tokenizers"):
        click.echo(f"  {dist:14s} {_version(dist) or '-'}")


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

for _cmd in (report, export, eval_):
    cli.add_command(_cmd)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
