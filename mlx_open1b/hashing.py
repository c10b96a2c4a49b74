"""Canonical Merkle hashes of tensors and of named collections of tensors (DESIGN §7).

Everything here is defined on bytes, so that an auditor can reimplement it from CONTRACT.md
("Hashes, ledger and checkpoints") without this code:

* Canonical bytes of a tensor: its elements in row-major (C) order, each little-endian, with the
  storage format of its dtype name: "bf16" (uint16 holding the upper half of an fp32), "f32",
  "i32", "u32", "i64", "u64". No padding, nothing else.
* The data are cut into chunks of CHUNK = 1 MiB counted from the tensor's first byte (the last
  chunk may be shorter; an empty tensor has one empty chunk). leaf = SHA-256(0x00 || chunk).
* merkle_root(digests): level by level, bottom-up, digests 2i and 2i+1 become
  SHA-256(0x01 || left || right); an odd digest at the end of a level goes up unchanged; the one
  digest left is the root (the root of a single leaf is that leaf).
* tensor hash = SHA-256(0x02 || header || data root), header = the UTF-8 bytes of
  {"dtype":<dtype name>,"name":<name>,"shape":[<dims>]} written as canonical JSON (keys sorted, no
  whitespace, non-ASCII characters as \\uXXXX escapes, as Python's json.dumps(sort_keys=True,
  separators=(",", ":")) writes it).
* collection hash = SHA-256(0x03 || header || root), header = canonical JSON
  {"count":<n>,"kind":<kind>}, root = merkle_root of the n tensor hashes (32 raw bytes each) in
  ascending order of their names (Unicode code points, i.e. UTF-8 byte order); names are unique;
  an empty collection has root = 32 zero bytes.

Because chunks are counted from the tensor's start, workers that each hold a CHUNK-aligned piece of
a tensor can compute `leaf_hashes` of their piece; the concatenated leaf lists, in order, give the
same root (`combine_chunks`, `tensor_hash_from_leaves`).

Speed: SHA-256 runs on memoryviews of the arrays (no copies for C-contiguous little-endian
arrays) and releases the GIL, so chunks are hashed on a small thread pool. Where the C reference
hashes 16 leaves at a time (AVX-512, cpu_ref/src/sha256_mb.c), the leaves of a call with 16 or
more go there, one job per thread; else hashlib hashes each. The digests are the same.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

import numpy as np

CHUNK = 1 << 20                      # bytes per Merkle leaf, counted from the tensor's first byte

LEAF, NODE, TENSOR, COLLECTION = b"\x00", b"\x01", b"\x02", b"\x03"   # domain-separation prefixes

# dtype name -> little-endian numpy dtype of its storage
DTYPES: dict[str, np.dtype] = {
    "bf16": np.dtype("<u2"),
    "f32": np.dtype("<f4"),
    "i32": np.dtype("<i4"),
    "u32": np.dtype("<u4"),
    "i64": np.dtype("<i8"),          # counters (step, Adam t) kept as tensors
    "u64": np.dtype("<u8"),
}
_DEFAULT_NAME = {np.dtype("uint16"): "bf16", np.dtype("float32"): "f32", np.dtype("int32"): "i32",
                 np.dtype("uint32"): "u32", np.dtype("int64"): "i64", np.dtype("uint64"): "u64"}

EMPTY_ROOT = bytes(32)               # the root of an empty collection


class HashError(ValueError):
    """An array that cannot be hashed as asked (wrong dtype for the name, bad digest list...)."""


# ------------------------------------------------------------------------------- thread pool
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
_pool_lock = threading.Lock()
_threads = min(os.cpu_count() or 1, 8)


def _forget_pool_after_fork() -> None:     # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def set_hash_threads(n: int) -> None:
    """Threads used to hash chunks (default: CPUs, at most 8). 1 hashes on the calling thread.
    The result never depends on it."""
    global _threads
    if n < 1:
        raise HashError(f"hash threads must be >= 1, got {n}")
    _threads = int(n)


def _map(fn, items: list):
    global _pool, _pool_threads
    if _threads <= 1 or len(items) < 2:
        return [fn(x) for x in items]
    with _pool_lock:
        if _pool is None or _pool_threads != _threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(_threads, thread_name_prefix="open1b-hash")
            _pool_threads = _threads
        pool = _pool
    return list(pool.map(fn, items))


# ------------------------------------------------------------------------------- canonical bytes
def canonical_json(obj) -> bytes:
    """The canonical JSON encoding used by headers: sorted keys, no whitespace, ASCII."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def dtype_name_of(array: np.ndarray) -> str:
    """The dtype name of an array by its numpy dtype: uint16 is bf16 storage (CONTRACT §1)."""
    try:
        return _DEFAULT_NAME[np.dtype(array.dtype).newbyteorder("=")]
    except KeyError:
        raise HashError(f"no canonical dtype name for numpy dtype {array.dtype} "
                        f"(supported: {sorted(DTYPES)})") from None


def canonical_array(array, dtype_name: str | None = None, what: str = "tensor") -> tuple[np.ndarray, str]:
    """(a C-contiguous little-endian array of the dtype name's storage type, dtype name).
    No copy when the array already is one (the usual case); a copy otherwise."""
    a = np.asarray(array)
    if dtype_name is None:
        dtype_name = dtype_name_of(a)
    if dtype_name not in DTYPES:
        raise HashError(f"{what}: unknown dtype name {dtype_name!r} (supported: {sorted(DTYPES)})")
    want = DTYPES[dtype_name]
    if a.dtype.kind != want.kind or a.dtype.itemsize != want.itemsize:
        raise HashError(f"{what}: dtype name {dtype_name!r} needs numpy {want.newbyteorder('=')} "
                        f"storage, got {a.dtype}")
    if a.dtype != want:                       # big-endian (or a non-native byte order)
        a = a.astype(want)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a, dtype_name


def byte_view(array: np.ndarray) -> memoryview:
    """The canonical bytes of a C-contiguous little-endian array as a flat memoryview (no copy)."""
    if array.size == 0:
        return memoryview(b"")
    if not array.flags.c_contiguous:
        raise HashError("byte_view needs a C-contiguous array (see canonical_array)")
    return memoryview(array.reshape(-1).view(np.uint8))


def tensor_header(name: str, dtype_name: str, shape: Sequence[int]) -> bytes:
    if not isinstance(name, str):
        raise HashError(f"tensor name must be a str, got {type(name).__name__}")
    return canonical_json({"dtype": dtype_name, "name": name, "shape": [int(s) for s in shape]})


# ------------------------------------------------------------------------------- Merkle pieces
def _leaf(chunk) -> bytes:
    h = hashlib.sha256(LEAF)
    h.update(chunk)
    return h.digest()


_lanes_module = None                 # cpu_ref.sha256 where it hashes 16 leaves at a time, else False


def _c_leaves():
    """The C leaves (cpu_ref/src/sha256_mb.c) where they hash 16 leaves at a time (AVX-512:
    about 2-3 times hashlib's bytes per second per core), else None (hashlib for every leaf)."""
    global _lanes_module
    if _lanes_module is None:
        try:
            from mlx_open1b.cpu_ref import sha256 as lanes
            _lanes_module = lanes if lanes.lanes() == 16 else False
        except (ImportError, OSError, AttributeError):  # the C library is not built here, or
            _lanes_module = False                          # was built before these leaves
    return _lanes_module or None


def _hash_leaves(chunks: list, parallel: bool = True) -> list[bytes]:
    """[_leaf(c) for c in chunks] (bytes-like chunks). With the C leaves and 16 chunks or more,
    the chunks are dealt, longest first, to as many jobs of about equal bytes as the pool has
    threads (16 chunks at least each), one C call per job; else hashlib per chunk. SHA-256 either
    way; `parallel`: on the thread pool, else on this thread."""
    fast = _c_leaves()
    n = len(chunks)
    if fast is None or n < 16:
        return _map(_leaf, chunks) if parallel else [_leaf(c) for c in chunks]
    njobs = max(1, min(_threads if parallel else 1, n // 16))
    jobs: list[list[int]] = [[] for _ in range(njobs)]
    load = [0] * njobs
    for k in sorted(range(n), key=lambda k: -len(chunks[k])):
        j = load.index(min(load))
        jobs[j].append(k)
        load[j] += len(chunks[k]) + 64

    def run(job: list[int]) -> list[bytes]:
        bufs = [chunks[k] for k in job]
        try:
            return fast.leaves(bufs)
        except MemoryError:                  # C could not allocate its order: the same digests by hashlib
            return [_leaf(b) for b in bufs]
    done = _map(run, jobs) if parallel else [run(j) for j in jobs]
    out: list = [None] * n
    for job, d in zip(jobs, done):
        for k, dk in zip(job, d):
            out[k] = dk
    return out


def leaf_hashes(data, offset: int = 0) -> list[bytes]:
    """Leaf digests of a run of canonical bytes (a bytes-like object or a C-contiguous array).
    `offset` is where these bytes start inside their tensor and must be a multiple of CHUNK, so
    that the leaves are the tensor's own; the result covers the chunks that start in `data`.
    Empty data (a whole empty tensor) is one empty leaf."""
    if offset % CHUNK:
        raise HashError(f"leaf_hashes: offset {offset} is not a multiple of CHUNK ({CHUNK})")
    if getattr(data, "SHAPE_ONLY", False):     # mlx_open1b.shape (the memory model): as many leaves, no values
        return [EMPTY_ROOT] * max(1, -(-data.nbytes // CHUNK))
    if isinstance(data, np.ndarray) and data.dtype.itemsize > 1:
        mv = byte_view(canonical_array(data)[0])
    else:
        mv = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
    n = len(mv)
    if n == 0:
        return [_leaf(b"")]
    return _hash_leaves([mv[i:i + CHUNK] for i in range(0, n, CHUNK)])


def merkle_root(digests: Sequence[bytes]) -> bytes:
    """The root of the binary tree over `digests` (each 32 raw bytes), built bottom-up; an odd
    digest at the end of a level is promoted unchanged."""
    level = list(digests)
    if not level:
        raise HashError("merkle_root of no digests")
    for d in level:
        if not isinstance(d, (bytes, bytearray)) or len(d) != 32:
            raise HashError(f"merkle_root: digests must be 32 raw bytes, got {d!r:.80}")
    while len(level) > 1:
        nxt = [hashlib.sha256(NODE + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return bytes(level[0])


def combine_chunks(parts: Iterable[Sequence[bytes]]) -> bytes:
    """The data root of a tensor from the leaf lists of its CHUNK-aligned pieces, in order
    (each list as `leaf_hashes` of the piece returned it)."""
    leaves: list[bytes] = []
    for p in parts:
        leaves.extend(p)
    return merkle_root(leaves)


def data_root(array, dtype_name: str | None = None) -> bytes:
    a, _ = canonical_array(array, dtype_name)
    return merkle_root(leaf_hashes(byte_view(a)))


def tensor_digest_from_root(name: str, dtype_name: str, shape: Sequence[int], root: bytes) -> bytes:
    if dtype_name not in DTYPES:
        raise HashError(f"{name}: unknown dtype name {dtype_name!r}")
    if len(root) != 32:
        raise HashError(f"{name}: a data root is 32 raw bytes")
    return hashlib.sha256(TENSOR + tensor_header(name, dtype_name, shape) + bytes(root)).digest()


def tensor_hash_from_leaves(name: str, dtype_name: str, shape: Sequence[int], leaves: Sequence[bytes]) -> str:
    """A tensor hash from its leaf digests (e.g. gathered from the workers that hold its pieces)."""
    if dtype_name not in DTYPES:
        raise HashError(f"{name}: unknown dtype name {dtype_name!r}")
    n = DTYPES[dtype_name].itemsize
    for s in shape:
        n *= int(s)
    want = max(1, -(-n // CHUNK))
    if len(leaves) != want:
        raise HashError(f"{name}: {len(leaves)} leaves given, a {dtype_name} tensor of shape "
                        f"{tuple(shape)} ({n} bytes) has {want}")
    return tensor_digest_from_root(name, dtype_name, shape, merkle_root(leaves)).hex()


# ------------------------------------------------------------------------------- public hashes
def tensor_digest(name: str, array, dtype_name: str | None = None) -> bytes:
    a, dn = canonical_array(array, dtype_name, what=f"tensor {name!r}")
    return tensor_digest_from_root(name, dn, a.shape, merkle_root(leaf_hashes(byte_view(a))))


def tensor_hash(name: str, array, dtype_name: str | None = None) -> str:
    """The hex hash of one named tensor (name, dtype name, shape and data). dtype_name defaults by
    the numpy dtype: uint16 -> "bf16", float32 -> "f32", int32 -> "i32", uint32 -> "u32",
    int64 -> "i64", uint64 -> "u64"."""
    return tensor_digest(name, array, dtype_name).hex()


def _norm_item(item) -> tuple[str, object, str | None]:
    if len(item) == 2:
        return item[0], item[1], None
    if len(item) == 3:
        return item[0], item[1], item[2]
    raise HashError(f"collection item must be (name, array[, dtype_name]), got {len(item)} fields")


def tensor_digests(items: Iterable) -> dict[str, bytes]:
    """{name: tensor digest} of many (name, array[, dtype_name]) items, hashing all their chunks on
    one thread pool (many small tensors hash in parallel too)."""
    prepared = []
    for item in items:
        name, arr, dn = _norm_item(item)
        if getattr(arr, "SHAPE_ONLY", False):     # mlx_open1b.shape (the memory model): no values to hash
            prepared.append((name, dn or dtype_name_of(arr), tuple(arr.shape), memoryview(b"")))
            continue
        a, dn = canonical_array(arr, dn, what=f"tensor {name!r}")
        prepared.append((name, dn, a.shape, byte_view(a)))
    tasks = []
    for t, (_, _, _, mv) in enumerate(prepared):
        if len(mv) == 0:
            tasks.append((t, mv, 0))
        tasks.extend((t, mv, i) for i in range(0, len(mv), CHUNK))
    # at most a chunk's bytes in all (counters, small tensors): on this thread, not queued behind a
    # background thread's chunks in the pool (mlx_open1b/state_hashes.py)
    leaves = _hash_leaves([mv[i:i + CHUNK] for _, mv, i in tasks],
                          parallel=sum(len(mv) for _, _, _, mv in prepared) > CHUNK)
    per: list[list[bytes]] = [[] for _ in prepared]
    for (t, _, _), d in zip(tasks, leaves):
        per[t].append(d)
    out: dict[str, bytes] = {}
    for (name, dn, shape, _), lv in zip(prepared, per):
        if name in out:
            raise HashError(f"tensor name {name!r} appears twice")
        out[name] = tensor_digest_from_root(name, dn, shape, merkle_root(lv))
    return out


def collection_hash_from_tensor_hashes(kind: str, hashes: dict[str, str | bytes]) -> str:
    """A collection hash from its tensors' hashes (hex or raw), e.g. computed on several workers."""
    if not isinstance(kind, str):
        raise HashError(f"collection kind must be a str, got {type(kind).__name__}")
    digests = []
    for name in sorted(hashes):
        h = hashes[name]
        d = bytes.fromhex(h) if isinstance(h, str) else bytes(h)
        if len(d) != 32:
            raise HashError(f"{kind}/{name}: a tensor hash is 32 bytes")
        digests.append(d)
    root = merkle_root(digests) if digests else EMPTY_ROOT
    header = canonical_json({"count": len(digests), "kind": kind})
    return hashlib.sha256(COLLECTION + header + root).hexdigest()


def collection_hash(kind: str, items: Iterable) -> str:
    """The hex hash of a named collection of tensors (e.g. kind "params"): items are
    (name, array, dtype_name) (dtype_name may be None or left off); order does not matter, the
    tensors enter the tree in ascending name order; names must be unique."""
    return collection_hash_from_tensor_hashes(kind, tensor_digests(items))


def hash_throughput(mbytes: int = 256, repeats: int = 3) -> float:
    """MB/s (10^6 bytes) of tensor_hash over an f32 array of `mbytes` MB, best of `repeats`."""
    a = np.frombuffer(np.random.default_rng(0).bytes(mbytes * 1_000_000 // 4 * 4), np.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        tensor_hash("x", a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e6

