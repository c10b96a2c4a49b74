"""The audit's replay comparisons, one forged component at a time.

Every forgery is consistent: the ledger is re-chained from the genesis and a re-saved checkpoint
carries hashes that match its tensors, so the chain and `open1b hash` accept it and only the
replay can tell. Each test expects the audit to name exactly the forged component, field and
step. The audit's starting checkpoint is checked against the ledger record of the step before it.
Two micro runs (a plain one, one with a GNMR controller) are trained once and copied per test."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_open1b.audit import audit, run_hash
from mlx_open1b.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from mlx_open1b.cli.main import cli
from mlx_open1b.ledger import canonical, canonical_dumps, read_records, record_hash
from mlx_open1b.step import gnmr_hash, opt_hash, param_hash
from mlx_open1b.train import TrainError, Trainer

from data_helpers import MICRO_MIX, make_corpus
from runs import forge_records, gnmr_cfg, micro_cfg

STEPS = 8      # checkpoints every 2 steps: ckpt-s holds the state after ledger step s - 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """plain: 8 steps with clipped, skipped and spiking steps, 2 then 3 microbatches, evals after
    steps 3 and 7; gnmr: 6 steps of an int8 run whose controller acts."""
    root = tmp_path_factory.mktemp("audit_replay")
    make_corpus(root / "corpus", MICRO_MIX)
    quiet = dict(log=lambda m: None)
    Trainer(root / "plain", micro_cfg(spike_threshold=4.3, spike_skip=1), root / "corpus", **quiet).train(STEPS)
    Trainer(root / "gnmr", gnmr_cfg(), root / "corpus", **quiet).train(6)
    recs = read_records(root / "plain" / "ledger.jsonl")
    assert recs[4]["microbatches"] == 3 and not recs[4]["skipped"] and recs[4]["clipped"]
    assert any(r["skipped"] for r in recs) and any(r["spike"] for r in recs) and "eval" in recs[7]
    assert any(r["gnmr"]["next"] for r in read_records(root / "gnmr" / "ledger.jsonl")[:4])
    return root


def copy_run(runs, name, tmp_path):
    shutil.copytree(runs / name, tmp_path / name)
    return tmp_path / name


# ----------------------------------------------------------------------------- forging


def resave_checkpoint(run, step: int, edit) -> dict:
    """Re-save ckpt-<step> after edit(tensors {params, m, v: writable arrays}, meta) with every hash
    in its meta.json recomputed from what it now holds; returns {params, opt_state, gnmr} hashes."""
    tr = Trainer(run, readonly=True, at_step=step, log=lambda m: None)
    loaded, meta = load_checkpoint(checkpoint_dir(run, step))
    tensors = {k: np.array(a, copy=True) for k, (a, _) in loaded.items()}
    meta = {k: v for k, v in meta.items() if k not in ("format", "files", "tensors", "collections", "meta_hash")}
    edit(tensors, meta)
    st = dataclasses.replace(tr.state, params=tensors["params"], m=tensors["m"], v=tensors["v"],
                             adam_t=meta["adam_t"], skip_left=meta["skip_left"])
    meta["params_hash"], meta["opt_hash"] = param_hash(tr, st.params), opt_hash(tr, st)
    hashes = {"params": meta["params_hash"], "opt_state": meta["opt_hash"]}
    if "gnmr" in meta:
        from mlx_open1b.gnmr import GNMRState
        g = GNMRState.from_json(meta["gnmr"], len(tr.gnmr.units), tr.gnmr.cfg.window)
        meta["gnmr_hash"] = hashes["gnmr"] = gnmr_hash(tr, g)
    save_checkpoint(run, step, {"params": (tensors["params"], "bf16"), "m": (tensors["m"], "f32"),
                                "v": (tensors["v"], "f32")}, meta)
    return hashes


def next_f32(x):
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def other_hex(h):
    return ("1" if h[0] == "0" else "0") + h[1:]


def at(path, fn):
    """An edit of the record field at `path` (a tuple of keys) by fn(old value) -> new value."""
    def edit(rec):
        for k in path[:-1]:
            rec = rec[k]
        rec[path[-1]] = fn(rec[path[-1]])
    return edit


def mismatch(att):
    assert att["verdict"] == "mismatch", att["verdict"]
    m = att["first_mismatch"]
    return m["step"], m["component"], m["field"]


# ----------------------------------------------------------------------------- one forged field
# (run, step, field path, forgery, the component the audit must name)
FIELDS = [
    ("plain", 4, ("hashes", "batch"), other_hex, "batch"),
    ("plain", 4, ("hashes", "grads"), other_hex, "grads"),
    ("plain", 4, ("hashes", "params"), other_hex, "params"),
    ("plain", 4, ("hashes", "opt_state"), other_hex, "optimizer"),
    ("plain", 4, ("loss",), next_f32, "loss"),
    ("plain", 4, ("grad_norm",), next_f32, "grad_norm"),
    ("plain", 4, ("lr",), next_f32, "lr"),
    ("plain", 4, ("clipped",), lambda b: not b, "flags"),
    ("plain", 4, ("skipped",), lambda b: not b, "flags"),
    ("plain", 4, ("spike",), lambda b: not b, "flags"),
    ("plain", 4, ("windows",), lambda w: [w[0], w[1] + 1], "windows"),
    # fields without a component of their own: the replayed record must still equal the recorded one
    ("plain", 4, ("ce",), next_f32, "record"),
    ("plain", 4, ("zloss",), next_f32, "record"),
    ("plain", 4, ("tokens",), lambda n: n + 1, "record"),
    ("plain", 4, ("microbatches",), lambda n: n - 1, "record"),
    ("plain", 7, ("eval", "mixture"), lambda x: x + 2.0 ** -40, "record"),
    ("gnmr", 2, ("gnmr",), lambda g: {**g, "next": g["next"][1:] if g["next"] else ["layers.0.qkv"]}, "gnmr"),
    ("gnmr", 2, ("gnmr",), lambda g: {**g, "max_risk": next_f32(g["max_risk"])}, "gnmr"),
    ("gnmr", 2, ("hashes", "gnmr"), other_hex, "gnmr"),
]


@pytest.mark.parametrize("name,step,path,forge,component", FIELDS,
                         ids=[f"{c[0]}-{'.'.join(c[2])}-{i}" for i, c in enumerate(FIELDS)])
def test_replay_names_the_forged_field(runs, tmp_path, name, step, path, forge, component):
    run = copy_run(runs, name, tmp_path)
    before = read_records(run / "ledger.jsonl")[step]
    h = forge_records(run, {step: at(path, forge)})
    assert run_hash(run)["run_hash"] == h            # chain and checkpoints agree: only replay can tell
    field = path[:1] if component == "gnmr" and path[0] == "gnmr" else path
    att = audit(run, step, step)
    assert mismatch(att) == (step, component, ".".join(field))
    want = before
    for k in field:
        want = want[k]
    assert att["first_mismatch"]["replayed"] == want
    assert att["first_mismatch"]["recorded"] != want


def test_a_field_the_replay_does_not_produce_is_not_certified(runs, tmp_path):
    run = copy_run(runs, "plain", tmp_path)
    forge_records(run, {4: lambda r: r.update(note="reviewed")})
    assert mismatch(audit(run, 4, 4)) == (4, "record", "note")


# ----------------------------------------------------------------------------- forged checkpoints
def _ulp_up(a, i):
    a.view(np.uint32 if a.dtype == np.float32 else np.uint16)[i] += 1


def test_moment_moved_one_ulp_in_a_consistently_resaved_checkpoint(runs, tmp_path):
    """ckpt-4's first Adam moment moved by one ulp, its meta.json and ledger step 3 made to agree:
    a replay from ckpt-4 differs in the optimizer state at step 4, one from ckpt-2 at step 3."""
    run = copy_run(runs, "plain", tmp_path)
    m = load_checkpoint(checkpoint_dir(run, 4))[0]["m"][0]
    i = int(np.argmax(np.abs(m)))
    hashes = resave_checkpoint(run, 4, lambda t, meta: _ulp_up(t["m"], i))
    h = forge_records(run, {3: at(("hashes", "opt_state"), lambda _: hashes["opt_state"])})
    assert run_hash(run)["run_hash"] == h
    assert mismatch(audit(run, 4, 5)) == (4, "optimizer", "hashes.opt_state")
    assert mismatch(audit(run, 2, 5)) == (3, "optimizer", "hashes.opt_state")


def test_gnmr_state_moved_one_ulp_in_a_consistently_resaved_checkpoint(runs, tmp_path):
    run = copy_run(runs, "gnmr", tmp_path)

    def edit(tensors, meta):
        meta["gnmr"]["mean"][0] += 1          # fp32 bit patterns: one ulp
    hashes = resave_checkpoint(run, 4, edit)
    h = forge_records(run, {3: at(("hashes", "gnmr"), lambda _: hashes["gnmr"])})
    assert run_hash(run)["run_hash"] == h
    step, component, _ = mismatch(audit(run, 4, 5))
    assert (step, component) == (4, "gnmr")


# the checkpoint edited, the ledger left alone: the audit refuses to start from it
STARTS = [
    ("plain", lambda t, meta: _ulp_up(t["m"], 5), "opt_state hash"),
    ("plain", lambda t, meta: _ulp_up(t["v"], 5), "opt_state hash"),
    ("plain", lambda t, meta: meta.update(adam_t=meta["adam_t"] + 1), "opt_state hash"),
    ("plain", lambda t, meta: _ulp_up(t["params"], 5), "params hash"),
    ("plain", lambda t, meta: meta.update(consumed=meta["consumed"] + 1), "tokens"),
    ("gnmr", lambda t, meta: meta["gnmr"]["locks"].__setitem__(0, meta["gnmr"]["locks"][0] + 1), "gnmr hash"),
]


@pytest.mark.parametrize("name,edit,what", STARTS, ids=[f"{s[0]}-{i}" for i, s in enumerate(STARTS)])
def test_starting_checkpoint_is_checked_against_the_ledger(runs, tmp_path, name, edit, what):
    run = copy_run(runs, name, tmp_path)
    resave_checkpoint(run, 4, edit)
    ckpt = checkpoint_dir(run, 4)
    with pytest.raises(TrainError, match=rf"{ckpt}: {what} .* differs from ledger step 3") as e:
        audit(run, 4, 5)
    assert e.value.exit_code == 1
    with pytest.raises(TrainError, match=rf"{ckpt}: {what} .* differs from ledger step 3"):
        run_hash(run)                                                   # `open1b hash` agrees
    assert audit(run, 2, 3)["verdict"] == "certified"                  # a range that does not start there


def test_starting_checkpoint_stream_position_is_checked(runs, tmp_path):
    run = copy_run(runs, "plain", tmp_path)
    resave_checkpoint(run, 4, lambda t, meta: meta["stream"].update(windows=meta["stream"]["windows"] + 1))
    for check in (lambda: audit(run, 4, 4), lambda: run_hash(run)):
        with pytest.raises(TrainError, match=rf"ckpt-00000004: windows \d+ differs from ledger step 3"):
            check()
    res = CliRunner().invoke(cli, ["audit", str(run), "--steps", "4-4", "--out", str(tmp_path / "a.json")])
    assert res.exit_code == 1 and "ckpt-00000004: windows" in res.output and "Traceback" not in res.output, res.output
    assert audit(run, 2, 3)["verdict"] == "certified"
