"""AdamW, the canonical sum of squares, the tree fold, clipping and the host square root (the global
norm is built from them: mlx_open1b.derived_ops)."""
from __future__ import annotations

import numpy as np

from mlx_open1b import opargs
from ._lib import c_f32, c_i64, declare, p, ptr

_adamw = declare("o1b_adamw_step", c_i64, ptr, ptr, ptr, ptr, *([c_f32] * 9))
_sumsq_blocks = declare("o1b_sumsq_blocks", c_i64, ptr, ptr)
_norm_block = declare("o1b_norm_block", restype=c_i64)
_treefold = declare("o1b_treefold", c_i64, ptr, restype=c_f32)
_clip_coef = declare("o1b_clip_coef", c_f32, c_f32, restype=c_f32)
scalar_sqrt = declare("o1b_scalar_sqrt", c_f32, restype=c_f32)
NORM_BLOCK = int(_norm_block())


def adamw_step(p_: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, *, lr: float,
               beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
               step: int) -> None:
    n, scalars = opargs.adamw(p_, g, m, v, lr, beta1, beta2, eps, weight_decay, step)
    _adamw(n, p(p_), p(g), p(m), p(v), *scalars)


def sumsq_blocks(x: np.ndarray) -> np.ndarray:
    out = np.empty(opargs.sumsq_blocks(x, NORM_BLOCK), np.float32)
    _sumsq_blocks(x.size, p(x), p(out))
    return out


def treefold(values: np.ndarray) -> float:
    n = opargs.treefold(values)
    return float(np.float32(_treefold(n, p(values))))


def clip_coef(norm: float, max_norm: float) -> float:
    return float(_clip_coef(float(np.float32(norm)), float(np.float32(max_norm))))
