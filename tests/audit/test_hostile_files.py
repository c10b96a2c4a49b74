"""Hostile files. scripts/fuzz_readers.py feeds every reader mutated and truncated files (a CI-sized
run here; the benchmark runs 10^5 cases): only the readers' own errors come out. And three forgeries
a reader must catch and locate: a ledger edited in the middle, a shard swapped for another valid
shard, a checkpoint from another run."""
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
from click.testing import CliRunner

from mlx_open1b.cli.main import cli
from mlx_open1b.data.format import read_shard, write_shard
from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import micro_cfg

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fuzzed_readers_raise_only_their_own_errors():
    """The one CI guard of the fuzzer: 1,200 cases over 12 readers (about 30 s on a busy machine)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz_readers.py"), "--cases", "1200", "--seed", "7"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "1200 cases in" in r.stdout and "; 0 crashes, hangs or out-of-memory" in r.stdout


def _run(tmp_path, name, seed=7, steps=4):
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        make_corpus(corpus, MICRO_MIX)
    run = tmp_path / name
    tr = Trainer.new(run, micro_cfg(seed=seed), corpus, log=lambda m: None)
    tr.train(steps)
    tr.rundir.unlock()
    return run, corpus


def _invoke(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res


def test_a_ledger_edited_in_the_middle_is_located(tmp_path):
    run, _ = _run(tmp_path, "run")
    lines = (run / "ledger.jsonl").read_text().splitlines(keepends=True)
    rec = json.loads(lines[1])
    rec["loss"] = rec["loss"] + 1.0                 # step 1's loss, its own hash left as it was
    lines[1] = json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n"
    (run / "ledger.jsonl").write_text("".join(lines))
    res = _invoke("hash", run)
    assert res.exit_code == 1 and "line 2 (step 1): record edited" in res.output, res.output


def test_a_shard_swapped_for_another_valid_shard_is_located(tmp_path):
    """The shard's documents reversed: a valid shard with the same counts, other tokens. `data
    verify` names the file; the audit names the first step whose batch it changes."""
    run, corpus = _run(tmp_path, "run")
    shard = corpus / "web" / "shard-00000.arrow"
    tokens, offsets = read_shard(shard)
    docs = [np.array(tokens[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]
    write_shard(shard, docs[::-1])
    res = _invoke("data", "verify", corpus)
    assert res.exit_code == 1 and str(shard) in res.output and "differs from the manifest" in res.output, res.output
    res = _invoke("audit", run, "--steps", "0-3", "--backend", "cpu_ref", "--skip-selftest", "--out",
                  tmp_path / "att.json")
    assert res.exit_code == 1 and "NOT certified: step" in res.output and "batch" in res.output, res.output


def test_a_checkpoint_from_another_run_is_located(tmp_path):
    run, _ = _run(tmp_path, "run")
    other, _ = _run(tmp_path, "other", seed=8)
    shutil.rmtree(run / "ckpt-00000004")
    shutil.copytree(other / "ckpt-00000004", run / "ckpt-00000004")
    res = _invoke("hash", run)
    assert res.exit_code == 1 and "ckpt-00000004" in res.output, res.output
    res = _invoke("train", "--resume", "--out", run, "--steps", 6, "--backend", "cpu_ref", "--skip-selftest")
    assert res.exit_code == 2 and f"{run / 'ckpt-00000004'}: checkpoint belongs to another run" in res.output, \
        res.output


def test_the_fuzzer_survives_a_case_that_kills_the_process(tmp_path):
    """A reader that dies by a signal on some inputs (as a C library's segfault would): each such
    case is a crash with its seed, and the cases after it still run."""
    import importlib.util
    import os
    import signal
    spec = importlib.util.spec_from_file_location("fuzz_readers", ROOT / "scripts" / "fuzz_readers.py")
    fz = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_readers"] = fz          # its dataclasses look their module up
    spec.loader.exec_module(fz)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"a": [1, 2, 3], "b": "text"}))

    def reader(p):
        if len(pathlib.Path(p).read_bytes()) % 3 == 0:
            os.kill(os.getpid(), signal.SIGSEGV)
        raise ValueError("refused")
    t = fz.Target("dies", good, reader, (ValueError,))
    got = list(fz.run_target(t, list(range(40)), tmp_path / "scratch", 5.0, 4 << 30))
    assert [s for s, _, _ in got] == list(range(40))
    crashed = [s for s, o, d in got if o == "crash"]
    assert crashed and all("the process died" in d for s, o, d in got if o == "crash")
    assert {o for _, o, _ in got} == {"crash", "refused"}
