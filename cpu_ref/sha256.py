"""Merkle leaves of mlx_open1b.hashing in C: leaf = SHA-256(0x00 || chunk), 16 leaves at a time on
AVX-512, one alone by the SHA extensions or portable C (cpu_ref/src/sha256_mb.c). The digests are
SHA-256's, whatever the path."""
from __future__ import annotations

import ctypes

import numpy as np

from ._lib import c_i64, declare, ptr

_leaves = declare("o1b_sha256_leaves", c_i64, ptr, ptr, ptr, restype=c_i64)
_lanes = declare("o1b_sha256_lanes", restype=ctypes.c_int)


def lanes() -> int:
    """16 where leaves are hashed 16 at a time (AVX-512), else 1 (one at a time: hashlib is as
    fast or faster)."""
    return int(_lanes())


def _address(buf) -> tuple[int, int, object]:
    """(address, length, the object that keeps the bytes alive) of a bytes-like object."""
    a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if not a.flags.c_contiguous:
        raise ValueError("sha256 leaves: a buffer is not contiguous")
    return (a.ctypes.data if a.nbytes else 0), a.nbytes, a


def leaves_counted(bufs) -> tuple[list[bytes], int]:
    """([SHA-256(0x00 || b) for b in bufs], how many ended in the 16 lanes) for bytes-like
    objects (bytes, memoryviews, contiguous arrays); on the calling thread, the GIL released."""
    held = [_address(b) for b in bufs]
    n = len(held)
    if n == 0:
        return [], 0
    ptrs = np.array([h[0] for h in held], np.uintp)
    lens = np.array([h[1] for h in held], np.int64)
    out = np.empty(32 * n, np.uint8)
    k = _leaves(n, ptrs.ctypes.data, lens.ctypes.data, out.ctypes.data)
    if k < 0:
        raise MemoryError("sha256 leaves: out of memory")
    raw = out.tobytes()
    return [raw[32 * i:32 * i + 32] for i in range(n)], int(k)


def leaves(bufs) -> list[bytes]:
    """[SHA-256(0x00 || b) for b in bufs] (see leaves_counted)."""
    return leaves_counted(bufs)[0]
