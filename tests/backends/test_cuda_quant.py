"""The CUDA backend's int8 quantized linear layer (cuda/quant.cu, CONTRACT.md §6.9) against the C
reference, bit for bit.

Where CuPy and a GPU exist the ops run the real runtime; elsewhere the same .cu text runs on the CPU
emulator (cuda/emu). Every public op of the family is compared with mlx_open1b.cpu_ref on shapes
that are not multiples of any block size (128-thread launches, 128-row Hadamard blocks, 4096-element
absmax chunks), with NaN/inf rows and tensors, zero rows, subnormals (inputs and flushed scales),
clipped weights and rounding ties; plus the nvcc compile check of quant.cu for sm_80 and sm_90.
The int8 attention forward (§6.10, cuda/attention.cu: the value-row quantization kernel and the
int8 block product) is compared with the numpy spec and the C reference the same way. The simulated
int4 and int6 paths (qmax=7 / 31: the same kernels with their qmax argument) are compared with the numpy spec (and
the C reference once its qlinear functions take qmax).
"""
from __future__ import annotations

import inspect
import shutil
import subprocess

import numpy as np
import pytest

from helpers import (I8_SHAPES, QMAX4, QMAX6, SPECIAL_BF16, SPECIAL_F32, TINY_E, assert_bits_equal,
                     attention_i8_empty_and_bad_arguments, attention_i8_inputs, attention_i8_matches_spec,
                     attention_i8_special_rows, attention_i8_ties_to_even,
                     attention_vquant_is_the_per_tensor_rule, check_attention_i8_backend, check_qlinear_low,
                     rand_bf16, rand_f32, sprinkle)

import mlx_open1b.cpu_ref as ref
from mlx_open1b.cuda import emu, ops as cu, runtime
from mlx_open1b.spec import quant as spec_quant
from mlx_open1b.spec.arith import f32_to_bf16

OK, HOW = cu.available()
pytestmark = pytest.mark.skipif(not OK, reason=HOW)
HAVE_GXX = emu.compiler_available()[0]
QB, Q_MAX_P = cu.QB, cu.Q_MAX_P


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng([ord(c) for c in name])


def rand_i8(rng, shape):
    return rng.integers(-127, 128, shape, dtype=np.int64).astype(np.int8)


def bf(v) -> np.ndarray:
    return f32_to_bf16(np.asarray(v, np.float32))


def assert_same_quant(got, want, what):
    (qa, sa), (qb, sb) = got, want
    assert qa.dtype == np.int8 and qa.shape == qb.shape, what
    assert np.array_equal(qa, qb), f"{what}: q differs at {np.argwhere(qa != qb)[:5].tolist()}"
    assert np.asarray(sa).dtype == np.float32, what
    assert_bits_equal(np.asarray(sa, np.float32), np.asarray(sb, np.float32), f"{what}: s")


# ================================================================== int8 GEMM
@pytest.mark.parametrize("I,J,P", [(1, 1, 1), (3, 5, 7), (37, 53, 19), (9, 33, 3001), (130, 70, 129),
                                   (0, 4, 5), (4, 0, 5), (3, 4, 0)])
def test_gemm_i8(I, J, P):
    rng = rng_for(f"gemm{I},{J},{P}")
    a, b = rand_i8(rng, (I, P)), rand_i8(rng, (J, P))
    got = cu.gemm_i8(a, b)
    assert got.dtype == np.int32 and got.shape == (I, J)
    assert np.array_equal(got, ref.gemm_i8(a, b))
    assert np.array_equal(got.astype(np.int64), a.astype(np.int64) @ b.astype(np.int64).T)


def test_gemm_i8_extremes_at_the_length_bound():
    """All products ±127·127 at P = Q_MAX_P: |acc| = 2^17·127² < 2^31, exact."""
    a = np.full((3, Q_MAX_P), 127, np.int8)
    a[1] = -127
    a[2, ::2] = -127
    b = np.full((2, Q_MAX_P), 127, np.int8)
    b[1] = -127
    want = a.astype(np.int64) @ b.astype(np.int64).T
    got = cu.gemm_i8(a, b)
    assert np.array_equal(got.astype(np.int64), want)
    assert np.array_equal(got, ref.gemm_i8(a, b))


def test_gemm_i8_has_vnni_is_cpu_only():
    assert cu.gemm_i8_has_vnni() is False


# ================================================================== quantizers
def test_quant_weight_rows_special_rows():
    rng = rng_for("qw")
    M, K = 71, 301
    w = rand_bf16(rng, (M, K), 0.02)
    w[3] = 0                                    # zero row: s = +0, q = 0
    w[4] = 0x0001                               # subnormals flush: a zero row as well
    w[5, 7] = 0x7F80                            # +inf: the row's scale is NaN, q = 0
    w[6, 9] = 0x7FC1                            # NaN
    w[7] = 0x7F7F                               # huge: the row sum overflows -> NaN
    w[8, 0] = bf(5.0)                           # an outlier that clips (|t| > 127)
    w[9] = 0x0080                               # all 2^-126: s = 2^-126 * QW_COEF flushes -> zero row
    w[10, 5] = 0xFF80                           # -inf
    w[11] = 0x8000                              # all -0
    w[12, ::3] = 0x0001                         # some subnormals in an ordinary row
    w[13] = bf(np.where(np.arange(K) % 2, 1.0, -1.0))   # constant magnitude: t = ±1/QW_COEF
    w[14, :] = 0
    w[14, 0] = bf(-3.0)                         # a single nonzero: clipped at -127
    w[15] = 0x7F7F
    w[15, 1:] = 0                               # one huge finite value: finite sum, clipped
    got, want = cu.quant_weight_rows(w), ref.quant_weight_rows(w)
    assert_same_quant(got, want, "quant_weight_rows")
    q, s = got
    assert s.shape == (M,)
    for r in (3, 4, 9, 11):
        assert s[r] == 0 and not q[r].any(), r
    for r in (5, 6, 7, 10):
        assert s.view(np.uint32)[r] == 0x7FC00000 and not q[r].any(), r
    assert q[8, 0] == 127 and q[14, 0] == -127 and q[15, 0] == 127
    assert np.abs(q).max() <= 127


@pytest.mark.parametrize("M,K", [(1, 1), (5, 3), (129, 257), (33, 1000), (0, 7), (4, 0)])
def test_quant_weight_rows_shapes(M, K):
    rng = rng_for(f"qws{M},{K}")
    w = rand_bf16(rng, (M, K), 0.05)
    if w.size:
        w = sprinkle(rng, w, SPECIAL_BF16, 0.002)
    assert_same_quant(cu.quant_weight_rows(w), ref.quant_weight_rows(w), f"{M}x{K}")


def test_quant_weight_rows_ties():
    """Rows built so that t = w / s_w falls on exact halves for many elements."""
    rng = rng_for("qwties")
    M, K = 40, 64
    w = np.zeros((M, K), np.uint16)
    for j in range(M):
        k = rng.integers(1, 6)
        w[j] = bf(rng.integers(-8, 9, K) * 2.0 ** -k)       # small multiples of a power of two
    got, want = cu.quant_weight_rows(w), ref.quant_weight_rows(w)
    assert_same_quant(got, want, "ties")


def test_quant_tensor_bf16():
    rng = rng_for("qtb")
    cases = [rand_bf16(rng, (33, 65)), rand_bf16(rng, (3, 5, 7), 100.0), np.zeros((4, 4), np.uint16),
             np.full((3, 3), 0x8000, np.uint16), np.full((5,), 0x0001, np.uint16),
             sprinkle(rng, rand_bf16(rng, (40,)), SPECIAL_BF16[[0, 1, 6, 7, 8]]),
             rand_bf16(rng, (3 * 4096 + 17,)),              # several absmax chunks
             np.zeros((0,), np.uint16), np.zeros((3, 0), np.uint16)]
    big = rand_bf16(rng, (2 * 4096 + 5,))
    big[4096 + 3] = bf(1e6)                                 # the absmax in the second chunk
    cases.append(big)
    for bad in (0x7F80, 0xFF80, 0x7FC1, 0xFFC0):
        x = rand_bf16(rng, (9, 4099))
        x[8, 4000] = bad                                    # the non-finite value in the last chunk
        cases.append(x)
    for i, x in enumerate(cases):
        got = cu.quant_tensor(x)
        assert_same_quant(got, ref.quant_tensor(x), f"case {i} {x.shape}")
        assert got[0].shape == x.shape
    for x in cases[-4:]:
        q, s = cu.quant_tensor(x)
        assert np.float32(s).view(np.uint32) == 0x7FC00000 and not q.any()


def test_quant_tensor_f32_ties_clipping_and_flushed_scales():
    rng = rng_for("qtf")
    # absmax 127: s = 1, inv = 1, t = v exactly, so the halves are ties to even
    ties = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 125.5, 0.49999997, -0.0,
                     3.5, 4.5, -3.5, 1e-40, -1e-40, 64.5, 63.5], np.float32)
    cases = [ties, -ties, ties * np.float32(2.0 ** 100),    # the same with a large scale
             np.array([2.0 ** -120, 2.0 ** -121, 0.0], np.float32),     # s = div(2^-120, 127) flushes
             np.array([2.0 ** -119, -(2.0 ** -120), 2.0 ** -125], np.float32),
             np.array([3.4028235e38, -3.4028235e38, 1.0], np.float32),
             (rng.standard_normal(1000) * 3).astype(np.float32),
             f32_inputs(rng),
             rand_f32(rng, (7, 4097), 1e-30)]
    for s in SPECIAL_F32:
        v = rand_f32(rng, (50,))
        v[17] = s
        cases.append(v)
    for i, v in enumerate(cases):
        assert_same_quant(cu.quant_tensor(v), ref.quant_tensor(v), f"f32 case {i}")
    q, s = cu.quant_tensor(ties)
    assert np.float32(s) == 1.0
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 126, 0, 0, 4, 4, -4, 0, 0, 64, 64]
    q, s = cu.quant_tensor(cases[3])
    assert np.float32(s).view(np.uint32) == 0 and not q.any()


def f32_inputs(rng) -> np.ndarray:
    """Finite random bit patterns (every exponent, subnormals included) and the specials."""
    bits = rng.integers(0, 2 ** 32, 5000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.ascontiguousarray(bits[np.isfinite(bits)])


# ================================================================== Hadamard rotation
def test_hadamard_identity_is_sylvester():
    H = cu.hadamard_rows(np.eye(QB, dtype=np.float32))
    assert_bits_equal(H, ref.hadamard_rows(np.eye(QB, dtype=np.float32)), "H")
    assert np.array_equal(H @ H, QB * np.eye(QB, dtype=np.float32))


@pytest.mark.parametrize("R,C", [(128, 1), (256, 37), (384, 5), (128, 0), (0, 3)])
def test_hadamard_rows(R, C):
    rng = rng_for(f"had{R},{C}")
    v = (rng.standard_normal((R, C)) * 10.0 ** rng.integers(-38, 38, (R, C))).astype(np.float32)
    if v.size:
        v = sprinkle(rng, v, SPECIAL_F32, 0.01)
    assert_bits_equal(cu.hadamard_rows(v), ref.hadamard_rows(v), f"{R}x{C}")
    assert_bits_equal(cu.hadamard_rows(v.astype(np.float64)), ref.hadamard_rows(v.astype(np.float64)), "f64 in")
    w = v.copy()
    cu.hadamard_rows(w)
    assert_bits_equal(w, v, "input unchanged")


def test_hadamard_overflow_and_cancellation():
    v = np.zeros((QB, 4), np.float32)
    v[:, 0] = 3.4028235e38                                   # overflows to inf, then inf - inf = NaN
    v[0, 1], v[1, 1] = 1.0, -1.0
    v[0, 2], v[64, 2] = 2.0 ** -126, -(2.0 ** -127)          # a subnormal input flushes
    v[:, 3] = np.inf
    assert_bits_equal(cu.hadamard_rows(v), ref.hadamard_rows(v), "specials")


# ================================================================== the layer
def check_layer(x, w, dy, what):
    y = cu.qlinear_forward(x, w)
    assert_bits_equal(y, ref.qlinear_forward(x, w), f"{what} y")
    dx, dw = cu.qlinear_backward(dy, x, w)
    rdx, rdw = ref.qlinear_backward(dy, x, w)
    assert_bits_equal(dx, rdx, f"{what} dx")
    assert_bits_equal(dw, rdw, f"{what} dw")
    return y, dx, dw


@pytest.mark.parametrize("N,K,M", [(1, 1, 1), (5, 3, 7), (37, 45, 29), (130, 70, 129), (129, 200, 3),
                                   (3, 129, 257), (20, 0, 5)])
def test_layer(N, K, M):
    rng = rng_for(f"layer{N},{K},{M}")
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    check_layer(x, w, dy, f"{N}x{K}x{M}")


def test_layer_need_flags():
    rng = rng_for("flags")
    x, w, dy = rand_bf16(rng, (9, 11)), rand_bf16(rng, (13, 11), 0.02), rand_bf16(rng, (9, 13), 1e-3)
    rdx, rdw = ref.qlinear_backward(dy, x, w)
    dx, dw = cu.qlinear_backward(dy, x, w, need_dw=False)
    assert dw is None
    assert_bits_equal(dx, rdx, "dx only")
    dx, dw = cu.qlinear_backward(dy, x, w, need_dx=False)
    assert dx is None
    assert_bits_equal(dw, rdw, "dw only")
    assert cu.qlinear_backward(dy, x, w, False, False) == (None, None)


FTZ_MODES = [None] + ([0, 1, 2] if HAVE_GXX else [])


def ftz_mode(ftz):
    """The emulator with the device's flush mode forced (None: as the runtime runs)."""
    import contextlib
    ctx = contextlib.ExitStack()
    if ftz is not None:
        ctx.enter_context(runtime.emulate())
        ctx.enter_context(emu.options(ftz=ftz))
    return ctx


@pytest.mark.parametrize("ftz", FTZ_MODES, ids=lambda m: "default" if m is None else f"emu-ftz{m}")
def test_special_values_in_the_layer(ftz):
    with ftz_mode(ftz):
        rng = rng_for("specials")
        N, K, M = 140, 96, 150
        x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
        w[10] = 0                                   # zero row: y column 0
        w[11, 5] = 0x7FC1                           # NaN in a weight row: y column NaN, dW row NaN
        w[12, 0] = bf(1.0)                          # clipped weight: its dW element is +0
        w[13] = 0x0080                              # flushed step size: a zero row
        x[3, 3] = 0x0001                            # subnormal input: flushed
        dy[5, 6] = 0x8001
        y, dx, dw = check_layer(x, w, dy, "specials")
        assert np.all(y[:, 10] == 0) and np.all(np.isnan(y[:, 11])) and not np.isnan(y[:, 12]).any()
        assert np.all(y[:, 13] == 0)
        assert np.all(np.isnan(dw[11])) and dw[12, 0] == 0 and np.all(np.isnan(dx))
        w[11, 5] = 0
        x[7, 7] = 0x7F80                            # inf activation: the tensor scale is NaN
        y, dx, dw = check_layer(x, w, dy, "inf x")
        assert np.all(np.isnan(y)) and np.all(np.isnan(dw[:10])) and not np.isnan(dx).any()
        dy[0, 0] = 0xFF80                           # inf gradient: both gradients NaN
        y, dx, dw = check_layer(x, w, dy, "inf dy")
        assert np.all(np.isnan(dx)) and np.all(np.isnan(dw[14:]))
        y, dx, dw = check_layer(np.zeros((N, K), np.uint16), w * 0, dy * 0, "zeros")
        assert y.view(np.uint32).max() == 0 and dx.view(np.uint32).max() == 0
        xs = sprinkle(rng, rand_bf16(rng, (N, K)), SPECIAL_BF16, 0.01)
        ws = sprinkle(rng, rand_bf16(rng, (M, K), 0.02), SPECIAL_BF16, 0.001)
        check_layer(xs, ws, rand_bf16(rng, (N, M), 1e-3), "sprinkled")


def test_layer_outliers_and_large_values():
    """Outlier tokens and channels (the case the rotation is for), huge finite values whose row sums
    stay finite, and gradients near the bf16 range's ends."""
    rng = rng_for("outliers")
    N, K, M = 131, 67, 140
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    widen = lambda a: ref.bf16_to_f32(np.ascontiguousarray(a))
    x[::17] = bf(widen(x[::17]) * 80)
    dy[::13] = bf(widen(dy[::13]) * 1e4)
    w[3, 2] = bf(1e30)
    dy[7, 7] = bf(1e38)
    check_layer(x, w, dy, "outliers")
    check_layer(x, w, bf(widen(dy) * np.float32(1e-36)), "tiny gradients")


# ================================================== the simulated int4 / int6 paths (qmax = 7 / 31)
LOW_QMAX = pytest.mark.parametrize("qmax", [QMAX4, QMAX6], ids=["int4", "int6"])


def check_layer4(x, w, dy, what, qmax=QMAX4):
    """The int4 / int6 path (qmax=7 / 31) equals the numpy spec and cpu_ref bit for bit."""
    return check_qlinear_low(cu, x, w, dy, what, qmax)


def quant_w(w, qmax):
    """The weight quantizer kernels alone -> q (M, K) int8, s (M,) fp32, clip (M, K) uint8."""
    M, K = w.shape
    q, s, c = cu._q_weight(M, K, cu._dev(w), True, qmax)
    return cu._host(q), cu._host(s)[:M].copy(), cu._host(c)


def quant_t(v, qmax):
    """The per-tensor quantizer kernels alone -> q (v's shape) int8, s fp32."""
    q = cu._empty(v.shape, np.int8)
    sc = cu._q_tensor(v.size, cu._dev(v), v.dtype == np.float32, q, qmax)
    return cu._host(q), np.float32(cu._host(sc)[0])


def test_int4_signatures():
    for name in ("qlinear_forward", "qlinear_backward"):
        sig = inspect.signature(getattr(cu, name))
        params = list(sig.parameters.values())
        assert params[-1].name == "qmax" and params[-1].default == 127, name   # old calls unchanged
        want = inspect.signature(getattr(ref, name))
        if "qmax" not in want.parameters:   # cpu_ref without the int4 path yet: the rest is the same
            sig = sig.replace(parameters=params[:-1])
        assert sig == want, name


@LOW_QMAX
@pytest.mark.parametrize("N,K,M", [(1, 1, 1), (5, 3, 7), (37, 45, 29), (130, 70, 129), (129, 200, 3),
                                   (3, 129, 257), (20, 0, 5)])
def test_int4_layer(N, K, M, qmax):
    rng = rng_for(f"layer4{N},{K},{M}")
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    y, dx, dw = check_layer4(x, w, dy, f"{N}x{K}x{M}", qmax)
    if N * K * M > 1000:                        # not the int8 layer
        assert not np.array_equal(y, cu.qlinear_forward(x, w))
        assert not np.array_equal(dx, cu.qlinear_backward(dy, x, w)[0])
    if qmax == QMAX6 and N * K * M > 1000:      # nor the int4 path
        assert not np.array_equal(y, cu.qlinear_forward(x, w, qmax=QMAX4))


@LOW_QMAX
def test_int4_need_flags_and_positional_arguments(qmax):
    rng = rng_for("flags4")
    x, w, dy = rand_bf16(rng, (9, 11)), rand_bf16(rng, (13, 11), 0.02), rand_bf16(rng, (9, 13), 1e-3)
    sdx, sdw = spec_quant.qlinear_backward(dy, x, w, qmax)
    dx, dw = cu.qlinear_backward(dy, x, w, True, False, qmax)
    assert dw is None
    assert_bits_equal(dx, sdx, "dx only")
    dx, dw = cu.qlinear_backward(dy, x, w, need_dx=False, qmax=qmax)
    assert dx is None
    assert_bits_equal(dw, sdw, "dw only")
    assert cu.qlinear_backward(dy, x, w, False, False, qmax) == (None, None)
    assert_bits_equal(cu.qlinear_forward(x, w, qmax), spec_quant.qlinear_forward(x, w, qmax), "positional")
    assert_bits_equal(cu.qlinear_forward(x, w, np.int32(127)), cu.qlinear_forward(x, w), "qmax 127 is int8")


@LOW_QMAX
@pytest.mark.parametrize("ftz", FTZ_MODES, ids=lambda m: "default" if m is None else f"emu-ftz{m}")
def test_int4_special_values_in_the_layer(ftz, qmax):
    with ftz_mode(ftz):
        rng = rng_for("specials4")
        N, K, M = 140, 96, 150
        x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
        w[10] = 0                                   # zero row: y column 0
        w[11, 5] = 0x7FC1                           # NaN in a weight row: y column NaN, dW row NaN
        w[12, 0] = bf(0.2 if qmax == QMAX4 else 0.35)   # clipped at int4 (int6): about 10 (50) steps; not at int8
        w[13] = 0x0080                              # flushed step size: a zero row
        w[14] = bf(np.full(K, 2.0 ** -122))         # s_w = 2^-122 QW_COEF4 (6): a normal step size
        w[15, :3] = 0x7F7F                          # the row sum overflows: NaN step
        x[3, 3] = 0x0001                            # subnormal input: flushed
        dy[5, 6] = 0x8001
        check = lambda x, w, dy, what: check_layer4(x, w, dy, what, qmax)
        y, dx, dw = check(x, w, dy, "specials")
        assert np.all(y[:, 10] == 0) and np.all(np.isnan(y[:, 11])) and not np.isnan(y[:, 12]).any()
        assert np.all(y[:, 13] == 0) and np.all(np.isnan(y[:, 15]))
        assert np.all(np.isnan(dw[11])) and dw[12, 0].view(np.uint32) == 0 and np.all(np.isnan(dx))
        assert cu.qlinear_backward(dy, x, w)[1][12, 0] != 0          # int8: not clipped
        w[11, 5] = 0
        w[15] = 0
        x[7, 7] = 0x7F80                            # inf activation: the tensor scale is NaN
        y, dx, dw = check(x, w, dy, "inf x")
        assert np.all(np.isnan(y)) and np.all(np.isnan(dw[:10])) and not np.isnan(dx).any()
        dy[0, 0] = 0xFF80                           # inf gradient: both gradients NaN
        y, dx, dw = check(x, w, dy, "inf dy")
        assert np.all(np.isnan(dx)) and np.all(np.isnan(dw[16:]))
        y, dx, dw = check(np.zeros((N, K), np.uint16), w * 0, dy * 0, "zeros")
        assert y.view(np.uint32).max() == 0 and dx.view(np.uint32).max() == 0 and dw.view(np.uint32).max() == 0
        xs = sprinkle(rng, rand_bf16(rng, (N, K)), SPECIAL_BF16, 0.01)
        ws = sprinkle(rng, rand_bf16(rng, (M, K), 0.02), SPECIAL_BF16, 0.001)
        check(xs, ws, rand_bf16(rng, (N, M), 1e-3), "sprinkled")
        tx = bf(np.where(rng.integers(0, 2, (N, K)) == 1, 1.0, -1.0) * 2.0 ** TINY_E[qmax])   # s_x: / qmax normal, / 127 flushed
        check(tx, rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3), "tiny activations")


@LOW_QMAX
def test_int4_quantizers_levels_within_7(qmax):
    """The quantizer kernels with qmax 7 (31): every level in [-7, 7] ([-31, 31]), both ends reached,
    ties to even, clip flags at |t| > qmax, the spec's levels and scales; qmax 127 gives other levels."""
    rng = rng_for("levels4")
    M, K = 71, 301
    w = rand_bf16(rng, (M, K), 0.02)
    w[3] = 0                                    # zero row
    w[5, 7] = 0x7F80                            # NaN step
    w[8, 0] = bf(0.3)                           # about 15 (50) steps at int4 (int6): clipped; not at int8
    w[8, 1] = bf(-0.3)                          # the same, negative: both ends of the levels
    w[9] = 0x0080                               # flushed step size
    w[13] = bf(np.where(np.arange(K) % 2, 1.0, -1.0))   # constant magnitude: t = ±1/QW_COEF4 = ±1.32... (int6: ±2.78...)
    q, s, clip = quant_w(w, qmax)
    wq, ws, wclip = spec_quant.quant_weight_rows(w, with_clip=True, qmax=qmax)
    assert np.array_equal(q, wq) and np.array_equal(clip, wclip)
    assert_bits_equal(s, ws, "s_w")
    assert q.min() == -qmax and q.max() == qmax and clip[8, 0] == 1 and (clip[5] == 2).all() and not q[5].any()
    assert s[3] == 0 and s[9] == 0 and (np.abs(q[13]) == {QMAX4: 1, QMAX6: 3}[qmax]).all()
    q8, s8, clip8 = quant_w(w, 127)
    assert clip8[8, 0] == 0 and np.abs(q8.astype(np.int64)).max() > qmax and not np.array_equal(s, s8)
    assert (clip.astype(np.int64) == 1).sum() > (clip8.astype(np.int64) == 1).sum()
    big = rand_bf16(rng, (3 * 4096 + 17,))          # several absmax chunks
    h, e = qmax - 0.5, TINY_E[qmax]                 # the largest tie below the clamp; a tiny absmax
    cases = [(rng.standard_normal(1000) * 3).astype(np.float32), big, rand_bf16(rng, (33, 65)),
             np.array([qmax, 0.5, 1.5, 2.5, -0.5, -2.5, h, -h, 3.5, -1.5, 5.5, -4.5, -0.0], np.float32),
             np.array([2.0 ** e, -(2.0 ** (e - 1)), 2.0 ** -126], np.float32),    # / qmax normal (/ 127 flushes)
             np.array([2.0 ** (e - 1), 0.0], np.float32),                         # / qmax flushes
             np.array([1.0, np.nan], np.float32), sprinkle(rng, rand_bf16(rng, (40,)), SPECIAL_BF16[[0, 1, 6, 7, 8]])]
    for i, v in enumerate(cases):
        qt, st = quant_t(v, qmax)
        wq, ws = (spec_quant.quant_tensor_f32 if v.dtype == np.float32 else spec_quant.quant_tensor)(v, qmax)
        assert np.array_equal(qt, wq.reshape(v.shape)), i
        assert_bits_equal(st, np.float32(ws), f"s case {i}")
        assert np.abs(qt.astype(np.int64)).max() <= qmax, i
    qt, st = quant_t(cases[3], qmax)
    assert st == 1.0 and qt.tolist() == [qmax, 0, 2, 2, 0, -2, qmax - 1, 1 - qmax, 4, -2, 6, -4, 0]
    assert quant_t(cases[4], qmax)[1] > 0 and quant_t(cases[4], 127)[1] == 0 and quant_t(cases[5], qmax)[1] == 0
    assert np.float32(quant_t(cases[6], qmax)[1]).view(np.uint32) == 0x7FC00000
    q0 = quant_t(cases[0], qmax)[0]
    assert np.abs(q0.astype(np.int64)).max() == qmax and np.abs(quant_t(cases[0], 127)[0].astype(np.int64)).max() == 127


@pytest.mark.parametrize("bad", [8, 0, -7, 32, 255, 7.0, True, "7", None])
def test_qmax_validated(bad):
    from mlx_open1b.parity import spec_backend
    x, w, dy = np.zeros((4, 8), np.uint16), np.zeros((3, 8), np.uint16), np.zeros((4, 3), np.uint16)
    msg = f"qmax: expected 127 (int8), 31 (the simulated int6 path) or 7 (the simulated int4 path), got {bad!r}"
    for mod in (cu, spec_backend):
        with pytest.raises(ValueError) as e1:
            mod.qlinear_forward(x, w, qmax=bad)
        with pytest.raises(ValueError) as e2:
            mod.qlinear_backward(dy, x, w, qmax=bad)
        assert str(e1.value) == str(e2.value) == msg


# ================================================================== §6.10 the int8 attention forward
def _rng_i8(*key) -> np.random.Generator:
    return np.random.default_rng([0xA778, *key])


def check_attention_i8(q, k, v, W, scale, what):
    """cu.attention_forward_i8 equals the numpy spec and the C reference bit for bit."""
    return check_attention_i8_backend(cu.attention_forward_i8, q, k, v, W, scale, what)


def test_attention_forward_i8_same_signature_as_cpu_ref():
    assert inspect.signature(cu.attention_forward_i8) == inspect.signature(ref.attention_forward_i8)


@pytest.mark.parametrize("B,T,H,G,D,W", I8_SHAPES)
def test_attention_forward_i8_matches_spec(B, T, H, G, D, W):
    """Blocks crossed (T not a multiple of 64), windows, grouped-query heads; plain inputs, then
    zero / subnormal / tiny / huge / tie / +inf / NaN value rows and finite specials in q and k."""
    attention_i8_matches_spec(check_attention_i8, _rng_i8(20, B, T, H, G, D, W), B, T, H, G, D, W)


@pytest.mark.parametrize("ftz", FTZ_MODES, ids=lambda m: "default" if m is None else f"emu-ftz{m}")
def test_attention_forward_i8_flush_modes(ftz):
    """The same bits whatever the emulated device's flushing (tiny values, flushed scales)."""
    with ftz_mode(ftz):
        rng = _rng_i8(23)
        q, k, v = attention_i8_inputs(rng, 1, 67, 2, 1, 4, specials=True)
        check_attention_i8(q, k, v, 0, 1.0, f"ftz={ftz}")
        tiny = f32_to_bf16((rng.uniform(-1, 1, v.shape) * 2.0 ** -112).astype(np.float32))
        check_attention_i8(q, k, tiny, 0, 1.0, f"tiny values, ftz={ftz}")


def test_attention_forward_i8_special_rows():
    attention_i8_special_rows(check_attention_i8, ref.attention_forward, _rng_i8(21))


def test_attention_forward_i8_ties_to_even():
    attention_i8_ties_to_even(check_attention_i8)


def run_vquant(v):
    """The kernel o1b_attention_vquant alone -> q_v (B,T,G,D) int8, s_v (B,T,G) fp32."""
    B, T, G, D = v.shape
    n = B * T * G
    qv, sv = cu._empty((B, T, G, D), np.int8), cu._empty((B, T, G), np.float32)
    cu._launch1d("attention.cu", "o1b_attention_vquant", n, np.int64(n), np.int64(D), cu._dev(v), qv, sv)
    return cu._host(qv), cu._host(sv)


def test_attention_vquant_kernel_is_the_per_tensor_rule():
    attention_vquant_is_the_per_tensor_rule(run_vquant, _rng_i8(22))


def test_attention_forward_i8_empty_and_bad_arguments():
    attention_i8_empty_and_bad_arguments(cu.attention_forward_i8, ref.attention_forward_i8)


# ================================================================== argument errors
BAD_CALLS = [
    ("w K", lambda o: o.qlinear_forward(np.zeros((4, 8), np.uint16), np.zeros((3, 9), np.uint16))),
    ("x dtype", lambda o: o.qlinear_forward(np.zeros((4, 8), np.float32), np.zeros((3, 8), np.uint16))),
    ("dy shape", lambda o: o.qlinear_backward(np.zeros((4, 4), np.uint16), np.zeros((4, 8), np.uint16),
                                              np.zeros((3, 8), np.uint16))),
    ("w layout", lambda o: o.quant_weight_rows(np.zeros((8, 3), np.uint16).T)),
    ("-128", lambda o: o.gemm_i8(np.full((2, 2), -128, np.int8), np.zeros((2, 2), np.int8))),
    ("P bound", lambda o: o.gemm_i8(np.zeros((1, Q_MAX_P + 1), np.int8), np.zeros((1, Q_MAX_P + 1), np.int8))),
    ("gemm dtype", lambda o: o.gemm_i8(np.zeros((2, 2), np.int16), np.zeros((2, 2), np.int8))),
    ("gemm P", lambda o: o.gemm_i8(np.zeros((2, 3), np.int8), np.zeros((2, 2), np.int8))),
    ("hadamard rows", lambda o: o.hadamard_rows(np.zeros((100, 3), np.float32))),
    ("hadamard ndim", lambda o: o.hadamard_rows(np.zeros((128,), np.float32))),
    ("quant_tensor dtype", lambda o: o.quant_tensor(np.zeros(3, np.float64))),
    ("backward N bound", lambda o: o.qlinear_backward(np.zeros((Q_MAX_P + 1, 1), np.uint16),
                                                      np.zeros((Q_MAX_P + 1, 1), np.uint16),
                                                      np.zeros((1, 1), np.uint16))),
    ("forward K bound", lambda o: o.qlinear_forward(np.zeros((1, Q_MAX_P + 1), np.uint16),
                                                    np.zeros((1, Q_MAX_P + 1), np.uint16))),
]


@pytest.mark.parametrize("what,call", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_same_error(what, call):
    with pytest.raises(ValueError) as e_ref:
        call(ref)
    with pytest.raises(ValueError) as e_cu:
        call(cu)
    assert str(e_cu.value) == str(e_ref.value)


# ================================================================== compile check (nvcc)
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles_quant(arch, tmp_path):
    """quant.cu, exactly as handed to NVRTC, compiles to PTX with CuPy's flush mode and our options,
    and the PTX holds no fused multiply-add on fp32."""
    src = tmp_path / "quant.cu"
    src.write_text(runtime.read_source("quant.cu"))
    ptx = tmp_path / "quant.ptx"
    proc = subprocess.run([NVCC, "--ptx", f"-arch={arch}", "-ftz=true", *runtime.OPTIONS, str(src), "-o",
                           str(ptx)], capture_output=True, text=True)
    assert proc.returncode == 0, f"quant.cu ({arch}):\n{proc.stdout}{proc.stderr}"
    text = ptx.read_text()
    assert "fma.rn.f32" not in text and "fma.rn.ftz.f32" not in text, "FMA in the PTX"
    for kernel in emu.kernel_names(runtime.read_source("quant.cu")):
        assert f".entry {kernel}(" in text, kernel
