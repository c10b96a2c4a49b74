"""AdamW, the canonical sum of squares and global norm, the tree fold, and clipping."""
from __future__ import annotations

from typing import Sequence

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
    """One AdamW step in place on bf16 params p_ with fp32 moments m, v; `step` is 1-based."""
    n, scalars = opargs.adamw(p_, g, m, v, lr, beta1, beta2, eps, weight_decay, step)
    _adamw(n, p(p_), p(g), p(m), p(v), *scalars)


def sumsq_blocks(x: np.ndarray) -> np.ndarray:
    """Per-block sums of squares of x (flattened), NORM_BLOCK elements per block."""
    out = np.empty(opargs.sumsq_blocks(x, NORM_BLOCK), np.float32)
    _sumsq_blocks(x.size, p(x), p(out))
    return out


def treefold(values: np.ndarray) -> float:
    """The binary-carry tree fold of a float32 vector (CONTRACT.md §7)."""
    n = opargs.treefold(values)
    return float(np.float32(_treefold(n, p(values))))


def global_norm(tensors: Sequence[np.ndarray]) -> float:
    """sqrt of the tree fold of all block partials, tensors in the given (canonical) order."""
    parts = [sumsq_blocks(t) for t in opargs.global_norm(tensors)]
    return float(scalar_sqrt(treefold(np.concatenate(parts))))


def clip_coef(norm: float, max_norm: float) -> float:
    """div(max_norm, add(norm, 1e-6)) in float32; the caller scales only when it is < 1."""
    return float(_clip_coef(float(np.float32(norm)), float(np.float32(max_norm))))
