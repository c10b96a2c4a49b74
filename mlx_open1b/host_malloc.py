"""glibc malloc's thresholds for a process that trains on the host.

A step allocates and frees thousands of host arrays (every activation and gradient of the C
reference, from a few KB to tens of MB). With glibc's defaults an array above the mmap threshold
(128 KiB at first, raised as freed mmapped chunks show larger sizes, up to 32 MiB) is a fresh mmap,
and the heap's top is given back to the system as soon as 128 KiB (twice the threshold once
raised) are free there: either way the next array of that size is new memory, a page fault (and
the kernel's zeroing) per page touched. tune() serves arrays below 32 MiB from the heap and keeps up
to 1 GiB free at its top, so a step reuses the memory the previous one freed. Only where the memory
comes from changes: no value, so no bit, depends on it. Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc's <malloc.h> parameter numbers
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

_tuned: bool | None = None


def tune() -> bool:
    """Set the thresholds once per process; True where they are set (glibc), False elsewhere."""
    global _tuned
    if _tuned is None:
        _tuned = _set()
    return _tuned


def _set() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt, glibc = libc.mallopt, libc.gnu_get_libc_version    # musl and others lack the second
    except (OSError, AttributeError):
        return False
    del glibc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
