"""Philox4x32-10 blocks and the truncated-normal initializer (CONTRACT.md §5)."""
from __future__ import annotations

import numpy as np

from ..contract import INIT_SIGMA
from ._lib import c_f32, c_i64, c_u32, c_u64, declare, ptr

_fill = declare("o1b_philox_fill", c_u64, c_u32, c_u64, c_u32, c_i64, ptr)
_tn = declare("o1b_trunc_normal", c_u64, c_u32, c_u64, c_f32, c_i64, ptr)


def _u(name: str, value: int, bits: int) -> int:
    if int(value) != value or not 0 <= value < 2 ** bits:
        raise ValueError(f"{name}: expected an integer in [0, 2^{bits}), got {value!r}")
    return int(value)


def philox_blocks(seed: int, stream: int, index0: int, n: int, sub: int = 0) -> np.ndarray:
    """(n, 4) uint32: the Philox block at (seed, stream, index0 + i, sub) for i < n."""
    out = np.empty((int(n), 4), np.uint32)
    _fill(_u("seed", seed, 64), _u("stream", stream, 32), _u("index0", index0, 64), _u("sub", sub, 32),
          int(n), out.ctypes.data)
    return out


def trunc_normal(seed: int, stream: int, index0: int, n: int, sigma: float = INIT_SIGMA) -> np.ndarray:
    """(n,) float32 truncated normal N(0, sigma^2) cut at +-2 sigma; element i is a pure
    function of (seed, stream, index0 + i)."""
    out = np.empty(int(n), np.float32)
    _tn(_u("seed", seed, 64), _u("stream", stream, 32), _u("index0", index0, 64),
        float(np.float32(sigma)), int(n), out.ctypes.data)
    return out
