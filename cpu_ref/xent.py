"""Fused, vocabulary-chunked cross-entropy + z-loss of the LM head (CONTRACT.md, cross-entropy).

N = rows (tokens), C = channels, V = vocabulary. The logits z = h W^T (linear_forward's bits)
are computed XENT_CHUNK vocabulary entries at a time and never held whole. Per row:
    lse = logsumexp(z)  (online over chunks),  ce = lse - z[target],  loss = ce + zcoef lse^2.
The mean over rows is the caller's: the backward takes dloss (N,), usually 1/N in every entry.
"""
from __future__ import annotations

import numpy as np

from mlx_open1b import opargs
from ._lib import c_f32, c_i64, c_int, declare, p, ptr

_forward = declare("o1b_xent_forward_chunked", c_i64, c_i64, c_i64, c_i64, ptr, ptr, ptr, c_f32,
                   ptr, ptr, ptr, restype=c_int)
_backward = declare("o1b_xent_backward_chunked", c_i64, c_i64, c_i64, c_i64, ptr, ptr, ptr, c_f32,
                    ptr, ptr, ptr, ptr, restype=c_int)
_chunk = declare("o1b_xent_chunk", restype=c_int)

#: Vocabulary entries per chunk: a contract constant (it decides where the online logsumexp
#: rescales, hence the bits of lse), never a tuning parameter.
XENT_CHUNK = int(_chunk())

_ERRORS = {1: MemoryError, 2: ValueError, 3: ValueError}


def _call(fn, *args):
    rc = fn(*args)
    if rc:
        raise _ERRORS.get(rc, RuntimeError)(f"xent kernel failed (code {rc})")


def _forward_chunked(h, w, targets, zcoef, chunk):
    N, C, V, zc = opargs.xent_forward(h, w, targets, zcoef)
    loss, lse, ce = (np.empty(N, np.float32) for _ in range(3))
    _call(_forward, N, C, V, int(chunk), p(h), p(w), p(targets), zc, p(loss), p(lse), p(ce))
    return loss, lse, ce


def _backward_chunked(h, w, targets, zcoef, lse, dloss, chunk):
    N, C, V, zc = opargs.xent_backward(h, w, targets, zcoef, lse, dloss)
    dh = np.empty((N, C), np.float32)
    dw = np.empty((V, C), np.float32)
    _call(_backward, N, C, V, int(chunk), p(h), p(w), p(targets), zc, p(lse), p(dloss), p(dh), p(dw))
    return dh, dw


def xent_forward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float):
    return _forward_chunked(h, w, targets, zcoef, XENT_CHUNK)


def xent_backward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float,
                  lse: np.ndarray, dloss: np.ndarray):
    return _backward_chunked(h, w, targets, zcoef, lse, dloss, XENT_CHUNK)
