"""Fused, vocabulary-chunked cross-entropy + z-loss of the LM head (CONTRACT.md, cross-entropy).

N = rows (tokens), C = channels, V = vocabulary. The logits z = h W^T (linear_forward's bits)
are computed XENT_CHUNK vocabulary entries at a time and never held whole. Per row:
    lse = logsumexp(z)  (online over chunks),  ce = lse - z[target],  loss = ce + zcoef lse^2.
The mean over rows is the caller's: the backward takes dloss (N,), usually 1/N in every entry.
"""
from __future__ import annotations

import math

import numpy as np

from ._lib import BF16, F32, I32, c_f32, c_i64, c_int, check, declare, p, ptr

_forward = declare("o1b_xent_forward_chunked", c_i64, c_i64, c_i64, c_i64, ptr, ptr, ptr, c_f32,
                   ptr, ptr, ptr, restype=c_int)
_backward = declare("o1b_xent_backward_chunked", c_i64, c_i64, c_i64, c_i64, ptr, ptr, ptr, c_f32,
                    ptr, ptr, ptr, ptr, restype=c_int)
_chunk = declare("o1b_xent_chunk", restype=c_int)

#: Vocabulary entries per chunk: a contract constant (it decides where the online logsumexp
#: rescales, hence the bits of lse), never a tuning parameter.
XENT_CHUNK = int(_chunk())

_ERRORS = {1: MemoryError, 2: ValueError, 3: ValueError}


def _check_common(h, w, targets, zcoef):
    check("h", h, BF16, ndim=2)
    N, C = h.shape
    check("w", w, BF16, shape=(None, C))
    V = w.shape[0]
    for name, size in (("h rows (N)", N), ("h columns (C)", C), ("w rows (V)", V)):
        if size == 0:
            raise ValueError(f"{name}: must be at least 1, got shape h {h.shape}, w {w.shape}")
    check("targets", targets, I32, shape=(N,))
    bad = np.flatnonzero((targets < 0) | (targets >= V))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"targets: entry {i} is {int(targets[i])}, outside [0, {V}) "
                         f"({bad.size} out of range)")
    try:
        with np.errstate(over="ignore"):          # 1e39 -> inf, rejected below
            zc = np.float32(zcoef)
    except (TypeError, ValueError):
        raise ValueError(f"zcoef: expected a real number, got {zcoef!r}") from None
    if np.ndim(zc) != 0 or not math.isfinite(float(zc)) or zc < 0:
        raise ValueError(f"zcoef: expected a finite number >= 0 (as float32), got {zcoef!r}")
    return N, C, V, float(zc)


def _call(fn, *args):
    rc = fn(*args)
    if rc:
        raise _ERRORS.get(rc, RuntimeError)(f"xent kernel failed (code {rc})")


def _forward_chunked(h, w, targets, zcoef, chunk):
    N, C, V, zc = _check_common(h, w, targets, zcoef)
    loss, lse, ce = (np.empty(N, np.float32) for _ in range(3))
    _call(_forward, N, C, V, int(chunk), p(h), p(w), p(targets), zc, p(loss), p(lse), p(ce))
    return loss, lse, ce


def _backward_chunked(h, w, targets, zcoef, lse, dloss, chunk):
    N, C, V, zc = _check_common(h, w, targets, zcoef)
    check("lse", lse, F32, shape=(N,))
    check("dloss", dloss, F32, shape=(N,))
    dh = np.empty((N, C), np.float32)
    dw = np.empty((V, C), np.float32)
    _call(_backward, N, C, V, int(chunk), p(h), p(w), p(targets), zc, p(lse), p(dloss), p(dh), p(dw))
    return dh, dw


def xent_forward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float):
    """h (N, C) bf16, w (V, C) bf16, targets (N,) int32 in [0, V), zcoef >= 0 (rounded to float32)
    -> loss (N,), lse (N,), ce (N,) float32, loss = ce + zcoef lse^2 per row."""
    return _forward_chunked(h, w, targets, zcoef, XENT_CHUNK)


def xent_backward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float,
                  lse: np.ndarray, dloss: np.ndarray):
    """lse (N,) float32 from xent_forward, dloss (N,) float32 -> dh (N, C), dw (V, C) float32.
    dz[n,v] = (softmax_v (1 + 2 zcoef lse) - [v == target]) dloss[n], rounded to bf16 for the GEMMs."""
    return _backward_chunked(h, w, targets, zcoef, lse, dloss, XENT_CHUNK)
