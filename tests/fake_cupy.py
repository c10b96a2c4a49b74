"""A stand-in for cupy where there is none (FakeCupyArray, a cupy-like module) and the `fake_gpu`
fixture that runs the CUDA backend as on a GPU with it: device arrays in, device arrays out, the
kernels on the emulator. Used by tests/backends/test_cuda_backend.py (the backend's device-array
mode) and tests/emulators/test_fake_cupy.py (the stand-in's own strictness)."""
from __future__ import annotations

import sys
import threading
import types
import weakref

import numpy as np
import pytest

from mlx_open1b.cuda import emu, ops as cu, runtime

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
             "Please use `.get()` to construct a NumPy array explicitly.")     # cupy's own message


def _unwrap(x):
    return x._a if isinstance(x, FakeCupyArray) else x


def _unwrap_key(key):
    return tuple(_unwrap(k) for k in key) if isinstance(key, tuple) else _unwrap(key)


class _Flags:
    """cupy's ndarray.flags: c_contiguous, f_contiguous, owndata (no writeable)."""

    def __init__(self, a: np.ndarray):
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = bool(a.flags.owndata)


class FakeCupyArray:
    """A stand-in for a cupy array where there is none: an object (not an np.ndarray) holding the
    numpy memory the emulator runs on, that mlx_open1b.arrays.kind reports as cupy by the same test
    it applies to real cupy arrays (a module named cupy*, __cuda_array_interface__).

    Strict like cupy: no implicit conversion to numpy — np.asarray / np.array / numpy setitem
    (`host[...] = dev`) raise cupy's TypeError (__array__ refuses), there is no buffer protocol
    (memoryview, np.frombuffer), and numpy functions and ufuncs on it raise. Stricter than cupy
    where cupy would run host code on a device value (so the ops must name their array module,
    arrays.module / ops._xp): numpy functions and ufuncs are refused rather than dispatched,
    Python arithmetic, comparisons, bool(), index(), .item(), .tolist() and .tobytes() raise.
    What cupy allows and the ops use: .shape .size .ndim .dtype .flags.c_contiguous, views that
    share memory (.reshape .view .ravel, basic indexing — 0-d arrays, never scalars), .copy
    .astype .min .max (0-d), setitem from device arrays, Python scalars or numpy arrays (a
    host-to-device copy, as cupy.ndarray.__setitem__ does), int()/float() of a 0-d array (a sync),
    and the explicit host copy .get()."""

    __module__ = "cupy._fake"          # arrays.kind: type(a).__module__ starts with "cupy"
    __slots__ = ("_a", "__weakref__")
    __array_ufunc__ = None             # numpy ufuncs and numpy binary operators refuse it
    __hash__ = None                    # as cupy.ndarray

    def __init__(self, a: np.ndarray):
        assert type(a) is np.ndarray, type(a)
        self._a = a

    # ---- what cupy.ndarray has and the backend uses
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    dtype = property(lambda self: self._a.dtype)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr, "version": 3,
                "data": (self._a.ctypes.data, False),
                "strides": None if self._a.flags.c_contiguous else self.strides}

    def reshape(self, *shape, order="C"):
        return FakeCupyArray(self._a.reshape(*shape, order=order))

    def view(self, dtype=None):
        return FakeCupyArray(self._a.view() if dtype is None else self._a.view(dtype))

    def ravel(self, order="C"):
        return FakeCupyArray(self._a.ravel(order))

    def copy(self, order="C"):
        return FakeCupyArray(self._a.copy(order))

    __copy__ = copy

    def __deepcopy__(self, memo):
        return self.copy()

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        out = self._a.astype(dtype, order=order, copy=copy)
        return self if out is self._a else FakeCupyArray(out)

    def min(self, axis=None):
        return FakeCupyArray(np.asarray(self._a.min(axis)))

    def max(self, axis=None):
        return FakeCupyArray(np.asarray(self._a.max(axis)))

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """The explicit device-to-host copy; with a stream, out and blocking=False it is queued on
        the stream (FakeStream: it runs when an event recorded after it is waited for)."""
        if out is not None:
            if stream is not None and not blocking:
                stream.enqueue(self, out)
                return out
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None) -> None:
        """The explicit host-to-device copy; with a stream it is queued there (FakeStream: it runs
        when an event recorded after it is waited for)."""
        if stream is not None:
            stream.enqueue(arr, self)
            return
        self._a[...] = arr

    def __getitem__(self, key):
        key = _unwrap_key(key)
        out = self._a[key]
        if not isinstance(out, np.ndarray):          # integers only: cupy gives a 0-d view, not a scalar
            out = self._a[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
        return FakeCupyArray(out)

    def __setitem__(self, key, value):
        self._a[_unwrap_key(key)] = _unwrap(value)   # a numpy value is a host-to-device copy (cupy allows it)

    def __len__(self):
        if not self.ndim:
            raise TypeError("len() of unsized object")
        return len(self._a)

    def __iter__(self):
        if not self.ndim:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self._a)))

    def _scalar(self, convert):
        if self.ndim:
            raise TypeError(f"only 0-d device arrays convert to Python scalars (got shape {self.shape})")
        return convert(self._a[()])

    def __int__(self):
        return self._scalar(int)

    def __float__(self):
        return self._scalar(float)

    def __repr__(self):
        return f"FakeCupyArray({self._a!r})"

    # ---- refused: implicit conversion to numpy, numpy functions, host values of device data
    def __array__(self, dtype=None, copy=None):
        raise TypeError(_IMPLICIT)

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} applied to a device array (name the array module: "
                        "arrays.module(kind) or the backend's _xp())")

    def _refuse(self, *_, **__):
        raise TypeError("a host value of a device array without .get() (an implicit device-to-host copy)")

    __bool__ = __index__ = __eq__ = __ne__ = item = tolist = tobytes = _refuse


class FakeStream:
    """cupy.cuda.Stream in the stand-in. The current stream (`NULL`) runs everything at once, as the
    emulated kernels do; another stream queues its copies (either way) and runs them as late as
    CUDA may: when an event recorded after them is synchronized, or waited for by the current
    stream. So a copy's destination read before its event is waited for holds stale bytes, and a
    copy not ordered before a kernel that writes its source reads the kernel's result: the
    ordering mistakes a real GPU makes only sometimes, made every time. The other way round, a
    copy may run as early as CUDA allows, before the kernels queued ahead of it on the current
    stream: stricter than CUDA, a copy queued on another stream that has not waited for an event
    recorded on the current stream after its last kernel is an error (on a GPU it may read a
    source those kernels have not written yet, or write a block they still use)."""

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.null, self.copies, self.ran = null, [], 0        # copies: (source, destination), either kind
        self.launches = 0     # the current stream: kernels launched on it (fake_gpu counts them)
        self.after = 0        # another stream: the current stream's launches it has waited for
        self._lock = threading.Lock()

    def enqueue(self, src, out) -> None:
        if self.null:
            _unwrap(out)[...] = _unwrap(src)
            return
        if self.after < NULL_STREAM.launches:
            raise AssertionError("a copy queued on a copy stream that has not waited for the kernels the "
                                 "current stream launched before it (a missing event and wait_event)")
        with self._lock:
            self.copies.append((_Held(src), _Held(out)))

    def run_until(self, n: int) -> None:
        with self._lock:
            while self.ran < n:
                src, out = self.copies[self.ran]
                out.memory()[...] = src.memory()
                self.copies[self.ran] = (None, out)          # the source may be freed once copied
                self.ran += 1

    def wait_event(self, event) -> None:
        if self.null:             # the current stream's later work waits: the event's work runs now
            event.synchronize()
        elif event.stream is NULL_STREAM:
            self.after = max(self.after, event.launches)

    def synchronize(self) -> None:
        self.run_until(len(self.copies))


class _Held:
    """An operand of a queued copy: a host array as it is; a device array by a weak reference and
    its memory. A device array the program let go of before its copy ran is an error: on a GPU the
    caching allocator may already have handed its memory to a kernel of another stream."""

    def __init__(self, a):
        self.ref = weakref.ref(a) if isinstance(a, FakeCupyArray) else None
        self.a = a._a if isinstance(a, FakeCupyArray) else a

    def memory(self) -> np.ndarray:
        if self.ref is not None and self.ref() is None:
            raise AssertionError("a device array was let go before its queued copy ran (a missing "
                                 "wait before its memory may be reused)")
        return self.a


class FakeEvent:
    """cupy.cuda.Event in the stand-in: marks the work queued on a stream so far."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.stream, self.upto, self.launches = None, 0, 0

    def record(self, stream=None) -> None:
        self.stream = stream or NULL_STREAM
        self.upto, self.launches = len(self.stream.copies), NULL_STREAM.launches

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.upto)

    @property
    def done(self) -> bool:
        return self.stream is None or self.stream.ran >= self.upto


NULL_STREAM = FakeStream(null=True)


def _fake_cupyx_module(pinned: list):
    """cupyx's pinned allocations: numpy arrays, each listed in `pinned` (cupyx.empty_pinned gives
    numpy arrays in page-locked memory)."""
    def empty_pinned(shape, dtype=float, order="C"):
        a = np.empty(shape, dtype, order)
        pinned.append(a)
        return a

    def zeros_pinned(shape, dtype=float, order="C"):
        a = empty_pinned(shape, dtype, order)
        a[...] = 0
        return a

    m = types.ModuleType("cupyx")
    m.empty_pinned, m.zeros_pinned, m.pinned = empty_pinned, zeros_pinned, pinned
    return m


def _fake_cupy_module():
    """The part of cupy's namespace the backend and mlx_open1b.arrays use, on FakeCupyArray; what
    real cupy refuses (concatenating or making contiguous numpy arrays) it refuses too."""
    def device_only(name, a):
        if not isinstance(a, FakeCupyArray):
            raise TypeError(f"cupy.{name}: expected a cupy array, got {type(a).__name__}")
        return a._a

    def asarray(a, dtype=None, order=None):
        if isinstance(a, FakeCupyArray):
            return a.astype(dtype, copy=False) if dtype is not None else a
        return FakeCupyArray(np.array(a, dtype, copy=True, order=order or "K"))      # host -> device

    def array(a, dtype=None, copy=True, order="K", ndmin=0):
        if isinstance(a, FakeCupyArray) and not copy:
            return asarray(a, dtype)
        return FakeCupyArray(np.array(_unwrap(a), dtype, copy=True, order=order, ndmin=ndmin))

    def ascontiguousarray(a, dtype=None):
        host = device_only("ascontiguousarray", a)
        if host.flags.c_contiguous and (dtype is None or np.dtype(dtype) == host.dtype):
            return a
        return FakeCupyArray(np.ascontiguousarray(host, dtype))

    def concatenate(arrs, axis=0, out=None, dtype=None):
        if out is not None:
            raise NotImplementedError("concatenate(out=...) in the cupy stand-in")
        return FakeCupyArray(np.concatenate([device_only("concatenate", a) for a in arrs], axis=axis, dtype=dtype))

    m = types.ModuleType("cupy")
    m.ndarray = FakeCupyArray
    m.asarray, m.array, m.ascontiguousarray, m.concatenate = asarray, array, ascontiguousarray, concatenate
    m.empty = lambda shape, dtype=float, order="C": FakeCupyArray(np.empty(shape, dtype, order))
    m.zeros = lambda shape, dtype=float, order="C": FakeCupyArray(np.zeros(shape, dtype, order))
    m.dtype = np.dtype
    for name in ("bool_", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", "float32", "float64"):
        setattr(m, name, getattr(np, name))
    return m


@pytest.fixture
def fake_gpu(monkeypatch):
    """The backend as on a GPU (inputs copied to 'device' arrays, results left there or copied
    back) with FakeCupyArray as the device arrays and the kernels still on the emulator. A launch
    passes the emulator each device array's own memory (so the kernel's writes land in it) and,
    as cupy does, refuses a numpy array argument (a host array the op forgot to copy to the
    device)."""
    fake = _fake_cupy_module()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupyx", _fake_cupyx_module([]))
    # `from cupy import cuda` finds it here; the module itself has no `cuda` attribute, which the
    # backend reads as "no GPU device to cache placeholders on"
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream, cuda.Event, cuda.get_current_stream = FakeStream, FakeEvent, lambda: NULL_STREAM
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setattr(cu, "_xp", lambda: fake)
    launch = emu.EmuFunction.__call__

    def device_launch(self, grid, block, args, shared_mem=0):
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                raise TypeError(f"{self.kernel}: argument {i} is a numpy array; a cupy kernel takes "
                                "device arrays (a missing _dev?)")
        NULL_STREAM.launches += 1
        return launch(self, grid, block, tuple(_unwrap(a) for a in args), shared_mem)

    monkeypatch.setattr(emu.EmuFunction, "__call__", device_launch)
    with runtime.emulate():        # on a GPU machine too: the stand-in's memory is host memory
        yield fake
