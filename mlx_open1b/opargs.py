"""Argument checks of every contract op, shared by the C reference, Metal and CUDA backends.

Each backend's op calls the function of the same name here before it touches a kernel: dtype,
C-contiguity, shape and range are validated (a ValueError names the offending argument), and what
the launch needs comes back — sizes, output shapes, normalized scalars. Only numpy and the
host-side contract modules are imported, so a backend can check arguments without the C library.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import threading
from typing import Callable, Sequence

import numpy as np

from . import arrays
from .contract import NORM_BLOCK, Q_MAX_P, QB, QMAX, QMAX4, QMAX6
from .hostmath import adamw_scalars

BF16 = np.dtype(np.uint16)   # bf16 is held as its 16 bits (CONTRACT.md §1)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

#: The contract's scalar functions (CONTRACT.md §4), in the order of their kernel index.
FUNCTIONS = ("exp", "log", "sin", "cos", "sqrt", "rsqrt", "sigmoid", "silu", "sqrt_int")


# ------------------------------------------------------------------ argument primitives
def check(name: str, a, dtype: np.dtype, shape: tuple | None = None, ndim: int | None = None) -> np.ndarray:
    """Validate one array argument; shape entries of None match any size."""
    # a C-contiguous numpy array of the dtype (nearly every call: thousands a step) passes the
    # first three checks at once; anything else takes them one by one
    if not (type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous):
        _check_kind(name, a, dtype)
    return _check_shape(name, a, shape, ndim)


def _check_shape(name: str, a, shape: tuple | None, ndim: int | None) -> np.ndarray:
    if ndim is None and shape is not None:
        ndim = len(shape)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, a.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name}: dimension {axis} is {got}, expected {want} "
                                 f"(shape {a.shape}, expected {tuple('*' if s is None else s for s in shape)})")
    return a


def _check_kind(name: str, a, dtype: np.dtype) -> None:
    """check's array kind, dtype and C-contiguity, one by one."""
    if not arrays.is_array(a):
        raise ValueError(f"{name}: expected an array (numpy, mx.array or cupy), got {type(a).__name__}")
    got = arrays.dtype(a)
    if got != dtype:
        hint = " (bf16 is held as uint16)" if dtype == BF16 else ""
        raise ValueError(f"{name}: expected dtype {dtype}{hint}, got {got}")
    if not arrays.c_contiguous(a):
        mod = "cupy" if arrays.kind(a) == arrays.CUPY else "np"
        raise ValueError(f"{name}: must be C-contiguous (use {mod}.ascontiguousarray)")


def writable(name: str, a: np.ndarray) -> np.ndarray:
    if arrays.kind(a) == arrays.MLX:
        raise ValueError(f"{name}: an mx.array cannot be updated in place; use the functional op "
                         "(add, scale, adamw), which returns new arrays")
    if arrays.kind(a) == arrays.NUMPY and not a.flags.writeable:
        raise ValueError(f"{name}: array is read-only but is updated in place")
    return a


def positive(name: str, value: int) -> int:
    if int(value) != value or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def uint(name: str, value: int, bits: int) -> int:
    """An integer in [0, 2^bits)."""
    if int(value) != value or not 0 <= value < 2 ** bits:
        raise ValueError(f"{name}: expected an integer in [0, 2^{bits}), got {value!r}")
    return int(value)


_checked = threading.local()    # .ids: ((device array, host copy, V), ...) of checked_ids


@contextlib.contextmanager
def checked_ids(V: int, *pairs):
    """Within: each (device, host) pair of token-id arrays, whose host copy the caller made the
    device array from and has checked to lie in [0, V), is taken as checked by the ops (no read
    back of the device ids for the range check), and ops that need the ids on the host use the host
    copy. A device array of ids is then read back by no op: a model checks its windows once per
    microbatch on the host."""
    old = getattr(_checked, "ids", ())
    _checked.ids = old + tuple((d, h, int(V)) for d, h in pairs)
    try:
        yield
    finally:
        _checked.ids = old


def _checked_copy(a, V: int | None = None):
    """The host copy of a, given to checked_ids (for the bound V when V is given), or None."""
    for d, h, v in getattr(_checked, "ids", ()):
        if d is a and (V is None or v == V):
            return h
    return None


def host_ids(a) -> np.ndarray:
    """Token ids on the host: checked_ids' host copy when a has one, else a read back."""
    h = _checked_copy(a)
    return h if h is not None else arrays.to_host(a)


def tokens(tokens: np.ndarray, V: int) -> np.ndarray:
    """int32 token ids (N,), each in [0, V)."""
    check("tokens", tokens, I32, ndim=1)
    if tokens.size and _checked_copy(tokens, V) is None:
        t = arrays.to_host(tokens)          # a few bytes per row; device ids are checked on the host
        bad = np.flatnonzero((t < 0) | (t >= V))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"tokens: token id {int(t[i])} at index {i} is outside [0, {V})")
    return tokens


def window(window) -> int:
    """The attention window: an integer >= 0 (0: causal only)."""
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise ValueError(f"window: expected an integer >= 0 (0: causal only), got {window!r}")
    return int(window)


def scale(scale) -> np.float32:
    """The attention scale, a finite real rounded to a finite float32."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number, got {scale!r}")
    s = np.float32(scale)
    if not np.isfinite(s):
        raise ValueError(f"scale: {scale!r} overflows float32")
    return s


def _nonneg(name: str, value) -> None:
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite value >= 0, got {value!r}")


# ------------------------------------------------------------------ §2–§4 elementwise
def map_functions(apply: Callable[[int, np.ndarray], np.ndarray]) -> tuple:
    """The FUNCTIONS over float32 arrays: each checks x, then returns apply(index, x)."""
    def make(index: int, name: str):
        def f(x: np.ndarray) -> np.ndarray:
            check("x", x, F32)
            return apply(index, x)
        f.__name__ = f.__qualname__ = name
        f.__module__ = apply.__module__
        f.__doc__ = f"The contract's {name} (CONTRACT.md §4) of every element of a float32 array."
        return f
    return tuple(make(i, n) for i, n in enumerate(FUNCTIONS))


SCALAR_OPS = ("add", "sub", "mul", "div", "sqrt")   # op codes 0..4 of the backends' scalar kernels


def scalar_functions(apply: Callable[..., float]) -> tuple:
    """scalar_add, scalar_sub, scalar_mul, scalar_div(a, b) and scalar_sqrt(x): host-side contract
    arithmetic on one float32 value; each returns apply(op code, operands...)."""
    def make(code: int, name: str):
        if name == "sqrt":
            def f(x: float) -> float:
                return apply(code, x)
        else:
            def f(a: float, b: float) -> float:
                return apply(code, a, b)
        f.__name__ = f.__qualname__ = f"scalar_{name}"
        f.__module__ = apply.__module__
        f.__doc__ = f"The contract's {name} (CONTRACT.md §3) of float32 scalars."
        return f
    return tuple(make(i, n) for i, n in enumerate(SCALAR_OPS))


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    return check("x", x, F32)


def bf16_to_f32(x: np.ndarray) -> np.ndarray:
    return check("x", x, BF16)


def _w(name: str, a, inplace: bool):
    return writable(name, a) if inplace else a


def add_inplace(a: np.ndarray, b: np.ndarray, inplace: bool = True) -> int:
    """-> the element count of a (updated in place unless inplace=False, b of the same shape)."""
    check("a", _w("a", a, inplace), F32)
    check("b", b, F32, shape=a.shape)
    return a.size


def scale_inplace(a: np.ndarray, inplace: bool = True) -> int:
    """-> the element count of a (updated in place unless inplace=False)."""
    check("a", _w("a", a, inplace), F32)
    return a.size


def div_int(a: np.ndarray, b: np.ndarray) -> int:
    """a, b float32 of one shape -> the element count."""
    check("a", a, F32)
    check("b", b, F32, shape=a.shape)
    return a.size


# ------------------------------------------------------------------ §6.1 linear
def linear_forward(x: np.ndarray, w: np.ndarray) -> tuple[int, int, int]:
    """x (N, K) bf16, w (M, K) bf16 -> (N, K, M)."""
    check("x", x, BF16, ndim=2)
    N, K = x.shape
    check("w", w, BF16, shape=(None, K))
    return N, K, w.shape[0]


def linear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray) -> tuple[int, int, int]:
    """dy (N, M) bf16, x (N, K) bf16, w (M, K) bf16 -> (N, K, M)."""
    N, K, M = linear_forward(x, w)
    check("dy", dy, BF16, shape=(N, M))
    return N, K, M


def dw_out(out, M: int, K: int, need_dw: bool):
    """The dw_out of linear_backward and qlinear_backward ((M, K), with need_dw), xent_backward and
    embedding_backward ((V, C)): None, or a writable C-contiguous fp32 array of that shape -> out."""
    if out is None:
        return None
    if not need_dw:
        raise ValueError("dw_out: given with need_dw=False (no dw is computed to write there)")
    if arrays.kind(out) == arrays.MLX:
        raise ValueError("dw_out: an mx.array cannot be written in place; give a numpy (or cupy) array, or none")
    check("dw_out", out, F32, shape=(M, K))
    return writable("dw_out", out)


# ------------------------------------------------------------------ §6.2–§6.5 layers
def embedding_forward(tokens_: np.ndarray, wte: np.ndarray) -> tuple[int, int, int]:
    """tokens (N,) int32, wte (V, C) bf16 -> (N, V, C)."""
    check("wte", wte, BF16, ndim=2)
    V, C = wte.shape
    tokens(tokens_, V)
    return tokens_.size, V, C


def embedding_backward(tokens_: np.ndarray, dout: np.ndarray, V: int) -> tuple[int, int, int]:
    """tokens (N,) int32, dout (N, C) fp32, V > 0 -> (N, V, C)."""
    V = positive("V", V)
    tokens(tokens_, V)
    check("dout", dout, F32, shape=(tokens_.size, None))
    return tokens_.size, V, dout.shape[1]


def rmsnorm_forward(x: np.ndarray, g: np.ndarray | None, eps: float) -> tuple[int, int]:
    """x (N, C) fp32, g (C,) bf16 or None, eps finite >= 0 -> (N, C)."""
    check("x", x, F32, ndim=2)
    N, C = x.shape
    if g is not None:
        check("g", g, BF16, shape=(C,))
    _nonneg("eps", eps)
    return N, C


def rmsnorm_backward(dy: np.ndarray, x: np.ndarray, g: np.ndarray | None, rstd: np.ndarray) -> tuple[int, int]:
    """dy, x (N, C) fp32, g (C,) bf16 or None, rstd (N,) fp32 -> (N, C)."""
    check("x", x, F32, ndim=2)
    N, C = x.shape
    check("dy", dy, F32, shape=(N, C))
    check("rstd", rstd, F32, shape=(N,))
    if g is not None:
        check("g", g, BF16, shape=(C,))
    return N, C


def rope_tables(T: int, D: int, theta: float) -> tuple[int, int]:
    """T, D > 0 (D even), theta finite > 1 -> (T, D) as ints."""
    T, D = positive("T", T), positive("D", D)
    if D % 2:
        raise ValueError(f"D: head dimension must be even for RoPE, got {D}")
    if not np.isfinite(theta) or theta <= 1:
        raise ValueError(f"theta: expected a finite value > 1, got {theta!r}")
    return T, D


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, name: str) -> tuple[int, int, int, int]:
    """x (B, T, R, D) fp32 (named `name`: x or dy), cos and sin tables (>= T, D/2) -> (B, T, R, D)."""
    check(name, x, F32, ndim=4)
    B, T, R, D = x.shape
    check("cos", cos, F32, shape=(None, D // 2))
    check("sin", sin, F32, shape=cos.shape)
    if D % 2:
        raise ValueError(f"{name}: head dimension must be even, got {D}")
    if cos.shape[0] < T:
        raise ValueError(f"cos: table has {cos.shape[0]} positions, {name} needs {T}")
    return B, T, R, D


def swiglu_forward(h: np.ndarray) -> tuple[int, int]:
    """h (N, 2F) fp32 -> (N, F)."""
    check("h", h, F32, ndim=2)
    N, F2 = h.shape
    if F2 % 2:
        raise ValueError(f"h: last dimension must be 2F (gate and up), got {F2}")
    return N, F2 // 2


def swiglu_backward(dout: np.ndarray, h: np.ndarray) -> tuple[int, int]:
    """dout (N, F) fp32, h (N, 2F) fp32 -> (N, F)."""
    N, F = swiglu_forward(h)
    check("dout", dout, F32, shape=(N, F))
    return N, F


# ------------------------------------------------------------------ §6.6 attention
def attention_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int]:
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


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, window_: int, scale_: float):
    """-> (B, T, H, G, D, W, s): the sizes, the window as an int and the scale as a float32."""
    B, T, H, G, D = attention_shapes(q, k, v)
    return B, T, H, G, D, window(window_), scale(scale_)


def attention_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       o: np.ndarray, lse: np.ndarray, window_: int, scale_: float):
    """-> (B, T, H, G, D, W, s) as attention_forward, dout, o and lse checked against them."""
    B, T, H, G, D = attention_shapes(q, k, v)
    check("dout", dout, F32, shape=(B, T, H, D))
    check("o", o, F32, shape=(B, T, H, D))
    check("lse", lse, F32, shape=(B, H, T))
    return B, T, H, G, D, window(window_), scale(scale_)


# ------------------------------------------------------------------ §6.8 cross-entropy
def xent_forward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float) -> tuple[int, int, int, float]:
    """h (N, C) bf16, w (V, C) bf16, targets (N,) int32 in [0, V), zcoef >= 0
    -> (N, C, V, zcoef rounded to float32)."""
    check("h", h, BF16, ndim=2)
    N, C = h.shape
    check("w", w, BF16, shape=(None, C))
    V = w.shape[0]
    for name, size in (("h rows (N)", N), ("h columns (C)", C), ("w rows (V)", V)):
        if size == 0:
            raise ValueError(f"{name}: must be at least 1, got shape h {h.shape}, w {w.shape}")
    check("targets", targets, I32, shape=(N,))
    t = _checked_copy(targets, V)
    if t is None:
        t = arrays.to_host(targets)
    bad = np.flatnonzero((t < 0) | (t >= V))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"targets: entry {i} is {int(t[i])}, outside [0, {V}) "
                         f"({bad.size} out of range)")
    try:
        with np.errstate(over="ignore"):          # 1e39 -> inf, rejected below
            zc = np.float32(zcoef)
    except (TypeError, ValueError):
        raise ValueError(f"zcoef: expected a real number, got {zcoef!r}") from None
    if np.ndim(zc) != 0 or not math.isfinite(float(zc)) or zc < 0:
        raise ValueError(f"zcoef: expected a finite number >= 0 (as float32), got {zcoef!r}")
    return N, C, V, float(zc)


def xent_backward(h: np.ndarray, w: np.ndarray, targets: np.ndarray, zcoef: float,
                  lse: np.ndarray, dloss: np.ndarray) -> tuple[int, int, int, float]:
    """As xent_forward, with lse and dloss (N,) float32 -> (N, C, V, zcoef as float32)."""
    N, C, V, zc = xent_forward(h, w, targets, zcoef)
    check("lse", lse, F32, shape=(N,))
    check("dloss", dloss, F32, shape=(N,))
    return N, C, V, zc


# ------------------------------------------------------------------ §6.7 AdamW, §7 reductions
#: The order in which the AdamW kernels take adamw's scalars.
ADAMW_SCALARS = ("lr", "b1", "b2", "omb1", "omb2", "eps", "decay", "bc1", "bc2")


def adamw(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, lr: float, beta1: float,
          beta2: float, eps: float, weight_decay: float, step: int,
          inplace: bool = True) -> tuple[int, list[float]]:
    """p (n,) bf16 and m, v (n,) fp32 (writable unless inplace=False), g (n,) fp32, hyperparameters
    finite >= 0, betas < 1 -> (n, the nine float32 kernel scalars in ADAMW_SCALARS order, from
    hostmath.adamw_scalars)."""
    check("p", _w("p", p, inplace), BF16, ndim=1)
    n = p.size
    check("g", g, F32, shape=(n,))
    check("m", _w("m", m, inplace), F32, shape=(n,))
    check("v", _w("v", v, inplace), F32, shape=(n,))
    for name, val in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay)):
        _nonneg(name, val)
    if not (beta1 < 1 and beta2 < 1):
        raise ValueError(f"beta1, beta2: expected values < 1, got {beta1!r}, {beta2!r}")
    s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, int(step))
    return n, [s[k] for k in ADAMW_SCALARS]


def sumsq_blocks(x: np.ndarray, block: int = NORM_BLOCK) -> int:
    """x fp32, any shape -> the number of `block`-element blocks of its flattening."""
    check("x", x, F32)
    return -(-x.size // block)


def treefold(values: np.ndarray) -> int:
    """values (n,) fp32 -> n."""
    check("values", values, F32, ndim=1)
    return values.size


def global_norm(tensors: Sequence[np.ndarray]) -> list[np.ndarray]:
    """At least one fp32 tensor -> the tensors, each checked, in the given order."""
    if not len(tensors):
        raise ValueError("tensors: expected at least one tensor")
    return [check(f"tensors[{i}]", t, F32) for i, t in enumerate(tensors)]


# ------------------------------------------------------------------ §5 random numbers
def philox(seed: int, stream: int, index0: int, sub: int = 0) -> tuple[int, int, int, int]:
    """A Philox counter start -> (seed, stream, index0, sub) as ints (64, 32, 64, 32 bits)."""
    return (uint("seed", seed, 64), uint("stream", stream, 32), uint("index0", index0, 64),
            uint("sub", sub, 32))


# ------------------------------------------------------------------ §6.9 int8 quantized linear
I8 = np.dtype(np.int8)
#: The level bounds a quantized op accepts as its qmax: int8 and the simulated int6 and int4 paths.
QMAX_CHOICES = (QMAX, QMAX6, QMAX4)


def _qlen(name: str, n: int, pad: bool) -> None:
    p = (n + QB - 1) // QB * QB if pad else n
    if p > Q_MAX_P:
        raise ValueError(f"{name}: contraction length {n} (padded {p}) exceeds {Q_MAX_P} "
                         "(int32 accumulation of int8 products would no longer be exact)")


def qmax(value) -> int:
    """The level bound of a quantized op: 127 (int8, the default), 31 (the simulated int6 path) or
    7 (the simulated int4 path, CONTRACT.md §6.9) -> the same as an int; anything else (bool,
    float, other integers) is a ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or int(value) not in QMAX_CHOICES:
        raise ValueError(f"qmax: expected {QMAX} (int8), {QMAX6} (the simulated int6 path) or {QMAX4} "
                         f"(the simulated int4 path), got {value!r}")
    return int(value)


def quant_weight_rows(w: np.ndarray) -> tuple[int, int]:
    """w (M, K) bf16 -> (M, K)."""
    check("w", w, BF16, ndim=2)
    if w.shape[1] >= 1 << 24:
        raise ValueError(f"w: K = {w.shape[1]} must be below 2^24")
    return w.shape


def quant_tensor(x: np.ndarray, dtype: np.dtype = BF16) -> int:
    """x (any shape) bf16 or fp32 -> its element count."""
    check("x", x, dtype)
    return x.size


def gemm_i8(a: np.ndarray, b: np.ndarray) -> tuple[int, int, int]:
    """a (I, P) int8, b (J, P) int8 -> (I, J, P)."""
    check("a", a, I8, ndim=2)
    I, P = a.shape
    check("b", b, I8, shape=(None, P))
    _qlen("P", P, False)
    for name, arr in (("a", a), ("b", b)):
        if arr.size and int(arr.min()) < -QMAX:
            raise ValueError(f"{name}: contains -128; int8 operands are in [-127, 127]")
    return I, b.shape[0], P


def hadamard_rows(f: np.ndarray, inplace: bool = True) -> tuple[int, int]:
    """f (R, C) fp32, R a multiple of QB (rotated in place unless inplace=False) -> (R, C)."""
    check("f", _w("f", f, inplace), F32, ndim=2)
    if f.shape[0] % QB:
        raise ValueError(f"f: {f.shape[0]} rows is not a multiple of the Hadamard block {QB}")
    return f.shape


def qlinear_forward(x: np.ndarray, w: np.ndarray) -> tuple[int, int, int]:
    """x (N, K) bf16, w (M, K) bf16 -> (N, K, M)."""
    N, K, M = linear_forward(x, w)
    _qlen("K", K, False)
    quant_weight_rows(w)
    return N, K, M


def qlinear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray) -> tuple[int, int, int]:
    """dy (N, M) bf16, x (N, K) bf16, w (M, K) bf16 -> (N, K, M)."""
    N, K, M = linear_backward(dy, x, w)
    _qlen("M", M, True)
    _qlen("N", N, True)
    quant_weight_rows(w)
    return N, K, M
