"""Coverage: attestations verified against the run and merged into which steps are certified.

No single auditor replays a whole run; each certifies a range (replay.certify). A **report** merges
their attestations into coverage: which steps are certified, by how many auditors, on which
backends and hardware, any disagreement, the uncovered ranges, and whether the run hash is fully
certified (kind "open1b-audit-report/1").

Verification against the run (`verify_attestation`): the seal; the signature (when present, and
required / restricted to trusted keys when asked); the genesis (another run's attestation is
rejected); the run hash (an attestation of another ledger or of an earlier state of this one is
rejected, the latter accepted with allow_prefix); the contract version; the range; every certified
step's record hash against the ledger's; the plan range when the plan is given. A rejected
attestation is listed with its reason and never counts towards coverage.
"""
from __future__ import annotations

import datetime
import json
import pathlib

from .attestation import ATT_KIND, check_signature, hardware_label, parse_public_key, seal_of
from .plan import check_plans, load_plan, planned_range
from .run import AttestError, RunView, load_run


_REQUIRED = {"kind": str, "genesis": str, "range": list, "verdict": str, "certified_steps": dict,
             "auditor": str, "backend": str, "contract_version": int}


def verify_attestation(att, run: RunView, trusted: set | None = None, require_signed: bool = False,
                       allow_prefix: bool = False, plans: dict | None = None) -> list[str]:
    """The reasons to reject `att` for `run` (an empty list: accepted)."""
    if not isinstance(att, dict) or att.get("kind") != ATT_KIND:
        kind = att.get("kind") if isinstance(att, dict) else type(att).__name__
        return [f"not an open1b attestation (kind {kind!r})"]
    for f, t in _REQUIRED.items():
        if not isinstance(att.get(f), t) or isinstance(att.get(f), bool):
            return [f"field {f!r} missing or not a {t.__name__}"]
    if "attestation_hash" not in att:
        return ["unsealed (no attestation_hash): its contents cannot be checked"]
    if att["attestation_hash"] != seal_of(att):
        return [f"tampered: its contents hash to {seal_of(att)[:16]}…, its attestation_hash "
                f"says {str(att['attestation_hash'])[:16]}…"]
    signed = att.get("signature") is not None
    if signed:
        why = check_signature(att)
        if why:
            return [why]
    if att["genesis"] != run.genesis:
        return [f"an attestation for another run (genesis {att['genesis'][:16]}…; this run's is {run.genesis[:16]}…)"]
    if signed and trusted is not None and att["signature"]["public_key"].lower() not in trusted:
        return [f"signed by an untrusted key {att['signature']['public_key'][:16]}…"]
    if not signed and (require_signed or trusted is not None):
        return ["not signed (signatures are required)"]
    if att.get("error"):
        return [f"the auditor could not replay: {att['error']}"]
    if att["contract_version"] != run.contract_version:
        return [f"made under contract v{att['contract_version']}, the run is v{run.contract_version}"]
    rh = att.get("run_hash")
    if rh != run.run_hash:
        at = next((r["step"] for r in run.records if r["hash"] == rh), None)
        if at is None:
            return [f"run hash {str(rh)[:16]}… is not in this run's ledger (run hash {run.run_hash[:16]}…): "
                    f"made against another ledger"]
        if not allow_prefix:
            return [f"made against an earlier state of this ledger (ending at step {at}, the ledger now ends at "
                    f"{run.steps - 1}); re-audit, or accept prefixes with --allow-prefix"]
    try:
        a, b = (int(x) for x in att["range"])
    except (TypeError, ValueError):
        return [f"range {att['range']!r} malformed"]
    if not (0 <= a <= b < run.steps):
        return [f"range {a}:{b} is outside the run's steps 0-{run.steps - 1}"]
    if att["verdict"] == "certified":
        want = set(range(a, b + 1))
    elif att["verdict"] == "mismatch":
        m = att.get("first_mismatch")
        lo = att.get("replayed_from_checkpoint_step")
        lo = lo if isinstance(lo, int) and 0 <= lo <= a else a
        if not isinstance(m, dict) or not isinstance(m.get("step"), int) or not lo <= m["step"] <= b:
            return ["verdict mismatch without a first_mismatch step among the steps it replayed"]
        want = set(range(a, max(a, m["step"])))
    else:
        return [f"unknown verdict {att['verdict']!r}"]
    try:
        got = {int(k): v for k, v in att["certified_steps"].items()}
    except ValueError:
        return ["certified_steps: keys are not step numbers"]
    if set(got) != want:
        extra, missing = sorted(set(got) - want), sorted(want - set(got))
        return [f"certified_steps do not match its range {a}:{b} and verdict (extra {extra[:5]}, missing {missing[:5]})"]
    for s in sorted(got):
        if got[s] != run.record_hash(s):
            return [f"step {s}: certified record hash {str(got[s])[:16]}… differs from the ledger's "
                    f"{run.record_hash(s)[:16]}… (tampered, or made against another ledger)"]
    p = att.get("plan")
    if p is not None and plans:
        if not isinstance(p, dict):
            return ["plan: malformed"]
        if p.get("hash") in plans:
            try:
                pa, pb = planned_range(plans[p["hash"]], p.get("auditor"))
            except AttestError as e:
                return [f"plan: {e}"]
            if [pa, pb] != [a, b] or p.get("range") != [a, b]:
                return [f"range {a}:{b} differs from auditor {p.get('auditor')}'s planned range {pa}:{pb}"]
    return []


def _read_attestation(path) -> dict:
    p = pathlib.Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise AttestError(f"{p}: no such attestation file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise AttestError(f"{p}: not JSON ({e}); no report is made from a partial set of attestations") from None


def _segments(N: int, cover: list[list[int]]) -> list[tuple[int, int, tuple]]:
    """Maximal runs of steps with the same set of covering attestation indices."""
    out, a = [], 0
    for s in range(1, N + 1):
        if s == N or cover[s] != cover[a]:
            out.append((a, s - 1, tuple(cover[a])))
            a = s
    return out


def _ranges(steps: list[int]) -> list[list[int]]:
    out = []
    for s in steps:
        if out and out[-1][1] == s - 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def report(run_dir, attestation_files, plan_files=(), trusted_keys=None, require_signed: bool = False,
           allow_prefix: bool = False) -> dict:
    """Verify every attestation against the run and merge the accepted ones into coverage."""
    run = load_run(run_dir)
    if not attestation_files:
        raise AttestError("no attestations given")
    plans = [(str(f), load_plan(f, run)) for f in plan_files]
    check_plans(plans)
    by_hash = {p["plan_hash"]: p for _, p in plans}
    trusted = {parse_public_key(k) for k in trusted_keys} if trusted_keys else None
    entries, seen = [], {}
    for f in attestation_files:
        att = _read_attestation(f)
        reasons = verify_attestation(att, run, trusted, require_signed, allow_prefix, by_hash)
        e = {"file": str(f), "status": "rejected" if reasons else "accepted", "reasons": reasons}
        if isinstance(att, dict):
            sig = att.get("signature")
            e.update(auditor=str(att.get("auditor")), backend=str(att.get("backend")), range=att.get("range"),
                     verdict=att.get("verdict"), hardware=hardware_label(att),
                     key=(sig.get("public_key") if isinstance(sig, dict) else None))
        h = att.get("attestation_hash") if isinstance(att, dict) else None
        if not reasons and h in seen:
            e["status"], e["reasons"] = "duplicate", [f"the same attestation as {seen[h]}"]
        elif not reasons:
            seen[h] = str(f)
            e["_att"] = att
        entries.append(e)
    accepted = [e for e in entries if e["status"] == "accepted"]
    N = run.steps
    cover: list[list[int]] = [[] for _ in range(N)]
    disagreements = []
    for i, e in enumerate(accepted):
        att = e["_att"]
        for s in att["certified_steps"]:
            cover[int(s)].append(i)
    for e in accepted:
        att = e["_att"]
        if att["verdict"] == "mismatch":
            m = att["first_mismatch"]
            disagreements.append({"step": m["step"], "component": m.get("component"), "field": m.get("field"),
                                  "recorded": m.get("recorded"), "replayed": m.get("replayed"),
                                  "auditor": e["auditor"], "backend": e["backend"], "hardware": e["hardware"],
                                  "file": e["file"],
                                  "certified_by": sorted({accepted[j]["auditor"] for j in cover[m["step"]]})})
    coverage = []
    for a, b, idx in _segments(N, cover):
        who = [accepted[j] for j in idx]
        coverage.append({"first": a, "last": b, "steps": b - a + 1, "attestations": len(who),
                         "auditors": sorted({_identity(w) for w in who}),
                         "backends": sorted({w["backend"] for w in who}),
                         "hardware": sorted({w["hardware"] for w in who})})
    uncovered = _ranges([s for s in range(N) if not cover[s]])
    unplanned = []
    for name, plan in plans:
        for r in plan["ranges"]:
            if not any(e["_att"].get("plan") and e["_att"]["plan"].get("hash") == plan["plan_hash"]
                       and e["_att"]["plan"].get("auditor") == r["auditor"] and e["_att"]["verdict"] == "certified"
                       for e in accepted):
                unplanned.append({"plan": name, "auditor": r["auditor"], "range": [r["first"], r["last"]]})
    full = not uncovered and not disagreements
    for e in entries:
        e.pop("_att", None)
    rejected = [e for e in entries if e["status"] == "rejected"]
    return {"kind": "open1b-audit-report/1", "run": str(run.dir), "genesis": run.genesis, "run_hash": run.run_hash,
            "steps": N, "fully_certified": full, "attestations": entries, "accepted": len(accepted),
            "rejected": len(rejected), "coverage": coverage, "uncovered": uncovered,
            "disagreements": disagreements, "planned_ranges_without_attestation": unplanned,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _identity(e: dict) -> str:
    return e["auditor"] + (f" [{e['key'][:8]}]" if e.get("key") else "")


def format_report(rep: dict) -> str:
    """The report as text: attestations, the coverage table, disagreements, the verdict."""
    L = [f"run {rep['run']}", f"  run hash {rep['run_hash']}  ({rep['steps']} steps 0-{rep['steps'] - 1})",
         f"attestations: {len(rep['attestations'])} given, {rep['accepted']} accepted, {rep['rejected']} rejected"]
    for e in rep["attestations"]:
        rng = e.get("range")
        rs = f"{rng[0]}-{rng[1]}" if isinstance(rng, list) and len(rng) == 2 else "?"
        head = f"  {e['status'].upper():9s} {e['file']}  ({e.get('auditor', '?')}, {e.get('backend', '?')}, steps {rs}"
        head += f", {e.get('verdict')}" + (", signed" if e.get("key") else "") + ")"
        L.append(head)
        for r in e["reasons"]:
            L.append(f"            {r}")
    L.append("coverage:")
    w = max(5, *(len(f"{c['first']}-{c['last']}") for c in rep["coverage"]))
    L.append(f"  {'steps':{w}s} {'n':>3s}  {'auditors':24s} {'backends':16s} hardware")
    for c in rep["coverage"]:
        s = f"{c['first']}-{c['last']}" if c["last"] > c["first"] else f"{c['first']}"
        if not c["attestations"]:
            L.append(f"  {s:{w}s} {0:3d}  ** uncovered **")
            continue
        L.append(f"  {s:{w}s} {len(c['auditors']):3d}  {', '.join(c['auditors']):24s} "
                 f"{', '.join(c['backends']):16s} {' | '.join(c['hardware'])}")
    if rep["disagreements"]:
        L.append("disagreements:")
        for d in rep["disagreements"]:
            L.append(f"  step {d['step']}: {d['auditor']} ({d['backend']}, {d['hardware']}) replayed a different "
                     f"{d['component']} ({d['field']}: recorded {d['recorded']}, replayed {d['replayed']}); "
                     f"certified by: {', '.join(d['certified_by']) or 'nobody'}")
    else:
        L.append("disagreements: none")
    for u in rep["planned_ranges_without_attestation"]:
        L.append(f"planned range without a certifying attestation: {u['plan']} auditor {u['auditor']} "
                 f"(steps {u['range'][0]}-{u['range'][1]})")
    if rep["fully_certified"]:
        L.append(f"FULLY CERTIFIED: every step 0-{rep['steps'] - 1} is certified and nobody disagrees; "
                 f"run hash {rep['run_hash']}")
    else:
        why = []
        if rep["uncovered"]:
            why.append("uncovered steps " + ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in rep["uncovered"]))
        if rep["disagreements"]:
            why.append(f"{len(rep['disagreements'])} disagreement(s)")
        L.append(f"NOT fully certified: {'; '.join(why)}")
    if rep["rejected"]:
        L.append(f"({rep['rejected']} attestation(s) rejected; see above)")
    return "\n".join(L)
