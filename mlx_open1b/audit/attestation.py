"""The attestation: what an auditor's replay of a range certifies, sealed and optionally signed.

Attestation (JSON, kind "open1b-attestation/1", made by `make_attestation` from a replay):

    run, genesis, run_hash   the run and the ledger state it was replayed against
    range                    [first, last] steps; replayed_from_checkpoint_step: where the replay began
    verdict                  "certified" or "mismatch"
    certified_steps          {step: ledger record hash} of every step replayed equal
    first_mismatch, error    the first step and component that differ; why a replay could not run
    auditor, backend, hardware, software, contract_version, created
    environment              device, libraries and thread count of the replay
    plan                     {"hash", "auditor", "range"} when the range came from a plan, else null
    attestation_hash         hex SHA-256 of the canonical JSON (CONTRACT.md §11) of the attestation
                             without "attestation_hash" and "signature": the seal
    signature                optional: {"algorithm": "ed25519", "public_key": hex (32 bytes raw),
                             "value": hex (64 bytes)}, the Ed25519 signature of the ASCII bytes of
                             attestation_hash

Checking an attestation against the run is coverage.verify_attestation's.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import pathlib
import platform

from .. import __version__, cpu_ref
from ..backend import load as get_backend
from ..contract import CONTRACT_VERSION
from ..fsutil import WriteError, write_bytes_atomic, write_json_atomic
from ..ledger import canonical, canonical_dumps
from .run import AttestError

# cryptography is optional (the `sign` extra): imported by the functions that sign and verify

ATT_KIND = "open1b-attestation/1"
_UNSEALED = ("attestation_hash", "signature")


def make_attestation(run, first, last, backend, auditor, out, verdict, start, certified, first_mismatch=None,
                     error=None, genesis=None, run_hash=None) -> dict:
    """The sealed attestation of a replay of steps first..last of `run` (replayed from checkpoint
    `start`; certified: {step: record hash}); written atomically to `out` unless it is None."""
    att = {
        "kind": ATT_KIND, "run": str(run.resolve()), "genesis": genesis, "run_hash": run_hash,
        "range": [first, last], "verdict": verdict, "replayed_from_checkpoint_step": start,
        "certified_steps": {str(k): v for k, v in certified.items()},
        "first_mismatch": first_mismatch, "error": error, "auditor": auditor, "backend": backend,
        "hardware": {"machine": platform.machine(), "processor": platform.processor(),
                     "system": f"{platform.system()} {platform.release()}", "python": platform.python_version()},
        "software": f"mlx-open1b {__version__}", "contract_version": CONTRACT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(backend), "plan": None,
    }
    seal(att)        # attestation_hash: what a collective-audit report verifies (coverage.py)
    if out is not None:
        write_attestation(out, att)
    return att


def write_attestation(out, att: dict) -> None:
    """att written atomically to `out`; a WriteError says which verdict it could not record (the
    replay took minutes: the user learns its outcome even so)."""
    try:
        write_json_atomic(out, att)
    except WriteError as e:
        a, b = att["range"]
        raise e.context(at=f"(the attestation of steps {a}-{b}: {att['verdict']})",
                        intact="the run (an audit only reads it)",
                        then="run the same audit with an --out that can be written") from None


# ------------------------------------------------------------------------------- sealing, signing

def _need_crypto() -> None:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise AttestError("Ed25519 signing and signature checks need the cryptography package: "
                          "pip install 'mlx-open1b[sign]'") from None


def digest(obj: dict, drop) -> str:
    """hex SHA-256 of the canonical JSON (CONTRACT.md §11) of obj without the keys in `drop`: the
    seal of an attestation (and of a plan)."""
    body = canonical({k: v for k, v in obj.items() if k not in drop}, "attestation")
    return hashlib.sha256(canonical_dumps(body).encode("ascii")).hexdigest()


def seal_of(att: dict) -> str:
    """What att["attestation_hash"] must be: the digest of everything but the seal and the signature."""
    return digest(att, _UNSEALED)


def seal(att: dict) -> dict:
    """Set att["attestation_hash"] over everything but the seal and the signature (which is
    dropped: it signed the old seal). Returns att."""
    att.pop("signature", None)
    att["attestation_hash"] = seal_of(att)
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
            env["device"] = f"C reference (SIMD {cpu_ref.simd_name()})"
            env["threads"] = cpu_ref.get_num_threads()
        else:
            env["device"] = get_backend(backend).available()[1]
    except Exception as e:   # noqa: BLE001 - descriptive only
        env["device"] = f"unknown ({type(e).__name__})"
    return env


def hardware_label(att: dict) -> str:
    """A short label of the machine and device an attestation was made on."""
    env = att.get("environment") if isinstance(att.get("environment"), dict) else {}
    hw = att.get("hardware") if isinstance(att.get("hardware"), dict) else {}
    dev = str(env.get("device") or "")                 # any JSON value: the file is not trusted yet
    cpu = str(env.get("cpu") or hw.get("processor") or "")
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
    _need_crypto()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    p = pathlib.Path(path)
    if p.exists():
        raise AttestError(f"{p}: exists; not overwriting a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_bytes_atomic(p, pem, mode=0o600)
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
    if not t or not p.is_file():
        raise AttestError(f"--trust {text!r}: neither 64 hex digits nor a key file")
    _need_crypto()
    from cryptography.hazmat.primitives import serialization
    try:
        data = p.read_bytes()
    except OSError as e:
        raise AttestError(f"--trust {p}: cannot read it ({e.strerror or e})") from None
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


def check_signature(att: dict) -> str | None:
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
