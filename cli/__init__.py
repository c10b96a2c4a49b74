"""The `open1b` command line (click)."""
from __future__ import annotations

import click

BACKENDS = ("auto", "cpu_ref", "metal", "cuda")


def backend_option(extra: tuple = (), help: str | None = None):
    """--backend (default auto: metal on Apple silicon, cuda on an NVIDIA GPU, else cpu_ref; every
    backend gives the same bits). The command receives the resolved name."""
    def resolve(ctx, param, value):
        if value in extra:
            return value
        from mlx_open1b.train import resolve_backend
        return resolve_backend(value)
    return click.option("--backend", type=click.Choice(list(BACKENDS) + list(extra)), default="auto",
                        show_default=True, callback=resolve,
                        help=help or "auto: metal on Apple silicon, cuda on an NVIDIA GPU, else cpu_ref "
                                     "(all bit-identical; metal and cuda run emulated where no GPU is present)")
