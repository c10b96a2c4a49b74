"""Embedding, RMSNorm (with and without gain; QK-norm), RoPE and SwiGLU on the C reference."""
from __future__ import annotations

import numpy as np

from mlx_open1b import opargs
from ._lib import c_f32, c_i64, c_int, declare, p, ptr

_emb_fwd = declare("o1b_embedding_forward", c_i64, c_i64, ptr, ptr, ptr)
_emb_bwd = declare("o1b_embedding_backward", c_i64, c_i64, c_i64, ptr, ptr, ptr, restype=c_int)
_rms_fwd = declare("o1b_rmsnorm_forward", c_i64, c_i64, ptr, ptr, c_f32, ptr, ptr)
_rms_bwd = declare("o1b_rmsnorm_backward", c_i64, c_i64, ptr, ptr, ptr, ptr, ptr, ptr)
_rms_fwd16 = declare("o1b_rmsnorm_forward_bf16", c_i64, c_i64, ptr, ptr, c_f32, ptr, ptr, restype=c_int)
_rope_tables = declare("o1b_rope_tables", c_i64, c_i64, c_f32, ptr, ptr)
_rope_c = declare("o1b_rope", c_i64, c_i64, c_i64, c_i64, ptr, ptr, ptr, ptr, c_int)
_swiglu_fwd = declare("o1b_swiglu_forward", c_i64, c_i64, ptr, ptr)
_swiglu_bwd = declare("o1b_swiglu_backward", c_i64, c_i64, ptr, ptr, ptr)
_swiglu_fwd16 = declare("o1b_swiglu_forward_bf16", c_i64, c_i64, ptr, ptr, restype=c_int)
_swiglu_bwd16 = declare("o1b_swiglu_backward_bf16", c_i64, c_i64, ptr, ptr, ptr, restype=c_int)


def _scratch(rc: int, name: str) -> None:
    if rc != 0:
        raise MemoryError(f"{name}: out of memory for the rows' scratch")


def embedding_forward(tokens: np.ndarray, wte: np.ndarray) -> np.ndarray:
    N, V, C = opargs.embedding_forward(tokens, wte)
    out = np.empty((N, C), np.float32)
    _emb_fwd(N, C, p(tokens), p(wte), p(out))
    return out


def embedding_backward(tokens: np.ndarray, dout: np.ndarray, V: int, *,
                       dw_out: np.ndarray | None = None) -> np.ndarray:
    N, V, C = opargs.embedding_backward(tokens, dout, V)
    dw_out = opargs.dw_out(dw_out, V, C, True)
    dwte = np.empty((V, C), np.float32) if dw_out is None else dw_out
    if _emb_bwd(N, V, C, p(tokens), p(dout), p(dwte)) != 0:
        raise MemoryError("embedding_backward: out of memory for the position buckets")
    return dwte


def rmsnorm_forward(x: np.ndarray, g: np.ndarray | None, eps: float, bf16_out: bool = False):
    N, C = opargs.rmsnorm_forward(x, g, eps)
    rstd = np.empty(N, np.float32)
    if bf16_out:
        y = np.empty(x.shape, np.uint16)
        _scratch(_rms_fwd16(N, C, p(x), p(g), float(np.float32(eps)), p(y), p(rstd)), "rmsnorm_forward")
        return y, rstd
    y = np.empty_like(x)
    _rms_fwd(N, C, p(x), p(g), float(np.float32(eps)), p(y), p(rstd))
    return y, rstd


def rmsnorm_backward(dy: np.ndarray, x: np.ndarray, g: np.ndarray | None, rstd: np.ndarray):
    N, C = opargs.rmsnorm_backward(dy, x, g, rstd)
    dx = np.empty_like(x)
    dg = np.empty(C, np.float32) if g is not None else None
    _rms_bwd(N, C, p(dy), p(x), p(g), p(rstd), p(dx), p(dg))
    return dx, dg


def rope_tables(T: int, D: int, theta: float):
    T, D = opargs.rope_tables(T, D, theta)
    cos = np.empty((T, D // 2), np.float32)
    sin = np.empty((T, D // 2), np.float32)
    _rope_tables(T, D, float(np.float32(theta)), p(cos), p(sin))
    return cos, sin


def _rope(x, cos, sin, backward, name):
    B, T, R, D = opargs.rope(x, cos, sin, name)
    y = np.empty_like(x)
    _rope_c(B, T, R, D, p(x), p(cos), p(sin), p(y), int(backward))
    return y


def rope_forward(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return _rope(x, cos, sin, False, "x")


def rope_backward(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return _rope(dy, cos, sin, True, "dy")


def swiglu_forward(h: np.ndarray, bf16_out: bool = False) -> np.ndarray:
    N, F = opargs.swiglu_forward(h)
    if bf16_out:
        out = np.empty((N, F), np.uint16)
        _scratch(_swiglu_fwd16(N, F, p(h), p(out)), "swiglu_forward")
        return out
    out = np.empty((N, F), np.float32)
    _swiglu_fwd(N, F, p(h), p(out))
    return out


def swiglu_backward(dout: np.ndarray, h: np.ndarray, bf16_out: bool = False) -> np.ndarray:
    N, F = opargs.swiglu_backward(dout, h)
    if bf16_out:
        dh = np.empty(h.shape, np.uint16)
        _scratch(_swiglu_bwd16(N, F, p(dout), p(h), p(dh)), "swiglu_backward")
        return dh
    dh = np.empty_like(h)
    _swiglu_bwd(N, F, p(dout), p(h), p(dh))
    return dh
