"""The array kinds the backends work on, and the data movement the model program needs on them.

Three kinds: numpy arrays (the C reference, and every backend when called with numpy), mx.array
(the Metal backend's device arrays; on Apple silicon in unified memory) and cupy arrays (the CUDA
backend's). bf16 is held as uint16 in every kind. Every function here only moves or reshapes
data — none computes a value — so which kind holds an array never changes a bit.

The rule the backends follow: an op returns the kind it was given (any device array among its
array arguments -> device arrays out; numpy only -> numpy out). The model program works in the
kind of the parameter buffer it is handed, and the trainer keeps its state in the backend's
kind (`ops.to_device`), moving to the host only what it hashes, checkpoints or prints.
(The last section, add_into and scale_into, applies a backend's own contract op, in place where
the kind allows it.)
"""
from __future__ import annotations

import sys

import numpy as np

# mlx and cupy are optional (the metal and cuda backends'): imported where an array of their kind is made

NUMPY, MLX, CUPY = "numpy", "mlx", "cupy"
SHAPE = "shape"     # mlx_open1b.shape: shape and dtype only, no values (the memory model)


def kind(a) -> str | None:
    """'numpy', 'mlx', 'cupy', or None for anything that is not an array of these."""
    if isinstance(a, np.ndarray):
        return NUMPY
    t = type(a)
    mod = t.__module__ or ""
    if mod == "mlx.core" and t.__name__ == "array":
        return MLX
    if mod.startswith("cupy") and hasattr(a, "__cuda_array_interface__"):
        return CUPY
    if getattr(t, "SHAPE_ONLY", False):
        return SHAPE
    return None


def is_array(a) -> bool:
    return kind(a) is not None


def is_device(a) -> bool:
    """An array of a device kind (mx.array or cupy), not numpy."""
    k = kind(a)
    return k is not None and k != NUMPY


def any_device(values) -> str | None:
    """The device kind among values (arrays, or sequences of arrays one level deep), or None."""
    for v in values:
        if isinstance(v, (list, tuple)):
            for u in v:
                k = kind(u)
                if k is not None and k != NUMPY:
                    return k
            continue
        k = kind(v)
        if k is not None and k != NUMPY:
            return k
    return None


def map_numpy(fn, value):
    """value with fn applied to every numpy array in it (lists and tuples item by item, one level
    or more); anything else as it is. The backends move a device-mode op's numpy arguments up."""
    if kind(value) == NUMPY:
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_numpy(fn, v) for v in value)
    return value


def dtype(a) -> np.dtype:
    """The numpy dtype of an array of any kind (mx's dtypes mapped by name)."""
    if kind(a) == MLX:
        name = str(a.dtype).rsplit(".", 1)[-1]
        try:
            return np.dtype(name)
        except TypeError:
            raise ValueError(f"mx.array of dtype {name} has no numpy equivalent "
                             "(bf16 is held as uint16 in this project)") from None
    return np.dtype(a.dtype)


def c_contiguous(a) -> bool:
    """numpy and cupy report it; mx arrays are made row-contiguous by the Metal binding
    (ensure_row_contiguous) and by the emulator's host copy, so they always pass."""
    if kind(a) == MLX:
        return True
    return bool(a.flags.c_contiguous)


def to_host(a):
    """A numpy array with the values of a (a itself when it is numpy; None stays None)."""
    k = kind(a)
    if a is None or k == NUMPY:
        return a
    if k == MLX:
        return np.array(a)
    if k in (CUPY, SHAPE):
        return a.get()
    raise ValueError(f"expected an array, got {type(a).__name__}")


def from_host(a: np.ndarray, to: str):
    """The numpy array a as an array of kind `to`."""
    if to == NUMPY:
        return a
    if to == MLX:
        import mlx.core as mx
        return mx.array(np.ascontiguousarray(a))
    if to in (CUPY, SHAPE):
        return module(to).asarray(a)
    raise ValueError(f"unknown array kind {to!r}")


def module(k: str):
    """The array namespace of kind k: numpy, mlx.core or cupy."""
    if k == NUMPY:
        return np
    if k == MLX:
        import mlx.core as mx
        return mx
    if k == CUPY:
        import cupy
        return cupy
    if k == SHAPE:
        from .shape import array as shape_array
        return shape_array
    raise ValueError(f"unknown array kind {k!r}")


def contiguous(a):
    """a in row-major order (numpy and cupy copy when needed; mx arrays are lazy and the kernels
    receive them row-contiguous)."""
    k = kind(a)
    if k == MLX:
        return a
    return module(k).ascontiguousarray(a)


def concat(arrays, axis: int = 0):
    """The arrays joined along axis, in the kind of the first (all must share it)."""
    arrays = list(arrays)
    k = kind(arrays[0])
    if any(kind(a) != k for a in arrays):
        raise ValueError(f"concat: arrays of mixed kinds {sorted({str(kind(a)) for a in arrays})}")
    return module(k).concatenate(arrays, axis=axis)


def own_memory(a) -> bool:
    """An array of a device with memory of its own (cupy; the shape-only kind models one), where
    keeping an idle buffer on the host frees device memory; numpy is the host, and an mx.array on
    Apple silicon shares the host's memory."""
    return kind(a) in (CUPY, SHAPE)


def writable(a) -> bool:
    """Arrays of this kind can be written in place, through views too (numpy, cupy); mx.arrays
    cannot (a write to a slice or reshape does not reach the array it came from)."""
    return kind(a) in (NUMPY, CUPY, SHAPE)


def copy(a):
    if kind(a) == MLX:
        import mlx.core as mx
        return mx.array(a)
    return a.copy()


class FlatBuffer:
    """A flat buffer of kind k assembled from pieces written at offsets, every element exactly once
    (checked): written in place for numpy and cupy, joined in offset order for mx.arrays (which
    cannot be written through views). `out`: a numpy buffer of n elements of dtype dt to write into
    instead of a new one (BufferPool's); its old values are never read, as every element is
    written."""

    def __init__(self, n: int, dt, k: str, out: np.ndarray | None = None):
        self.n, self.dt, self.kind = int(n), np.dtype(dt), k
        if out is not None and not (k == NUMPY and kind(out) == NUMPY and out.dtype == self.dt
                                    and out.shape == (self.n,) and out.flags.c_contiguous and out.flags.writeable):
            raise AssertionError(f"FlatBuffer: out must be a writable C-contiguous numpy ({self.n},) {self.dt} "
                                 f"buffer in a numpy FlatBuffer, got {type(out).__name__} for kind {k}")
        if out is not None:
            self.buf = out
        else:
            self.buf = module(k).empty(self.n, self.dt) if k in (NUMPY, CUPY, SHAPE) else None
        self.pieces: list = []

    def write(self, offset: int, values) -> None:
        if dtype(values) != self.dt:
            raise AssertionError(f"FlatBuffer: a piece of dtype {dtype(values)} in a {self.dt} buffer")
        flat = values.reshape(-1)
        self.pieces.append((int(offset), int(flat.size), None if self.buf is not None else flat))
        if self.buf is not None:
            self.buf[offset:offset + flat.size] = flat

    def slot(self, offset: int, shape: tuple):
        """A writable view of the elements [offset, offset + prod(shape)) in `shape`, taken as
        written (the caller writes every element, e.g. a kernel's output argument), where the buffer
        is a numpy one; else None (write the piece instead). The piece counts as written from here
        on: a kernel that fails after taking it must abandon the whole buffer (the model's backward
        raises and nothing reads it)."""
        if self.buf is None or self.kind != NUMPY:
            return None
        size = int(np.prod(shape))
        self.pieces.append((int(offset), size, None))
        return self.buf[offset:offset + size].reshape(shape)

    def settle(self, offset: int, value, out) -> None:
        """The piece at offset is `value`, an op's result given `out` (slot's view, or None): written
        when out is None; else the op must have written it there (an op that returned its result
        elsewhere would leave the piece stale: AssertionError)."""
        if out is None:
            self.write(offset, value)
        elif value is not out:
            raise AssertionError(f"FlatBuffer: the piece at {offset} came back elsewhere than the slot it was given")

    def result(self):
        self.pieces.sort(key=lambda p: p[0])
        at = 0
        for off, size, _ in self.pieces:
            if off != at:
                raise AssertionError(f"FlatBuffer: element {min(at, off)} is {'written twice' if off < at else 'never written'}")
            at += size
        if at != self.n:
            raise AssertionError(f"FlatBuffer: {self.n - at} elements at the end were never written")
        if self.buf is not None:
            return self.buf
        if not self.pieces:
            return from_host(np.empty(0, self.dt), self.kind)
        return concat([p for _, _, p in self.pieces])


def _refs(held: list, i: int) -> int:
    """The reference count of held[i] as seen from here (BufferPool's test, calibrated through this
    same function so that the interpreter's own temporary references cancel out)."""
    return sys.getrefcount(held[i])


class BufferPool:
    """Host (numpy) buffers of n elements of dtype dt, given back by whoever is done with one and
    handed out again by take() instead of a new allocation: a fresh buffer of the size of a model's
    gradient costs a page fault per page (and the kernel's zeroing of it) every time it is made.

    A buffer is handed out only when the pool's own reference is the only one left: its reference
    count says so (every view, memoryview or slice of it holds a reference to it through its base, and
    so does a thread that still reads it, e.g. the background hashing). So a buffer given back too
    early is not written while anything can still read it; it waits in the pool until it is free,
    and take() makes a new buffer meanwhile. At most `keep` buffers wait; what does not fit, or is
    not a whole owned numpy buffer of the pool's size and dtype, is not kept."""

    def __init__(self, n: int, dt, keep: int = 8):
        self.n, self.dt, self.keep = int(n), np.dtype(dt), int(keep)
        self._held: list = []
        self._alone = _refs([np.empty(0)], 0)      # the count of an array that only a list holds
        self.made = self.reused = 0                # counters, for tests and benchmarks

    def give(self, a) -> None:
        """Give back a buffer its holder is done with (it may still be read elsewhere: see above)."""
        if (kind(a) != NUMPY or a.dtype != self.dt or a.shape != (self.n,) or a.base is not None
                or not a.flags.owndata or not a.flags.writeable or len(self._held) >= self.keep
                or any(b is a for b in self._held)):
            return
        self._held.append(a)

    def take(self) -> np.ndarray:
        """A buffer that nothing else references (its old values are garbage), or a new one."""
        for i in range(len(self._held)):
            if _refs(self._held, i) == self._alone:
                self.reused += 1
                return self._held.pop(i)
        self.made += 1
        return np.empty(self.n, self.dt)

    def waiting(self) -> int:
        """Buffers in the pool (free or still referenced elsewhere)."""
        return len(self._held)


# ------------------------------------------- a backend's update ops, in place where the kind allows
def add_into(ops, a, b):
    """a + b by the backend's contract add (a on the left): `a` is updated in place and returned
    where the kind allows (numpy, cupy); an mx.array gets a new array."""
    if writable(a):
        ops.add_inplace(a, b)
        return a
    return ops.add(a, b)


def scale_into(ops, a, s: float):
    """a * s by the backend's contract multiply (s rounded to float32), in place where the kind
    allows (numpy, cupy)."""
    if writable(a):
        ops.scale_inplace(a, s)
        return a
    return ops.scale(a, s)
