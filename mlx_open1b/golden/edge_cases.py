"""Deterministic cases at the edges real hardware gets wrong (the golden set's `edge` cases).

The seeded parity cases (parity/cases.py) sprinkle special values at random; these place them
where a GPU's fp32 unit, compiler or conversion instructions part from the contract (CONTRACT.md
§1-§4, §6.9), so that a first contact with a device meets every known way of failing:

- tininess: mul and div results just below, exactly at and just above 2^-126 (x86 FTZ and IEEE
  gradual underflow round the exact value 2^-126 (1 - 2^-24) up to 2^-126, the contract flushes
  it), negative tiny results (-0, not +0), subnormal inputs and results of every primitive;
- division: divisors above 2^126, quotients that overflow or round up to infinity, inexact
  quotients that round up (a quotient rounded toward zero differs), sigmoid's 1/(1 + e^-x) where
  the divisor passes 2^126;
- contraction: linear-layer sums and exp arguments where fma(a, b, c) differs from
  add(mul(a, b), c) (the GEMM rows of CONTRACT.md §6.1's table; exp inputs found by search, the
  Horner steps of §4 fused, or only its argument reduction);
- conversions: round-to-nearest-even ties of fp32 -> bf16, of sums and products, of the int8
  accumulator's i2f (2^24 + 1, 2^24 + 3, 2^25 + 2, ... through the int8 layer's dequantization;
  2^31 - 1 itself is out of reach: |acc| <= 127^2 * 2^17 < 2^31 - 1 for every valid GEMM), and
  int8 rounding ties of the per-tensor quantization; the int8 backward's accumulators at that
  bound, +-127^2 * 2^17 (an accumulator of fewer than 32 bits, or of fp32, differs);
- shapes: a 7x5x9 GEMM, an attention row across a 64-key block boundary (plain and sliding
  window), a cross-entropy row across an XENT_CHUNK boundary.

Each case is a parity.cases.Case built from exact constants and, where values are random,
Philox words on the test stream (CaseRNG), so its inputs have the same bits on every machine
(the golden file records their hash). `edge_cases()` lists them in a fixed order.
"""
from __future__ import annotations

import functools

import numpy as np

from ..contract import Q_MAX_P, QB, XENT_CHUNK
from ..parity.cases import Case, CaseRNG, case_seed
from ..spec import arith as A
from ..spec import attention as _sp_att
from ..spec import quant as _sp_q
from ..spec import xent as _sp_xent

F32, U16, U32, I32 = np.float32, np.uint16, np.uint32, np.int32
#: the smallest normal, 2^-126
TINY = 2.0 ** -126
#: exp inputs where the Horner steps of CONTRACT.md §4's exp, computed as fused multiply-adds,
#: give another result (found by a search over [-20, 20]; tests/backends/test_golden.py re-checks each one
#: against an exact fused model)
EXP_FMA_CANARY_BITS = (0xC19F47AE, 0xC18C7AE1, 0xC16A147B, 0xC13FD70A, 0xC115EB85, 0xC0CE6666, 0xC0733333,
                       0xBFE147AE, 0x3E8F5C29, 0x401EB852, 0x40A5C28F, 0x40EC7AE1, 0x4110CCCD, 0x41375C29,
                       0x415A8F5C, 0x41826666, 0x419947AE)
#: exp inputs where fusing only the argument reduction (nf = fma(x, log2(e), MAGIC) - MAGIC and
#: r = fma(-nf, c2, fma(-nf, c1, x)), the Horner steps unfused) gives another result: a compiler
#: that contracts only there passes the canaries above on some inputs (found by a search of 48M
#: random inputs in [-87, 88], where about one in 800,000 differs; the first eight round nf the
#: other way, the rest differ in r; tests/backends/test_golden.py re-checks each against an exact model)
EXP_REDUCTION_CANARY_BITS = (0xC2A2E3BC, 0xC26A48A4, 0xC240B1E6, 0xC1CFF1B4, 0x40D2B77C, 0x416E7150, 0x4227BDDB,
                             0x4283013C, 0xC2A4F9CA, 0xC291934F, 0xC2662699, 0xC247A803, 0xC20515EE, 0x41C79AC5,
                             0x42479B27, 0x426627AC, 0x42918BD1)
#: the int8 layer's accumulators: ties of i2f at three scales (to the even neighbour, down and up),
#: values that round, and the same negated
I2F_TARGETS = (2 ** 24 + 1, 2 ** 24 + 3, 2 ** 25 + 2, 2 ** 25 + 6, 2 ** 26 + 4, 2 ** 26 + 12, 2 ** 26 + 5,
               -(2 ** 24 + 1), -(2 ** 25 + 6), 88_000_001)


def _f(*v) -> np.ndarray:
    """fp32 array of exactly representable values (Python floats or ints)."""
    out = np.array(v, np.float64).astype(F32)
    assert np.array_equal(out.astype(np.float64), np.array(v, np.float64), equal_nan=True), v
    return out


def _bits(*u) -> np.ndarray:
    return np.array(u, U32).view(F32)


def _bf16(v) -> np.ndarray:
    """fp32 values that are exact in bf16 -> their bf16 bits."""
    u = np.asarray(v, F32).view(U32)
    assert not np.any(u & U32(0xFFFF)), "value is not exactly a bf16"
    return (u >> U32(16)).astype(U16)


def _pairs(rows) -> tuple[np.ndarray, np.ndarray]:
    """[(a, b), ...] of values as _val takes them -> the fp32 arrays a, b."""
    a = np.array([_val(r[0]) for r in rows], F32)
    b = np.array([_val(r[1]) for r in rows], F32)
    return a, b


def _val(x) -> np.float32:
    """A float (must be exact in fp32) or a bit pattern written as the string '0x3F800000'."""
    if isinstance(x, str):
        return np.array([int(x, 16)], U32).view(F32)[0]
    v = F32(x)
    assert float(v) == x or np.isnan(x), x
    return v


# ------------------------------------------------------------------------- the primitives
P = 2.0 ** -63          # P * P = 2^-126
ONE_M = "0x3F7FFFFF"    # 1 - 2^-24
ONE_M2 = "0x3F7FFFFE"   # 1 - 2^-23
ONE_P = "0x3F800001"    # 1 + 2^-23
MAXF = "0x7F7FFFFF"     # the largest finite fp32
SUB_MIN, SUB_MAX, SUB_MID = "0x00000001", "0x007FFFFF", "0x00400000"
NSUB_MIN, NSUB_MAX = "0x80000001", "0x807FFFFF"

MUL_ROWS = [
    (P, P), (-P, P), (P * (1 + 2 ** -23), P), (ONE_M, TINY), ("0xBF7FFFFF", TINY), (ONE_M2, TINY),
    (0.75, TINY), (1.5, 2.0 ** -127), (-P, 2.0 ** -64), (P, 2.0 ** -64), (2.0 ** -100, 2.0 ** -27),
    (0.75, 2.0 ** -125), ("0x00FFFFFF", ONE_P), ("0x00FFFFFF", ONE_M), (TINY, -1.0),
    (SUB_MIN, 2.0 ** 100), (SUB_MID, 4.0), (NSUB_MAX, 2.0 ** 23), (SUB_MAX, -1.0), (2.0 ** 64, SUB_MID),
    (2.0 ** 64, 2.0 ** 64), (MAXF, ONE_P), (MAXF, ONE_M), ("0xFF7FFFFF", 2.0),
    (1 + 2 ** -12, 1 + 2 ** -12), (ONE_P, 1.5), (3.0, "0x3EAAAAAB"),
]
DIV_ROWS = [
    (TINY, 1.0), (2.0 ** -125, 2.0), (2.0, 2.0 ** 127), (1.0, 2.0 ** 127), (-1.0, 2.0 ** 127), (1.5, 2.0 ** 127),
    (3.0, 2.0 ** 127), (1.0, MAXF), (-1.0, MAXF), (MAXF, MAXF), (2.0 ** 127, 1.5 * 2.0 ** 127),
    (ONE_M, 2.0 ** 126), ("0xBF7FFFFF", 2.0 ** 126), (ONE_P, 2.0 ** 126), (1.0, 3.0 * 2.0 ** 125),
    (4.0, 3.0 * 2.0 ** 125), (TINY, 3.0), (3 * TINY, 3.0), (TINY, ONE_P), (TINY, ONE_M),
    (2.0 ** 127, 0.5), (MAXF, ONE_M), (MAXF, ONE_M2), (1.5 * 2.0 ** 127, 0.75), (MAXF, 1.0), ("0xFF7FFFFF", ONE_M),
    (1.0, SUB_MIN), (-1.0, NSUB_MAX), (SUB_MID, 2.0 ** -100), (SUB_MAX, SUB_MAX), (0.0, SUB_MIN),
    (1.0, 7.0), (1.0, 5.0), (2.0, 7.0), (10.0, 7.0), (-1.0, 5.0), (1.0, 10.0), (5.0, 3.0), (1.0, "0x3F8CCCCD"),
]
ADD_ROWS = [
    (1.5 * TINY, -TINY), (-1.5 * TINY, TINY), (TINY, -TINY), (TINY * (1 + 2 ** -23), -TINY),
    (-TINY * (1 + 2 ** -23), TINY), (SUB_MIN, 0.0), (SUB_MID, SUB_MID), (NSUB_MIN, -0.0), (SUB_MAX, TINY),
    (1.0, 2.0 ** -24), (ONE_P, 2.0 ** -24), (-1.0, -2.0 ** -24), (MAXF, MAXF), (MAXF, 2.0 ** 103),
    (MAXF, 2.0 ** 102), (-0.0, -0.0), (0.0, -0.0), (2.0 ** -24, 1.0), (1.0, -1.0),
]
SUB_ROWS = [
    (1.5 * TINY, TINY), (TINY, 1.5 * TINY), (TINY, TINY), (-0.0, 0.0), (-0.0, -0.0), (SUB_MID, NSUB_MAX),
    (NSUB_MIN, SUB_MIN), (1.0, -2.0 ** -24), (ONE_P, -2.0 ** -24), (MAXF, "0xFF7FFFFF"), (1.0, ONE_P),
    (TINY * (1 + 2 ** -22), TINY * (1 + 2 ** -23)), (-TINY * (1 + 2 ** -22), -TINY * (1 + 2 ** -23)),
]
SQRT_VALUES = [SUB_MIN, SUB_MID, SUB_MAX, NSUB_MIN, NSUB_MAX, "0x80000000", 0.0, TINY, 2.0 ** -125,
               "0x00800001", MAXF, 2.0, 3.0, 0.5, "0x7F800000", "0xFF800000", -1.0, -TINY]


def _scalar_case(op: str, rows) -> dict:
    a, b = _pairs(rows)
    return dict(op=op, args=(a, b), outputs=("y",), pairs=True, desc=f"{len(rows)} pairs")


def _primitives() -> list[tuple[str, dict]]:
    sq = np.array([_val(v) for v in SQRT_VALUES], F32)
    cases = [
        ("mul_tiny", _scalar_case("scalar_mul", MUL_ROWS)),
        ("div_tiny_overflow", _scalar_case("scalar_div", DIV_ROWS)),
        ("add_tiny_ties", _scalar_case("scalar_add", ADD_ROWS)),
        ("sub_tiny", _scalar_case("scalar_sub", SUB_ROWS)),
        ("scalar_sqrt_subnormal", dict(op="scalar_sqrt", args=(sq,), outputs=("y",), pairs=True,
                                desc=f"{sq.size} values")),
    ]
    # the same on device arrays: add (elementwise), scale (mul by one scalar), the sqrt maps
    a, b = _pairs(ADD_ROWS + [(x, -y if isinstance(y, float) else y) for x, y in SUB_ROWS])
    cases.append(("add_vector_tiny_ties", dict(op="add", args=(a, b), outputs=("out",), desc=f"n={a.size}")))
    s63 = np.array([_val(v) for v in (P, -P, P * (1 + 2 ** -23), 2.0 ** -64, -2.0 ** -64, 0.75 * 2.0 ** -62,
                                      "0x203FFFFF", "0xA03FFFFF", "0x20400001", 2.0 ** -63 * 1.5, SUB_MID, NSUB_MAX,
                                      2.0 ** 100, MAXF)], F32)
    cases.append(("scale_tiny", dict(op="scale", args=(s63, P), outputs=("out",), desc="s=2^-63")))
    s100 = np.array([_val(v) for v in (SUB_MIN, SUB_MID, SUB_MAX, NSUB_MIN, NSUB_MAX, 2.0 ** 27, 1.5 * 2.0 ** 27,
                                       "0x0DFFFFFF", 2.0 ** 28, -2.0 ** 28, TINY, 1.0)], F32)
    cases.append(("scale_subnormal_overflow", dict(op="scale", args=(s100, 2.0 ** 100), outputs=("out",),
                                                   desc="s=2^100")))
    for op in ("sqrt", "sqrt_int", "rsqrt"):
        cases.append((f"{op}_subnormal", dict(op=op, args=(sq.copy(),), outputs=("y",), desc=f"n={sq.size}")))
    return cases


# ------------------------------------------------------------------------- functions of §4
def _functions() -> list[tuple[str, dict]]:
    canary = _bits(*EXP_FMA_CANARY_BITS)
    reduction = _bits(*EXP_REDUCTION_CANARY_BITS)
    # exp(x) near -87.34 ends in mul(p, 2^-126): products on both sides of 2^-126
    x_low = np.arange(-87.5, -87.15, 2.0 ** -7, dtype=np.float64).astype(F32)
    thresholds = _bits(0x42B17217, 0x42B17218, 0xC2CE0000, 0xC2CE0001, 0xC2AEAC4F, 0xC2AEAC50, 0xC2AEAC51)
    exp_x = np.concatenate([canary, reduction, x_low, thresholds])
    # sigmoid(x) = div(1, add(1, exp(-x))): for x in [-89, -86] the divisor passes 2^126 and the
    # quotient 2^-126; an ordinary sweep has inexact quotients that round up (as many that round down)
    sig_x = np.concatenate([np.arange(-89.0, -86.0, 2.0 ** -5), np.arange(-12.0, 12.0, 0.1875)]).astype(F32)
    log_x = np.array([_val(v) for v in (SUB_MIN, SUB_MAX, NSUB_MIN, "0x80000000", TINY, "0x00800001", MAXF,
                                        ONE_M, ONE_P, 2.0, 0.5)], F32)
    return [
        ("exp_fma_canary_tiny", dict(op="exp", args=(exp_x,), outputs=("y",),
                                     desc=f"{canary.size} contraction canaries, {reduction.size} argument-"
                                          f"reduction canaries, {x_low.size} results near 2^-126, thresholds")),
        ("sigmoid_divisor_above_2^126", dict(op="sigmoid", args=(sig_x,), outputs=("y",), desc=f"n={sig_x.size}")),
        ("silu_tiny", dict(op="silu", args=(sig_x.copy(),), outputs=("y",), desc=f"n={sig_x.size}")),
        ("log_subnormal", dict(op="log", args=(log_x,), outputs=("y",), desc=f"n={log_x.size}")),
    ]


# ------------------------------------------------------------------------- conversions
def _conversions() -> list[tuple[str, dict]]:
    to_bf16 = _bits(0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x3F807FFF, 0x7F7F8000, 0x7F7F7FFF,
                    0xFF7F8000, 0x00008000, 0x00808000, 0x80808000, 0x00818000, 0x007F8000, 0x7F800001,
                    0xFFC00001, 0x47FF8000)
    from_bf16 = np.array([0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080, 0x7F80, 0x7FC1, 0xFF81, 0x3F80], U16)
    return [
        ("f32_to_bf16_ties", dict(op="f32_to_bf16", args=(to_bf16,), outputs=("y",), desc=f"n={to_bf16.size}")),
        ("bf16_to_f32_subnormal", dict(op="bf16_to_f32", args=(from_bf16,), outputs=("y",),
                                       desc=f"n={from_bf16.size}")),
    ]


# ------------------------------------------------------------------------- GEMMs
def _canary_rows() -> tuple[np.ndarray, np.ndarray]:
    """CONTRACT.md §6.1's table: x (3, 2) and w (3, 2) bf16 whose diagonal y[i, i] = x[i]·w[i] is
    2^-126 (a tiny product flushed) vs 0 fused; +0 vs -0; +inf (an overflowing product) vs finite."""
    x = _bf16(_f(2.0 ** -100, 2.0 ** -64, 0.0, 2.0 ** -64, 0.0, 0.0).reshape(3, 2))
    x[2] = [0x7F7F, 0x5F80]                              # largest bf16, 2^64
    w = _bf16(_f(2.0 ** -26, -2.0 ** -64, 0.0, -2.0 ** -64, -1.0, 2.0 ** 64).reshape(3, 2))
    return x, w


def _gemms() -> list[tuple[str, dict]]:
    x, w = _canary_rows()
    zeros = lambda *s: np.zeros(s, U16)      # noqa: E731
    out = [
        ("linear_fma_canary", dict(op="linear_forward", args=(x, w), outputs=("y",), desc="N=3 K=2 M=3")),
        # dx[n, k] = sum over m of dy[n, m] W[m, k]: dy = x, W = w^T
        ("linear_dx_fma_canary", dict(op="linear_backward", args=(x, zeros(3, 3), np.ascontiguousarray(w.T)),
                                      kwargs=dict(need_dx=True, need_dw=False), outputs=("dx", "dw"),
                                      desc="N=3 M=2 K=3")),
        # dW[m, k] = sum over n of dy[n, m] x[n, k]: dy = x^T, x = w^T
        ("linear_dw_fma_canary", dict(op="linear_backward",
                                      args=(np.ascontiguousarray(x.T), np.ascontiguousarray(w.T), zeros(3, 3)),
                                      kwargs=dict(need_dx=False, need_dw=True), outputs=("dx", "dw"),
                                      desc="N=2 M=3 K=3")),
    ]
    rng = _rng("gemm_7x5x9")
    N, M, K = 7, 5, 9
    xs = rng.sprinkle(rng.bf16((N, K), 1.0), 0.1, _bf16(_f(0.0, -0.0, TINY, -TINY, 2.0 ** 64)))
    ws = rng.sprinkle(rng.bf16((M, K), 1.0), 0.1, _bf16(_f(0.0, 2.0 ** -64, 2.0 ** 64, -2.0 ** 100)))
    dy = rng.bf16((N, M), 1.0)
    qa = rng.ints(N * K, -127, 128).astype(np.int8).reshape(N, K)
    qb = rng.ints(M * K, -127, 128).astype(np.int8).reshape(M, K)
    qa[0], qb[0] = 127, -127
    out += [
        ("gemm_7x5x9", dict(op="linear_forward", args=(xs, ws), outputs=("y",), desc="N=7 K=9 M=5")),
        ("gemm_7x5x9_backward", dict(op="linear_backward", args=(dy, xs, ws), outputs=("dx", "dw"),
                                     desc="N=7 K=9 M=5")),
        ("gemm_i8_7x5x9", dict(op="gemm_i8", args=(qa, qb), outputs=("c",), desc="I=7 J=5 P=9")),
        ("qlinear_7x5x9", dict(op="qlinear_forward", args=(xs, ws), outputs=("y",), desc="N=7 K=9 M=5")),
    ]
    return out


# ------------------------------------------------------------------------- int8 conversions and ties
I2F_K = Q_MAX_P         # the longest contraction
I2F_SPACING = 24        # a weight of 1 every 24 columns: t = 24 / QW_COEF ~ 135 > 127, clipped to 127
I2F_E = -3              # activation levels q are x = q * 2^-3 (s_x = 2^-3 exactly)


def _row_step(values: np.ndarray, K: int) -> np.float32:
    """§6.9's step size s_w = mul(div(S, i2f(K)), QW_COEF) of a weight row of length K whose nonzero
    entries, in column order, are `values` (S sums |w| from +0 in column order: a zero leaves it
    unchanged, so the zeros need not be visited)."""
    S = F32(0.0)
    for v in np.abs(values.astype(F32)):
        S = A.add(S, v)
    return A.mul(A.div(S, F32(K)), _sp_q.QW_COEF)


@functools.lru_cache(maxsize=1)
def i2f_layer() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (R, 2^17) and w (1, 2^17) bf16 for qlinear_forward whose accumulators acc[r, 0] are exactly
    I2F_TARGETS[r]; returns (x, w, the accumulators). The weight row: 1.0 every I2F_SPACING columns
    (level 127, clipped), one weight of level 1 in column 1, zeros elsewhere; the activations:
    levels q in [-127, 127] times 2^I2F_E (so s_x = 2^I2F_E and every level is exact), chosen so
    that 127 * (sum of q on the 127 columns) + q[1] is the target."""
    K, big = I2F_K, np.arange(0, I2F_K, I2F_SPACING)
    s0 = _row_step(np.ones(big.size, F32), K)
    w_small = A.bf16_to_f32(A.f32_to_bf16(np.array([s0], F32)))[0]      # t = w / s_w ~ 1: level 1
    nonzero = np.ones(big.size + 1, F32)
    nonzero[1] = w_small                                # column 1 comes after column 0's 1.0
    s_w = _row_step(nonzero, K)
    levels = _sp_q.rne_clamp(A.mul(np.array([1.0, w_small], F32), A.div(F32(1), s_w)))
    if levels.tolist() != [127, 1]:
        raise AssertionError(f"i2f_layer: the weight row quantizes to levels {levels.tolist()}, not [127, 1]")
    wf = np.zeros(K, F32)
    wf[big], wf[1] = 1.0, w_small
    w = _bf16(wf)[None]
    qw = np.zeros((1, K), np.int8)
    qw[0, big], qw[0, 1] = 127, 1
    rows = []
    for target in I2F_TARGETS:
        a, c = divmod(abs(target), 127)                 # target = 127 a + c, 0 <= c < 127
        sign = 1 if target > 0 else -1
        q = np.zeros(K, np.int64)
        n_full, rest = divmod(a, 127)
        if n_full >= big.size:
            raise AssertionError(f"i2f_layer: {target} is out of reach")
        q[big[:n_full]] = 127
        q[big[n_full]] = rest
        q[1] = c
        q[2] = 127                                      # absmax 127 * 2^e in every row (w is 0 here)
        rows.append(sign * q)
    q = np.array(rows, np.int64)
    x = _bf16((q.astype(np.float64) * 2.0 ** I2F_E).astype(F32))
    qx, sx = _sp_q.quant_tensor(x)
    acc = _sp_q.gemm_i8(qx, qw)[:, 0].astype(np.int64)
    if float(sx) != 2.0 ** I2F_E or not np.array_equal(acc, np.array(I2F_TARGETS, np.int64)):
        raise AssertionError("i2f_layer: the accumulators are not the intended ones")
    return x, w, acc


BIG_ACC_K = 24          # a weight row of 1.0 and 23 zeros: t = 24 / QW_COEF ~ 135, clipped to level 127


@functools.lru_cache(maxsize=1)
def big_acc_layer() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dy (3, Q_MAX_P), x (3, BIG_ACC_K), w (Q_MAX_P, BIG_ACC_K) bf16 for qlinear_backward whose dx
    accumulators are the largest there are, +-127^2 * Q_MAX_P (~0.98 * 2^31): dy and the weights are
    nonzero only at the first row of each QB-block of the contraction, so the rotation (§6.9) makes
    both operands flat and both quantize to +-127 at every position (dy's row 2, -0.5, to about half)."""
    M = Q_MAX_P
    dyf = np.zeros((3, M), F32)
    dyf[:, ::QB] = np.array([1.0, -1.0, -0.5], F32)[:, None]
    wf = np.zeros((M, BIG_ACC_K), F32)
    wf[::QB, 0] = 1.0
    x = _f(*[(k % 5) - 2.0 for k in range(3 * BIG_ACC_K)]).reshape(3, BIG_ACC_K)
    return _bf16(dyf), _bf16(x), _bf16(wf)


def _quant_ties() -> list[tuple[str, dict]]:
    k = np.arange(-253, 254, 2)                         # odd: k/2 is a tie of level()
    v = np.concatenate([k / 2.0, [127.0, -127.0, 0.0]]) * 2.0 ** -5
    xf = v.astype(F32)
    x, w, _ = i2f_layer()
    return [
        ("quant_tensor_ties_f32", dict(op="quant_tensor", args=(xf,), outputs=("q", "s"), desc=f"n={xf.size}")),
        ("quant_tensor_ties_bf16", dict(op="quant_tensor", args=(_bf16(xf),), outputs=("q", "s"),
                                        desc=f"n={xf.size} bf16")),
        ("qlinear_i2f_ties", dict(op="qlinear_forward", args=(x, w), outputs=("y",),
                                  desc="accumulators " + ", ".join(str(t) for t in I2F_TARGETS))),
        ("qlinear_backward_max_accumulators", dict(op="qlinear_backward", args=big_acc_layer(), outputs=("dx", "dw"),
                                                   desc=f"N=3 M={Q_MAX_P} K={BIG_ACC_K}: dx accumulators "
                                                        f"+-127^2 * {Q_MAX_P}")),
    ]


# ------------------------------------------------------------------------- block and chunk boundaries
def _rng(name: str) -> CaseRNG:
    return CaseRNG(case_seed(0, f"edge/{name}", 0))


def _attention_inputs(T: int, name: str):
    """q (1, T, 2, 16), k, v (1, T, 1, 16) bf16 with keys growing along t, so the running max of a
    row changes at each 64-key block (the online softmax rescales across the boundary)."""
    rng = _rng(name)
    D = 16
    q = rng.bf16((1, T, 2, D), 1.0)
    grow = (1.0 + np.arange(T, dtype=np.float64) / 16.0).astype(F32)[None, :, None, None]
    k = A.f32_to_bf16((A.bf16_to_f32(rng.bf16((1, T, 1, D), 1.0)) * grow).astype(F32))
    v = rng.bf16((1, T, 1, D), 1.0)
    return q, k, v


def _boundaries() -> list[tuple[str, dict]]:
    out = []
    scale = float(F32(0.25))
    for T, W in ((129, 0), (130, 65)):
        name = f"attention_T{T}_W{W}"
        q, k, v = _attention_inputs(T, name)
        desc = f"B=1 T={T} H=2 G=1 D=16 window={W}: rows 64.. cross the 64-key block boundary"
        out.append((name, dict(op="attention_forward", args=(q, k, v, W, scale), outputs=("o", "lse"), desc=desc)))
        out.append((name + "_i8", dict(op="attention_forward_i8", args=(q, k, v, W, scale), outputs=("o", "lse"),
                                       desc=desc)))
        o, lse = _sp_att.attention_forward(q, k, v, W, F32(scale))
        dout = _rng(name + "/dout").f32((1, T, 2, 16), "normal", 1.0)
        out.append((name + "_backward", dict(op="attention_backward", args=(dout, q, k, v, o, lse, W, scale),
                                             outputs=("dq", "dk", "dv"), desc=desc)))
    # cross-entropy: V = 2 chunks + 1; row 0's largest logit opens chunk 2 (target at the end of
    # chunk 1), row 1's closes chunk 1 (target opens chunk 2), row 2's is alone in chunk 3
    rng = _rng("xent_chunks")
    N, C, V = 4, 16, 2 * XENT_CHUNK + 1
    h = rng.bf16((N, C), 1.0)
    w = rng.bf16((V, C), 0.25)
    for row, col in ((0, XENT_CHUNK), (1, XENT_CHUNK - 1), (2, V - 1)):
        w[col] = h[row]
    targets = np.array([XENT_CHUNK - 1, XENT_CHUNK, 0, V - 1], I32)
    zcoef = 1e-4
    desc = f"N={N} C={C} V={V}: largest logits at {XENT_CHUNK - 1}, {XENT_CHUNK}, {V - 1}"
    out.append(("xent_chunk_boundary", dict(op="xent_forward", args=(h, w, targets, zcoef),
                                            outputs=("loss", "lse", "ce"), desc=desc)))
    lse = _sp_xent.xent_forward(h, w, targets, F32(zcoef))[1]
    dloss = np.full(N, F32(1.0 / N))
    out.append(("xent_chunk_boundary_backward", dict(op="xent_backward", args=(h, w, targets, zcoef, lse, dloss),
                                                     outputs=("dh", "dw"), desc=desc)))
    return out


# ------------------------------------------------------------------------- public
@functools.lru_cache(maxsize=1)
def _all() -> tuple[tuple[str, dict], ...]:
    items = _primitives() + _functions() + _conversions() + _gemms() + _quant_ties() + _boundaries()
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise AssertionError("edge case names must be unique")
    return tuple(items)


def names() -> list[str]:
    return [n for n, _ in _all()]


def edge_ops() -> dict:
    """name -> the op each edge case runs, in order."""
    return {n: d["op"] for n, d in _all()}


def edge_case(name: str) -> Case:
    """A fresh Case (its own copies of the inputs) for the edge case `name`."""
    for index, (n, d) in enumerate(_all()):
        if n == name:
            copy = lambda v: v.copy() if isinstance(v, np.ndarray) else v       # noqa: E731
            return Case(op=d["op"], index=index, seed=case_seed(0, f"edge/{name}", 0),
                        args=tuple(copy(a) for a in d["args"]), kwargs=dict(d.get("kwargs", {})),
                        outputs=tuple(d["outputs"]), desc=f"{name}: {d.get('desc', '')}",
                        inplace=d.get("inplace"), pairs=bool(d.get("pairs", False)))
    raise KeyError(f"unknown edge case {name!r}")


def edge_cases() -> list[tuple[str, Case]]:
    return [(n, edge_case(n)) for n in names()]
