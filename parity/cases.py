"""Seeded test cases for every op of the backend API (cpu_ref's public functions).

A case is a pure function of (base seed, op, case index): its seed is the first 8 bytes of
SHA-256("open1b-parity/1|<base seed>|<op>|<index>"), and every random choice and value comes
from Philox4x32-10 words under that seed on STREAM_TESTS (CONTRACT.md §5), turned into values
with exact integer operations or correctly rounded binary64 + - * / and one rounding to fp32.
No library random generator or transcendental is used, so the same case has the same input
bits on every machine and numpy version (a bundle records an input hash to prove it).

Inputs are in ordinary ranges, with special values sprinkled in (subnormals, +-0, +-inf, NaNs
with several payloads, the largest and smallest normals, tiny and huge powers of two) at a rate
that depends on the case index (index % 4 == 0: none), shapes that are multiples of no tile
size (1, 7, 33, 65, 130, ...), and valid parameters (windows, chunk-crossing vocabularies,
block-crossing lengths, counter words crossing 2^32, ...). Inputs a backward op takes from its
forward (rstd, o, lse) are, in most cases, computed by the numpy spec so they are realistic.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Callable

import numpy as np

from mlx_open1b.contract import NORM_BLOCK, Q_MAX_P, QB, QMAX, QMAX4, QMAX6, STREAM_TESTS, XENT_CHUNK
from mlx_open1b.spec import arith as A
from mlx_open1b.spec import attention as _sp_att
from mlx_open1b.spec import layers as _sp_lay
from mlx_open1b.spec import quant as _sp_q
from mlx_open1b.spec import xent as _sp_xent
from mlx_open1b.spec.optim import philox_block

F32, U16, U32, I32, I8 = np.float32, np.uint16, np.uint32, np.int32, np.int8

SPECIAL_F32_BITS = np.array([
    0x00000000, 0x80000000,                 # +-0
    0x7F800000, 0xFF800000,                 # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA00001,   # NaNs, quiet and signalling payloads
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00400000,   # subnormals (smallest, largest, middle)
    0x00800000, 0x80800000, 0x00800001,     # smallest normals
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7FFFFE,     # largest normals
    0x3F800000, 0xBF800000,                 # +-1
    0x1C800000, 0x62800000, 0x9C800000,     # 2^-70, 2^70, -2^-70 (products under/overflow)
], np.uint32)
SPECIAL_F32 = SPECIAL_F32_BITS.view(F32)
SPECIAL_BF16 = np.array([
    0x0000, 0x8000, 0x7F80, 0xFF80,          # +-0, +-inf
    0x7FC0, 0xFFC0, 0x7FC1, 0x7F81, 0xFFFF,  # NaNs
    0x0001, 0x8001, 0x007F, 0x807F, 0x0040,  # subnormals
    0x0080, 0x8080, 0x0081,                  # smallest normals
    0x7F7F, 0xFF7F,                          # largest normals
    0x3F80, 0xBF80, 0x1D80, 0x6280,          # +-1, 2^-68, 2^70
], np.uint16)

#: the finite ones: they reach every output of a sum without turning whole rows into NaN
SPECIAL_F32_FINITE = SPECIAL_F32[np.isfinite(SPECIAL_F32)]
SPECIAL_F32_NONFINITE = SPECIAL_F32[~np.isfinite(SPECIAL_F32)]
SPECIAL_BF16_FINITE = SPECIAL_BF16[(SPECIAL_BF16 & 0x7F80) != 0x7F80]
SPECIAL_BF16_NONFINITE = SPECIAL_BF16[(SPECIAL_BF16 & 0x7F80) == 0x7F80]
#: signed zeros, subnormals and the smallest normals: never overflow anything
SPECIAL_BF16_TINY = SPECIAL_BF16[(SPECIAL_BF16 & 0x7F80) <= 0x0080]

SIZES = (1, 7, 33, 65, 130)
SIZES_1D = (1, 7, 33, 65, 130, 1000, 4097)
SPECIAL_FRAC = (0.0, 0.01, 0.05, 0.25)          # elementwise ops, by case index % 4


def case_seed(seed: int, op: str, index: int) -> int:
    d = hashlib.sha256(f"open1b-parity/1|{int(seed)}|{op}|{int(index)}".encode()).digest()
    return int.from_bytes(d[:8], "little")


class CaseRNG:
    """Philox4x32-10 words under a 64-bit key on STREAM_TESTS, consumed in order."""

    def __init__(self, seed: int):
        self.seed = int(seed) & (2 ** 64 - 1)
        self._next = 0

    def words(self, n: int) -> np.ndarray:
        n = int(n)
        if n <= 0:
            return np.empty(0, U32)
        nb = -(-n // 4)
        idx = np.arange(self._next, self._next + nb, dtype=np.uint64)
        self._next += nb
        return philox_block(self.seed, STREAM_TESTS, idx).reshape(-1)[:n]

    def below(self, n: int) -> int:
        return int(self.words(1)[0]) % int(n)

    def ints(self, n: int, lo: int, hi: int) -> np.ndarray:
        """n integers in [lo, hi) (hi - lo <= 2^32; the modulo bias is irrelevant here)."""
        return (self.words(n).astype(np.int64) % (hi - lo) + lo)

    def u64(self) -> int:
        w = self.words(2)
        return int(w[0]) | (int(w[1]) << 32)

    def choice(self, seq):
        return seq[self.below(len(seq))]

    def coin(self, p: float) -> bool:
        return self.below(1 << 20) < p * (1 << 20)

    def uniform(self, n: int, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
        """binary64 uniforms in [lo, hi): 53 random bits, exact scaling by powers of two."""
        w = self.words(2 * n).astype(np.uint64).reshape(n, 2) if n else np.empty((0, 2), np.uint64)
        k = ((w[:, 0] >> np.uint64(5)) << np.uint64(26)) | (w[:, 1] >> np.uint64(6))
        u = k.astype(np.float64) * 2.0 ** -53
        return lo + (hi - lo) * u

    def normal(self, n: int) -> np.ndarray:
        """Approximately standard normal (Irwin-Hall of 4 uniforms), binary64."""
        u = self.uniform(4 * n).reshape(n, 4) if n else np.empty((0, 4))
        return (((u[:, 0] + u[:, 1]) + (u[:, 2] + u[:, 3])) - 2.0) * 1.7320508075688772

    # ---- fp32 / bf16 arrays
    def f32(self, shape, kind: str = "normal", scale: float = 1.0, lo: float = -1.0, hi: float = 1.0,
            elo: int = -126, ehi: int = 127) -> np.ndarray:
        n = int(np.prod(shape))
        with np.errstate(over="ignore"):
            if kind == "normal":
                x = (self.normal(n) * scale).astype(F32)
            elif kind == "uniform":
                x = self.uniform(n, lo, hi).astype(F32)
            elif kind == "wide":      # random sign, exponent in [elo, ehi], random significand: normals
                e = self.ints(n, elo + 127, ehi + 128).astype(np.uint32)
                w = self.words(2 * n).reshape(2, n) if n else np.empty((2, 0), U32)
                x = ((w[0] & U32(0x80000000)) | (e << U32(23)) | (w[1] & U32(0x7FFFFF))).astype(U32).view(F32)
            elif kind == "wide+":     # positive only
                x = np.abs(self.f32(shape, "wide", elo=elo, ehi=ehi)).reshape(-1)
            elif kind == "bits":      # any bit pattern: NaNs, infinities, subnormals at their natural rate
                x = self.words(n).view(F32)
            else:
                raise ValueError(kind)
        return np.ascontiguousarray(x.reshape(shape))

    def mix(self, shape, parts) -> np.ndarray:
        """Elementwise choice among arrays of the same shape (parts: list of arrays)."""
        n = int(np.prod(shape))
        sel = self.ints(n, 0, len(parts)).reshape(shape)
        out = np.empty(shape, F32)
        for i, p in enumerate(parts):
            out[sel == i] = p[sel == i]
        return out

    def bf16(self, shape, scale: float = 1.0) -> np.ndarray:
        return A.f32_to_bf16(self.f32(shape, "normal", scale)).reshape(shape)

    def sprinkle(self, a: np.ndarray, frac: float, specials=None) -> np.ndarray:
        """A copy of a with about frac of its entries replaced by special values."""
        a = np.array(a, copy=True)
        if frac <= 0 or a.size == 0:
            return a
        if specials is None:
            specials = SPECIAL_BF16 if a.dtype == U16 else SPECIAL_F32
        k = max(1, int(round(frac * a.size)))
        flat = a.reshape(-1)
        pos = self.ints(k, 0, a.size)
        flat[pos] = specials[self.ints(k, 0, len(specials))]
        return a


@dataclasses.dataclass
class Case:
    op: str
    index: int
    seed: int
    args: tuple
    kwargs: dict
    outputs: tuple                  # names of the outputs, in the order the op returns them
    desc: str = ""
    inplace: tuple | None = None    # the outputs are these arguments after the call
    pairs: bool = False             # scalar op: called once per element (pair) of the argument arrays

    def input_hash(self) -> str:
        h = hashlib.sha256()
        _hash_value(h, self.args)
        _hash_value(h, sorted(self.kwargs.items()))
        return h.hexdigest()


def _hash_value(h, v) -> None:
    if isinstance(v, np.ndarray):
        h.update(f"a{v.dtype.str}{v.shape}".encode())
        h.update(np.ascontiguousarray(v).tobytes())
    elif isinstance(v, (list, tuple)):
        h.update(f"l{len(v)}".encode())
        for x in v:
            _hash_value(h, x)
    elif isinstance(v, float):
        h.update(b"f" + float(v).hex().encode())
    else:
        h.update(b"s" + repr(v).encode())


def frac(i: int) -> float:
    return SPECIAL_FRAC[i % 4]


def sum_specials(rng: CaseRNG, a: np.ndarray, i: int) -> np.ndarray:
    """Specials for an operand of a sum, where one NaN or infinity spoils whole rows: by case
    index % 4: none; finite specials (signed zeros, subnormals, extreme normals) at 2%; finite at
    1% plus one non-finite value; all kinds at 0.3% (at most 4)."""
    bf = a.dtype == U16
    fin = SPECIAL_BF16_FINITE if bf else SPECIAL_F32_FINITE
    nonfin = SPECIAL_BF16_NONFINITE if bf else SPECIAL_F32_NONFINITE
    k = i % 4
    if k == 1:
        return rng.sprinkle(a, 0.02, fin)
    if k == 2:
        a = rng.sprinkle(a, 0.01, fin)
        if a.size:
            a.reshape(-1)[rng.below(a.size)] = nonfin[rng.below(len(nonfin))]
        return a
    if k == 3:
        return rng.sprinkle(a, min(0.003, 4.0 / max(1, a.size)))
    return a


# ------------------------------------------------------------------------- generators
# Each takes (rng, case index) and returns dict(args=..., kwargs=..., outputs=..., desc=..., ...).
GENERATORS: dict[str, Callable[[CaseRNG, int], dict]] = {}


def gen(*ops):
    def deco(fn):
        for op in ops:
            GENERATORS[op] = (lambda fn_, op_: (lambda rng, i: fn_(rng, i, op_)))(fn, op)
        return fn
    return deco


def _shape_1d_or_2d(rng: CaseRNG):
    if rng.coin(0.3):
        return (rng.choice(SIZES), rng.choice(SIZES))
    return (rng.choice(SIZES_1D),)


_MAP_RANGE = {
    "exp": dict(kind="uniform", lo=-110.0, hi=95.0),
    "log": dict(kind="wide+"),
    "sin": None, "cos": None,     # chosen per case below
    "sqrt": dict(kind="wide+"), "sqrt_int": dict(kind="wide+"), "rsqrt": dict(kind="wide+"),
    "sigmoid": dict(kind="uniform", lo=-100.0, hi=100.0),
    "silu": dict(kind="uniform", lo=-100.0, hi=100.0),
}


@gen("exp", "log", "sin", "cos", "sqrt", "sqrt_int", "rsqrt", "sigmoid", "silu")
def _map(rng: CaseRNG, i: int, op: str):
    shape = _shape_1d_or_2d(rng)
    rk = _MAP_RANGE[op]
    if rk is None:   # sin, cos: RoPE-like small, moderate and large arguments
        hi = rng.choice([4.0, 100.0, 3.0e4, 1.0e6])
        rk = dict(kind="uniform", lo=-hi, hi=hi)
    parts = [rng.f32(shape, **rk), rng.f32(shape, **rk), rng.f32(shape, "normal", 3.0), rng.f32(shape, "bits")]
    x = rng.sprinkle(rng.mix(shape, parts), frac(i))
    return dict(args=(x,), outputs=("y",), desc=f"shape={shape}")


@gen("div_int")
def _div_int(rng: CaseRNG, i: int, op: str):
    """Quotients in every range, and divisors a few ulp from a/2^-126 and a/FLT_MAX (quotients at
    the flush boundary and at overflow)."""
    shape = _shape_1d_or_2d(rng)
    parts = lambda: [rng.f32(shape, "normal", 10.0), rng.f32(shape, "wide"), rng.f32(shape, "bits"),
                     rng.f32(shape, "wide", elo=-128, ehi=-100), rng.f32(shape, "wide", elo=100, ehi=127)]
    a = rng.mix(shape, parts())
    b = rng.mix(shape, parts())
    with np.errstate(all="ignore"):
        edge = [np.abs(a.astype(np.float64)) / 2.0 ** -126, np.abs(a.astype(np.float64)) / float(np.finfo(F32).max)]
    k = rng.ints(a.size, 0, 3).reshape(shape)
    steps = rng.ints(a.size, -3, 4).reshape(shape)
    for j in (1, 2):
        sel = (k == j) & np.isfinite(edge[j - 1]) & (edge[j - 1] > 0)
        with np.errstate(all="ignore"):
            e = edge[j - 1][sel].astype(F32)
        b[sel] = (e.view(np.int32) + steps[sel].astype(np.int32)).view(F32)
    return dict(args=(rng.sprinkle(a, frac(i)), rng.sprinkle(b, frac(i))), outputs=("y",), desc=f"shape={shape}")


@gen("f32_to_bf16")
def _to_bf16(rng, i, op):
    shape = _shape_1d_or_2d(rng)
    x = rng.mix(shape, [rng.f32(shape, "bits"), rng.f32(shape, "normal", 10.0), rng.f32(shape, "wide")])
    u = x.view(U32).copy()
    tie = rng.ints(u.size, 0, 4).reshape(shape) == 0                  # rounding boundaries
    low = np.array([0x8000, 0x7FFF, 0x0000, 0xFFFF, 0x8001], U32)[rng.ints(u.size, 0, 5).reshape(shape)]
    u[tie] = (u[tie] & U32(0xFFFF0000)) | low[tie]
    x = rng.sprinkle(u.view(F32), frac(i))
    return dict(args=(x,), outputs=("y",), desc=f"shape={shape}")


@gen("bf16_to_f32")
def _to_f32(rng, i, op):
    shape = _shape_1d_or_2d(rng)
    x = rng.sprinkle(rng.words(int(np.prod(shape))).astype(U16).reshape(shape), frac(i))
    return dict(args=(x,), outputs=("y",), desc=f"shape={shape}")


def _mixed_f32(rng: CaseRNG, shape, scale: float = 1.0) -> np.ndarray:
    return rng.mix(shape, [rng.f32(shape, "normal", scale), rng.f32(shape, "normal", scale * 1e-3),
                           rng.f32(shape, "wide", elo=-40, ehi=40)])


@gen("add_inplace")
def _add_inplace(rng, i, op):
    shape = _shape_1d_or_2d(rng)
    a = rng.sprinkle(_mixed_f32(rng, shape), frac(i))
    b = _mixed_f32(rng, shape)
    cancel = rng.ints(a.size, 0, 3).reshape(shape) == 0               # exact and near cancellation
    b[cancel] = -a[cancel]
    b = rng.sprinkle(b, frac(i))
    return dict(args=(a, b), outputs=("a",), inplace=(0,), desc=f"shape={shape}")


@gen("scale_inplace")
def _scale_inplace(rng, i, op):
    shape = _shape_1d_or_2d(rng)
    a = rng.sprinkle(_mixed_f32(rng, shape), frac(i))
    s = rng.choice([float(np.float32(rng.normal(1)[0])), 1.0 / 3.0, 0.5, 1e-3, 1e30, 1e-30, 0.0, -0.0, -2.0,
                    float(rng.uniform(1, 0.0, 1.0)[0])])
    return dict(args=(a, s), outputs=("a",), inplace=(0,), desc=f"shape={shape} s={s!r}")


def _functional(case: dict, outputs: tuple) -> dict:
    """An in-place op's case as its functional form's (add, scale, adamw: the result is returned)."""
    case = dict(case, outputs=outputs)
    del case["inplace"]
    return case


@gen("add")
def _add(rng, i, op):
    return _functional(_add_inplace(rng, i, op), ("out",))


@gen("scale")
def _scale(rng, i, op):
    return _functional(_scale_inplace(rng, i, op), ("out",))


@gen("scalar_add", "scalar_sub", "scalar_mul", "scalar_div")
def _scalar(rng, i, op):
    n = rng.choice([1, 7, 33, 65])
    parts = lambda: [rng.f32((n,), "normal", 10.0), rng.f32((n,), "wide"), rng.f32((n,), "bits"),
                     rng.f32((n,), "wide", elo=-128, ehi=-100)]
    a = rng.sprinkle(rng.mix((n,), parts()), frac(i))
    b = rng.sprinkle(rng.mix((n,), parts()), frac(i))
    if op in ("scalar_add", "scalar_sub"):
        near = rng.ints(n, 0, 4) == 0
        b[near] = (-a[near] if op == "scalar_add" else a[near])
    return dict(args=(a, b), outputs=("y",), pairs=True, desc=f"n={n}")


def _bf16_operand(rng: CaseRNG, shape, i: int, scale: float) -> np.ndarray:
    return sum_specials(rng, rng.bf16(shape, scale), i)


_GEMM_SCALES = (1.0, 1.0, 0.02, 30.0, 2.0 ** -62, 2.0 ** 62)   # tiny/huge: products under- and overflow


@gen("scalar_sqrt")
def _scalar_sqrt(rng, i, op):
    n = rng.choice([1, 7, 33, 65])
    a = rng.sprinkle(rng.mix((n,), [rng.f32((n,), "wide+"), rng.f32((n,), "bits"), rng.f32((n,), "normal", 10.0)]),
                     frac(i))
    return dict(args=(a,), outputs=("y",), pairs=True, desc=f"n={n}")


@gen("linear_forward", "linear_backward")
def _linear(rng, i, op):
    N, M = rng.choice(SIZES), rng.choice(SIZES)
    K = rng.choice(SIZES + (513,))                   # 513 crosses the 512-deep slices of the fast GEMM
    sx, sw = rng.choice(_GEMM_SCALES), rng.choice(_GEMM_SCALES[:4])
    x = _bf16_operand(rng, (N, K), i, sx)
    w = _bf16_operand(rng, (M, K), i, sw)
    if op == "linear_forward":
        return dict(args=(x, w), outputs=("y",), desc=f"N={N} K={K} M={M}")
    dy = _bf16_operand(rng, (N, M), i, rng.choice(_GEMM_SCALES[:4]))
    need_dx, need_dw = rng.choice([(True, True), (True, True), (True, False), (False, True)])
    return dict(args=(dy, x, w), kwargs=dict(need_dx=need_dx, need_dw=need_dw), outputs=("dx", "dw"),
                desc=f"N={N} K={K} M={M} need_dx={need_dx} need_dw={need_dw}")


def _tokens(rng: CaseRNG, N: int, V: int) -> np.ndarray:
    t = rng.ints(N, 0, V).astype(I32)
    if N > 3 and rng.coin(0.5):        # one id at many positions: the backward's order matters
        t[rng.ints(max(1, N // 3), 0, N)] = rng.below(V)
    return t


@gen("embedding_forward", "embedding_backward")
def _embedding(rng, i, op):
    V, C, N = rng.choice((1, 7, 33, 130, 1000)), rng.choice(SIZES), rng.choice(SIZES)
    tok = _tokens(rng, N, V)
    if op == "embedding_forward":
        wte = rng.sprinkle(rng.bf16((V, C), 0.02), frac(i))
        return dict(args=(tok, wte), outputs=("out",), desc=f"V={V} C={C} N={N}")
    dout = sum_specials(rng, _mixed_f32(rng, (N, C)), i)
    return dict(args=(tok, dout, V), outputs=("dwte",), desc=f"V={V} C={C} N={N}")


@gen("rmsnorm_forward", "rmsnorm_backward")
def _rmsnorm(rng, i, op):
    N, C = rng.choice(SIZES), rng.choice(SIZES + (1000,))
    x = sum_specials(rng, _mixed_f32(rng, (N, C), rng.choice([1.0, 30.0, 1e-3])), i)
    g = sum_specials(rng, rng.bf16((C,), 1.0), i) if rng.coin(0.6) else None
    eps = rng.choice([1e-6, 1e-5, 0.0, 1e-3])
    desc = f"N={N} C={C} gain={g is not None}"
    if op == "rmsnorm_forward":
        return dict(args=(x, g, eps), outputs=("y", "rstd"), desc=desc + f" eps={eps}")
    if rng.coin(0.75):
        rstd = _sp_lay.rmsnorm_forward(x, g, F32(eps))[1]
    else:
        rstd = rng.sprinkle(np.abs(rng.f32((N,), "normal", 2.0)), frac(i))
    dy = sum_specials(rng, _mixed_f32(rng, (N, C)), i)
    return dict(args=(dy, x, g, rstd), outputs=("dx", "dg"), desc=desc)


@gen("rope_tables")
def _rope_tables(rng, i, op):
    T, D = rng.choice(SIZES + (1000,)), rng.choice((2, 4, 8, 16, 32, 64, 66, 130))
    theta = rng.choice([10000.0, 500000.0, 1e6, 2.0, 1.5, 10.0])
    return dict(args=(T, D, theta), outputs=("cos", "sin"), desc=f"T={T} D={D} theta={theta}")


@gen("rope_forward", "rope_backward")
def _rope(rng, i, op):
    B, T, R, D = rng.choice((1, 2)), rng.choice((1, 7, 33, 65)), rng.choice((1, 2, 3)), rng.choice((2, 8, 16, 34, 64))
    Tt = T + rng.choice((0, 0, 3))
    if rng.coin(0.6):
        cos, sin = _sp_lay.rope_tables(Tt, D, rng.choice([10000.0, 500000.0]))
    else:
        cos, sin = rng.f32((Tt, D // 2), "uniform"), rng.f32((Tt, D // 2), "uniform")
    cos, sin = rng.sprinkle(cos, frac(i) / 4), rng.sprinkle(sin, frac(i) / 4)
    x = rng.sprinkle(_mixed_f32(rng, (B, T, R, D)), frac(i))
    return dict(args=(x, cos, sin), outputs=("y" if op == "rope_forward" else "dx",),
                desc=f"B={B} T={T} R={R} D={D} table_T={Tt}")


@gen("swiglu_forward", "swiglu_backward")
def _swiglu(rng, i, op):
    N, F = rng.choice(SIZES), rng.choice(SIZES)
    parts = [rng.f32((N, 2 * F), "normal", 3.0), rng.f32((N, 2 * F), "uniform", lo=-100.0, hi=100.0),
             rng.f32((N, 2 * F), "wide", elo=-30, ehi=30)]
    h = rng.sprinkle(rng.mix((N, 2 * F), parts), frac(i))
    if op == "swiglu_forward":
        return dict(args=(h,), outputs=("out",), desc=f"N={N} F={F}")
    dout = rng.sprinkle(_mixed_f32(rng, (N, F)), frac(i))
    return dict(args=(dout, h), outputs=("dh",), desc=f"N={N} F={F}")


@gen("attention_forward", "attention_backward", "attention_forward_i8")
def _attention(rng, i, op):
    B, T = rng.choice((1, 2)), rng.choice((1, 7, 33, 65, 130))
    G = rng.choice((1, 2))
    H, D = G * rng.choice((1, 2, 3)), rng.choice((1, 2, 7, 16, 32, 64))
    W = rng.choice([0, 0, 1, 7, 64, 65, T, 1 + rng.below(T + 4)])
    scale = rng.choice([float(np.float32(1.0 / math.sqrt(D))), 1.0, 8.0, float(np.float32(rng.uniform(1, 0.01, 2.0)[0]))])
    sin_ = rng.choice((1.0, 1.0, 3.0, 0.1))
    q, k, v = (_bf16_operand(rng, (B, T, n, D), i, sin_) for n in (H, G, G))
    desc = f"B={B} T={T} H={H} G={G} D={D} window={W} scale={scale:.6g}"
    if op == "attention_forward":
        return dict(args=(q, k, v, W, scale), outputs=("o", "lse"), desc=desc)
    if op == "attention_forward_i8":
        q0 = rng.coin(0.25)   # q = +-0: every score 0, every p_j = 1, t_j = s_v[j]: ties of q_p (tie rows)
        v, kinds = _value_rows_i8(rng, v, i, ties=q0)
        if q0:
            q = np.where(rng.ints(q.size, 0, 2).reshape(q.shape) == 1, U16(0x8000), U16(0)).astype(U16)
            desc += " q=0"
        return dict(args=(q, k, v, W, scale), outputs=("o", "lse"), desc=desc + f" v rows: {kinds}")
    o, lse = _sp_att.attention_forward(q, k, v, W, F32(scale))
    dout = _mixed_f32(rng, (B, T, H, D))
    if i % 4 == 3:                      # specials in the forward's outputs too
        o, lse = rng.sprinkle(o, 0.01), rng.sprinkle(lse, 0.01)
    dout = sum_specials(rng, dout, i)
    return dict(args=(dout, q, k, v, o, lse, W, scale), outputs=("dq", "dk", "dv"), desc=desc)


def _value_rows_i8(rng: CaseRNG, v: np.ndarray, i: int, ties: bool = False):
    """§6.10's value rows (each quantized alone, s_v = absmax/127): v (B, T, G, D) bf16 with rows
    (the D values of one key and head) replaced, row by row: tie rows (half-integer multiples of
    2^(e-1), e one of two exponents per case: ties of q_v, and of q_p under equal scores); by case
    index % 4 (not 0) also zero rows (s_v = +0), subnormal rows (flushed: zero rows), tiny rows
    (s_v or the block scale s_p flushes), huge rows, rows with one outlier (most levels 0),
    sometimes every row tiny; and (index % 4 == 2, sometimes 3) one row holding a NaN or infinity
    (s_v NaN: every query that sees it is NaN). ties: mostly tie rows. Returns (v, summary)."""
    B, T, G, D = v.shape
    rows = np.array(v, copy=True).reshape(-1, D)
    n = rows.shape[0]
    kinds = ["plain", "tie", "tie", "tie", "tie"] if ties else ["plain", "plain", "plain", "tie", "tie"]
    if i % 4:
        kinds += ["zero", "subnormal", "tiny", "huge", "outlier"]
    used: dict[str, int] = {}
    all_tiny = i % 4 != 0 and rng.coin(0.1)
    e_tie = rng.choice((-20, -7, 0, 3, 40))
    for r in range(n):
        kind = "tiny" if all_tiny else rng.choice(kinds)
        if kind == "tie":                 # v = k/2 2^e, max |k| = kmax: s_v = div(kmax 2^(e-1), 127)
            e = e_tie - rng.below(2)      # (2^e when kmax = 254: |k| odd is then a tie of q_v). With
            kmax = rng.choice((254, 254, 1 + rng.below(254)))   # equal scores t_j = s_v[j], and a block
            k = rng.ints(D, -kmax, kmax + 1)                     # whose largest t is 2^e gives
            k[rng.below(D)] = rng.choice((kmax, -kmax))          # q_p = kmax/2: ties when kmax is odd
            rows[r] = _bf16_exact((k.astype(np.float64) * 2.0 ** (e - 1)).astype(F32))
        elif kind == "zero":
            rows[r] = np.where(rng.ints(D, 0, 2) == 1, U16(0x8000), U16(0))
        elif kind == "subnormal":
            rows[r] = rng.words(D).astype(U16) & U16(0x807F)
        elif kind == "tiny":              # absmax 2^-126 .. 2^-110: s_v = div(a, 127) flushes below 2^-119
            rows[r] = A.f32_to_bf16(rng.f32((D,), "wide", elo=-126, ehi=-110))
        elif kind == "huge":
            rows[r] = A.f32_to_bf16(rng.f32((D,), "wide", elo=110, ehi=127))
        elif kind == "outlier":
            rows[r, rng.below(D)] = A.f32_to_bf16(np.array([rng.choice((1e3, -1e3, 3e5))], F32))[0]
        used[kind] = used.get(kind, 0) + 1
    if n and ((i % 4 == 2) or (i % 4 == 3 and rng.coin(0.3))):
        rows[rng.below(n), rng.below(D)] = SPECIAL_BF16_NONFINITE[rng.below(len(SPECIAL_BF16_NONFINITE))]
        used["nonfinite"] = 1
    summary = ",".join(f"{k}={c}" for k, c in sorted(used.items()))
    return np.ascontiguousarray(rows.reshape(B, T, G, D)), summary


@gen("xent_forward", "xent_backward")
def _xent(rng, i, op):
    N, C = rng.choice((1, 7, 33)), rng.choice((1, 7, 33, 65))
    V = rng.choice((1, 7, XENT_CHUNK - 1, XENT_CHUNK, XENT_CHUNK + 1, 2 * XENT_CHUNK + 1, 2500))
    s = rng.choice((1.0, 1.0, 4.0, 30.0))
    h = _bf16_operand(rng, (N, C), i, s)
    # a NaN or huge entry in w spoils its logit in every row: w gets tiny specials, rarely one more
    w = rng.sprinkle(rng.bf16((V, C), 1.0), 0.02 if i % 4 else 0.0, SPECIAL_BF16_TINY)
    if i % 4 == 3 and rng.coin(0.25):
        w = rng.sprinkle(w, 1.0 / w.size)
    targets = rng.ints(N, 0, V).astype(I32)
    zcoef = rng.choice([0.0, 1e-4, 0.5, 1.0])
    desc = f"N={N} C={C} V={V} zcoef={zcoef}"
    if op == "xent_forward":
        return dict(args=(h, w, targets, zcoef), outputs=("loss", "lse", "ce"), desc=desc)
    if rng.coin(0.8):
        lse = _sp_xent.xent_forward(h, w, targets, F32(zcoef))[1]
    else:
        lse = rng.f32((N,), "normal", 10.0)
    dloss = (np.full(N, F32(1.0 / N)) if rng.coin(0.5) else rng.f32((N,), "normal", 1.0))
    lse, dloss = sum_specials(rng, lse, i), sum_specials(rng, dloss, i)
    return dict(args=(h, w, targets, zcoef, lse, dloss), outputs=("dh", "dw"), desc=desc)


@gen("adamw_step")
def _adamw(rng, i, op):
    n = rng.choice(SIZES_1D)
    p = rng.sprinkle(rng.bf16((n,), 0.02), frac(i))
    g = rng.sprinkle(_mixed_f32(rng, (n,), rng.choice([1.0, 1e-3, 100.0])), frac(i))
    m = rng.sprinkle(rng.f32((n,), "normal", 0.01), frac(i))
    v = rng.sprinkle(np.abs(rng.f32((n,), "normal", 1e-4)), frac(i))
    kw = dict(lr=rng.choice([0.0, 1e-3, 3e-3, 0.1]), beta1=rng.choice([0.9, 0.8, 0.0]),
              beta2=rng.choice([0.95, 0.999]), eps=rng.choice([1e-8, 1e-6]),
              weight_decay=rng.choice([0.0, 0.1]), step=rng.choice([1, 2, 3, 10, 1000, 100000]))
    return dict(args=(p, g, m, v), kwargs=kw, outputs=("p", "m", "v"), inplace=(0, 2, 3),
                desc=f"n={n} " + " ".join(f"{k}={v}" for k, v in kw.items()))


@gen("adamw")
def _adamw_functional(rng, i, op):
    return _functional(_adamw(rng, i, op), ("p", "m", "v"))


@gen("sumsq_blocks")
def _sumsq(rng, i, op):
    n = rng.choice((1, 7, 130, NORM_BLOCK - 1, NORM_BLOCK, NORM_BLOCK + 1, 2 * NORM_BLOCK + 33))
    x = sum_specials(rng, _mixed_f32(rng, (n,), rng.choice([1.0, 1e-20, 1e18])), i)
    return dict(args=(x,), outputs=("partials",), desc=f"n={n}")


# fold sizes with 3 or more set bits: 3 or more blocks are left on the stack, so the order in which
# they are combined (CONTRACT.md §7: from the bottom up) shows in the bits
ORDER_SENSITIVE = (7, 11, 13, 14, 15, 23, 29, 45, 1000)


def _fold_values(rng: CaseRNG, n: int, i: int) -> np.ndarray:
    """Random signs and significands within a few octaves of each other, so that most adds round,
    and round differently in another association (one value many octaves above the rest would
    absorb them in any order); the special values of sum_specials in three cases of four."""
    x = rng.mix((n,), [rng.f32((n,), "normal", 1.0), rng.f32((n,), "wide", elo=-6, ehi=6)])
    return sum_specials(rng, x, i)


@gen("treefold")
def _treefold(rng, i, op):
    n = rng.choice(ORDER_SENSITIVE) if rng.coin(0.75) else rng.choice((0, 1, 2, 3, 6, 8, 130))
    return dict(args=(_fold_values(rng, n, i),), outputs=("value",), desc=f"n={n}")


@gen("global_norm")
def _global_norm(rng, i, op):
    """In three cases of four, one to three tensors whose NORM_BLOCK partials number an
    order-sensitive count; otherwise a few small tensors. In three cases of four each tensor is
    normal at a scale that puts its partials a few octaves from the others' (their association
    shows in the bits; sum_specials in one tensor in odd cases only, as one NaN, infinity or
    squared extreme normal hides the order); otherwise wide-ranging values, sum_specials in every
    tensor."""
    if rng.coin(0.75):
        left, shapes = rng.choice(ORDER_SENSITIVE[:7]), []
        for _ in range(2):
            if left > 1 and rng.coin(0.5):
                b = 1 + rng.below(left - 1)
                shapes.append(_blocks_shape(rng, b))
                left -= b
        shapes.append(_blocks_shape(rng, left))
    else:
        shapes = [rng.choice([(1,), (7,), (33, 65), (NORM_BLOCK + 1,), (130, 33), (65, 1)])
                  for _ in range(1 + rng.below(4))]
    k = len(shapes)
    if rng.coin(0.75):
        ts = [rng.f32(s, "normal", 2.0 ** (rng.below(5) - 2) / np.sqrt(np.prod(s))) for s in shapes]
        if i % 2:
            j = rng.below(k)
            ts[j] = sum_specials(rng, ts[j], i)
    else:
        ts = [sum_specials(rng, _mixed_f32(rng, s, rng.choice([1.0, 1e-3])), i) for s in shapes]
    return dict(args=(ts,), outputs=("norm",), desc=f"shapes={shapes}")


def _blocks_shape(rng, b: int) -> tuple:
    """A tensor shape of exactly b NORM_BLOCK partials (the last one short, or all full in rows of 64)."""
    return rng.choice([(b * NORM_BLOCK - 1 - rng.below(NORM_BLOCK // 2),), (b * 64, 64)])


@gen("clip_coef")
def _clip_coef(rng, i, op):
    n = rng.choice([7, 33])
    norm = rng.mix((n,), [np.abs(rng.f32((n,), "normal", 3.0)), rng.f32((n,), "wide+", elo=-30, ehi=30)])
    norm = rng.sprinkle(norm, frac(i), np.array([0.0, np.inf, np.nan, 1e-40, 3.4e38, 1.0], F32))
    mx = np.full(n, F32(rng.choice([1.0, 0.5, 2.0, 1e-3])))
    return dict(args=(norm, mx), outputs=("coef",), pairs=True, desc=f"n={n} max_norm={float(mx[0])}")


@gen("philox_blocks")
def _philox(rng, i, op):
    n = rng.choice((1, 7, 33, 130, 1000))
    index0 = rng.choice([0, rng.below(2 ** 32), 2 ** 32 - 3, rng.u64() >> 1])
    kw = dict(seed=rng.u64(), stream=rng.choice([0, 1, 5, 0xFFFF, rng.below(2 ** 32)]), index0=index0,
              n=n, sub=rng.choice([0, 0, 1, rng.below(2 ** 32)]))
    return dict(args=(), kwargs=kw, outputs=("blocks",), desc=" ".join(f"{k}={v}" for k, v in kw.items()))


@gen("trunc_normal")
def _trunc_normal(rng, i, op):
    kw = dict(seed=rng.u64(), stream=rng.choice([1, 0xFFFF, rng.below(2 ** 32)]),
              index0=rng.choice([0, rng.below(2 ** 32), 2 ** 32 - 5, rng.u64() >> 2]),
              n=rng.choice((1, 7, 33, 130, 1000)), sigma=rng.choice([0.02, 1.0, 0.5]))
    return dict(args=(), kwargs=kw, outputs=("x",), desc=" ".join(f"{k}={v}" for k, v in kw.items()))


# ------------------------------------------------------------------------- §6.9 int8 quantized linear
#: the largest exponent of a "tiny" quantization input: absmax < 2^(e+1), so div(absmax, qmax) flushes
_TINY_EHI = {QMAX: -120, QMAX6: -123, QMAX4: -125}
#: contraction lengths around the Hadamard block and SIMD widths (16, 32, 64 int8 lanes)
_Q_LEN = (1, 7, 33, 63, 65, 127, 128, 129, 130, 257, 513, 1000)
#: lengths padded to a multiple of QB (backward's N and M): one block, just over, several
_Q_PADDED = (1, 7, 33, 127, 128, 129, 130, 257)


def _i8(rng: CaseRNG, shape, i: int) -> np.ndarray:
    """int8 in [-QMAX, QMAX] (never -128): uniform levels, small levels, the extremes +-127,
    zeros; by case index % 4 also whole rows (axis 0) and columns of +127, -127 or 0."""
    n = int(np.prod(shape))
    sel = rng.ints(n, 0, 8).reshape(shape)
    a = rng.ints(n, -QMAX, QMAX + 1).reshape(shape)
    a = np.where(sel == 5, rng.ints(n, -2, 3).reshape(shape), a)
    a = np.where(sel == 6, np.where(rng.ints(n, 0, 2).reshape(shape) == 1, QMAX, -QMAX), a)
    a = np.where((sel == 7) & (i % 4 != 0), 0, a).astype(I8)
    if i % 4 and len(shape) == 2 and shape[0] > 1:
        for r in rng.ints(1 + rng.below(3), 0, shape[0]):
            a[r] = rng.choice((QMAX, -QMAX, 0))
    return np.ascontiguousarray(a)


def _bf16_exact(v) -> np.ndarray:
    """fp32 values that are exactly bf16 (as built below) -> their bf16 bits."""
    u = np.asarray(v, F32).view(U32)
    assert not np.any(u & U32(0xFFFF)), "value is not exactly a bf16"
    return (u >> U32(16)).astype(U16)


def _tie_tensor(rng: CaseRNG, shape, bf16: bool, qmax: int = QMAX) -> np.ndarray:
    """A tensor whose per-tensor scale is a power of two 2^e (absmax qmax * 2^e), so that
    mul(v, inv) is exact: half-integer levels (ties to even, +-0.5, +-(qmax - 0.5)), exact levels
    and the extremes +-qmax. bf16 bits if bf16, else fp32 values."""
    n = int(np.prod(shape))
    e = rng.choice((-20, -7, 0, 3, 40))
    k = rng.ints(n, -(2 * qmax - 1), 2 * qmax)           # v = k/2 * 2^e: |k| odd -> a tie
    v = (k.astype(np.float64) * 2.0 ** (e - 1)).astype(F32)
    if n:
        v[rng.below(n)] = F32(rng.choice((float(qmax), -float(qmax))) * 2.0 ** e)
    v = v.reshape(shape)
    return _bf16_exact(v) if bf16 else np.ascontiguousarray(v)


def _quant_tensor_input(rng: CaseRNG, shape, i: int, bf16: bool, layer: bool = False,
                        qmax: int = QMAX) -> np.ndarray:
    """Per-tensor quantization input: ties, ordinary values, the special tensors (all zero, all
    subnormal, so tiny that absmax/qmax flushes, an extreme normal), and (case index % 4 == 2,
    sometimes 3) one NaN or infinity, which makes s NaN and every level 0. layer: the layer's
    activation x, where a zero or NaN s_x zeroes or spoils all of y and dW: those are rarer.
    qmax: the level bound (127, or 31 / 7 for the simulated int6 / int4 paths) the ties and flushes
    aim at."""
    n = int(np.prod(shape))
    kinds = ("tie", "tie", "normal", "normal", "wide", "zero", "subnormal", "tiny", "huge")
    if layer:
        kinds = ("tie", "tie", "tie", "normal", "normal", "normal", "wide", "huge",
                 rng.choice(("zero", "subnormal", "tiny")))
    kind = rng.choice(kinds)
    if kind == "tie":
        x = _tie_tensor(rng, shape, bf16, qmax)
    else:
        if kind == "normal":
            x = rng.f32(shape, "normal", rng.choice((1.0, 0.02, 300.0)))
        elif kind == "wide":
            x = rng.f32(shape, "wide", elo=-60, ehi=60)
        elif kind == "zero":
            x = np.where(rng.ints(n, 0, 2).reshape(shape) == 1, F32(-0.0), F32(0.0)).astype(F32)
        elif kind == "subnormal":
            x = rng.f32(shape, "bits")
            x = (x.view(U32) & U32(0x807FFFFF)).view(F32) if not bf16 else \
                (x.view(U32) & U32(0x807F0000)).view(F32)
        elif kind == "tiny":                              # absmax < 2^-119 (2^-122, 2^-124): absmax/127 (/31, /7) flushes
            x = rng.f32(shape, "wide", elo=-126, ehi=_TINY_EHI[qmax])
        else:                                             # near the largest normal: inv still finite
            x = rng.f32(shape, "wide", elo=100, ehi=127)
        x = np.ascontiguousarray(x.reshape(shape))
        if bf16:
            x = A.f32_to_bf16(x).reshape(shape)
        if kind in ("normal", "wide") and i % 4 == 1:
            x = rng.sprinkle(x, 0.02, SPECIAL_BF16_FINITE if bf16 else SPECIAL_F32_FINITE)
    if n and ((i % 4 == 2 and not (layer and rng.coin(0.5))) or (i % 4 == 3 and rng.coin(0.3))):
        nonfin = SPECIAL_BF16_NONFINITE if bf16 else SPECIAL_F32_NONFINITE
        x = np.array(x, copy=True)
        x.reshape(-1)[rng.below(n)] = nonfin[rng.below(len(nonfin))]
    return np.ascontiguousarray(x)


def _tie_row(rng: CaseRNG, K: int, qmax: int = QMAX) -> np.ndarray | None:
    """A weight row (K a power of two >= 16) whose step size s_w is exactly 2^e, so its levels
    t = mul(W, 1/s_w) are exact: half-integers (ties to even, up to +-(qmax - 0.5); with qmax 7
    also +-7.5, clipped) and a few pieces far beyond qmax (clipped). Built from tie values plus at
    most three bf16 pieces making S = sum |W| an fp32 with mul(div(S, K), coef) == 2^e (every
    partial sum is exact; coef QW_COEF, or QW_COEF6 / QW_COEF4 for qmax 31 / 7). None when no such row comes out
    (checked against the spec's step size)."""
    coef = _sp_q.COEF[qmax]
    e = rng.choice((-12, -5, 0, 4))
    target = F32(2.0 ** e)
    q = F32(float(target) / float(coef))
    cands = [q]
    for d in (np.inf, -np.inf):
        c = q
        for _ in range(3):
            c = np.nextafter(c, F32(d))
            cands.append(c)
    qq = next((c for c in cands if A.mul(c, coef) == target), None)
    if qq is None:
        return None
    S = float(qq) * K                                     # exact: K is a power of two
    nt = K // 8
    k = 2 * rng.ints(nt, -8, 8) + 1                       # odd: t = k/2 in [-7.5, 7.5]
    if nt >= 8:
        k[:2] = [rng.choice((2 * qmax - 1, 2 * qmax - 3)),          # t = +-126.5, +-125.5 (int6: 30.5, 29.5; int4: 6.5, 5.5)
                 rng.choice((-(2 * qmax - 1), -(2 * qmax - 3)))]
    ties = k.astype(np.float64) * 2.0 ** (e - 1)
    rest = S - float(np.abs(ties).sum())
    pieces = []
    while rest > 0 and len(pieces) < 3:                   # rest is exact in fp32: truncate to bf16
        p_ = float((np.array([rest], F32).view(U32) & U32(0xFFFF0000)).view(F32)[0])
        pieces.append(p_)
        rest -= p_
    if rest != 0:
        return None
    row = np.zeros(K, np.float64)
    row[:nt] = ties
    row[nt:nt + len(pieces)] = np.array(pieces) * np.where(rng.ints(len(pieces), 0, 2) == 1, 1.0, -1.0)
    perm = np.argsort(rng.words(K), kind="stable")
    w = _bf16_exact(row[perm].astype(F32))
    return w if _sp_q.weight_scales(w[None], qmax)[0] == target else None


def _weight_rows(rng: CaseRNG, M: int, K: int, i: int, nonfinite: bool = True, qmax: int = QMAX) -> np.ndarray:
    """w (M, K) bf16, row by row: ordinary rows; by case index % 4 (not 0) also zero rows,
    subnormal rows (flushed: zero rows), rows so small s_w flushes to +0, rows with outliers that
    clip, tie rows (s_w a power of two), rows whose sum overflows (NaN step), rows with one NaN or
    infinity (NaN step; with nonfinite only), and sprinkled finite specials. qmax 7 or 31 (the
    simulated int4 / int6 paths): tie rows of its step coefficient, and outliers also just past the
    clip bound."""
    w = rng.bf16((M, K), rng.choice((0.02, 1.0, 0.02, 40.0)))
    if i % 4 == 0:
        return w
    kinds = ["plain", "plain", "zero", "subnormal", "tiny", "clip", "clip", "tie"]
    if nonfinite:
        kinds += ["overflow"] + (["nonfinite"] if i % 4 >= 2 else [])
    if i % 4 == 1:        # extreme normals overflow the backward's G = dy * s_w: only with nonfinite
        w = sum_specials(rng, w, 1) if nonfinite else rng.sprinkle(w, 0.02, SPECIAL_BF16_TINY)
    for j in range(M):
        kind = rng.choice(kinds)
        if kind == "zero":
            w[j] = np.where(rng.ints(K, 0, 2) == 1, U16(0x8000), U16(0))
        elif kind == "subnormal":
            w[j] = rng.words(K).astype(U16) & U16(0x807F)
        elif kind == "tiny":
            w[j] = A.f32_to_bf16(rng.f32((K,), "wide", elo=-126, ehi=-123))
        elif kind == "clip":                              # outliers beyond qmax steps (K >= 24 or so)
            n = 1 + rng.below(max(1, K // 16))
            row = np.abs(A.bf16_to_f32(w[j]).astype(np.float64))
            m = row[np.isfinite(row)].mean() if np.isfinite(row).any() else 1.0
            m = m if 0 < m < 1e30 else 1.0
            f = 1000.0 if qmax == QMAX else rng.choice((12.0, 1000.0))   # int4 / int6: some near the clip bound
            w[j, rng.ints(n, 0, K)] = A.f32_to_bf16((rng.normal(n) * (f * m)).astype(F32))
        elif kind == "tie":
            KK = 1 << (K.bit_length() - 1)                # the largest power of two <= K
            r = _tie_row(rng, KK, qmax) if KK == K and K >= 16 else None
            if r is not None:
                w[j] = r
        elif kind == "overflow" and K >= 2:               # finite weights, their sum is inf
            w[j] = A.f32_to_bf16(rng.f32((K,), "wide", elo=126, ehi=127))
        elif kind == "nonfinite":
            w[j, rng.below(K)] = SPECIAL_BF16_NONFINITE[rng.below(len(SPECIAL_BF16_NONFINITE))]
    return np.ascontiguousarray(w)


def _row_specials(rng: CaseRNG, f: np.ndarray, i: int) -> np.ndarray:
    """fp32 (R, C): by case index % 4: none; finite specials and zero / subnormal / huge rows;
    plus rows holding a NaN or infinity; all kinds sprinkled."""
    f = np.array(f, copy=True)
    k = i % 4
    if k == 0:
        return f
    if k == 3:
        return rng.sprinkle(f, min(0.003, 8.0 / max(1, f.size)))
    f = rng.sprinkle(f, 0.02, SPECIAL_F32_FINITE)
    R, C = f.shape
    for r in rng.ints(1 + rng.below(6), 0, R):
        kind = rng.choice(("zero", "subnormal", "huge", "nonfinite" if k == 2 else "zero"))
        if kind == "zero":
            f[r] = 0.0
        elif kind == "subnormal":
            f[r] = (rng.words(C) & U32(0x807FFFFF)).view(F32)
        elif kind == "huge":                              # butterflies overflow to +-inf
            f[r] = rng.f32((C,), "wide", elo=120, ehi=127)
        else:
            f[r, rng.below(C)] = SPECIAL_F32_NONFINITE[rng.below(len(SPECIAL_F32_NONFINITE))]
    return f


@gen("gemm_i8")
def _gemm_i8(rng, i, op):
    if i % 8 == 7:        # the longest contraction: |acc| up to 2^17 * 127^2 (just below 2^31)
        I, J = rng.choice((1, 2, 3)), rng.choice((1, 2, 5))
        P = rng.choice((Q_MAX_P, Q_MAX_P, Q_MAX_P - 1, Q_MAX_P // 2 + 3))
    else:
        I, J, P = rng.choice(SIZES), rng.choice(SIZES), rng.choice(_Q_LEN + (4097,))
    a, b = _i8(rng, (I, P), i), _i8(rng, (J, P), i)
    if i % 8 == 7:        # whole rows of +-127: the extreme sums, both signs
        a[0], b[0] = QMAX, rng.choice((QMAX, -QMAX))
    return dict(args=(a, b), outputs=("c",), desc=f"I={I} J={J} P={P}")


@gen("hadamard_rows")
def _hadamard(rng, i, op):
    R, C = QB * rng.choice((1, 1, 2, 3, 8)), rng.choice(SIZES)
    if rng.coin(0.25):    # integer matrices (as the backward's q_w, q_x): exact sums
        f = rng.ints(R * C, -QMAX, QMAX + 1).astype(F32).reshape(R, C)
    else:
        f = _mixed_f32(rng, (R, C), rng.choice((1.0, 1e-3, 1e30, 1e-30)))
    f = _row_specials(rng, f, i)
    return dict(args=(np.ascontiguousarray(f),), outputs=("f",), desc=f"R={R} C={C}")


@gen("quant_weight_rows")
def _quant_weight_rows(rng, i, op):
    M, K = rng.choice(SIZES), rng.choice(_Q_LEN + (16, 64, 256, 4097))
    w = _weight_rows(rng, M, K, i)
    return dict(args=(w,), outputs=("q", "s"), desc=f"M={M} K={K}")


@gen("quant_tensor")
def _quant_tensor(rng, i, op):
    shape = rng.choice([(1,), (7,), (1000,), (4097,), (33, 65), (7, 130), (2, 7, 33), (0,), (3, 0)])
    bf16 = rng.coin(0.5)
    x = _quant_tensor_input(rng, shape, i, bf16)
    return dict(args=(x,), outputs=("q", "s"), desc=f"shape={shape} dtype={'bf16' if bf16 else 'fp32'}")


def _op_qmax(op: str) -> int:
    """The level bound of a quantized-layer op: 7 for the simulated int4 path's ops (qlinear4_*,
    run as qlinear_* with qmax=7, parity.backends.VARIANTS), 31 for the int6 path's (qlinear6_*),
    else 127."""
    return QMAX4 if op.startswith("qlinear4_") else QMAX6 if op.startswith("qlinear6_") else QMAX


@gen("qlinear_forward", "qlinear4_forward", "qlinear6_forward")
def _qlinear_forward(rng, i, op):
    qmax = _op_qmax(op)
    N, M = rng.choice(SIZES), rng.choice(SIZES)
    K = rng.choice(_Q_LEN + (16, 64, 128, 256, 4097))      # powers of two: tie rows in w
    if i % 8 == 7 and rng.coin(0.5):                      # the longest contraction over k
        N, M, K = rng.choice((1, 2)), rng.choice((1, 3)), Q_MAX_P
    x = _quant_tensor_input(rng, (N, K), i, True, layer=True, qmax=qmax)
    w = _weight_rows(rng, M, K, i, qmax=qmax)
    return dict(args=(x, w), outputs=("y",), desc=f"N={N} K={K} M={M}")


@gen("qlinear_backward", "qlinear4_backward", "qlinear6_backward")
def _qlinear_backward(rng, i, op):
    qmax = _op_qmax(op)
    N, M, K = rng.choice(_Q_PADDED), rng.choice(_Q_PADDED), rng.choice(SIZES + (128, 129))
    x = _quant_tensor_input(rng, (N, K), i, True, layer=True, qmax=qmax)
    # a NaN or infinity in w or dy makes all of dx NaN: only in some cases
    w = _weight_rows(rng, M, K, i, nonfinite=i % 4 == 3 and rng.coin(0.5), qmax=qmax)
    dy = rng.bf16((N, M), rng.choice((1.0, 1e-3, 30.0)))
    if i % 4 == 1:
        dy = rng.sprinkle(dy, 0.02, SPECIAL_BF16_FINITE)
    elif i % 4 == 2:      # outlier gradients, which the rotation spreads; one rarely non-finite
        dy = rng.sprinkle(dy, 0.01, A.f32_to_bf16(np.array([80.0, -50.0, 1e4], F32)))
        if rng.coin(0.25):
            dy.reshape(-1)[rng.below(dy.size)] = SPECIAL_BF16_NONFINITE[rng.below(len(SPECIAL_BF16_NONFINITE))]
    need_dx, need_dw = rng.choice([(True, True), (True, True), (True, False), (False, True)])
    return dict(args=(dy, x, w), kwargs=dict(need_dx=need_dx, need_dw=need_dw), outputs=("dx", "dw"),
                desc=f"N={N} K={K} M={M} need_dx={need_dx} need_dw={need_dw}")


# ------------------------------------------------------------------------- public
OPS: tuple[str, ...] = tuple(GENERATORS)
#: ops returning host scalars (Python floats): NaNs are compared as NaN, not by payload
SCALAR_OPS = frozenset({"treefold", "global_norm", "clip_coef", "scalar_add", "scalar_sub", "scalar_mul",
                        "scalar_div", "scalar_sqrt"})


def make_case(op: str, index: int, seed: int = 0) -> Case:
    if op not in GENERATORS:
        raise KeyError(f"unknown op {op!r}")
    cs = case_seed(seed, op, index)
    d = GENERATORS[op](CaseRNG(cs), index)
    return Case(op=op, index=index, seed=cs, args=tuple(d.get("args", ())), kwargs=dict(d.get("kwargs", {})),
                outputs=tuple(d["outputs"]), desc=d.get("desc", ""), inplace=d.get("inplace"),
                pairs=bool(d.get("pairs", False)))


def _copy(v: Any):
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(v, list):
        return [_copy(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_copy(x) for x in v)
    return v


def execute(fn, case: Case) -> tuple:
    """Run one case on one backend function (fresh copies of the inputs); returns the raw outputs
    in case.outputs order (arrays of any array library, floats, or None)."""
    args, kwargs = _copy(case.args), _copy(case.kwargs)
    if case.pairs:
        res = np.array([np.float32(fn(*(float(x) for x in xs))) for xs in zip(*args)], F32)
        return (res,)
    res = fn(*args, **kwargs)
    if case.inplace is not None:
        return tuple(args[j] for j in case.inplace)
    if not isinstance(res, tuple):
        res = (res,)
    if len(res) != len(case.outputs):
        raise ValueError(f"{case.op} returned {len(res)} outputs, expected {len(case.outputs)} "
                         f"({', '.join(case.outputs)})")
    return res
