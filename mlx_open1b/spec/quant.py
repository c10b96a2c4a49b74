"""CONTRACT.md §6.9 (int8 quantized linear) in numpy, written from the contract text.

Integer GEMMs are computed as float64 matmuls of int8 values: every partial sum is an integer of
magnitude below 2^31 < 2^53, so the float64 result is exact whatever order BLAS uses.
"""
from __future__ import annotations

import numpy as np

from .. import contract
from ..contract import QB, QMAX, QMAX4, QMAX6

from .arith import F32, add, bf16_to_f32, div, f32, flush, from_bits, mul, store, sub

QW_COEF, QW_COEF4, QW_COEF6 = (np.float32(c) for c in (contract.QW_COEF, contract.QW_COEF4, contract.QW_COEF6))
COEF = {QMAX: QW_COEF, QMAX4: QW_COEF4, QMAX6: QW_COEF6}
INV_QB = np.float32(contract.INV_QB)
NAN = from_bits(np.uint32(0x7FC00000))


def i2f(acc) -> np.ndarray:
    """int32 -> fp32 (CONTRACT.md §6.9): add(mul(i2f(hi), 2^16), i2f(lo)) with hi = floor(acc / 2^16),
    lo = acc mod 2^16, both exact in fp32; equals the IEEE conversion (round to nearest even)."""
    a = np.asarray(acc, np.int64).astype(np.int32).astype(np.int64)
    hi, lo = a >> 16, a & 0xFFFF
    return add(mul(hi.astype(F32), F32(65536.0)), lo.astype(F32))


def rne_clamp(t, qmax=QMAX) -> np.ndarray:
    return np.clip(np.rint(f32(t)), -qmax, qmax).astype(np.int8)


def weight_scales(w, qmax=QMAX):
    """w (M, K) bf16 -> s (M,) fp32 (NaN where the row sum is not finite)."""
    wf = bf16_to_f32(w)
    M, K = wf.shape
    S = np.zeros(M, F32)
    for k in range(K):
        S = add(S, np.abs(wf[:, k]))
    s = mul(div(S, F32(K)), COEF[qmax])
    return np.where(np.isfinite(S), s, NAN).astype(F32)


def quant_weight_rows(w, with_clip=False, qmax=QMAX):
    wf = bf16_to_f32(w)
    s = weight_scales(w, qmax)
    ok = np.isfinite(s) & (s != 0)
    with np.errstate(all="ignore"):
        inv = div(F32(1), np.where(ok, s, F32(1)))
        t = mul(wf, inv[:, None])
    q = np.where(ok[:, None], rne_clamp(np.where(ok[:, None], t, 0), qmax), 0).astype(np.int8)
    if not with_clip:
        return q, store(s)
    clip = np.where(ok[:, None], (np.abs(t) > qmax).astype(np.uint8), 0)
    clip = np.where(np.isnan(s)[:, None], 2, clip).astype(np.uint8)
    return q, store(s), clip


def _tensor_scale(v, qmax=QMAX):
    v = flush(f32(v))
    if v.size and not np.all(np.isfinite(v)):
        return NAN
    amax = np.abs(v).max() if v.size else F32(0)
    return div(amax, F32(qmax))


def quant_tensor_f32(v, qmax=QMAX):
    v = flush(f32(v))
    s = _tensor_scale(v, qmax)
    if not (np.isfinite(s) and s != 0):
        return np.zeros(v.shape, np.int8), store(s)
    inv = div(F32(1), s)
    return rne_clamp(mul(v, inv), qmax), store(s)


def quant_tensor(x, qmax=QMAX):
    return quant_tensor_f32(bf16_to_f32(x), qmax)


def hadamard_rows(f, integer=False):
    """Rotate (R, C) along the rows in blocks of QB: stages h = 1, 2, ..., QB/2, rows i and i+h
    (i & h == 0) -> (add(a, b), sub(a, b))."""
    f = np.array(f, np.int64 if integer else F32, copy=True)
    if not integer:
        f = flush(f)
    R = f.shape[0]
    blocks = f.reshape(R // QB, QB, -1)
    h = 1
    while h < QB:
        idx = np.array([i for i in range(QB) if not i & h])
        a, b = blocks[:, idx].copy(), blocks[:, idx + h].copy()
        if integer:
            blocks[:, idx], blocks[:, idx + h] = a + b, a - b
        else:
            blocks[:, idx], blocks[:, idx + h] = add(a, b), sub(a, b)
        h <<= 1
    return blocks.reshape(f.shape)


def gemm_i8(a, b):
    """C = a b^T exactly (int32)."""
    return (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T).astype(np.int64).astype(np.int32)


def _pad(n):
    return (n + QB - 1) // QB * QB


def qlinear_forward(x, w, qmax=QMAX):
    """§6.9 forward; qmax 7 is the simulated int4 path, 31 the simulated int6 path."""
    qx, sx = quant_tensor(x, qmax)
    qw, sw = quant_weight_rows(w, qmax=qmax)
    acc = gemm_i8(qx, qw)
    return store(mul(mul(i2f(acc), sx), sw[None, :]))


def qlinear_backward(dy, x, w, qmax=QMAX):
    N, M = dy.shape
    K = x.shape[1]
    qw, sw, clip = quant_weight_rows(w, with_clip=True, qmax=qmax)
    dyf = bf16_to_f32(dy)
    # dx: contraction over m
    Mp = _pad(M)
    g = np.zeros((Mp, N), F32)
    g[:M] = mul(dyf, sw[None, :]).T
    qa, sg = quant_tensor_f32(hadamard_rows(g), qmax)
    r = np.zeros((Mp, K), np.int64)
    r[:M] = qw
    qb, sr = quant_tensor_f32(hadamard_rows(r, integer=True).astype(F32), qmax)
    acc = gemm_i8(qa.T, qb.T)
    dx = store(mul(mul(mul(i2f(acc), sg), sr), INV_QB))
    # dW: contraction over n
    Np = _pad(N)
    qx, sx = quant_tensor(x, qmax)
    d = np.zeros((Np, M), F32)
    d[:N] = dyf
    qa, sd = quant_tensor_f32(hadamard_rows(d), qmax)
    r = np.zeros((Np, K), np.int64)
    r[:N] = qx
    qb, sr = quant_tensor_f32(hadamard_rows(r, integer=True).astype(F32), qmax)
    acc = gemm_i8(qa.T, qb.T)
    v = store(mul(mul(mul(mul(i2f(acc), sd), sr), sx), INV_QB))
    dw = np.where(clip == 2, NAN, np.where(clip == 1, F32(0), v)).astype(F32)
    return dx, dw
