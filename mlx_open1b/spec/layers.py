"""CONTRACT.md §6.2–§6.5 in numpy: embedding, RMSNorm, RoPE, SwiGLU."""
from __future__ import annotations

import numpy as np

from .arith import F32, add, bf16_to_f32, div, flush, i2f, mul, neg, store, sub
from .mathfn import cos, exp, log, rsqrt, sigmoid, sin


def embedding_forward(tokens, wte):
    return store(bf16_to_f32(wte)[tokens])


def embedding_backward(tokens, dout, V):
    dwte = np.zeros((V, dout.shape[1]), F32)
    for n, t in enumerate(tokens):        # ascending position order per row
        dwte[t] = add(dwte[t], flush(dout[n]))
    return store(dwte)


def rmsnorm_forward(x, g, eps):
    x = flush(x)
    N, C = x.shape
    ss = np.zeros(N, F32)
    for c in range(C):
        ss = add(ss, mul(x[:, c], x[:, c]))
    r = rsqrt(add(mul(ss, div(F32(1), i2f(C))), F32(eps)))
    y = mul(x, r[:, None])
    if g is not None:
        y = mul(y, bf16_to_f32(g)[None, :])
    return store(y), store(r)


def rmsnorm_backward(dy, x, g, rstd):
    x, dy, r = flush(x), flush(dy), flush(rstd)
    N, C = x.shape
    t = dy if g is None else mul(dy, bf16_to_f32(g)[None, :])
    dot = np.zeros(N, F32)
    for c in range(C):
        dot = add(dot, mul(t[:, c], x[:, c]))
    b = mul(mul(dot, mul(mul(r, r), r)), div(F32(1), i2f(C)))
    dx = sub(mul(t, r[:, None]), mul(x, b[:, None]))
    dg = None
    if g is not None:
        xr = mul(x, r[:, None])
        dg = np.zeros(C, F32)
        for n in range(N):
            dg = add(dg, mul(dy[n], xr[n]))
        dg = store(dg)
    return store(dx), dg


def rope_tables(T, D, theta):
    invD = div(F32(1), i2f(D))
    lt = log(F32(theta))
    i2 = i2f(2 * np.arange(D // 2))
    f = exp(neg(mul(mul(i2, invD), lt)))
    ang = mul(i2f(np.arange(T))[:, None], f[None, :])
    return store(cos(ang)), store(sin(ang))


def rope(x, cos_t, sin_t, backward=False):
    x = flush(x)
    B, T, R, D = x.shape
    h = D // 2
    c, s = flush(cos_t[:T])[None, :, None, :], flush(sin_t[:T])[None, :, None, :]
    x1, x2 = x[..., :h], x[..., h:]
    if not backward:
        y1, y2 = sub(mul(x1, c), mul(x2, s)), add(mul(x2, c), mul(x1, s))
    else:
        y1, y2 = add(mul(x1, c), mul(x2, s)), sub(mul(x2, c), mul(x1, s))
    return store(np.concatenate([y1, y2], axis=-1))


def swiglu_forward(h):
    h = flush(h)
    F = h.shape[1] // 2
    g, u = h[:, :F], h[:, F:]
    return store(mul(mul(g, sigmoid(g)), u))


def swiglu_backward(dout, h):
    h, d = flush(h), flush(dout)
    F = h.shape[1] // 2
    g, u = h[:, :F], h[:, F:]
    s = sigmoid(g)
    dsilu = mul(s, add(F32(1), mul(g, sub(F32(1), s))))
    return store(np.concatenate([mul(mul(d, u), dsilu), mul(d, mul(g, s))], axis=1))
