"""Loads the C reference library and checks arguments before any pointer reaches C.

Every kernel is a plain C function called through ctypes (which releases the GIL). The checks
here are the only guard: dtype, C-contiguity, and shape are validated and a ValueError names
the offending argument, so the C code only ever sees buffers of the sizes it was told.
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import pathlib

import numpy as np

BF16 = np.dtype(np.uint16)   # bf16 is held as its 16 bits (CONTRACT.md §1)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

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


def declare(name: str, *argtypes, restype=None):
    fn = getattr(lib, name)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


def check(name: str, a, dtype: np.dtype, shape: tuple | None = None, ndim: int | None = None) -> np.ndarray:
    """Validate one array argument; shape entries of None match any size."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        hint = " (bf16 is held as uint16)" if dtype == BF16 else ""
        raise ValueError(f"{name}: expected dtype {dtype}{hint}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (use np.ascontiguousarray)")
    if ndim is None and shape is not None:
        ndim = len(shape)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, a.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name}: dimension {axis} is {got}, expected {want} "
                                 f"(shape {a.shape}, expected {tuple('*' if s is None else s for s in shape)})")
    return a


def writable(name: str, a: np.ndarray) -> np.ndarray:
    if not a.flags.writeable:
        raise ValueError(f"{name}: array is read-only but is updated in place")
    return a


def p(a: np.ndarray | None):
    """The data pointer of a checked array (None -> NULL)."""
    return None if a is None else a.ctypes.data


def positive(name: str, value: int) -> int:
    if int(value) != value or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


set_num_threads_c = declare("o1b_set_num_threads", c_int)
get_num_threads_c = declare("o1b_get_num_threads", restype=c_int)
set_simd_c = declare("o1b_set_simd", c_int)
simd_level_c = declare("o1b_simd_level", restype=c_int)
simd_name_c = declare("o1b_simd_name", restype=ctypes.c_char_p)
contract_version_c = declare("o1b_contract_version", restype=c_int)
set_gemm_impl_c = declare("o1b_set_gemm_impl", c_int)
