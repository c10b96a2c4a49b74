"""GNMR in training (CONTRACT.md §13): the controller's decisions are part of the ledger, identical
across backends, across resume from a checkpoint taken mid-lock, across worker counts; an injected
gradient spike moves its unit to the recovery path on the next step; audit replays the decisions."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from mlx_open1b.audit import audit, run_hash
from mlx_open1b.config import ConfigError, RunConfig
from mlx_open1b.gnmr import GNMRConfig
from mlx_open1b.train import TrainError, Trainer

from runs import MICRO, SENSITIVE, forge_records, gnmr_cfg

def records(run):
    return [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]


def test_records_carry_decisions_and_recovery_changes_the_program(tmp_path, corpus):
    Trainer(tmp_path / "g", gnmr_cfg(), corpus).train(8)
    recs = records(tmp_path / "g")
    assert all("gnmr" in r and "gnmr" in r["hashes"] for r in recs)
    assert recs[0]["gnmr"]["active"] == []                        # nothing recovered in step 0
    for a, b in zip(recs, recs[1:]):
        assert b["gnmr"]["active"] == a["gnmr"]["next"]           # chosen after t, applied at t + 1
    used = [r["gnmr"]["active"] for r in recs]
    assert any(used) and all(len(u) <= 2 for u in used)
    # the same run without the controller: identical until the first recovered step, then not
    Trainer(tmp_path / "plain", gnmr_cfg(gnmr=None), corpus).train(8)
    plain = records(tmp_path / "plain")
    first = next(i for i, u in enumerate(used) if u)
    for i in range(first):
        assert recs[i]["hashes"]["grads"] == plain[i]["hashes"]["grads"]
    assert recs[first]["hashes"]["grads"] != plain[first]["hashes"]["grads"]
    assert "gnmr" not in plain[0]


def test_resume_mid_lock_gives_the_same_ledger(tmp_path, corpus):
    cfg = gnmr_cfg()
    full = tmp_path / "full"
    Trainer(full, cfg, corpus).train(10)
    metas = {int(p.name.split("-")[1]): json.loads((p / "meta.json").read_text())
             for p in full.glob("ckpt-*")}
    mid = [s for s, m in sorted(metas.items()) if 0 < s < 10 and any(m["gnmr"]["locks"])]
    assert mid, "no checkpoint was taken while a unit was locked; retune SENSITIVE"
    part = tmp_path / "part"
    Trainer(part, cfg, corpus).train(mid[0])
    Trainer(part, resume=True).train(10)
    assert (part / "ledger.jsonl").read_bytes() == (full / "ledger.jsonl").read_bytes()


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_gnmr_ledger_parity_across_backends(tmp_path, corpus, backend):
    cfg = gnmr_cfg()
    Trainer(tmp_path / "cpu", cfg, corpus).train(3)
    Trainer(tmp_path / backend, cfg, corpus, backend=backend).train(3)
    a = (tmp_path / "cpu" / "ledger.jsonl").read_bytes()
    assert any(r["gnmr"]["active"] for r in records(tmp_path / "cpu"))
    assert a == (tmp_path / backend / "ledger.jsonl").read_bytes()


def test_injected_spike_moves_its_unit_to_recovery_next_step(tmp_path, corpus):
    """Multiply layer 1's wo gradient by 50 in step 5 only (a hook on the model): the controller
    selects layers.1.wo for step 6."""
    cfg = gnmr_cfg(gnmr=GNMRConfig(alpha=3.0, alpha_init=3.0, warm=0.0, beta=3.0, max_o=1, lock=2, window=3))
    tr = Trainer(tmp_path / "spike", cfg, corpus)
    lo = tr.layout["layers.1.wo"]
    inner = tr.model.loss_and_grad

    def spiked(params, windows):
        loss, ce, zl, g = inner(params, windows)
        if tr.state.step == 5:
            g[lo.offset:lo.offset + lo.size] *= np.float32(50)
        return loss, ce, zl, g

    tr.model.loss_and_grad = spiked
    tr.train(7)
    recs = records(tmp_path / "spike")
    assert recs[4]["gnmr"]["next"] == []
    assert recs[5]["gnmr"]["next"] == ["layers.1.wo"] and recs[6]["gnmr"]["active"] == ["layers.1.wo"]


def test_audit_replays_and_checks_the_decisions(tmp_path, corpus):
    run = tmp_path / "run"
    h = Trainer(run, gnmr_cfg(), corpus).train(6)
    att = audit(run, 2, 5)
    assert att["verdict"] == "certified" and att["run_hash"] == h
    assert run_hash(run)["run_hash"] == h
    # a decision the controller did not take, in a re-chained ledger: the replay names it
    import shutil
    shutil.copytree(run, tmp_path / "forged")
    forge_records(tmp_path / "forged", {3: lambda r: r["gnmr"].update(next=r["gnmr"]["next"][1:] or ["layers.0.qkv"])})
    m = audit(tmp_path / "forged", 2, 5)["first_mismatch"]
    assert (m["step"], m["component"], m["field"]) == (3, "gnmr", "gnmr")
    # a checkpoint whose controller state was altered is refused on load
    meta_f = run / "ckpt-00000004" / "meta.json"
    meta = json.loads(meta_f.read_text())
    meta["gnmr"]["locks"][0] += 1
    from mlx_open1b.checkpoint import _meta_hash
    meta["meta_hash"] = _meta_hash(meta)            # a consistent forgery of meta.json itself
    meta_f.write_text(json.dumps(meta))
    with pytest.raises(TrainError, match="gnmr"):
        Trainer(run, readonly=True, at_step=4)


def test_block_mode_switches_whole_layers(tmp_path, corpus):
    cfg = gnmr_cfg(gnmr=dataclasses.replace(SENSITIVE, mode="block", max_o=1))
    Trainer(tmp_path / "b", cfg, corpus).train(6)
    used = [r["gnmr"]["active"] for r in records(tmp_path / "b")]
    assert any(used) and all(set(u) <= {"layers.0", "layers.1"} and len(u) <= 1 for u in used)


def test_bad_gnmr_configs(tmp_path, corpus):
    with pytest.raises(ConfigError, match="precision"):
        dataclasses.replace(gnmr_cfg(), precision="bf16").check()
    with pytest.raises(ConfigError, match="max_o"):
        gnmr_cfg(gnmr=GNMRConfig(max_o=-1)).check()
    from click.testing import CliRunner

    from mlx_open1b.cli.main import cli
    r = CliRunner().invoke(cli, ["train", "--steps", "1", "--out", str(tmp_path / "x"), "--data", str(corpus),
                                 "--precision", "int8", "--gnmr", "alpha=3,gamma=1"])
    assert r.exit_code == 2 and "unknown key 'gamma'" in r.output
    r = CliRunner().invoke(cli, ["train", "--steps", "1", "--out", str(tmp_path / "y"), "--data", str(corpus),
                                 "--gnmr", ""])
    assert r.exit_code == 2 and "precision" in r.output


def test_heldout_eval_runs_at_the_base_precision(tmp_path, corpus):
    """The recovered units apply to the step's forward and backward only: the record's held-out CE
    equals a fresh model's (no recovered units) on the checkpointed parameters."""
    cfg = gnmr_cfg(eval_every=2, eval_windows=2)
    Trainer(tmp_path / "r", cfg, corpus).train(6)
    recs = records(tmp_path / "r")
    t = next(r for r in recs if "eval" in r and r["gnmr"]["active"])      # a recovered step with an eval
    tr = Trainer(tmp_path / "r", readonly=True, at_step=t["step"] + 1)
    assert tr.state.step == t["step"] + 1
    assert tr.heldout_ce() == t["eval"]


def test_state_and_config_validation(tmp_path, corpus):
    from mlx_open1b.gnmr import GNMRError, GNMRState
    st = GNMRState.fresh(4, 3).to_json()
    for bad in ({"active": [2, 1]}, {"active": [1, 1]}, {"t": 2, "filled": 1}, {"mean": [-1, 0, 0, 0]},
                {"locks": [-1, 0, 0, 0]}):
        with pytest.raises(GNMRError, match="gnmr state"):
            GNMRState.from_json({**st, **bad}, 4, 3)
    for bad in (dict(eps=1e-40), dict(alpha=True), dict(warm="0.1")):
        with pytest.raises(GNMRError):
            GNMRConfig(**bad).check("int8")
    with pytest.raises(GNMRError, match="twice"):
        GNMRConfig.parse("alpha=2,alpha=3")
    j = gnmr_cfg().to_json()
    del j["gnmr"]["beta"]
    with pytest.raises(ConfigError, match="missing beta"):
        RunConfig.from_json(j)


def test_int8_configs_from_before_the_int8_attention_keep_theirs(tmp_path, corpus):
    """An int8 run.json written before CONTRACT §6.10 has no attention_pv: it resumes with the §6.6
    attention forward it was trained with (the same program as recovering every attention unit)."""
    from mlx_open1b.model import Model, init_params
    cfg = dataclasses.replace(gnmr_cfg(gnmr=None), precision="int8")
    j = cfg.to_json()
    assert j["attention_pv"] == "int8"
    del j["attention_pv"]
    old = RunConfig.from_json(j)
    assert old.attention_pv == "fp32" and old.to_json() == j          # the old run's genesis is unchanged
    old_run = tmp_path / "old"
    Trainer(old_run, old, corpus).train(2)
    assert Trainer(old_run, resume=True).model._impl["int8"][2].__name__ == "attention_forward"
    params = init_params(MICRO, 1)
    win = np.random.default_rng(0).integers(0, MICRO.vocab_size, (2, MICRO.seq_len + 1)).astype(np.uint32)
    a = Model(MICRO, precision="int8", attention_pv="fp32").loss_and_grad(params, win)
    m = Model(MICRO, precision="int8")
    m.set_paths({(l, "attn"): "bf16" for l in range(MICRO.n_layers)})
    b = m.loss_and_grad(params, win)
    assert a[:3] == b[:3] and (a[3].view(np.uint32) == b[3].view(np.uint32)).all()
    c = Model(MICRO, precision="int8").loss_and_grad(params, win)
    assert (c[3].view(np.uint32) != a[3].view(np.uint32)).any()
