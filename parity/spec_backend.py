"""The `spec` pseudo-backend: mlx_open1b/spec (the independent numpy implementation of the
contract) behind the backend interface (mlx_open1b/backend.py), on numpy arrays.

Only adapters live here, no arithmetic of its own: argument order, in-place updates, the load
rule on scalars and arrays where the spec leaves it to the caller, and the store rule on the one
spec function (sqrt) that does not apply it. It is slow (numpy loops over the summed dimension)
and meant for self-tests of the harness and of the C reference, not for training.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from mlx_open1b.contract import CLIP_EPS, CONTRACT_VERSION, INIT_SIGMA, NORM_BLOCK, QMAX, XENT_CHUNK
from mlx_open1b import derived_ops, opargs
from mlx_open1b.hostmath import adamw_scalars
from mlx_open1b.spec import arith as A
from mlx_open1b.spec import attention as _att
from mlx_open1b.spec import layers as _lay
from mlx_open1b.spec import mathfn as _mf
from mlx_open1b.spec import optim as _opt
from mlx_open1b.spec import quant as _q
from mlx_open1b.spec import xent as _xent

NAME = "spec"
F32 = np.float32


def available():
    return True, "numpy implementation of the contract (mlx_open1b/spec), slow"


def contract_version() -> int:
    return CONTRACT_VERSION


def to_device(a):
    return a


def to_host(a):
    return a


def _f32s(x) -> np.float32:
    """A host scalar as the kernels see it: rounded to fp32 once, then the load rule."""
    return A.flush(F32(x))[()]


# ---------------------------------------------------------------- §4 functions, §2 conversions
def exp(x): return _mf.exp(x)
def log(x): return _mf.log(x)
def sin(x): return _mf.sin(x)
def cos(x): return _mf.cos(x)
def rsqrt(x): return _mf.rsqrt(x)
def sigmoid(x): return _mf.sigmoid(x)
def silu(x): return _mf.silu(x)
def sqrt(x): return A.store(A.sqrt(A.flush(x)))
def sqrt_int(x): return A.store(A.sqrt(A.flush(x)))   # the integer definition equals IEEE sqrt (§3)
def div_int(a, b): return A.store(A.div_int(a, b))
def f32_to_bf16(x): return A.f32_to_bf16(x)
def bf16_to_f32(x): return A.store(A.bf16_to_f32(x))


def add_inplace(a, b) -> None:
    a[...] = A.store(A.add(A.flush(a), A.flush(b)))


def scale_inplace(a, s) -> None:
    a[...] = A.store(A.mul(A.flush(a), _f32s(s)))


def _scalar(fn):
    def f(a, b) -> float:
        return float(fn(_f32s(a), _f32s(b)))
    return f


scalar_add, scalar_sub, scalar_mul, scalar_div = (_scalar(f) for f in (A.add, A.sub, A.mul, A.div))


def scalar_sqrt(x) -> float:
    return float(A.sqrt(_f32s(x)))


# ---------------------------------------------------------------- §6.1 linear layer
def linear_forward(x, w):
    return _xent.gemm_nt(x, w)


def linear_backward(dy, x, w, need_dx: bool = True, need_dw: bool = True, *, dw_out=None):
    N, K, M = opargs.linear_backward(dy, x, w)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    dx = _xent.gemm_nt(dy, np.ascontiguousarray(w.T)) if need_dx else None          # sum over m
    dw = _xent.gemm_nt(np.ascontiguousarray(dy.T), np.ascontiguousarray(x.T)) if need_dw else None  # sum over n
    return dx, derived_ops.into(dw_out, dw)


# ---------------------------------------------------------------- §6.2-6.5 layers
def embedding_forward(tokens, wte): return _lay.embedding_forward(tokens, wte)
def embedding_backward(tokens, dout, V, *, dw_out=None):
    N, V, C = opargs.embedding_backward(tokens, dout, V)
    dw_out = opargs.dw_out(dw_out, V, C, True)
    return derived_ops.into(dw_out, _lay.embedding_backward(tokens, dout, int(V)))


def rmsnorm_forward(x, g, eps, bf16_out: bool = False):
    y, rstd = _lay.rmsnorm_forward(x, g, _f32s(eps))
    return (f32_to_bf16(y) if bf16_out else y), rstd


def rmsnorm_backward(dy, x, g, rstd): return _lay.rmsnorm_backward(dy, x, g, rstd)
def rope_tables(T, D, theta): return _lay.rope_tables(int(T), int(D), _f32s(theta))
def rope_forward(x, cos, sin): return _lay.rope(x, cos, sin, backward=False)
def rope_backward(dy, cos, sin): return _lay.rope(dy, cos, sin, backward=True)
def swiglu_forward(h, bf16_out: bool = False):
    out = _lay.swiglu_forward(h)
    return f32_to_bf16(out) if bf16_out else out


def swiglu_backward(dout, h, bf16_out: bool = False):
    dh = _lay.swiglu_backward(dout, h)
    return f32_to_bf16(dh) if bf16_out else dh


# ---------------------------------------------------------------- §6.6 attention, §6.8 xent
def attention_forward(q, k, v, window, scale):
    return _att.attention_forward(q, k, v, int(window), F32(scale))


def attention_forward_i8(q, k, v, window, scale):
    return _att.attention_forward_i8(q, k, v, int(window), F32(scale))


def attention_backward(dout, q, k, v, o, lse, window, scale):
    return _att.attention_backward(dout, q, k, v, o, lse, int(window), F32(scale))


def xent_forward(h, w, targets, zcoef, keep=False):
    out = _xent.xent_forward(h, w, targets, F32(zcoef), XENT_CHUNK)
    return (*out, None) if keep else out


def xent_backward(h, w, targets, zcoef, lse, dloss, saved=None, *, dw_out=None):
    N, C, V, _ = opargs.xent_backward(h, w, targets, zcoef, lse, dloss)
    dw_out = opargs.dw_out(dw_out, V, C, True)
    dh, dw = _xent.xent_backward(h, w, targets, F32(zcoef), A.flush(lse), A.flush(dloss))
    return dh, derived_ops.into(dw_out, dw)


# ---------------------------------------------------------------- §6.7 AdamW, §7 reductions
def adamw_step(p_, g, m, v, *, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step) -> None:
    s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, int(step))
    p_[...], m[...], v[...] = _opt.adamw_step(p_, g, m, v, s)


def sumsq_blocks(x):
    return _opt.sumsq_blocks(x, NORM_BLOCK)


def treefold(values) -> float:
    return float(_opt.treefold(list(A.flush(values))))


def global_norm(tensors: Sequence[np.ndarray]) -> float:
    parts = np.concatenate([sumsq_blocks(t) for t in tensors])
    return float(A.sqrt(F32(treefold(parts))))


def clip_coef(norm, max_norm) -> float:
    return float(A.div(_f32s(max_norm), A.add(_f32s(norm), F32(CLIP_EPS))))


# ---------------------------------------------------------------- §5 random numbers
def philox_blocks(seed, stream, index0, n, sub=0):
    idx = np.arange(int(n), dtype=np.uint64) + np.uint64(index0)    # wraps mod 2^64 like the C counter
    if n == 0:
        return np.empty((0, 4), np.uint32)
    return _opt.philox_block(int(seed), int(stream), idx, int(sub))


def trunc_normal(seed, stream, index0, n, sigma=INIT_SIGMA):
    return _opt.trunc_normal(int(seed), int(stream), int(index0), int(n), F32(sigma))


# ---------------------------------------------------------------- §6.9 int8 quantized linear
# Arguments are checked by opargs as cpu_ref checks them (contraction lengths <= 2^17, int8 in
# [-127, 127], Hadamard rows a multiple of 128, qmax 127, 31 or 7), so that an invalid case fails
# on both sides. qmax = 7 / 31 are the simulated int4 / int6 paths (the parity ops
# qlinear4_forward / _backward, qlinear6_forward / _backward).
def gemm_i8(a, b):
    opargs.gemm_i8(a, b)
    return _q.gemm_i8(a, b)


def hadamard_rows(f):
    f = np.array(f, F32, copy=True, order="C")
    opargs.hadamard_rows(f)
    return A.store(_q.hadamard_rows(f))


def quant_weight_rows(w):
    opargs.quant_weight_rows(w)
    return _q.quant_weight_rows(w)


def quant_tensor(x):
    f32 = x.dtype == np.float32
    opargs.quant_tensor(x, opargs.F32 if f32 else opargs.BF16)
    q, s = (_q.quant_tensor_f32 if f32 else _q.quant_tensor)(x)
    return q.reshape(x.shape), F32(s)


def qlinear_forward(x, w, qmax: int = QMAX):
    opargs.qlinear_forward(x, w)
    return _q.qlinear_forward(x, w, opargs.qmax(qmax))


def qlinear_backward(dy, x, w, need_dx: bool = True, need_dw: bool = True, qmax: int = QMAX, *, dw_out=None):
    N, K, M = opargs.qlinear_backward(dy, x, w)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    dx, dw = _q.qlinear_backward(dy, x, w, opargs.qmax(qmax))
    return (dx if need_dx else None), (derived_ops.into(dw_out, dw) if need_dw else None)


# the functional forms the model program and trainer use on device arrays (same arithmetic)
add, scale, adamw = derived_ops.functional_ops(add_inplace, scale_inplace, adamw_step)
