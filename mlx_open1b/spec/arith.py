"""CONTRACT.md §1–§3 in numpy: flush, canonical NaN, bf16 conversion, the primitive operations."""
from __future__ import annotations

import numpy as np

F32, U32, F64 = np.float32, np.uint32, np.float64
NAN_BITS = 0x7FC00000
MIN_NORMAL = 2.0 ** -126


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=F32)


def bits(x) -> np.ndarray:
    return f32(x).view(U32)


def from_bits(u) -> np.ndarray:
    return np.asarray(u, dtype=U32).view(F32)


def signed_zero_like(x) -> np.ndarray:
    return from_bits(bits(x) & U32(0x80000000))


def flush(x) -> np.ndarray:
    """Subnormal -> zero of the same sign."""
    x = f32(x)
    return np.where((bits(x) & U32(0x7F800000)) == 0, signed_zero_like(x), x).astype(F32)


def canon(x) -> np.ndarray:
    x = f32(x)
    return np.where(np.isnan(x), from_bits(U32(NAN_BITS)), x).astype(F32)


def store(x) -> np.ndarray:
    return canon(flush(x))


def add(a, b) -> np.ndarray:
    with np.errstate(all="ignore"):
        return flush(f32(a) + f32(b))


def sub(a, b) -> np.ndarray:
    with np.errstate(all="ignore"):
        return flush(f32(a) - f32(b))


def neg(a) -> np.ndarray:
    return from_bits(bits(a) ^ U32(0x80000000))


def mul(a, b) -> np.ndarray:
    """IEEE product, except that an exact product of magnitude < 2^-126 is a signed zero."""
    a, b = f32(a), f32(b)
    with np.errstate(all="ignore"):
        r = a * b
        tiny = np.abs(a.astype(F64) * b.astype(F64)) < MIN_NORMAL
    return np.where(tiny, signed_zero_like(r), r).astype(F32)


def div(a, b) -> np.ndarray:
    a, b = f32(a), f32(b)
    with np.errstate(all="ignore"):
        r = a / b
        tiny = np.abs(a.astype(F64)) < MIN_NORMAL * np.abs(b.astype(F64))
    return np.where(tiny, signed_zero_like(r), r).astype(F32)


def sqrt(x) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.sqrt(f32(x)).astype(F32)


def maximum(a, b) -> np.ndarray:
    """b > a ? b : a (a NaN in a survives, a NaN in b is passed over)."""
    a, b = f32(a), f32(b)
    return np.where(b > a, b, a).astype(F32)


def i2f(i) -> np.ndarray:
    return np.asarray(i).astype(F32)


def bf16_to_f32(h) -> np.ndarray:
    return flush(from_bits(np.asarray(h, dtype=np.uint16).astype(U32) << U32(16)))


def f32_to_bf16(x) -> np.ndarray:
    u = bits(flush(x)).astype(np.uint64)
    isnan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(isnan, 0x7FC0, r).astype(np.uint16)


def round_bf16(x) -> np.ndarray:
    """fp32 -> bf16 -> fp32: the value a bf16 store keeps."""
    return bf16_to_f32(f32_to_bf16(x))
