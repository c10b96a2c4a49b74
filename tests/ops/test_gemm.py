"""The fast contract GEMM (cpu_ref/src/gemm_fast.c) against the definition (o1b_gemm_simple).

Every test compares uint32 views: the fast path must give the definition's bits for every
input, every SIMD level the CPU has, and any thread count. The definition is reached with
settings(gemm_fast=False). Also: special values (subnormal inputs, products that underflow or
overflow, inf * 0, NaN), inputs on which an FMA would round differently (proof that no
multiply-add was contracted), and accuracy against a float64 matmul with an argued bound.
"""
from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from helpers import assert_bits_equal, rand_bf16
from mlx_open1b import cpu_ref
from mlx_open1b.cpu_ref import _lib
from mlx_open1b.cpu_ref import settings

U = 2.0 ** -24                      # unit roundoff of fp32
LEVELS = list(range(cpu_ref.simd_level() + 1))   # 0 portable, 1 AVX2, 2 AVX-512 where present
CONFIGS = [(lvl, th) for lvl in LEVELS for th in (1, 2)] + [(LEVELS[-1], 3)]   # 3: uneven split


def bf(v: float) -> int:
    """The bf16 bits of a value that bf16 holds exactly."""
    b = int(np.array(v, np.float32).view(np.uint32))
    assert b & 0xFFFF == 0, v
    return b >> 16


def run_all(x, w, dy):
    y = cpu_ref.linear_forward(x, w)
    dx, dw = cpu_ref.linear_backward(dy, x, w)
    return {"y": y, "dx": dx, "dw": dw}


def reference(x, w, dy):
    with settings(gemm_fast=False):
        return run_all(x, w, dy)


def check_all_configs(x, w, dy, what=""):
    want = reference(x, w, dy)
    for lvl, th in CONFIGS:
        with settings(simd=lvl, threads=th):
            got = run_all(x, w, dy)
        for k in want:
            assert_bits_equal(got[k], want[k], f"{what} {k} simd={lvl} threads={th}")
    return want


# Shapes (N, K, M): degenerate, odd, none a multiple of any tile (MR 12/6, NR 32/16/8, KC 512),
# depth above one KC block, a column-split case (few rows, many columns), and medium ones big
# enough that two threads really split the work (1024 x 512 x 704 is a training shape, shrunk;
# 160 x 704 x 256 and 300 x 700 x 40 have last row panels of 4 rows and split dW and dx by
# columns at two threads, as the small preset's FFN down projection does).
SHAPES = [(1, 1, 1), (1, 7, 1), (3, 1, 5), (37, 53, 19), (13, 600, 33), (65, 97, 129),
          (130, 1030, 41), (1100, 160, 200), (20, 600, 2000), (300, 520, 260), (512, 384, 320),
          (1024, 512, 704), (160, 704, 256), (300, 700, 40)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fast_equals_definition(shape):
    N, K, M = shape
    rng = np.random.default_rng(N * 1_000_003 + K * 1009 + M)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.05), rand_bf16(rng, (N, M))
    check_all_configs(x, w, dy, f"{shape}")


def bf16_of_exponents(rng, shape, lo, hi):
    """Random-signed bf16 with biased exponent in [lo, hi] and random mantissa."""
    e = rng.integers(lo, hi + 1, shape).astype(np.uint16)
    return (rng.integers(0, 2, shape).astype(np.uint16) << 15) | (e << 7) | \
        rng.integers(0, 128, shape).astype(np.uint16)


def special_mix(rng, shape, nonfinite: float = 0.0):
    """A dense mix: ordinary values, bf16 subnormals (10%), +-0 (10%), tiny normals 2^-120..2^-60
    (15%: many products fall below 2^-126 or land near it), huge ones 2^60..2^127 and max finite
    0x7F7F (1% each: products overflow), the smallest normal, and where asked +-inf and NaN
    (quiet and signalling payloads), a fraction `nonfinite` of them, else +-1."""
    kind = rng.choice(8, shape, p=[0.6, 0.1, 0.15, 0.01, 0.1, 0.01, 0.01, 0.02])
    kind[rng.random(shape) < nonfinite] = 8
    pick = lambda *v: rng.choice(np.array(v, np.uint16), shape)  # noqa: E731
    sub = (rng.integers(0, 2, shape).astype(np.uint16) << 15) | rng.integers(0, 128, shape).astype(np.uint16)
    choices = [bf16_of_exponents(rng, shape, 120, 134), sub, bf16_of_exponents(rng, shape, 7, 67),
               bf16_of_exponents(rng, shape, 187, 254), pick(0x0000, 0x8000), pick(0x7F7F, 0xFF7F),
               pick(0x0080, 0x8080), pick(0x3F80, 0xBF80), pick(0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81)]
    return np.choose(kind, choices).astype(np.uint16)


@pytest.mark.parametrize("with_nonfinite", [False, True])
@pytest.mark.parametrize("shape", [(29, 45, 37), (70, 530, 50)], ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else str(s))
def test_special_values(shape, with_nonfinite):
    N, K, M = shape
    rng = np.random.default_rng(7 + N + with_nonfinite)
    nonfinite = 0.3 / max(shape) if with_nonfinite else 0.0   # a few rows and columns
    x, w, dy = (special_mix(rng, s, nonfinite) for s in [(N, K), (M, K), (N, M)])
    want = check_all_configs(x, w, dy, f"specials {shape}")
    for k, v in want.items():               # outputs obey the store rule, and the mix is rich
        u = v.view(np.uint32)
        assert not np.any((u & 0x7F800000 == 0) & (u & 0x7FFFFF != 0)), f"{k}: subnormal stored"
        nan = np.isnan(v)
        assert np.all(u[nan] == 0x7FC00000), f"{k}: NaN not canonical"
        assert nan.any() or np.isinf(v).any(), f"{k}: no overflow in the mix"
        assert (np.isfinite(v) & (v != 0)).any(), f"{k}: mix too poor"


def test_all_negative_zero_products_sum_to_positive_zero():
    """The accumulator starts at +0, so products that are all -0 (or flushed to -0) give +0."""
    neg_tiny = bf(-(2.0 ** -70))
    x = np.full((5, 9), bf(2.0 ** -70), np.uint16)
    x[:, ::2] = 0x8000                                    # -0 * w
    w = np.full((7, 9), neg_tiny, np.uint16)             # 2^-70 * -2^-70 = -2^-140 -> -0
    dy = np.full((5, 7), 0x8001, np.uint16)              # negative subnormal -> -0
    want = check_all_configs(x, w, dy, "signed zeros")
    for k, v in want.items():
        assert np.all(v.view(np.uint32) == 0), k


def crafted(a, b):
    """Layouts that put the sequence sum_p a[p] * b[p] into one element of y, dx and dw
    (p ascending), inside larger matrices of ordinary values so the element sits in the
    middle of a tile. Returns (x, w, dy, positions)."""
    P = len(a)
    rng = np.random.default_rng(P)
    # y[n0, m0] = sum_k x[n0, k] w[m0, k]
    x, w = rand_bf16(rng, (21, P)), rand_bf16(rng, (37, P))
    x[7], w[11] = a, b
    y_case = (x, w, rand_bf16(rng, (21, 37)), ("y", 7, 11))
    # dx[n0, k0] = sum_m dy[n0, m] w[m, k0]
    dy, w2 = rand_bf16(rng, (19, P)), rand_bf16(rng, (P, 45))
    dy[5], w2[:, 30] = a, b
    dx_case = (rand_bf16(rng, (19, 45)), w2, dy, ("dx", 5, 30))
    # dw[m0, k0] = sum_n dy[n, m0] x[n, k0]
    dy3, x3 = rand_bf16(rng, (P, 40)), rand_bf16(rng, (P, 33))
    dy3[:, 25], x3[:, 13] = a, b
    dw_case = (x3, rand_bf16(rng, (40, 33)), dy3, ("dw", 25, 13))
    return [y_case, dx_case, dw_case]


BF16_MAX = float(np.array(0x7F7F0000, np.uint32).view(np.float32))

# With bf16 operands every product is exact in fp32 unless it overflows or falls below 2^-126,
# so a fused multiply-add can differ from mul-then-add only there. Each case below is one where
# it does; the expected value is the contract's (rounded, flushed product, then rounded add).
FMA_CASES = {
    # 2^-126 + (-2^-128): the product flushes to -0, the sum stays 2^-126; an FMA gives
    # 0.75 * 2^-126, subnormal, flushed to 0.
    "tiny_product_near_min_normal": ([2.0 ** -100, 2.0 ** -64], [2.0 ** -26, -(2.0 ** -64)], 0x00800000),
    # +0 + (-2^-128): the product flushes to -0 and +0 + -0 = +0; an FMA gives -2^-128 -> -0.
    "sign_of_zero": ([2.0 ** -64], [-(2.0 ** -64)], 0x00000000),
    # -max + 2^64 * 2^64: the product overflows to inf, so the sum is inf; an FMA adds the exact
    # 2^128 and gives a finite 2^128 - max.
    "overflowing_product": ([BF16_MAX, 2.0 ** 64], [-1.0, 2.0 ** 64], 0x7F800000),
}


@pytest.mark.parametrize("case", list(FMA_CASES))
def test_no_fused_multiply_add(case):
    a, b, want_bits = FMA_CASES[case]
    a16 = np.array([bf(v) for v in a], np.uint16)
    b16 = np.array([bf(v) for v in b], np.uint16)
    # an FMA chain (exact a*b + acc, one rounding, then the flush) would give other bits; float64
    # holds these sums exactly, and none of them is an fp32 rounding case
    fma = 0.0
    for u, v in zip(a, b):
        fma = u * v + fma
        if abs(fma) < 2.0 ** -126:
            fma = np.copysign(0.0, fma)
    assert int(np.array(fma, np.float32).view(np.uint32)) != want_bits
    for x, w, dy, (k, r, c) in crafted(a16, b16):
        want = check_all_configs(x, w, dy, f"fma {case}")
        assert int(want[k].view(np.uint32)[r, c]) == want_bits, (case, k, hex(int(want[k].view(np.uint32)[r, c])))


@pytest.mark.parametrize("shape", [(64, 1500, 48), (200, 256, 96)], ids=lambda s: "x".join(map(str, s)))
def test_accuracy_vs_float64(shape):
    """|y - exact| <= (P - 1) u S per element, S = sum_p |x_p w_p|, u = 2^-24, exact = the float64
    matmul of the same bf16 values. Argument: each product of two bf16 is exact in fp32 (no value
    here is near under- or overflow) and float64 holds the exact sum to far below u S; recursive
    summation of P terms adds P - 1 roundings, each of relative size <= u on a partial sum whose
    magnitude is <= S, so the error is <= (P - 1) u S (to first order; the second-order term is
    < (P u)^2 S, covered by the 1.01 factor)."""
    N, K, M = shape
    rng = np.random.default_rng(N + K)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K)), rand_bf16(rng, (N, M))
    f = lambda a: a.astype(np.uint32).__lshift__(16).view(np.float32).astype(np.float64)  # noqa: E731
    X, W, DY = f(x), f(w), f(dy)
    y = cpu_ref.linear_forward(x, w)
    dx, dw = cpu_ref.linear_backward(dy, x, w)
    for got, exact, S, P in [(y, X @ W.T, np.abs(X) @ np.abs(W).T, K),
                             (dx, DY @ W, np.abs(DY) @ np.abs(W), M),
                             (dw, DY.T @ X, np.abs(DY).T @ np.abs(X), N)]:
        err = np.abs(got.astype(np.float64) - exact)
        bound = 1.01 * (P - 1) * U * S
        assert np.all(err <= bound), float(np.max(err / np.maximum(bound, 1e-300)))
        assert np.max(err / S) > 0          # it is fp32 arithmetic, not something exact


# ---- the entry point itself: arbitrary strides and accumulation (as cross-entropy uses it) ----

_gemm = getattr(_lib.lib, "o1b_gemm", None)
_gemm_fast = getattr(_lib.lib, "o1b_gemm_fast", None)
if _gemm is not None:
    _gemm.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + \
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    _gemm.restype = None
if _gemm_fast is not None:
    _gemm_fast.argtypes = _gemm.argtypes if _gemm is not None else None
    _gemm_fast.restype = ctypes.c_int


@pytest.mark.skipif(_gemm is None or _gemm_fast is None, reason="o1b_gemm is not exported")
@pytest.mark.parametrize("accumulate", [0, 1])
def test_strided_and_accumulate(accumulate):
    rng = np.random.default_rng(11 + accumulate)
    for it in range(12):
        I, J, P = (int(v) for v in rng.integers(1, [60, 80, 700 if it % 3 == 0 else 60]))
        sa = [(P + 2, 1), (1, I + 1), (3 * P + 3, 3)][it % 3]          # A(i,p) = A[i sa_i + p sa_p]
        sb = [(J + 1, 1), (1, P + 3), (2, 2 * P)][(it // 3) % 3]       # B(p,j) = B[p sb_p + j sb_j]
        nonfinite = 0.3 / max(I, J, P) if it % 2 else 0.0
        A = special_mix(rng, ((I - 1) * sa[0] + (P - 1) * sa[1] + 1,), nonfinite)
        B = special_mix(rng, ((P - 1) * sb[0] + (J - 1) * sb[1] + 1,), nonfinite)
        ldc = J + int(rng.integers(0, 3))
        C0 = rng.integers(0, 2 ** 32, (I, ldc), dtype=np.uint64).astype(np.uint32)
        C0[rng.random((I, ldc)) < 0.2] &= 0x807FFFFF                     # subnormal or zero
        C0[rng.random((I, ldc)) < 0.1] = 0x7FC12345                      # NaN with a payload
        C0 = C0.view(np.float32)

        def call(fast, lvl=None, th=1):
            C = C0.copy()
            with settings(gemm_fast=fast, simd=lvl, threads=th):
                _gemm(I, J, P, A.ctypes.data, sa[0], sa[1], B.ctypes.data, sb[0], sb[1],
                      C.ctypes.data, ldc, accumulate)
            return C
        want = call(False)
        assert_bits_equal(want[:, J:], C0[:, J:], "padding columns untouched")
        for lvl, th in CONFIGS:
            assert_bits_equal(call(True, lvl, th), want, f"it {it} I,J,P={I},{J},{P} simd={lvl} th={th}")


@pytest.mark.skipif(_gemm_fast is None, reason="o1b_gemm_fast is not exported")
def test_fast_path_is_taken():
    """o1b_gemm_fast handles ordinary shapes at every level on x86-64 and arm64 (else the tests
    above would compare the definition with itself)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        pytest.skip("no hardware flush mode: the fast path defers to the definition")
    A = np.zeros(6 * 5, np.uint16)
    B = np.zeros(5 * 7, np.uint16)
    C = np.zeros((6, 7), np.float32)
    for lvl in LEVELS:
        with settings(simd=lvl):
            handled = _gemm_fast(6, 7, 5, A.ctypes.data, 5, 1, B.ctypes.data, 7, 1, C.ctypes.data, 7, 0)
        assert handled == 1, lvl
