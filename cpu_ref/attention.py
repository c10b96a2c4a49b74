"""Causal (optionally sliding-window) grouped-query attention, forward and backward.

B = batch, T = sequence length, H = query heads, G = kv heads (H % G == 0), D = head dim.
Key j is visible to query i iff j <= i and (window == 0 or i - j < window). The forward is an
online softmax over aligned 64-key blocks; the backward recomputes p from the saved lse
(CONTRACT.md, section "Attention").
"""
from __future__ import annotations

import numpy as np

from mlx_open1b import opargs
from ._lib import c_f32, c_i64, c_int, declare, p, ptr

_forward = declare("o1b_attention_forward", c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_f32,
                   ptr, ptr, ptr, ptr, ptr, restype=c_int)
_forward_i8 = declare("o1b_attention_forward_i8", c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_f32,
                      ptr, ptr, ptr, ptr, ptr, restype=c_int)
_backward = declare("o1b_attention_backward", c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_f32,
                    ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, restype=c_int)


def _run_forward(fn, name, q, k, v, window, scale):
    """Check the arguments, allocate o (B,T,H,D) and lse (B,H,T) fp32, run the C forward fn."""
    B, T, H, G, D, W, s = opargs.attention_forward(q, k, v, window, scale)
    o = np.empty((B, T, H, D), np.float32)
    lse = np.empty((B, H, T), np.float32)
    if fn(B, T, H, G, D, W, s, p(q), p(k), p(v), p(o), p(lse)) != 0:
        raise MemoryError(f"{name}: out of memory")
    return o, lse


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, scale: float):
    return _run_forward(_forward, "attention_forward", q, k, v, window, scale)


def attention_forward_i8(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, scale: float):
    return _run_forward(_forward_i8, "attention_forward_i8", q, k, v, window, scale)


def attention_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       o: np.ndarray, lse: np.ndarray, window: int, scale: float):
    B, T, H, G, D, W, s = opargs.attention_backward(dout, q, k, v, o, lse, window, scale)
    dq = np.empty((B, T, H, D), np.float32)
    dk = np.empty((B, T, G, D), np.float32)
    dv = np.empty((B, T, G, D), np.float32)
    if _backward(B, T, H, G, D, W, s, p(dout), p(q), p(k), p(v), p(o), p(lse),
                 p(dq), p(dk), p(dv)) != 0:
        raise MemoryError("attention_backward: out of memory")
    return dq, dk, dv
