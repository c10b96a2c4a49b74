"""Audit plans: a run's steps split into checkpoint-aligned ranges, one per auditor.

A plan (kind "open1b-audit-plan/1") splits the run's steps 0..N-1 into K contiguous ranges that
each start at a checkpoint (so an auditor replays nothing outside its range), optionally extended
by S steps into the next auditor's range (overlap: two auditors certify those steps). It records
the run hash, the genesis, the checkpoints it uses and for each range its first and last step, its
checkpoint and the ledger hashes at both ends; it is sealed by "plan_hash". Plans are checked
against the run's ledger wherever they are used: a plan made from another ledger (or one that
disagrees with another plan on a hash) is an error, as is a planned range whose checkpoint the run
does not have.
"""
from __future__ import annotations

import json
import pathlib

from ..fsutil import write_json_atomic
from .attestation import digest
from .run import AttestError, RunView, checkpoint_meta, load_run

PLAN_KIND = "open1b-audit-plan/1"


def make_plan(run_dir, auditors: int, overlap: int = 0) -> dict:
    """Split the run into `auditors` contiguous checkpoint-aligned ranges (balanced by steps);
    each range but the last is extended by `overlap` steps into the next one."""
    run = load_run(run_dir)
    N = run.steps
    if auditors < 1:
        raise AttestError(f"--auditors: expected at least 1, got {auditors}")
    if overlap < 0:
        raise AttestError(f"--overlap: expected a number of steps >= 0, got {overlap}")
    starts = [s for s in run.checkpoints if s < N]
    if 0 not in starts:
        raise AttestError(f"{run.dir}: no checkpoint at step 0 (ckpt-00000000): the first range cannot be replayed")
    for s in starts:
        checkpoint_meta(run, s)
    segs = [(a, b - 1) for a, b in zip(starts, starts[1:] + [N])]
    if auditors > len(segs):
        raise AttestError(f"{run.dir}: {len(segs)} checkpoint-aligned segment(s) (checkpoints at steps "
                          f"{starts}) cannot be split among {auditors} auditors; use at most {len(segs)}")
    # contiguous groups of segments: the k-th cut after the segment whose end is nearest k*N/K,
    # leaving at least one segment to each later auditor
    ends = [b + 1 for _, b in segs]
    cuts, lo = [], 0
    for k in range(1, auditors):
        hi = len(segs) - 1 - (auditors - k)
        best = min(range(lo, hi + 1), key=lambda i: (abs(ends[i] * auditors - k * N), i))
        cuts.append(best)
        lo = best + 1
    ranges, lo = [], 0
    for c in cuts + [len(segs) - 1]:
        ranges.append((segs[lo][0], segs[c][1]))
        lo = c + 1
    plan_ranges = []
    for j, (first, last) in enumerate(ranges):
        last_ext = min(N - 1, last + overlap) if j < len(ranges) - 1 else last
        plan_ranges.append({"auditor": j, "first": first, "last": last_ext, "checkpoint": first,
                            "prev_hash": run.prev_hash(first), "last_hash": run.record_hash(last_ext)})
    plan = {"kind": PLAN_KIND, "genesis": run.genesis, "run_hash": run.run_hash, "steps": N,
            "contract_version": run.contract_version, "auditors": auditors, "overlap": overlap,
            "checkpoints": starts, "ranges": plan_ranges}
    plan["plan_hash"] = digest(plan, ("plan_hash",))
    return plan


def write_plan(run_dir, auditors: int, overlap: int, out) -> dict:
    plan = make_plan(run_dir, auditors, overlap)
    write_json_atomic(out, plan)
    return plan


def load_plan(path, run: RunView) -> dict:
    """Read a plan and check it against the run: seal, genesis, run hash, every range's hashes
    at both ends and its checkpoint's presence."""
    p = pathlib.Path(path)
    try:
        plan = json.loads(p.read_text())
    except FileNotFoundError:
        raise AttestError(f"{p}: no such plan file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise AttestError(f"{p}: not JSON ({e})") from None
    if not isinstance(plan, dict) or plan.get("kind") != PLAN_KIND:
        raise AttestError(f"{p}: not an audit plan (kind {plan.get('kind') if isinstance(plan, dict) else None!r}, "
                          f"expected {PLAN_KIND!r})")
    if plan.get("plan_hash") != digest(plan, ("plan_hash",)):
        raise AttestError(f"{p}: contents do not match its plan_hash (edited)")
    if plan.get("genesis") != run.genesis:
        raise AttestError(f"{p}: a plan for another run (genesis {str(plan.get('genesis'))[:16]}…, "
                          f"{run.dir}'s is {run.genesis[:16]}…)")
    try:
        ranges = plan["ranges"]
        for r in ranges:
            a, b, c = int(r["first"]), int(r["last"]), int(r["checkpoint"])
            where = f"{p}: range {a}:{b} (auditor {r['auditor']})"
            if not (0 <= a <= b < run.steps):
                raise AttestError(f"{where}: outside the run's steps 0-{run.steps - 1}")
            for step, key, mine in ((a, "prev_hash", run.prev_hash(a)), (b, "last_hash", run.record_hash(b))):
                if r[key] != mine:
                    raise AttestError(f"{where}: {key} at step {step} is {str(r[key])[:16]}…, the ledger's is "
                                      f"{mine[:16]}… (the plan was made from another ledger)")
            if c != a:
                raise AttestError(f"{where}: checkpoint {c} is not the range's first step")
    except (KeyError, TypeError, ValueError) as e:
        raise AttestError(f"{p}: malformed range ({e!r})") from None
    if plan.get("run_hash") != run.run_hash:
        raise AttestError(f"{p}: made for run hash {str(plan.get('run_hash'))[:16]}…, the ledger's is "
                          f"{run.run_hash[:16]}… (the ledger changed since the plan was made)")
    return plan


def check_plans(plans: list[tuple[str, dict]]) -> None:
    """Plans used together (each already checked against the run by load_plan) must agree on the
    ledger hashes of every step they both name."""
    seen: dict[tuple[int, str], tuple[str, str]] = {}
    for name, plan in plans:
        for r in plan["ranges"]:
            for step, key in ((r["first"], "prev_hash"), (r["last"], "last_hash")):
                other = seen.setdefault((step, key), (name, r[key]))
                if other[1] != r[key]:
                    raise AttestError(f"plans {other[0]} and {name} disagree on the {key} of step {step} "
                                      f"({other[1][:16]}… vs {r[key][:16]}…)")


def planned_range(plan: dict, auditor: int, plan_file="plan") -> tuple[int, int]:
    for r in plan["ranges"]:
        if r["auditor"] == auditor:
            return r["first"], r["last"]
    raise AttestError(f"{plan_file}: no auditor {auditor} (the plan has auditors 0-{len(plan['ranges']) - 1})")
