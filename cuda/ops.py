"""The CUDA backend: every op of the interface (mlx_open1b/backend.py) through the kernels of
cuda/*.cu.

On a machine with CuPy and a GPU the kernels run through cupy.RawModule; elsewhere the same kernel
sources and the same launch code run on the CPU emulator (cuda/emu), on numpy memory. `available()`
says which. Its device arrays are cupy arrays (`to_device`; numpy ones where emulated). Given any
cupy array an op works on the device and nothing goes through the host but token ids (range-checked
by opargs, bucketed for the embedding backward), the smallest level of gemm_i8's operands (opargs'
check) and the scalar results; given numpy only, the inputs are copied to the device and the
outputs back (cupy.asarray / .get()). The kernels update in place, so add, scale and adamw run
them on copies (mlx_open1b.derived_ops). The kernels never see the difference, so the bits are the
same either way.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from mlx_open1b.contract import (CONTRACT_VERSION, INIT_SIGMA, NORM_BLOCK, Q_MAX_P, QB, QMAX,  # noqa: F401
                                 QMAX4, XENT_CHUNK)                                             # (re-exported)
from mlx_open1b import arrays, derived_ops, opargs
from mlx_open1b.opargs import F32, FUNCTIONS  # noqa: F401  (FUNCTIONS re-exported)
from . import runtime

NAME = "cuda"
BLOCK = 128          # threads per block of the 1-D kernels (no result depends on it)
GEMM_TILE = 128      # linear.cu's block tile (BM = BN), computed by 16 x 16 threads
GEMM_SLICE = 16      # linear.cu's BK: values of p per shared slice, the unit of its FMA guard
GI_TILE = 128        # quant.cu's GI_BM = GI_BN: the int8 GEMM's output tile per block
GI_THREADS = 256     # quant.cu's GI_THREADS: 8 warps per block of the int8 GEMM
QT_TILE, QT_ROWS = 32, 8   # quant.cu's transposed-levels tile and its block (QT_TILE x QT_ROWS threads)

i64, i32, u32, u64, f32 = np.int64, np.int32, np.uint32, np.uint64, np.float32


def available() -> tuple[bool, str]:
    return runtime.describe()


def contract_version() -> int:
    return CONTRACT_VERSION


def to_device(a):
    return _dev(a)


def to_host(a):
    return arrays.to_host(a)


# ------------------------------------------------------------------ device arrays and launches
def _xp():
    """The array module of the memory the kernels run on: cupy on a GPU, numpy when emulated."""
    if runtime.real_cuda():
        import cupy
        return cupy
    return np


def _dev(a):
    """An input array in the kernels' memory: a itself when it already is there (a cupy array on a
    GPU, any numpy array when emulated), else a device copy."""
    return _xp().asarray(a)


def _empty(shape, dtype):
    return _xp().empty(shape, dtype)


_dummies: dict = {}     # (device id, dtype) -> a 1-element cupy array


def _dummy(a: np.ndarray):
    """The 1-element placeholder a (numpy) for a kernel argument the launch does not use, in the
    kernels' memory: on a GPU uploaded once per device and dtype, not on every call. (The
    shape-only kind, whose ledger counts what stays on the device, keeps the per-call copy.)"""
    xp = _xp()
    if xp is np or not hasattr(xp, "cuda"):
        return xp.asarray(a)
    key = (xp.cuda.Device().id, a.dtype.str)
    d = _dummies.get(key)
    if d is None:
        d = _dummies[key] = xp.asarray(a)
    return d


_mode = threading.local()      # .device: the running op was given a device (cupy) array


def _host(a):
    """An op's result as returned: as is in device mode, else a numpy array (a copy from the GPU;
    itself where emulated)."""
    if a is None or getattr(_mode, "device", False):
        return a
    return arrays.to_host(a)


@contextlib.contextmanager
def _op_mode(device: bool, values):
    """Around an op: device mode (its results stay on the device, _host) iff it was given a device
    array. An in-place op keeps its numpy arguments (written back by _inplace_back)."""
    old = getattr(_mode, "device", False)
    _mode.device = device
    try:
        yield
    finally:
        _mode.device = old


_given_kind = derived_ops.returns_given_kind(_dev, _op_mode)


def _in_place(op):
    """_given_kind for an op that writes its array arguments in place (numpy or cupy)."""
    return _given_kind(op, in_place=True)


def _launch1d(file: str, kernel: str, n: int, *args) -> None:
    """One thread per item: ceil(n / BLOCK) blocks of BLOCK threads (nothing when n == 0)."""
    if n <= 0:
        return
    fn = runtime.load(file).get_function(kernel)
    fn(((n + BLOCK - 1) // BLOCK,), (BLOCK,), args)


def _gemm(I, J, P, A, sa_i, sa_p, B, sb_p, sb_j, C, ldc, accumulate) -> None:
    """C[i,j] (+)= sum_p A(i,p) B(p,j) on device arrays (linear.cu)."""
    if I <= 0 or J <= 0:
        return
    tiles = -(-I // GEMM_TILE) * -(-J // GEMM_TILE)
    fn = runtime.load("linear.cu").get_function("o1b_gemm")
    fn((tiles,), (16, 16),
       (i64(I), i64(J), i64(P), A, i64(sa_i), i64(sa_p), B, i64(sb_p), i64(sb_j), C, i64(ldc),
        i32(1 if accumulate else 0)))


# ------------------------------------------------------------------ mathfn (§2–§4)
def _map(index: int, x: np.ndarray) -> np.ndarray:
    y = _empty(x.shape, np.float32)
    _launch1d("mathfn.cu", "o1b_map", x.size, i32(index), i64(x.size), _dev(x), y)
    return _host(y)


exp, log, sin, cos, sqrt, rsqrt, sigmoid, silu, sqrt_int = map(_given_kind, opargs.map_functions(_map))


@_given_kind
def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    opargs.f32_to_bf16(x)
    y = _empty(x.shape, np.uint16)
    _launch1d("mathfn.cu", "o1b_f32_to_bf16_array", x.size, i64(x.size), _dev(x), y)
    return _host(y)


@_given_kind
def bf16_to_f32(x: np.ndarray) -> np.ndarray:
    opargs.bf16_to_f32(x)
    y = _empty(x.shape, np.float32)
    _launch1d("mathfn.cu", "o1b_bf16_to_f32_array", x.size, i64(x.size), _dev(x), y)
    return _host(y)


def _inplace_back(a: np.ndarray, d) -> None:
    """Write the device copy d of an in-place argument back into a (nothing when d is a: a cupy
    array, or numpy where emulated)."""
    if d is not a:
        a[...] = arrays.to_host(d)


@_in_place
def add_inplace(a: np.ndarray, b: np.ndarray) -> None:
    n = opargs.add_inplace(a, b)
    da = _dev(a)
    _launch1d("mathfn.cu", "o1b_add_inplace", n, i64(n), da, _dev(b))
    _inplace_back(a, da)


@_in_place
def scale_inplace(a: np.ndarray, s: float) -> None:
    n = opargs.scale_inplace(a)
    da = _dev(a)
    _launch1d("mathfn.cu", "o1b_scale_inplace", n, i64(n), da, f32(s))
    _inplace_back(a, da)


def _scalar(op: int, a: float, b: float = 0.0) -> float:
    x, y = np.array([a], np.float32), np.array([b], np.float32)
    out = _empty((1,), np.float32)
    _launch1d("mathfn.cu", "o1b_binary", 1, i32(op), i64(1), _dev(x), _dev(y), out)
    return float(arrays.to_host(out)[0])


scalar_add, scalar_sub, scalar_mul, scalar_div, scalar_sqrt = map(_given_kind, opargs.scalar_functions(_scalar))


@_given_kind
def div_int(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = opargs.div_int(a, b)
    y = _empty(a.shape, np.float32)
    _launch1d("mathfn.cu", "o1b_binary", n, i32(5), i64(n), _dev(a), _dev(b), y)
    return _host(y)


# ------------------------------------------------------------------ linear (§6.1)
@_given_kind
def linear_forward(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    N, K, M = opargs.linear_forward(x, w)
    y = _empty((N, M), np.float32)
    _gemm(N, M, K, _dev(x), K, 1, _dev(w), 1, K, y, M, False)
    return _host(y)


@_given_kind
def linear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, need_dx: bool = True,
                    need_dw: bool = True, *, dw_out: np.ndarray | None = None):
    N, K, M = opargs.linear_backward(dy, x, w)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    ddy = _dev(dy)
    dx = dw = None
    if need_dx:        # dx = dy W, sum over m ascending
        dx = _empty((N, K), np.float32)
        _gemm(N, K, M, ddy, M, 1, _dev(w), K, 1, dx, K, False)
    if need_dw:        # dW = dy^T x, sum over n ascending
        dw = _empty((M, K), np.float32)
        _gemm(M, K, N, ddy, 1, M, _dev(x), K, 1, dw, K, False)
    return _host(dx), derived_ops.into(dw_out, _host(dw))


# ------------------------------------------------------------------ layers (§6.2–§6.5)
@_given_kind
def embedding_forward(tokens: np.ndarray, wte: np.ndarray) -> np.ndarray:
    N, V, C = opargs.embedding_forward(tokens, wte)
    out = _empty((N, C), np.float32)
    _launch1d("embedding.cu", "o1b_embedding_forward", N * C, i64(N), i64(C), _dev(tokens), _dev(wte), out)
    return _host(out)


@_given_kind
def embedding_backward(tokens: np.ndarray, dout: np.ndarray, V: int, *,
                       dw_out: np.ndarray | None = None) -> np.ndarray:
    N, V, C = opargs.embedding_backward(tokens, dout, V)
    dw_out = opargs.dw_out(dw_out, V, C, True)
    # the stable counting sort of positions by token, on the host (data movement only; the index
    # arrays go to the device with the launch)
    tokens = opargs.host_ids(tokens)
    start = np.zeros(V + 1, np.int64)
    np.cumsum(np.bincount(tokens, minlength=V), out=start[1:])
    pos = np.argsort(tokens, kind="stable").astype(np.int64)
    if pos.size == 0:
        pos = np.zeros(1, np.int64)
    dwte = _empty((V, C), np.float32)
    _launch1d("embedding.cu", "o1b_embedding_backward", V * C, i64(V), i64(C), _dev(start), _dev(pos),
              _dev(dout), dwte)
    return derived_ops.into(dw_out, _host(dwte))


_NO_GAIN = np.zeros(1, np.uint16)       # the 1-element placeholders of unused arguments (_dummy)
_NO_F32 = np.zeros(1, np.float32)


@_given_kind
def rmsnorm_forward(x: np.ndarray, g: np.ndarray | None, eps: float, bf16_out: bool = False):
    N, C = opargs.rmsnorm_forward(x, g, eps)
    y = _empty((N, C), np.float32)
    rstd = _empty((N,), np.float32)
    _launch1d("rmsnorm.cu", "o1b_rmsnorm_forward", N, i64(N), i64(C), _dev(x),
              (_dev(g) if g is not None else _dummy(_NO_GAIN)), i32(g is not None), f32(eps), y, rstd)
    return _host(f32_to_bf16(y) if bf16_out else y), _host(rstd)


@_given_kind
def rmsnorm_backward(dy: np.ndarray, x: np.ndarray, g: np.ndarray | None, rstd: np.ndarray):
    N, C = opargs.rmsnorm_backward(dy, x, g, rstd)
    ddy, xd, drstd = _dev(dy), _dev(x), _dev(rstd)
    dx = _empty((N, C), np.float32)
    _launch1d("rmsnorm.cu", "o1b_rmsnorm_backward_dx", N, i64(N), i64(C), ddy, xd,
              (_dev(g) if g is not None else _dummy(_NO_GAIN)), i32(g is not None), drstd, dx)
    dg = None
    if g is not None:
        dg = _empty((C,), np.float32)
        _launch1d("rmsnorm.cu", "o1b_rmsnorm_backward_dg", C, i64(N), i64(C), ddy, xd, drstd, dg)
    return _host(dx), _host(dg)


@_given_kind
def rope_tables(T: int, D: int, theta: float):
    T, D = opargs.rope_tables(T, D, theta)
    cos_t = _empty((T, D // 2), np.float32)
    sin_t = _empty((T, D // 2), np.float32)
    _launch1d("rope.cu", "o1b_rope_tables", T * (D // 2), i64(T), i64(D), f32(theta), cos_t, sin_t)
    return _host(cos_t), _host(sin_t)


def _rope(x, cos_t, sin_t, backward, name):
    B, T, R, D = opargs.rope(x, cos_t, sin_t, name)
    y = _empty(x.shape, np.float32)
    rows = B * T * R
    _launch1d("rope.cu", "o1b_rope", rows * (D // 2), i64(rows), i64(T), i64(R), i64(D), _dev(x),
              _dev(cos_t), _dev(sin_t), y, i32(int(backward)))
    return _host(y)


@_given_kind
def rope_forward(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return _rope(x, cos, sin, False, "x")


@_given_kind
def rope_backward(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    return _rope(dy, cos, sin, True, "dy")


@_given_kind
def swiglu_forward(h: np.ndarray, bf16_out: bool = False) -> np.ndarray:
    N, F = opargs.swiglu_forward(h)
    out = _empty((N, F), np.float32)
    _launch1d("swiglu.cu", "o1b_swiglu_forward", N * F, i64(N), i64(F), _dev(h), out)
    return _host(f32_to_bf16(out) if bf16_out else out)


@_given_kind
def swiglu_backward(dout: np.ndarray, h: np.ndarray, bf16_out: bool = False) -> np.ndarray:
    N, F = opargs.swiglu_backward(dout, h)
    dh = _empty((N, 2 * F), np.float32)
    _launch1d("swiglu.cu", "o1b_swiglu_backward", N * F, i64(N), i64(F), _dev(dout), _dev(h), dh)
    return _host(f32_to_bf16(dh) if bf16_out else dh)


# ------------------------------------------------------------------ optimizer and reductions (§6.7, §7)
@_in_place
def adamw_step(p_: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, *, lr: float,
               beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
               step: int) -> None:
    n, scalars = opargs.adamw(p_, g, m, v, lr, beta1, beta2, eps, weight_decay, step)
    dp, dm, dv = _dev(p_), _dev(m), _dev(v)
    _launch1d("adamw.cu", "o1b_adamw_step", n, i64(n), dp, _dev(g), dm, dv, *(f32(s) for s in scalars))
    _inplace_back(p_, dp)
    _inplace_back(m, dm)
    _inplace_back(v, dv)


# the kernels update in place: the functional forms run them on copies of the kind given
add, scale, adamw = map(_given_kind, derived_ops.functional_ops(add_inplace, scale_inplace, adamw_step))


@_given_kind
def sumsq_blocks(x: np.ndarray) -> np.ndarray:
    nb = opargs.sumsq_blocks(x, NORM_BLOCK)
    out = _empty((nb,), np.float32)
    _launch1d("reduce.cu", "o1b_sumsq_blocks", nb, i64(x.size), _dev(x), out)
    return _host(out)


@_given_kind
def treefold(values: np.ndarray) -> float:
    n = opargs.treefold(values)
    out = _empty((1,), np.float32)
    _launch1d("reduce.cu", "o1b_treefold", 1, i64(n), _dev(values) if values.size else _dummy(_NO_F32), out)
    return float(np.float32(arrays.to_host(out)[0]))


global_norm = _given_kind(derived_ops.global_norm_of(sumsq_blocks, treefold, scalar_sqrt))


@_given_kind
def clip_coef(norm: float, max_norm: float) -> float:
    out = _empty((1,), np.float32)
    _launch1d("reduce.cu", "o1b_clip_coef", 1, f32(norm), f32(max_norm), out)
    return float(arrays.to_host(out)[0])


# ------------------------------------------------------------------ random (§5)
@_given_kind
def philox_blocks(seed: int, stream: int, index0: int, n: int, sub: int = 0) -> np.ndarray:
    seed, stream, index0, sub = opargs.philox(seed, stream, index0, sub)
    args = (u64(seed), u32(stream), u64(index0), u32(sub))
    out = _empty((int(n), 4), np.uint32)
    _launch1d("random.cu", "o1b_philox_fill", int(n), *args, i64(n), out)
    return _host(out)


@_given_kind
def trunc_normal(seed: int, stream: int, index0: int, n: int, sigma: float = INIT_SIGMA) -> np.ndarray:
    seed, stream, index0, _ = opargs.philox(seed, stream, index0)
    args = (u64(seed), u32(stream), u64(index0))
    out = _empty((int(n),), np.float32)
    _launch1d("random.cu", "o1b_trunc_normal", int(n), *args, f32(sigma), i64(n), out)
    return _host(out)


# ------------------------------------------------------------------ attention (§6.6)
ATTN_ROWS = 64       # rows (query or key) per block of attention.cu's tiled kernels
ATTN_THREADS = {"o1b_attention_forward": 128, "o1b_attention_forward_i8": 128,   # two per row
                "o1b_attention_dq": 256, "o1b_attention_dkv": 256}             # four per row

# the largest head dim D for which attention.cu's dk/dv pass keeps its smallest query tile (8 rows)
# (q and dout rows fp32) within 48 KiB of static shared memory beside its guard slots
# (tests/ops/test_attention_head_dims.py holds it to the source)
ATTN_MAX_HEAD_DIM = 702


def _attention_head_dim(D: int) -> None:
    """Refuse, before any launch, a head dim whose attention tiles would not fit on chip."""
    if D > ATTN_MAX_HEAD_DIM:
        raise ValueError(f"attention: head_dim {D} is over this backend's limit of {ATTN_MAX_HEAD_DIM} "
                         "(the dk/dv pass's smallest query tile must fit on chip)")


def _launch_tiles(kernel: str, T: int, heads: int, B: int, D: int, *args) -> None:
    """A tiled kernel of attention.cu, built for head dim D: one block of ATTN_THREADS[kernel] per
    64 rows of one head (grid (ceil(T / 64), heads, B))."""
    fn = runtime.load("attention.cu", defines=(("ATTN_D", D),)).get_function(kernel)
    fn((-(-T // ATTN_ROWS), heads, B), (ATTN_THREADS[kernel],), args)


@_given_kind
def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, scale: float):
    B, T, H, G, D, W, s = opargs.attention_forward(q, k, v, window, scale)
    _attention_head_dim(D)
    o = _empty((B, T, H, D), np.float32)
    lse = _empty((B, H, T), np.float32)
    if B * T:
        _launch_tiles("o1b_attention_forward", T, H, B, D, i64(B), i64(T), i64(H), i64(G), i64(W), f32(s),
                      _dev(q), _dev(k), _dev(v), o, lse)
    return _host(o), _host(lse)


@_given_kind
def attention_forward_i8(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int, scale: float):
    """The value rows quantized once (o1b_attention_vquant, one thread per key row), then the query
    blocks as in attention_forward."""
    B, T, H, G, D, W, s = opargs.attention_forward(q, k, v, window, scale)
    _attention_head_dim(D)
    o = _empty((B, T, H, D), np.float32)
    lse = _empty((B, H, T), np.float32)
    if B * T:
        nv = B * T * G
        qv = _empty((nv, D), np.int8)
        sv = _empty((nv,), np.float32)
        _launch1d("attention.cu", "o1b_attention_vquant", nv, i64(nv), i64(D), _dev(v), qv, sv)
        _launch_tiles("o1b_attention_forward_i8", T, H, B, D, i64(B), i64(T), i64(H), i64(G), i64(W), f32(s),
                      _dev(q), _dev(k), qv, sv, o, lse)
    return _host(o), _host(lse)


@_given_kind
def attention_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       o: np.ndarray, lse: np.ndarray, window: int, scale: float):
    B, T, H, G, D, W, s = opargs.attention_backward(dout, q, k, v, o, lse, window, scale)
    _attention_head_dim(D)
    dq = _empty((B, T, H, D), np.float32)
    dk = _empty((B, T, G, D), np.float32)
    dv = _empty((B, T, G, D), np.float32)
    if B * T:
        dd, dq_, dk_, dv_, dl = _dev(dout), _dev(q), _dev(k), _dev(v), _dev(lse)
        dims = (i64(B), i64(T), i64(H), i64(G), i64(W), f32(s))
        Di = _empty((B * H * T,), np.float32)
        _launch1d("attention.cu", "o1b_attention_di", B * H * T, i64(B), i64(T), i64(H), i64(D), dd,
                  _dev(o), Di)
        _launch_tiles("o1b_attention_dq", T, H, B, D, *dims, dd, dq_, dk_, dv_, dl, Di, dq)
        _launch_tiles("o1b_attention_dkv", T, G, B, D, *dims, dd, dq_, dk_, dv_, dl, Di, dk, dv)
    return _host(dq), _host(dk), _host(dv)


# ------------------------------------------------------------------ cross-entropy (§6.8)
def _forward_chunked(h, w, targets, zcoef, chunk):
    N, C, V, zc = opargs.xent_forward(h, w, targets, zcoef)
    dh_, dw_, dt = _dev(h), _dev(w), _dev(targets)
    m, s, zt = (_empty((N,), np.float32) for _ in range(3))
    _launch1d("xent.cu", "o1b_xent_init", N, i64(N), m, s, zt)
    for v0 in range(0, V, chunk):
        L = min(chunk, V - v0)
        z = _empty((N, L), np.float32)
        _gemm(N, L, C, dh_, C, 1, dw_[v0:v0 + L], 1, C, z, L, False)    # columns v0.. of h W^T
        _launch1d("xent.cu", "o1b_xent_chunk_forward", N, i64(N), i64(v0), i64(L), z, dt, m, s, zt)
    loss, lse, ce = (_empty((N,), np.float32) for _ in range(3))
    _launch1d("xent.cu", "o1b_xent_final", N, i64(N), m, s, zt, f32(zc), loss, lse, ce)
    return _host(loss), _host(lse), _host(ce)


def _backward_chunked(h, w, targets, zcoef, lse, dloss, chunk, dw_out=None):
    N, C, V, zc = opargs.xent_backward(h, w, targets, zcoef, lse, dloss)
    dw_out = opargs.dw_out(dw_out, V, C, True)
    dh_, dw_, dt, dl, dd = _dev(h), _dev(w), _dev(targets), _dev(lse), _dev(dloss)
    dh = _empty((N, C), np.float32)
    dw = _empty((V, C), np.float32)
    for v0 in range(0, V, chunk):
        L = min(chunk, V - v0)
        wc = dw_[v0:v0 + L]                                              # (L, C) rows of this chunk
        z = _empty((N, L), np.float32)
        _gemm(N, L, C, dh_, C, 1, wc, 1, C, z, L, False)                 # logits, as in the forward
        dz = _empty((N, L), np.uint16)
        _launch1d("xent.cu", "o1b_xent_chunk_backward", N * L, i64(N), i64(v0), i64(L), z, dt, f32(zc),
                  dl, dd, dz)
        # dh[n,c] (+)= sum_j dz[n,j] w[v0+j,c]: one accumulator across all chunks
        _gemm(N, C, L, dz, L, 1, wc, C, 1, dh, C, v0 > 0)
        # dw[v0+j,c] = sum_n dz[n,j] h[n,c]: this chunk's rows of dw
        _gemm(L, C, N, dz, 1, L, dh_, C, 1, dw[v0:v0 + L], C, False)
    return _host(dh), derived_ops.into(dw_out, _host(dw))


@_given_kind
def xent_forward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float, keep: bool = False):
    out = _forward_chunked(h, w, targets, zcoef, XENT_CHUNK)
    return (*out, None) if keep else out             # keeps nothing: the backward computes the logits


@_given_kind
def xent_backward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float,
                  lse: np.ndarray, dloss: np.ndarray, saved=None, *, dw_out: np.ndarray | None = None):
    return _backward_chunked(h, w, targets, zcoef, lse, dloss, XENT_CHUNK, dw_out)


# ------------------------------------------------------------------ int8 quantized linear (§6.9)
# qmax 7 / 31 are the simulated int4 / int6 paths: the kernels that depend on the level bound take it
# as an argument.
Q_CHUNK = 4096       # quant.cu's Q_CHUNK: elements per block of the absmax (no result depends on it)
QA_THREADS = 256     # quant.cu's QA_THREADS: threads per block of the absmax and of the rotations
QR_COLS = 64         # quant.cu's QR_COLS: columns per block of the rotations
GRID_Y_MAX = 65535   # CUDA's largest grid y dimension
QW_ROWS = 4          # quant.cu's QW_ROWS: rows per block of the weight quantizer (a warp each)
_NO_U8 = np.zeros(1, np.uint8)
_counters: dict = {}     # device id -> the absmax's count of finished blocks (a 1-element uint32 cupy array)


def _pad_qb(n: int) -> int:
    return (n + QB - 1) // QB * QB


def _counter():
    """The absmax's count of finished blocks, +0 before each launch: on a GPU one per device, its own
    array (the kernel writes it, so never a shared placeholder of _dummy's; the last block of each
    launch sets it back to 0, and launches on one stream run in order), elsewhere a fresh zero (an
    emulated launch that fails half-way leaves nothing behind)."""
    xp = _xp()
    if not runtime.real_cuda():
        return xp.zeros(1, np.uint32)
    key = xp.cuda.Device().id if hasattr(xp, "cuda") else None    # None: the shape-only backend's stand-in
    if key not in _counters:
        _counters[key] = xp.zeros(1, np.uint32)
    return _counters[key]


def _q_weight(M: int, K: int, dw_, clip: bool, qmax: int = QMAX):
    """Device q (M, K) int8 in [-qmax, qmax], s (M,) fp32 and, if asked, clip (M, K) uint8
    (1 clipped, 2 NaN row)."""
    q = _empty((M, K), np.int8)
    s = _empty((max(M, 1),), np.float32)
    c = _empty((M, K), np.uint8) if clip else _dummy(_NO_U8)
    if M > 0:
        fn = runtime.load("quant.cu").get_function("o1b_q_weight")
        fn((-(-M // QW_ROWS),), (32 * QW_ROWS,), (i64(M), i64(K), dw_, s, q, c, i32(int(clip)), i32(qmax)))
    return q, s, c


def _q_scale(n: int, src, is_f32: bool, qmax: int = QMAX):
    """The per-tensor scale of n elements of a device array (bf16 or fp32), one launch: the device
    array sc (sc[0] = s, sc[1] = div(1, s) where used)."""
    xb, xf = (_dummy(_NO_GAIN), src) if is_f32 else (src, _dummy(_NO_F32))
    nb = max(1, -(-n // Q_CHUNK))
    part, sc = _empty((nb,), np.uint32), _empty((2,), np.float32)
    fn = runtime.load("quant.cu").get_function("o1b_q_absmax")
    fn((nb,), (QA_THREADS,), (i64(n), xb, xf, i32(int(is_f32)), part, _counter(), sc, i32(qmax)))
    return sc


def _q_levels(n: int, src, is_f32: bool, sc, q, qmax: int = QMAX, rows: int = 0):
    """The levels of n elements of a device array (bf16 or fp32) with the scale sc into device q (int8,
    in [-qmax, qmax]). rows > 0 (fp32 only): src is (rows, n // rows) and q receives the levels
    transposed, (n // rows, rows) — the layout the int8 GEMM contracts fastest (data movement only)."""
    if rows:
        cols = n // rows
        if -(-rows // QT_TILE) > GRID_Y_MAX:
            raise ValueError(f"int8 levels transposed: {rows} rows is over {GRID_Y_MAX * QT_TILE} (a grid's y "
                             f"dimension holds {GRID_Y_MAX} tiles of {QT_TILE} rows)")
        if n > 0:
            fn = runtime.load("quant.cu").get_function("o1b_q_tensor_levels_t")
            fn((-(-cols // QT_TILE), -(-rows // QT_TILE)), (QT_TILE, QT_ROWS),
               (i64(rows), i64(cols), src, sc, q, i32(qmax)))
    else:
        xb, xf = (_dummy(_NO_GAIN), src) if is_f32 else (src, _dummy(_NO_F32))
        _launch1d("quant.cu", "o1b_q_tensor_levels", n, i64(n), xb, xf, i32(int(is_f32)), sc, q, i32(qmax))


def _q_tensor(n: int, src, is_f32: bool, q, qmax: int = QMAX):
    """Quantize n elements of a device array (bf16 or fp32) into device q; returns the device scale
    array sc."""
    sc = _q_scale(n, src, is_f32, qmax)
    _q_levels(n, src, is_f32, sc, q, qmax)
    return sc


def _rot_grid(R: int, C: int) -> tuple[int, int]:
    """The rotations' grid over (R, C), R a multiple of QB: blocks of QR_COLS columns along x, of QB
    rows along y (at least one each, so that the fused scale is written for an empty operand)."""
    if R // QB > GRID_Y_MAX:
        raise ValueError(f"hadamard rotation: {R} rows is over {GRID_Y_MAX * QB} (a grid's y dimension holds "
                         f"{GRID_Y_MAX} blocks of {QB} rows)")
    return max(1, -(-C // QR_COLS)), max(1, R // QB)


def _q_rotated(kernel: str, Rp: int, C: int, cols: int, args, qmax: int = QMAX):
    """One of the rotations fused with its operand and its scale (o1b_q_rotate_d, _g, _i8): args are
    the kernel's arguments before its output; cols its grid's columns. Returns the rotated operand f
    (Rp, C) fp32 and its scale array sc."""
    f = _empty((Rp, C), np.float32)
    grid = _rot_grid(Rp, cols)
    part, sc = _empty((grid[0] * grid[1],), np.uint32), _empty((2,), np.float32)
    fn = runtime.load("quant.cu").get_function(kernel)
    fn(grid, (QA_THREADS,), (*args, f, part, _counter(), sc, i32(qmax)))
    return f, sc


def _gemm_i8(I, J, P, A, sa_i, sa_p, B, sb_j, sb_p, kernel: str = "o1b_gemm_i8", out=None, epilogue=()):
    """Device C (I, J) int32 = sum_p A(i,p) B(j,p), exactly (quant.cu, on the tensor cores): one block
    of GI_THREADS per GI_TILE x GI_TILE tile of C. Fastest with p contiguous (sa_p = sb_p = 1) and
    P, sa_i, sb_j multiples of 16. With `kernel` o1b_qgemm_y, _dx or _dw the sums go through that
    layer epilogue (its scale arrays `epilogue`) into `out`, fp32 (I, J), instead."""
    c = _empty((I, J), np.int32) if out is None else out
    if I > 0 and J > 0:
        fn = runtime.load("quant.cu").get_function(kernel)
        fn((-(-I // GI_TILE), -(-J // GI_TILE)), (GI_THREADS,),
           (i64(I), i64(J), i64(P), A, i64(sa_i), i64(sa_p), B, i64(sb_j), i64(sb_p), *epilogue, c))
    return c


def _rotated_levels(q, R: int, Rp: int, C: int, qmax: int = QMAX):
    """Integer q (R, C) padded with zero rows to Rp, rotated in int32, converted by i2f, quantized:
    device q' int8, transposed (C, Rp) for the GEMM, and its scale array."""
    f, sc = _q_rotated("o1b_q_rotate_i8", Rp, C, C, (i64(R), i64(Rp), i64(C), q), qmax)
    out = _empty((C, Rp), np.int8)
    _q_levels(Rp * C, f, True, sc, out, qmax, rows=Rp)
    return out, sc


@_given_kind
def quant_weight_rows(w: np.ndarray):
    M, K = opargs.quant_weight_rows(w)
    q, s, _ = _q_weight(M, K, _dev(w), False)
    return _host(q), _host(s)[:M].copy()


@_given_kind
def quant_tensor(x: np.ndarray):
    f32_ = x.dtype == np.float32
    n = opargs.quant_tensor(x, opargs.F32 if f32_ else opargs.BF16)
    q = _empty(x.shape, np.int8)
    sc = _q_tensor(n, _dev(x), f32_, q)
    return _host(q), _host(sc)[0]


@_given_kind
def gemm_i8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    I, J, P = opargs.gemm_i8(a, b)
    return _host(_gemm_i8(I, J, P, _dev(a), P, 1, _dev(b), P, 1))


def gemm_i8_has_vnni() -> bool:
    """Whether the C reference's AVX-512 VNNI kernel is in use: never here (CPU-only information)."""
    return False


@_given_kind
def hadamard_rows(f: np.ndarray) -> np.ndarray:
    xp = arrays.module(arrays.kind(f)) if arrays.is_device(f) else np
    f = xp.array(f, np.float32, copy=True, order="C")
    R, C = opargs.hadamard_rows(f)
    d = _dev(f)
    if R and C:
        fn = runtime.load("quant.cu").get_function("o1b_hadamard_rows")
        fn(_rot_grid(R, C), (QA_THREADS,), (i64(R), i64(C), d))
    return _host(d)


@_given_kind
def qlinear_forward(x: np.ndarray, w: np.ndarray, qmax: int = QMAX) -> np.ndarray:
    N, K, M = opargs.qlinear_forward(x, w)
    qmax = opargs.qmax(qmax)
    qx = _empty((N, K), np.int8)
    scx = _q_tensor(N * K, _dev(x), False, qx, qmax)
    qw, sw, _ = _q_weight(M, K, _dev(w), False, qmax)
    y = _gemm_i8(N, M, K, qx, K, 1, qw, K, 1, "o1b_qgemm_y", _empty((N, M), np.float32), (scx, sw))
    return _host(y)


@_given_kind
def qlinear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, need_dx: bool = True,
                     need_dw: bool = True, qmax: int = QMAX, *, dw_out: np.ndarray | None = None):
    N, K, M = opargs.qlinear_backward(dy, x, w)
    qmax = opargs.qmax(qmax)
    dw_out = opargs.dw_out(dw_out, M, K, need_dw)
    Mp, Np = _pad_qb(M), _pad_qb(N)
    ddy = _dev(dy)
    qw, sw, clip = _q_weight(M, K, _dev(w), True, qmax)
    dx = dw = None
    if need_dx:
        # G^T (Mp, N): mul(dy[n, m], s_w[m]), zero rows m >= M, rotated along m, quantized
        g, scg = _q_rotated("o1b_q_rotate_g", Mp, N, N, (i64(N), i64(M), i64(Mp), ddy, sw), qmax)
        qg = _empty((N, Mp), np.int8)                                # q_G transposed
        _q_levels(Mp * N, g, True, scg, qg, qmax, rows=Mp)
        qr, scr = _rotated_levels(qw, M, Mp, K, qmax)                # (K, Mp): q_R transposed
        # dx[n, k] = epilogue(sum over m' of q_G[n, m'] q_R[m', k])
        dx = _gemm_i8(N, K, Mp, qg, Mp, 1, qr, Mp, 1, "o1b_qgemm_dx", _empty((N, K), np.float32), (scg, scr))
    if need_dw:
        qx = _empty((N, K), np.int8)
        scx = _q_tensor(N * K, _dev(x), False, qx, qmax)
        # dy widened, zero rows n >= N, rotated along n
        d, scd = _q_rotated("o1b_q_rotate_d", Np, M, M, (i64(N), i64(Np), i64(M), ddy), qmax)
        qd = _empty((M, Np), np.int8)                                # q_D transposed
        _q_levels(Np * M, d, True, scd, qd, qmax, rows=Np)
        qX, scX = _rotated_levels(qx, N, Np, K, qmax)                # (K, Np): q_X transposed
        # dW[m, k] = epilogue(sum over n' of q_D[n', m] q_X[n', k])
        dw = _gemm_i8(M, K, Np, qd, Np, 1, qX, Np, 1, "o1b_qgemm_dw", _empty((M, K), np.float32),
                      (scd, scX, scx, clip))
    return _host(dx), derived_ops.into(dw_out, _host(dw))


# ------------------------------------------------------------------ torch interop
def to_torch(x):
    """A torch tensor sharing x's memory: by DLPack for a cupy array, torch.from_numpy for numpy
    (bf16 stays uint16)."""
    import torch
    if arrays.kind(x) == arrays.NUMPY:
        return torch.from_numpy(x)
    return torch.utils.dlpack.from_dlpack(x)


def from_torch(t):
    """A cupy array sharing a CUDA tensor's memory by DLPack (a numpy array for a CPU tensor)."""
    if t.device.type == "cpu":
        return t.numpy()
    import cupy
    return cupy.from_dlpack(t)

