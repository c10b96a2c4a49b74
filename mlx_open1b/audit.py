"""Replay and certify steps of a run, and recompute its run hash (DESIGN §8).

`audit(run, first, last)` checks the ledger's chain, loads the checkpoint at or before `first`,
replays every step up to `last` on the chosen backend and compares each recomputed value with the
ledger record: the batch hash (data), the gradient hash, the parameter and optimizer-state hashes,
and the scalars (loss, norm, lr, flags). It reports "certified" with the range and hashes, or the
first step and component that differ, and writes an attestation JSON. It never writes to the run.
"""
from __future__ import annotations

import datetime
import json
import pathlib
import platform

from . import __version__
from .attest import environment, seal
from .checkpoint import list_checkpoints, load_checkpoint
from .contract import CONTRACT_VERSION
from .fsutil import write_json_atomic
from .ledger import LedgerError, read_records, verify_chain
from .train import LEDGER_FILE, RUN_FILE, TrainError, Trainer

COMPARED = (("batch", ("hashes", "batch")), ("grads", ("hashes", "grads")), ("params", ("hashes", "params")),
            ("optimizer", ("hashes", "opt_state")), ("loss", ("loss",)), ("grad_norm", ("grad_norm",)),
            ("lr", ("lr",)), ("flags", ("clipped",)), ("flags", ("skipped",)), ("flags", ("spike",)),
            ("windows", ("windows",)))
# runs with a GNMR controller (CONTRACT.md §13): its decisions and state replay too
COMPARED_GNMR = (("gnmr", ("gnmr",)), ("gnmr", ("hashes", "gnmr")))


def _get(rec: dict, path: tuple):
    for k in path:
        rec = rec.get(k) if isinstance(rec, dict) else None
    return rec


def _genesis(run: pathlib.Path) -> str:
    f = run / RUN_FILE
    if not f.exists():
        raise TrainError(f"{f}: not a run directory (no {RUN_FILE})", exit_code=2)
    return json.loads(f.read_text())["genesis"]


def run_hash(run_dir) -> dict:
    """Recompute the run hash from the artifacts: the ledger chain from the genesis, and every
    checkpoint's parameter/optimizer hashes against the ledger record of its step."""
    run = pathlib.Path(run_dir)
    genesis = _genesis(run)
    final = verify_chain(run / LEDGER_FILE, genesis)
    records = {r["step"]: r for r in _records(run)}
    checked = []
    for step, path in list_checkpoints(run):
        if step == 0:
            continue
        _, meta = load_checkpoint(path)
        rec = records.get(step - 1)
        if rec is None:
            continue
        pairs = [("params", meta["params_hash"]), ("opt_state", meta["opt_hash"])]
        if "gnmr_hash" in meta or "gnmr" in rec["hashes"]:
            pairs.append(("gnmr", meta.get("gnmr_hash")))
        for key, mine in pairs:
            if rec["hashes"].get(key) != mine:
                raise TrainError(f"{path}: {key} hash {str(mine)[:16]}… differs from ledger step {step - 1} "
                                 f"({str(rec['hashes'].get(key))[:16]}…)", exit_code=1)
        checked.append(step)
    return {"run_hash": final, "steps": len(records), "checkpoints_checked": checked}


def _records(run: pathlib.Path) -> list[dict]:
    return read_records(run / LEDGER_FILE)


def audit(run_dir, first: int, last: int, backend: str = "cpu_ref", auditor: str = "anonymous",
          out=None, progress=None) -> dict:
    run = pathlib.Path(run_dir)
    genesis = _genesis(run)
    try:
        final = verify_chain(run / LEDGER_FILE, genesis)
    except LedgerError as e:
        return _attest(run, first, last, backend, auditor, out, "mismatch", None, {}, error=str(e), genesis=genesis)
    records = {r["step"]: r for r in _records(run)}
    if not records:
        raise TrainError(f"{run / LEDGER_FILE}: the ledger is empty", exit_code=2)
    if first < 0 or last < first or last not in records:
        raise TrainError(f"steps {first}-{last}: the run has steps 0-{max(records)}", exit_code=2)
    tr = Trainer(run, backend=backend, readonly=True, at_step=first)
    start = tr.state.step
    certified = {}
    for t in range(start, last + 1):
        rec = tr.compute_step()
        want = records[t]
        for component, path in COMPARED + (COMPARED_GNMR if ("gnmr" in want or "gnmr" in rec) else ()):
            if _get(rec, path) != _get(want, path):
                detail = {"step": t, "component": component, "field": ".".join(path),
                          "recorded": _get(want, path), "replayed": _get(rec, path)}
                return _attest(run, first, last, backend, auditor, out, "mismatch", start, certified,
                               first_mismatch=detail, genesis=genesis, run_hash=final)
        if t >= first:
            certified[t] = want["hash"]
        if progress:
            progress(t, last)
    return _attest(run, first, last, backend, auditor, out, "certified", start, certified,
                   genesis=genesis, run_hash=final)


def _attest(run, first, last, backend, auditor, out, verdict, start, certified, first_mismatch=None,
            error=None, genesis=None, run_hash=None) -> dict:
    att = {
        "kind": "open1b-attestation/1", "run": str(run.resolve()), "genesis": genesis, "run_hash": run_hash,
        "range": [first, last], "verdict": verdict, "replayed_from_checkpoint_step": start,
        "certified_steps": {str(k): v for k, v in certified.items()},
        "first_mismatch": first_mismatch, "error": error, "auditor": auditor, "backend": backend,
        "hardware": {"machine": platform.machine(), "processor": platform.processor(),
                     "system": f"{platform.system()} {platform.release()}", "python": platform.python_version()},
        "software": f"mlx-open1b {__version__}", "contract_version": CONTRACT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(backend), "plan": None,
    }
    seal(att)        # attestation_hash: what a collective-audit report verifies (attest.py)
    if out is not None:
        write_json_atomic(out, att)
    return att
