"""The run's ledger: one JSON line per optimizer step, each chained to the one before (DESIGN §7).

A record is a JSON object given by the trainer (step, windows, lr, loss, grad_norm, clip/skip
flags, eval, hashes: {batch, params, opt_state, grads}, ...). The ledger adds

    "prev": the previous record's "hash" (the run's genesis hash for the first record)
    "hash": SHA-256 (hex) of the canonical JSON of the record without "hash"

Canonical JSON (CONTRACT.md, "Hashes, ledger and checkpoints"): keys sorted, separators "," and
":" with no whitespace, non-ASCII characters as \\uXXXX, integers in decimal, floats as Python's
repr (the shortest text that reads back to the same binary64; non-finite ones as NaN, Infinity,
-Infinity), true/false/null. Each line of the file is the canonical JSON of the whole record (with
"hash") and a newline, so equal runs have byte-identical ledgers.

The last record's hash is the run hash. Records are appended with write + flush + fsync. A crash
can leave an incomplete last line (bytes after the last newline): opening a Ledger for writing
removes it with a warning; `verify_chain` reports it as an error. Nothing else is ever repaired.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import warnings

import numpy as np

from .fsutil import append_durable, write_bytes_atomic

FORMAT = "open1b-ledger/1"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class LedgerError(Exception):
    """A ledger that is broken, edited or unusable; .line (1-based) and .step locate it."""

    def __init__(self, msg: str, line: int | None = None, step=None):
        super().__init__(msg)
        self.line, self.step = line, step


# ------------------------------------------------------------------------------- canonical JSON
def canonical(obj, where: str = "record"):
    """A copy of obj with only JSON types: numpy scalars become int/float/bool (exactly), tuples
    and numpy arrays become lists, dataclasses dicts. Keys must be strings."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj)                 # float32 -> float64 is exact
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise LedgerError(f"{where}: key {k!r} is not a string")
            out[k] = canonical(v, f"{where}.{k}")
        return out
    if isinstance(obj, (list, tuple)):
        return [canonical(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, np.ndarray):
        return canonical(obj.tolist(), where)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return canonical(dataclasses.asdict(obj), where)
    raise LedgerError(f"{where}: a value of type {type(obj).__name__} cannot be written as JSON")


def canonical_dumps(obj) -> str:
    """The canonical JSON text of an object made of JSON types (see the module docstring)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def record_hash(record: dict) -> str:
    """SHA-256 (hex) of the canonical JSON of the record without its "hash" field."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical_dumps(body).encode("ascii")).hexdigest()


def genesis_hash(config, manifest_fingerprint: str, tokenizer_sha256: str, contract_version: int) -> str:
    """The chain's anchor: SHA-256 of the canonical JSON of
    {"config": <config JSON>, "contract_version": v, "format": "open1b-ledger/1",
     "manifest": <corpus manifest fingerprint>, "tokenizer": <tokenizer SHA-256>}.
    config: a RunConfig (its to_json()) or the config's JSON object."""
    cfg = config.to_json() if hasattr(config, "to_json") else config
    body = canonical({"config": cfg, "contract_version": int(contract_version), "format": FORMAT,
                      "manifest": str(manifest_fingerprint), "tokenizer": str(tokenizer_sha256)}, "genesis")
    return hashlib.sha256(canonical_dumps(body).encode("ascii")).hexdigest()


# ------------------------------------------------------------------------------- reading
def _split(data: bytes) -> tuple[list[bytes], bytes]:
    """(complete lines without their newline, the incomplete tail after the last newline)."""
    cut = data.rfind(b"\n") + 1
    lines = data[:cut].split(b"\n")[:-1] if cut else []
    return lines, data[cut:]


def _step_of(raw: bytes):
    try:
        return json.loads(raw).get("step")
    except Exception:
        m = re.search(rb'"step":\s*(-?\d+)', raw)
        return int(m.group(1)) if m else None


def _check_lines(path, lines: list[bytes], genesis: str) -> list[dict]:
    """Parse and verify complete lines; LedgerError at the first bad one."""
    if not _HEX64.fullmatch(str(genesis)):
        raise LedgerError(f"{path}: genesis must be a 64-digit lowercase hex SHA-256, got {genesis!r}")
    out: list[dict] = []
    prev, prev_step = genesis, None
    for i, raw in enumerate(lines, 1):
        step = _step_of(raw)
        at = f"{path}: line {i} (step {step})"
        try:
            rec = json.loads(raw.decode("ascii"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:    # nesting too deep too
            raise LedgerError(f"{at}: not a JSON record ({e})", i, step) from None
        if not isinstance(rec, dict):
            raise LedgerError(f"{at}: not a JSON object", i, step)
        if not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
            raise LedgerError(f"{at}: no integer \"step\" field", i, step)
        for f in ("prev", "hash"):
            if not isinstance(rec.get(f), str) or not _HEX64.fullmatch(rec[f]):
                raise LedgerError(f"{at}: field {f!r} missing or not a hex SHA-256", i, step)
        want = record_hash(rec)
        if rec["hash"] != want:
            raise LedgerError(f"{at}: record edited: its fields hash to {want[:16]}…, the line says "
                              f"{rec['hash'][:16]}…", i, step)
        if canonical_dumps(rec).encode("ascii") != raw:
            raise LedgerError(f"{at}: the line is not the canonical JSON of its record "
                              f"(reformatted or duplicate keys)", i, step)
        if rec["prev"] != prev:
            if i == 1:
                why = "does not match the run's genesis hash (another run's ledger, or lines deleted before it)"
            else:
                why = (f"does not match the hash of line {i - 1} (step {prev_step}): a line was deleted, "
                       f"inserted or reordered here, or line {i - 1} was edited and re-hashed")
            raise LedgerError(f"{at}: broken chain: prev {rec['prev'][:16]}… {why}", i, step)
        if prev_step is not None and rec["step"] <= prev_step:
            raise LedgerError(f"{at}: step does not increase (line {i - 1} is step {prev_step})", i, step)
        out.append(rec)
        prev, prev_step = rec["hash"], rec["step"]
    return out


def verify_chain(path, genesis: str) -> str:
    """Verify every record of the ledger at `path` against the run's genesis hash and return the
    run hash (the genesis hash if the ledger has no records). LedgerError names the line number
    and step of the first edited record or broken link, or an incomplete (torn) last line."""
    path = pathlib.Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LedgerError(f"{path}: no ledger") from None
    lines, tail = _split(data)
    recs = _check_lines(path, lines, genesis)
    if tail:
        n = len(lines) + 1
        raise LedgerError(f"{path}: line {n} (step {_step_of(tail)}): incomplete last line "
                          f"({len(tail)} bytes without a newline: the run stopped mid-write)", n, _step_of(tail))
    return recs[-1]["hash"] if recs else genesis


def read_records(path) -> list[dict]:
    """The ledger's records in file order (not verified: see verify_chain)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_hash(path) -> str:
    """The hash of the ledger's last complete record (not verified: see verify_chain)."""
    path = pathlib.Path(path)
    try:
        lines, _ = _split(path.read_bytes())
    except FileNotFoundError:
        raise LedgerError(f"{path}: no ledger") from None
    if not lines:
        raise LedgerError(f"{path}: the ledger has no records")
    try:
        h = json.loads(lines[-1])["hash"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        raise LedgerError(f"{path}: line {len(lines)}: not a ledger record", len(lines)) from None
    return h


# ------------------------------------------------------------------------------- writing
class Ledger:
    """An open ledger. Opening verifies the existing chain (LedgerError if it is broken) and
    removes an incomplete last line left by a crash, with a warning. Only the last record is kept
    in memory (a run of a million steps holds one record, not a million); the rest is read from
    the file when asked for (records, truncate_after, record_at: rare)."""

    def __init__(self, path, genesis: str):
        self.path = pathlib.Path(path)
        self.genesis = genesis
        data = self.path.read_bytes() if self.path.exists() else b""
        lines, tail = _split(data)
        recs = _check_lines(self.path, lines, genesis)
        self._last, self._count = (recs[-1] if recs else None), len(recs)
        del recs
        if tail:
            warnings.warn(f"{self.path}: removing an incomplete last line ({len(tail)} bytes, "
                          f"line {len(lines) + 1}) left by an interrupted write", RuntimeWarning, stacklevel=2)
            with open(self.path, "rb+") as f:
                f.truncate(len(data) - len(tail))
                f.flush()
                os.fsync(f.fileno())

    @property
    def last_hash(self) -> str:
        return self._last["hash"] if self._last else self.genesis

    @property
    def last_step(self):
        return self._last["step"] if self._last else None

    def __len__(self) -> int:
        return self._count

    def records(self) -> list[dict]:
        """The records, oldest first, read back from the file (verified again: this process is the
        run's one writer, RunDir.lock, so they are the ones it verified and appended)."""
        lines, _ = _split(self.path.read_bytes()) if self.path.exists() else ([], b"")
        return _check_lines(self.path, lines, self.genesis)

    def append(self, record: dict) -> str:
        """Add "prev" and "hash" to a copy of the record, append it as one line, flush and fsync;
        return its hash. The record needs an integer "step" above the last record's. A write that
        fails (fsutil.WriteError) leaves the file as it was: the ledger through the last record."""
        if not isinstance(record, dict):
            raise LedgerError(f"{self.path}: a record is a dict, got {type(record).__name__}")
        for f in ("prev", "hash"):
            if f in record:
                raise LedgerError(f"{self.path}: the record already has a {f!r} field (the ledger sets it)")
        rec = canonical(record)
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise LedgerError(f"{self.path}: the record needs an integer \"step\", got {step!r}")
        if self._last and step <= self._last["step"]:
            raise LedgerError(f"{self.path}: step {step} does not follow the last record's step "
                              f"{self._last['step']}", step=step)
        rec["prev"] = self.last_hash
        rec["hash"] = record_hash(rec)
        line = (canonical_dumps(rec) + "\n").encode("ascii")
        append_durable(self.path, line)  # fsutil.WriteError on failure, the file cut back to its last record
        self._last, self._count = rec, self._count + 1
        return rec["hash"]

    def truncate_after(self, step: int) -> int:
        """Keep the records with step <= `step` (resume from a checkpoint at `step`); the file is
        rewritten atomically. Returns how many records were removed."""
        if self._last is None or self._last["step"] <= step:
            return 0
        keep = [r for r in self.records() if r["step"] <= step]
        removed = self._count - len(keep)
        write_bytes_atomic(self.path, "".join(canonical_dumps(r) + "\n" for r in keep).encode("ascii"))
        self._last, self._count = (keep[-1] if keep else None), len(keep)
        return removed

    def record_at(self, step: int) -> dict | None:
        if self._last is not None and self._last["step"] == step:     # the record just appended
            return copy.deepcopy(self._last)
        return next((r for r in self.records() if r["step"] == step), None)

