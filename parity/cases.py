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

from ..contract import NORM_BLOCK, STREAM_TESTS, XENT_CHUNK
from ..spec import arith as A
from ..spec import attention as _sp_att
from ..spec import layers as _sp_lay
from ..spec import xent as _sp_xent
from ..spec.optim import philox_block

F32, U16, U32, I32 = np.float32, np.uint16, np.uint32, np.int32

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


@gen("attention_forward", "attention_backward")
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
    o, lse = _sp_att.attention_forward(q, k, v, W, F32(scale))
    dout = _mixed_f32(rng, (B, T, H, D))
    if i % 4 == 3:                      # specials in the forward's outputs too
        o, lse = rng.sprinkle(o, 0.01), rng.sprinkle(lse, 0.01)
    dout = sum_specials(rng, dout, i)
    return dict(args=(dout, q, k, v, o, lse, W, scale), outputs=("dq", "dk", "dv"), desc=desc)


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


@gen("sumsq_blocks")
def _sumsq(rng, i, op):
    n = rng.choice((1, 7, 130, NORM_BLOCK - 1, NORM_BLOCK, NORM_BLOCK + 1, 2 * NORM_BLOCK + 33))
    x = sum_specials(rng, _mixed_f32(rng, (n,), rng.choice([1.0, 1e-20, 1e18])), i)
    return dict(args=(x,), outputs=("partials",), desc=f"n={n}")


def _fold_values(rng: CaseRNG, n: int, i: int) -> np.ndarray:
    x = rng.mix((n,), [rng.f32((n,), "normal", 1.0), rng.f32((n,), "wide", elo=-30, ehi=30)])
    return sum_specials(rng, x, i)


@gen("treefold")
def _treefold(rng, i, op):
    n = rng.choice((0, 1, 2, 3, 5, 6, 7, 8, 33, 130, 1000))
    return dict(args=(_fold_values(rng, n, i),), outputs=("value",), desc=f"n={n}")


@gen("global_norm")
def _global_norm(rng, i, op):
    shapes = [rng.choice([(1,), (7,), (33, 65), (NORM_BLOCK + 1,), (130, 33), (65, 1)]) for _ in range(1 + rng.below(4))]
    ts = [sum_specials(rng, _mixed_f32(rng, s, rng.choice([1.0, 1e-3])), i) for s in shapes]
    return dict(args=(ts,), outputs=("norm",), desc=f"shapes={shapes}")


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
