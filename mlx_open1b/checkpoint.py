"""Checkpoints: safetensors + JSON, written atomically, verified on load (DESIGN §7).

A checkpoint is a directory `ckpt-<step:08d>/` inside the run directory:

    state.safetensors   the tensors (params "bf16" as safetensors BF16, moments "f32" as F32, any
                        extra "i32"/"u32"/"i64"/"u64" tensors), written by this module (no dependency)
    meta.json           the trainer's metadata (step, consumed tokens, data-stream state, schedule
                        and spike state, config, tokenizer hash, ...) plus what this module adds:
                        format, contract_version, files (each file's SHA-256 and size), tensors
                        (each tensor's dtype, shape and hashing.tensor_hash), collections (the
                        hashing.collection_hash of named groups, e.g. "params", "opt_state") and
                        meta_hash (SHA-256 of the canonical JSON of meta.json without meta_hash)

Atomicity: everything is written into a temporary directory `.ckpt-<step>.tmp-*` beside the final
one, every file is fsynced, the directory is renamed onto its final name and the run directory is
fsynced. A crash at any point leaves earlier checkpoints untouched and never a partial directory
under a `ckpt-*` name; the next save (or `recover_checkpoints`) removes the leftovers. One writer
per run directory.

Safetensors layout (https://github.com/huggingface/safetensors, format description): 8 bytes
little-endian u64 N, N bytes of JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}} padded with spaces so that 8 + N is a multiple of 8, then the tensor
bytes (row-major, little-endian), offsets relative to the first byte after the header. Tensors are
laid out by decreasing element size, then name, so every tensor is aligned to its element size.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import struct
import tempfile
import threading
import warnings

import numpy as np

from . import fsutil, hashing
from .contract import CONTRACT_VERSION
from .ledger import LedgerError, canonical, canonical_dumps

FORMAT = "open1b-checkpoint/1"
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
_NAME = re.compile(r"^ckpt-(\d{8,})$")
_LEFTOVER = re.compile(r"^\.ckpt-(\d{8,})\.(tmp|old|del)-")
_RESERVED = ("format", "files", "tensors", "collections", "meta_hash")

# our dtype names <-> safetensors dtype strings
ST_DTYPE = {"bf16": "BF16", "f32": "F32", "i32": "I32", "u32": "U32", "i64": "I64", "u64": "U64"}
FROM_ST = {v: k for k, v in ST_DTYPE.items()}
MAX_HEADER = 100 << 20


class CheckpointError(Exception):
    """A checkpoint that is missing, corrupt, truncated or from another contract/tokenizer; the
    message names the directory, the file and, where one is at fault, the tensor."""


# ------------------------------------------------------------------------------- safetensors
def _prepare(tensors: dict) -> list[tuple[str, np.ndarray, str]]:
    out = []
    for name, v in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"invalid tensor name {name!r}")
        arr, dn = (v if isinstance(v, tuple) else (v, None))
        try:
            a, dn = hashing.canonical_array(arr, dn, what=f"tensor {name!r}")
        except hashing.HashError as e:
            raise CheckpointError(str(e)) from None
        out.append((name, a, dn))
    out.sort(key=lambda t: (-t[1].dtype.itemsize, t[0]))
    return out


def _st_header(entries, metadata: dict | None) -> tuple[bytes, int]:
    """The safetensors header bytes (length prefix and padding included) of tensors laid out as
    `entries` [(name, dtype name, shape, byte count)] in file order, and the data's byte count."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dn, shape, nbytes in entries:
        header[name] = {"dtype": ST_DTYPE[dn], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb, off


def write_safetensors(path, tensors: dict, metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write tensors ({name: (array, dtype_name)} or {name: array}) as a safetensors file, fsync it,
    and return (SHA-256 hex of the file, its size in bytes)."""
    items = _prepare(tensors)
    head, off = _st_header([(name, dn, a.shape, a.nbytes) for name, a, dn in items], metadata)
    pieces = [head] + [hashing.byte_view(a) for _, a, _ in items]

    sha = hashlib.sha256()

    def _hash():                      # hashlib releases the GIL: hash while the main thread writes
        for p in pieces:
            sha.update(p)

    t = threading.Thread(target=_hash, name="open1b-ckpt-sha")
    t.start()
    try:
        fsutil.write_file(path, pieces)
    finally:
        t.join()
    return sha.hexdigest(), len(head) + off


def _read_all(path, expect_size: int | None = None) -> tuple[bytearray, str]:
    """The file's bytes and their SHA-256, in one pass."""
    size = os.path.getsize(path)
    buf = bytearray(size)
    mv = memoryview(buf)
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < size:
            n = f.readinto(mv[pos:pos + (64 << 20)])
            if not n:
                break
            sha.update(mv[pos:pos + n])
            pos += n
    if pos != size:
        raise CheckpointError(f"{path}: file shrank while being read ({pos} of {size} bytes)")
    return buf, sha.hexdigest()


def _header_entries(buf, size: int, where: str) -> tuple[list, dict, int]:
    """([(begin, end, name, dtype name, shape)] in the header's order, __metadata__, the data's first byte) of a
    safetensors file of `size` bytes whose first bytes are `buf` (at least its header); every
    header entry is checked (dtype, shape, offsets inside the data, no gaps or overlaps)."""
    if size < 8 or len(buf) < 8:
        raise CheckpointError(f"{where}: truncated ({size} bytes, no header)")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{where}: header length {n} does not fit the file ({size} bytes): truncated or corrupt")
    try:
        header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:     # nesting deeper than the parser goes
        raise CheckpointError(f"{where}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base, data_len = 8 + n, size - 8 - n
    spans = []
    for name, e in header.items():
        at = f"{where}: tensor {name!r}"
        try:
            dn = FROM_ST[e["dtype"]]
            shape = [int(s) for s in e["shape"]]
            b, end = (int(x) for x in e["data_offsets"])
        except KeyError as k:
            raise CheckpointError(f"{at}: missing or unsupported header field ({k}: {e!r:.200})") from None
        except (TypeError, ValueError) as x:
            raise CheckpointError(f"{at}: malformed header entry ({x})") from None
        if any(s < 0 for s in shape):
            raise CheckpointError(f"{at}: negative dimension in shape {shape}")
        dt = hashing.DTYPES[dn]
        count = 1
        for s in shape:
            count *= s
        if end - b != count * dt.itemsize or b < 0:
            raise CheckpointError(f"{at}: data_offsets [{b}, {end}] do not hold {dn}{shape}")
        if end > data_len:
            raise CheckpointError(f"{at}: data_offsets end {end} is beyond the file's {data_len} data bytes: truncated")
        spans.append((b, end, name, dn, shape))
    pos = 0
    for b, end, name, _, _ in sorted(spans, key=lambda t: t[:3]):
        if b != pos:
            raise CheckpointError(f"{where}: tensor {name!r} starts at {b}, expected {pos} (gap or overlap)")
        pos = end
    if pos != data_len:
        raise CheckpointError(f"{where}: {data_len - pos} bytes after the last tensor")
    return spans, meta, base


def parse_safetensors(buf, where: str = STATE_FILE) -> tuple[dict, dict]:
    """({name: (array, dtype_name)} as views into buf, __metadata__) of safetensors bytes; every
    header entry is checked (dtype, shape, offsets inside the data, no gaps or overlaps)."""
    spans, meta, base = _header_entries(buf, len(buf), where)
    out = {}
    for b, end, name, dn, shape in spans:
        dt = hashing.DTYPES[dn]
        out[name] = (np.frombuffer(buf, dt, (end - b) // dt.itemsize, base + b).reshape(shape), dn)
    return out, meta


def read_safetensors(path) -> tuple[dict, dict]:
    buf, _ = _read_all(path)
    return parse_safetensors(buf, str(path))


# ------------------------------------------------------------------------------- meta
def _meta_hash(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_hash"}
    return hashlib.sha256(canonical_dumps(body).encode("ascii")).hexdigest()


def _fsync_dir(path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def checkpoint_dir(run_dir, step: int) -> pathlib.Path:
    return pathlib.Path(run_dir) / f"ckpt-{step:08d}"


def recover_checkpoints(run_dir) -> list[str]:
    """Clean what an interrupted save or prune left in the run directory: temporary directories
    are removed; a checkpoint moved aside for replacement whose replacement never arrived is put
    back. Returns what was done, one line per entry."""
    run_dir = pathlib.Path(run_dir)
    done = []
    if not run_dir.is_dir():
        return done
    for p in sorted(run_dir.iterdir()):
        m = _LEFTOVER.match(p.name)
        if not m or not p.is_dir():
            continue
        final = run_dir / f"ckpt-{m.group(1)}"
        if m.group(2) == "old" and not final.exists():
            os.rename(p, final)
            done.append(f"restored {final.name}")
        else:
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name}")
    if done:
        _fsync_dir(run_dir)
    return done


def _checked_meta(step, meta: dict) -> tuple[int, dict]:
    """(step, a canonical copy of meta with step and contract_version set), or CheckpointError."""
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
    step = int(step)
    try:
        meta = canonical(dict(meta), "meta")
    except LedgerError as e:
        raise CheckpointError(f"meta: {e}") from None
    if "step" in meta and (not isinstance(meta["step"], int) or isinstance(meta["step"], bool)):
        raise CheckpointError(f"meta step must be an integer, got {meta['step']!r}")
    for k in _RESERVED:
        if k in meta:
            raise CheckpointError(f"meta key {k!r} is reserved (the checkpoint writes it)")
    if meta.setdefault("step", step) != step:
        raise CheckpointError(f"meta step {meta['step']} differs from the checkpoint step {step}")
    if meta.setdefault("contract_version", CONTRACT_VERSION) != CONTRACT_VERSION:
        raise CheckpointError(f"meta contract_version {meta['contract_version']} is not this build's {CONTRACT_VERSION}")
    return step, meta


def _write_meta(tmp: pathlib.Path, meta: dict) -> None:
    """meta.json (meta_hash added) into the temporary directory, which is then made durable."""
    meta["meta_hash"] = _meta_hash(meta)
    fsutil.write_file(tmp / META_FILE, [(json.dumps(meta, indent=1, sort_keys=True, ensure_ascii=True)
                                         + "\n").encode("ascii")])
    os.chmod(tmp, 0o777 & ~_umask())
    _fsync_dir(tmp)


def _publish(run_dir: pathlib.Path, step: int, tmp: pathlib.Path, final: pathlib.Path):
    """Rename the complete temporary directory onto its final name (a checkpoint of the same step
    moved aside first); returns the directory moved aside, or None. On failure the old one is back."""
    aside = None
    try:
        if final.exists():          # replacing a checkpoint of the same step: move it aside first
            aside = pathlib.Path(tempfile.mkdtemp(prefix=f".ckpt-{step:08d}.old-", dir=run_dir))
            os.rmdir(aside)
            _rename(final, aside)
        _rename(tmp, final)
        _fsync_dir(run_dir)
    except BaseException:
        if aside is not None and aside.exists() and not final.exists():
            os.rename(aside, final)
        raise
    return aside


# ------------------------------------------------------------------------------- save / load
def save_checkpoint(run_dir, step: int, tensors: dict, meta: dict,
                    collections: dict | None = None) -> pathlib.Path:
    """Write checkpoint `step` atomically and return its directory.

    tensors: {name: (array, dtype_name)} (dtype_name None or a bare array: by numpy dtype).
    meta: JSON-able trainer metadata (numpy scalars and tuples are converted); a "step" in it must
    equal `step`, a "contract_version" must be this build's; the keys format, files, tensors,
    collections and meta_hash are reserved.
    collections: {kind: [tensor names]} or {kind: {item name: tensor name}}; the
    hashing.collection_hash of each (items named by the list's names or the mapping's keys) is
    recorded as meta["collections"][kind] = {"hash": ..., "tensors": {item: tensor}} and checked
    on load (see collection_hashes).
    """
    step, meta = _checked_meta(step, meta)
    run_dir = pathlib.Path(run_dir)

    items = _prepare(tensors)
    digests = hashing.tensor_digests(items)
    colls = {}
    for kind, names in (collections or {}).items():
        mapping = dict(names) if isinstance(names, dict) else {n: n for n in names}
        missing = [t for t in mapping.values() if t not in digests]
        if missing:
            raise CheckpointError(f"collection {kind!r}: no tensor named {missing[0]!r}")
        colls[kind] = {"hash": _collection_hash(kind, mapping, {n: (a, dn) for n, a, dn in items}, digests),
                       "tensors": mapping}

    final = checkpoint_dir(run_dir, step)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        recover_checkpoints(run_dir)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".ckpt-{step:08d}.tmp-", dir=run_dir))
    except OSError as e:
        raise fsutil.WriteError.of_part(final, e, "checkpoint ") from None
    try:
        sha, nbytes = write_safetensors(tmp / STATE_FILE, {n: (a, dn) for n, a, dn in items},
                                        {"format": FORMAT, "step": str(step)})
        meta["format"] = FORMAT
        meta["files"] = {STATE_FILE: {"bytes": nbytes, "sha256": sha}}
        meta["tensors"] = {n: {"dtype": dn, "hash": digests[n].hex(), "shape": list(a.shape)} for n, a, dn in items}
        meta["collections"] = colls
        _write_meta(tmp, meta)
        aside = _publish(run_dir, step, tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):          # fsutil.WriteError included: name the checkpoint, not its part
            raise fsutil.WriteError.of_part(final, e, "checkpoint ") from None
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


class TensorStreams:
    """The tensor digests (hashing.tensor_digest) of consecutive tensors `items` [(name, dtype name,
    shape)] whose bytes arrive in pieces, in order, pieces free to straddle tensors: each tensor's
    Merkle leaves are counted from its own first byte, a chunk's tail carried to the next piece.
    E.g. the "params" collection's tensors from a stream of the flat parameter buffer."""

    def __init__(self, items):
        self._items = [(str(n), dn, tuple(int(d) for d in shape), hashing.DTYPES[dn].itemsize * math.prod(shape))
                       for n, dn, shape in items]
        self._at, self._left = 0, self._items[0][3] if self._items else 0
        self._leaves, self._carry = [], bytearray()
        self.digests: dict[str, bytes] = {}
        self._close_empty()

    @property
    def complete(self) -> bool:
        return self._at >= len(self._items)

    @property
    def current(self) -> tuple[str, int]:
        """(the tensor the next byte belongs to, its bytes still to come)."""
        return self._items[self._at][0], self._left

    def _close_empty(self) -> None:
        while self._at < len(self._items) and self._left == 0:
            name, dn, shape, nb = self._items[self._at]
            if self._carry or nb == 0:
                self._leaves += hashing.leaf_hashes(bytes(self._carry))
            self.digests[name] = hashing.tensor_digest_from_root(name, dn, shape, hashing.merkle_root(self._leaves))
            self._leaves, self._carry = [], bytearray()
            self._at += 1
            if self._at < len(self._items):
                self._left = self._items[self._at][3]

    def update(self, mv) -> None:
        """The next bytes (a flat byte memoryview); more than the tensors hold is a ValueError."""
        while len(mv):
            if self.complete:
                raise ValueError(f"TensorStreams: {len(mv)} bytes after the last tensor")
            take = mv[:self._left]
            self._left -= len(take)
            pos = 0
            if self._carry:                  # complete the chunk the last piece began
                pos = min(len(take), hashing.CHUNK - len(self._carry))
                self._carry += take[:pos]
                if len(self._carry) == hashing.CHUNK:
                    self._leaves += hashing.leaf_hashes(bytes(self._carry))
                    self._carry = bytearray()
            whole = (len(take) - pos) // hashing.CHUNK * hashing.CHUNK
            if whole:
                self._leaves += hashing.leaf_hashes(take[pos:pos + whole])
            self._carry += take[pos + whole:]
            mv = mv[len(take):]
            self._close_empty()


class StreamedCheckpoint:
    """A checkpoint whose tensors arrive in pieces, in file order, so that no process holds the whole
    state (a distributed run's writer receives each owner's range in turn): the same directory,
    bytes and meta.json as save_checkpoint of the whole tensors (no collections).

        with StreamedCheckpoint(run_dir, step, {name: (dtype name, shape)}, meta) as w:
            for name in w.order:
                for piece in ...: w.write(name, piece)     # consecutive elements, in order
            path = w.finish()

    Atomic as save_checkpoint: the pieces go to a file in a temporary directory that is renamed
    into place by finish() only when every byte is in; leaving the block without finish() (an
    error, a lost worker) removes it and earlier checkpoints stay as they were. The file's SHA-256
    and every tensor's Merkle leaves are computed as the pieces pass. One writer per run directory
    (the caller holds the RunDir lock)."""

    def __init__(self, run_dir, step: int, specs: dict, meta: dict):
        self.step, self.meta = _checked_meta(step, meta)
        self.run_dir = pathlib.Path(run_dir)
        self.final = checkpoint_dir(self.run_dir, self.step)
        entries = []
        for name, (dn, shape) in specs.items():
            if not isinstance(name, str) or not name or name == "__metadata__":
                raise CheckpointError(f"invalid tensor name {name!r}")
            if dn not in ST_DTYPE:
                raise CheckpointError(f"tensor {name!r}: unknown dtype name {dn!r} (supported: {sorted(ST_DTYPE)})")
            shape = tuple(int(d) for d in shape)
            entries.append((name, dn, shape, hashing.DTYPES[dn].itemsize * math.prod(shape)))
        entries.sort(key=lambda e: (-hashing.DTYPES[e[1]].itemsize, e[0]))      # _prepare's order
        self._entries = {e[0]: e for e in entries}
        self.order = [e[0] for e in entries]
        self._head, data = _st_header(entries, {"format": FORMAT, "step": str(self.step)})
        self.nbytes = len(self._head) + data
        self._hashes = TensorStreams([(n, dn, shape) for n, dn, shape, _ in entries])
        self._sha = hashlib.sha256()
        self._file = None
        self.tmp = None
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            recover_checkpoints(self.run_dir)
            self.tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".ckpt-{self.step:08d}.tmp-", dir=self.run_dir))
            self._file = open(self.tmp / STATE_FILE, "wb", buffering=0)
            self._put(self._head)
        except BaseException as e:
            self._fail(e)

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if self.tmp is not None:        # left without finish(): nothing of this save stays
            self.abort()

    def _put(self, mv) -> None:
        """Write bytes to the file while the file's SHA-256 runs beside (hashlib releases the GIL)."""
        t = threading.Thread(target=self._sha.update, args=(mv,), name="open1b-ckpt-sha")
        t.start()
        try:
            fsutil.write_all(self._file, mv)
        except OSError as e:
            raise fsutil.WriteError(self.tmp / STATE_FILE, e) from None
        finally:
            t.join()

    def write(self, name: str, piece) -> None:
        """The next elements of tensor `name` (the tensor in `order` being written), a flat or shaped
        array of its dtype's storage; consecutive pieces fill the tensor in row-major order."""
        h = self._hashes
        if name in h.digests and not np.asarray(piece).size:
            return                      # nothing for a complete tensor (an empty one closes by itself)
        if h.complete or name != h.current[0]:
            want = "nothing (every tensor is complete)" if h.complete else h.current[0]
            raise CheckpointError(f"{self.final}: piece of tensor {name!r} out of order: expected {want}")
        _, dn, _, _ = self._entries[name]
        try:
            a, _ = hashing.canonical_array(piece, dn, what=f"tensor {name!r}")
        except hashing.HashError as e:
            raise CheckpointError(str(e)) from None
        mv = hashing.byte_view(a)
        if len(mv) > h.current[1]:
            raise CheckpointError(f"{self.final}: tensor {name!r} is given {len(mv) - h.current[1]} bytes more "
                                  f"than its shape holds")
        try:
            self._put(mv)
        except BaseException as e:
            self._fail(e)
        h.update(mv)

    def finish(self, more_meta: dict | None = None) -> pathlib.Path:
        """fsync, meta.json (the meta given at the start and `more_meta`: fields known only once the
        pieces have passed, e.g. hashes computed from them), rename into place; returns the
        checkpoint directory."""
        if not self._hashes.complete:
            name, left = self._hashes.current
            raise CheckpointError(f"{self.final}: incomplete: tensor {name!r} lacks {left} bytes")
        _, meta = _checked_meta(self.step, {**self.meta, **(more_meta or {})})
        try:
            fsutil.fsync_file(self._file)
            self._file.close()
            meta["format"] = FORMAT
            meta["files"] = {STATE_FILE: {"bytes": self.nbytes, "sha256": self._sha.hexdigest()}}
            meta["tensors"] = {n: {"dtype": dn, "hash": self._hashes.digests[n].hex(), "shape": list(shape)}
                               for n, (_, dn, shape, _) in self._entries.items()}
            meta["collections"] = {}
            _write_meta(self.tmp, meta)
            aside = _publish(self.run_dir, self.step, self.tmp, self.final)
        except BaseException as e:
            self._fail(e)
        self.tmp = None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        return self.final

    def abort(self) -> None:
        """Remove what this save wrote (earlier checkpoints are untouched)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def _fail(self, e: BaseException):
        self.abort()
        if isinstance(e, OSError):          # fsutil.WriteError included: name the checkpoint, not its part
            raise fsutil.WriteError.of_part(self.final, e, "checkpoint ") from None
        raise e


class StreamedCheckpointReader:
    """A checkpoint read in pieces, in file order, so that no process holds the whole state (a
    distributed run's rank 0 hands each owner its range as it reads): load_checkpoint's checks —
    meta.json and the file sizes at once, the header against meta's tensor list, then, as the
    pieces pass, the file's SHA-256 and every tensor's hash, judged by finish() (before it, what was
    read is not yet known to be intact). Collection hashes are load_checkpoint's only (a trainer's
    checkpoint has none; the state hashes in its meta are the trainer's to check).

        with StreamedCheckpointReader(path) as r:
            for name, dtype_name, shape in r.order:
                ... r.read(name, count) ...          # consecutive elements, in order
            r.finish()
    """

    def __init__(self, path, *, contract_version: int = CONTRACT_VERSION, tokenizer_sha256: str | None = None):
        self.path = pathlib.Path(path)
        self.meta, tmeta, _, self._expect = _checked_files(self.path, contract_version, tokenizer_sha256)
        sp = self.path / STATE_FILE
        self._where = str(sp)
        size = sp.stat().st_size
        self._file = open(sp, "rb", buffering=0)
        try:
            head = self._read_bytes(min(8, size))
            if len(head) == 8:
                (n,) = struct.unpack_from("<Q", head, 0)
                if n <= MAX_HEADER and 8 + n <= size:
                    head += self._read_bytes(n)
            spans, _, _ = _header_entries(head, size, self._where)
        except BaseException:
            self.close()
            raise
        names = {t[2] for t in spans}
        if names != set(tmeta):
            self.close()
            extra, gone = sorted(names - set(tmeta)), sorted(set(tmeta) - names)
            raise CheckpointError(f"{sp}: tensors differ from {META_FILE}: missing {gone}, unexpected {extra}")
        for _, _, name, dn, shape in spans:
            tm = tmeta[name]
            if tm.get("dtype") != dn or list(shape) != tm.get("shape"):
                self.close()
                raise CheckpointError(f"{sp}: tensor {name!r} is {dn}{list(shape)}, {META_FILE} records "
                                      f"{tm.get('dtype')}{tm.get('shape')}")
        self._tmeta = tmeta
        self.order = [(name, dn, tuple(shape)) for _, _, name, dn, shape in sorted(spans, key=lambda t: t[:3])]
        self._hashes = TensorStreams(self.order)
        self._sha = hashlib.sha256(head)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()

    def _read_bytes(self, n: int) -> bytearray:
        buf = bytearray(n)
        mv, pos = memoryview(buf), 0
        while pos < n:
            got = self._file.readinto(mv[pos:])
            if not got:
                raise CheckpointError(f"{self._where}: file shrank while being read ({pos} of {n} bytes)")
            pos += got
        return buf

    def read(self, name: str, count: int) -> np.ndarray:
        """The next `count` elements of tensor `name` (the tensor being read), flat, in its dtype's
        storage."""
        h = self._hashes
        if count == 0 and name in h.digests:
            return np.zeros(0, hashing.DTYPES[dict((n, d) for n, d, _ in self.order)[name]])
        if h.complete or name != h.current[0]:
            want = "nothing (every tensor is read)" if h.complete else h.current[0]
            raise CheckpointError(f"{self._where}: read of tensor {name!r} out of order: expected {want}")
        dt = hashing.DTYPES[dict((n, d) for n, d, _ in self.order)[name]]
        if count * dt.itemsize > h.current[1]:
            raise CheckpointError(f"{self._where}: tensor {name!r} has {h.current[1] // dt.itemsize} elements left, "
                                  f"{count} asked")
        buf = self._read_bytes(count * dt.itemsize)
        self._sha.update(buf)
        h.update(memoryview(buf))
        return np.frombuffer(buf, dt)

    def finish(self) -> dict:
        """Every byte read: the file's SHA-256 and every tensor's hash against meta.json (CheckpointError
        naming the tensors that differ, as load_checkpoint). Returns meta."""
        h = self._hashes
        if not h.complete:
            name, left = h.current
            raise CheckpointError(f"{self._where}: read incomplete: tensor {name!r} has {left} bytes left")
        sha = self._sha.hexdigest()
        bad = [n for n in sorted(h.digests) if h.digests[n].hex() != self._tmeta[n].get("hash")]
        if bad or sha != self._expect["sha256"]:
            what = (f"tensor{'s' if len(bad) > 1 else ''} {', '.join(repr(b) for b in bad[:5])}"
                    f"{' …' if len(bad) > 5 else ''} differ{'s' if len(bad) == 1 else ''} from the recorded hash"
                    if bad else "header or padding bytes changed (every tensor matches its hash)")
            sha_msg = ("" if sha == self._expect["sha256"] else
                       f"; file SHA-256 {sha[:12]}… differs from the recorded {self._expect['sha256'][:12]}…")
            raise CheckpointError(f"{self._where}: corrupt: {what}{sha_msg}")
        self.close()
        return self.meta


def _rename(src, dst) -> None:
    """os.rename, in one place (tests simulate crashes here)."""
    os.rename(src, dst)


def _umask() -> int:
    u = os.umask(0)
    os.umask(u)
    return u


def _collection_hash(kind: str, mapping: dict, tensors: dict, digests: dict | None = None) -> str:
    """collection_hash over {item name: tensor name}; tensor digests already computed under the
    same name are reused (a tensor hash commits to its name, so renamed items are rehashed)."""
    digests = digests or {}
    have = {item: digests[t] for item, t in mapping.items() if item == t and t in digests}
    rest = [(item, *tensors[t]) for item, t in mapping.items() if item not in have]
    return hashing.collection_hash_from_tensor_hashes(kind, {**have, **hashing.tensor_digests(rest)})


def _checked_files(path: pathlib.Path, contract_version: int, tokenizer_sha256: str | None):
    """A checkpoint directory's meta.json and file sizes, checked (load_checkpoint's first half):
    (meta, its tensor entries, its collections, the state file's entry)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint directory")
    mp = path / META_FILE
    if not mp.exists():
        raise CheckpointError(f"{path}: {META_FILE} is missing (not a checkpoint, or an incomplete one)")
    try:
        meta = json.loads(mp.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{mp}: not valid JSON ({e}): corrupt or truncated") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{mp}: not a JSON object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{mp}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("meta_hash") != _meta_hash(meta):
        raise CheckpointError(f"{mp}: contents do not match its meta_hash (edited or corrupt)")
    if meta.get("contract_version") != contract_version:
        raise CheckpointError(f"{path}: written under contract version {meta.get('contract_version')}, "
                              f"this build implements version {contract_version}")
    if tokenizer_sha256 is not None and meta.get("tokenizer_sha256") != tokenizer_sha256:
        got = meta.get("tokenizer_sha256")
        raise CheckpointError(f"{path}: written with tokenizer {str(got)[:12]}…, this run's is {tokenizer_sha256[:12]}…")
    m = _NAME.match(path.name)
    if m and int(m.group(1)) != meta.get("step"):
        raise CheckpointError(f"{mp}: step {meta.get('step')} does not match the directory name {path.name}")
    try:
        files, tmeta, colls = dict(meta["files"]), dict(meta["tensors"]), dict(meta["collections"])
        expect = files[STATE_FILE]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{mp}: malformed ({e!r} missing)") from None
    for fname, info in files.items():
        fp = path / fname
        if not fp.exists():
            raise CheckpointError(f"{path}: {fname} is missing")
        size = fp.stat().st_size
        want = info.get("bytes") if isinstance(info, dict) else None
        if not isinstance(want, int) or not isinstance(info.get("sha256"), str):
            raise CheckpointError(f"{mp}: malformed entry for {fname}")
        if size != want:
            how = "truncated" if size < want else "longer than written"
            raise CheckpointError(f"{fp}: {how}: {size} bytes, {META_FILE} records {want}")
    return meta, tmeta, colls, expect


def load_checkpoint(path, *, verify_tensors: bool = True, contract_version: int = CONTRACT_VERSION,
                    tokenizer_sha256: str | None = None) -> tuple[dict, dict]:
    """Load and verify a checkpoint directory: ({name: (array, dtype_name)}, meta).

    Checks meta.json (present, valid, its meta_hash, format, step = the directory's), the contract
    version (and the tokenizer hash in meta["tokenizer_sha256"] when `tokenizer_sha256` is given),
    every file's size and SHA-256, the safetensors header against meta's tensor list, and (unless
    verify_tensors=False) every tensor's hash and every collection hash. CheckpointError names the
    file and, for corrupt data, the tensor(s)."""
    path = pathlib.Path(path)
    meta, tmeta, colls, expect = _checked_files(path, contract_version, tokenizer_sha256)
    mp = path / META_FILE
    sp = path / STATE_FILE
    buf, sha = _read_all(sp)
    sha_ok = sha == expect["sha256"]
    try:
        tensors, _ = parse_safetensors(buf, str(sp))
    except CheckpointError as e:
        raise CheckpointError(f"{e}" + ("" if sha_ok else f" (SHA-256 {sha[:12]}… differs from the recorded "
                                        f"{expect['sha256'][:12]}…)")) from None
    if set(tensors) != set(tmeta):
        extra, gone = sorted(set(tensors) - set(tmeta)), sorted(set(tmeta) - set(tensors))
        raise CheckpointError(f"{sp}: tensors differ from {META_FILE}: missing {gone}, unexpected {extra}")
    for name, (a, dn) in tensors.items():
        tm = tmeta[name]
        if tm.get("dtype") != dn or list(a.shape) != tm.get("shape"):
            raise CheckpointError(f"{sp}: tensor {name!r} is {dn}{list(a.shape)}, {META_FILE} records "
                                  f"{tm.get('dtype')}{tm.get('shape')}")
    bad = []
    if verify_tensors or not sha_ok:
        digests = hashing.tensor_digests([(n, a, dn) for n, (a, dn) in tensors.items()])
        bad = [n for n in sorted(tensors) if digests[n].hex() != tmeta[n].get("hash")]
    if bad or not sha_ok:
        what = (f"tensor{'s' if len(bad) > 1 else ''} {', '.join(repr(b) for b in bad[:5])}"
                f"{' …' if len(bad) > 5 else ''} differ{'s' if len(bad) == 1 else ''} from the recorded hash"
                if bad else "header or padding bytes changed (every tensor matches its hash)")
        sha_msg = "" if sha_ok else f"; file SHA-256 {sha[:12]}… differs from the recorded {expect['sha256'][:12]}…"
        raise CheckpointError(f"{sp}: corrupt: {what}{sha_msg}")
    if verify_tensors:
        for kind, c in colls.items():
            try:
                mapping, h = dict(c["tensors"]), c["hash"]
            except (KeyError, TypeError):
                raise CheckpointError(f"{mp}: collection {kind!r} malformed") from None
            missing = [t for t in mapping.values() if t not in tensors]
            if missing:
                raise CheckpointError(f"{mp}: collection {kind!r} names a tensor {missing[0]!r} that is not in {STATE_FILE}")
            got = _collection_hash(kind, mapping, tensors, digests)
            if got != h:
                raise CheckpointError(f"{sp}: collection {kind!r} hashes to {got[:12]}…, {META_FILE} records {h[:12]}…")
    return {n: tensors[n] for n in sorted(tensors)}, meta


def collection_hashes(meta: dict) -> dict[str, str]:
    """{kind: collection hash} recorded in a checkpoint's meta (compare with the ledger's hashes)."""
    return {k: c["hash"] for k, c in meta.get("collections", {}).items()}


def verify_checkpoint(path, **kw) -> dict:
    """load_checkpoint without keeping the tensors; returns meta."""
    return load_checkpoint(path, **kw)[1]


# ------------------------------------------------------------------------------- listing, pruning
def list_checkpoints(run_dir) -> list[tuple[int, pathlib.Path]]:
    """[(step, directory)] of the run's checkpoints (complete saves only), ascending by step.
    Not verified: load_checkpoint verifies."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        return []
    out = []
    for p in run_dir.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def select_checkpoint(run_dir, step: int | None = None, error=CheckpointError) -> int:
    """`step` if the run has a checkpoint of it, the latest checkpoint's step when step is None;
    otherwise `error` naming the run and the checkpoints it has."""
    have = [s for s, _ in list_checkpoints(run_dir)]
    if step is None:
        if not have:
            raise error(f"{run_dir}: no checkpoints")
        return have[-1]
    if step not in have:
        raise error(f"{run_dir}: no checkpoint of step {step} (checkpoints: {have})")
    return step


def latest_checkpoint(run_dir, at_or_before: int | None = None, verify: bool = False,
                      **load_kw) -> tuple[int, pathlib.Path] | None:
    """The newest checkpoint (with step <= at_or_before if given), or None. verify=True skips,
    with a warning, checkpoints that fail load_checkpoint (load_kw passed on)."""
    for step, p in reversed(list_checkpoints(run_dir)):
        if at_or_before is not None and step > at_or_before:
            continue
        if verify:
            try:
                load_checkpoint(p, **load_kw)
            except CheckpointError as e:
                warnings.warn(f"skipping checkpoint {p.name}: {e}", RuntimeWarning, stacklevel=2)
                continue
        return step, p
    return None


def keep_last(run_dir, k: int, **load_kw) -> list[pathlib.Path]:
    """Delete all but the k newest checkpoints, but never the newest one that loads and verifies
    (if none of the k newest does, the newest valid older one is kept as well). Returns the
    deleted directories. Each is renamed away before it is removed, so no partial checkpoint is
    ever visible under a ckpt-* name."""
    if k < 1:
        raise CheckpointError(f"keep_last: k must be >= 1, got {k}")
    run_dir = pathlib.Path(run_dir)
    recover_checkpoints(run_dir)
    ckpts = list_checkpoints(run_dir)
    keep = {p for _, p in ckpts[-k:]}
    for _, p in reversed(ckpts):
        try:
            load_checkpoint(p, **load_kw)
        except CheckpointError:
            continue
        keep.add(p)
        break
    deleted = []
    for step, p in ckpts:
        if p in keep:
            continue
        aside = pathlib.Path(tempfile.mkdtemp(prefix=f".ckpt-{step:08d}.del-", dir=run_dir))
        os.rmdir(aside)
        _rename(p, aside)
        shutil.rmtree(aside, ignore_errors=True)
        deleted.append(p)
    if deleted:
        _fsync_dir(run_dir)
    return deleted
