"""The int8 quantized linear layer (CONTRACT.md §6.9): quantizers, the exact int8 GEMM, the
Walsh-Hadamard rotation, and the layer's forward and backward."""
from __future__ import annotations

import numpy as np

from mlx_open1b import opargs
from ._lib import c_i64, declare, empty_lines, p, ptr
import ctypes

_qw = declare("o1b_quant_weight_rows", c_i64, c_i64, ptr, ptr, ptr)
_qt = declare("o1b_quant_tensor", c_i64, ptr, ptr, ptr, restype=ctypes.c_int)
_qtf = declare("o1b_quant_tensor_f32", c_i64, ptr, ptr, ptr, restype=ctypes.c_int)
_gemm = declare("o1b_gemm_i8", c_i64, c_i64, c_i64, ptr, ptr, ptr)
_vnni = declare("o1b_gemm_i8_has_vnni", restype=ctypes.c_int)
_amx = declare("o1b_q_amx_present", restype=ctypes.c_int)
_amx_runs = declare("o1b_q_amx_runs", restype=ctypes.c_int64)
_had = declare("o1b_hadamard_rows", c_i64, c_i64, ptr)
_fwd = declare("o1b_qlinear_forward_q", c_i64, c_i64, c_i64, ptr, ptr, ptr, ctypes.c_int, restype=ctypes.c_int)
_bwd = declare("o1b_qlinear_backward_q", c_i64, c_i64, c_i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int,
               restype=ctypes.c_int)

from mlx_open1b.contract import Q_MAX_P, QB, QMAX  # noqa: E402,F401  (QB, Q_MAX_P re-exported)


def _ok(rc: int) -> None:
    if rc != 0:
        raise MemoryError("the C reference could not allocate its int8 work buffers")


def quant_weight_rows(w: np.ndarray):
    M, K = opargs.quant_weight_rows(w)
    q = np.empty((M, K), np.int8)
    s = np.empty(M, np.float32)
    _qw(M, K, p(w), p(q), p(s))
    return q, s


def quant_tensor(x: np.ndarray):
    f32 = x.dtype == np.float32
    n = opargs.quant_tensor(x, opargs.F32 if f32 else opargs.BF16)
    q = np.empty(x.shape, np.int8)
    s = np.empty(1, np.float32)
    _ok((_qtf if f32 else _qt)(n, p(x), p(q), p(s)))
    return q, s[0]


def gemm_i8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    I, J, P = opargs.gemm_i8(a, b)
    c = np.empty((I, J), np.int32)
    _gemm(I, J, P, p(a), p(b), p(c))
    return c


def gemm_i8_has_vnni() -> bool:
    """Whether the AVX-512 VNNI kernel is in use (at the current SIMD cap)."""
    return bool(_vnni())


def gemm_i8_has_amx() -> bool:
    """Whether this CPU and kernel give the VNNI path AMX int8 tiles for its GEMM blocks (used
    unless switched off with runtime.settings(amx=False); the same bits either way)."""
    return bool(_amx()) and gemm_i8_has_vnni()


def gemm_i8_amx_runs() -> int:
    """How many runs of GEMM blocks have gone to the AMX tiles in this process (a test's proof
    that the tile path ran)."""
    return int(_amx_runs())


def hadamard_rows(f: np.ndarray) -> np.ndarray:
    f = np.array(f, np.float32, copy=True, order="C")
    R, C = opargs.hadamard_rows(f)
    _had(R, C, p(f))
    return f


def qlinear_forward(x: np.ndarray, w: np.ndarray, qmax: int = QMAX) -> np.ndarray:
    N, K, M = opargs.qlinear_forward(x, w)
    qmax = opargs.qmax(qmax)
    y = empty_lines((N, M))
    _ok(_fwd(N, K, M, p(x), p(w), p(y), qmax))
    return y


def qlinear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, need_dx: bool = True,
                     need_dw: bool = True, qmax: int = QMAX, *, dw_out: np.ndarray | None = None):
    N, K, M = opargs.qlinear_backward(dy, x, w)
    qmax = opargs.qmax(qmax)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    dx = empty_lines((N, K)) if need_dx else None
    dw = (empty_lines((M, K)) if dw_out is None else dw_out) if need_dw else None
    _ok(_bwd(N, K, M, p(dy), p(x), p(w), p(dx), p(dw), qmax))
    return dx, dw
