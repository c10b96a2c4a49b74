"""A reference module (cpu_ref, a spec module) whose pure functions are computed once per distinct
arguments: the op tests hold every GPU backend to the same reference results, so the second backend
reuses the first one's instead of computing them again.

SharedReference(module) answers like the module; its functions return copies of the first result
for arguments equal bit for bit (arrays by dtype, shape and bytes; other values by type and repr),
except the functions named in `in_place` (they write their arguments) and results larger than
`max_bytes` (cheaper to compute again than to hold). `scope(owner)` forgets every result when the
owner (the test function) changes, so one test's cases are held at a time. CPU_REF, SPEC_QUANT
and SPEC_ATTENTION are the ones the backend op tests and the emulators' flush-mode tests share, with
tests/helpers.py's int8 checks on them.
"""
from __future__ import annotations

import functools
import hashlib
import inspect

import numpy as np


def _key(v):
    if isinstance(v, np.ndarray):
        return ("a", v.dtype.str, v.shape, hashlib.blake2b(np.ascontiguousarray(v).tobytes(), digest_size=16).digest())
    if isinstance(v, np.generic):
        return ("g", v.dtype.str, v.tobytes())
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_key(x) for x in v))
    if isinstance(v, dict):
        return ("d", tuple((k, _key(x)) for k, x in sorted(v.items())))
    return (type(v).__name__, repr(v))


def _copy(v):
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(v, (tuple, list)):
        return type(v)(_copy(x) for x in v)
    return v


def _nbytes(v) -> int:
    if isinstance(v, np.ndarray):
        return v.nbytes
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return 0


class SharedReference:
    def __init__(self, module, in_place=(), max_bytes: int = 1 << 23):
        self._module, self._in_place, self._max_bytes = module, frozenset(in_place), max_bytes
        self._memo: dict = {}
        self._owner = None
        self.hits = 0

    def scope(self, owner) -> None:
        if owner is not self._owner:
            self._memo.clear()
            self._owner = owner

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if (name.startswith("_") or name in self._in_place or not callable(value) or inspect.isclass(value)
                or inspect.ismodule(value)):
            return value

        @functools.wraps(value)
        def shared(*args, **kwargs):
            key = (name, _key(args), _key(kwargs))
            if key in self._memo:
                self.hits += 1
                return _copy(self._memo[key])
            out = value(*args, **kwargs)
            if _nbytes(out) <= self._max_bytes:
                self._memo[key] = _copy(out)
            return out
        return shared


# ------------------------------------------------------------------ the references the op tests share
import mlx_open1b.cpu_ref as _cpu_ref  # noqa: E402
from mlx_open1b.spec import attention as _spec_attention, quant as _spec_quant  # noqa: E402

from helpers import QMAX4, assert_bits_equal  # noqa: E402

CPU_REF = SharedReference(_cpu_ref, in_place=("add_inplace", "scale_inplace", "adamw_step"))
SPEC_QUANT = SharedReference(_spec_quant)
SPEC_ATTENTION = SharedReference(_spec_attention)


def scope(owner) -> None:
    """Every shared reference holds owner's (a test function's) results only."""
    for ref in (CPU_REF, SPEC_QUANT, SPEC_ATTENTION):
        ref.scope(owner)


def check_qlinear_low(ops, x, w, dy, what, qmax=QMAX4):
    """A backend's int4 / int6 path (qmax=7 / 31) equals the numpy spec and cpu_ref bit for bit."""
    what = f"{what} (qmax {qmax})"
    y = ops.qlinear_forward(x, w, qmax=qmax)
    assert_bits_equal(y, SPEC_QUANT.qlinear_forward(x, w, qmax), f"{what} y")
    dx, dw = ops.qlinear_backward(dy, x, w, qmax=qmax)
    want_dx, want_dw = SPEC_QUANT.qlinear_backward(dy, x, w, qmax)
    assert_bits_equal(dx, want_dx, f"{what} dx")
    assert_bits_equal(dw, want_dw, f"{what} dw")
    assert_bits_equal(y, CPU_REF.qlinear_forward(x, w, qmax=qmax), f"{what} y, cpu_ref")
    ref_dx, ref_dw = CPU_REF.qlinear_backward(dy, x, w, qmax=qmax)
    assert_bits_equal(dx, ref_dx, f"{what} dx, cpu_ref")
    assert_bits_equal(dw, ref_dw, f"{what} dw, cpu_ref")
    return y, dx, dw


def check_attention_i8_backend(forward_i8, q, k, v, W, scale, what):
    """A backend's attention_forward_i8 equals the numpy spec and the C reference bit for bit."""
    o, lse = forward_i8(q, k, v, W, scale)
    want_o, want_lse = SPEC_ATTENTION.attention_forward_i8(q, k, v, W, np.float32(scale))
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert_bits_equal(o, want_o, f"{what} o")
    assert_bits_equal(lse, want_lse, f"{what} lse")
    ref_o, ref_lse = CPU_REF.attention_forward_i8(q, k, v, W, scale)
    assert_bits_equal(o, ref_o, f"{what} o (cpu_ref)")
    assert_bits_equal(lse, ref_lse, f"{what} lse (cpu_ref)")
    return o, lse
