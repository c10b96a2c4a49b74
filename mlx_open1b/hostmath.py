"""Host-side scalar arithmetic (CONTRACT.md §8).

Scalars that kernels receive (bias corrections, 1 - lr*wd, reciprocals) are computed in Python
floats (IEEE binary64) with + - * / only — operations every platform rounds correctly — and then
rounded once to float32. No pow, exp or cos from a C library: those differ between libms.
"""
from __future__ import annotations

import numpy as np


def f32(x: float) -> float:
    """Round a binary64 value to the nearest float32 (ties to even), returned as a Python float."""
    return float(np.float32(x))


def pow_int(base: float, n: int) -> float:
    """base**n for an integer n >= 0 by binary exponentiation: squares of the base taken from
    the lowest bit up, multiplied into the result in that order."""
    if n < 0:
        raise ValueError(f"pow_int: exponent must be >= 0, got {n}")
    result, sq = 1.0, float(base)
    while n:
        if n & 1:
            result = result * sq
        sq = sq * sq
        n >>= 1
    return result


def adamw_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> dict:
    """The float32 scalars of the AdamW kernel for optimizer step `step` (1-based)."""
    if step < 1:
        raise ValueError(f"adamw step must be >= 1, got {step}")
    return dict(
        lr=f32(lr), b1=f32(beta1), b2=f32(beta2), omb1=f32(1.0 - beta1), omb2=f32(1.0 - beta2),
        eps=f32(eps), decay=f32(1.0 - lr * weight_decay),
        bc1=f32(1.0 / (1.0 - pow_int(beta1, step))), bc2=f32(1.0 / (1.0 - pow_int(beta2, step))))


def reciprocal(n: int) -> float:
    """1/n rounded once to float32: every average is a multiply by this."""
    return f32(1.0 / n)


PI_F64 = 3.141592653589793          # the binary64 nearest to pi
# (-1)^k / (2k)! for k = 0..13, each a correctly rounded int/int division (Python's true division)
_COS_COEFS = [(-1) ** k / _fact for k, _fact in
              enumerate([1, 2, 24, 720, 40320, 3628800, 479001600, 87178291200, 20922789888000,
                         6402373705728000, 2432902008176640000, 1124000727777607680000,
                         620448401733239439360000, 403291461126605635584000000])]


def cos_pi_f64(f: float) -> float:
    """cos(pi * f) for f in [0, 1], in binary64 + - * / only (no libm): fold to f <= 1/2, then a
    Taylor polynomial in z = (pi f)^2 evaluated by Horner from the highest term (error < 1e-15)."""
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"cos_pi_f64: f must be in [0, 1], got {f}")
    sign = 1.0
    if f > 0.5:
        f, sign = 1.0 - f, -1.0
    x = PI_F64 * f
    z = x * x
    acc = _COS_COEFS[-1]
    for c in reversed(_COS_COEFS[:-1]):
        acc = acc * z + c
    return sign * acc
