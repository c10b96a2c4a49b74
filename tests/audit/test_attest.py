"""Collective audit: plans, sealed/signed attestations, the coverage report, rejections
and bad input. One micro run of 12 steps (checkpoints every 2 steps) is shared by the tests."""
import copy
import json
import shutil

import pytest
from click.testing import CliRunner

from mlx_open1b import audit as attest
from mlx_open1b.audit import AttestError, audit, certify, make_plan, report, seal, sign, verify_attestation
from mlx_open1b.cli.main import cli
from mlx_open1b.train import Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import micro_cfg

STEPS = 12


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run: 12 steps; longer: the same run continued to 14 steps (same genesis, longer ledger);
    other: another seed (another genesis)."""
    root = tmp_path_factory.mktemp("attest")
    make_corpus(root / "corpus", MICRO_MIX)
    quiet = dict(log=lambda m: None)
    Trainer(root / "run", micro_cfg(), root / "corpus", **quiet).train(STEPS)
    shutil.copytree(root / "run", root / "longer")
    Trainer(root / "longer", resume=True, **quiet).train(STEPS + 2)
    Trainer(root / "other", micro_cfg(seed=8), root / "corpus", **quiet).train(4)
    return root


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {n: (d / f"{n}.pem", attest.generate_key(d / f"{n}.pem")) for n in ("alice", "mallory")}


def _write(path, att):
    path.write_text(json.dumps(att, indent=2))
    return path


def test_plan_is_checkpoint_aligned_and_balanced(runs):
    plan = make_plan(runs / "run", 3, overlap=1)
    assert plan["checkpoints"] == [0, 2, 4, 6, 8, 10]
    assert [(r["first"], r["last"]) for r in plan["ranges"]] == [(0, 4), (4, 8), (8, 11)]
    assert all(r["checkpoint"] == r["first"] for r in plan["ranges"])
    assert [(r["first"], r["last"]) for r in make_plan(runs / "run", 6)["ranges"]] == \
        [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]
    assert [(r["first"], r["last"]) for r in make_plan(runs / "run", 1, overlap=3)["ranges"]] == [(0, 11)]
    with pytest.raises(AttestError, match="6 checkpoint-aligned segment.*at most 6"):
        make_plan(runs / "run", 7)


def test_three_auditors_gap_and_overlap(runs, keys, tmp_path):
    run = runs / "run"
    plan_file = tmp_path / "plan.json"
    attest.write_plan(run, 3, 1, plan_file)
    a0 = certify(run, backend="cpu_ref", auditor="alice", key=keys["alice"][0], plan_file=plan_file,
                 auditor_index=0, out=tmp_path / "a0.json")
    assert a0["verdict"] == "certified" and a0["signature"]["public_key"] == keys["alice"][1]
    a1 = certify(run, auditor="bob", plan_file=plan_file, auditor_index=1)
    # bob's auditor replays on another machine: simulated by its recorded environment (re-sealed)
    a1["backend"], a1["environment"]["device"] = "cuda", "NVIDIA H100 80GB HBM3"
    a1["hardware"]["machine"] = "x86_64"
    _write(tmp_path / "a1.json", seal(a1))
    certify(run, 10, 11, auditor="carol", out=tmp_path / "a2.json")       # leaves step 9 uncovered
    files = [tmp_path / f"a{i}.json" for i in range(3)]
    rep = report(run, files, plan_files=[plan_file])
    assert rep["accepted"] == 3 and rep["rejected"] == 0
    table = [(c["first"], c["last"], len(c["auditors"]), c["backends"]) for c in rep["coverage"]]
    assert table == [(0, 3, 1, ["cpu_ref"]), (4, 4, 2, ["cpu_ref", "cuda"]), (5, 8, 1, ["cuda"]),
                     (9, 9, 0, []), (10, 11, 1, ["cpu_ref"])]
    assert rep["coverage"][1]["auditors"] == [f"alice [{keys['alice'][1][:8]}]", "bob"]
    assert any("H100" in h for h in rep["coverage"][2]["hardware"])
    assert rep["uncovered"] == [[9, 9]] and not rep["disagreements"] and not rep["fully_certified"]
    assert rep["planned_ranges_without_attestation"] == [{"plan": str(plan_file), "auditor": 2, "range": [8, 11]}]
    text = attest.format_report(rep)
    assert any(line.split()[:3] == ["9", "0", "**"] for line in text.splitlines())
    assert "NOT fully certified: uncovered steps 9" in text
    # the gap closed (by the plain `audit` path, which seals too): fully certified, CLI exit 0
    audit(run, 9, 9, auditor="dave", out=tmp_path / "a3.json")
    files.append(tmp_path / "a3.json")
    rep = report(run, files, plan_files=[plan_file])
    assert rep["fully_certified"] and rep["uncovered"] == []
    res = CliRunner().invoke(cli, ["audit", "report", str(run), *map(str, files)])
    assert res.exit_code == 0 and "FULLY CERTIFIED" in res.output, res.output
    # a duplicate file counts once
    shutil.copy(files[0], tmp_path / "dup.json")
    rep = report(run, files + [tmp_path / "dup.json"])
    assert rep["attestations"][-1]["status"] == "duplicate" and rep["coverage"][0]["attestations"] == 1
    # a disagreeing auditor (simulated: a replay that differed at step 6) is reported, not hidden
    d = copy.deepcopy(a1)
    d.update(verdict="mismatch", auditor="erin",
             certified_steps={str(s): h for s, h in a1["certified_steps"].items() if int(s) < 6},
             first_mismatch={"step": 6, "component": "grads", "field": "hashes.grads",
                             "recorded": "aa" * 32, "replayed": "bb" * 32})
    _write(tmp_path / "d.json", seal(d))
    rep = report(run, files + [tmp_path / "d.json"])
    assert not rep["fully_certified"] and rep["uncovered"] == []
    [dis] = rep["disagreements"]
    assert dis["step"] == 6 and dis["auditor"] == "erin" and dis["certified_by"] == ["bob"]
    res = CliRunner().invoke(cli, ["audit", "report", str(run), *map(str, files), str(tmp_path / "d.json")])
    assert res.exit_code == 1 and "disagreement" in res.output


def test_tampered_and_foreign_attestations_rejected(runs, keys, tmp_path):
    run, view = runs / "run", attest.load_run(runs / "run")
    good = certify(run, 2, 5, auditor="alice", key=keys["alice"][0])
    assert verify_attestation(good, view) == []

    edited = copy.deepcopy(good)                        # edited without re-sealing
    edited["backend"] = "metal"
    assert "tampered" in verify_attestation(edited, view)[0]
    forged = copy.deepcopy(good)                        # a certified hash changed and the seal recomputed
    forged["certified_steps"]["3"] = "0" * 64
    sig = forged["signature"]
    seal(forged)
    assert "step 3: certified record hash" in verify_attestation(forged, view)[0]
    forged["signature"] = sig                           # ... keeping alice's signature
    assert "does not verify" in verify_attestation(forged, view)[0]
    extended = copy.deepcopy(good)                      # steps claimed that were never replayed
    extended["range"] = [0, 5]
    extended["certified_steps"].update({str(s): view.record_hash(s) for s in (0, 1)})
    seal(extended)
    assert "does not verify" in verify_attestation(dict(extended, signature=good["signature"]), view)[0]
    sign(extended, keys["mallory"][0])                  # mallory's own signature verifies ...
    assert verify_attestation(extended, view) == []
    assert "untrusted key" in verify_attestation(extended, view, trusted={keys["alice"][1]})[0]   # ... untrusted
    unsigned = certify(run, 2, 3)
    assert "not signed" in verify_attestation(unsigned, view, require_signed=True)[0]
    unsealed = {k: v for k, v in unsigned.items() if k != "attestation_hash"}
    assert "unsealed" in verify_attestation(unsealed, view)[0]

    # another run (another genesis), another ledger with the same genesis, an earlier ledger state
    other = certify(runs / "other", 0, 1)
    assert "another run" in verify_attestation(other, view)[0]
    longer = certify(runs / "longer", 2, 3)
    assert "not in this run's ledger" in verify_attestation(longer, view)[0]
    lview = attest.load_run(runs / "longer")
    assert "earlier state of this ledger (ending at step 11" in verify_attestation(good, lview)[0]
    assert verify_attestation(good, lview, allow_prefix=True) == []

    files = [_write(tmp_path / f"{n}.json", a) for n, a in
             (("good", good), ("edited", edited), ("forged", forged), ("other", other))]
    rep = report(run, files, trusted_keys=[keys["alice"][1]])
    assert [e["status"] for e in rep["attestations"]] == ["accepted", "rejected", "rejected", "rejected"]
    assert rep["coverage"][1] == {"first": 2, "last": 5, "steps": 4, "attestations": 1,
                                  "auditors": [f"alice [{keys['alice'][1][:8]}]"], "backends": ["cpu_ref"],
                                  "hardware": rep["coverage"][1]["hardware"]}
    res = CliRunner().invoke(cli, ["audit", "report", str(run), *map(str, files), "--trust", str(keys["alice"][0])])
    assert res.exit_code == 1
    assert "REJECTED" in res.output and "another run" in res.output and "tampered" in res.output


def test_bad_input_is_a_clear_error(runs, tmp_path):
    run = runs / "run"
    with pytest.raises(AttestError, match="not a run directory"):
        report(tmp_path, [tmp_path / "x.json"])
    good = _write(tmp_path / "good.json", certify(run, 0, 1))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(AttestError, match="junk.json: not JSON.*partial"):
        report(run, [good, tmp_path / "junk.json"])
    with pytest.raises(AttestError, match="no such attestation"):
        report(run, [good, tmp_path / "missing.json"])
    # a plan made from another ledger (same genesis), and a plan whose hashes were edited
    longer_plan = tmp_path / "longer-plan.json"
    attest.write_plan(runs / "longer", 2, 0, longer_plan)
    with pytest.raises(AttestError, match="outside the run's steps|another ledger|ledger changed"):
        report(run, [good], plan_files=[longer_plan])
    plan = make_plan(run, 3, overlap=1)
    bad = copy.deepcopy(plan)
    bad["ranges"][1]["prev_hash"] = "1" * 64            # overlapping plan with an inconsistent hash
    bad["plan_hash"] = attest.digest(bad, ("plan_hash",))
    _write(tmp_path / "plan.json", plan)
    _write(tmp_path / "bad-plan.json", bad)
    with pytest.raises(AttestError, match=r"bad-plan.json: range 4:8 .*prev_hash at step 4 .*another ledger"):
        report(run, [good], plan_files=[tmp_path / "plan.json", tmp_path / "bad-plan.json"])
    edited = dict(plan, overlap=0)
    _write(tmp_path / "edited-plan.json", edited)
    with pytest.raises(AttestError, match="plan_hash"):
        certify(run, plan_file=tmp_path / "edited-plan.json", auditor_index=0)
    with pytest.raises(AttestError, match="no auditor 5"):
        certify(run, plan_file=tmp_path / "plan.json", auditor_index=5)
    # a planned range whose checkpoint the run no longer has
    holey = tmp_path / "holey"
    shutil.copytree(run, holey)
    shutil.rmtree(holey / "ckpt-00000004")
    with pytest.raises(AttestError, match=r"range 4:8 \(auditor 1\) starts from checkpoint ckpt-00000004, which .* "
                                          r"does not have"):
        certify(holey, plan_file=tmp_path / "plan.json", auditor_index=1)
    with pytest.raises(AttestError, match="the run has steps 0-11"):
        certify(run, 5, 12)
    r = CliRunner()
    res = r.invoke(cli, ["audit", "report", str(run), str(good), str(tmp_path / "junk.json")])
    assert res.exit_code == 2 and "junk.json" in res.output
    res = r.invoke(cli, ["audit", "run", str(run), "--auditor", "1"])
    assert res.exit_code == 2 and "--plan" in res.output
    res = r.invoke(cli, ["audit", "plan", str(run), "--auditors", "9", "--out", str(tmp_path / "p9.json")])
    assert res.exit_code == 2 and "at most 6" in res.output


def test_cli_plan_run_report_and_legacy_form(runs, keys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(runs / "run", tmp_path / "run")        # a run directory named like a subcommand
    r = CliRunner()
    res = r.invoke(cli, ["audit", "plan", "run", "--auditors", "2"])
    assert res.exit_code == 0 and "auditor 1: steps 6-11" in res.output, res.output
    for i in (0, 1):
        res = r.invoke(cli, ["audit", "run", "run", "--plan", "audit-plan.json", "--auditor", str(i),
                             "--name", f"aud{i}", "--key", str(keys["alice"][0]), "--out", f"a{i}.json"])
        assert res.exit_code == 0 and "(signed)" in res.output, res.output
    res = r.invoke(cli, ["audit", "report", "run", "a0.json", "a1.json", "--plan", "audit-plan.json",
                         "--require-signed", "--json", "rep.json"])
    assert res.exit_code == 0 and "FULLY CERTIFIED" in res.output, res.output
    assert json.loads((tmp_path / "rep.json").read_text())["fully_certified"]
    res = r.invoke(cli, ["audit", "run", "--steps", "3"])        # the original form, on ./run
    assert res.exit_code == 0 and "certified: steps 3-3" in res.output, res.output
    res = r.invoke(cli, ["audit", "replay", "run", "--steps", "4-5"])
    assert res.exit_code == 0 and "certified: steps 4-5" in res.output
