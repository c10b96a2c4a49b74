"""The run under audit: its genesis and verified ledger, its checkpoints, each checkpoint's metadata
checked against the ledger (what plans, attestations and coverage are checked against)."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

from ..checkpoint import META_FILE, _meta_hash
from ..errors import Open1bError
from ..rundir import RunDir


class AttestError(Open1bError):
    """Bad input for a plan, an audit or a report; the message names the file, step or field.
    exit_code for the CLI (2: bad input, 1: the run's own artifacts are broken)."""


@dataclass
class RunView:
    """What verification needs from a run directory: the verified ledger and the checkpoints."""
    dir: pathlib.Path
    genesis: str
    contract_version: int
    records: list
    run_hash: str
    checkpoints: list = field(default_factory=list)    # checkpoint steps present (not verified)

    @property
    def steps(self) -> int:
        return len(self.records)

    def record_hash(self, step: int) -> str:
        return self.records[step]["hash"]

    def prev_hash(self, step: int) -> str:
        return self.records[step]["prev"]


def load_run(run_dir) -> RunView:
    """The run's genesis (run.json) and its ledger, chain verified; steps must be 0..N-1."""
    rd = RunDir(run_dir)
    info, final, records = rd.verified_records(AttestError, "audit")
    for i, r in enumerate(records):
        if r["step"] != i:
            raise AttestError(f"{rd.ledger_file}: line {i + 1} is step {r['step']}, expected {i} "
                              f"(steps must run 0..N-1 without gaps)", exit_code=1)
    return RunView(rd.path, info.genesis, info.contract_version, records, final, [s for s, _ in rd.checkpoints()])


def checkpoint_meta(run: RunView, step: int) -> dict:
    """meta.json of ckpt-<step>, checked against its meta_hash, the run's genesis and, for step > 0,
    the ledger's parameter and optimizer-state hashes after step - 1 (the tensors themselves are
    verified when an auditor loads them)."""
    d = RunDir(run.dir).checkpoint(step)
    mp = d / META_FILE
    if not mp.exists():
        raise AttestError(f"{d}: missing (no {META_FILE})")
    try:
        meta = json.loads(mp.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise AttestError(f"{mp}: not valid JSON ({e})", exit_code=1) from None
    if not isinstance(meta, dict) or meta.get("meta_hash") != _meta_hash(meta):
        raise AttestError(f"{mp}: contents do not match its meta_hash (edited or corrupt)", exit_code=1)
    if meta.get("genesis") != run.genesis:
        raise AttestError(f"{d}: belongs to another run (genesis {str(meta.get('genesis'))[:16]}…)", exit_code=1)
    if step > 0:
        rec = run.records[step - 1]
        for key, mk in (("params", "params_hash"), ("opt_state", "opt_hash")):
            if meta.get(mk) != rec["hashes"][key]:
                raise AttestError(f"{d}: its {key} hash {str(meta.get(mk))[:16]}… differs from the ledger's "
                                  f"after step {step - 1} ({rec['hashes'][key][:16]}…)", exit_code=1)
    return meta
