"""CONTRACT.md §4 in numpy: exp, log, sin, cos, rsqrt, sigmoid, silu, step for step."""
from __future__ import annotations

import numpy as np

from .arith import (F32, U32, add, bits, canon, div, flush, from_bits, i2f, mul, neg, sqrt,
                    sub)

MAGIC = F32(12582912.0)  # 1.5 * 2^23


def _c(h: str) -> np.float32:
    return F32(float.fromhex(h))


def _horner(coefs, z):
    p = np.full(np.shape(z), coefs[0], F32)
    for c in coefs[1:]:
        p = add(mul(p, z), c)
    return p


EXP_COEFS = [_c("0x1.a01a02p-13"), _c("0x1.6c16c2p-10"), _c("0x1.111112p-7"), _c("0x1.555556p-5"),
             _c("0x1.555556p-3"), _c("0x1p-1"), F32(1.0), F32(1.0)]


def exp(x) -> np.ndarray:
    x = flush(x)
    with np.errstate(all="ignore"):
        nf = sub(add(mul(x, _c("0x1.715476p0")), MAGIC), MAGIC)
        n = np.nan_to_num(nf, nan=0.0, posinf=0.0, neginf=0.0).astype(np.int64)
        r = sub(sub(x, mul(nf, _c("0x1.62e4p-1"))), mul(nf, _c("0x1.7f7d1cp-20")))
        p = _horner(EXP_COEFS, r)
        scale = from_bits((np.clip(n, -126, 127) + 127).astype(U32) << U32(23))
        y = np.where(n > 127, mul(mul(p, F32(2.0)), F32(2.0 ** 127)), mul(p, scale))
    y = np.where(n < -126, F32(0.0), y)
    y = np.where(x < _c("-0x1.9cp6"), F32(0.0), y)
    y = np.where(x > _c("0x1.62e42ep6"), F32(np.inf), y)
    return canon(y).astype(F32)


def log(x) -> np.ndarray:
    u = bits(flush(x))
    e = (u >> U32(23)).astype(np.int64) - 127
    m = from_bits((u & U32(0x7FFFFF)) | U32(0x3F800000))
    big = m > _c("0x1.6a09e6p0")
    m = np.where(big, mul(m, F32(0.5)), m)
    e = e + big
    f = sub(m, F32(1.0))
    s = div(f, add(F32(2.0), f))
    z = mul(s, s)
    R = mul(_horner([_c("0x1.c71c72p-3"), _c("0x1.24924ap-2"), _c("0x1.99999ap-2"), _c("0x1.555556p-1")], z), z)
    hfsq = mul(F32(0.5), mul(f, f))
    ef = i2f(e)
    r = add(mul(s, add(hfsq, R)), mul(ef, _c("0x1.7f7d1cp-20")))
    r = add(sub(r, hfsq), f)
    y = add(r, mul(ef, _c("0x1.62e4p-1")))
    a = u & U32(0x7FFFFFFF)
    y = np.where(u == U32(0x7F800000), F32(np.inf), y)
    y = np.where(u >> U32(31) == 1, F32(np.nan), y)
    y = np.where(a == 0, F32(-np.inf), y)
    y = np.where(a > U32(0x7F800000), F32(np.nan), y)
    return canon(y).astype(F32)


def _reduce(x):
    nf = sub(add(mul(x, _c("0x1.45f306p-1")), MAGIC), MAGIC)
    y = sub(x, mul(nf, _c("0x1.92p0")))
    y = sub(y, mul(nf, _c("0x1.fb4p-12")))
    r = sub(y, mul(nf, _c("0x1.4442d2p-24")))
    nf0 = np.nan_to_num(nf, nan=0.0, posinf=0.0, neginf=0.0)
    q = np.where(np.abs(nf0) < 2.0 ** 31, nf0, 0).astype(np.int64) & 3   # |nf| >= 2^25: a multiple of 4
    return r, q


def _sin_poly(r):
    z = mul(r, r)
    p = _horner([_c("0x1.71de3ap-19"), _c("-0x1.a01a02p-13"), _c("0x1.111112p-7"), _c("-0x1.555556p-3")], z)
    return add(r, mul(mul(r, z), p))


def _cos_poly(r):
    z = mul(r, r)
    p = _horner([_c("-0x1.27e4fcp-22"), _c("0x1.a01a02p-16"), _c("-0x1.6c16c2p-10"), _c("0x1.555556p-5"),
                 _c("-0x1p-1")], z)
    return add(F32(1.0), mul(z, p))


def sin(x) -> np.ndarray:
    x = flush(x)
    with np.errstate(all="ignore"):
        r, q = _reduce(np.where(np.isfinite(x), x, F32(0)))
        v = np.where(q & 1, _cos_poly(r), _sin_poly(r))
        v = np.where(q & 2, neg(v), v)
        v = np.where(np.abs(x) < F32(2.0 ** -12), x, v)
    return canon(np.where(np.isfinite(x), v, F32(np.nan))).astype(F32)


def cos(x) -> np.ndarray:
    x = flush(x)
    with np.errstate(all="ignore"):
        r, q = _reduce(np.where(np.isfinite(x), x, F32(0)))
        v = np.where(q & 1, _sin_poly(r), _cos_poly(r))
        v = np.where((q == 1) | (q == 2), neg(v), v)
    return canon(np.where(np.isfinite(x), v, F32(np.nan))).astype(F32)


def rsqrt(x) -> np.ndarray:
    return canon(div(F32(1.0), sqrt(flush(x))))


def sigmoid(x) -> np.ndarray:
    return canon(div(F32(1.0), add(F32(1.0), exp(neg(flush(x))))))


def silu(x) -> np.ndarray:
    x = flush(x)
    return canon(mul(x, sigmoid(x)))
