"""`open1b gnmr experiment`: the seed's Table 1 at our scale (mlx_open1b/gnmr_experiment.py)."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import click

from mlx_open1b.cli import INT64_MAX, THREADS, Path, backend_option, fail

from mlx_open1b.cli.train import _default_corpus
from mlx_open1b.config import PRESETS, ConfigError, preset
from mlx_open1b.data.format import DataError, Manifest
from mlx_open1b.gnmr import GNMRConfig, GNMRError
from mlx_open1b.step import TrainError

# What only a command runs is imported inside it: the GNMR experiment and the C reference; `open1b --help` and
# the other commands start without loading it.


@click.group()
def gnmr():
    """The GNMR precision controller (CONTRACT.md §13)."""


@gnmr.command()
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option("--steps", type=click.IntRange(1, INT64_MAX), default=300, show_default=True,
              help="optimizer steps per arm")
@click.option("--out", type=Path(file_okay=False), default="runs/gnmr-experiment", show_default=True,
              help="one run directory per arm, summary.json and curves.svg (arms resume if present)")
@click.option("--data", "data_dir", type=Path(file_okay=False), default=None,
              help="prepared corpus (default: the embedded default corpus)")
@click.option("--gnmr", "gnmr_spec", default="", metavar="K=V,...",
              help="controller settings of the GNMR arm (as open1b train --gnmr; its high path is int8)")
@click.option("--low", type=click.Choice(["int4", "int6"]), default="int4", show_default=True,
              help="low-cost precision of the fixed-low arm and the GNMR arm (§6.9's simulated paths)")
@click.option("--arms", default=None,
              help="comma-separated arms to run [default: all: LOW,gnmr-LOW-int8,int8,bf16]")
@click.option("--eval-every", type=click.IntRange(0, INT64_MAX), default=None, help="held-out CE every N steps (default: the preset's)")
@click.option("--spike-skip", type=click.IntRange(0, INT64_MAX), default=None,
              help="updates skipped after a gradient-norm spike (default: the preset's, 5; 0 turns the spike "
                   "protocol off, so that low-precision arms are not frozen by repeated spikes)")
@backend_option()
@click.option("--threads", type=THREADS, default=0, help="kernel threads (0: one per CPU)")
def experiment(preset_name, steps, out, data_dir, gnmr_spec, low, arms, eval_every, spike_skip, backend, threads):
    """Fixed low (int4 or int6), GNMR low/int8, fixed int8 and bf16 on the same tokens: held-out CE
    per arm, the promotion ratio and the hit-maxO rate; writes OUT/summary.json and OUT/curves.svg."""
    from mlx_open1b import cpu_ref
    from mlx_open1b.gnmr_experiment import arms_for, run_experiment, table
    cpu_ref.set_num_threads(threads)
    all_arms = arms_for(low)
    chosen = list(all_arms) if arms is None else [a.strip() for a in arms.split(",") if a.strip()]
    bad = [a for a in chosen if a not in all_arms]
    if bad or not chosen:
        fail(f"--arms: unknown {', '.join(bad) or '(none given)'} (arms with --low {low}: "
             f"{', '.join(all_arms)})", 2)
    try:
        g = GNMRConfig.parse(gnmr_spec)
        base = preset(preset_name)
        if eval_every is not None:
            base = dataclasses.replace(base, train=dataclasses.replace(base.train, eval_every=eval_every))
        if spike_skip is not None:
            base = dataclasses.replace(base, train=dataclasses.replace(base.train, spike_skip=spike_skip))
        data = pathlib.Path(data_dir) if data_dir else _default_corpus()
        Manifest.load(data)                 # a prepared corpus, before any arm starts
        summary = run_experiment(out, base, data, steps, g, arms=chosen, backend=backend,
                                 log=lambda m: click.echo(m, err=True), low=low)
    except (GNMRError, ConfigError, DataError, ValueError) as e:
        fail(e, 2)
    except TrainError as e:
        fail(e)
    click.echo(table(summary))
    click.echo(f"wrote {pathlib.Path(out) / 'summary.json'} and {pathlib.Path(out) / 'curves.svg'}", err=True)
    sys.stdout.flush()
