"""Linear layer y = x W^T with bf16 operands and fp32 accumulation in contract order."""
from __future__ import annotations

import numpy as np

from mlx_open1b import opargs
from ._lib import c_i64, declare, p, ptr

_forward = declare("o1b_linear_forward", c_i64, c_i64, c_i64, ptr, ptr, ptr)
_backward = declare("o1b_linear_backward", c_i64, c_i64, c_i64, ptr, ptr, ptr, ptr, ptr)


def linear_forward(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    N, K, M = opargs.linear_forward(x, w)
    y = np.empty((N, M), np.float32)
    _forward(N, K, M, p(x), p(w), p(y))
    return y


def linear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, need_dx: bool = True,
                    need_dw: bool = True, *, dw_out: np.ndarray | None = None):
    N, K, M = opargs.linear_backward(dy, x, w)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    dx = np.empty((N, K), np.float32) if need_dx else None
    dw = (np.empty((M, K), np.float32) if dw_out is None else dw_out) if need_dw else None
    _backward(N, K, M, p(dy), p(x), p(w), p(dx), p(dw))
    return dx, dw
