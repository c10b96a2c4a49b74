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


def attention_i8_inputs(rng: np.random.Generator, B: int, T: int, H: int, G: int, D: int,
                        specials: bool = False):
    """q, k, v bf16 for the int8 attention forward (CONTRACT.md §6.10). Value rows (the D values of
    one key and kv head, each quantized alone) of very different magnitudes; with specials also a
    ±0 row (s_v = +0), a subnormal row (flushed: a zero row), a tiny row (s_v flushes), a row of
    largest normals, tie rows (s_v = 1: half-integer levels), a row holding +inf and one holding a
    NaN (s_v NaN: every query that sees it is NaN), and finite specials (±0, subnormals, ±1, tiny
    and large powers of two) sprinkled into q and k."""
    q = rand_bf16(rng, (B, T, H, D))
    k = rand_bf16(rng, (B, T, G, D))
    mag = np.exp(2.0 * rng.standard_normal((B, T, G, 1)))
    v = f32_to_bf16((rng.standard_normal((B, T, G, D)) * mag).astype(np.float32))
    if specials:
        rows = v.reshape(-1, D)
        pick = iter(rng.permutation(rows.shape[0]))
        kinds = {
            "zero": lambda: np.where(rng.integers(0, 2, D) == 1, 0x8000, 0).astype(np.uint16),
            "subnormal": lambda: (rng.integers(0, 0x10000, D) & 0x807F).astype(np.uint16),
            "tiny": lambda: f32_to_bf16((rng.uniform(-1, 1, D) * 2.0 ** -120).astype(np.float32)),
            "huge": lambda: np.where(rng.integers(0, 2, D) == 1, 0x7F7F, 0xFF7F).astype(np.uint16),
            "tie": lambda: f32_to_bf16(np.concatenate([[127.0], rng.integers(-253, 254, D - 1) / 2.0])
                                       .astype(np.float32)),
            "tie2": lambda: f32_to_bf16(np.concatenate([[-127.0], rng.integers(-253, 254, D - 1) / 2.0])
                                        .astype(np.float32)),
        }
        for name, make in kinds.items():
            r = next(pick, None)
            if r is not None:
                rows[r] = make()
        for bad in (0x7F80, 0x7FC1):
            r = next(pick, None)
            if r is not None:
                rows[r, rng.integers(D)] = bad
        fin = SPECIAL_BF16[[0, 1, 6, 7, 8, 9, 12, 13, 14]]
        q, k = sprinkle(rng, q, fin, 0.01), sprinkle(rng, k, fin, 0.01)
    return q, k, v
