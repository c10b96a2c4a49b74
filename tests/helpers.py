"""Shared test helpers: bit comparison with a useful message, seeded inputs, special values."""
from __future__ import annotations

import numpy as np

from mlx_open1b.spec.arith import f32_to_bf16

SPECIAL_F32 = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1e-45, 2.0 ** -126,
                        -(2.0 ** -126), 3.4028235e38, -3.4028235e38, 1.0, -1.0, 2.0 ** -70, 2.0 ** 70],
                       np.float32)
SPECIAL_BF16 = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFC0, 0x0001, 0x8001, 0x007F,
                         0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x1D80, 0x6280], np.uint16)


def assert_bits_equal(a, b, what: str = "") -> None:
    """Bit equality of two float32 (or uint16) arrays, reporting the first mismatch."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shapes differ {a.shape} vs {b.shape}"
    view = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    ua, ub = np.ascontiguousarray(a).view(view), np.ascontiguousarray(b).view(view)
    bad = np.argwhere(ua != ub)
    if bad.size:
        i = tuple(bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {a.size} elements differ; first at {i}: "
                             f"{a[i]!r} (0x{int(ua[i]):08x}) vs {b[i]!r} (0x{int(ub[i]):08x})")


def rand_f32(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def rand_bf16(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return f32_to_bf16(rand_f32(rng, shape, scale))


def sprinkle(rng: np.random.Generator, a: np.ndarray, specials: np.ndarray, frac: float = 0.05) -> np.ndarray:
    """A copy of a with a fraction of its entries replaced by special values."""
    a = a.copy()
    flat = a.reshape(-1)
    k = max(1, int(frac * flat.size))
    flat[rng.choice(flat.size, k, replace=False)] = rng.choice(specials, k)
    return a
