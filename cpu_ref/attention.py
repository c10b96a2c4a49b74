"""Causal (optionally sliding-window) grouped-query attention, forward and backward.

B = batch, T = sequence length, H = query heads, G = kv heads (H % G == 0), D = head dim.
Key j is visible to query i iff j <= i and (window == 0 or i - j < window). The forward is an
online softmax over aligned 64-key blocks; the backward recomputes p from the saved lse
(CONTRACT.md, section "Attention").
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ._lib import BF16, F32, c_f32, c_i64, c_int, check, declare, p, ptr

_forward = declare("o1b_attention_forward", c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_f32,
                   ptr, ptr, ptr, ptr, ptr, restype=c_int)
_backward = declare("o1b_attention_backward", c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_f32,
                    ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, restype=c_int)


def _window(window) -> int:
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise ValueError(f"window: expected an integer >= 0 (0: causal only), got {window!r}")
    return int(window)


def _scale(scale) -> np.float32:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number, got {scale!r}")
    s = np.float32(scale)
    if not np.isfinite(s):
        raise ValueError(f"scale: {scale!r} overflows float32")
    return s


def _shapes(q, k, v):
    """Check q, k, v; return (B, T, H, G, D)."""
    check("q", q, BF16, ndim=4)
    B, T, H, D = q.shape
    if H == 0 or D == 0:
        raise ValueError(f"q: needs at least one head and a head dim > 0, got shape {q.shape}")
    check("k", k, BF16, shape=(B, T, None, D))
    G = k.shape[2]
    if G == 0 or H % G != 0:
        raise ValueError(f"k: the number of kv heads ({G}) must divide the query heads ({H})")
    check("v", v, BF16, shape=(B, T, G, D))
    return B, T, H, G, D


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, scale: float):
    """q (B,T,H,D) bf16, k and v (B,T,G,D) bf16 -> o (B,T,H,D) fp32, lse (B,H,T) fp32.

    scale is rounded to float32 (pass e.g. 1/sqrt(D) computed by the caller)."""
    B, T, H, G, D = _shapes(q, k, v)
    W, s = _window(window), _scale(scale)
    o = np.empty((B, T, H, D), np.float32)
    lse = np.empty((B, H, T), np.float32)
    if _forward(B, T, H, G, D, W, s, p(q), p(k), p(v), p(o), p(lse)) != 0:
        raise MemoryError("attention_forward: out of memory")
    return o, lse


def attention_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       o: np.ndarray, lse: np.ndarray, window: int, scale: float):
    """dout (B,T,H,D) fp32, q, k, v as in the forward, o and lse from the forward
    -> dq (B,T,H,D), dk (B,T,G,D), dv (B,T,G,D), all fp32."""
    B, T, H, G, D = _shapes(q, k, v)
    check("dout", dout, F32, shape=(B, T, H, D))
    check("o", o, F32, shape=(B, T, H, D))
    check("lse", lse, F32, shape=(B, H, T))
    W, s = _window(window), _scale(scale)
    dq = np.empty((B, T, H, D), np.float32)
    dk = np.empty((B, T, G, D), np.float32)
    dv = np.empty((B, T, G, D), np.float32)
    if _backward(B, T, H, G, D, W, s, p(dout), p(q), p(k), p(v), p(o), p(lse),
                 p(dq), p(dk), p(dv)) != 0:
        raise MemoryError("attention_backward: out of memory")
    return dq, dk, dv
