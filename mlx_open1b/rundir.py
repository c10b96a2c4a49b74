"""A run directory: what a training run writes, and the one place that finds and reads it.

    RUN/run.json           RunInfo: the run's configuration, contract version, corpus and genesis hash
    RUN/ledger.jsonl       the chained step records (ledger.py), one per optimizer step
    RUN/ckpt-<step:08d>/   checkpoints (checkpoint.py)
    RUN/timing.jsonl       wall-clock step times, beside the ledger and in no hash (steptimes.py)
    RUN/writer.lock        the writer's lock (RunDir.lock): the pid and host of the process writing the run

One process writes a run directory at a time: train, resume and a distributed run's rank 0 hold an
exclusive flock on writer.lock from before their first write until they exit (the OS releases it
when the process dies, however it dies), and a second writer is refused naming the holder. Readers
(hash, audit, report, export, eval) never take it: every file they read is replaced atomically
(run.json, checkpoints) or appended one fsynced line at a time (the ledger, whose reader reports an
incomplete last line, see ledger.verify_chain).

run.json is written once, when the run starts, and never changes. Its config is hashed into the
genesis (ledger.genesis_hash) that every ledger record chains from, so it is written in the oldest
version of the config's JSON form that expresses it (the rule in config.py, at _ADDED_KEYS); the
version is inferred from the keys when run.json is read (RunInfo.config_version), never written.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import pathlib
import socket
import threading
import weakref

from .checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint, list_checkpoints, select_checkpoint
from .config import RunConfig, config_version
from .errors import Open1bError
from .fsutil import write_json_atomic
from .ledger import Ledger, LedgerError, read_records, verify_chain

RUN_FILE = "run.json"
LEDGER_FILE = "ledger.jsonl"
LOCK_FILE = "writer.lock"


class RunDirError(Open1bError):
    """A directory that is not a readable run; the message names it. exit_code for the CLI (2: not
    a run directory, 1: the run's own files are broken)."""


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """run.json: the run's identity, fixed when it starts."""
    config: RunConfig
    contract_version: int        # CONTRACT_VERSION the run was started under
    created_by: str              # "mlx-open1b <version>"
    corpus_dir: str              # the prepared corpus (resolved path)
    manifest_fingerprint: str    # data.stream.manifest_fingerprint of its manifest
    tokenizer_sha256: str
    genesis: str                 # ledger.genesis_hash of the config, corpus, tokenizer and contract
    config_version: int = 1      # the version of the config's JSON form (config.py); read, never written

    def to_json(self) -> dict:
        """run.json's object, its keys in the order they have always been written."""
        return {"config": self.config.to_json(), "contract_version": self.contract_version,
                "created_by": self.created_by, "corpus_dir": self.corpus_dir,
                "manifest_fingerprint": self.manifest_fingerprint, "tokenizer_sha256": self.tokenizer_sha256,
                "genesis": self.genesis}

    @classmethod
    def from_json(cls, d) -> "RunInfo":
        """ValueError naming the field of a run.json object that is missing or of the wrong type."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        fields = {}
        for f in dataclasses.fields(cls):
            if f.name in ("config", "config_version"):
                continue
            want = int if f.name == "contract_version" else str
            v = d.get(f.name)
            if not isinstance(v, want) or isinstance(v, bool):
                raise ValueError(f"{f.name}: expected {want.__name__}, got {v!r}")
            fields[f.name] = v
        if not isinstance(d.get("config"), dict):
            raise ValueError(f"config: expected an object, got {d.get('config')!r}")
        return cls(config=RunConfig.from_json(d["config"]), config_version=config_version(d["config"]), **fields)


class RunDir:
    """The files of one run directory: its run.json, its ledger and its checkpoints."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self.run_file = self.path / RUN_FILE
        self.ledger_file = self.path / LEDGER_FILE
        self.lock_file = self.path / LOCK_FILE
        self._hold = None

    # ------------------------------------------------------------------ the writer's lock
    def lock(self, error=RunDirError) -> None:
        """Become the run's one writer (creating the directory if needed): an exclusive flock on
        writer.lock, held until unlock(), until this RunDir is garbage-collected, or until the process
        exits. `error` (the caller's error class, exit code 2) when another process holds it, naming
        its pid and host. Within one process the lock is shared: the process is the writer, and a
        second RunDir of the same directory (a Trainer resumed in the same process) joins its hold."""
        if self._hold is not None:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._hold = _WriterLock.acquire(self.lock_file)
        except OSError as e:
            raise error(f"{self.lock_file}: cannot take the run's writer lock ({e.strerror or e})",
                        exit_code=2) from None
        if self._hold is None:
            holder = self.writer()
            who = (f"pid {holder['pid']} on host {holder['host']}" if holder else "another process")
            raise error(f"{self.path}: the run is being written by {who} (it holds {self.lock_file}); one "
                        f"writer per run directory: wait for it to finish or stop it (the lock is released "
                        f"when it exits), or train into another --out", exit_code=2)
        self._release = weakref.finalize(self, self._hold.release)

    def unlock(self) -> None:
        """Stop being the run's writer (this RunDir's share of the process's hold)."""
        if self._hold is not None:
            self._hold = None
            self._release()

    def writer(self) -> dict | None:
        """{"pid", "host"} of the process recorded as the run's writer, or None: nobody has written
        it yet, or the recorded writer has released the lock. Read without locking: a reader's view,
        for messages."""
        try:
            d = json.loads(self.lock_file.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if not isinstance(d, dict) or not isinstance(d.get("pid"), int) or not isinstance(d.get("host"), str):
            return None
        return {"pid": d["pid"], "host": d["host"]}

    # ------------------------------------------------------------------ run.json
    def exists(self) -> bool:
        """Whether a run was started here (it has a run.json)."""
        return self.run_file.is_file()

    def info(self, error=RunDirError) -> RunInfo:
        """run.json, parsed and typed; `error` (a class taking (message, exit_code=)) otherwise."""
        if not self.exists():
            raise error(f"{self.path}: not a run directory (no {RUN_FILE})", exit_code=2)
        try:
            return RunInfo.from_json(json.loads(self.run_file.read_text()))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:   # JSONDecodeError, ConfigError, deep nesting
            raise error(f"{self.run_file}: malformed ({e})", exit_code=1) from None

    def create(self, info: RunInfo) -> None:
        """Start the run: the directory and its run.json (written atomically). The writer calls
        lock() first."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run_file, info.to_json())

    def intact(self) -> str:
        """What of the run is on disk and good, for the message of a write that failed: run.json,
        the verified ledger's last step and run hash, the checkpoints (not loaded)."""
        try:
            info = self.info()
        except RunDirError:
            return f"nothing of a run in {self.path} (no run.json: it was not started)"
        try:
            run_hash = self.verify_ledger(info.genesis)
            recs = self.records()
            ledger = (f"the ledger through step {recs[-1]['step']} (run hash {run_hash[:16]}…)" if recs
                      else "an empty ledger")
        except LedgerError as e:
            ledger = f"a ledger that does not verify ({e})" if self.ledger_file.exists() else "no ledger yet"
        steps = [s for s, _ in self.checkpoints()]
        ckpts = f"checkpoints at steps {', '.join(map(str, steps))}" if steps else "no checkpoint"
        return f"{self.run_file.name}, {ledger}, {ckpts}"

    # ------------------------------------------------------------------ the ledger
    def ledger(self, genesis: str) -> Ledger:
        """The ledger for appending (its records verified from the genesis on opening)."""
        return Ledger(self.ledger_file, genesis)

    def verify_ledger(self, genesis: str) -> str:
        """The run hash: the ledger's chain verified from the genesis (ledger.LedgerError otherwise).
        An incomplete last line while a writer holds the run is a record being appended, and the
        error says so (readers do not wait for the writer)."""
        try:
            return verify_chain(self.ledger_file, genesis)
        except LedgerError as e:
            holder = self.writer() if "incomplete last line" in str(e) else None
            if holder is None or (holder["host"] == socket.gethostname() and not _alive(holder["pid"])):
                raise
            raise LedgerError(f"{e}; the run is being written (pid {holder['pid']} on host {holder['host']}): "
                              f"that is a record being appended, read it again", e.line, e.step) from None

    def records(self) -> list[dict]:
        """The ledger's records in file order (not verified: see verify_ledger)."""
        return read_records(self.ledger_file)

    def verified_records(self, error, nothing_to: str,
                         unverified: str = "the run's ledger does not verify") -> tuple[RunInfo, str, list[dict]]:
        """(run.json, the run hash, the records) of a run whose ledger verifies from its genesis and
        is not empty; otherwise `error` (the caller's error class): `unverified` and the cause (exit 1),
        or that an empty ledger leaves nothing to `nothing_to`."""
        info = self.info(error=error)
        try:
            run_hash = self.verify_ledger(info.genesis)
        except LedgerError as e:
            raise error(f"{unverified}: {e}", exit_code=1) from None
        records = self.records()
        if not records:
            raise error(f"{self.ledger_file}: the ledger is empty: nothing to {nothing_to}")
        return info, run_hash, records

    def params_hash_after(self, step: int, genesis: str, error=RunDirError) -> tuple[str | None, str | None]:
        """(the parameter hash the verified ledger records after step - 1, the run hash); None for the
        hash at step 0 or where the ledger has no such record, (None, None) without a ledger."""
        if not self.ledger_file.exists():
            return None, None
        try:
            run_hash = self.verify_ledger(genesis)
        except LedgerError as e:
            raise error(f"the run's ledger does not verify: {e}", exit_code=1) from None
        if step == 0:
            return None, run_hash
        rec = next((r for r in self.records() if r["step"] == step - 1), None)
        return (None if rec is None else rec["hashes"]["params"]), run_hash

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, step: int) -> pathlib.Path:
        """The directory of the checkpoint of `step` (the state after steps 0..step-1)."""
        return checkpoint_dir(self.path, step)

    def checkpoints(self) -> list[tuple[int, pathlib.Path]]:
        """[(step, directory)] of the complete checkpoints, ascending (not verified)."""
        return list_checkpoints(self.path)

    def latest_checkpoint(self, at_or_before: int | None = None) -> tuple[int, pathlib.Path] | None:
        """The newest checkpoint (with step <= at_or_before if given), or None."""
        return latest_checkpoint(self.path, at_or_before)

    def select_checkpoint(self, step: int | None = None, error=CheckpointError) -> int:
        """`step` if the run has its checkpoint, the latest checkpoint's step for None; else `error`."""
        return select_checkpoint(self.path, step, error)


def _alive(pid: int) -> bool:
    """Whether a process of this host has the pid (a reader's check, for messages only)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True                   # it exists, owned by someone else
    return True


class _WriterLock:
    """This process's flock on one writer.lock, shared by every RunDir of the process that locks
    the same file (flock conflicts between two open descriptions even within one process)."""

    _held: dict = {}                     # (st_dev, st_ino) -> _WriterLock
    _guard = threading.Lock()

    def __init__(self, key, fd: int):
        self.key, self.fd, self.count = key, fd, 1

    @classmethod
    def acquire(cls, path: pathlib.Path) -> "_WriterLock | None":
        """A share of this process's hold, or None when another process holds the lock."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        with cls._guard:
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                held = cls._held.get(key)
                if held is None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return None
                raise
            if held is not None:
                os.close(fd)
                held.count += 1
                return held
            note = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode() + b"\n"
            try:                             # for the refusal message only: a full disk does not stop the writer
                os.ftruncate(fd, 0)
                os.pwrite(fd, note, 0)
            except OSError:
                pass
            cls._held[key] = hold = cls(key, fd)
            return hold

    def release(self) -> None:
        with self._guard:
            self.count -= 1
            if self.count:
                return
            del self._held[self.key]
            try:
                os.ftruncate(self.fd, 0)      # no pid once released
            except OSError:
                pass
            os.close(self.fd)                 # closing the last descriptor releases the flock
