"""The cupy stand-in (tests/fake_cupy.py) the CUDA backend's device-array tests run on where there
is no GPU: as strict as cupy about implicit conversions to numpy (stricter about host arithmetic on
device values), allowing what cupy allows, and its kernel launches refusing numpy arguments."""
from __future__ import annotations

import numpy as np
import pytest

from fake_cupy import FakeCupyArray, fake_gpu  # noqa: F401 (fake_gpu: a fixture)

from mlx_open1b import arrays
from mlx_open1b.cuda import emu, ops as cu, runtime

HAVE_GXX = emu.compiler_available()[0]
needs_emulator = pytest.mark.skipif(not HAVE_GXX, reason="the CUDA emulator needs g++")


def test_fake_cupy_array_is_strict(fake_gpu):
    """The stand-in refuses, as cupy does, every implicit conversion to numpy (and, stricter than
    cupy, numpy functions and host arithmetic on it), so an op that slips one in fails here."""
    a = fake_gpu.asarray(np.arange(4, dtype=np.float32))
    assert not isinstance(a, np.ndarray)
    assert arrays.kind(a) == arrays.CUPY and arrays.any_device([[a]]) == arrays.CUPY   # the real kind()
    host = np.zeros(4, np.float32)

    def setitem(target, key, value):
        target[key] = value

    refused = {
        "np.asarray": lambda: np.asarray(a), "np.array": lambda: np.array(a),
        "np.array of a list": lambda: np.array([a, a]), "np.asarray dtype": lambda: np.asarray(a, np.float64),
        "np.ascontiguousarray": lambda: np.ascontiguousarray(a), "memoryview": lambda: memoryview(a),
        "bytes": lambda: bytes(a), "np.frombuffer": lambda: np.frombuffer(a, np.float32),
        "host[...] = dev": lambda: setitem(host, Ellipsis, a), "host[:2] = dev[:2]": lambda: setitem(host, slice(0, 2), a[:2]),
        "host[1:2] = dev 0-d": lambda: setitem(host, slice(1, 2), a[1]), "np.copyto": lambda: np.copyto(host, a),
        "ufunc": lambda: np.add(a, 1), "ufunc on 0-d": lambda: np.exp(a[0]), "ufunc out=": lambda: np.add(host, host, out=a),
        "np.concatenate": lambda: np.concatenate([a, a]), "np.sum": lambda: np.sum(a), "np.ndim": lambda: np.ndim(a),
        "dev + 1": lambda: a + 1, "1.0 + dev": lambda: 1.0 + a, "host + dev": lambda: host + a,
        "np.float32 * dev": lambda: np.float32(2) * a, "dev == dev": lambda: a == a[:], "dev < 1": lambda: a < 1,
        "bool": lambda: bool(a[0]), "float of 1-d": lambda: float(a), "int of 1-d": lambda: int(a[:1]),
        "index": lambda: [0, 1][a[1]], "tobytes": lambda: a.tobytes(), "item": lambda: a.item(),
        "tolist": lambda: a.tolist(), "cupy.concatenate with numpy": lambda: fake_gpu.concatenate([a, host]),
        "cupy.ascontiguousarray of numpy": lambda: fake_gpu.ascontiguousarray(host),
    }
    for what, bad in refused.items():
        with pytest.raises(TypeError):
            bad()
            pytest.fail(f"{what} was allowed")
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    assert not host.any() and a.get().tolist() == [0, 1, 2, 3]
    assert type(arrays.to_host(a)) is np.ndarray and type(arrays.concat([a, a])) is FakeCupyArray
    assert type(cu.to_device(np.zeros(3, np.float32))) is FakeCupyArray
    assert type(cu.to_host(a)) is np.ndarray


def test_fake_cupy_array_allows_what_cupy_allows(fake_gpu):
    """Views share the device memory, copies do not, indexing gives 0-d arrays, setitem takes
    device arrays, Python scalars and numpy arrays (a host-to-device copy), int()/float() of 0-d."""
    h = np.arange(4, dtype=np.float32)
    a = fake_gpu.asarray(h)
    h[0] = -1                                        # asarray copied the host array
    assert fake_gpu.asarray(a) is a and fake_gpu.ascontiguousarray(a) is a
    assert type(a[1]) is FakeCupyArray and a[1].shape == () and a[..., 1].shape == ()
    assert float(a[3]) == 3.0 and int(a.min()) == 0 and int(a.max()) == 3 and len(a) == 4
    host = np.zeros(2, np.float32)
    host[1] = a[3]                                   # numpy converts one element by float(): cupy syncs
    assert host.tolist() == [0, 3]
    a[1] = 7
    a[2:] = np.array([8, 9], np.float32)
    a[0] = a[3]
    a.reshape(2, 2)[1, 0] = 10                       # a view: the write lands in a
    a.ravel()[3] = 11
    a[1][...] = 12                                   # a 0-d view
    assert a.get().tolist() == [9, 12, 10, 11] and [float(x) for x in a] == [9, 12, 10, 11]
    g = a.get()
    g[0] = -1
    c = a.copy()
    c[0] = -2
    assert a.get()[0] == 9
    assert a.view(np.uint32).dtype == np.uint32 and arrays.to_host(a.view(np.uint32))[0] == np.float32(9).view(np.uint32)
    assert a.astype(np.float64).dtype == np.float64 and a.reshape(2, 2).flags.c_contiguous
    assert not a.reshape(2, 2)[:, 0].flags.c_contiguous and arrays.contiguous(a.reshape(2, 2)[:, 0]).flags.c_contiguous
    assert a.__cuda_array_interface__["shape"] == (4,)
    assert arrays.dtype(a) == np.float32 and arrays.c_contiguous(a) and arrays.is_device(a)


@needs_emulator
def test_fake_gpu_kernel_launches(fake_gpu):
    """A launch on the stand-in writes the device array's own memory, and refuses a numpy array
    argument as cupy does (an op that forgot to copy an input to the device fails here)."""
    fn = runtime.load("mathfn.cu").get_function("o1b_add_inplace")
    a, b = fake_gpu.zeros(5, np.float32), fake_gpu.asarray(np.arange(5, dtype=np.float32))
    view = a.reshape(5)
    fn((1,), (128,), (np.int64(5), view, b))
    assert a.get().tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match="numpy array"):
        fn((1,), (128,), (np.int64(5), a, np.arange(5, dtype=np.float32)))
