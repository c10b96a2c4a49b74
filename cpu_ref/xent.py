"""Fused, vocabulary-chunked cross-entropy + z-loss of the LM head (CONTRACT.md, cross-entropy).

N = rows (tokens), C = channels, V = vocabulary. The logits z = h W^T (linear_forward's bits)
are computed XENT_CHUNK vocabulary entries at a time (held whole only when kept, below). Per row:
    lse = logsumexp(z)  (online over chunks),  ce = lse - z[target],  loss = ce + zcoef lse^2.
The mean over rows is the caller's: the backward takes dloss (N,), usually 1/N in every entry.

In training, xent_forward(..., keep=True) also returns a handle (XentSaved) holding every chunk's
logits, when they fit XENT_KEEP_BYTES, and xent_backward(..., saved=handle) reads them instead of
running the logits GEMM again (one GEMM of the backward's three). The logits kept are the stored
bits of the same GEMM, so the results are the same bits either way.
"""
from __future__ import annotations

import threading

import numpy as np

from mlx_open1b import opargs
from ._lib import c_f32, c_i64, c_int, declare, p, ptr

_forward = declare("o1b_xent_forward_kept", c_i64, c_i64, c_i64, c_i64, ptr, ptr, ptr, c_f32,
                   ptr, ptr, ptr, ptr, restype=c_int)
_backward = declare("o1b_xent_backward_kept", c_i64, c_i64, c_i64, c_i64, ptr, ptr, ptr, c_f32,
                    ptr, ptr, ptr, ptr, ptr, restype=c_int)
_chunk = declare("o1b_xent_chunk", restype=c_int)
_ldz = declare("o1b_xent_ldz", c_i64, restype=c_i64)

#: Vocabulary entries per chunk: a contract constant (it decides where the online logsumexp
#: rescales, hence the bits of lse), never a tuning parameter.
XENT_CHUNK = int(_chunk())

#: The most bytes of logits the forward keeps for the backward (one microbatch's, held from its
#: forward to its backward); larger ones are computed again there. 17 MB at tiny, 34 at small;
#: open1b's (16384 x 128256) are not kept.
XENT_KEEP_BYTES = 256 << 20

# The buffer of the last logits a backward consumed, for the next forward of the same shape: new
# memory of this size is a fresh mapping each time (above glibc's largest mmap threshold, 32 MiB),
# whose page faults and zeroing cost about a third of the GEMM it spares (small, one thread). One
# buffer at most; no value is read from it before the forward writes it, so no bit depends on it.
_spare: list = [None]
_spare_lock = threading.Lock()


def _take_buffer(shape: tuple) -> np.ndarray:
    with _spare_lock:
        buf, _spare[0] = _spare[0], None
    return buf if buf is not None and buf.shape == shape else np.empty(shape, np.float32)


def _give_buffer(buf: np.ndarray) -> None:
    with _spare_lock:
        _spare[0] = buf

_ERRORS = {1: MemoryError, 2: ValueError, 3: ValueError}


def _call(fn, *args):
    rc = fn(*args)
    if rc:
        raise _ERRORS.get(rc, RuntimeError)(f"xent kernel failed (code {rc})")


def _key(a: np.ndarray) -> tuple:
    return a.__array_interface__["data"][0], a.shape, a.strides


class XentSaved:
    """What xent_forward(keep=True) keeps for the backward of the same h and w: the logits,
    z[n, v] at zk[v, n] (rows of o1b_xent_ldz(N) floats, as the forward computes them). One
    backward consumes it. It holds the forward's h and w until then, so that no other array can
    take their memory meanwhile and pass as them; values written into h or w in between are the
    caller's to avoid (the logits would be those of the old values)."""
    __slots__ = ("zk", "chunk", "_h", "_w", "_held")

    def __init__(self, zk: np.ndarray, chunk: int, h: np.ndarray, w: np.ndarray):
        self.zk, self.chunk, self._h, self._w, self._held = zk, chunk, _key(h), _key(w), (h, w)

    def check(self, h: np.ndarray, w: np.ndarray, chunk: int) -> None:
        """The backward's h and w are the buffers the forward read (the logits are theirs)."""
        if self.zk is None:
            raise ValueError("saved: already consumed by a backward (one handle serves one backward)")
        if (_key(h), _key(w), chunk) != (self._h, self._w, self.chunk):
            raise ValueError("saved: the logits kept by xent_forward are of another h, w or chunk "
                             "(pass the h and w arrays the forward was given)")


def kept_bytes(N: int, V: int) -> int:
    """The size of the kept logits of N rows and V vocabulary entries (rows padded as the forward's)."""
    return V * int(_ldz(N)) * 4


def keeps(N: int, V: int) -> bool:
    """Whether the forward keeps the logits of N rows and V vocabulary entries."""
    return kept_bytes(N, V) <= XENT_KEEP_BYTES


def _forward_chunked(h, w, targets, zcoef, chunk, keep=False):
    N, C, V, zc = opargs.xent_forward(h, w, targets, zcoef)
    loss, lse, ce = (np.empty(N, np.float32) for _ in range(3))
    saved = None
    if keep and keeps(N, V):
        saved = XentSaved(_take_buffer((V, int(_ldz(N)))), int(chunk), h, w)
    _call(_forward, N, C, V, int(chunk), p(h), p(w), p(targets), zc, p(loss), p(lse), p(ce),
          p(saved.zk) if saved else None)
    return (loss, lse, ce, saved) if keep else (loss, lse, ce)


def _backward_chunked(h, w, targets, zcoef, lse, dloss, chunk, saved=None, dw_out=None):
    N, C, V, zc = opargs.xent_backward(h, w, targets, zcoef, lse, dloss)
    dw_out = opargs.dw_out(dw_out, V, C, True)
    if saved is not None:
        if not isinstance(saved, XentSaved):
            raise ValueError("saved: expected what xent_forward(keep=True) returned, got "
                             f"{type(saved).__name__}")
        saved.check(h, w, int(chunk))
    dh = np.empty((N, C), np.float32)
    dw = np.empty((V, C), np.float32) if dw_out is None else dw_out
    _call(_backward, N, C, V, int(chunk), p(h), p(w), p(targets), zc, p(lse), p(dloss),
          p(saved.zk) if saved else None, p(dh), p(dw))
    if saved is not None:
        zk, saved.zk, saved._held = saved.zk, None, None
        _give_buffer(zk)
    return dh, dw


def xent_forward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float, keep: bool = False):
    return _forward_chunked(h, w, targets, zcoef, XENT_CHUNK, keep)


def xent_backward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float,
                  lse: np.ndarray, dloss: np.ndarray, saved=None, *, dw_out: np.ndarray | None = None):
    return _backward_chunked(h, w, targets, zcoef, lse, dloss, XENT_CHUNK, saved, dw_out)
