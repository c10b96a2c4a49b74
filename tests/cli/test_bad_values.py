"""Every command, every bad value: generated from the click command tree (mlx_open1b.cli.main.cli).
Each option gets a value of the wrong type, an empty one, a negative and an out-of-range one (where
its type has a range), each path a missing file, a directory where a file goes (or a file where a
directory goes) and a file of garbage; each free-text option the bad values listed for it below.
The command must stop with exit code 2 (bad input) and a message naming the option (or the bad
path), no traceback, and before any work: the functions that start work (training, preparing a
corpus, running ops, the self-test, a launcher) are replaced by a trap that fails the test."""
import dataclasses
import os
import pathlib
import subprocess

import click
import pytest
from click.testing import CliRunner

from mlx_open1b.cli.main import cli
from mlx_open1b.data.format import Manifest
from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import micro_cfg


class _Reached(BaseException):
    """A command started work with a value it should have refused (a BaseException: no command's
    `except Exception` hides it)."""


def _commands(group, path=()):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, path + (name,))
        else:
            yield " ".join(path + (name,)), cmd


COMMANDS = dict(_commands(cli))

# the arguments with which each command gets as far as its work (checked by test_the_baselines_are_good)
BASE = {
    "info": ([], {}),
    "data prepare": ([], {"--source": ["web={texts}/*.txt"], "--heldout-tokens": "0", "--out": "{tmp}/prepared"}),
    "data verify": (["{corpus}"], {}),
    "data tokenizer train": ([], {"--source": ["web={texts}/*.txt"], "--vocab": "300", "--out": "{tmp}/tok-new.json"}),
    "data inspect": (["{corpus}"], {"--window": "0", "--seq-len": "8"}),
    "train": ([], {"--out": "{tmp}/new", "--data": "{micro}", "--backend": "cpu_ref", "--skip-selftest": None}),
    "audit replay": (["{run}"], {"--steps": "0-1", "--backend": "cpu_ref", "--skip-selftest": None,
                                 "--out": "{tmp}/att.json"}),
    "audit plan": (["{run}"], {"--auditors": "1", "--out": "{tmp}/plan.json"}),
    "audit run": (["{run}"], {"--range": "0:1", "--backend": "cpu_ref", "--skip-selftest": None,
                              "--out": "{tmp}/att2.json"}),
    "audit report": (["{run}", "{attestation}"], {}),
    "audit keygen": (["{tmp}/new-key.pem"], {}),
    "hash": (["{run}"], {}),
    "parity backends": ([], {}),
    "parity run": ([], {"--backends": "cpu_ref,spec", "--ops": "rmsnorm_forward", "--cases": "1"}),
    "parity fuzz": ([], {"--seconds": "1", "--backends": "cpu_ref,spec", "--ops": "rmsnorm_forward",
                         "--json": "{tmp}/fuzz.json"}),
    "parity export": (["{tmp}/bundle-new.json"], {"--cases": "1", "--steps": "0", "--ops": "rmsnorm_forward"}),
    "parity compare": (["{bundle}", "{bundle}"], {}),
    "gnmr experiment": ([], {"--out": "{tmp}/gnmr", "--data": "{micro}", "--backend": "cpu_ref",
                             "--skip-selftest": None}),
    "selftest": ([], {"--backend": "cpu_ref"}),
    "report": (["{run}"], {"--out": "{tmp}/report", "--no-png": None}),
    "export": (["{run}"], {"--out": "{tmp}/exported"}),
    "eval": (["{run}"], {"--backend": "cpu_ref", "--skip-selftest": None, "--tasks": "arith", "--limit": "1"}),
    "config show": ([], {}),
    "config check": (["{config}"], {}),
    "config keys": ([], {}),
    "generate": (["{run}"], {"--prompt": "the", "--max-tokens": "1", "--backend": "cpu_ref", "--skip-selftest": None}),
}

# free-text options: the values each must refuse (a bad value for it is wrong in its own way)
BAD_TEXT = {
    ("data prepare", "--source"): ["", "web", "=x/*.txt", "web=", "web={tmp}/nothing-here/*.txt", "b@d=*.txt"],
    ("data inspect", "--source"): ["", "nosuch"],          # with --doc 0 instead of --window
    ("data tokenizer train", "--source"): ["", "web", "=x/*.txt", "web=", "web={tmp}/nothing-here/*.txt", "b@d=*.txt"],
    ("train", "--gnmr"): ["alpha=x", "nosuch=1", "alpha"],
    ("audit replay", "--steps"): ["", "x", "-5", "5-2", "0-1-2", "0-99", str(2 ** 64)],
    ("audit run", "--range"): ["", "x", "-5", "5:2", "0:99", str(2 ** 64)],
    ("audit report", "--trust"): ["", "zz", "00"],
    ("parity run", "--backends"): ["", ",", "nosuch"],
    ("parity run", "--ops"): ["", ",", "nosuch"],
    ("parity fuzz", "--backends"): ["", ",", "nosuch", "cpu_ref"],
    ("parity fuzz", "--ops"): ["", ",", "nosuch"],
    ("parity export", "--backend"): ["", "nosuch"],
    ("parity export", "--ops"): ["", ",", "nosuch"],
    ("gnmr experiment", "--gnmr"): ["alpha=x", "nosuch=1"],
    ("gnmr experiment", "--arms"): ["", ",", "nosuch"],
    ("eval", "--tasks"): ["", ",", "nosuch"],
    ("config show", "--set"): ["", "x", "nosuch.key=1", "model.d_model=abc", "model.d_model=-1"],
    ("train", "--set"): ["", "x", "nosuch.key=1", "model.d_model=abc", "model.d_model=-1"],
    ("generate", "--prompt-ids"): ["", "x", "-1", "1,,2", str(2 ** 64)],
}
# free-text options any text is good for, and why
ANY_TEXT = {
    ("data prepare", "--text-field"): "a column or field name; a file without it is reported when read",
    ("data tokenizer train", "--text-field"): "a column or field name; a file without it is reported when read",
    ("audit replay", "--auditor"): "the auditor's name, written into the attestation as given",
    ("audit run", "--name"): "the auditor's name, written into the attestation as given",
    ("generate", "--prompt"): "any text is a prompt",
}
# extra arguments some bad values need to be reached (None: a flag; False: leave the baseline's option out)
CONTEXT = {("data inspect", "--source"): {"--window": False, "--doc": "0"}}

# paths the command reads without click checking that they exist (click.Path(exists=True) are inputs too)
INPUTS = {("data verify", "corpus_dir"), ("data inspect", "corpus_dir"), ("data prepare", "tokenizer_path"),
          ("data verify", "tokenizer_path"), ("data inspect", "tokenizer_path"), ("train", "data_dir"),
          ("gnmr experiment", "data_dir"), ("audit report", "attestations"), ("audit report", "plans"),
          ("selftest", "golden_path")}
# inputs that are files of the package's own formats: a file of garbage in their place is bad input
FORMATTED = {("data prepare", "tokenizer_path"), ("data verify", "tokenizer_path"), ("data inspect", "tokenizer_path"),
             ("audit run", "plan_file"), ("audit run", "key"), ("audit report", "attestations"),
             ("audit report", "plans"), ("parity compare", "a"), ("parity compare", "b"), ("selftest", "golden_path"),
             ("eval", "tokenizer"), ("generate", "tokenizer"), ("train", "tokenizer_path"), ("export", "tokenizer"), ("config check", "file"), ("config show", "config_file"), ("train", "config_file")}
# combinations a bad value is tried in, where the baseline alone would not read that option
NEEDS = {("selftest", "--bundle"): {}, ("selftest", "--golden"): {}, ("selftest", "--data"): {"--full": None},
         ("selftest", "--out"): {"--regenerate": None, "--backend": False}}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The files the baselines name: a micro run with an attestation, a prepared corpus, a bundle."""
    tmp = tmp_path_factory.mktemp("bad_values")
    texts = tmp / "texts"
    texts.mkdir()
    for i in range(8):
        (texts / f"{i}.txt").write_text(f"the document number {i} says " + "words and numbers 12 " * (30 + i))
    micro = tmp / "micro"
    make_corpus(micro, MICRO_MIX)
    run = tmp / "run"
    env = {"tmp": str(tmp), "texts": str(texts), "micro": str(micro), "run": str(run),
           "corpus": str(tmp / "corpus"), "attestation": str(tmp / "attestation.json"),
           "bundle": str(tmp / "bundle.json")}
    r = CliRunner()
    res = r.invoke(cli, ["data", "prepare", "--source", f"web={texts}/*.txt", "--heldout-tokens", "0",
                         "--out", env["corpus"]])
    assert res.exit_code == 0, res.output
    cfg = micro_cfg(eval_every=0)       # on the packaged tokenizer, so that eval can read it
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=Manifest.load(tmp / "corpus").vocab_size))
    Trainer.new(run, cfg, tmp / "corpus", log=lambda m: None).train(2)
    for args in (["audit", run, "--steps", "0-1", "--backend", "cpu_ref", "--skip-selftest", "--out", env["attestation"]],
                 ["parity", "export", env["bundle"], "--cases", "1", "--steps", "0", "--ops", "rmsnorm_forward"]):
        res = r.invoke(cli, [str(a) for a in args])
        assert res.exit_code == 0, res.output
    if "config show" in COMMANDS:
        res = r.invoke(cli, ["config", "show"])
        assert res.exit_code == 0, res.output
        (tmp / "run.toml").write_text(res.output)
    env["config"] = str(tmp / "run.toml")
    garbage = tmp / "garbage.bin"
    garbage.write_bytes(b"\x00\xffnot what was asked for\n" * 4)
    (tmp / "a-directory").mkdir()
    env.update(garbage=str(garbage), directory=str(tmp / "a-directory"), missing=str(tmp / "missing" / "x"))
    return env


@pytest.fixture()
def traps(monkeypatch):
    """The functions that start work raise _Reached."""
    import mlx_open1b.data.prepare as prepare
    import mlx_open1b.evaluate as evaluate
    import mlx_open1b.gnmr_experiment as gnmr_experiment
    import mlx_open1b.golden as golden
    import mlx_open1b.parity as parity
    import mlx_open1b.parity.fuzz as parity_fuzz
    import mlx_open1b.selftest as selftest
    import mlx_open1b.data.tokenizer as tokenizer

    def trap(what):
        def reached(*a, **k):
            raise _Reached(what)
        return reached

    try:
        import mlx_open1b.generate as generate
        monkeypatch.setattr(generate.Generator, "generate", trap("Generator.generate"))
    except (ImportError, AttributeError):
        pass
    for obj, name in ((Trainer, "__init__"), (prepare, "prepare"), (parity, "run"), (parity, "export_bundle"), (parity_fuzz, "fuzz"),
                      (selftest, "run_backend"), (selftest._Cases, "prepare"), (golden, "compute"),
                      (gnmr_experiment, "run_experiment"), (evaluate, "evaluate"), (subprocess, "call"),
                      (tokenizer, "train_tokenizer_bytes")):
        monkeypatch.setattr(obj, name, trap(f"{getattr(obj, '__name__', obj)}.{name}"))


def _args(command: str, env: dict, options: dict, positionals: list) -> list[str]:
    out = command.split()
    for k, v in options.items():
        for one in (v if isinstance(v, list) else [v]):
            if one is not False:
                out += [k] if one is None else [k, one.format(**env)]
    return out + [p.format(**env) for p in positionals]


def _invoke(args: list[str]):
    """The result, or the _Reached of a command that started work."""
    try:
        return CliRunner().invoke(cli, args)
    except _Reached as e:
        return e


def _cases(env):
    """(command, parameter, bad value, extra options) for every parameter of every command."""
    for command, cmd in COMMANDS.items():
        for p in cmd.params:
            if isinstance(p, click.Option) and (p.is_flag or p.name in ("help",)):
                continue
            key = (command, p.opts[0] if isinstance(p, click.Option) else p.name)
            t = p.type
            if isinstance(t, click.Choice):
                values = ["nosuch", ""]
            elif isinstance(t, (click.types.IntParamType, click.types.FloatParamType)):
                values = ["x1", ""]
                low = getattr(t, "min", None)
                if low is None or low >= 0:
                    values.append("-5")
                high = getattr(t, "max", None)
                values.append(str(high + 1) if high is not None and isinstance(t, click.types.IntParamType)
                              else str(2 ** 64) if isinstance(t, click.types.IntParamType) else "inf")
                if isinstance(t, click.types.FloatParamType):
                    values.append("nan")
            elif isinstance(t, click.Path):
                reads = t.exists or (command, p.name) in INPUTS
                values = [""]
                if reads:
                    values.append(env["missing"])
                if not t.dir_okay:
                    values.append(env["directory"])
                if not t.file_okay:
                    values.append(env["garbage"])
                elif reads and (command, p.name) in FORMATTED:
                    values.append(env["garbage"])
            elif key in BAD_TEXT:
                values = [v.format(**env) for v in BAD_TEXT[key]]
            elif key in ANY_TEXT:
                continue
            else:
                raise AssertionError(f"{command} {key[1]}: a free-text option with no bad values listed (add it to "
                                     f"BAD_TEXT, or to ANY_TEXT saying why any text is good)")
            for v in values:
                yield command, p, v, {**CONTEXT.get(key, {}), **NEEDS.get(key, {})}


def test_every_option_refuses_bad_values(env, traps):
    tried, wrong = 0, []
    for command, p, value, extra in _cases(env):
        positionals, options = BASE[command]
        positionals, options = list(positionals), {**options, **extra}
        if isinstance(p, click.Argument):
            i = [q for q in COMMANDS[command].params if isinstance(q, click.Argument)].index(p)
            positionals[i] = value.replace("{", "{{").replace("}", "}}")
            name = p.human_readable_name
        else:
            options[p.opts[0]] = [value.replace("{", "{{").replace("}", "}}")] if p.multiple else \
                value.replace("{", "{{").replace("}", "}}")
            name = p.opts[0]
        args = _args(command, env, options, positionals)
        res = _invoke(args)
        tried += 1
        if isinstance(res, _Reached):
            wrong.append(f"open1b {' '.join(args)}  ->  accepted: started work ({res})")
            continue
        out = res.output
        said = name in out or (value and value in out) or (p.name and f"'{p.name}'" in out)
        if res.exit_code != 2 or not said or not isinstance(res.exception, (SystemExit, type(None))):
            why = (repr(res.exception) if res.exception and not isinstance(res.exception, SystemExit)
                   else out.strip().splitlines()[-1:] if out.strip() else "(no output)")
            wrong.append(f"open1b {' '.join(args)}  ->  exit {res.exit_code}: {why}")
    assert not wrong, f"{len(wrong)} of {tried} bad values not refused as bad input:\n" + "\n".join(wrong)
    assert tried > 150


def test_the_baselines_are_good(env, traps):
    """Each baseline gets as far as its work (exit 0 or a trap), so a bad value's exit 2 is its own."""
    assert not set(COMMANDS) - set(BASE), f"commands without a baseline here: {set(COMMANDS) - set(BASE)}"
    for command, (positionals, options) in BASE.items():
        if command not in COMMANDS:
            continue
        args = _args(command, env, options, positionals)
        try:
            res = CliRunner().invoke(cli, args)
        except _Reached:
            continue
        assert res.exit_code == 0, f"{' '.join(args)}: {res.output}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file: a file without read permission is readable")
def test_unreadable_files_are_bad_input(env, tmp_path):
    locked = tmp_path / "locked.json"
    locked.write_text("{}")
    locked.chmod(0)
    for args in (["parity", "compare", str(locked), env["bundle"]], ["audit", "report", env["run"], str(locked)],
                 ["data", "verify", env["corpus"], "--tokenizer", str(locked)]):
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2 and str(locked) in res.output, res.output
    corpus = pathlib.Path(env["corpus"])
    manifest = corpus / "manifest.json"
    manifest.chmod(0)
    try:
        res = CliRunner().invoke(cli, ["data", "verify", str(corpus)])
        assert res.exit_code == 2 and str(manifest) in res.output, res.output
    finally:
        manifest.chmod(0o644)
