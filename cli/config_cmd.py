"""`open1b config show | check | keys`: a run's configuration as a TOML file (mlx_open1b.config_file)."""
from __future__ import annotations

import click

from mlx_open1b.cli import Path, fail
from mlx_open1b.config import PRESETS, ConfigError

SET_HELP = ("override one key, section.key=value (repeatable, applied after the file in the order given), "
            "e.g. --set model.d_model=256 --set train.peak_lr=1e-3 --set precision=int8; `open1b config keys` "
            "lists every key with its type, range and help")


TOKENIZER_VOCAB_HELP = ("model.vocab_size: this tokenizer's vocabulary, unless the --config file or a --set gives it "
                       "(then the two must agree)")


def vocab_of_tokenizer(tokenizer_path, config_file=None, sets=()) -> tuple:
    """The --sets with `model.vocab_size=<the tokenizer's>` added where neither the file nor a --set
    gives the key; one given that differs is a ConfigError naming both values (exit 2)."""
    from mlx_open1b.config_file import given
    from mlx_open1b.data.tokenizer import Tokenizer
    tok = Tokenizer.load(tokenizer_path)
    have = given("model.vocab_size", config_file, sets)
    if have is None:
        return tuple(sets) + (f"model.vocab_size={tok.vocab_size}",)
    value, where = have
    if value != tok.vocab_size:
        raise ConfigError(f"model.vocab_size: {where} gives {value}, but the tokenizer {tokenizer_path} has "
                          f"{tok.vocab_size} tokens; give {tok.vocab_size}, or leave the key out to take the "
                          f"tokenizer's")
    return tuple(sets)


def config_options(f):
    """--config FILE and repeatable --set, shared by `open1b train` and `open1b config show`."""
    f = click.option("--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE", help=SET_HELP)(f)
    return click.option("--config", "config_file", type=Path(exists=True, dir_okay=False), default=None,
                        help="run configuration (TOML; `open1b config show` writes a complete one to start "
                             "from): its `preset` key (or --preset) is the base, its values and then each "
                             "--set override it")(f)


@click.group()
def config() -> None:
    """Run configurations as TOML: show a resolved one, check a file, list the keys."""


@config.command()
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default=None,
              help="the preset to start from (default: the file's preset key, else tiny)")
@click.option("--run", "run_dir", type=Path(exists=True, file_okay=False), default=None,
              help="start from this run's own configuration (its run.json) instead of a preset")
@click.option("--tokenizer", "tokenizer_path", type=Path(exists=True, dir_okay=False), default=None,
              help=TOKENIZER_VOCAB_HELP)
@config_options
def show(preset_name, run_dir, tokenizer_path, config_file, sets):
    """Print the complete resolved configuration as TOML (`> run.toml` to start a config file)."""
    from mlx_open1b.config_file import resolve, to_toml
    from mlx_open1b.data.format import DataError
    from mlx_open1b.rundir import RunDir, RunDirError
    if run_dir is not None and (preset_name is not None or config_file is not None):
        fail("--run: a run's configuration is the base; --preset and --config name another one", 2)
    try:
        if tokenizer_path is not None:
            sets = vocab_of_tokenizer(tokenizer_path, config_file, sets)
        base = RunDir(run_dir).info().config if run_dir is not None else None
        cfg = resolve(preset_name, config_file, sets, base=base)
    except (ConfigError, RunDirError, DataError) as e:
        fail(e)
    click.echo(to_toml(cfg), nl=False)


@config.command()
@click.argument("file", type=Path(exists=True, dir_okay=False))
def check(file):
    """Validate a config FILE: every key known, every value in its range (exit 2 naming the key)."""
    from mlx_open1b.config_file import resolve
    try:
        cfg = resolve(None, file)
    except ConfigError as e:
        fail(e, 2)
    click.echo(f"{file}: ok (preset {cfg.preset}, {cfg.precision}, {cfg.model.n_params():,} parameters)")


@config.command()
def keys():
    """Every key of a config file and of --set: its type, allowed range and help."""
    from mlx_open1b.config_file import keys as all_keys
    for k in all_keys():
        click.echo(k.describe())
