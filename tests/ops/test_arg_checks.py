"""The per-call argument path of every C reference op: opargs.check's numpy fast path decides and
words every case as the one-by-one checks do, and cpu_ref's data pointer (read from the ndarray's
struct) is the pointer numpy gives for views, offsets, zero-size, read-only and reversed arrays."""
from __future__ import annotations

import platform

import numpy as np
import pytest

from mlx_open1b import opargs
from mlx_open1b.cpu_ref import _lib


class Sub(np.ndarray):
    pass


def _cases():
    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    return [base, base[1:], base[:, ::2], base.T, base.astype(np.float64), base.view(np.uint32),
            base.astype(np.uint16), np.empty(0, np.float32), base.view(Sub), base[None], base.reshape(-1),
            [1.0, 2.0], None, 3.0]


def _slow(name, a, dtype, shape=None, ndim=None):
    """check with the fast path left out: every case goes through _check_kind."""
    opargs._check_kind(name, a, dtype)
    return opargs._check_shape(name, a, shape, ndim)


def _outcome(fn, *args, **kw):
    try:
        return ("ok", fn(*args, **kw) is args[1])
    except ValueError as e:
        return ("error", str(e))


@pytest.mark.parametrize("i", range(len(_cases())))
@pytest.mark.parametrize("dtype", [opargs.F32, opargs.BF16])
@pytest.mark.parametrize("shape,ndim", [(None, None), ((6, 8), None), ((None, 8), None), ((6, None, 1), None),
                                        (None, 2), ((5, None), None)])
def test_the_fast_path_accepts_and_rejects_as_the_checks_one_by_one(i, dtype, shape, ndim):
    a = _cases()[i]
    assert _outcome(opargs.check, "x", a, dtype, shape=shape, ndim=ndim) == \
        _outcome(_slow, "x", a, dtype, shape=shape, ndim=ndim)


def test_the_data_pointer_is_numpys():
    # on CPython with numpy's usual struct the read passes its probes; elsewhere p() falls back to
    # ctypes, and the pointers below must be the same either way
    if platform.python_implementation() == "CPython" and np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        assert _lib._data is not None
    base = np.arange(60, dtype=np.float32).reshape(5, 12)
    ro = base.copy()
    ro.flags.writeable = False
    for a in (base, base[2:], base[1:, 3:], base.reshape(-1)[7:9], base[::-1], base.T, ro, base.view(Sub),
              np.empty(0, np.int8), np.zeros(3, np.uint16)[1:], np.float32(2.0) * np.ones(1, np.float32)):
        assert _lib.p(a) == a.ctypes.data
    assert _lib.p(None) is None
    with pytest.raises(ValueError, match="numpy arrays"):
        _lib.p([1.0])


def test_the_struct_read_is_cpythons_only(monkeypatch):
    """Elsewhere id() need not be an address: the ctypes pointer is used, nothing read at id(a)."""
    import types
    monkeypatch.setattr(_lib, "sys", types.SimpleNamespace(implementation=types.SimpleNamespace(name="pypy")))
    assert _lib._data_reader() is None
