"""Configuration as data: `open1b config show | check | keys`, `open1b train --config F --set k=v`.
A shown config reads back as the same RunConfig (the same JSON bytes, so the same genesis); every
bad value fails naming the key and its range, before anything is written; resume refuses a config
that would change the run."""
import dataclasses
import json

import pytest
from click.testing import CliRunner

from data_helpers import make_corpus
from mlx_open1b.cli.main import cli
from mlx_open1b.config import PRESETS, ModelConfig, TrainConfig
from mlx_open1b.config_file import RANGES, keys, resolve, to_toml


def _show(*args):
    res = CliRunner().invoke(cli, ["config", "show", *args])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_show_check_round_trip(tmp_path, name):
    f = tmp_path / "run.toml"
    f.write_text(_show("--preset", name))
    res = CliRunner().invoke(cli, ["config", "check", str(f)])
    assert res.exit_code == 0 and "ok" in res.output, res.output
    back = resolve(None, f)
    # the same config, and the same JSON bytes: a preset's run.json and genesis are unchanged
    assert back == PRESETS[name] and back.dumps() == PRESETS[name].dumps()


def test_overrides_round_trip(tmp_path):
    sets = ["--set", "model.d_model=64", "--set", "train.peak_lr=1e-3", "--set", "train.phases=[[0, 1], [5000, 3]]",
            "--set", "precision=int8", "--set", "gnmr.alpha=4", "--set", "model.rope_theta=10000"]
    f = tmp_path / "run.toml"
    f.write_text(_show(*sets))
    cfg = resolve(None, f)
    assert (cfg.model.d_model, cfg.train.peak_lr, cfg.train.phases, cfg.precision) == (64, 1e-3, ((0, 1), (5000, 3)), "int8")
    assert cfg.gnmr.alpha == 4.0 and isinstance(cfg.gnmr.alpha, float) and isinstance(cfg.model.rope_theta, float)
    assert _show("--config", str(f)) == f.read_text()
    # a --set after the file wins; the file's own preset is the base
    g = tmp_path / "part.toml"
    g.write_text('preset = "small"\n[train]\nseed = 3\n')
    cfg = resolve(None, g, ["train.seed=5"])
    assert cfg.train.seed == 5 and cfg.model == PRESETS["small"].model


def test_every_key_has_type_help_and_range():
    ks = {k.name: k for k in keys()}
    for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
        for f in dataclasses.fields(cls):
            k = ks[f"{section}.{f.name}"]
            assert k.help
            if k.type in ("int", "float"):
                assert k.name in RANGES, k.name
    res = CliRunner().invoke(cli, ["config", "keys"])
    assert res.exit_code == 0 and "train.peak_lr (float; (0.0, inf))" in res.output


@pytest.mark.parametrize("text,key,allowed", [
    ("model.d_model=0", "model.d_model", "[1, 2147483647]"),
    ("train.beta2=1.0", "train.beta2", "[0.0, 1.0)"),
    ("train.peak_lr=nan", "train.peak_lr", "(0.0, inf)"),
    ("train.final_lr_frac=1.5", "train.final_lr_frac", "[0.0, 1.0]"),
    ("train.seed=-1", "train.seed", "[0, 18446744073709551615]"),
    ("train.checkpoint_every=2.5", "train.checkpoint_every", "an integer"),
    ("precision=int9", "precision", "one of bf16, int8, int6, int4"),
    ("train.phases=[[1, 2]]", "train.phases", "start at 0"),
    ("model.window=4096", "model.window", "model.seq_len"),
    ("model.nope=1", "model.nope", "keys of [model]"),
])
def test_bad_values_write_nothing(tmp_path, monkeypatch, text, key, allowed):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["train", "--set", text, "--out", str(tmp_path / "run"), "--steps", "1",
                                   "--skip-selftest"])
    assert res.exit_code == 2 and key in res.output and allowed in res.output, res.output
    assert "Traceback" not in res.output and list(tmp_path.iterdir()) == []    # no run, no default corpus
    f = tmp_path / "bad.toml"
    section, _, sub = text.partition("=")[0].rpartition(".")
    f.write_text((f"[{section}]\n" if section else "") + f"{sub} = {text.partition('=')[2]}\n"
                 if key != "precision" else 'precision = "int9"\n')
    res = CliRunner().invoke(cli, ["config", "check", str(f)])
    assert res.exit_code == 2 and key in res.output and allowed in res.output, res.output


def test_bad_files(tmp_path):
    r = CliRunner()
    f = tmp_path / "x.toml"
    f.write_text("[model\nd_model = 3\n")
    res = r.invoke(cli, ["config", "check", str(f)])
    assert res.exit_code == 2 and "not a valid TOML file" in res.output and str(f) in res.output
    f.write_text('preset = "small"\n')
    res = r.invoke(cli, ["config", "show", "--preset", "tiny", "--config", str(f)])
    assert res.exit_code == 2 and "preset" in res.output
    f.write_text("[extra]\nx = 1\n")
    res = r.invoke(cli, ["config", "check", str(f)])
    assert res.exit_code == 2 and "'extra'" in res.output


def test_train_records_resolved_config_and_resume_refuses_change(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    make_corpus(data, {"a": (1.0, 20, 40)})
    micro = ('preset = "tiny"\n[model]\nvocab_size = 4000\nd_model = 32\nn_layers = 2\nn_heads = 4\n'
             'n_kv_heads = 2\nhead_dim = 8\nffn_hidden = 48\nseq_len = 16\nwindow = 8\nglobal_every = 2\n'
             '[train]\nseed = 7\nmicrobatch_seqs = 2\nphases = [[0, 1]]\ntotal_tokens = 4000\n'
             'warmup_tokens = 64\ncheckpoint_every = 1\neval_every = 0\n')
    f = tmp_path / "micro.toml"
    f.write_text(micro)
    out = tmp_path / "run"
    r = CliRunner()
    base = ["train", "--out", str(out), "--backend", "cpu_ref", "--skip-selftest", "--threads", "1"]
    res = r.invoke(cli, base + ["--config", str(f), "--set", "train.peak_lr=0.002", "--data", str(data),
                                "--steps", "1"])
    assert res.exit_code == 0, res.output
    want = resolve(None, f, ["train.peak_lr=0.002"])
    assert json.loads((out / "run.json").read_text())["config"] == json.loads(want.dumps())
    res = r.invoke(cli, base + ["--resume", "--set", "train.peak_lr=0.003", "--steps", "2"])
    assert res.exit_code == 2 and "train.peak_lr" in res.output and "0.002" in res.output, res.output
    res = r.invoke(cli, base + ["--resume", "--config", str(f), "--steps", "2"])     # the file alone: peak_lr differs
    assert res.exit_code == 2 and "train.peak_lr" in res.output, res.output
    assert len((out / "ledger.jsonl").read_text().splitlines()) == 1
    res = r.invoke(cli, base + ["--resume", "--config", str(f), "--set", "train.peak_lr=2e-3", "--steps", "2"])
    assert res.exit_code == 0, res.output
    res = r.invoke(cli, base + ["--resume", "--steps", "3"])
    assert res.exit_code == 0, res.output
    # a run's own config as a file: the same config; under a name of one's own it needs every key
    shown = r.invoke(cli, ["config", "show", "--run", str(out)])
    assert shown.exit_code == 0, shown.output
    g = tmp_path / "again.toml"
    g.write_text(shown.output)
    assert resolve(None, g) == want and resolve(None, g).dumps() == want.dumps()
    g.write_text(shown.output.replace('preset = "tiny"', 'preset = "mine"'))
    assert resolve(None, g) == dataclasses.replace(want, preset="mine")
    g.write_text('preset = "mine"\n[model]\nd_model = 64\n')
    res = r.invoke(cli, ["config", "check", str(g)])
    assert res.exit_code == 2 and "'mine' is none of the presets" in res.output and "model.vocab_size" in res.output
    res = r.invoke(cli, ["config", "show", "--run", str(tmp_path)])
    assert res.exit_code == 2 and "not a run directory" in res.output, res.output


def test_preset_as_a_file_is_the_same_run(tmp_path, monkeypatch, default_corpus):
    """`train --config` of the tiny preset's shown config writes the run.json bytes (config, genesis) and run hash of
    `train --preset tiny`: a preset's genesis (and the README's run hash) does not change."""
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "tiny.toml"
    f.write_text(_show("--preset", "tiny"))
    r = CliRunner()
    common = ["--steps", "0", "--data", str(default_corpus), "--backend", "cpu_ref", "--skip-selftest"]
    a = r.invoke(cli, ["train", "--out", str(tmp_path / "a"), *common])
    b = r.invoke(cli, ["train", "--out", str(tmp_path / "b"), "--config", str(f), *common])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert (tmp_path / "a" / "run.json").read_bytes() == (tmp_path / "b" / "run.json").read_bytes()
    assert a.stdout.splitlines()[-1] == b.stdout.splitlines()[-1] and "run hash" in a.stdout
