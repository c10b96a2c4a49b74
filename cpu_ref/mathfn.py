"""The contract's scalar functions over arrays, bf16 conversions, and small elementwise ops."""
from __future__ import annotations

import contextlib

import numpy as np

from mlx_open1b import opargs
from mlx_open1b.opargs import BF16, F32, FUNCTIONS  # noqa: F401  (FUNCTIONS re-exported)
from ._lib import c_f32, c_i64, c_int, declare, p, ptr

_map = declare("o1b_map", c_int, c_i64, ptr, ptr)
_to_bf16 = declare("o1b_f32_to_bf16_array", c_i64, ptr, ptr)
_to_f32 = declare("o1b_bf16_to_f32_array", c_i64, ptr, ptr)
_div_array = declare("o1b_div_array", c_int, c_i64, ptr, ptr, ptr)
_i2f_acc = declare("o1b_i2f_acc_array", c_i64, ptr, ptr)
_add_inplace = declare("o1b_add_inplace", c_i64, ptr, ptr)
_add_array = declare("o1b_add_array", c_i64, ptr, ptr, ptr)
_scale_inplace = declare("o1b_scale_inplace", c_i64, ptr, c_f32)
scalar_add = declare("o1b_scalar_add", c_f32, c_f32, restype=c_f32)
scalar_sub = declare("o1b_scalar_sub", c_f32, c_f32, restype=c_f32)
scalar_mul = declare("o1b_scalar_mul", c_f32, c_f32, restype=c_f32)
scalar_div = declare("o1b_scalar_div", c_f32, c_f32, restype=c_f32)
_set_vmath = declare("o1b_set_vmath", c_int)


@contextlib.contextmanager
def vector_math(on: bool):
    """Temporarily choose the SIMD forms of the software functions and of the ops built on them
    (cross-entropy, SwiGLU; vmath.c, the default) or contract.h's scalar loops. Both give the same
    bits; the tests hold them equal at every SIMD level."""
    _set_vmath(int(bool(on)))
    try:
        yield
    finally:
        _set_vmath(1)


def _apply(index: int, x: np.ndarray) -> np.ndarray:
    y = np.empty_like(x)
    _map(index, x.size, p(x), p(y))
    return y


exp, log, sin, cos, sqrt, rsqrt, sigmoid, silu, sqrt_int = opargs.map_functions(_apply)


def _div(op: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    opargs.div_int(a, b)
    y = np.empty(a.shape, F32)
    _div_array(op, a.size, p(a), p(b), p(y))
    return y


def div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The contract's div (CONTRACT.md §3) elementwise, as the C reference computes it: C `/`
    (IEEE 754) with the exact check of the flush rule."""
    return _div(0, a, b)


def div_int(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _div(1, a, b)


def i2f_acc(v: np.ndarray) -> np.ndarray:
    """int32 -> fp32 of every element (CONTRACT.md §6.9, an int8 GEMM accumulator's conversion) by
    the contract's exact halves: add(mul(i2f(hi), 2^16), i2f(lo))."""
    opargs.check("v", v, opargs.I32)
    y = np.empty(v.shape, F32)
    _i2f_acc(v.size, p(v), p(y))
    return y


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    opargs.f32_to_bf16(x)
    y = np.empty(x.shape, BF16)
    _to_bf16(x.size, p(x), p(y))
    return y


def bf16_to_f32(x: np.ndarray) -> np.ndarray:
    opargs.bf16_to_f32(x)
    y = np.empty(x.shape, F32)
    _to_f32(x.size, p(x), p(y))
    return y


def add_inplace(a: np.ndarray, b: np.ndarray) -> None:
    n = opargs.add_inplace(a, b)
    _add_inplace(n, p(a), p(b))


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b (a on the left) as a new array: add_inplace's arithmetic in one pass."""
    n = opargs.add_inplace(a, b, inplace=False)
    out = np.empty(a.shape, F32)
    _add_array(n, p(a), p(b), p(out))
    return out


def scale_inplace(a: np.ndarray, s: float) -> None:
    n = opargs.scale_inplace(a)
    _scale_inplace(n, p(a), float(np.float32(s)))
