"""Collective audit (DESIGN §8, paper §5): plans, sealed and signed attestations, coverage reports.

No single auditor replays a whole run. A **plan** splits the run's steps 0..N-1 into K contiguous
ranges that each start at a checkpoint (so an auditor replays nothing outside its range), optionally
extended by S steps into the next auditor's range (overlap: two auditors certify those steps). Each
auditor replays its range (`certify`, on any backend and machine) and writes an **attestation**; a
**report** merges attestations into coverage — which steps are certified, by how many auditors, on
which backends and hardware, any disagreement, the uncovered ranges — and says whether the run hash
is fully certified.

Attestation (JSON, kind "open1b-attestation/1", written by `audit.audit`): genesis, run_hash, range,
verdict ("certified" or "mismatch"), certified_steps {step: ledger record hash}, first_mismatch,
auditor, backend, hardware, software, contract_version, plus what this module adds:

    environment       device, libraries and thread count of the replay
    plan              {"hash", "auditor", "range"} when the range came from a plan, else null
    attestation_hash  hex SHA-256 of the canonical JSON (CONTRACT.md §11) of the attestation
                      without "attestation_hash" and "signature": the seal
    signature         optional: {"algorithm": "ed25519", "public_key": hex (32 bytes raw),
                      "value": hex (64 bytes)}, the Ed25519 signature of the ASCII bytes of
                      attestation_hash

Verification against the run (`verify_attestation`): the seal; the signature (when present, and
required / restricted to trusted keys when asked); the genesis (another run's attestation is
rejected); the run hash (an attestation of another ledger or of an earlier state of this one is
rejected, the latter accepted with allow_prefix); the contract version; the range; every certified
step's record hash against the ledger's; the plan range when the plan is given. A rejected
attestation is listed with its reason and never counts towards coverage.

A plan (kind "open1b-audit-plan/1") records the run hash, the genesis, the checkpoints it uses and
for each range its first and last step, its checkpoint and the ledger hashes at both ends; it is
sealed by "plan_hash". Plans are checked against the run's ledger wherever they are used: a plan
made from another ledger (or one that disagrees with another plan on a hash) is an error, as is a
planned range whose checkpoint the run does not have.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import pathlib
import platform
from dataclasses import dataclass, field

from .checkpoint import META_FILE, checkpoint_dir, list_checkpoints
from .fsutil import write_bytes_atomic, write_json_atomic
from .ledger import LedgerError, canonical, canonical_dumps, read_records, verify_chain

ATT_KIND = "open1b-attestation/1"
PLAN_KIND = "open1b-audit-plan/1"
_UNSEALED = ("attestation_hash", "signature")


class AttestError(Exception):
    """Bad input for a plan, an audit or a report; the message names the file, step or field.
    exit_code for the CLI (2: bad input, 1: the run's own artifacts are broken)."""

    def __init__(self, msg: str, exit_code: int = 2):
        super().__init__(msg)
        self.exit_code = exit_code


# ------------------------------------------------------------------------------- the run
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
    from .train import LEDGER_FILE, RUN_FILE
    run = pathlib.Path(run_dir)
    rf = run / RUN_FILE
    if not run.is_dir() or not rf.exists():
        raise AttestError(f"{run}: not a run directory (no {RUN_FILE})")
    try:
        info = json.loads(rf.read_text())
        genesis = info["genesis"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise AttestError(f"{rf}: malformed ({e})", exit_code=1) from None
    try:
        final = verify_chain(run / LEDGER_FILE, genesis)
    except LedgerError as e:
        raise AttestError(f"the run's ledger does not verify: {e}", exit_code=1) from None
    records = read_records(run / LEDGER_FILE)
    if not records:
        raise AttestError(f"{run / LEDGER_FILE}: the ledger is empty: nothing to audit")
    for i, r in enumerate(records):
        if r["step"] != i:
            raise AttestError(f"{run / LEDGER_FILE}: line {i + 1} is step {r['step']}, expected {i} "
                              f"(steps must run 0..N-1 without gaps)", exit_code=1)
    return RunView(run, genesis, info.get("contract_version"), records, final,
                   [s for s, _ in list_checkpoints(run)])


def _checkpoint_meta(run: RunView, step: int) -> dict:
    """meta.json of ckpt-<step>, checked against its meta_hash, the run's genesis and, for step > 0,
    the ledger's parameter and optimizer-state hashes after step - 1 (the tensors themselves are
    verified when an auditor loads them)."""
    from .checkpoint import _meta_hash
    d = checkpoint_dir(run.dir, step)
    mp = d / META_FILE
    if not mp.exists():
        raise AttestError(f"{d}: missing (no {META_FILE})")
    try:
        meta = json.loads(mp.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
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


# ------------------------------------------------------------------------------- sealing, signing

def _need_crypto() -> None:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise AttestError("Ed25519 signing and signature checks need the cryptography package: "
                          "pip install 'mlx-open1b[sign]'") from None


def _digest(obj: dict, drop) -> str:
    body = canonical({k: v for k, v in obj.items() if k not in drop}, "attestation")
    return hashlib.sha256(canonical_dumps(body).encode("ascii")).hexdigest()


def seal(att: dict) -> dict:
    """Set att["attestation_hash"] over everything but the seal and the signature (which is
    dropped: it signed the old seal). Returns att."""
    att.pop("signature", None)
    att["attestation_hash"] = _digest(att, _UNSEALED)
    return att


def environment(backend: str) -> dict:
    """Where a replay ran: the backend's device description, thread count and library versions."""
    env: dict = {"backend": backend, "libraries": {}}
    for dist in ("numpy", "mlx", "cupy-cuda12x", "cupy-cuda13x", "torch"):
        try:
            env["libraries"][dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    env["cpu"] = cpu
    try:
        if backend == "cpu_ref":
            from . import cpu_ref
            env["device"] = f"C reference (SIMD {cpu_ref.simd_name()})"
            env["threads"] = cpu_ref.get_num_threads()
        else:
            from .train import get_backend
            env["device"] = get_backend(backend).available()[1]
    except Exception as e:   # noqa: BLE001 - descriptive only
        env["device"] = f"unknown ({type(e).__name__})"
    return env


def hardware_label(att: dict) -> str:
    """A short label of the machine and device an attestation was made on."""
    env = att.get("environment") or {}
    hw = att.get("hardware") or {}
    dev = env.get("device", "")
    cpu = env.get("cpu") or hw.get("processor") or ""
    label = f"{hw.get('machine', '?')} {cpu}".strip()
    if dev and not dev.startswith("C reference"):
        label += f"; {dev}"
    return label


def load_private_key(path):
    """An Ed25519 private key from a PEM (PKCS#8) file."""
    _need_crypto()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    p = pathlib.Path(path)
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except FileNotFoundError:
        raise AttestError(f"{p}: no such key file") from None
    except (ValueError, TypeError) as e:
        raise AttestError(f"{p}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AttestError(f"{p}: not an Ed25519 key ({type(key).__name__})")
    return key


def public_key_hex(key) -> str:
    _need_crypto()
    from cryptography.hazmat.primitives import serialization
    pub = key.public_key() if hasattr(key, "public_key") else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def generate_key(path) -> str:
    """Write a new Ed25519 private key (PEM, PKCS#8, mode 0600) and return its public key (hex)."""
    import os

    _need_crypto()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    p = pathlib.Path(path)
    if p.exists():
        raise AttestError(f"{p}: exists; not overwriting a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_bytes_atomic(p, pem)
    os.chmod(p, 0o600)
    return public_key_hex(key)


def sign(att: dict, key) -> dict:
    """Seal att and sign its seal with an Ed25519 private key (object or PEM path)."""
    if not hasattr(key, "sign"):
        key = load_private_key(key)
    seal(att)
    att["signature"] = {"algorithm": "ed25519", "public_key": public_key_hex(key),
                        "value": key.sign(att["attestation_hash"].encode("ascii")).hex()}
    return att


def parse_public_key(text: str) -> str:
    """A trusted key given as 64 hex digits, or a PEM public/private key file: -> hex."""
    t = text.strip()
    if len(t) == 64 and all(c in "0123456789abcdefABCDEF" for c in t):
        return t.lower()
    p = pathlib.Path(t)
    if not p.exists():
        raise AttestError(f"--trust {text}: neither 64 hex digits nor a key file")
    _need_crypto()
    from cryptography.hazmat.primitives import serialization
    data = p.read_bytes()
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise AttestError(f"{p}: not a PEM key ({e})") from None
    try:
        return public_key_hex(key)
    except Exception:   # noqa: BLE001 - not Ed25519
        raise AttestError(f"{p}: not an Ed25519 key") from None


def _check_signature(att: dict) -> str | None:
    """None if the signature verifies, else the reason."""
    _need_crypto()
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    sig = att["signature"]
    if not isinstance(sig, dict) or sig.get("algorithm") != "ed25519":
        return f"signature: unknown algorithm {sig.get('algorithm') if isinstance(sig, dict) else sig!r}"
    try:
        pub = Ed25519PublicKey.from_public_bytes(bytes.fromhex(sig["public_key"]))
        pub.verify(bytes.fromhex(sig["value"]), att["attestation_hash"].encode("ascii"))
    except InvalidSignature:
        return "signature: does not verify (the attestation was altered after signing, or forged)"
    except (KeyError, TypeError, ValueError) as e:
        return f"signature: malformed ({e})"
    return None


# ------------------------------------------------------------------------------- plans
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
        _checkpoint_meta(run, s)
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
    plan["plan_hash"] = _digest(plan, ("plan_hash",))
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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AttestError(f"{p}: not JSON ({e})") from None
    if not isinstance(plan, dict) or plan.get("kind") != PLAN_KIND:
        raise AttestError(f"{p}: not an audit plan (kind {plan.get('kind') if isinstance(plan, dict) else None!r}, "
                          f"expected {PLAN_KIND!r})")
    if plan.get("plan_hash") != _digest(plan, ("plan_hash",)):
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


# ------------------------------------------------------------------------------- certify
def certify(run_dir, first: int | None = None, last: int | None = None, backend: str = "cpu_ref",
            auditor: str = "anonymous", key=None, plan_file=None, auditor_index: int | None = None,
            out=None, progress=None) -> dict:
    """Replay and certify a range (from --range, or auditor `auditor_index`'s range of a plan) and
    return the sealed (and, with a key, signed) attestation; written atomically to `out`."""
    from .audit import audit
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
        if not checkpoint_dir(run.dir, a).is_dir():
            raise AttestError(f"{plan_file}: range {a}:{b} (auditor {auditor_index}) starts from checkpoint "
                              f"ckpt-{a:08d}, which {run.dir} does not have")
        _checkpoint_meta(run, a)
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
        write_json_atomic(out, att)
    return att


# ------------------------------------------------------------------------------- verification
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
    if att["attestation_hash"] != _digest(att, _UNSEALED):
        return [f"tampered: its contents hash to {_digest(att, _UNSEALED)[:16]}…, its attestation_hash "
                f"says {str(att['attestation_hash'])[:16]}…"]
    signed = att.get("signature") is not None
    if signed:
        why = _check_signature(att)
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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
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
