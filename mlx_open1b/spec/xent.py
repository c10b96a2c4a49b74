"""CONTRACT.md cross-entropy + z-loss in numpy: the fused LM-head loss, forward and backward.

N = rows, C = channels, V = vocabulary; h (N, C) and w (V, C) bf16 (uint16), targets (N,) int.
Written from the contract text: the logits with the contract GEMM (sum over c ascending from +0),
the online logsumexp over chunks of XENT_CHUNK vocabulary entries, and the gradient rounded to
bf16 before the two GEMMs. Every sum is a Python loop in the contract's order, vectorized over
the indices it does not reduce.
"""
from __future__ import annotations

import numpy as np

from ..contract import XENT_CHUNK

from .arith import F32, add, bf16_to_f32, f32, f32_to_bf16, flush, maximum, mul, store, sub
from .mathfn import exp, log



def gemm_nt(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (I, P) bf16, b (J, P) bf16 -> (I, J) fp32, sum over p ascending from +0."""
    af, bf = bf16_to_f32(a), bf16_to_f32(b)
    acc = np.zeros((af.shape[0], bf.shape[0]), F32)
    for k in range(af.shape[1]):
        acc = add(acc, mul(af[:, k, None], bf[None, :, k]))
    return store(acc)


def logits(h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """z (N, V) = h w^T: the contract GEMM, the same bits as the linear layer's forward."""
    return gemm_nt(h, w)


def xent_forward_from_logits(z: np.ndarray, targets: np.ndarray, zcoef, chunk: int = XENT_CHUNK):
    """z (N, V) fp32 logits -> loss, lse, ce (N,) fp32."""
    z = flush(z)
    N, V = z.shape
    zc = flush(F32(zcoef))
    m = np.full(N, -np.inf, F32)
    s = np.zeros(N, F32)
    for v0 in range(0, V, chunk):
        zch = z[:, v0:v0 + chunk]
        cm = np.full(N, -np.inf, F32)
        for j in range(zch.shape[1]):
            cm = maximum(cm, zch[:, j])
        m_new = maximum(m, cm)
        corr = exp(sub(m, m_new))
        e = exp(sub(zch, m_new[:, None]))
        cs = np.zeros(N, F32)
        for j in range(zch.shape[1]):
            cs = add(cs, e[:, j])
        s = add(mul(s, corr), cs)
        m = m_new
    lse = add(m, log(s))
    zt = z[np.arange(N), np.asarray(targets, np.int64)]
    ce = sub(lse, zt)
    zl = mul(zc, mul(lse, lse))
    loss = add(ce, zl)
    return store(loss), store(lse), store(ce)


def xent_forward(h, w, targets, zcoef, chunk: int = XENT_CHUNK):
    """h (N, C) bf16, w (V, C) bf16, targets (N,), zcoef (float32) -> loss, lse, ce (N,) fp32."""
    return xent_forward_from_logits(logits(h, w), targets, zcoef, chunk)


def xent_dz(z, targets, zcoef, lse, dloss) -> np.ndarray:
    """The gradient of loss[n] dloss[n] with respect to z, as the bf16 GEMM operand (N, V)."""
    z, lse, dloss = flush(z), flush(f32(lse)), flush(f32(dloss))
    N, V = z.shape
    coef = add(F32(1.0), mul(mul(F32(2.0), flush(F32(zcoef))), lse))
    pv = exp(sub(z, lse[:, None]))
    g = mul(pv, coef[:, None])
    rows, t = np.arange(N), np.asarray(targets, np.int64)
    g[rows, t] = sub(g[rows, t], F32(1.0))
    return f32_to_bf16(mul(g, dloss[:, None]))


def xent_backward(h, w, targets, zcoef, lse, dloss):
    """-> dh (N, C), dw (V, C) fp32. No chunk argument: the chunks do not enter the backward's
    arithmetic (dh keeps one accumulator over all v; each dw row is one chunk's)."""
    dz = bf16_to_f32(xent_dz(logits(h, w), targets, zcoef, lse, dloss))
    hf, wf = bf16_to_f32(h), bf16_to_f32(w)
    N, V = dz.shape
    dh = np.zeros((N, hf.shape[1]), F32)
    for v in range(V):                                 # dh[n,c] = sum over v ascending
        dh = add(dh, mul(dz[:, v, None], wf[None, v, :]))
    dw = np.zeros((V, hf.shape[1]), F32)
    for n in range(N):                                 # dw[v,c] = sum over n ascending
        dw = add(dw, mul(dz[n, :, None], hf[None, n, :]))
    return store(dh), store(dw)
