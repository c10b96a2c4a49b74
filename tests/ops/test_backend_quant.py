"""The int8 family on every GPU backend (metal, cuda: on their device, else their kernel sources on
the CPU emulators) against the C reference and the numpy spec, bit for bit: the quantizers (per-row
weight step sizes, per-tensor scales, the level kernels), the exact int8 GEMM, the Walsh-Hadamard
rotation (fp32 and integer), the quantized linear layer (CONTRACT.md §6.9) with its simulated int4
and int6 paths (qmax = 7 / 31), the int8 attention forward (§6.10: the value-row quantization
kernel and the int8 block product), the qmax check, and bad arguments.

Each test runs on each backend (the `gpu` fixture, tests/ops/conftest.py). Shapes are multiples of
no block (QB, the absmax chunks, any threadgroup); inputs include NaN/inf rows and tensors, zero
rows, subnormals (inputs and flushed scales), clipped weights and rounding ties. Floats are compared
as bit patterns, integer outputs exactly. The cases come from two sets that each held for one
backend and must hold for both: case ids starting with m use the `seeded` generator, those starting
with c the `named` one. A few kernels are reached below their op (the level kernel with given
scales, the integer rotation, the value-row quantizer): each backend's way in is in the adapters.
"""
from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from mlx_open1b.spec.arith import f32_to_bf16

from helpers import (I8_SHAPES, QMAX4, QMAX6, SPECIAL_BF16, SPECIAL_F32, TINY_E, assert_bits_equal,
                     attention_i8_empty_and_bad_arguments, attention_i8_inputs, attention_i8_matches_spec,
                     attention_i8_special_rows, attention_i8_ties_to_even,
                     attention_vquant_is_the_per_tensor_rule, rand_bf16, rand_f32, sprinkle)
# the references (cpu_ref, the numpy spec), each result computed once for both backends
from shared_reference import CPU_REF as C, SPEC_QUANT as SQ, check_attention_i8_backend, check_qlinear_low, scope

OPS = ("gemm_i8", "hadamard_rows", "quant_weight_rows", "quant_tensor", "qlinear_forward", "qlinear_backward",
       "attention_forward_i8")
QB, Q_MAX_P = C.quant.QB, C.quant.Q_MAX_P
LOW_QMAX = pytest.mark.parametrize("qmax", [QMAX4, QMAX6], ids=["int4", "int6"])


@pytest.fixture(autouse=True)
def _references_shared_by_the_backends(request):
    scope(request.function)


def seeded(*key) -> np.random.Generator:
    return np.random.default_rng([0x18A7, *key])


def named(name: str) -> np.random.Generator:
    return np.random.default_rng([ord(c) for c in name])


def rand_i8(rng, shape):
    return rng.integers(-127, 128, shape, dtype=np.int64).astype(np.int8)


def bf(v) -> np.ndarray:
    return f32_to_bf16(np.asarray(v, np.float32))


def case_id(case) -> str:
    return case[0] + "-".join(str(v) for v in case[1:])


def assert_same_q(got, want, what):
    (qa, sa), (qb, sb) = got, want
    assert qa.dtype == np.int8 and qa.shape == qb.shape, what
    bad = np.argwhere(qa != qb)
    assert not bad.size, f"{what}: q differs at {tuple(bad[0])}: {qa[tuple(bad[0])]} vs {qb[tuple(bad[0])]}"
    assert np.asarray(sa).dtype == np.float32, what
    assert_bits_equal(np.asarray(sa, np.float32), np.asarray(sb, np.float32), f"{what} scale")


def check_layer(gpu, x, w, dy, what):
    y = gpu.qlinear_forward(x, w)
    assert_bits_equal(y, C.qlinear_forward(x, w), f"{what} y")
    dx, dw = gpu.qlinear_backward(dy, x, w)
    want_dx, want_dw = C.qlinear_backward(dy, x, w)
    assert_bits_equal(dx, want_dx, f"{what} dx")
    assert_bits_equal(dw, want_dw, f"{what} dw")
    return y, dx, dw


# ------------------------------------------------------------------ the adapters: kernels below the ops
def quant_w(gpu, w, qmax=127):
    """The weight quantizer kernels alone -> q (M, K) int8, s (M,) fp32, clip (M, K) uint8 (1 clipped,
    2 NaN row)."""
    M, K = w.shape
    if gpu.NAME == "metal":
        return gpu._quant_w(w, M, K, qmax)
    assert gpu.NAME == "cuda", f"no adapter for backend {gpu.NAME!r}"
    q, s, c = gpu._q_weight(M, K, gpu._dev(w), True, qmax)
    return gpu._host(q), gpu._host(s)[:M].copy(), gpu._host(c)


def quant_t(gpu, v, qmax=127):
    """The per-tensor quantizer kernels alone on bf16 or fp32 v -> q (v's shape) int8, s fp32."""
    if gpu.NAME == "metal":
        q, s = gpu._quant_f32(v if v.dtype == np.float32 else gpu.bf16_to_f32(v), qmax)
        return q, np.float32(s[0])
    assert gpu.NAME == "cuda", f"no adapter for backend {gpu.NAME!r}"
    q = gpu._empty(v.shape, np.int8)
    sc = gpu._q_tensor(v.size, gpu._dev(v), v.dtype == np.float32, q, qmax)
    return gpu._host(q), np.float32(gpu._host(sc)[0])


def quant_levels(gpu, v, s, qmax):
    """The level kernel with given scales: row r of v (fp32, K per row) quantized with step s[r]
    -> q (rows, K) int8, clip (rows, K) uint8 and the values the clip flags were computed from.
    Metal's quant_apply kernel does both from fp32 values; on cuda the levels come from
    o1b_q_tensor_levels (fp32 values, one row at a time) and the clip flags from the weight
    quantizer's row levels (quant.cu's o1b_q_weight_row, in a kernel taking the steps given), which
    read bf16 weights: the values rounded to bf16."""
    K = v.size
    vv = np.tile(v, s.size)
    if gpu.NAME == "metal":
        q, clip = gpu._run("quant_apply", [vv, s, gpu._i64(K)], [((vv.size,), np.int8), ((vv.size,), np.uint8)],
                           (vv.size, 1, 1), template=[("PER_ROW", 1), ("QMAX", qmax)])
        return q.reshape(s.size, K), clip.reshape(s.size, K), v
    assert gpu.NAME == "cuda", f"no adapter for backend {gpu.NAME!r}"
    inv = np.array([C.mathfn.scalar_div(1.0, float(x)) if np.isfinite(x) and x != 0 else 0.0 for x in s], np.float32)
    rows = []
    for r in range(s.size):
        q = gpu._empty((K,), np.int8)
        gpu._launch1d("quant.cu", "o1b_q_tensor_levels", K, np.int64(K), gpu._dev(np.zeros(1, np.uint16)),
                      gpu._dev(v), np.int32(1), gpu._dev(np.array([s[r], inv[r]], np.float32)), q, np.int32(qmax))
        rows.append(gpu._host(q))
    w = f32_to_bf16(vv).reshape(s.size, K)
    M = s.size
    qw, clip = gpu._empty((M, K), np.int8), gpu._empty((M, K), np.uint8)
    from mlx_open1b.cuda import runtime as cuda_runtime
    mod = cuda_runtime.CudaModule(cuda_runtime.read_source("quant.cu") + WEIGHT_ROW_SRC, name="quant.cu + test")
    mod.get_function("test_weight_rows")((M,), (32,), (np.int64(K), gpu._dev(w), gpu._dev(s), gpu._dev(inv), qw, clip,
                                                       np.int32(qmax)))
    return np.stack(rows), gpu._host(clip), C.bf16_to_f32(w[0])


WEIGHT_ROW_SRC = """
extern "C" __global__ void test_weight_rows(i64 K, const bf16 *w, const float *s, const float *inv, i8 *q,
                                            unsigned char *clip, int qmax) {
    i64 j = blockIdx.x;
    o1b_q_weight_row(K, w + j * K, s[j], inv[j], q + j * K, clip + j * K, 1, qmax, (int)threadIdx.x, 32);
}
"""


def rotate_i8(gpu, q):
    """The integer rotation (the backward's operands): q (R, C) int8 zero-padded to a multiple of QB
    rows, rotated in int32 butterflies, converted by i2f -> fp32 (padded rows, C)."""
    R, C_ = q.shape
    Rp = (R + QB - 1) // QB * QB
    if gpu.NAME == "metal":
        return gpu._rotate("hadamard_i8", q, R, C_)
    assert gpu.NAME == "cuda", f"no adapter for backend {gpu.NAME!r}"
    f, _ = gpu._q_rotated("o1b_q_rotate_i8", Rp, C_, C_, (np.int64(R), np.int64(Rp), np.int64(C_), gpu._dev(q)))
    return gpu._host(f)


def vquant(gpu, v):
    """The value-row quantization kernel of the int8 attention alone -> q_v (B,T,G,D) int8, s_v (B,T,G) fp32."""
    B, T, G, D = v.shape
    if gpu.NAME == "metal":
        return gpu._run("attention_vquant", [v.reshape(-1), gpu._i64(D)],
                        [((B, T, G, D), np.int8), ((B, T, G), np.float32)], (B * T * G, 1, 1), (64, 1, 1))
    assert gpu.NAME == "cuda", f"no adapter for backend {gpu.NAME!r}"
    n = B * T * G
    qv, sv = gpu._empty((B, T, G, D), np.int8), gpu._empty((B, T, G), np.float32)
    gpu._launch1d("attention.cu", "o1b_attention_vquant", n, np.int64(n), np.int64(D), gpu._dev(v), qv, sv)
    return gpu._host(qv), gpu._host(sv)


# ------------------------------------------------------------------ signatures
def test_same_signatures_as_cpu_ref(gpu):
    for name in OPS:
        got, want = inspect.signature(getattr(gpu, name)), inspect.signature(getattr(C, name))
        if name.startswith("qlinear_") and "qmax" not in want.parameters:
            # cpu_ref without the int4 path yet: the rest is the same
            got = got.replace(parameters=[p for n, p in got.parameters.items() if n != "qmax"])
        assert got == want, name
    for name in ("qlinear_forward", "qlinear_backward"):   # qmax the last positional, 127 by default: old calls unchanged
        params = [p for p in inspect.signature(getattr(gpu, name)).parameters.values()
                  if p.kind != inspect.Parameter.KEYWORD_ONLY]
        assert params[-1].name == "qmax" and params[-1].default == 127, name


# ------------------------------------------------------------------ int8 GEMM
GEMM_SHAPES = [(1, 1, 1), (3, 5, 7), (37, 53, 19), (9, 33, 3001), (130, 70, 1030), (2, 3, 0), (130, 70, 129),
               (0, 4, 5), (4, 0, 5), (3, 4, 0)]


@pytest.mark.parametrize("I,J,P", GEMM_SHAPES)
def test_gemm_i8_exact(gpu, I, J, P):
    rng = seeded(1, I, J, P)
    a, b = rand_i8(rng, (I, P)), rand_i8(rng, (J, P))
    if P and I and J:
        a[0] = 127                      # extreme rows and columns
        b[-1] = -127
    got = gpu.gemm_i8(a, b)
    assert got.dtype == np.int32 and got.shape == (I, J)
    want = a.astype(np.int64) @ b.astype(np.int64).T
    assert np.array_equal(got.astype(np.int64), want)
    assert np.array_equal(got, C.gemm_i8(a, b))


def test_gemm_i8_extremes_at_the_length_bound(gpu):
    """All products ±127·127 at P = Q_MAX_P: |acc| = 2^17·127² < 2^31, exact."""
    P = Q_MAX_P
    a = np.full((3, P), 127, np.int8)
    a[1] = -127
    a[2, ::2] = -127
    b = np.full((2, P), 127, np.int8)
    b[1] = -127
    want = a.astype(np.int64) @ b.astype(np.int64).T
    assert np.abs(want).max() == P * 127 * 127
    got = gpu.gemm_i8(a, b)
    assert np.array_equal(got.astype(np.int64), want)
    assert np.array_equal(got, C.gemm_i8(a, b))


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
def test_quant_weight_rows(gpu, M_, K):
    rng = seeded(2, M_, K)
    w = special_weights(rng, M_, K) if K > 10 else rand_bf16(rng, (M_, K), 0.02)
    got, want = gpu.quant_weight_rows(w), C.quant_weight_rows(w)
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


def test_quant_weight_rows_special_rows(gpu):
    rng = named("qw")
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
    got, want = gpu.quant_weight_rows(w), C.quant_weight_rows(w)
    assert_same_q(got, want, "quant_weight_rows")
    q, s = got
    assert s.shape == (M,)
    for r in (3, 4, 9, 11):
        assert s[r] == 0 and not q[r].any(), r
    for r in (5, 6, 7, 10):
        assert s.view(np.uint32)[r] == 0x7FC00000 and not q[r].any(), r
    assert q[8, 0] == 127 and q[14, 0] == -127 and q[15, 0] == 127
    assert np.abs(q).max() <= 127


@pytest.mark.parametrize("M,K", [(1, 1), (5, 3), (129, 257), (33, 1000), (0, 7), (4, 0), (0, 5), (3, 0)])
def test_quant_weight_rows_shapes(gpu, M, K):
    rng = named(f"qws{M},{K}")
    w = rand_bf16(rng, (M, K), 0.05)
    if w.size:
        w = sprinkle(rng, w, SPECIAL_BF16, 0.002)
    assert_same_q(gpu.quant_weight_rows(w), C.quant_weight_rows(w), f"{M}x{K}")
    z = np.zeros((M, K), np.uint16)
    assert_same_q(gpu.quant_weight_rows(z), C.quant_weight_rows(z), f"zeros {M}x{K}")


def test_quant_weight_rows_ties(gpu):
    """Rows built so that t = w / s_w falls on exact halves for many elements."""
    rng = named("qwties")
    M, K = 40, 64
    w = np.zeros((M, K), np.uint16)
    for j in range(M):
        k = rng.integers(1, 6)
        w[j] = bf(rng.integers(-8, 9, K) * 2.0 ** -k)       # small multiples of a power of two
    assert_same_q(gpu.quant_weight_rows(w), C.quant_weight_rows(w), "ties")


@pytest.mark.parametrize("shape", [(33, 65), (40,), (4, 4), (3, 4097), (9000,), (2, 3, 5), (0,), ()])
def test_quant_tensor_bf16(gpu, shape):
    rng = seeded(3, *shape)
    x = rand_bf16(rng, shape) if shape else np.array(0x3F80, np.uint16)
    if x.size > 4:
        x = sprinkle(rng, x, SPECIAL_BF16[[0, 1, 6, 7, 8, 9, 12, 13, 14, 15]], 0.1)
    assert_same_q(gpu.quant_tensor(x), C.quant_tensor(x), f"quant_tensor bf16 {shape}")
    z = np.zeros(shape, np.uint16)
    assert_same_q(gpu.quant_tensor(z), C.quant_tensor(z), f"quant_tensor zeros {shape}")


def test_quant_tensor_bf16_cases(gpu):
    rng = named("qtb")
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
        got = gpu.quant_tensor(x)
        assert_same_q(got, C.quant_tensor(x), f"case {i} {x.shape}")
        assert got[0].shape == x.shape
    for x in cases[-4:]:
        q, s = gpu.quant_tensor(x)
        assert np.float32(s).view(np.uint32) == 0x7FC00000 and not q.any()


@pytest.mark.parametrize("bad", [0x7F80, 0xFF80, 0x7FC1, 0xFFC0])
def test_quant_tensor_non_finite(gpu, bad):
    rng = seeded(4, bad)
    for shape, pos in (((8, 8), (2, 2)), ((3, 5000), (2, 4999)), ((3, 5000), (0, 0))):
        x = rand_bf16(rng, shape)
        x[pos] = bad
        q, s = gpu.quant_tensor(x)
        assert np.float32(s).view(np.uint32) == 0x7FC00000 and not q.any()
        assert_same_q((q, s), C.quant_tensor(x), f"quant_tensor {bad:#x} at {pos}")


def test_quant_tensor_f32(gpu):
    rng = seeded(5)
    v = (rng.standard_normal(10000) * 3).astype(np.float32)
    v[0] = 1e-40                                 # subnormal: flushed
    v[9999] = -40.0                              # the max in the last block
    assert_same_q(gpu.quant_tensor(v), C.quant_tensor(v), "quant_tensor f32")
    # ties go to even (s = 1 exactly), the clamp, a max that is itself a subnormal
    t = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 3.5, -1.5], np.float32)
    q, s = gpu.quant_tensor(t)
    assert s == 1.0 and q.tolist() == [127, 0, 2, 2, 0, -2, 126, -126, 4, -2]
    assert_same_q((q, s), C.quant_tensor(t), "ties")
    for v in (np.array([1e-40, -1e-41], np.float32),                  # flushed to a zero tensor
              np.array([2.0 ** -120, 2.0 ** -126], np.float32),         # a / 127 flushes: s = +0
              np.array([3.4028235e38, -3.4028235e38, 1.0], np.float32),
              sprinkle(rng, rand_f32(rng, (50, 7), 1e-30), SPECIAL_F32[[0, 1, 5, 6, 7, 8, 9, 12, 13]], 0.2),
              np.array([np.inf, 1.0], np.float32), np.array([1.0, np.nan], np.float32)):
        assert_same_q(gpu.quant_tensor(v), C.quant_tensor(v), f"quant_tensor f32 {v.ravel()[:3]}")


def finite_bit_patterns(rng) -> np.ndarray:
    """Finite random bit patterns (every exponent, subnormals included)."""
    bits = rng.integers(0, 2 ** 32, 5000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.ascontiguousarray(bits[np.isfinite(bits)])


def test_quant_tensor_f32_ties_clipping_and_flushed_scales(gpu):
    rng = named("qtf")
    # absmax 127: s = 1, inv = 1, t = v exactly, so the halves are ties to even
    ties = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 125.5, 0.49999997, -0.0,
                     3.5, 4.5, -3.5, 1e-40, -1e-40, 64.5, 63.5], np.float32)
    cases = [ties, -ties, ties * np.float32(2.0 ** 100),    # the same with a large scale
             np.array([2.0 ** -120, 2.0 ** -121, 0.0], np.float32),     # s = div(2^-120, 127) flushes
             np.array([2.0 ** -119, -(2.0 ** -120), 2.0 ** -125], np.float32),
             np.array([3.4028235e38, -3.4028235e38, 1.0], np.float32),
             (rng.standard_normal(1000) * 3).astype(np.float32),
             finite_bit_patterns(rng),
             rand_f32(rng, (7, 4097), 1e-30)]
    for s in SPECIAL_F32:
        v = rand_f32(rng, (50,))
        v[17] = s
        cases.append(v)
    for i, v in enumerate(cases):
        assert_same_q(gpu.quant_tensor(v), C.quant_tensor(v), f"f32 case {i}")
    q, s = gpu.quant_tensor(ties)
    assert np.float32(s) == 1.0
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 126, 0, 0, 4, 4, -4, 0, 0, 64, 64]
    q, s = gpu.quant_tensor(cases[3])
    assert np.float32(s).view(np.uint32) == 0 and not q.any()


@pytest.mark.parametrize("qmax", [127, 31, 7])
def test_quant_levels_and_clip_flags(gpu, qmax):
    """The level kernel itself (int8, or the simulated int6 / int4 paths): per-row scales of powers
    of two (inv exact), values at ties, at the clamp (127, 31 or 7), past it, overflowing to inf;
    a NaN-scale row and a zero-scale row."""
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.5, -127.5, 127.0, 128.0, 3e38, -3e38,
                  0.49999997, -2.5000002, 6.5, -6.5, 7.0, -7.0, 7.5, -7.5, 8.0, 6.4999995, 7.0000005,
                  3.5, 4.5, 5.5, 30.5, -30.5, 31.0, 31.5, -31.5, 32.0, 31.000002], np.float32)
    s = np.array([1.0, 0.5, 2.0 ** -100, np.nan, 0.0], np.float32)
    q, clip, vc = quant_levels(gpu, v, s, qmax)
    with np.errstate(over="ignore"):
        for r in range(3):
            t = (v * (np.float32(1) / s[r])).astype(np.float32)
            assert q[r].tolist() == np.clip(np.rint(t), -qmax, qmax).astype(np.int64).tolist(), r
            tc = (vc * (np.float32(1) / s[r])).astype(np.float32)
            assert clip[r].tolist() == (np.abs(tc) > qmax).astype(np.int64).tolist(), r
    assert np.abs(q.astype(np.int64)).max() == qmax
    assert not q[3].any() and (clip[3] == 2).all()
    assert not q[4].any() and not clip[4].any()


# ------------------------------------------------------------------ Hadamard
def test_hadamard_identity_and_specials(gpu):
    Hf = gpu.hadamard_rows(np.eye(QB, dtype=np.float32))
    assert_bits_equal(Hf, C.hadamard_rows(np.eye(QB, dtype=np.float32)), "H")
    assert np.array_equal(Hf @ Hf, QB * np.eye(QB, dtype=np.float32))
    rng = seeded(6)
    v = (rng.standard_normal((3 * QB, 37)) * 10.0 ** rng.integers(-30, 30, (3 * QB, 37))).astype(np.float32)
    v[0, 0], v[1, 1], v[2, 2], v[200, 3], v[300, 4] = 1e-40, np.inf, np.nan, -np.inf, 3.4e38
    v[130:140, 5] = 2.0 ** -126
    v[141, 5] = -(2.0 ** -126) * 1.5
    v = sprinkle(rng, v, SPECIAL_F32, 0.01)
    src = v.copy()
    got = gpu.hadamard_rows(v)
    assert np.array_equal(v.view(np.uint32), src.view(np.uint32))          # the input is not changed
    assert_bits_equal(got, C.hadamard_rows(v), "hadamard_rows")
    for shape in ((QB, 1), (2 * QB, 0), (0, 5)):
        f = rand_f32(rng, shape)
        assert_bits_equal(gpu.hadamard_rows(f), C.hadamard_rows(f), f"hadamard_rows {shape}")
    f64 = rng.standard_normal((QB, 3))                  # converted to fp32 first, as in cpu_ref
    assert_bits_equal(gpu.hadamard_rows(f64), C.hadamard_rows(f64), "hadamard_rows float64 input")


@pytest.mark.parametrize("R,C_", [(128, 1), (256, 37), (384, 5), (128, 0), (0, 3)])
def test_hadamard_rows(gpu, R, C_):
    rng = named(f"had{R},{C_}")
    v = (rng.standard_normal((R, C_)) * 10.0 ** rng.integers(-38, 38, (R, C_))).astype(np.float32)
    if v.size:
        v = sprinkle(rng, v, SPECIAL_F32, 0.01)
    assert_bits_equal(gpu.hadamard_rows(v), C.hadamard_rows(v), f"{R}x{C_}")
    assert_bits_equal(gpu.hadamard_rows(v.astype(np.float64)), C.hadamard_rows(v.astype(np.float64)), "f64 in")
    w = v.copy()
    gpu.hadamard_rows(w)
    assert_bits_equal(w, v, "input unchanged")


def test_hadamard_overflow_and_cancellation(gpu):
    v = np.zeros((QB, 4), np.float32)
    v[:, 0] = 3.4028235e38                                   # overflows to inf, then inf - inf = NaN
    v[0, 1], v[1, 1] = 1.0, -1.0
    v[0, 2], v[64, 2] = 2.0 ** -126, -(2.0 ** -127)          # a subnormal input flushes
    v[:, 3] = np.inf
    assert_bits_equal(gpu.hadamard_rows(v), C.hadamard_rows(v), "specials")


def test_hadamard_i8_kernel_exact(gpu):
    """The integer rotation (backward operands): int32 butterflies, i2f, zero-padded rows."""
    rng = seeded(7)
    R, Cc = 200, 9
    q = rand_i8(rng, (R, Cc))
    q[:QB, 0] = 127
    q[:QB, 1] = -127
    got = rotate_i8(gpu, q)
    pad = np.zeros((2 * QB, Cc), np.float32)
    pad[:R] = q
    assert_bits_equal(got, C.hadamard_rows(pad), "hadamard_i8")
    assert got[0, 0] == 127 * QB and got[0, 1] == -127 * QB


# ------------------------------------------------------------------ the layer
LAYER_CASES = [("m", 1, 1, 1), ("m", 5, 3, 7), ("m", 130, 70, 129), ("m", 300, 257, 200), ("m", 129, 33, 128),
               ("c", 1, 1, 1), ("c", 5, 3, 7), ("c", 37, 45, 29), ("c", 130, 70, 129), ("c", 129, 200, 3),
               ("c", 3, 129, 257), ("c", 20, 0, 5)]


def layer_inputs(case, m_key, c_prefix):
    origin, N, K, M = case
    rng = seeded(m_key, N, K, M) if origin == "m" else named(f"{c_prefix}{N},{K},{M}")
    return rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)


@pytest.mark.parametrize("case", LAYER_CASES, ids=case_id)
def test_layer(gpu, case):
    x, w, dy = layer_inputs(case, 8, "layer")
    check_layer(gpu, x, w, dy, case_id(case))


def test_layer_need_flags(gpu):
    for rng, N in ((seeded(9), 17), (named("flags"), 9)):
        x, w, dy = rand_bf16(rng, (N, 11)), rand_bf16(rng, (13, 11), 0.02), rand_bf16(rng, (N, 13), 1e-3)
        want_dx, want_dw = C.qlinear_backward(dy, x, w)
        dx, dw = gpu.qlinear_backward(dy, x, w, need_dx=False)
        assert dx is None
        assert_bits_equal(dw, want_dw, "dw only")
        dx, dw = gpu.qlinear_backward(dy, x, w, need_dw=False)
        assert dw is None
        assert_bits_equal(dx, want_dx, "dx only")
        assert gpu.qlinear_backward(dy, x, w, False, False) == (None, None)


def test_special_weights_in_the_layer(gpu):
    rng = seeded(10)
    N, K, M_ = 140, 96, 150
    x, w, dy = rand_bf16(rng, (N, K)), special_weights(rng, M_, K), rand_bf16(rng, (N, M_), 1e-3)
    x[3, 3] = 0x0001                            # subnormal input: flushed
    x[4, :7] = 0x8001
    dy[5, :9] = 0x0001
    check = lambda x, w, dy, what: check_layer(gpu, x, w, dy, what)
    y, dx, dw = check(x, w, dy, "specials")
    assert np.all(y[:, 3] == 0) and np.all(np.isnan(y[:, 5])) and np.all(np.isnan(dw[6])) and np.all(np.isnan(dx))
    assert dw[8, 0] == 0 and dw[8, 0].view(np.uint32) == 0
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
    assert y.view(np.uint32).max() == 0
    big = rand_bf16(rng, (N, K), 1e30)          # large activations, tiny gradients near flushing
    tiny = rand_bf16(rng, (N, M_), 1e-36)
    check(big, w, tiny, "big x, tiny dy")
    check(x, rand_bf16(rng, (M_, K), 1e-37), dy, "tiny weights")


def test_special_values_in_the_layer(gpu):
    rng = named("specials")
    N, K, M = 140, 96, 150
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    w[10] = 0                                   # zero row: y column 0
    w[11, 5] = 0x7FC1                           # NaN in a weight row: y column NaN, dW row NaN
    w[12, 0] = bf(1.0)                          # clipped weight: its dW element is +0
    w[13] = 0x0080                              # flushed step size: a zero row
    x[3, 3] = 0x0001                            # subnormal input: flushed
    dy[5, 6] = 0x8001
    check = lambda x, w, dy, what: check_layer(gpu, x, w, dy, what)
    y, dx, dw = check(x, w, dy, "specials")
    assert np.all(y[:, 10] == 0) and np.all(np.isnan(y[:, 11])) and not np.isnan(y[:, 12]).any()
    assert np.all(y[:, 13] == 0)
    assert np.all(np.isnan(dw[11])) and dw[12, 0] == 0 and np.all(np.isnan(dx))
    w[11, 5] = 0
    x[7, 7] = 0x7F80                            # inf activation: the tensor scale is NaN
    y, dx, dw = check(x, w, dy, "inf x")
    assert np.all(np.isnan(y)) and np.all(np.isnan(dw[:10])) and not np.isnan(dx).any()
    dy[0, 0] = 0xFF80                           # inf gradient: both gradients NaN
    y, dx, dw = check(x, w, dy, "inf dy")
    assert np.all(np.isnan(dx)) and np.all(np.isnan(dw[14:]))
    y, dx, dw = check(np.zeros((N, K), np.uint16), w * 0, dy * 0, "zeros")
    assert y.view(np.uint32).max() == 0 and dx.view(np.uint32).max() == 0
    xs = sprinkle(rng, rand_bf16(rng, (N, K)), SPECIAL_BF16, 0.01)
    ws = sprinkle(rng, rand_bf16(rng, (M, K), 0.02), SPECIAL_BF16, 0.001)
    check(xs, ws, rand_bf16(rng, (N, M), 1e-3), "sprinkled")


def test_layer_outliers_and_clipping(gpu):
    rng = seeded(11)
    N, K, M_ = 257, 130, 131
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M_, K), 0.02), rand_bf16(rng, (N, M_), 1e-3)
    w[:, 0] = f32_to_bf16(np.float32(3.0))      # a clipped column in every row
    w[1, :] = f32_to_bf16(np.float32(0.5))      # a constant row: every t = sqrt(127) / 2, level 6
    dy[rng.choice(N, 4, replace=False)] = f32_to_bf16(np.float32(80.0))   # outlier tokens
    x[:, 5] = f32_to_bf16(np.float32(-1e4))     # an outlier channel
    _, _, dw = check_layer(gpu, x, w, dy, "outliers")
    q, s = C.quant_weight_rows(w)
    assert (q[2:, 0] == 127).all() and (q[1] == 6).all()
    assert (dw[2:, 0] == 0).all() and (dw[2:, 0].view(np.uint32) == 0).all()


def test_layer_outliers_and_large_values(gpu):
    """Outlier tokens and channels (the case the rotation is for), huge finite values whose row sums
    stay finite, and gradients near the bf16 range's ends."""
    rng = named("outliers")
    N, K, M = 131, 67, 140
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    widen = lambda a: C.bf16_to_f32(np.ascontiguousarray(a))
    x[::17] = bf(widen(x[::17]) * 80)
    dy[::13] = bf(widen(dy[::13]) * 1e4)
    w[3, 2] = bf(1e30)
    dy[7, 7] = bf(1e38)
    check_layer(gpu, x, w, dy, "outliers")
    check_layer(gpu, x, w, bf(widen(dy) * np.float32(1e-36)), "tiny gradients")


# ------------------------------------------------------ the simulated int4 / int6 paths (qmax = 7 / 31)
@LOW_QMAX
@pytest.mark.parametrize("case", LAYER_CASES, ids=case_id)
def test_int4_layer(gpu, case, qmax):
    N, K, M = case[1:]
    x, w, dy = layer_inputs(case, 30, "layer4")
    y, dx, dw = check_qlinear_low(gpu, x, w, dy, case_id(case), qmax)
    if N * K * M > 1000:                        # not the int8 layer
        assert not np.array_equal(y, gpu.qlinear_forward(x, w))
        dx8, dw8 = gpu.qlinear_backward(dy, x, w)
        assert not np.array_equal(dx, dx8) and not np.array_equal(dw, dw8)
    if qmax == QMAX6 and N * K * M > 1000:      # nor the int4 path
        assert not np.array_equal(y, gpu.qlinear_forward(x, w, qmax=QMAX4))


@LOW_QMAX
def test_int4_need_flags_and_positional_arguments(gpu, qmax):
    for rng, N in ((seeded(31), 17), (named("flags4"), 9)):
        x, w, dy = rand_bf16(rng, (N, 11)), rand_bf16(rng, (13, 11), 0.02), rand_bf16(rng, (N, 13), 1e-3)
        want_dx, want_dw = SQ.qlinear_backward(dy, x, w, qmax)
        dx, dw = gpu.qlinear_backward(dy, x, w, False, True, qmax)
        assert dx is None
        assert_bits_equal(dw, want_dw, "dw only")
        dx, dw = gpu.qlinear_backward(dy, x, w, need_dw=False, qmax=qmax)
        assert dw is None
        assert_bits_equal(dx, want_dx, "dx only")
        dx, dw = gpu.qlinear_backward(dy, x, w, True, False, qmax)
        assert dw is None
        assert_bits_equal(dx, want_dx, "dx only, positional")
        dx, dw = gpu.qlinear_backward(dy, x, w, need_dx=False, qmax=qmax)
        assert dx is None
        assert_bits_equal(dw, want_dw, "dw only, keyword")
        assert gpu.qlinear_backward(dy, x, w, False, False, qmax) == (None, None)
        assert_bits_equal(gpu.qlinear_forward(x, w, qmax), SQ.qlinear_forward(x, w, qmax), "positional qmax")
        for q127 in (np.int64(127), np.int32(127)):
            assert_bits_equal(gpu.qlinear_forward(x, w, q127), gpu.qlinear_forward(x, w), "qmax 127 is int8")


@LOW_QMAX
def test_int4_special_weights_in_the_layer(gpu, qmax):
    rng = seeded(32)
    N, K, M_ = 140, 96, 150
    x, w, dy = rand_bf16(rng, (N, K)), special_weights(rng, M_, K), rand_bf16(rng, (N, M_), 1e-3)
    x[3, 3] = 0x0001                            # subnormal input: flushed
    x[4, :7] = 0x8001
    dy[5, :9] = 0x0001
    w[15] = f32_to_bf16(np.full(K, 2.0 ** -122, np.float32))   # s_w = 2^-122 QW_COEF4 (6): not flushed
    check = lambda x, w, dy, what: check_qlinear_low(gpu, x, w, dy, what, qmax)
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
    assert quant_t(gpu, tx, qmax)[1] > 0 and quant_t(gpu, tx)[1] == 0


@LOW_QMAX
def test_int4_special_values_in_the_layer(gpu, qmax):
    rng = named("specials4")
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
    check = lambda x, w, dy, what: check_qlinear_low(gpu, x, w, dy, what, qmax)
    y, dx, dw = check(x, w, dy, "specials")
    assert np.all(y[:, 10] == 0) and np.all(np.isnan(y[:, 11])) and not np.isnan(y[:, 12]).any()
    assert np.all(y[:, 13] == 0) and np.all(np.isnan(y[:, 15]))
    assert np.all(np.isnan(dw[11])) and dw[12, 0].view(np.uint32) == 0 and np.all(np.isnan(dx))
    assert gpu.qlinear_backward(dy, x, w)[1][12, 0] != 0          # int8: not clipped
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
def test_int4_clipping(gpu, qmax):
    """A weight 10x its row's mean magnitude: t ~ 12 steps at int4 (clipped: level 7, dW +0), ~50
    at int8 (not clipped); int6: 30x, t ~ 50 steps (clipped: level 31), ~100 at int8."""
    rng = seeded(33)
    N, K, M_ = 131, 96, 140
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M_, K), 0.02), rand_bf16(rng, (N, M_), 1e-3)
    out = {QMAX4: 0.1, QMAX6: 0.3}[qmax]
    w[:20] = f32_to_bf16(np.float32(0.01))
    w[:20, 0] = f32_to_bf16(np.float32(out))
    w[:20, 1] = f32_to_bf16(np.float32(-out))
    w[30] = 0
    w[30, 0] = f32_to_bf16(np.float32(-9.0))    # a single nonzero: clipped at both
    q4, s4, clip4 = quant_w(gpu, w, qmax)
    want_q, want_s, want_clip = SQ.quant_weight_rows(w, with_clip=True, qmax=qmax)
    assert np.array_equal(q4, want_q) and np.array_equal(clip4, want_clip)
    assert_bits_equal(s4, want_s, f"s_w qmax {qmax}")
    q8, _, clip8 = quant_w(gpu, w)
    assert (clip4[:20, :2] == 1).all() and (q4[:20, 0] == qmax).all() and (q4[:20, 1] == -qmax).all()
    assert not clip8[:20].any() and (np.abs(q8[:20, :2].astype(np.int64)) < 127).all()
    assert clip4.sum() > clip8.sum() > 0
    _, _, dw = check_qlinear_low(gpu, x, w, dy, "clipping", qmax)
    assert (dw[:20, :2].view(np.uint32) == 0).all() and dw[30, 0].view(np.uint32) == 0
    dw8 = gpu.qlinear_backward(dy, x, w)[1]
    assert (dw8[:20, :2] != 0).all()


@LOW_QMAX
def test_int4_levels_within_7(gpu, qmax):
    """The quantizer kernels with qmax 7 (31): every level in [-7, 7] ([-31, 31]), both ends
    reached, the spec's levels and scales (weight rows: QW_COEF4 (QW_COEF6); tensors:
    div(absmax, qmax)); int8 differs."""
    rng = seeded(34)
    M_, K = 67, 301
    w = special_weights(rng, M_, K)
    q, s, clip = quant_w(gpu, w, qmax)
    want_q, want_s, want_clip = SQ.quant_weight_rows(w, with_clip=True, qmax=qmax)
    assert np.array_equal(q, want_q) and np.array_equal(clip, want_clip)
    assert_bits_equal(s, want_s, "s_w")
    assert q.min() == -qmax and q.max() == qmax and clip[8, 0] == 1 and (clip[5] == 2).all()
    q8, s8, _ = quant_w(gpu, w)
    assert np.abs(q8.astype(np.int64)).max() == 127 and not np.array_equal(s, s8)
    v = (rng.standard_normal(10000) * 3).astype(np.float32)
    v[0], v[9999] = 1e-40, -40.0                # a flushed subnormal; the max in the last block
    for vv in (v, sprinkle(rng, rand_f32(rng, (50, 7), 1e-30), SPECIAL_F32[[0, 1, 5, 6, 7, 8, 9, 12, 13]], 0.2),
               np.array([np.inf, 1.0], np.float32), np.array([2.0 ** -124, 2.0 ** -126], np.float32)):
        qt, st = quant_t(gpu, vv, qmax)
        want_q, want_s = SQ.quant_tensor_f32(vv, qmax)
        assert np.array_equal(qt, want_q.reshape(vv.shape)), vv.ravel()[:3]
        assert_bits_equal(st, np.float32(want_s), "s")
        assert np.abs(qt.astype(np.int64)).max(initial=0) <= qmax
    qt, st = quant_t(gpu, v, qmax)
    assert qt.min() == -qmax and st == np.float32(40.0) / np.float32(qmax)
    assert np.abs(quant_t(gpu, v)[0].astype(np.int64)).max() == 127
    h = qmax - 0.5                              # the largest tie below the clamp: to qmax - 1 (even)
    t = np.array([qmax, 0.5, 1.5, 2.5, -0.5, -2.5, h, -h, 3.5, -1.5, 5.5, -4.5], np.float32)
    qt, st = quant_t(gpu, t, qmax)              # s = 1 exactly: ties to even
    assert st == 1.0 and qt.tolist() == [qmax, 0, 2, 2, 0, -2, qmax - 1, 1 - qmax, 4, -2, 6, -4]
    e = TINY_E[qmax]
    tv = np.array([2.0 ** e, -(2.0 ** (e - 1))], np.float32)
    qt, st = quant_t(gpu, tv, qmax)             # div(2^e, qmax) is a normal: not flushed, unlike / 127
    assert st > 0 and qt[0] == qmax and qt.tolist() == SQ.quant_tensor_f32(tv, qmax)[0].tolist()
    assert quant_t(gpu, np.array([2.0 ** e], np.float32))[1] == 0
    assert quant_t(gpu, np.array([2.0 ** (e - 1)], np.float32), qmax)[1] == 0     # div(2^(e-1), qmax) flushes


@LOW_QMAX
def test_int4_quantizers_levels_within_7(gpu, qmax):
    """The quantizer kernels with qmax 7 (31): every level in [-7, 7] ([-31, 31]), both ends reached,
    ties to even, clip flags at |t| > qmax, the spec's levels and scales; qmax 127 gives other levels."""
    rng = named("levels4")
    M, K = 71, 301
    w = rand_bf16(rng, (M, K), 0.02)
    w[3] = 0                                    # zero row
    w[5, 7] = 0x7F80                            # NaN step
    w[8, 0] = bf(0.3)                           # about 15 (50) steps at int4 (int6): clipped; not at int8
    w[8, 1] = bf(-0.3)                          # the same, negative: both ends of the levels
    w[9] = 0x0080                               # flushed step size
    w[13] = bf(np.where(np.arange(K) % 2, 1.0, -1.0))   # constant magnitude: t = ±1/QW_COEF4 = ±1.32... (int6: ±2.78...)
    q, s, clip = quant_w(gpu, w, qmax)
    wq, ws, wclip = SQ.quant_weight_rows(w, with_clip=True, qmax=qmax)
    assert np.array_equal(q, wq) and np.array_equal(clip, wclip)
    assert_bits_equal(s, ws, "s_w")
    assert q.min() == -qmax and q.max() == qmax and clip[8, 0] == 1 and (clip[5] == 2).all() and not q[5].any()
    assert s[3] == 0 and s[9] == 0 and (np.abs(q[13]) == {QMAX4: 1, QMAX6: 3}[qmax]).all()
    q8, s8, clip8 = quant_w(gpu, w, 127)
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
        qt, st = quant_t(gpu, v, qmax)
        wq, ws = (SQ.quant_tensor_f32 if v.dtype == np.float32 else SQ.quant_tensor)(v, qmax)
        assert np.array_equal(qt, wq.reshape(v.shape)), i
        assert_bits_equal(st, np.float32(ws), f"s case {i}")
        assert np.abs(qt.astype(np.int64)).max() <= qmax, i
    qt, st = quant_t(gpu, cases[3], qmax)
    assert st == 1.0 and qt.tolist() == [qmax, 0, 2, 2, 0, -2, qmax - 1, 1 - qmax, 4, -2, 6, -4, 0]
    assert quant_t(gpu, cases[4], qmax)[1] > 0 and quant_t(gpu, cases[4], 127)[1] == 0
    assert quant_t(gpu, cases[5], qmax)[1] == 0
    assert np.float32(quant_t(gpu, cases[6], qmax)[1]).view(np.uint32) == 0x7FC00000
    q0 = quant_t(gpu, cases[0], qmax)[0]
    assert np.abs(q0.astype(np.int64)).max() == qmax and np.abs(quant_t(gpu, cases[0], 127)[0].astype(np.int64)).max() == 127


@pytest.mark.parametrize("bad", [8, 0, -7, 32, 255, 7.0, True, "7", None])
def test_qmax_validated(gpu, bad):
    from mlx_open1b.parity import spec_backend
    x, w, dy = np.zeros((4, 8), np.uint16), np.zeros((3, 8), np.uint16), np.zeros((4, 3), np.uint16)
    msg = f"qmax: expected 127 (int8), 31 (the simulated int6 path) or 7 (the simulated int4 path), got {bad!r}"
    for mod in (gpu, spec_backend):
        with pytest.raises(ValueError, match="qmax: expected 127") as e1:
            mod.qlinear_forward(x, w, qmax=bad)
        with pytest.raises(ValueError, match="qmax: expected 127") as e2:
            mod.qlinear_backward(dy, x, w, qmax=bad)
        assert str(e1.value) == str(e2.value) == msg


# ------------------------------------------------------------------ §6.10 the int8 attention forward
def _check_attention_i8(gpu):
    """check(q, k, v, W, scale, what): gpu.attention_forward_i8 equals the numpy spec and the C
    reference bit for bit."""
    return lambda q, k, v, W, scale, what: check_attention_i8_backend(gpu.attention_forward_i8, q, k, v, W, scale, what)


@pytest.mark.parametrize("B,T,H,G,D,W", I8_SHAPES)
def test_attention_forward_i8_matches_spec(gpu, B, T, H, G, D, W):
    """Blocks crossed (T not a multiple of 64), windows, grouped-query heads; plain inputs, then
    zero / subnormal / tiny / huge / tie / +inf / NaN value rows and finite specials in q and k."""
    attention_i8_matches_spec(_check_attention_i8(gpu), seeded(20, B, T, H, G, D, W), B, T, H, G, D, W)


def test_attention_forward_i8_tiny_values(gpu):
    """Special values, then tiny values (flushed scales)."""
    check = _check_attention_i8(gpu)
    rng = np.random.default_rng([0xA778, 23])
    q, k, v = attention_i8_inputs(rng, 1, 67, 2, 1, 4, specials=True)
    check(q, k, v, 0, 1.0, "specials")
    tiny = f32_to_bf16((rng.uniform(-1, 1, v.shape) * 2.0 ** -112).astype(np.float32))
    check(q, k, tiny, 0, 1.0, "tiny values")


def test_attention_forward_i8_special_rows(gpu):
    attention_i8_special_rows(_check_attention_i8(gpu), C.attention_forward, seeded(21))


def test_attention_forward_i8_ties_to_even(gpu):
    attention_i8_ties_to_even(_check_attention_i8(gpu))


def test_attention_vquant_kernel_is_the_per_tensor_rule(gpu):
    attention_vquant_is_the_per_tensor_rule(lambda v: vquant(gpu, v), seeded(22))


def test_attention_forward_i8_empty_and_bad_arguments(gpu):
    attention_i8_empty_and_bad_arguments(gpu.attention_forward_i8, C.attention_forward_i8)


# ------------------------------------------------------------------ argument errors: cpu_ref's text
_x8, _w8 = np.zeros((4, 8), np.uint16), np.zeros((3, 8), np.uint16)
BAD_CALLS = [  # id, call, what the message names
    ("w K", lambda o: o.qlinear_forward(_x8, np.zeros((3, 9), np.uint16)), "w: dimension 1"),
    ("x dtype", lambda o: o.qlinear_forward(_x8.astype(np.float32), _w8), "dtype"),
    ("dy shape", lambda o: o.qlinear_backward(np.zeros((4, 4), np.uint16), _x8, _w8), "dy: dimension"),
    ("w layout", lambda o: o.quant_weight_rows(np.zeros((8, 3), np.uint16).T), "C-contiguous"),
    ("-128", lambda o: o.gemm_i8(np.full((2, 2), -128, np.int8), np.zeros((2, 2), np.int8)), "-128"),
    ("P bound", lambda o: o.gemm_i8(np.zeros((1, Q_MAX_P + 1), np.int8), np.zeros((1, Q_MAX_P + 1), np.int8)),
     "exceeds"),
    ("gemm dtype", lambda o: o.gemm_i8(np.zeros((2, 2), np.int16), np.zeros((2, 2), np.int8)), "dtype"),
    ("gemm P", lambda o: o.gemm_i8(np.zeros((2, 3), np.int8), np.zeros((2, 2), np.int8)), None),
    ("hadamard rows", lambda o: o.hadamard_rows(np.zeros((100, 3), np.float32)), "multiple of the Hadamard block"),
    ("hadamard ndim", lambda o: o.hadamard_rows(np.zeros((128,), np.float32)), None),
    ("quant_tensor int32", lambda o: o.quant_tensor(np.zeros((2, 2), np.int32)), "dtype"),
    ("quant_tensor float64", lambda o: o.quant_tensor(np.zeros(3, np.float64)), None),
    ("backward K bound", lambda o: o.qlinear_backward(np.zeros((4, Q_MAX_P + 1), np.uint16), _x8,
                                                      np.zeros((Q_MAX_P + 1, 8), np.uint16)), "exceeds"),
    ("backward N bound", lambda o: o.qlinear_backward(np.zeros((Q_MAX_P + 1, 1), np.uint16),
                                                      np.zeros((Q_MAX_P + 1, 1), np.uint16),
                                                      np.zeros((1, 1), np.uint16)), None),
    ("forward K bound", lambda o: o.qlinear_forward(np.zeros((1, Q_MAX_P + 1), np.uint16),
                                                    np.zeros((1, Q_MAX_P + 1), np.uint16)), None),
]


@pytest.mark.parametrize("what,call,names", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_same_error(gpu, what, call, names):
    with pytest.raises(ValueError) as e_ref:
        call(C)
    with pytest.raises(ValueError) as e_gpu:
        call(gpu)
    assert str(e_gpu.value) == str(e_ref.value)
    if names:
        assert re.search(names, str(e_ref.value)), str(e_ref.value)
