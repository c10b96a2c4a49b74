"""The hardware .ftz steps of cuda/attention.cu (cuda/ftz.cuh; CONTRACT.md §6.6 implementation notes)
against the contract, bit for bit, in every emulated flush mode and under the adversary:

- o1b_exp_ftz, the exponential on hardware steps, equals the contract's o1b_exp for every input kind
  (a random sweep of the range, every input scaled by 2^-126, every binade, the thresholds of its
  branches, special values);
- PTX mul.rn.ftz / add.rn.ftz as emulated (metal/emu/hwfloat.h) against exact rational arithmetic;
- the attention kernels at the edges of their guards, where the fast step would give other bits: a
  score whose exponent sum is 127 (a tiny product the fused step would keep) and 381 (an overflow
  it would not see), the same one exponent inside (the fused path, same bits), and fp32 x bf16 (or
  fp32) products of exponent sum 127 whose exact value lies just below 2^-126 and rounds up to it
  (where the hardware may keep 2^-126 and the contract flushes): in the forward's block product,
  in dq's and dk/dv's dp, and in the dq, dk and dv sums; the backward's scores (dq's and dk/dv's p,
  recomputed under the same score guard) at both edges; and every edge again with its operand staged by
  the block's last warp (a guard folded over fewer warps' keys than staged the tile fails there).
Each attention case fails when its guard's bound is moved by one (checked by planting it)."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from helpers import assert_bits_equal

import mlx_open1b.cpu_ref as ref
from mlx_open1b.cuda import emu, runtime
from mlx_open1b.spec.arith import f32_to_bf16

pytestmark = pytest.mark.skipif(not emu.compiler_available()[0], reason="the CUDA emulator needs g++")

U32 = np.uint32
MIN = 2.0 ** -126
MODES = {"ftz0": lambda: emu.options(ftz=0), "ftz1": lambda: emu.options(ftz=1),
         "ftz2": lambda: emu.options(ftz=2), "adversarial": lambda: emu.hardware(adversarial_flush=True, seed=11)}

SRC = r'''
#include "ftz.cuh"
extern "C" __global__ void ftz_probe(i64 n, const float *a, const float *b, float *out) {
    i64 i = o1b_gid();
    if (i >= n) return;
    out[4 * i] = o1b_exp_ftz(a[i]);
    out[4 * i + 1] = o1b_exp(a[i]);
    out[4 * i + 2] = o1b_mul_ftz(a[i], b[i]);
    out[4 * i + 3] = o1b_add_ftz(a[i], b[i]);
}
'''


def probe(a, b, ctx):
    out = np.empty((a.size, 4), np.float32)
    with runtime.emulate(), ctx:
        mod = emu.EmuModule(runtime.read_source_text(SRC, "ftz_probe.cu"), name="ftz_probe.cu")
        mod.get_function("ftz_probe")(((a.size + 127) // 128,), (128,), (np.int64(a.size), a, b, out))
    return out.view(U32)


def exp_inputs():
    """Normal and zero inputs of every kind o1b_exp branches on (flushed operands: no subnormals)."""
    rng = np.random.default_rng(16)
    xs = [rng.uniform(-104.0, 89.0, 200_000), rng.uniform(-1.0, 1.0, 50_000)]
    binades = 2.0 ** np.arange(-126, 8)                      # every binade |x| from 2^-126 to 2^7
    xs += [binades * m for m in (1.0, 1.5, 1.9999999, -1.0, -1.25, -1.9999999)]
    for edge in (2.0 ** -100, float.fromhex("0x1.62e42ep6"), float.fromhex("0x1.9cp6"), 87.33654, 87.49823, 88.0, 0.34657359, 0.5 / 1.4426950):
        e = np.float32(edge).view(U32)
        near = (e + np.arange(-40, 41)).astype(U32).view(np.float32)
        xs += [near, -near]
    # every input whose result is scaled by 2^-126 (n = -126): p * 2^-126 is tiny for p < 1, and would
    # round up to 2^-126 on the subnormal grid for p = 1 - 2^-24 (never reached: the greatest p < 1 there
    # is 1 - 52 2^-24)
    ln2 = np.log(2.0)
    xs.append(np.arange(np.float32(-125.5 * ln2).view(U32), np.float32(-126.5 * ln2).view(U32) + 1,
                        dtype=U32).view(np.float32))              # negative: the bits grow with |x|
    xs = np.concatenate([np.asarray(x, np.float32) for x in xs]).astype(np.float32)
    xs = xs[(np.abs(xs) >= np.float32(MIN)) | (xs == 0)]
    specials = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
                         0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF], U32).view(np.float32)
    return np.concatenate([xs, specials]).astype(np.float32)


@pytest.mark.parametrize("mode", list(MODES))
def test_exp_ftz_is_the_contract_exp(mode):
    a = exp_inputs()
    got = probe(a, np.ones_like(a), MODES[mode]())
    bad = np.nonzero(got[:, 0] != got[:, 1])[0]
    assert bad.size == 0, [(float(a[k]), hex(got[k, 0]), hex(got[k, 1])) for k in bad[:5]]
    # the C reference's exp too (o1b_exp's equality with it is held elsewhere; here at these inputs)
    want = ref.exp(a).view(U32)
    canon = np.where((want & 0x7FFFFFFF) > 0x7F800000, U32(0x7FC00000), want)
    gotc = np.where((got[:, 0] & 0x7FFFFFFF) > 0x7F800000, U32(0x7FC00000), got[:, 0])
    assert np.array_equal(gotc, canon)


def _exact(x) -> Fraction:
    return Fraction(float(x))


def _round(v: Fraction) -> int:
    """Bits of the fp32 nearest v (ties to even; IEEE subnormals; overflow at 2^128 - 2^103)."""
    if abs(v) >= 2 ** 128 - 2 ** 103:
        return 0x7F800000 | (0x80000000 if v < 0 else 0)
    d = np.float32(float(v))
    cands = [np.nextafter(d, np.float32(-np.inf)), d, np.nextafter(d, np.float32(np.inf))]
    w = min(cands, key=lambda c: (abs(Fraction(float(c)) - v), int(np.float32(c).view(U32)) & 1))
    return int(np.float32(w).view(U32))


def _ftz_answers(v: Fraction, product: bool, zero_sign: int) -> set[int]:
    """What mul.rn.ftz (product) / add.rn.ftz give for the exact result v of flushed operands."""
    if v == 0:
        return {zero_sign}
    sign = 0x80000000 if v < 0 else 0
    if abs(v) < MIN:
        r = _round(v)
        return {sign, r} if product and r & 0x7FFFFFFF == 0x00800000 else {sign}
    return {_round(v)}


def test_mul_add_ftz_model_is_the_ptx_one():
    """Emulated mul.rn.ftz / add.rn.ftz: subnormal inputs read as zeros of their sign, one rounding,
    a tiny result the zero of its sign; only mul's exact value just below 2^-126 that rounds to it
    depends on when tininess is detected (ftz0/1: kept; ftz2: the zero; the adversary: either)."""
    rng = np.random.default_rng(17)
    n = 3000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-70, 70, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-70, 70, n)).astype(np.float32)
    t = (rng.uniform(1, 4, 200) * MIN).astype(np.float32)                         # tiny sums of normals
    ps, vs = int(P_STAR.view(U32)), int(V_STAR.view(U32))                       # the round-up case, both signs
    a = np.concatenate([a, t, np.array([ps, ps | 0x80000000, 0x00000001, 0x80000001, 0, 0x80000000, 0x3F800000],
                                       U32).view(np.float32)])
    b = np.concatenate([b, -(t * np.float32(1.25)).astype(np.float32),
                        np.array([vs, vs, 0x3F800000, 0x3F800000, 0x80000000, 0x80000000,
                                  0x80000000], U32).view(np.float32)])
    for mode, ctx in MODES.items():
        got = probe(a, b, ctx())
        for k, (x, y) in enumerate(zip(a, b)):
            fx = np.copysign(np.float32(0.0), x) if abs(float(x)) < MIN else x   # the input flush
            fy = np.copysign(np.float32(0.0), y) if abs(float(y)) < MIN else y
            sx, sy = int(np.float32(fx).view(U32)) >> 31, int(np.float32(fy).view(U32)) >> 31
            pm = _exact(fx) * _exact(fy)
            want_m = _ftz_answers(pm, True, (sx ^ sy) << 31)
            want_a = _ftz_answers(_exact(fx) + _exact(fy), False, (sx & sy) << 31)
            assert int(got[k, 2]) in want_m, (mode, float(x), float(y), hex(got[k, 2]))
            assert int(got[k, 3]) in want_a, (mode, float(x), float(y), hex(got[k, 3]))
            if len(want_m) == 2 and mode != "adversarial":
                assert (int(got[k, 2]) & 0x7FFFFFFF == 0) == (mode == "ftz2"), (mode, hex(got[k, 2]))
    assert any(len(_ftz_answers(_exact(x) * _exact(y), True, 0)) == 2 for x, y in zip(a[-7:-5], b[-7:-5]))


# ------------------------------------------------------------------ the kernels at their guards' edges
def bf(*vals):
    return f32_to_bf16(np.array(vals, np.float32))


P_STAR = np.float32(16647160 * 2.0 ** -24)          # 24 significant bits, exponent field 126
V_STAR = np.float32(129 / 128 * MIN)                # a bf16 value of exponent field 1
# P_STAR * V_STAR = 2^-126 (1 - 2^-28): below 2^-126, rounds up to it: the exponent sum is 127


def x_star() -> np.float32:
    """A score difference x whose contract exp(x) is P_STAR."""
    x0 = np.float32(np.log(np.float64(P_STAR)))
    xs = (x0.view(U32) + np.arange(-2000, 2000)).astype(U32).view(np.float32)
    return xs[np.nonzero(ref.exp(xs) == P_STAR)[0][0]]


def bf16_pieces(x: np.float32) -> list[float]:
    """Three bf16 values whose sum, from +0 left to right, is x exactly (the top, middle and low 8
    significant bits)."""
    out, rest = [], np.float32(x)
    for _ in range(3):
        top = np.uint32(rest.view(U32) & U32(0xFFFF0000)).view(np.float32)
        out.append(float(top))
        rest = np.float32(rest - top)
    assert rest == 0 and np.float32(np.float32(np.float32(out[0]) + np.float32(out[1])) + np.float32(out[2])) == x
    return out


def cases():
    D = 8
    z = [0.0] * D
    xs = x_star()
    a, b, c = bf16_pieces(xs)
    big = 1.5 * 2.0 ** 64
    out = {}
    # score guard, lo: q0 (exponents 64, 63) against k0 (64, 64): sum 127, 2^-63 2^-63 - 2^-64 2^-63 is
    # 2^-126 in the contract (the tiny product flushes), 0 in a fused step; row 0's lse is its score
    out["score lo 127"] = dict(T=2, W=0, q=[[2.0 ** -63, 2.0 ** -64] + z[2:], [1.0] + z[1:]],
                               k=[[2.0 ** -63, -(2.0 ** -63)] + z[2:], [1.0] + z[1:]], v=[[1.0] + z[1:]] * 2)
    out["score lo 128"] = dict(T=2, W=0, q=[[2.0 ** -62, 2.0 ** -63] + z[2:], [1.0] + z[1:]],
                               k=[[2.0 ** -63, -(2.0 ** -63)] + z[2:], [1.0] + z[1:]], v=[[1.0] + z[1:]] * 2)
    # score guard, hi: q1 (191) against k (190, 127): sum 381; the first product overflows to -inf, the
    # second to +inf: NaN in the contract (row 1 NaN), -inf in a fused step (row 1 finite)
    out["score hi 381"] = dict(T=2, W=0, q=[[1.0] + z[1:], [-big, big] + z[2:]],
                               k=[[1.0] + z[1:], [big / 2, big / 2] + z[2:]], v=[[1.0] + z[1:], [2.0] + z[1:]])
    out["score hi 380"] = dict(T=2, W=0, q=[[1.0] + z[1:], [-big / 2, big / 2] + z[2:]],
                               k=[[1.0] + z[1:], [big / 2, big / 2] + z[2:]], v=[[1.0] + z[1:], [2.0] + z[1:]])
    # the forward's block product: row 1 sees key 0 (score 0, p = 1, v = 2^-110) and key 1 (score x*,
    # p = P_STAR, v = V_STAR): the second term is tiny in the contract (pv = 2^-110), 2^-126 where a
    # hardware multiply detects tininess after rounding
    out["pv band"] = dict(T=2, W=0, q=[z, [a, b, c] + z[3:]], k=[z, [1.0, 1.0, 1.0] + z[3:]],
                          v=[[2.0 ** -110] + z[1:], [float(V_STAR)] + z[1:]])
    return out


def backward_cases():
    """(q, k, v, dout, o, lse, scale) by name, of one row and key (T = 1, D = 8): the products of
    exponent sum 127 around P_STAR x V_STAR, and the scores of the forward's cases, whose p the
    backward computes again from lse (an input: chosen here so that the score's bits reach p)."""
    D = 8
    z = [0.0] * D
    xs = float(x_star())
    vs = float(V_STAR)
    out = {}
    # p = exp(sub(0, -x*)) = P_STAR, dp = 0, Di = -1: ds = P_STAR; dq = ds k, dk = ds q, dv = p dout each
    # meet P_STAR x V_STAR in column 0 (the score q k is tiny: +0)
    out["dq dk dv sums band"] = (bf(vs, *z[1:]), bf(vs, *z[1:]), bf(*z), np.array([vs, 1.0] + z[2:], np.float32),
                                 np.array([0.0, -1.0] + z[2:], np.float32), np.float32(-xs), 1.0)
    # dp = dot(dout, v) = P_STAR V_STAR + 1 2^-110 (the first term tiny in the contract), p = 1, Di = 0:
    # ds = dp reaches dq[1] (k = e1) and dk[2] (q = e2); dk/dv's dp is the same sum (the exponent
    # sums: dout's least 126, v's 1)
    out["dp band"] = (bf(0.0, 0.0, 1.0, *z[3:]), bf(0.0, 1.0, *z[2:]), bf(vs, 2.0 ** -110, *z[2:]),
                      np.array([float(P_STAR), 1.0] + z[2:], np.float32), np.zeros(D, np.float32),
                      np.float32(0.0), 1.0)
    # the score guard of dq's p and dk/dv's p (§6.1's, the row against the staged tile): the forward's
    # score cases with lse = 0, v = dout = e1, o = 0 (Di = 0, dp = 1: ds = p reaches dq and dk, p
    # reaches dv). Exponent sum 127: the score is 2^-126 in the contract, +0 in a fused step; the scale
    # 2^120 makes that 2^-6 against 0, so p = exp(2^-6) against 1. Sum 381: p NaN against 0.
    big = 1.5 * 2.0 ** 64
    e1 = [1.0] + z[1:]
    for name, qr, kr, scale in (("score lo 127", [2.0 ** -63, 2.0 ** -64], [2.0 ** -63, -(2.0 ** -63)], 2.0 ** 120),
                                ("score lo 128", [2.0 ** -62, 2.0 ** -63], [2.0 ** -63, -(2.0 ** -63)], 2.0 ** 120),
                                ("score hi 381", [-big, big], [big / 2, big / 2], 1.0),
                                ("score hi 380", [-big / 2, big / 2], [big / 2, big / 2], 1.0)):
        out[name] = (bf(*qr, *z[2:]), bf(*kr, *z[2:]), bf(*e1), np.array(e1, np.float32), np.zeros(D, np.float32),
                     np.float32(0.0), scale)
    return out


def _cuda():
    from mlx_open1b.cuda import ops
    ok, why = ops.available()
    if not ok:
        pytest.skip(why)
    return ops


def check_case(ops, q, k, v, W, scale, what, dout=None):
    T, D = q.shape[1], q.shape[3]
    o, lse = ref.attention_forward(q, k, v, W, scale)
    for got, want, name in zip(ops.attention_forward(q, k, v, W, scale), (o, lse), ("o", "lse")):
        assert_bits_equal(got, want, f"{what} {name}")
    if dout is None:
        dout = np.full((1, T, 1, D), 0.5, np.float32)
    for got, want, name in zip(ops.attention_backward(dout, q, k, v, o, lse, W, scale),
                               ref.attention_backward(dout, q, k, v, o, lse, W, scale), ("dq", "dk", "dv")):
        assert_bits_equal(got, want, f"{what} {name}")


@pytest.mark.parametrize("mode", list(MODES))
def test_forward_guard_edges(mode):
    ops = _cuda()
    for name, c in cases().items():
        T, W = c["T"], c["W"]
        q, k, v = (bf(*np.ravel(c[x])).reshape(1, T, 1, -1) for x in ("q", "k", "v"))
        with MODES[mode]():
            check_case(ops, q, k, v, W, 1.0, f"{name} [{mode}]")
    # the constructions do what they say: the contract's bits differ from a fused/unflushed step's
    c = cases()
    o, lse = ref.attention_forward(*(bf(*np.ravel(c["score lo 127"][x])).reshape(1, 2, 1, -1) for x in "qkv"), 0, 1.0)
    assert lse[0, 0, 0] == np.float32(MIN)
    o, lse = ref.attention_forward(*(bf(*np.ravel(c["score hi 381"][x])).reshape(1, 2, 1, -1) for x in "qkv"), 0, 1.0)
    assert np.isnan(lse[0, 0, 1]) and not np.isnan(lse[0, 0, 0])
    o, lse = ref.attention_forward(*(bf(*np.ravel(c["pv band"][x])).reshape(1, 2, 1, -1) for x in "qkv"), 0, 1.0)
    l = np.float32(1.0) + P_STAR
    assert o[0, 1, 0, 0] == np.float32(np.float32(2.0 ** -110) * np.float32(np.float32(1.0) / l))


@pytest.mark.parametrize("mode", list(MODES))
def test_backward_guard_edges(mode):
    ops = _cuda()
    for name, (q, k, v, dout, o, lse, scale) in backward_cases().items():
        q, k, v = (x.reshape(1, 1, 1, -1) for x in (q, k, v))
        dout, o = dout.reshape(1, 1, 1, -1), o.reshape(1, 1, 1, -1)
        lse = np.array(lse, np.float32).reshape(1, 1, 1)
        with MODES[mode]():
            for got, want, what in zip(ops.attention_backward(dout, q, k, v, o, lse, 0, scale),
                                       ref.attention_backward(dout, q, k, v, o, lse, 0, scale), ("dq", "dk", "dv")):
                assert_bits_equal(got, want, f"{name} [{mode}] {what}")
    # the band products are flushed in the contract and visible where they are not
    q, k, v, dout, o, lse, _ = backward_cases()["dq dk dv sums band"]
    dq, dk, dv = ref.attention_backward(dout.reshape(1, 1, 1, -1), q.reshape(1, 1, 1, -1), k.reshape(1, 1, 1, -1),
                                        v.reshape(1, 1, 1, -1), o.reshape(1, 1, 1, -1),
                                        np.array(lse, np.float32).reshape(1, 1, 1), 0, 1.0)
    assert dq.reshape(-1)[0] == 0 and dk.reshape(-1)[0] == 0 and dv.reshape(-1)[0] == 0
    # the scores reach p: a fused step's score (+0, -inf) would give p = 1 or 0 where the contract's
    # gives exp(2^-6) and NaN (dv = p)
    for name, want in (("score lo 127", lambda p: p != 1.0), ("score hi 381", np.isnan)):
        q, k, v, dout, o, lse, scale = backward_cases()[name]
        _, _, dv = ref.attention_backward(dout.reshape(1, 1, 1, -1), q.reshape(1, 1, 1, -1), k.reshape(1, 1, 1, -1),
                                          v.reshape(1, 1, 1, -1), o.reshape(1, 1, 1, -1),
                                          np.array(lse, np.float32).reshape(1, 1, 1), 0, scale)
        assert want(dv.reshape(-1)[0]), (name, dv.reshape(-1)[0])


# Rows of zeros put before a case so that its operands at a guard's edge are staged by the last warp of
# the block (D = 8: key or query 28 is staged by threads 224..231, warp 3 of the forward's 4 as the
# forward stages a sub-tile 128 elements at a time, warp 7 of the backward's 8). A window keeps each
# shifted row's visible keys those of the case: 1 where the case reads its first row alone (whose only
# key is its own), else 2 (a case's second row sees both its keys).
SHIFT = 28
FIRST_ROW_ONLY = ("score lo 127", "score lo 128")


@pytest.mark.parametrize("mode", ["ftz1", "adversarial"])
def test_guard_keys_of_every_warp(mode):
    """The guards' keys are folded over every warp that staged the tile: the edge cases above again
    with their edge operands staged by the block's last warp (a guard read from fewer warps' keys
    takes the fast step there and gives other bits)."""
    ops = _cuda()
    for name, c in cases().items():
        T, W = c["T"] + SHIFT, 1 if name in FIRST_ROW_ONLY else 2
        q, k, v = (np.concatenate([np.zeros((SHIFT, 8), np.float32), np.array(c[x], np.float32)]) for x in "qkv")
        q, k, v = (bf(*np.ravel(x)).reshape(1, T, 1, -1) for x in (q, k, v))
        with MODES[mode]():
            check_case(ops, q, k, v, W, 1.0, f"{name} shifted [{mode}]")
    for name, case in backward_cases().items():
        q, k, v, dout, o = (np.concatenate([np.zeros((SHIFT, 8), x.dtype), x.reshape(1, -1)])
                            .reshape(1, SHIFT + 1, 1, -1) for x in case[:5])
        lse = np.concatenate([np.zeros(SHIFT, np.float32), [case[5]]]).astype(np.float32).reshape(1, 1, -1)
        with MODES[mode]():
            for got, want, what in zip(ops.attention_backward(dout, q, k, v, o, lse, 1, case[6]),
                                       ref.attention_backward(dout, q, k, v, o, lse, 1, case[6]), ("dq", "dk", "dv")):
                assert_bits_equal(got, want, f"{name} shifted [{mode}] {what}")
