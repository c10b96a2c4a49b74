"""The shape-only array kind (like PyTorch's meta device): shape, dtype and strides, no values.

A `ShapeArray` lives on the simulated device or on the host (`place`); its memory is a `Buffer`
recorded in the ledger of the worker that allocated it (ledger.py) and freed there when the last
array viewing it is gone (CPython frees by reference count, so live bytes follow the code exactly as
a CUDA caching allocator's "allocated" counter does). Views (basic slices, reshapes of contiguous
arrays) share their base's buffer; numpy itself works out their shapes, strides and contiguity on a
zero-byte stand-in, so no value is ever read or written.

This module is also the kind's array namespace (arrays.module('shape'): empty, zeros, asarray,
ascontiguousarray, concatenate, array), the role numpy and cupy play for their kinds.

Moving to the host (`to_host`) gives a real numpy array of zeros when it is small (at most
HOST_VALUES bytes: token ids, per-row losses, norm partials, scalar results, which the code reads)
and a host ShapeArray otherwise (the full-size copies the trainer hashes; mlx_open1b.hashing hashes
only their header). Reading the values of a shape array raises (`__array__`): code that reads
values the shape-only run does not have says so instead of computing with made-up numbers.
"""
from __future__ import annotations

import math
import weakref

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .ledger import DEVICE, HOST, current

HOST_VALUES = 64 << 20          # bytes up to which to_host gives real (zero) values
_STANDINS: dict = {}           # dtype -> a one-element array the zero-byte views are made on


def _standin(dtype) -> np.ndarray:
    s = _STANDINS.get(dtype)
    if s is None:
        s = _STANDINS[dtype] = np.zeros(1, dtype)
    return s


class Buffer:
    """Memory of one allocation; recorded in `ledger`, freed there when no array holds it."""
    __slots__ = ("nbytes", "place", "ledger", "serial", "__weakref__")

    def __init__(self, nbytes: int, place: str):
        self.nbytes, self.place, self.ledger = int(nbytes), place, current()
        self.serial = self.ledger.alloc(self.nbytes, place)

    def __del__(self):
        try:
            self.ledger.free(self.serial)
        except Exception:       # noqa: BLE001 - interpreter shutdown
            pass


def _c_strides(shape, itemsize: int) -> tuple:
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


class _Flags:
    __slots__ = ("c_contiguous", "writeable")

    def __init__(self, c: bool):
        self.c_contiguous, self.writeable = c, True


class ShapeArray:
    """An array with a shape, a dtype and a place, and no values."""
    __slots__ = ("shape", "dtype", "_strides", "_c", "_buf", "__weakref__")
    SHAPE_ONLY = True            # mlx_open1b.hashing hashes the header only

    def __init__(self, shape, dtype, place: str = DEVICE, buf: Buffer | None = None, strides=None,
                 contiguous: bool = True):
        self.shape = tuple(map(int, shape))
        self.dtype = np.dtype(dtype)
        self._strides, self._c = strides, contiguous      # strides None: row-major
        self._buf = buf if buf is not None else Buffer(self.nbytes, place)

    @property
    def strides(self) -> tuple:
        if self._strides is None:
            self._strides = _c_strides(self.shape, self.dtype.itemsize)
        return self._strides

    # ---- numpy-like attributes
    @property
    def place(self) -> str:
        return self._buf.place

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def flags(self) -> _Flags:
        return _Flags(self._c)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ShapeArray({self.shape}, {self.dtype}, {self.place})"

    def __array__(self, *a, **k):
        raise TypeError(f"a shape-only array {self.shape} {self.dtype} has no values to read")

    def _standin(self):
        """A zero-byte numpy view with this array's shape and strides (never read)."""
        return as_strided(_standin(self.dtype), self.shape, self.strides, writeable=False)

    # ---- views and copies
    def __getitem__(self, key) -> "ShapeArray":
        if self._c and type(key) is slice and key.step is None and len(self.shape) == 1:
            n = len(range(*key.indices(self.shape[0])))     # the common case: a range of a flat buffer
            return ShapeArray((n,), self.dtype, buf=self._buf)
        v = self._standin()[key]
        return ShapeArray(v.shape, self.dtype, buf=self._buf, strides=v.strides, contiguous=v.flags.c_contiguous)

    def __setitem__(self, key, value) -> None:
        """A write moves no values; writing a host array into a device one is an upload."""
        n = self._standin()[key].size * self.dtype.itemsize
        if self.place == DEVICE and (isinstance(value, np.ndarray) or getattr(value, "place", DEVICE) == HOST):
            self._buf.ledger.count("h2d", n)

    def reshape(self, *shape) -> "ShapeArray":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if shape.count(-1) == 1:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape a shape array of size {self.size} into shape {shape}")
        if not self._c:
            return ShapeArray(shape, self.dtype, self.place)      # numpy copies a non-contiguous array
        return ShapeArray(shape, self.dtype, buf=self._buf)

    def ravel(self) -> "ShapeArray":
        return self.reshape(-1)

    def view(self, dtype) -> "ShapeArray":
        dt = np.dtype(dtype)
        flat = self.reshape(-1)
        return ShapeArray((flat.nbytes // dt.itemsize,), dt, buf=flat._buf)

    def copy(self) -> "ShapeArray":
        return ShapeArray(self.shape, self.dtype, self.place)

    def astype(self, dtype, copy: bool = True) -> "ShapeArray":
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return ShapeArray(self.shape, dtype, self.place)

    # ---- moving between host and device
    def to_host(self):
        """A host copy: real zeros when small (the code reads them), else a host ShapeArray."""
        if self.place == HOST:
            return self
        self._buf.ledger.count("d2h", self.nbytes)
        if self.nbytes <= HOST_VALUES:
            return _host_values(self.shape, self.dtype)
        return ShapeArray(self.shape, self.dtype, HOST)

    def get(self):
        return self.to_host()


def _host_values(shape, dtype) -> np.ndarray:
    """Real host zeros, recorded in the ledger until numpy frees them."""
    a = np.zeros(shape, dtype)
    buf = Buffer(a.nbytes, HOST)
    weakref.finalize(a, lambda b: None, buf)     # holds the Buffer as long as the array lives
    return a


# ---------------------------------------------------------------- the kind's array namespace
def empty(shape, dtype=np.float32) -> ShapeArray:
    return ShapeArray((shape,) if isinstance(shape, (int, np.integer)) else shape, dtype)


zeros = empty


def empty_pinned(shape, dtype=np.float32) -> ShapeArray:
    """cupyx.empty_pinned's place: page-locked host memory (the hashes' copies), its host bytes
    tagged "pinned"."""
    with current().tagged("pinned"):
        return ShapeArray((shape,) if isinstance(shape, (int, np.integer)) else shape, dtype, HOST)


def empty_like(a, dtype=None) -> ShapeArray:
    return ShapeArray(a.shape, dtype or a.dtype, getattr(a, "place", DEVICE))


zeros_like = empty_like


def asarray(a, dtype=None):
    """On the device: a itself when it is a device ShapeArray of the dtype, else an upload."""
    if isinstance(a, ShapeArray) and a.place == DEVICE and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    dt = a.dtype if dtype is None else dtype
    out = ShapeArray(a.shape, dt, DEVICE)
    if isinstance(a, np.ndarray) or a.place == HOST:
        current().count("h2d", a.nbytes)
    return out


def ascontiguousarray(a, dtype=None):
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):   # numpy's rule
        return a
    return ShapeArray(a.shape, a.dtype if dtype is None else dtype, a.place)


def array(a, dtype=None, copy: bool = True, order: str = "C"):
    return ShapeArray(a.shape, a.dtype if dtype is None else dtype, getattr(a, "place", DEVICE))


def concatenate(parts, axis: int = 0) -> ShapeArray:
    parts = list(parts)
    shape = list(parts[0].shape)
    axis = axis % len(shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    return ShapeArray(shape, parts[0].dtype, parts[0].place)
