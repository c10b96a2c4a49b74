"""div by its integer definition (CONTRACT.md §3) equals the IEEE correctly rounded quotient with the
contract's flush rule, bit for bit, over sweeps built to hit every edge: quotients on both sides of
and exactly at 2^-126, divisors above 2^126, quotients that overflow or just fail to, subnormal
operands, near-ties, and every special value. The IEEE side is the C reference's `/` (mathfn.div:
x86-64 divss or the platform's binary32 division) and numpy's float32 division; the integer side is
the C reference's o1b_div_int, the numpy spec's div_int, and the Metal header's o1b_div (the only
division Metal has) run by the emulator."""
import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref import mathfn
from mlx_open1b.cuda import ops as G
from mlx_open1b.metal import ops as M, runtime
from mlx_open1b.spec import arith as A

from helpers import SPECIAL_F32, assert_bits_equal

F32, U32 = np.float32, np.uint32
FLT_MAX = float(np.finfo(F32).max)


def _bits_f32(u) -> np.ndarray:
    return np.asarray(u, np.uint64).astype(U32).view(F32)


def _normals(rng, n, elo=-126, ehi=127) -> np.ndarray:
    """Random-sign normals with exponents in [elo, ehi] and random significands."""
    e = rng.integers(elo + 127, ehi + 128, n, dtype=np.uint64)
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(31)
    return _bits_f32(sign | (e << np.uint64(23)) | rng.integers(0, 2 ** 23, n, dtype=np.uint64))


def _step(x: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """x moved by `steps` ulp (on the magnitude's bit pattern)."""
    return (x.view(np.int32) + steps.astype(np.int32)).view(F32)


def sweep(n: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Operand pairs by class, n pairs per class (name -> (a, b))."""
    rng = np.random.default_rng([0xD1F, seed])
    out = {}
    u = lambda k: _bits_f32(rng.integers(0, 2 ** 32, k))
    out["bit patterns"] = (u(n), u(n))
    out["normals"] = (_normals(rng, n), _normals(rng, n))
    # a/b = 2^-126 exactly (b >= 1 so that a = b 2^-126 is a normal), then b or a moved a few ulp:
    # the quotient just below 2^-126 (flushed even where IEEE rounds it up to 2^-126) or just above
    b = np.abs(_normals(rng, n, 0, 126))
    a = (b.astype(np.float64) * 2.0 ** -126).astype(F32)
    sgn = rng.choice(np.array([1, -1], F32), n)
    out["at 2^-126"] = (a * sgn, b)
    out["b near a 2^126"] = (a * sgn, _step(b, rng.integers(-4, 5, n)))
    out["a near b 2^-126"] = (_step(a, rng.integers(-4, 5, n)) * sgn, b)
    # any a: b = RN(|a| 2^126) moved a few ulp (quotients at the flush boundary from every exponent)
    a = _normals(rng, n, -126, 1)
    with np.errstate(over="ignore"):
        b = (np.abs(a.astype(np.float64)) * 2.0 ** 126).astype(F32)
    out["quotient near 2^-126"] = (a, _step(b, rng.integers(-3, 4, n)))
    # divisors above 2^126 (the hardware's reciprocal of such b is subnormal or flushed)
    out["divisor >= 2^126"] = (_normals(rng, n), _normals(rng, n, 126, 127))
    # quotients near the overflow threshold: b = RN(|a| / FLT_MAX) moved a few ulp (normal b)
    a = _normals(rng, n, 2, 127)
    b = (np.abs(a.astype(np.float64)) / FLT_MAX).astype(F32)
    keep = b >= 2.0 ** -126
    a, b = a[keep], b[keep]
    j = rng.integers(0, 100, 1000).astype(np.float64)                 # and quotients exactly FLT_MAX
    a, b = np.concatenate([a, (FLT_MAX * np.exp2(-j)).astype(F32)]), np.concatenate([b, np.exp2(-j).astype(F32)])
    out["quotient near overflow"] = (a, _step(b, rng.integers(-3, 4, b.size)))
    # subnormal operands (zeros of their sign after the load rule)
    sub = _bits_f32((rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(31)) | rng.integers(1, 2 ** 23, n, dtype=np.uint64))
    out["subnormal a"] = (sub, _normals(rng, n))
    out["subnormal b"] = (_normals(rng, n), sub)
    # the one way an IEEE quotient of normals rounds up to 2^-126 from below: a significand of
    # 2^24 - 1 over a power of two, a/b = 2^-126 (1 - 2^-24), a tie that IEEE rounds to the even
    # 2^-126 and the contract flushes; with neighbours of b
    k = rng.integers(-126, 2, n)
    a = ((1 - 2.0 ** -24) * np.exp2(k.astype(np.float64))).astype(F32) * sgn
    b = np.exp2((k + 126).astype(np.float64)).astype(F32)
    out["(2^24-1) over 2^j"] = (a, np.where(rng.integers(0, 2, n) == 0, b, _step(b, rng.integers(-2, 3, n))))
    out["near-ties, ma >= mb"] = near_ties(rng, n, 23)
    out["near-ties, ma < mb"] = near_ties(rng, n, 24)
    # every pair of special values
    s = np.concatenate([SPECIAL_F32, np.array([FLT_MAX, -FLT_MAX, 2.0 ** -126, 2.0 ** 126, 2.0 ** 127, 0.5,
                                               np.float32(1 - 2 ** -24), np.float32(1 + 2 ** -23)], F32)])
    out["specials"] = (np.repeat(s, s.size), np.tile(s, s.size))
    return out


def near_ties(rng, n: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs whose quotient is as close to a rounding midpoint as 24-bit operands allow, in the
    integer definition's branch s (23: ma >= mb, 24: ma < mb): for an odd significand mb,
    2^(s+1) ma = (2Q + 1) mb + d with d in {-5, -3, -1, 1, 3, 5} (2Q + 1 from the inverse of mb
    modulo 2^(s+1), Q in [2^23, 2^24)), so 2R - mb = d; exponents random, quotients normal."""
    mask = 2 ** (s + 1) - 1
    mb = rng.integers(2 ** 22, 2 ** 23, 8 * n, dtype=np.int64) * 2 + 1
    d = rng.choice(np.array([-5, -3, -1, 1, 3, 5]), 8 * n)
    inv = np.ones_like(mb)
    for _ in range(5):                                  # Newton: inv = mb^-1 mod 2^(s+1) (bits double)
        inv = (inv * (2 - mb * inv)) & mask
    q2 = ((-d * inv) & mask) + (2 ** 24 if s == 23 else 0)         # 2Q + 1
    num = q2 * mb + d
    ma = num >> (s + 1)
    ok = (q2 > 2 ** 24) & (q2 < 2 ** 25) & ((num & mask) == 0) & (ma >= 2 ** 23) & (ma < 2 ** 24)
    ok &= (ma >= mb) if s == 23 else (ma < mb)
    ma, mb = ma[ok][:n], mb[ok][:n]
    e = rng.integers(-40, 40, ma.size)
    a = (ma.astype(np.float64) * np.exp2(e - 23.0)).astype(F32)
    b = (mb.astype(np.float64) * np.exp2(rng.integers(-40, 40, ma.size) - 23.0)).astype(F32)
    return a, b


def _ieee(a, b) -> np.ndarray:
    """numpy's binary32 division with the contract's flush rule decided in float64 (exact)."""
    return A.store(A.div(A.flush(a), A.flush(b)))


@pytest.fixture(scope="module")
def cases():
    return sweep(200_000)


def test_integer_division_equals_ieee_division_with_flush(cases):
    for name, (a, b) in cases.items():
        want = mathfn.div(a, b)                                      # C `/` + the exact tiny check
        assert_bits_equal(want, _ieee(a, b), f"{name}: C div vs numpy")
        assert_bits_equal(C.div_int(a, b), want, f"{name}: C div_int vs C div")
        assert_bits_equal(A.store(A.div_int(a, b)), want, f"{name}: spec div_int vs C div")


def test_sweep_reaches_every_edge(cases):
    """The sweep is not vacuous: each edge it is named for occurs."""
    def q64(a, b):
        fa, fb = A.flush(a).astype(np.float64), A.flush(b).astype(np.float64)
        with np.errstate(all="ignore"):
            return np.abs(fa / fb), np.abs(C.div_int(a, b).astype(np.float64))
    tiny = 2.0 ** -126
    exact, got = q64(*cases["(2^24-1) over 2^j"])
    a, b = cases["(2^24-1) over 2^j"]
    with np.errstate(all="ignore"):
        ieee = np.abs(A.flush(a) / A.flush(b)).astype(np.float64)     # gradual underflow
    assert ((ieee == tiny) & (got == 0)).sum() > 100                 # IEEE rounds up, the contract flushes
    exact, got = q64(*cases["b near a 2^126"])
    assert (got == tiny).sum() > 100 and ((got > tiny) & (got < 2 * tiny)).sum() > 100
    assert ((got == 0) & (exact > 0)).sum() > 100
    exact, got = q64(*cases["at 2^-126"])
    assert (got == tiny).all()
    a, b = cases["quotient near overflow"]
    exact, got = q64(a, b)
    E = _exponent(a, b)
    assert ((exact < FLT_MAX) & (got == FLT_MAX)).sum() > 100            # rounds up to the largest finite
    assert ((exact == FLT_MAX) & (got == FLT_MAX)).sum() > 100           # is it
    # no quotient of 24-bit significands lies strictly between FLT_MAX = (2^24 - 1) 2^104 and 2^128
    # (CONTRACT.md §3: Q never carries to 2^24), so every quotient above FLT_MAX overflows
    assert not ((exact > FLT_MAX) & (exact < 2.0 ** 128)).any()
    assert ((exact >= 2.0 ** 128) & np.isinf(got)).sum() > 100
    assert set(np.unique(E)) == {254, 255}                               # the top binade and overflow
    assert ((E == 254) & (got >= 2.0 ** 127) & (got <= FLT_MAX)).sum() > 100
    assert ((E == 255) & np.isinf(got)).sum() > 100 and (np.isinf(got) == (E == 255)).all()
    exact, got = q64(*cases["divisor >= 2^126"])
    assert ((got > 0) & (got < 2.0 ** -100)).sum() > 100 and ((got == 0) & (exact > 0)).sum() > 100
    for s, name in ((23, "near-ties, ma >= mb"), (24, "near-ties, ma < mb")):
        assert (_branch(*cases[name]) == s).all() and (_remainder_distance(*cases[name]) <= 5).all()


def _exponent(a, b) -> np.ndarray:
    """The integer definition's E = Ea - Eb + 150 - s for normal a, b (the result's biased exponent
    before the flush and overflow tests)."""
    ua, ub = a.view(U32).astype(np.int64), b.view(U32).astype(np.int64)
    return ((ua >> 23) & 0xFF) - ((ub >> 23) & 0xFF) + 150 - _branch(a, b)


def _branch(a, b) -> np.ndarray:
    """s of the integer definition for normal a, b: 24 where ma < mb, else 23."""
    ma, mb = (a.view(U32) & 0x7FFFFF) | 0x800000, (b.view(U32) & 0x7FFFFF) | 0x800000
    return np.where(ma < mb, 24, 23)


def _remainder_distance(a, b) -> np.ndarray:
    """|2R - mb| of the integer definition for normal a, b (0 would be a tie)."""
    ua, ub = a.view(U32).astype(np.int64), b.view(U32).astype(np.int64)
    ma, mb = (ua & 0x7FFFFF) | 0x800000, (ub & 0x7FFFFF) | 0x800000
    s = np.where(ma < mb, 24, 23)
    return np.abs(2 * ((ma << s) % mb) - mb)


@pytest.mark.parametrize("s", [23, 24])
def test_no_quotient_ties(s):
    # CONTRACT.md §3: 2R = mb would need odd(ma) = (2Q + 1) odd(mb) >= 2^24 + 1 > ma. Pairs at
    # distance 1, 3 and 5 from a tie exist in both branches, and still round as IEEE does.
    a, b = near_ties(np.random.default_rng(7 + s), 500_000, s)
    d = _remainder_distance(a, b)
    assert a.size == 500_000 and (_branch(a, b) == s).all()
    assert all((d == k).sum() > 10_000 for k in (1, 3, 5)) and set(np.unique(d)) == {1, 3, 5}
    assert_bits_equal(C.div_int(a, b), mathfn.div(a, b), f"near-ties s={s}")
    assert_bits_equal(A.store(A.div_int(a, b)), mathfn.div(a, b), f"near-ties s={s} (spec)")


# o1b_div's own result, before the store rule could hide a subnormal or a wrong zero
RAW_DIV_SRC = """
uint i = thread_position_in_grid.x;
y[i] = o1b_bits(o1b_div(o1b_load(a[i]), o1b_load(b[i])));
"""


def test_metal_and_cuda_divide_as_cpu_ref(cases):
    """Metal's o1b_div (the emulator runs the header's text) and CUDA's o1b_div_int equal the C
    reference on every class."""
    raw = runtime.get_kernel("test_raw_div", ["a", "b"], ["y"], RAW_DIV_SRC, runtime.header())
    for name, (a, b) in cases.items():
        a, b = a[:50_000], b[:50_000]
        want = C.div_int(a, b)
        (got,) = raw(inputs=[a, b], output_shapes=[a.shape], output_dtypes=[np.uint32], grid=(a.size, 1, 1),
                     threadgroup=(256, 1, 1))
        assert_bits_equal(got.view(F32), want, f"{name}: metal o1b_div")
        assert_bits_equal(M.div_int(a, b), want, f"{name}: metal div_int")
        assert_bits_equal(G.div_int(a, b), want, f"{name}: cuda")


def test_bad_input():
    with pytest.raises(ValueError, match="b: dimension 0 is 2, expected 3"):
        C.div_int(np.zeros(3, F32), np.zeros(2, F32))
    with pytest.raises(ValueError, match="a: expected dtype float32"):
        M.div_int(np.zeros(3, np.float64), np.zeros(3, F32))
