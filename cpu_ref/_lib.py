"""Loads the C reference library and checks arguments before any pointer reaches C.

Every kernel is a plain C function called through ctypes (which releases the GIL). The checks
of mlx_open1b.opargs (re-exported here) are the only guard: dtype, C-contiguity, and shape are
validated and a ValueError names the offending argument, so the C code only ever sees buffers of
the sizes it was told.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import math
import pathlib
import sys

import numpy as np

from mlx_open1b.opargs import BF16, F32, I32, check, positive, writable  # noqa: F401  (re-exported)

_here = pathlib.Path(__file__).resolve().parent


def _find_library() -> pathlib.Path:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = _here / f"_kernels{suffix}"
        if p.exists():
            return p
    raise ImportError(
        f"the C reference library is not built (no _kernels*.so in {_here}); "
        "run `pip install -e .` from the repository root")


lib = ctypes.CDLL(str(_find_library()))
c_i64, c_int, c_f32, c_u64, c_u32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint32
ptr = ctypes.c_void_p


def empty_lines(shape, dtype=np.float32) -> np.ndarray:
    """np.empty whose data starts on a 64-byte line (glibc's blocks start 16 bytes past one): a
    kernel that writes a large output once may then stream whole lines around the cache."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize     # math.prod and p: a few microseconds less a call than
    buf = np.empty(nbytes + 64, np.uint8)          # np.prod and .ctypes (hundreds of calls a step)
    off = -p(buf) % 64
    return buf[off:off + nbytes].view(dtype).reshape(shape)


def declare(name: str, *argtypes, restype=None):
    fn = getattr(lib, name)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def _data_reader():
    """A function reading an ndarray's data pointer from its C struct (numpy's `char *data`, the
    first field after the object header: numpy's C API, PyArray_DATA), or None where that does not
    give what a.ctypes.data gives for a few arrays (views at an offset, zero-size, read-only,
    reversed). a.ctypes.data builds a ctypes object per call (about a microsecond); the kernels
    take thousands of pointers a step. CPython only: there id(a) is the object's address (another
    interpreter's id may be no address at all, and reading there could crash the probes)."""
    if sys.implementation.name != "cpython":
        return None
    field = ctypes.c_void_p.from_address
    offset = object.__basicsize__

    def data(a: np.ndarray) -> int:
        return field(id(a) + offset).value or 0

    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    ro = np.ones(3)
    ro.flags.writeable = False
    probes = (base, base[1:], base[2:, 3:], base.reshape(-1)[5:7], np.empty(0, np.uint16), ro, base[::-1],
              np.zeros((2, 3), np.int8).T)
    if all(data(a) == (a.ctypes.data or 0) for a in probes):
        return data
    return None


_data = _data_reader()


def p(a: np.ndarray | None):
    """The data pointer of a checked array (None -> NULL)."""
    if a is None:
        return None
    if not isinstance(a, np.ndarray):
        raise ValueError(f"cpu_ref works on numpy arrays, got {type(a).__module__}.{type(a).__name__} "
                         "(move it with mlx_open1b.arrays.to_host)")
    return _data(a) if _data is not None else a.ctypes.data


set_num_threads_c = declare("o1b_set_num_threads", c_int)
get_num_threads_c = declare("o1b_get_num_threads", restype=c_int)
set_simd_c = declare("o1b_set_simd", c_int)
simd_level_c = declare("o1b_simd_level", restype=c_int)
simd_name_c = declare("o1b_simd_name", restype=ctypes.c_char_p)
contract_version_c = declare("o1b_contract_version", restype=c_int)
set_gemm_impl_c = declare("o1b_set_gemm_impl", c_int)
set_q_amx_c = declare("o1b_set_q_amx", c_int)
set_attn_vnni_c = declare("o1b_set_attn_vnni", c_int)
set_sha_ni_c = declare("o1b_set_sha_ni", c_int)
