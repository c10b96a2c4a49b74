"""The C reference GEMM's fused path (cpu_ref/src/gemm_fast.c, AVX-512 level, and AVX2 on a CPU with
FMA3): tiles whose packed
operands pass CONTRACT.md §6.1's exponent guard run one vfmadd a step, under the worker's FTZ; the
result must equal the definition (the plain loop, settings(gemm_fast=False)) bit for bit on every
boundary the guard draws, at every SIMD level this machine has."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref import _lib

from helpers import assert_bits_equal

_gemm = _lib.lib.o1b_gemm
_gemm.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + \
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
_gemm.restype = None
_fma_tiles = _lib.lib.o1b_gemm_fma_tiles
_fma_tiles.argtypes = [ctypes.c_int]
_fma_tiles.restype = ctypes.c_int64
_set_fma = _lib.lib.o1b_set_gemm_fma
_set_fma.argtypes = [ctypes.c_int]



def _cpu_has_fma() -> bool:
    """The FMA3 CPUID flag, as /proc/cpuinfo reports it (Linux); elsewhere assumed with AVX2."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "fma" in line.split()
    except OSError:
        pass
    return True


LEVELS = list(range(C.simd_level() + 1))
# The fused path exists on the AVX-512 level, and on the AVX2 level where the CPU has FMA3.
FUSED_LEVELS = {2, 1} if _cpu_has_fma() else {2}
HAS_FUSED = C.simd_level() in FUSED_LEVELS
MR, NR, KC = 12, 32, 512                 # the AVX-512 tile and depth block
I, J, P = 2 * MR + 5, 2 * NR + 7, KC + 37   # edge tiles in both dimensions, a partial depth block


def bf(v: float) -> int:
    b = int(np.array(v, np.float32).view(np.uint32))
    assert b & 0xFFFF == 0, v
    return b >> 16


def gemm(A, B, C0=None, fast=True):
    """C (+)= A B with A (I, P), B (P, J) bf16 row-major; the contract GEMM."""
    I_, P_ = A.shape
    J_ = B.shape[1]
    out = np.zeros((I_, J_), np.float32) if C0 is None else C0.copy()
    args = (I_, J_, P_, A.ctypes.data, P_, 1, B.ctypes.data, J_, 1, out.ctypes.data, J_, int(C0 is not None))
    if fast:                                       # (settings() would also reset the SIMD cap)
        _gemm(*args)
    else:
        with C.settings(gemm_fast=False):
            _gemm(*args)
    return out


def ordinary(rng, shape):
    """bf16 values with exponents near 127, so that their tiles pass the guard."""
    v = rng.uniform(1.0, 2.0, shape) * rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.integers(-3, 4, shape)
    return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


# Sequences of (a, b) products put on one output, each on one side of the guard (CONTRACT.md §6.1):
# name -> (pairs, whether a fused multiply-add of them gives other bits than the contract).
CASES = {
    "tiny product after a normal sum (exponent sum 127)": ([(2.0 ** -100, 2.0 ** -26), (2.0 ** -64, -(2.0 ** -64))], True),
    "a lone tiny negative product (+0 + -0)": ([(2.0 ** -64, -(2.0 ** -64))], True),
    "overflowing product (exponent sum 382)": ([(-3.3895313892515355e38, 1.0), (2.0 ** 64, 2.0 ** 64)], True),
    "product one exponent over the bound (381)": ([(-3.3895313892515355e38, 1.0), (1.5 * 2.0 ** 63, 1.5 * 2.0 ** 64)], True),
    "product at the bound (380), fused": ([(1.5 * 2.0 ** 63, 1.5 * 2.0 ** 63), (-(2.0 ** 127), 1.0)], False),
    "product exactly 2^-126 (128), fused": ([(2.0 ** -63, 2.0 ** -63), (2.0 ** -63, 2.0 ** -63)], False),
    "cancellation to a negative tiny sum, fused": ([(1.5 * 2.0 ** -63, 2.0 ** -63), (-(2.0 ** -62), 2.0 ** -63)], False),
    "cancellation to a positive tiny sum, fused": ([(-1.5 * 2.0 ** -63, 2.0 ** -63), (2.0 ** -62, 2.0 ** -63)], False),
    "signed zeros only": ([(-0.0, 1.0), (0.0, -1.0), (-0.0, -0.0)], False),
    "inf and NaN in the tile": ([(float("inf"), 1.0), (float("nan"), 2.0)], False),
}


def place(rng, pairs, r0, c0, p0):
    A, B = ordinary(rng, (I, P)), ordinary(rng, (P, J))
    # The output (r0, c0) is the case's sequence among products -0 * (b > 0) = -0, which keep a
    # zero's sign: +0 stays +0 (add(+0, -0)) and -0 stays -0.
    A[r0, :] = 0x8000
    B[:, c0] &= 0x7FFF
    p0 = min(p0, P - len(pairs))                   # a sequence placed at the end ends at P - 1
    for k, (a, b) in enumerate(pairs):
        A[r0, p0 + k], B[p0 + k, c0] = bf(a), bf(b)
    return A, B


def fused_model(pairs, c0=0.0):
    """The sequence with one rounding per step and a sign-preserving flush (float64 holds every
    exact product and sum here; an overflow is the fp32 infinity)."""
    acc = np.float64(c0)
    for a, b in pairs:
        s = acc + np.float64(a) * np.float64(b)
        acc = np.float64(np.float32(s)) if abs(s) >= 2.0 ** -126 or s == 0 else np.copysign(0.0, s)
    return np.float32(acc)


def test_cases_have_teeth():
    # Where the case says so, the fused sequence differs from the definition's bits.
    rng = np.random.default_rng(0)
    for name, (pairs, differs) in CASES.items():
        if not differs:
            continue
        A, B = place(rng, pairs, 0, 0, 0)
        want = gemm(A, B, fast=False)[0, 0]
        assert np.float32(want).view(np.uint32) != fused_model(pairs).view(np.uint32), name


@pytest.mark.parametrize("where", [(0, 0, 0), (MR + 3, NR + 1, 5), (2 * MR + 4, 2 * NR + 6, KC + 30),
                                   (MR - 1, 2 * NR, KC - 1), (MR + 1, NR + 2, P - 1)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_guard_cases_equal_the_definition(name, where):
    # The case in a full tile, an inner one, the edge tiles, across the depth block boundary, and
    # ending at the last p (in a packed A panel of the partial depth block, MR x 37 values, the
    # last row of p lies past the whole SIMD vectors that the exponent range reads at a time).
    rng = np.random.default_rng(hash(name) % 2 ** 32)
    A, B = place(rng, CASES[name][0], *where)
    want = gemm(A, B, fast=False)
    C0 = np.where(rng.random((I, J)) < 0.5, np.float32(-0.0), rng.standard_normal((I, J))).astype(np.float32)
    want_acc = gemm(A, B, C0, fast=False)
    for lv in LEVELS:
        with C.settings(simd=lv):
            _fma_tiles(1)
            assert_bits_equal(gemm(A, B), want, f"{name}, level {lv}")
            assert_bits_equal(gemm(A, B, C0), want_acc, f"{name}, accumulate, level {lv}")
            fused = _fma_tiles(1)
        # the ordinary tiles around the case did take the fused path
        assert (fused > 0) == (lv in FUSED_LEVELS), (lv, fused)


@pytest.mark.parametrize("seed", range(3))
def test_exponent_boundaries_across_tiles(seed):
    # Row panels and column panels with exponent fields set so that tiles sit at, just inside and
    # just outside both bounds (min sums 127/128/129, max sums 379/380/381), plus random mantissas
    # and signs; every tile's bits equal the definition's whichever path it takes.
    rng = np.random.default_rng(seed)
    lo_a = rng.choice([63, 64, 65, 120, 127], I // MR + 1)
    hi_a = rng.choice([127, 189, 190, 191], I // MR + 1)
    lo_b = rng.choice([63, 64, 65, 127], J // NR + 1)
    hi_b = rng.choice([127, 189, 190], J // NR + 1)

    def make(shape, lo, hi, axis, panel):
        e = np.empty(shape, np.int64)
        for k in range(shape[axis]):
            sl = (k, slice(None)) if axis == 0 else (slice(None), k)
            e[sl] = rng.integers(lo[k // panel], hi[k // panel] + 1, shape[1 - axis])
            # the panel's extreme exponents appear for certain
            e[sl][0], e[sl][-1] = lo[k // panel], hi[k // panel]
        m = rng.integers(0, 128, shape)
        s = rng.integers(0, 2, shape)
        return ((s << 15) | (e << 7) | m).astype(np.uint16)

    A = make((I, P), lo_a, hi_a, 0, MR)
    B = make((P, J), lo_b, hi_b, 1, NR)
    want = gemm(A, B, fast=False)
    for lv in LEVELS:
        with C.settings(simd=lv):
            assert_bits_equal(gemm(A, B), want, f"seed {seed}, level {lv}")


def test_switch_off_takes_no_fused_tile():
    rng = np.random.default_rng(4)
    A, B = ordinary(rng, (I, P)), ordinary(rng, (P, J))
    want = gemm(A, B, fast=False)
    _set_fma(0)
    try:
        _fma_tiles(1)
        assert_bits_equal(gemm(A, B), want, "fused path off")
        assert _fma_tiles(1) == 0
    finally:
        _set_fma(1)
    assert_bits_equal(gemm(A, B), want, "fused path on")
    assert (_fma_tiles(1) > 0) == HAS_FUSED


# ---- the exponent ranges behind the guard, through every packing ----
# An operand reaches the kernel through one of three packings: each p of a panel a contiguous
# run in memory ("across": dy and x in dW = dy^T x, W in dx = dy W), each row of a panel a
# contiguous run along p ("along": x and W in y = x W^T, dy in dx), or neither ("strided"). The
# AVX-512 level takes a panel's exponent range on the lanes while it packs the first two. The
# number of tiles that take the fused path must be the guard's count over the panels' true
# ranges, whatever the layout, thread count or split.
TILES = {2: (12, 32), 1: (6, 16)}              # (MR, NR) of the levels with a fused path


def laid_out(M, layout):
    """The logical operand M (panel index w, p) as a buffer and its strides (s_w, s_p)."""
    W_, P_ = M.shape
    if layout == "along":
        return np.ascontiguousarray(M), P_, 1
    if layout == "across":
        return np.ascontiguousarray(M.T), 1, W_
    buf = np.zeros((P_, 2 * W_ + 3), np.uint16)          # strided: w 2 apart, p 2 W + 3 apart
    buf[:, 0:2 * W_:2] = M.T
    return buf, 2, 2 * W_ + 3


def panel_ranges(M, R):
    """{(panel, depth slice): (min, max of the nonzero exponent fields, any inf or NaN)}."""
    e = (M.astype(np.int64) >> 7) & 0xFF
    out = {}
    for q in range(-(-M.shape[0] // R)):
        for s in range(-(-M.shape[1] // KC)):
            blk = e[q * R:(q + 1) * R, s * KC:(s + 1) * KC]
            nz = blk[blk != 0]
            out[q, s] = (int(nz.min()) if nz.size else 1000, int(nz.max()) if nz.size else 0,
                         bool((blk == 255).any()))
    return out


def guard_count(A, Bt, mr, nr):
    ra, rb = panel_ranges(A, mr), panel_ranges(Bt, nr)
    return sum(not a[2] and not b[2] and a[0] + b[0] >= 128 and a[1] + b[1] <= 380
               for (qa, sa), a in ra.items() for (qb, sb), b in rb.items() if sa == sb)


def with_outliers(rng, rows, R):
    """bf16 (rows, P) with exponents 120..130, a tenth zeros or subnormals, and in 40% of the
    (panel, slice) blocks one outlier (exponent 1..8 or 251..254, or inf or NaN) at a lane and
    a p where a range taken by whole vectors could miss it: the first and last lanes, lanes 15
    and 16, the first and last p of the slice, p at a multiple of 16 and just before it, and the
    p past the last whole 16."""
    e = rng.integers(120, 131, (rows, P))
    M = ((rng.integers(0, 2, (rows, P)) << 15) | (e << 7) | rng.integers(0, 128, (rows, P))).astype(np.uint16)
    small = rng.random((rows, P)) < 0.1
    M[small] = (rng.integers(0, 2, int(small.sum())) << 15) | rng.integers(0, 128, int(small.sum()))
    for q in range(-(-rows // R)):
        lanes = sorted({q * R + l for l in (0, R - 1, 15, 16, int(rng.integers(R))) if q * R + l < min(rows, (q + 1) * R)})
        for s in range(-(-P // KC)):
            p0, p1 = s * KC, min(P, (s + 1) * KC)
            ps = [p0, p1 - 1, p0 + 15, p0 + 16, p1 - 1 - int(rng.integers((p1 - p0) % 16 or 1)),
                  int(rng.integers(p0, p1))]
            kind = rng.choice(4, p=[0.6, 0.15, 0.15, 0.1])
            if kind == 0:
                continue
            i, p = int(rng.choice(lanes)), int(rng.choice([p for p in ps if p0 <= p < p1]))
            ex = {1: int(rng.integers(1, 9)), 2: int(rng.integers(251, 255)), 3: 255}[int(kind)]
            M[i, p] = (int(M[i, p]) & 0x807F) | (ex << 7) | (0x40 if ex == 255 and rng.random() < 0.5 else 0)
    return M


@pytest.mark.parametrize("b_layout", ["across", "along", "strided"])
@pytest.mark.parametrize("a_layout", ["across", "along", "strided"])
def test_fused_tiles_follow_the_panel_ranges(a_layout, b_layout):
    levels = [lv for lv in LEVELS if lv in FUSED_LEVELS]
    if not levels:
        pytest.skip("no fused path at this machine's SIMD levels")
    for seed in range(3):
        for lv in levels:
            mr, nr = TILES[lv]
            I_, J_ = 5 * mr + 4, 5 * nr + 7            # a last row panel of 4 rows, of 7 columns
            rng = np.random.default_rng(100 * seed + 10 * lv + len(a_layout + b_layout))
            A, Bt = with_outliers(rng, I_, mr), with_outliers(rng, J_, nr)
            (a, sa_w, sa_p), (b, sb_w, sb_p) = laid_out(A, a_layout), laid_out(Bt, b_layout)
            want = guard_count(A, Bt, mr, nr)
            assert 0 < want < (I_ // mr + 1) * (J_ // nr + 1) * 2, want    # both paths occur
            ref = None
            for th in (1, 2, 3):
                out = np.zeros((I_, J_), np.float32)
                args = (I_, J_, P, a.ctypes.data, sa_w, sa_p, b.ctypes.data, sb_p, sb_w, out.ctypes.data, J_, 0)
                with C.settings(simd=lv, threads=th):
                    _fma_tiles(1)
                    _gemm(*args)
                    got = _fma_tiles(1)
                if ref is None:
                    ref = np.zeros_like(out)
                    with C.settings(gemm_fast=False):
                        _gemm(*args[:-3], ref.ctypes.data, J_, 0)
                assert got == want, (seed, lv, th, got, want)
                assert_bits_equal(out, ref, f"seed {seed}, level {lv}, threads {th}")
