"""The run directory: run.json read into a RunInfo and written back byte for byte, the config's
JSON-form version inferred from its keys, bad run directories refused naming the file and field."""
import json

import pytest

from mlx_open1b.contract import CONTRACT_VERSION
from mlx_open1b.fsutil import write_json_atomic
from mlx_open1b.ledger import genesis_hash
from mlx_open1b.rundir import RunDir, RunDirError
from mlx_open1b.train import TrainError, Trainer

from runs import micro_cfg
from test_train import corpus  # noqa: F401 - corpus is a fixture


@pytest.fixture()
def run(tmp_path, corpus):  # noqa: F811
    Trainer.new(tmp_path / "run", micro_cfg(), corpus, log=lambda m: None).train(3)
    return RunDir(tmp_path / "run")


def test_run_json_reads_and_writes_back_byte_for_byte(run, tmp_path):
    info = run.info()
    again = tmp_path / "again.json"
    write_json_atomic(again, info.to_json())
    assert again.read_bytes() == run.run_file.read_bytes()
    # a format pin: the keys in the order every run.json has been written (its bytes never change)
    assert list(json.loads(again.read_text())) == ["config", "contract_version", "created_by", "corpus_dir",
                                                   "manifest_fingerprint", "tokenizer_sha256", "genesis"]
    assert info.config == micro_cfg() and info.config_version == 1 and info.contract_version == CONTRACT_VERSION
    assert info.genesis == genesis_hash(info.config, info.manifest_fingerprint, info.tokenizer_sha256,
                                        info.contract_version)
    assert run.verify_ledger(info.genesis) == run.records()[-1]["hash"]
    assert [s for s, _ in run.checkpoints()] == [0, 2, 3] and run.latest_checkpoint(1)[0] == 0


def test_config_version_is_read_from_the_keys(run):
    d = json.loads(run.run_file.read_text())
    d["config"]["precision"], d["config"]["attention_pv"] = "int8", "int8"
    run.run_file.write_text(json.dumps(d))
    info = run.info()
    assert info.config_version == 3 and info.config.attention_pv == "int8"
    del d["config"]["attention_pv"]               # an int8 run.json from before CONTRACT §6.10
    run.run_file.write_text(json.dumps(d))
    info = run.info()
    assert info.config_version == 1 and info.config.attention_pv == "fp32"
    assert json.loads(json.dumps(info.to_json())) == d     # and it is written back the way it was read


def test_bad_run_directories_are_refused(run, tmp_path):
    with pytest.raises(RunDirError, match="not a run directory") as e:
        RunDir(tmp_path / "none").info()
    assert e.value.exit_code == 2
    good = json.loads(run.run_file.read_text())
    for edit, says in ((lambda d: d.pop("genesis"), "genesis: expected str"),
                       (lambda d: d.update(contract_version="1"), "contract_version: expected int"),
                       (lambda d: d["config"].pop("train"), "config: malformed"),
                       (lambda d: d.update(config=None), "config: expected an object")):
        d = json.loads(json.dumps(good))
        edit(d)
        run.run_file.write_text(json.dumps(d))
        with pytest.raises(RunDirError, match=f"run.json: malformed .*{says}") as e:
            run.info()
        assert e.value.exit_code == 1
    run.run_file.write_text("{")
    with pytest.raises(TrainError, match="run.json: malformed"):      # the caller's error class
        Trainer.resume(run.path)


def test_the_trainer_constructors(run, corpus):  # noqa: F811
    with pytest.raises(TrainError, match="already exists"):
        Trainer.new(run.path, micro_cfg(), corpus)
    tr = Trainer.replay(run.path, at_step=2)
    assert tr.state.step == 2 and tr.ledger is None
    before = run.ledger_file.read_bytes()
    tr = Trainer.resume(run.path, log=lambda m: None)
    assert tr.state.step == 3 and run.ledger_file.read_bytes() == before
    tr.train(4)
    assert run.records()[-1]["step"] == 3
