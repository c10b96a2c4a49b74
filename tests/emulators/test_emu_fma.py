"""The emulated fused multiply-add instructions (metal/emu/hwfloat.h, the CUDA prelude): __fmaf_rn, the
unit's FMA under its flush mode, and PTX fma.rn.ftz.f32 (contract.cuh's o1b_fma_ftz, the fused step of
the CUDA GEMM), against exact rational arithmetic.

fma.rn.ftz: subnormal inputs read as zeros of their sign, one rounding to nearest even, a result whose
exact value is tiny comes back as the zero of that value's sign in every mode; only an exact value
just below 2^-126 that rounds to 2^-126 depends on the mode (after rounding: 2^-126; before: the zero)
or on the adversary (either). The flush_unsigned fault gives +0 for every tiny result.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlx_open1b.cuda import emu, runtime

pytestmark = pytest.mark.skipif(not emu.compiler_available()[0], reason="the CUDA emulator needs g++")

SRC = r'''
#include "contract.cuh"
extern "C" __global__ void fma_probe(i64 n, const float *a, const float *b, const float *c, float *out) {
    i64 i = o1b_gid();
    if (i >= n) return;
    out[2 * i] = o1b_fma_ftz(a[i], b[i], c[i]);
    out[2 * i + 1] = __fmaf_rn(a[i], b[i], c[i]);
}
'''
MIN = 2.0 ** -126
U32 = np.uint32


def f(bits: int) -> float:
    return float(np.array(bits, U32).view(np.float32))


def inputs():
    """(a, b, c) bits: ordinary triples, tiny results of both signs (exact and inexact), exact zeros,
    subnormal inputs, the round-up-to-2^-126 case of both signs, overflow."""
    rng = np.random.default_rng(5)
    n = 400
    a = (rng.standard_normal(n) * 3).astype(np.float32)
    b = (rng.standard_normal(n) * 3).astype(np.float32)
    c = (rng.standard_normal(n) * 3).astype(np.float32)
    rows = [(x, y, z) for x, y, z in zip(a.view(U32), b.view(U32), c.view(U32))]
    t = (rng.uniform(1, 4, n) * MIN).astype(np.float32)
    rows += [(int(x), 0x3F800000, int(np.float32(-np.float32(y) * np.float32(s)).view(U32)))       # x*1 - s*y: tiny
             for x, y, s in zip(t.view(U32), t.view(U32), rng.choice([0.75, 1.25, 1.5], n))]
    rows += [(0x3F7FFFFF, 0x00800000, 0x00000000), (0xBF7FFFFF, 0x00800000, 0x80000000),   # round up to 2^-126
             (0x3F800000, 0x00800000, 0x80800000), (0x3F800000, 0x80000000, 0x00000000),   # exact zeros
             (0x80000000, 0x3F800000, 0x80000000), (0x00000001, 0x7F000000, 0x00000000),   # subnormal in
             (0x3F800000, 0x3F800000, 0x80400000), (0x7F7FFFFF, 0x40000000, 0x00000000),   # subnormal c; overflow
             (0x20000000, 0x20000000, 0x00000000), (0x1F800000, 0xA0000000, 0x00000000)]   # tiny products
    return [np.array([r[k] for r in rows], U32).view(np.float32) for k in range(3)]


def exact(x: np.float32, y: np.float32, z: np.float32, daz: bool) -> Fraction | None:
    vals = []
    for v in (x, y, z):
        if not np.isfinite(v):
            return None
        if daz and v != 0 and abs(float(v)) < MIN:
            v = np.float32(0.0)
        vals.append(Fraction(float(v)))
    return vals[0] * vals[1] + vals[2]


def rounded(v: Fraction) -> np.float32:
    """The fp32 value nearest to v (ties to even, subnormals as IEEE, overflow to inf at and beyond
    the midpoint 2^128 - 2^103)."""
    if abs(v) >= 2 ** 128 - 2 ** 103:
        return np.float32(np.inf if v > 0 else -np.inf)
    d = np.float32(float(v))
    cands = [np.nextafter(d, np.float32(-np.inf)), d, np.nextafter(d, np.float32(np.inf))]
    return min((w for w in cands if np.isfinite(w)),
               key=lambda w: (abs(Fraction(float(w)) - v), int(w.view(U32)) & 1))


def run(ctx):
    a, b, c = inputs()
    out = np.empty((a.size, 2), np.float32)
    with runtime.emulate(), ctx:
        mod = emu.EmuModule(runtime.read_source_text(SRC, "fma_probe.cu"), name="fma_probe.cu")
        mod.get_function("fma_probe")(((a.size + 127) // 128,), (128,), (np.int64(a.size), a, b, c, out))
    return a, b, c, out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *e):
        return False


def ftz_answers(x, y, z):
    """The set of bits fma.rn.ftz may give: one, or two at the round-up case."""
    v = exact(x, y, z, daz=True)
    if v is None:
        return None
    if v == 0:
        # an exact zero: -0 only as the sum of a -0 product (of flushed operands) and a -0 addend;
        # a nonzero product cancelled by the addend gives +0
        product_zero = abs(float(x)) < MIN or abs(float(y)) < MIN
        neg = product_zero and np.signbit(x) != np.signbit(y) and np.signbit(z) and abs(float(z)) < MIN
        return {0x80000000 if neg else 0}
    r = rounded(v)
    sign = 0x80000000 if v < 0 else 0
    if abs(v) < MIN:
        rb = int(r.view(U32))
        return {sign, rb} if rb & 0x7FFFFFFF == 0x00800000 else {sign}
    return {int(r.view(U32))}


@pytest.mark.parametrize("mode", ["ftz0", "ftz1", "ftz2", "adversarial", "flush_unsigned"])
def test_fma_ftz_model(mode):
    ctx = {"ftz0": emu.options(ftz=0), "ftz1": emu.options(ftz=1), "ftz2": emu.options(ftz=2),
           "adversarial": emu.hardware(adversarial_flush=True, seed=3),
           "flush_unsigned": emu.hardware(fault="flush_unsigned")}[mode]
    a, b, c, out = run(ctx)
    got = out[:, 0].view(U32)
    seen_up = set()
    for k, (x, y, z) in enumerate(zip(a, b, c)):
        want = ftz_answers(x, y, z)
        if want is None:
            continue
        v = exact(x, y, z, daz=True)
        g = int(got[k])
        if len(want) == 2:
            seen_up.add(k)
        if mode == "flush_unsigned" and v != 0 and abs(v) < MIN:
            assert g == 0, (k, hex(g))
            continue
        assert g in want, (mode, k, float(x), float(y), float(z), hex(g), [hex(w) for w in want])
        if len(want) == 2:                      # the round-up case: the mode decides
            if mode in ("ftz0", "ftz1"):
                assert g & 0x7FFFFFFF == 0x00800000, (mode, hex(g))
            if mode == "ftz2":
                assert g & 0x7FFFFFFF == 0, (mode, hex(g))
    assert seen_up, "the inputs hold the round-up case"


def test_fmaf_rn_follows_the_unit_mode():
    """__fmaf_rn: IEEE with gradual underflow under ftz 0, flushed (zero of the result's sign) under
    ftz 1 and 2, one rounding of the exact a*b + c."""
    for ftz in (0, 1, 2):
        a, b, c, out = run(emu.options(ftz=ftz))
        got = out[:, 1].view(U32)
        for k, (x, y, z) in enumerate(zip(a, b, c)):
            v = exact(x, y, z, daz=ftz != 0)
            if v is None or v == 0:
                continue
            r = rounded(v)
            rb = int(r.view(U32))
            if ftz and rb & 0x7F800000 == 0 or ftz == 2 and abs(v) < MIN:
                rb &= 0x80000000
            assert int(got[k]) == rb, (ftz, k, float(x), float(y), float(z), hex(int(got[k])), hex(rb))
