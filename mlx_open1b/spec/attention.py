"""CONTRACT.md "Attention" in numpy: causal, sliding-window, grouped-query attention.

B = batch, T = sequence length, H = query heads, G = kv heads (head h reads kv head
h // (H // G)), D = head dim. Key j is visible to query i iff j <= i and (W == 0 or i - j < W).

Written from the contract text alone, as a second implementation beside the C reference: every
query row (b, h, i) is a lane of a numpy array, and the loops run over the key index, the head
dim, or the key block — the order in which the contract accumulates. Masked lanes keep their
state through np.where (never by adding a zero, which would let a NaN or inf of an invisible
key in).
"""
from __future__ import annotations

import numpy as np

from .arith import F32, add, bf16_to_f32, div, f32, flush, i2f, maximum, mul, store, sub
from .mathfn import exp, log
from .quant import rne_clamp

BK = 64   # contract constant: key block of the forward online softmax


def visible(T: int, window: int) -> np.ndarray:
    """(T, T) bool: [i, j] is True iff query i sees key j."""
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    vis = j <= i
    if window:
        vis &= (i - j) < window
    return vis


def _heads(x_bf16: np.ndarray, H: int) -> np.ndarray:
    """(B, T, N, D) bf16 -> (B, H, T, D) fp32: kv heads repeated so that lane h reads head h // (H // N)."""
    x = bf16_to_f32(x_bf16).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(x[:, np.arange(H) // (H // x.shape[1])])


def _dot_all_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (B,H,T,D), b (B,H,T,D) -> (B,H,T,T): [.., i, j] = sum_{d ascending} a_id * b_jd from +0."""
    B, H, T, D = a.shape
    acc = np.zeros((B, H, T, T), F32)
    for d in range(D):
        acc = add(acc, mul(a[:, :, :, None, d], b[:, :, None, :, d]))
    return acc


def _scores(qh: np.ndarray, kh: np.ndarray, scale) -> np.ndarray:
    return mul(_dot_all_pairs(qh, kh), scale)


def attention_forward(q, k, v, window: int, scale):
    """q (B,T,H,D) bf16, k and v (B,T,G,D) bf16 -> o (B,T,H,D) fp32, lse (B,H,T) fp32."""
    return _forward(q, k, v, window, scale, int8_pv=False)


def attention_forward_i8(q, k, v, window: int, scale):
    """§6.10: as attention_forward, with each block's P·V product in int8 (value rows quantized
    per key row, the block's weights per query row) and exact integer accumulation."""
    return _forward(q, k, v, window, scale, int8_pv=True)


def _quant_value_rows(vh):
    """(B,H,T,D) fp32 -> q_v (B,H,T,D) int64, s_v (B,H,T) fp32: §6.9's per-tensor rule per row."""
    finite = np.isfinite(vh).all(axis=-1)
    a = np.where(finite, np.abs(np.where(np.isfinite(vh), vh, 0)).max(axis=-1, initial=F32(0)), 0).astype(F32)
    sv = np.where(finite, div(a, F32(127)), np.float32(np.nan)).astype(F32)
    ok = finite & (sv != 0)
    inv = div(F32(1), np.where(ok, sv, F32(1)))
    qv = np.where(ok[..., None], rne_clamp(np.where(ok[..., None], mul(vh, inv[..., None]), 0)), 0)
    return qv.astype(np.int64), sv


def _block_pv_i8(p, part, sv, qv):
    """One block's int8 P·V (§6.10). p (B,H,T,n) fp32 weights, part (T,n) participating keys,
    sv (B,H,n) and qv (B,H,n,D) the block's quantized value rows -> pv (B,H,T,D) fp32."""
    t = mul(p, sv[:, :, None, :])
    nonfinite = (np.isnan(t) & part).any(axis=-1)
    a = np.where(part & ~np.isnan(t), t, F32(0)).max(axis=-1, initial=F32(0)).astype(F32)
    sp = div(a, F32(127))
    ok = (sp != 0) & ~nonfinite
    inv = div(F32(1), np.where(ok, sp, F32(1)))
    use = part & ok[..., None]
    qp = np.where(use, rne_clamp(np.where(use, mul(t, inv[..., None]), 0)), 0).astype(np.int64)
    acc = np.einsum("bhtn,bhnd->bhtd", qp, qv)                  # exact: |acc| < 2^20
    pv = np.where(ok[..., None], mul(i2f(acc), sp[..., None]), F32(0)).astype(F32)
    return np.where(nonfinite[..., None], np.float32(np.nan), pv).astype(F32)


def _forward(q, k, v, window: int, scale, int8_pv: bool):
    B, T, H, D = q.shape
    scale = flush(F32(scale))
    qh, kh, vh = bf16_to_f32(q).transpose(0, 2, 1, 3), _heads(k, H), _heads(v, H)
    s = _scores(qh, kh, scale)                          # (B, H, T, T)
    vis = visible(T, window)
    if int8_pv:
        qv, sv = _quant_value_rows(vh)
    m = np.full((B, H, T), -np.inf, F32)
    l = np.zeros((B, H, T), F32)
    acc = np.zeros((B, H, T, D), F32)
    with np.errstate(all="ignore"):
        for kb in range((T + BK - 1) // BK):
            keys = range(kb * BK, min(T, kb * BK + BK))
            active = vis[:, keys.start:keys.stop].any(axis=1)      # (T,) queries that see the block
            mb = np.full((B, H, T), -np.inf, F32)
            for j in keys:
                mb = np.where(vis[:, j], maximum(mb, s[..., j]), mb)
            m_new = maximum(m, mb)
            corr = exp(sub(m, m_new))
            ps = np.zeros((B, H, T), F32)
            pv = np.zeros((B, H, T, D), F32)
            pblock = []
            for j in keys:
                p = exp(sub(s[..., j], m_new))
                pblock.append(p)
                ps = np.where(vis[:, j], add(ps, p), ps)
                if not int8_pv:
                    pv = np.where(vis[:, j, None], add(pv, mul(p[..., None], vh[:, :, None, j, :])), pv)
            if int8_pv:
                pv = _block_pv_i8(np.stack(pblock, axis=-1), vis[:, keys.start:keys.stop],
                                  sv[:, :, keys.start:keys.stop], qv[:, :, keys.start:keys.stop])
            l = np.where(active, add(mul(l, corr), ps), l)
            acc = np.where(active[:, None], add(mul(acc, corr[..., None]), pv), acc)
            m = np.where(active, m_new, m)
        inv = div(F32(1.0), l)
        o = mul(acc, inv[..., None])
        lse = add(m, log(l))
    return store(o.transpose(0, 2, 1, 3)).copy(), store(lse)


def attention_backward(dout, q, k, v, o, lse, window: int, scale):
    """dout (B,T,H,D) fp32, q/k/v bf16 as in the forward, o (B,T,H,D), lse (B,H,T) from the
    forward -> dq (B,T,H,D), dk (B,T,G,D), dv (B,T,G,D), fp32."""
    B, T, H, D = q.shape
    G = k.shape[2]
    rep = H // G
    scale = flush(F32(scale))
    qh, kh, vh = bf16_to_f32(q).transpose(0, 2, 1, 3), _heads(k, H), _heads(v, H)
    gh = flush(f32(dout)).transpose(0, 2, 1, 3)         # (B, H, T, D)
    oh = flush(f32(o)).transpose(0, 2, 1, 3)
    lse = flush(f32(lse))
    vis = visible(T, window)
    with np.errstate(all="ignore"):
        Di = np.zeros((B, H, T), F32)
        for d in range(D):
            Di = add(Di, mul(gh[..., d], oh[..., d]))
        p = exp(sub(_scores(qh, kh, scale), lse[..., None]))   # (B, H, T_i, T_j)
        dp = _dot_all_pairs(gh, vh)
        ds = mul(p, sub(dp, Di[..., None]))

        # dq: per query lane, keys j ascending
        acc = np.zeros((B, H, T, D), F32)
        for j in range(T):
            acc = np.where(vis[:, j, None], add(acc, mul(ds[..., j, None], kh[:, :, None, j, :])), acc)
        dq = mul(acc, scale)

        # dk, dv: per key lane (b, g, j), heads of the group ascending, then queries i ascending
        dk = np.zeros((B, G, T, D), F32)
        dv = np.zeros((B, G, T, D), F32)
        for r in range(rep):
            hs = np.arange(G) * rep + r
            for i in range(T):
                keys = vis[i, :, None]                           # (T_j, 1)
                qi, gi = qh[:, hs, i, None, :], gh[:, hs, i, None, :]   # (B, G, 1, D)
                dk = np.where(keys, add(dk, mul(ds[:, hs, i, :, None], qi)), dk)
                dv = np.where(keys, add(dv, mul(p[:, hs, i, :, None], gi)), dv)
        dk = mul(dk, scale)
    tok = (0, 2, 1, 3)
    return (store(dq.transpose(tok)).copy(), store(dk.transpose(tok)).copy(),
            store(dv.transpose(tok)).copy())
