"""Replay and certify steps of a run, and recompute its run hash (DESIGN §8).

`audit(run, first, last)` checks the ledger's chain, loads the checkpoint at or before `first`,
checks its tensors (parameter, optimizer-state and controller hashes) and position (tokens,
windows) against the ledger record of the step before it, replays every step up to `last` on the
chosen backend and compares each recomputed record with the ledger's: the batch hash (data), the
gradient hash, the parameter and optimizer-state hashes, the scalars (loss, norm, lr, flags), the
windows, the GNMR decisions and controller hash, and then every other field (held-out eval
included), so that a certified record hash stands for a record that replays whole. It reports
"certified" with the range and hashes, or the first step and component that differ, and writes an
attestation JSON. It never writes to the run.

`certify(run, ...)` replays a range given directly or by a plan (an auditor's share of a
collective audit) and seals, or signs, its attestation.
"""
from __future__ import annotations

from ..checkpoint import load_checkpoint
from ..ledger import LedgerError, canonical
from ..rundir import RunDir
from ..step import gnmr_hash, opt_hash, param_hash
from ..train import TrainError, Trainer
from .attestation import load_private_key, make_attestation, seal, sign, write_attestation
from .plan import load_plan, planned_range
from .run import AttestError, checkpoint_meta, load_run

COMPARED = (("batch", ("hashes", "batch")), ("grads", ("hashes", "grads")), ("params", ("hashes", "params")),
            ("optimizer", ("hashes", "opt_state")), ("loss", ("loss",)), ("grad_norm", ("grad_norm",)),
            ("lr", ("lr",)), ("flags", ("clipped",)), ("flags", ("skipped",)), ("flags", ("spike",)),
            ("windows", ("windows",)))
# runs with a GNMR controller (CONTRACT.md §13): its decisions and state replay too
COMPARED_GNMR = (("gnmr", ("gnmr",)), ("gnmr", ("hashes", "gnmr")))
UNHASHED = ("prev", "hash")         # the chain's own fields (verify_chain checks them)


def _get(rec: dict, path: tuple):
    for k in path:
        rec = rec.get(k) if isinstance(rec, dict) else None
    return rec


def run_hash(run_dir) -> dict:
    """Recompute the run hash from the artifacts: the ledger chain from the genesis, and every
    checkpoint's hashes and stream position against the ledger record of the step before it."""
    rd = RunDir(run_dir)
    final = rd.verify_ledger(rd.info(error=TrainError).genesis)
    records = {r["step"]: r for r in rd.records()}
    checked = []
    for step, path in rd.checkpoints():
        if step == 0:
            continue
        _, meta = load_checkpoint(path)
        rec = records.get(step - 1)
        if rec is None:
            continue
        check_against_ledger(path, rec, {"params": meta["params_hash"], "opt_state": meta["opt_hash"],
                                         "gnmr": meta.get("gnmr_hash")},
                             {"tokens": meta["consumed"], "windows": meta["stream"]["windows"]})
        checked.append(step)
    return {"run_hash": final, "steps": len(records), "checkpoints_checked": checked}


def check_against_ledger(path, rec: dict, hashes: dict, position: dict | None = None) -> None:
    """TrainError (exit 1) naming the checkpoint at `path` and what differs unless its hashes
    ({"params", "opt_state", "gnmr"}: None where it has no controller) and position ({"tokens",
    "windows"}: consumed tokens, windows emitted) are those of `rec`, the ledger record of the step
    before it."""
    keys = ["params", "opt_state"] + (["gnmr"] if hashes.get("gnmr") is not None or "gnmr" in rec["hashes"] else [])
    for key in keys:
        if rec["hashes"].get(key) != hashes.get(key):
            raise TrainError(f"{path}: {key} hash {str(hashes.get(key))[:16]}… differs from ledger step "
                             f"{rec['step']} ({str(rec['hashes'].get(key))[:16]}…)", exit_code=1)
    recorded = {"tokens": rec.get("tokens"), "windows": (rec.get("windows") or [None, None])[1]}
    for key, mine in (position or {}).items():
        if recorded[key] != mine:
            raise TrainError(f"{path}: {key} {mine} differs from ledger step {rec['step']} ({recorded[key]} "
                             f"after it)", exit_code=1)


def audit(run_dir, first: int, last: int, backend: str = "cpu_ref", auditor: str = "anonymous",
          out=None, progress=None) -> dict:
    """Replay steps first..last of the run on `backend` and return their attestation (sealed;
    written atomically to `out` unless it is None)."""
    rd = RunDir(run_dir)
    run, genesis = rd.path, rd.info(error=TrainError).genesis
    try:
        final = rd.verify_ledger(genesis)
    except LedgerError as e:
        return make_attestation(run, first, last, backend, auditor, out, "mismatch", None, {}, error=str(e),
                                genesis=genesis)
    records = {r["step"]: r for r in rd.records()}
    if not records:
        raise TrainError(f"{rd.ledger_file}: the ledger is empty", exit_code=2)
    if first < 0 or last < first or last not in records:
        raise TrainError(f"steps {first}-{last}: the run has steps 0-{max(records)}", exit_code=2)
    tr = Trainer.replay(run, at_step=first, backend=backend)
    start = tr.state.step
    if start > 0:
        _check_start(tr, records, start)
    certified = {}
    for rec in tr.records(last + 1):        # step t's hashes overlap step t+1's compute, as in training
        t, rec = rec["step"], canonical(rec)
        want = records[t]
        differs = _first_difference(rec, want)
        if differs is not None:
            component, path = differs
            detail = {"step": t, "component": component, "field": ".".join(path),
                      "recorded": _get(want, path), "replayed": _get(rec, path)}
            return make_attestation(run, first, last, backend, auditor, out, "mismatch", start, certified,
                                    first_mismatch=detail, genesis=genesis, run_hash=final)
        if t >= first:
            certified[t] = want["hash"]
        if progress:
            progress(t, last)
    return make_attestation(run, first, last, backend, auditor, out, "certified", start, certified,
                            genesis=genesis, run_hash=final)


def _check_start(tr: Trainer, records: dict, start: int) -> None:
    """The checkpoint the replay starts from holds the state the ledger records after step start - 1
    (its tensors hashed afresh, as `open1b hash` checks every checkpoint)."""
    path = tr.rundir.checkpoint(start)
    rec = records.get(start - 1)
    if rec is None:
        raise TrainError(f"{path}: the ledger has no record of step {start - 1} to check it against", exit_code=1)
    st = tr.state
    hashes = {"params": param_hash(tr, st.params), "opt_state": opt_hash(tr, st),
              "gnmr": gnmr_hash(tr, st.gnmr) if st.gnmr is not None else None}
    check_against_ledger(path, rec, hashes, {"tokens": st.consumed, "windows": st.stream["windows"]})


def _first_difference(rec: dict, want: dict):
    """(component, field path) of the first field where the replayed record differs from the
    recorded one: the named components in their order, then any other field, or None."""
    named = COMPARED + (COMPARED_GNMR if ("gnmr" in want or "gnmr" in rec) else ())
    for component, path in named:
        if _get(rec, path) != _get(want, path):
            return component, path
    for key in sorted((set(rec) | set(want)) - set(UNHASHED)):
        if isinstance(rec.get(key), dict) and isinstance(want.get(key), dict):
            for sub in sorted(set(rec[key]) | set(want[key])):
                if rec[key].get(sub) != want[key].get(sub):
                    return "record", (key, sub)
        elif rec.get(key) != want.get(key):
            return "record", (key,)
    return None


def certify(run_dir, first: int | None = None, last: int | None = None, backend: str = "cpu_ref",
            auditor: str = "anonymous", key=None, plan_file=None, auditor_index: int | None = None,
            out=None, progress=None) -> dict:
    """Replay and certify a range (from --range, or auditor `auditor_index`'s range of a plan) and
    return the sealed (and, with a key, signed) attestation; written atomically to `out`."""
    run = load_run(run_dir)
    plan_ref = None
    if plan_file is not None:
        if auditor_index is None:
            raise AttestError("--plan needs --auditor I (which of the plan's ranges to certify)")
        plan = load_plan(plan_file, run)
        a, b = planned_range(plan, auditor_index, plan_file)
        if first is not None and (first, last) != (a, b):
            raise AttestError(f"--range {first}:{last} differs from auditor {auditor_index}'s planned range {a}:{b}")
        first, last = a, b
        if not RunDir(run.dir).checkpoint(a).is_dir():
            raise AttestError(f"{plan_file}: range {a}:{b} (auditor {auditor_index}) starts from checkpoint "
                              f"ckpt-{a:08d}, which {run.dir} does not have")
        checkpoint_meta(run, a)
        plan_ref = {"hash": plan["plan_hash"], "auditor": auditor_index, "range": [a, b]}
    elif auditor_index is not None:
        raise AttestError("--auditor I selects a range of a plan: give --plan FILE too")
    if first is None or last is None:
        raise AttestError("give --range A:B or --plan FILE --auditor I")
    if not (0 <= first <= last < run.steps):
        raise AttestError(f"range {first}:{last}: the run has steps 0-{run.steps - 1}")
    signer = load_private_key(key) if key is not None and not hasattr(key, "sign") else key
    att = audit(run.dir, first, last, backend=backend, auditor=auditor, progress=progress)
    att["plan"] = plan_ref
    if signer is not None:
        sign(att, signer)
    else:
        seal(att)
    if out is not None:
        write_attestation(out, att)
    return att
