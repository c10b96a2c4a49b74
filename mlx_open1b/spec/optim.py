"""CONTRACT.md §5, §6.7, §7 in numpy: Philox, truncated normal, AdamW, sums of squares, fold."""
from __future__ import annotations

import numpy as np

from .arith import F32, add, bf16_to_f32, div, f32_to_bf16, flush, i2f, mul, sqrt, store, sub
from .mathfn import cos, log, sin

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def philox(key, ctr):
    """Philox4x32-10 of counters ctr (..., 4) uint32 under key (k0, k1), vectorized."""
    c = [np.asarray(ctr[..., i], np.uint64) for i in range(4)]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0, p1 = np.uint64(M0) * c[0], np.uint64(M1) * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & mask, p1 & mask,
             ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & mask, p0 & mask]
        k0, k1 = (k0 + np.uint64(W0)) & mask, (k1 + np.uint64(W1)) & mask
    return np.stack(c, axis=-1).astype(np.uint32)


def philox_block(seed, stream, index, sub=0):
    index = np.asarray(index, np.uint64)
    ctr = np.stack([index & np.uint64(0xFFFFFFFF), index >> np.uint64(32),
                    np.full_like(index, stream), np.full_like(index, sub)], axis=-1)
    return philox((seed & 0xFFFFFFFF, seed >> 32), ctr)


def trunc_normal(seed, stream, index0, n, sigma):
    out = np.zeros(n, F32)
    todo = np.ones(n, bool)
    idx = np.arange(index0, index0 + n, dtype=np.uint64)
    for a in range(64):
        w = philox_block(seed, stream, idx, a)
        for pair in range(2):
            u1 = mul(i2f((w[:, 2 * pair] >> 8).astype(np.int64) + 1), F32(2.0 ** -24))
            u2 = mul(i2f((w[:, 2 * pair + 1] >> 8).astype(np.int64)), F32(2.0 ** -24))
            rad = sqrt(mul(F32(-2), log(u1)))
            th = mul(F32(float.fromhex("0x1.921fb6p2")), u2)
            for z in (mul(rad, cos(th)), mul(rad, sin(th))):
                take = todo & (np.abs(z) <= 2)
                out[take] = mul(z[take], F32(sigma))
                todo &= ~take
        if not todo.any():
            break
    return store(out)


def adamw_step(p, g, m, v, s):
    g = flush(g)
    m = add(mul(F32(s["b1"]), flush(m)), mul(F32(s["omb1"]), g))
    v = add(mul(F32(s["b2"]), flush(v)), mul(F32(s["omb2"]), mul(g, g)))
    u = div(mul(m, F32(s["bc1"])), add(sqrt(mul(v, F32(s["bc2"]))), F32(s["eps"])))
    p32 = sub(mul(bf16_to_f32(p), F32(s["decay"])), mul(F32(s["lr"]), u))
    return f32_to_bf16(p32), store(m), store(v)


def sumsq_blocks(x, block):
    x = flush(np.ravel(x))
    nb = -(-x.size // block)
    pad = np.zeros(nb * block, F32)
    pad[:x.size] = x
    blocks = pad.reshape(nb, block)
    acc = np.zeros(nb, F32)
    for i in range(block):       # padding adds +0 * +0 = +0 after the real elements: no change
        acc = add(acc, mul(blocks[:, i], blocks[:, i]))
    return store(acc)


def treefold(values, add_fn=add):
    """Algorithm 2 of the paper with the lower-index operand on the left; leftovers combined
    from the largest (lowest-index) block upwards."""
    stack = []
    for v in values:
        level = 0
        while stack and stack[-1][0] == level:
            v = add_fn(stack.pop()[1], v)
            level += 1
        stack.append((level, v))
    if not stack:
        return F32(0)
    acc = stack[0][1]
    for _, v in stack[1:]:
        acc = add_fn(acc, v)
    return acc
