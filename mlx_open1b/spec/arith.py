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


def div_int(a, b) -> np.ndarray:
    """div by its integer definition (CONTRACT.md §3): with a = ma 2^(Ea-150), b = mb 2^(Eb-150)
    (24-bit significands), Q, R = divmod(ma 2^s, mb) with s = 24 if ma < mb else 23 (Q in
    [2^23, 2^24)), a/b = (Q + R/mb) 2^(E-150) with E = Ea - Eb + 150 - s; E <= 0: the signed zero
    (exact value below 2^-126); E >= 255: the signed infinity; else Q + 1 if 2R > mb (2R = mb
    cannot happen), built as the bits (E << 23) + Q - 2^23 (Q never rounds up to 2^24: with a
    remainder Q <= 2^24 - 2, CONTRACT.md §3). Equals div for every pair of fp32 operands."""
    ua, ub = bits(flush(a)), bits(flush(b))
    ua, ub = np.broadcast_arrays(ua, ub)
    sign = (ua ^ ub) & U32(0x80000000)
    xa, xb = (ua & U32(0x7FFFFFFF)).astype(np.int64), (ub & U32(0x7FFFFFFF)).astype(np.int64)
    inf = 0x7F800000
    ma, mb = (xa & 0x7FFFFF) | 0x800000, (xb & 0x7FFFFF) | 0x800000
    s = np.where(ma < mb, 24, 23)
    Q, R = np.divmod(ma << s, mb)
    E = (xa >> 23) - (xb >> 23) + 150 - s
    Q = Q + (2 * R > mb)
    mag = np.where(E <= 0, 0, np.where(E >= 255, inf, (np.clip(E, 1, 254) << 23) + Q - 0x800000))
    mag = np.where(xa == 0, 0, mag)                                   # 0/x
    mag = np.where(xb == inf, 0, mag)                                 # x/inf
    mag = np.where((xb == 0) | (xa == inf), inf, mag)                 # x/0, inf/x
    nan = (xa > inf) | (xb > inf) | ((xa == 0) & (xb == 0)) | ((xa == inf) & (xb == inf))
    out = np.where(nan, NAN_BITS, sign.astype(np.int64) | mag)
    return out.astype(U32).view(F32)


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
