"""The int8 quantized linear layer (CONTRACT.md §6.9) on the Metal backend against the C reference,
bit for bit: the quantizers (per-row weight step sizes, per-tensor scales), the exact int8 GEMM,
the Walsh-Hadamard rotation and the layer's forward and backward; and the int8 attention forward
(§6.10: value-row quantization kernel, int8 block product) against the numpy spec and the C reference;
and the simulated int4 and int6 paths (qmax=7 / 31: the same kernels with the template argument
QMAX = 7 / 31) against the numpy spec (and the C reference once its qlinear functions take qmax).

Where Metal is available the kernels run through mx.fast.metal_kernel, elsewhere in the emulator.
Shapes are odd (not multiples of QB, of the absmax block or of any threadgroup), inputs include
NaN/inf rows, zero rows, subnormals, clipped weights and rounding ties. Floats are compared as
uint32 bit patterns, integer outputs exactly.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.metal import ops as M
from mlx_open1b.spec import quant as spec_quant
from mlx_open1b.spec.arith import f32_to_bf16

from helpers import (I8_SHAPES, QMAX4, QMAX6, SPECIAL_BF16, SPECIAL_F32, TINY_E, assert_bits_equal,
                     attention_i8_empty_and_bad_arguments, attention_i8_matches_spec,
                     attention_i8_special_rows, attention_i8_ties_to_even,
                     attention_vquant_is_the_per_tensor_rule, check_attention_i8_backend, check_qlinear_low,
                     rand_bf16, rand_f32, sprinkle)

OPS = ("gemm_i8", "hadamard_rows", "quant_weight_rows", "quant_tensor", "qlinear_forward", "qlinear_backward")
QB = C.quant.QB


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng([0x18A7, *key])


def rand_i8(rng, shape):
    return rng.integers(-127, 128, shape, dtype=np.int64).astype(np.int8)


def assert_same_q(got, want, what):
    (qa, sa), (qb, sb) = got, want
    assert qa.dtype == np.int8 and qa.shape == qb.shape, what
    bad = np.argwhere(qa != qb)
    assert not bad.size, f"{what}: q differs at {tuple(bad[0])}: {qa[tuple(bad[0])]} vs {qb[tuple(bad[0])]}"
    assert np.asarray(sa).dtype == np.float32, what
    assert_bits_equal(np.asarray(sa), np.asarray(sb), f"{what} scale")


def check_layer(x, w, dy, what):
    y = M.qlinear_forward(x, w)
    want_y = C.qlinear_forward(x, w)
    assert_bits_equal(y, want_y, f"{what} y")
    dx, dw = M.qlinear_backward(dy, x, w)
    want_dx, want_dw = C.qlinear_backward(dy, x, w)
    assert_bits_equal(dx, want_dx, f"{what} dx")
    assert_bits_equal(dw, want_dw, f"{what} dw")
    return y, dx, dw


def without_qmax(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "qmax"])


def test_same_functions_as_cpu_ref():
    for name in OPS:
        got, want = inspect.signature(getattr(M, name)), inspect.signature(getattr(C, name))
        if name.startswith("qlinear_") and "qmax" not in want.parameters:
            got = without_qmax(got)         # cpu_ref without the int4 path yet: the rest is the same
        assert got == want, name
    for name in ("qlinear_forward", "qlinear_backward"):   # qmax last, 127 by default: old calls unchanged
        params = list(inspect.signature(getattr(M, name)).parameters.values())
        assert params[-1].name == "qmax" and params[-1].default == 127, name


# ------------------------------------------------------------------ int8 GEMM
@pytest.mark.parametrize("I,J,P", [(1, 1, 1), (3, 5, 7), (37, 53, 19), (9, 33, 3001), (130, 70, 1030), (2, 3, 0)])
def test_gemm_i8_exact(I, J, P):
    rng = rng_for(1, I, J, P)
    a, b = rand_i8(rng, (I, P)), rand_i8(rng, (J, P))
    if P:
        a[0] = 127                      # extreme rows and columns
        b[-1] = -127
    got = M.gemm_i8(a, b)
    assert got.dtype == np.int32 and got.shape == (I, J)
    want = a.astype(np.int64) @ b.astype(np.int64).T
    assert np.array_equal(got.astype(np.int64), want)
    assert np.array_equal(got, C.gemm_i8(a, b))


def test_gemm_i8_extremes_at_the_length_bound():
    P = C.quant.Q_MAX_P
    a = np.full((3, P), 127, np.int8)
    a[1] = -127
    a[2, ::2] = -127
    b = np.full((2, P), 127, np.int8)
    b[1] = -127
    want = a.astype(np.int64) @ b.astype(np.int64).T
    assert np.abs(want).max() == P * 127 * 127
    assert np.array_equal(M.gemm_i8(a, b).astype(np.int64), want)


# ------------------------------------------------------------------ quantizers
def special_weights(rng, M_, K):
    w = rand_bf16(rng, (M_, K), 0.02)
    w[3] = 0                                    # zero row: s = +0, q = 0
    w[4] = 0x0001                               # subnormals flush: a zero row as well
    w[5, 7] = 0x7F80                            # +inf: NaN scale, q = 0
    w[6, 9] = 0x7FC1                            # NaN
    w[7] = 0x7F7F                               # huge: the row sum overflows -> NaN
    w[8, 0] = f32_to_bf16(np.float32(5.0))      # an outlier that clips (|t| > 127)
    w[9, 1] = 0xFF80                            # -inf
    w[10] = 0x8000                              # -0 row
    w[11, ::2] = 0x0080                         # smallest normals: the quotient flushes -> zero row
    w[11, 1::2] = 0
    w[12, 0] = 0x0080                           # one smallest normal, the rest tiny normals
    w[13] = sprinkle(rng, w[13], SPECIAL_BF16[[0, 1, 6, 7, 8]], 0.3)   # zeros, subnormals in a row
    w[14, :5] = f32_to_bf16(np.float32(-9.0))   # negative clipping
    return w


@pytest.mark.parametrize("M_,K", [(67, 301), (16, 1), (20, 4099)])
def test_quant_weight_rows(M_, K):
    rng = rng_for(2, M_, K)
    w = special_weights(rng, M_, K) if K > 10 else rand_bf16(rng, (M_, K), 0.02)
    got, want = M.quant_weight_rows(w), C.quant_weight_rows(w)
    assert_same_q(got, want, f"quant_weight_rows {M_}x{K}")
    q, s = got
    assert s.shape == (M_,) and np.abs(q.astype(np.int64)).max() <= 127
    if K > 10:
        su = s.view(np.uint32)
        for r in (5, 6, 7, 9):
            assert su[r] == 0x7FC00000 and not q[r].any()
        for r in (3, 4, 10, 11):
            assert su[r] == 0 and not q[r].any()
        assert q[8, 0] == 127 and (q[14, :5] == -127).all()


def test_quant_weight_rows_empty_and_k0():
    for shape in ((0, 5), (3, 0)):
        w = np.zeros(shape, np.uint16)
        assert_same_q(M.quant_weight_rows(w), C.quant_weight_rows(w), f"quant_weight_rows {shape}")


@pytest.mark.parametrize("shape", [(33, 65), (40,), (4, 4), (3, 4097), (9000,), (2, 3, 5), (0,), ()])
def test_quant_tensor_bf16(shape):
    rng = rng_for(3, *shape)
    x = rand_bf16(rng, shape) if shape else np.array(0x3F80, np.uint16)
    if x.size > 4:
        x = sprinkle(rng, x, SPECIAL_BF16[[0, 1, 6, 7, 8, 9, 12, 13, 14, 15]], 0.1)
    assert_same_q(M.quant_tensor(x), C.quant_tensor(x), f"quant_tensor bf16 {shape}")
    z = np.zeros(shape, np.uint16)
    assert_same_q(M.quant_tensor(z), C.quant_tensor(z), f"quant_tensor zeros {shape}")


@pytest.mark.parametrize("bad", [0x7F80, 0xFF80, 0x7FC1, 0xFFC0])
def test_quant_tensor_non_finite(bad):
    rng = rng_for(4, bad)
    for shape, pos in (((8, 8), (2, 2)), ((3, 5000), (2, 4999)), ((3, 5000), (0, 0))):
        x = rand_bf16(rng, shape)
        x[pos] = bad
        q, s = M.quant_tensor(x)
        assert np.float32(s).view(np.uint32) == 0x7FC00000 and not q.any()
        assert_same_q((q, s), C.quant_tensor(x), f"quant_tensor {bad:#x} at {pos}")


def test_quant_tensor_f32():
    rng = rng_for(5)
    v = (rng.standard_normal(10000) * 3).astype(np.float32)
    v[0] = 1e-40                                 # subnormal: flushed
    v[9999] = -40.0                              # the max in the last block
    assert_same_q(M.quant_tensor(v), C.quant_tensor(v), "quant_tensor f32")
    # ties go to even (s = 1 exactly), the clamp, a max that is itself a subnormal
    t = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 3.5, -1.5], np.float32)
    q, s = M.quant_tensor(t)
    assert s == 1.0 and q.tolist() == [127, 0, 2, 2, 0, -2, 126, -126, 4, -2]
    assert_same_q((q, s), C.quant_tensor(t), "ties")
    for v in (np.array([1e-40, -1e-41], np.float32),                  # flushed to a zero tensor
              np.array([2.0 ** -120, 2.0 ** -126], np.float32),         # a / 127 flushes: s = +0
              np.array([3.4028235e38, -3.4028235e38, 1.0], np.float32),
              sprinkle(rng, rand_f32(rng, (50, 7), 1e-30), SPECIAL_F32[[0, 1, 5, 6, 7, 8, 9, 12, 13]], 0.2),
              np.array([np.inf, 1.0], np.float32), np.array([1.0, np.nan], np.float32)):
        assert_same_q(M.quant_tensor(v), C.quant_tensor(v), f"quant_tensor f32 {v.ravel()[:3]}")


@pytest.mark.parametrize("qmax", [127, 31, 7])
def test_quant_apply_levels_and_clip_flags(qmax):
    """The rounding kernel itself (template QMAX: int8, or the simulated int6 / int4 paths): per-row
    scales of powers of two (inv exact), values at ties, at the clamp (127, 31 or 7), past it,
    overflowing to inf; a NaN-scale row and a zero-scale row."""
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.5, -127.5, 127.0, 128.0, 3e38, -3e38,
                  0.49999997, -2.5000002, 6.5, -6.5, 7.0, -7.0, 7.5, -7.5, 8.0, 6.4999995, 7.0000005,
                  3.5, 4.5, 5.5, 30.5, -30.5, 31.0, 31.5, -31.5, 32.0, 31.000002], np.float32)
    K = v.size
    s = np.array([1.0, 0.5, 2.0 ** -100, np.nan, 0.0], np.float32)
    vv = np.tile(v, s.size)
    q, clip = M._run("quant_apply", [vv, s, M._i64(K)], [((vv.size,), np.int8), ((vv.size,), np.uint8)],
                     (vv.size, 1, 1), template=[("PER_ROW", 1), ("QMAX", qmax)])
    q, clip = q.reshape(s.size, K), clip.reshape(s.size, K)
    with np.errstate(over="ignore"):
        for r in range(3):
            t = (v * (np.float32(1) / s[r])).astype(np.float32)
            assert q[r].tolist() == np.clip(np.rint(t), -qmax, qmax).astype(np.int64).tolist(), r
            assert clip[r].tolist() == (np.abs(t) > qmax).astype(np.int64).tolist(), r
    assert np.abs(q.astype(np.int64)).max() == qmax
    assert not q[3].any() and (clip[3] == 2).all()
    assert not q[4].any() and not clip[4].any()


# ------------------------------------------------------------------ Hadamard
def test_hadamard_identity_and_specials():
    Hf = M.hadamard_rows(np.eye(QB, dtype=np.float32))
    assert_bits_equal(Hf, C.hadamard_rows(np.eye(QB, dtype=np.float32)), "H")
    assert np.array_equal(Hf @ Hf, QB * np.eye(QB, dtype=np.float32))
    rng = rng_for(6)
    v = (rng.standard_normal((3 * QB, 37)) * 10.0 ** rng.integers(-30, 30, (3 * QB, 37))).astype(np.float32)
    v[0, 0], v[1, 1], v[2, 2], v[200, 3], v[300, 4] = 1e-40, np.inf, np.nan, -np.inf, 3.4e38
    v[130:140, 5] = 2.0 ** -126
    v[141, 5] = -(2.0 ** -126) * 1.5
    v = sprinkle(rng, v, SPECIAL_F32, 0.01)
    src = v.copy()
    got = M.hadamard_rows(v)
    assert np.array_equal(v.view(np.uint32), src.view(np.uint32))          # the input is not changed
    assert_bits_equal(got, C.hadamard_rows(v), "hadamard_rows")
    for shape in ((QB, 1), (2 * QB, 0), (0, 5)):
        f = rand_f32(rng, shape)
        assert_bits_equal(M.hadamard_rows(f), C.hadamard_rows(f), f"hadamard_rows {shape}")
    f64 = rng.standard_normal((QB, 3))                  # converted to fp32 first, as in cpu_ref
    assert_bits_equal(M.hadamard_rows(f64), C.hadamard_rows(f64), "hadamard_rows float64 input")


def test_hadamard_i8_kernel_exact():
    """The integer rotation (backward operands): int32 butterflies, i2f, zero-padded rows."""
    rng = rng_for(7)
    R, Cc = 200, 9
    q = rand_i8(rng, (R, Cc))
    q[:QB, 0] = 127
    q[:QB, 1] = -127
    got = M._rotate("hadamard_i8", q, R, Cc)
    pad = np.zeros((2 * QB, Cc), np.float32)
    pad[:R] = q
    assert_bits_equal(got, C.hadamard_rows(pad), "hadamard_i8")
    assert got[0, 0] == 127 * QB and got[0, 1] == -127 * QB


# ------------------------------------------------------------------ the layer
@pytest.mark.parametrize("N,K,M_", [(1, 1, 1), (5, 3, 7), (130, 70, 129), (300, 257, 200), (129, 33, 128)])
def test_layer_matches_cpu_ref(N, K, M_):
    rng = rng_for(8, N, K, M_)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M_, K), 0.02), rand_bf16(rng, (N, M_), 1e-3)
    check_layer(x, w, dy, f"{N}x{K}x{M_}")


def test_layer_need_flags():
    rng = rng_for(9)
    x, w, dy = rand_bf16(rng, (17, 11)), rand_bf16(rng, (13, 11), 0.02), rand_bf16(rng, (17, 13), 1e-3)
    want_dx, want_dw = C.qlinear_backward(dy, x, w)
    dx, dw = M.qlinear_backward(dy, x, w, need_dx=False)
    assert dx is None
    assert_bits_equal(dw, want_dw, "dw only")
    dx, dw = M.qlinear_backward(dy, x, w, need_dw=False)
    assert dw is None
    assert_bits_equal(dx, want_dx, "dx only")


def test_special_values_in_the_layer():
    rng = rng_for(10)
    N, K, M_ = 140, 96, 150
    x, w, dy = rand_bf16(rng, (N, K)), special_weights(rng, M_, K), rand_bf16(rng, (N, M_), 1e-3)
    x[3, 3] = 0x0001                            # subnormal input: flushed
    x[4, :7] = 0x8001
    dy[5, :9] = 0x0001
    y, dx, dw = check_layer(x, w, dy, "specials")
    assert np.all(y[:, 3] == 0) and np.all(np.isnan(y[:, 5])) and np.all(np.isnan(dw[6])) and np.all(np.isnan(dx))
    assert dw[8, 0] == 0 and dw[8, 0].view(np.uint32) == 0
    for r in (5, 6, 7, 9):                      # without the non-finite rows
        w[r] = 0
    y, dx, dw = check_layer(x, w, dy, "finite weights")
    assert not np.isnan(dx).any()
    x[7, 7] = 0x7F80                            # inf activation: the tensor scale is NaN
    y, dx, dw = check_layer(x, w, dy, "inf x")
    assert np.all(np.isnan(y)) and not np.isnan(dx).any()
    dy[0, 0] = 0xFF80                           # inf gradient: both gradients NaN
    check_layer(x, w, dy, "inf dy")
    x[7, 7] = 0
    dy[0, 0] = 0x7FC1                           # NaN gradient
    check_layer(x, w, dy, "nan dy")
    y, dx, dw = check_layer(np.zeros((N, K), np.uint16), w * 0, dy * 0, "zeros")
    assert y.view(np.uint32).max() == 0
    big = rand_bf16(rng, (N, K), 1e30)          # large activations, tiny gradients near flushing
    tiny = rand_bf16(rng, (N, M_), 1e-36)
    check_layer(big, w, tiny, "big x, tiny dy")
    check_layer(x, rand_bf16(rng, (M_, K), 1e-37), dy, "tiny weights")


def test_layer_outliers_and_clipping():
    rng = rng_for(11)
    N, K, M_ = 257, 130, 131
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M_, K), 0.02), rand_bf16(rng, (N, M_), 1e-3)
    w[:, 0] = f32_to_bf16(np.float32(3.0))      # a clipped column in every row
    w[1, :] = f32_to_bf16(np.float32(0.5))      # a constant row: every t = sqrt(127) / 2, level 6
    dy[rng.choice(N, 4, replace=False)] = f32_to_bf16(np.float32(80.0))   # outlier tokens
    x[:, 5] = f32_to_bf16(np.float32(-1e4))     # an outlier channel
    _, _, dw = check_layer(x, w, dy, "outliers")
    q, s = C.quant_weight_rows(w)
    assert (q[2:, 0] == 127).all() and (q[1] == 6).all()
    assert (dw[2:, 0] == 0).all() and (dw[2:, 0].view(np.uint32) == 0).all()


# ------------------------------------------------------------------ §6.10 the int8 attention forward
def check_attention_i8(q, k, v, W, scale, what):
    """M.attention_forward_i8 equals the numpy spec and the C reference bit for bit."""
    return check_attention_i8_backend(M.attention_forward_i8, q, k, v, W, scale, what)


def test_attention_forward_i8_same_signature_as_cpu_ref():
    assert inspect.signature(M.attention_forward_i8) == inspect.signature(C.attention_forward_i8)


@pytest.mark.parametrize("B,T,H,G,D,W", I8_SHAPES)
def test_attention_forward_i8_matches_spec(B, T, H, G, D, W):
    """Blocks crossed (T not a multiple of 64), windows, grouped-query heads; plain inputs, then
    zero / subnormal / tiny / huge / tie / +inf / NaN value rows and finite specials in q and k."""
    attention_i8_matches_spec(check_attention_i8, rng_for(20, B, T, H, G, D, W), B, T, H, G, D, W)


def test_attention_forward_i8_special_rows():
    attention_i8_special_rows(check_attention_i8, C.attention_forward, rng_for(21))


def test_attention_forward_i8_ties_to_even():
    attention_i8_ties_to_even(check_attention_i8)


def run_vquant(v):
    B, T, G, D = v.shape
    return M._run("attention_vquant", [v.reshape(-1), M._i64(D)], [((B, T, G, D), np.int8), ((B, T, G), np.float32)],
                  (B * T * G, 1, 1), (64, 1, 1))


def test_attention_vquant_kernel_is_the_per_tensor_rule():
    attention_vquant_is_the_per_tensor_rule(run_vquant, rng_for(22))


def test_attention_forward_i8_empty_and_bad_arguments():
    attention_i8_empty_and_bad_arguments(M.attention_forward_i8, C.attention_forward_i8)


# ------------------------------------------------------ the simulated int4 / int6 paths (qmax = 7 / 31)
LOW_QMAX = pytest.mark.parametrize("qmax", [QMAX4, QMAX6], ids=["int4", "int6"])


def check_layer4(x, w, dy, what, qmax=QMAX4):
    """The int4 / int6 path (qmax=7 / 31) equals the numpy spec and cpu_ref bit for bit."""
    return check_qlinear_low(M, x, w, dy, what, qmax)


@LOW_QMAX
@pytest.mark.parametrize("N,K,M_", [(1, 1, 1), (5, 3, 7), (130, 70, 129), (300, 257, 200), (129, 33, 128)])
def test_int4_layer_matches_spec(N, K, M_, qmax):
    rng = rng_for(30, N, K, M_)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M_, K), 0.02), rand_bf16(rng, (N, M_), 1e-3)
    y, dx, dw = check_layer4(x, w, dy, f"{N}x{K}x{M_}", qmax)
    if N * K * M_ > 1000:                       # not the int8 layer
        assert not np.array_equal(y, M.qlinear_forward(x, w))
        assert not np.array_equal(dw, M.qlinear_backward(dy, x, w)[1])
    if qmax == QMAX6 and N * K * M_ > 1000:     # nor the int4 path
        assert not np.array_equal(y, M.qlinear_forward(x, w, qmax=QMAX4))


@LOW_QMAX
def test_int4_need_flags_and_positional_arguments(qmax):
    rng = rng_for(31)
    x, w, dy = rand_bf16(rng, (17, 11)), rand_bf16(rng, (13, 11), 0.02), rand_bf16(rng, (17, 13), 1e-3)
    want_dx, want_dw = spec_quant.qlinear_backward(dy, x, w, qmax)
    dx, dw = M.qlinear_backward(dy, x, w, False, True, qmax)
    assert dx is None
    assert_bits_equal(dw, want_dw, "dw only")
    dx, dw = M.qlinear_backward(dy, x, w, need_dw=False, qmax=qmax)
    assert dw is None
    assert_bits_equal(dx, want_dx, "dx only")
    assert_bits_equal(M.qlinear_forward(x, w, qmax), spec_quant.qlinear_forward(x, w, qmax), "positional qmax")
    assert_bits_equal(M.qlinear_forward(x, w, np.int64(127)), M.qlinear_forward(x, w), "qmax 127 is int8")


@LOW_QMAX
def test_int4_special_values_in_the_layer(qmax):
    rng = rng_for(32)
    N, K, M_ = 140, 96, 150
    x, w, dy = rand_bf16(rng, (N, K)), special_weights(rng, M_, K), rand_bf16(rng, (N, M_), 1e-3)
    x[3, 3] = 0x0001                            # subnormal input: flushed
    x[4, :7] = 0x8001
    dy[5, :9] = 0x0001
    w[15] = f32_to_bf16(np.full(K, 2.0 ** -122, np.float32))   # s_w = 2^-122 QW_COEF4 (6): not flushed
    check = lambda x, w, dy, what: check_layer4(x, w, dy, what, qmax)
    y, dx, dw = check(x, w, dy, "specials")
    assert np.all(y[:, 3] == 0) and np.all(np.isnan(y[:, 5])) and np.all(np.isnan(dw[6])) and np.all(np.isnan(dx))
    assert dw[8, 0] == 0 and dw[8, 0].view(np.uint32) == 0 and (dw[14, :5].view(np.uint32) == 0).all()
    for r in (5, 6, 7, 9):                      # without the non-finite rows
        w[r] = 0
    y, dx, dw = check(x, w, dy, "finite weights")
    assert not np.isnan(dx).any()
    x[7, 7] = 0x7F80                            # inf activation: the tensor scale is NaN
    y, dx, dw = check(x, w, dy, "inf x")
    assert np.all(np.isnan(y)) and not np.isnan(dx).any()
    dy[0, 0] = 0xFF80                           # inf gradient: both gradients NaN
    check(x, w, dy, "inf dy")
    x[7, 7] = 0
    dy[0, 0] = 0x7FC1                           # NaN gradient
    check(x, w, dy, "nan dy")
    y, dx, dw = check(np.zeros((N, K), np.uint16), w * 0, dy * 0, "zeros")
    assert y.view(np.uint32).max() == 0 and dx.view(np.uint32).max() == 0 and dw.view(np.uint32).max() == 0
    big = rand_bf16(rng, (N, K), 1e30)          # large activations, tiny gradients near flushing
    tiny = rand_bf16(rng, (N, M_), 1e-36)
    check(big, w, tiny, "big x, tiny dy")
    check(x, rand_bf16(rng, (M_, K), 1e-37), dy, "tiny weights")
    # absmax 2^-123 (int6: 2^-121): div(a, 127) flushes, div(a, qmax) does not
    tx = f32_to_bf16((np.sign(rng.standard_normal((N, K))) * 2.0 ** TINY_E[qmax]).astype(np.float32))
    check(tx, w, dy, "tiny activations")
    assert M._quant_f32(M.bf16_to_f32(tx), qmax)[1][0] > 0 and M._quant_f32(M.bf16_to_f32(tx))[1][0] == 0


@LOW_QMAX
def test_int4_clipping(qmax):
    """A weight 10x its row's mean magnitude: t ~ 12 steps at int4 (clipped: level 7, dW +0), ~50
    at int8 (not clipped); int6: 30x, t ~ 50 steps (clipped: level 31), ~100 at int8."""
    rng = rng_for(33)
    N, K, M_ = 131, 96, 140
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M_, K), 0.02), rand_bf16(rng, (N, M_), 1e-3)
    out = {QMAX4: 0.1, QMAX6: 0.3}[qmax]
    w[:20] = f32_to_bf16(np.float32(0.01))
    w[:20, 0] = f32_to_bf16(np.float32(out))
    w[:20, 1] = f32_to_bf16(np.float32(-out))
    w[30] = 0
    w[30, 0] = f32_to_bf16(np.float32(-9.0))    # a single nonzero: clipped at both
    q4, s4, clip4 = M._quant_w(w, M_, K, qmax)
    want_q, want_s, want_clip = spec_quant.quant_weight_rows(w, with_clip=True, qmax=qmax)
    assert np.array_equal(q4, want_q) and np.array_equal(clip4, want_clip)
    assert_bits_equal(s4, want_s, f"s_w qmax {qmax}")
    q8, _, clip8 = M._quant_w(w, M_, K)
    assert (clip4[:20, :2] == 1).all() and (q4[:20, 0] == qmax).all() and (q4[:20, 1] == -qmax).all()
    assert not clip8[:20].any() and (np.abs(q8[:20, :2].astype(np.int64)) < 127).all()
    assert clip4.sum() > clip8.sum() > 0
    _, _, dw = check_layer4(x, w, dy, "clipping", qmax)
    assert (dw[:20, :2].view(np.uint32) == 0).all() and dw[30, 0].view(np.uint32) == 0
    dw8 = M.qlinear_backward(dy, x, w)[1]
    assert (dw8[:20, :2] != 0).all()


@LOW_QMAX
def test_int4_levels_within_7(qmax):
    """The quantizer kernels with QMAX = 7 (31): every level in [-7, 7] ([-31, 31]), both ends
    reached, the spec's levels and scales (weight rows: QW_COEF4 (QW_COEF6); tensors:
    div(absmax, qmax)); int8 differs."""
    rng = rng_for(34)
    M_, K = 67, 301
    w = special_weights(rng, M_, K)
    q, s, clip = M._quant_w(w, M_, K, qmax)
    want_q, want_s, want_clip = spec_quant.quant_weight_rows(w, with_clip=True, qmax=qmax)
    assert np.array_equal(q, want_q) and np.array_equal(clip, want_clip)
    assert_bits_equal(s, want_s, "s_w")
    assert q.min() == -qmax and q.max() == qmax and clip[8, 0] == 1 and (clip[5] == 2).all()
    q8, s8, _ = M._quant_w(w, M_, K)
    assert np.abs(q8.astype(np.int64)).max() == 127 and not np.array_equal(s, s8)
    v = (rng.standard_normal(10000) * 3).astype(np.float32)
    v[0], v[9999] = 1e-40, -40.0                # a flushed subnormal; the max in the last block
    for vv in (v, sprinkle(rng, rand_f32(rng, (50, 7), 1e-30), SPECIAL_F32[[0, 1, 5, 6, 7, 8, 9, 12, 13]], 0.2),
               np.array([np.inf, 1.0], np.float32), np.array([2.0 ** -124, 2.0 ** -126], np.float32)):
        qt, st = M._quant_f32(vv, qmax)
        want_q, want_s = spec_quant.quant_tensor_f32(vv, qmax)
        assert np.array_equal(qt, want_q.reshape(vv.shape)), vv.ravel()[:3]
        assert_bits_equal(st[0], np.float32(want_s), "s")
        assert np.abs(qt.astype(np.int64)).max(initial=0) <= qmax
    qt, st = M._quant_f32(v, qmax)
    assert qt.min() == -qmax and st[0] == np.float32(40.0) / np.float32(qmax)
    assert np.abs(M._quant_f32(v)[0].astype(np.int64)).max() == 127
    h = qmax - 0.5                              # the largest tie below the clamp: to qmax - 1 (even)
    t = np.array([qmax, 0.5, 1.5, 2.5, -0.5, -2.5, h, -h, 3.5, -1.5, 5.5, -4.5], np.float32)
    qt, st = M._quant_f32(t, qmax)               # s = 1 exactly: ties to even
    assert st[0] == 1.0 and qt.tolist() == [qmax, 0, 2, 2, 0, -2, qmax - 1, 1 - qmax, 4, -2, 6, -4]
    e = TINY_E[qmax]
    tv = np.array([2.0 ** e, -(2.0 ** (e - 1))], np.float32)
    qt, st = M._quant_f32(tv, qmax)             # div(2^e, qmax) is a normal: not flushed, unlike / 127
    assert st[0] > 0 and qt[0] == qmax and qt.tolist() == spec_quant.quant_tensor_f32(tv, qmax)[0].tolist()
    assert M._quant_f32(np.array([2.0 ** e], np.float32))[1][0] == 0
    assert M._quant_f32(np.array([2.0 ** (e - 1)], np.float32), qmax)[1][0] == 0     # div(2^(e-1), qmax) flushes


@pytest.mark.parametrize("bad", [8, 0, -7, 32, 255, 7.0, True, "7", None])
def test_qmax_validated(bad):
    from mlx_open1b.parity import spec_backend
    x, w, dy = np.zeros((4, 8), np.uint16), np.zeros((3, 8), np.uint16), np.zeros((4, 3), np.uint16)
    for mod in (M, spec_backend):
        with pytest.raises(ValueError, match="qmax: expected 127") as e1:
            mod.qlinear_forward(x, w, qmax=bad)
        with pytest.raises(ValueError, match="qmax: expected 127") as e2:
            mod.qlinear_backward(dy, x, w, qmax=bad)
        msg = f"qmax: expected 127 (int8), 31 (the simulated int6 path) or 7 (the simulated int4 path), got {bad!r}"
        assert str(e1.value) == str(e2.value) == msg


def test_kernels_reject_other_qmax_at_compile_time():
    v, s = np.ones(4, np.float32), np.ones(1, np.float32)
    with pytest.raises(RuntimeError, match="QMAX must be 127"):
        M._run("quant_apply", [v, s, M._i64(1)], [((4,), np.int8), ((4,), np.uint8)], (4, 1, 1),
               template=[("PER_ROW", 0), ("QMAX", 8)])


# ------------------------------------------------------------------ argument errors
def test_bad_inputs_as_cpu_ref():
    x = np.zeros((4, 8), np.uint16)
    w = np.zeros((3, 8), np.uint16)
    cases = [
        ("qlinear_forward", (x, np.zeros((3, 9), np.uint16)), "w: dimension 1"),
        ("qlinear_forward", (x.astype(np.float32), w), "dtype"),
        ("qlinear_backward", (np.zeros((4, 4), np.uint16), x, w), "dy: dimension"),
        ("quant_weight_rows", (np.zeros((8, 3), np.uint16).T,), "C-contiguous"),
        ("gemm_i8", (np.full((2, 2), -128, np.int8), np.zeros((2, 2), np.int8)), "-128"),
        ("gemm_i8", (np.zeros((1, (1 << 17) + 1), np.int8), np.zeros((1, (1 << 17) + 1), np.int8)), "exceeds"),
        ("gemm_i8", (np.zeros((2, 2), np.int16), np.zeros((2, 2), np.int8)), "dtype"),
        ("hadamard_rows", (np.zeros((100, 3), np.float32),), "multiple of the Hadamard block"),
        ("quant_tensor", (np.zeros((2, 2), np.int32),), "dtype"),
        ("qlinear_backward", (np.zeros((4, (1 << 17) + 1), np.uint16), x, np.zeros(((1 << 17) + 1, 8), np.uint16)),
         "exceeds"),
    ]
    for name, args, match in cases:
        for mod in (C, M):
            with pytest.raises(ValueError, match=match):
                getattr(mod, name)(*args)
