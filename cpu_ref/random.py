"""Philox4x32-10 blocks and the truncated-normal initializer (CONTRACT.md §5)."""
from __future__ import annotations

import numpy as np

from mlx_open1b.contract import INIT_SIGMA
from mlx_open1b import opargs
from ._lib import c_f32, c_i64, c_u32, c_u64, declare, ptr

_fill = declare("o1b_philox_fill", c_u64, c_u32, c_u64, c_u32, c_i64, ptr)
_tn = declare("o1b_trunc_normal", c_u64, c_u32, c_u64, c_f32, c_i64, ptr)


def philox_blocks(seed: int, stream: int, index0: int, n: int, sub: int = 0) -> np.ndarray:
    out = np.empty((int(n), 4), np.uint32)
    _fill(*opargs.philox(seed, stream, index0, sub), int(n), out.ctypes.data)
    return out


def trunc_normal(seed: int, stream: int, index0: int, n: int, sigma: float = INIT_SIGMA) -> np.ndarray:
    out = np.empty(int(n), np.float32)
    seed, stream, index0, _ = opargs.philox(seed, stream, index0)
    _tn(seed, stream, index0, float(np.float32(sigma)), int(n), out.ctypes.data)
    return out
