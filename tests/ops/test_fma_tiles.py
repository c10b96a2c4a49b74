"""The CUDA GEMM's FMA tile guard (cuda/linear.cu; CONTRACT.md §6.1, implementation notes) against
the C reference's definition (o1b_gemm, settings(gemm_fast=False)), bit for bit.

Per (block tile, slice of p) the kernel takes the fused path (one fma.rn.ftz per
step) when the exponent fields of the tile's nonzero operands satisfy minA + minB >= 128 and
maxA + maxB <= 380 and none is inf or NaN, else the exact path (o1b_add(acc, o1b_mul(a, b))). The
crafted operands put each case in its own slice of one tile (I, J: two row tiles and two column
tiles, the second ones partial; P: 13 slices and a partial one), on ordinary values
whose products keep every other tile on the fused path:
- a product exactly at 2^-126 (exponent sum 128, fused), just below (sum 127: a product that flushes,
  exact path), cancellation to a tiny sum of either sign (fused: flushed like add's), a product one
  exponent over the overflow bound (sum 381, exact path) and at it (sum 380, fused: the sum overflows),
  signed zeros, bf16 subnormal operands, inf and NaN in one tile only, and the accumulating start
  value.
Each case's target element is one where a fused multiply-add of the wrong kind gives other bits
(checked here on a model of the sequence), and each case's tile also holds a probe element whose
sum cancels to a negative tiny value: under the planted `flush_unsigned` fault the fused path returns
+0 there and the exact path -0, which shows which path each tile took.
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from helpers import assert_bits_equal
from mlx_open1b.cpu_ref import _lib, settings
from mlx_open1b.cuda import emu, ops as cu, runtime

OK, HOW = cu.available()
pytestmark = pytest.mark.skipif(not OK, reason=HOW)
needs_emulator = pytest.mark.skipif(not emu.compiler_available()[0], reason="the CUDA emulator needs g++")

_gemm = _lib.lib.o1b_gemm
_gemm.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + \
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
_gemm.restype = None

TILE, BK = cu.GEMM_TILE, cu.GEMM_SLICE          # linear.cu's block tile and slice of p
I, J, SLICES = TILE + 22, TILE + 12, 13
P = BK * SLICES + 3
BF16_MAX = 0x7F7F
NEG_MAX_F32 = 0xFF7FFFFF


def bf(v: float) -> int:
    b = int(np.array(v, np.float32).view(np.uint32))
    assert b & 0xFFFF == 0, v
    return b >> 16


def val(bits16: int) -> float:
    return float(np.array(bits16 << 16, np.uint32).view(np.float32))


# The cancellation probe: 1.5*2^-126 - 2^-125 = -2^-127, flushed to -0 (exponent sums 128 and 129).
PROBE = [(bf(1.5 * 2.0 ** -63), bf(2.0 ** -63)), (bf(-(2.0 ** -62)), bf(2.0 ** -63))]

# name: (tile (row, column), [one list of (a, b) bf16 pairs per slice], path, C0 bits or None).
# The pairs are one element's products in p order, from the start of its slice; path: "fused" or
# "exact", the path the guard must choose for the case's slices (the last one where several).
CASES = {
    # 1.5*2^-126 - 2^-125 + 2^-126: the tiny sum flushes to -0 before the last product; unflushed,
    # -2^-127 + 2^-126 = 2^-127 would flush to +0 at the store
    "min_normal_cancel_then_add": ((0, 0), [PROBE + [(bf(2.0 ** -63), bf(2.0 ** -63))]], "fused", None),
    # 1.5*2^-126 - 1.25*2^-126 = 2^-128 (positive tiny) -> +0, then -0 products keep +0
    "cancel_positive_tiny": ((0, 1), [[(bf(1.5 * 2.0 ** -63), bf(2.0 ** -63)), (bf(-1.25 * 2.0 ** -63), bf(2.0 ** -63)),
                                       (0x8000, bf(0.5))]], "fused", None),
    # 2^-126, then 2^-63 * -2^-64 = -2^-127: the product flushes to -0 (sum 2^-126); fused: 2^-127 -> 0
    "just_below_min_normal": ((1, 0), [[(bf(2.0 ** -63), bf(2.0 ** -63)), (bf(2.0 ** -63), bf(-(2.0 ** -64)))]], "exact", None),
    # -max, then 1.5*2^64 * 1.5*2^63 = 1.125*2^128 overflows to inf; fused: a finite sum
    "overflow_by_one_exponent": ((1, 1), [[(BF16_MAX, bf(-1.0))], [(bf(1.5 * 2.0 ** 64), bf(1.5 * 2.0 ** 63))]], "exact", None),
    # max * (1 - 2^-8) twice: products below 2^128 (sum 380), their sum overflows to inf on both paths
    "sum_overflows_at_max_bound": ((0, 0), [[(BF16_MAX, 0x3F7F), (BF16_MAX, 0x3F7F)]], "fused", None),
    # exact zero from opposite signs is +0, then -0 products: +0
    "signed_zeros": ((1, 0), [[(bf(0.125), bf(0.125)), (bf(-0.125), bf(0.125)), (0x8000, bf(0.75)), (bf(0.5), 0x8000)]],
                     "fused", None),
    # accumulating from -0: -0 + (-0) products stay -0
    "accumulate_negative_zero": ((0, 1), [[(0x8000, bf(0.5)), (bf(0.25), 0x8000)]], "fused", 0x80000000),
    # accumulating from -max_f32: 1.125*2^128 overflows (exact path); fused would give a finite sum
    "accumulate_overflow": ((1, 1), [[(bf(1.5 * 2.0 ** 64), bf(1.5 * 2.0 ** 63))]], "exact", NEG_MAX_F32),
    # a bf16 subnormal operand is a zero of its sign (§2): -0 * 2^100 adds -0, so +0 stays; on the
    # fused path the instruction's input flush does it, on the exact path the kernel's flush (the
    # exponent sum 127 of the first two steps makes this tile exact)
    "subnormal_operand_fused": ((1, 1), [[(0x8001, bf(2.0 ** 100))]], "fused", None),
    "subnormal_operand_exact": ((1, 0), [[(bf(2.0 ** -63), bf(2.0 ** -63)), (bf(2.0 ** -63), bf(-(2.0 ** -64))),
                                          (0x8001, bf(2.0 ** 100)), (0x807F, bf(2.0 ** 100))]], "exact", None),
    # inf in this tile's slice only (its row tile's other column tile shares the A values)
    "inf_one_tile": ((0, 0), [[(0x7F80, bf(0.5)), (bf(1.0), bf(-1.0))]], "exact", None),
    "nan_one_tile": ((0, 1), [[(bf(1.0), 0x7FC0), (bf(1.0), bf(-1.0))]], "exact", None),
}


def build(seed: int = 0):
    """Logical A (I, P) and B (P, J) bf16 bits, C0 (I, J) float32, and per case its target and probe
    elements (row, column, first slice)."""
    rng = np.random.default_rng(seed)
    # ordinary values: exponent fields 118..126 (2^-9 .. 1), random signs and significands
    e = rng.integers(118, 127, (I, P)).astype(np.uint16)
    A = (rng.integers(0, 2, (I, P)).astype(np.uint16) << 15) | (e << 7) | rng.integers(0, 128, (I, P)).astype(np.uint16)
    e = rng.integers(118, 127, (P, J)).astype(np.uint16)
    B = (rng.integers(0, 2, (P, J)).astype(np.uint16) << 15) | (e << 7) | rng.integers(0, 128, (P, J)).astype(np.uint16)
    C0 = rng.standard_normal((I, J)).astype(np.float32)
    rows, cols = {}, {}      # rows and columns of each row tile and column tile taken so far
    where = {}
    slice0 = 0
    for name, (tile, slices, path, c0) in CASES.items():
        ki, kj = rows.get(tile[0], 0), cols.get(tile[1], 0)
        rows[tile[0]], cols[tile[1]] = ki + 1, kj + 1
        ti, tj = tile[0] * TILE + 2 * ki, tile[1] * TILE + 2 * kj
        for role, (i, j) in (("target", (ti, tj)), ("probe", (ti + 1, tj + 1))):
            # the element sums its planted steps and -0 products, which change no accumulator
            A[i, :] = 0x8000
            B[:, j] &= 0x7FFF
            seqs = slices if role == "target" else [[]] * (len(slices) - 1) + [PROBE]
            for s, seq in enumerate(seqs):
                off = 4 if role == "probe" else 0                 # the probe's p after the target's
                for q, (a, b) in enumerate(seq):
                    A[i, BK * (slice0 + s) + off + q] = a
                    B[BK * (slice0 + s) + off + q, j] = b
        if c0 is not None:
            C0[ti, tj] = np.array(c0, np.uint32).view(np.float32)
        where[name] = (ti, tj, ti + 1, tj + 1, slice0 + len(slices) - 1)
        slice0 += len(slices)
    assert slice0 <= SLICES
    return A, B, C0, where


def reference(A, B, C0, accumulate):
    """The definition (the C reference's plain loop), row-major A and B."""
    (I, P), J = A.shape, B.shape[1]
    C = np.ascontiguousarray(C0.copy())
    Ac, Bc = np.ascontiguousarray(A), np.ascontiguousarray(B)
    with settings(gemm_fast=False):
        _gemm(I, J, P, Ac.ctypes.data, P, 1, Bc.ctypes.data, J, 1, C.ctypes.data, J, int(accumulate))
    return C


# The operand layouts the kernel stages differently: A contiguous along p or along i, B along p or j.
LAYOUTS = {"A_rows_B_rows": (False, False), "A_cols_B_cols": (True, True), "A_rows_B_cols": (False, True)}


def cuda_gemm(A, B, C0, accumulate, layout="A_rows_B_rows"):
    (I, P), J = A.shape, B.shape[1]
    ta, tb = LAYOUTS[layout]
    a = np.ascontiguousarray(A.T if ta else A)
    b = np.ascontiguousarray(B.T if tb else B)
    sa = (1, I) if ta else (P, 1)            # A(i, p) = a[i sa_i + p sa_p]
    sb = (1, P) if tb else (J, 1)            # B(p, j) = b[p sb_p + j sb_j]
    C = cu._dev(np.ascontiguousarray(C0.copy()))
    cu._gemm(I, J, P, cu._dev(a), sa[0], sa[1], cu._dev(b), sb[0], sb[1], C, J, accumulate)
    return cu.to_host(C)


def fused_model(seq, c0: float) -> np.float32:
    """acc + a*b as one rounding per step, tiny sums flushed with their sign (float64 holds every
    sum of these cases exactly)."""
    acc = np.float32(c0)
    for a, b in seq:
        s = np.float64(acc) + np.float64(val(a)) * np.float64(val(b))
        with np.errstate(over="ignore"):
            acc = np.float32(s)
        if 0 < abs(s) < 2.0 ** -126:
            acc = np.float32(np.copysign(0.0, s))
    return acc


def test_cases_have_teeth():
    """Every exact-path case is one where a fused step gives other bits than the definition, and
    every fused-path case one where an unflushed (IEEE) fused step would."""
    A, B, C0, where = build()
    for name, (tile, slices, path, c0) in CASES.items():
        acc = reference(A, B, C0, c0 is not None)
        ti, tj = where[name][:2]
        seq = [p for s in slices for p in s]
        start = float(C0[ti, tj]) if c0 is not None else 0.0
        got = fused_model(seq, start)
        if path == "exact" and "one_tile" not in name:
            assert got.view(np.uint32) != acc[ti, tj].view(np.uint32), name
        if name == "min_normal_cancel_then_add":      # unflushed: -2^-127 + 2^-126 = 2^-127 -> +0
            assert acc[ti, tj] == np.float32(2.0 ** -126), name


@contextlib.contextmanager
def _null():
    yield


def run_all_cases(ctx=_null, layouts=tuple(LAYOUTS)):
    A, B, C0, where = build()
    for accumulate in (False, True):
        want = reference(A, B, C0, accumulate)
        for layout in layouts:
            with ctx():
                got = cuda_gemm(A, B, C0, accumulate, layout)
            assert_bits_equal(got, want, f"{layout} accumulate={accumulate}")
    return where


def test_guard_cases_equal_the_definition():
    """On the backend as loaded (a GPU where there is one, else the emulator)."""
    run_all_cases()


@needs_emulator
@pytest.mark.parametrize("mode", ["ftz0", "ftz1", "ftz2", "adversarial", "race"])
def test_guard_cases_on_every_emulated_unit(mode):
    """The emulator's flush modes (IEEE, tininess after and before rounding), the adversarial flush
    (every tiny result of the exact path's add and mul an IEEE subnormal, +0 or -0 at random; the
    fused step's tininess at 2^-126 either way) and the race check (forward and reverse thread
    orders)."""
    def ctx():
        if mode.startswith("ftz"):
            return emu.options(ftz=int(mode[3]))
        if mode == "race":
            return emu.options(race_check=True)
        return emu.hardware(adversarial_flush=True, seed=12345)
    with runtime.emulate():
        run_all_cases(ctx, ("A_rows_B_rows",) if mode != "race" else tuple(LAYOUTS))


@needs_emulator
def test_each_tile_takes_the_path_the_guard_says():
    """Under the planted flush_unsigned fault (every tiny result +0) the probe element of a fused
    tile gives +0 (its fused step cancels to a negative tiny value), that of an exact tile -0 (the
    contract's add re-signs the flushed zero): the guard's boundaries are where the notes put them
    (exponent sums 128 and 380 fused, 127 and 381, inf and NaN exact)."""
    A, B, C0, where = build()
    want = reference(A, B, C0, False)
    with runtime.emulate(), emu.hardware(fault="flush_unsigned"):
        got = {layout: cuda_gemm(A, B, C0, False, layout) for layout in LAYOUTS}
    for name, (tile, slices, path, c0) in CASES.items():
        pi, pj = where[name][2:4]
        assert want[pi, pj].view(np.uint32) == 0x80000000, name
        for layout, g in got.items():
            fused = g[pi, pj].view(np.uint32) == 0
            assert fused == (path == "fused"), f"{name} ({layout}): the {'fused' if fused else 'exact'} path was taken"


@needs_emulator
@pytest.mark.parametrize("special", [0x7F80, 0xFF80, 0x7FC0], ids=["inf", "-inf", "nan"])
def test_inf_or_nan_alone_sends_the_tile_to_the_exact_path(special):
    """A tile whose exponent sums pass both bounds with its inf or NaN counted as exponent 255
    (maxA + maxB = 255 + 124 <= 380) still takes the exact path: the guard's own inf/NaN clause,
    which the boundary cases above never isolate (their inf and NaN tiles also exceed 380). Row 0
    is the probe (1.5*2^-126 - 2^-125: -0 on the exact path, +0 fused under flush_unsigned); the
    special value sits in row 1 of the same tile. The definition's bits on the plain unit too."""
    P = BK
    A = np.full((2, P), 0x8000, np.uint16)
    A[0, 0], A[0, 1] = bf(1.5 * 2.0 ** -123), bf(-(2.0 ** -122))     # exponent fields 4 and 5
    A[1, 0] = special
    B = np.full((P, 1), bf(2.0 ** -3), np.uint16)                       # exponent field 124
    C0 = np.zeros((2, 1), np.float32)
    want = reference(A, B, C0, False)
    assert want[0, 0].view(np.uint32) == 0x80000000
    with runtime.emulate():
        assert_bits_equal(cuda_gemm(A, B, C0, False), want, "plain unit")
        with emu.hardware(fault="flush_unsigned"):
            got = cuda_gemm(A, B, C0, False)
    assert got[0, 0].view(np.uint32) == 0x80000000, "the fused path was taken"


def mixed_operand(rng, shape):
    """Ordinary values with a sprinkling of zeros, bf16 subnormals, tiny and huge values, inf and NaN:
    some slices fused, some exact."""
    e = rng.integers(118, 127, shape).astype(np.uint16)
    v = (rng.integers(0, 2, shape).astype(np.uint16) << 15) | (e << 7) | rng.integers(0, 128, shape).astype(np.uint16)
    for bits, frac in ((0x0000, 0.05), (0x8000, 0.05), (0x0001, 0.003), (0x8081, 0.003), (bf(2.0 ** -70), 0.002),
                       (bf(2.0 ** 70), 0.002), (0x7F80, 0.0005), (0x7FC0, 0.0005)):
        v[rng.random(shape) < frac] = bits
    return v


@needs_emulator
@pytest.mark.parametrize("shape", [(136, 264, 96), (129, 130, 100)], ids=lambda s: "x".join(map(str, s)))   # I, J, P
def test_layouts_and_vector_loads(shape):
    """Operands whose rows are 16-byte aligned (one 128-bit load per thread and slice) and not (eight
    2-byte loads), in every staging layout, under the race check, against the definition."""
    rng = np.random.default_rng(sum(shape))
    m, n, k = shape
    A, B = mixed_operand(rng, (m, k)), mixed_operand(rng, (k, n))
    C0 = rng.standard_normal((m, n)).astype(np.float32)
    for accumulate in (False, True):
        want = reference(A, B, C0, accumulate)
        for layout in LAYOUTS:
            with runtime.emulate(), emu.options(race_check=True):
                got = cuda_gemm(A, B, C0, accumulate, layout)
            assert_bits_equal(got, want, f"{shape} {layout} accumulate={accumulate}")
