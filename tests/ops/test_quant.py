"""The int8 quantized linear layer (CONTRACT.md §6.9): C reference == numpy spec bit for bit,
the int8 GEMM == an exact integer reference at every SIMD level and thread count, the Hadamard
rotation (exactness and its effect on the int8 weight-gradient error), the recomputed step size
against a trained one, and argument errors."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_bits_equal, rand_bf16, sprinkle, SPECIAL_BF16
from mlx_open1b import cpu_ref
from mlx_open1b.cpu_ref import settings
from mlx_open1b.spec import quant as S
from mlx_open1b.spec.arith import bf16_to_f32, f32_to_bf16

LEVELS = list(range(cpu_ref.simd_level() + 1))
CONFIGS = [(lvl, th) for lvl in LEVELS for th in (1, 2)] + [(LEVELS[-1], 3)]   # 3: uneven split


def rand_i8(rng, shape):
    return rng.integers(-127, 128, shape, dtype=np.int64).astype(np.int8)


# ------------------------------------------------------------------ int8 GEMM
@pytest.mark.parametrize("I,J,P", [(1, 1, 1), (3, 5, 7), (37, 53, 19), (9, 33, 3001), (130, 70, 1030),
                                   (257, 129, 512), (64, 31, 4096)])
def test_gemm_i8_exact_every_level(I, J, P):
    rng = np.random.default_rng(I * 7 + J * 3 + P)
    a, b = rand_i8(rng, (I, P)), rand_i8(rng, (J, P))
    want = (a.astype(np.int64) @ b.astype(np.int64).T)
    assert np.abs(want).max() < 2 ** 31
    for lvl, th in CONFIGS:
        with settings(simd=lvl, threads=th):
            got = cpu_ref.gemm_i8(a, b)
        assert got.dtype == np.int32
        assert np.array_equal(got.astype(np.int64), want), (lvl, th)
    assert np.array_equal(S.gemm_i8(a, b).astype(np.int64), want)


def test_gemm_i8_extremes_at_the_length_bound():
    """All products ±127·127 at P = Q_MAX_P: |acc| = 2^17·127² < 2^31, still exact (the VNNI
    path's offset sum wraps modulo 2^32 on the way and comes back exact)."""
    P = cpu_ref.quant.Q_MAX_P
    a = np.full((3, P), 127, np.int8)
    a[1] = -127
    a[2, ::2] = -127
    b = np.full((2, P), 127, np.int8)
    b[1] = -127
    want = a.astype(np.int64) @ b.astype(np.int64).T
    for lvl in LEVELS:
        with settings(simd=lvl, threads=2):
            assert np.array_equal(cpu_ref.gemm_i8(a, b).astype(np.int64), want), lvl


def test_gemm_i8_dequantized_equals_integer_reference():
    """y = mul(mul(i2f(acc), s_x), s_w[j]) from the C layer == the same from numpy int64."""
    rng = np.random.default_rng(5)
    x, w = rand_bf16(rng, (300, 700)), rand_bf16(rng, (90, 700), 0.02)
    qx, sx = cpu_ref.quant_tensor(x)
    qw, sw = cpu_ref.quant_weight_rows(w)
    acc = qx.astype(np.int64) @ qw.astype(np.int64).T
    want = ((acc.astype(np.int32).astype(np.float32) * sx).astype(np.float32) * sw).astype(np.float32)
    for lvl, th in CONFIGS:
        with settings(simd=lvl, threads=th):
            assert_bits_equal(cpu_ref.qlinear_forward(x, w), want, f"simd={lvl} threads={th}")


# ------------------------------------------------------------------ C == spec
def check_layer(x, w, dy, what):
    want_y = S.qlinear_forward(x, w)
    want_dx, want_dw = S.qlinear_backward(dy, x, w)
    for lvl, th in CONFIGS:
        with settings(simd=lvl, threads=th):
            assert_bits_equal(cpu_ref.qlinear_forward(x, w), want_y, f"{what} y {lvl}/{th}")
            dx, dw = cpu_ref.qlinear_backward(dy, x, w)
            assert_bits_equal(dx, want_dx, f"{what} dx {lvl}/{th}")
            assert_bits_equal(dw, want_dw, f"{what} dw {lvl}/{th}")
    return want_y, want_dx, want_dw


@pytest.mark.parametrize("N,K,M", [(1, 1, 1), (5, 3, 7), (130, 70, 129), (300, 257, 200), (256, 512, 384)])
def test_layer_matches_spec(N, K, M):
    rng = np.random.default_rng(N + K + M)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    check_layer(x, w, dy, f"{N}x{K}x{M}")


@pytest.mark.parametrize("N,K,M", [(17, 5, 33), (129, 37, 257), (1, 300, 1), (200, 3, 70),
                                   (33, 129, 16), (48, 64, 96)])
def test_layer_shapes_with_tails(N, K, M):
    """Edges of every blocking in the VNNI path (16/32 lanes, 4-byte groups, 8- and 16-row tiles,
    128-row Hadamard blocks, 32-column panels) and of the thread split."""
    rng = np.random.default_rng(10 * N + K + M)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    check_layer(x, w, dy, f"tails {N}x{K}x{M}")


@pytest.mark.parametrize("e_x,e_w,e_dy", [(-60, -70, -50), (-118, -12, -100), (-17, -2, -122),
                                          (-15, -10, -116), (-126, 0, -127)])
def test_layer_near_the_flush_threshold(e_x, e_w, e_dy):
    """Magnitudes where products and butterfly sums land around 2^-126: subnormal results of
    the dequantization chains and of the fp32 rotations must flush exactly as the contract
    does (the VNNI path relies on FTZ|DAZ there), and subnormal inputs count as zeros. Chosen
    so that y (the first two), dx (the third: s_G just above the flush) and dW (the fourth)
    have many outputs below 2^-123 beside flushed ones; the last has everything flushed."""
    rng = np.random.default_rng(abs(e_x * e_w * e_dy) + 1)
    N, K, M = 150, 70, 140
    def mk(shape, e):
        v = rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, shape) + float(e))
        return f32_to_bf16(v.astype(np.float32))
    x, w, dy = mk((N, K), e_x), mk((M, K), e_w), mk((N, M), e_dy)
    check_layer(x, w, dy, f"flush {e_x}/{e_w}/{e_dy}")


def test_vnni_lane_helpers_selftest():
    """The VNNI path's lane-wise product (hardware product under FTZ, scalar o1b_mul where it
    lands on exactly 2^-126) and level(), against the scalar contract on operands crafted to
    straddle the flush boundary (cpu_ref/src/quant_vnni.c, o1b_q_vnni_selftest)."""
    import ctypes
    from mlx_open1b.cpu_ref import _lib
    if not cpu_ref.gemm_i8_has_vnni():
        pytest.skip("no AVX-512 VNNI on this CPU")
    f = _lib.lib.o1b_q_vnni_selftest
    f.restype, f.argtypes = ctypes.c_int64, [ctypes.c_uint64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    boundary = ctypes.c_int64()
    assert f(7, 20000, ctypes.byref(boundary)) == 0
    assert boundary.value > 1000           # the scalar path really ran


def test_concurrent_calls_from_threads():
    """Kernels called from several Python threads at once (ctypes releases the GIL): one call
    holds the C reference's thread pool and scratch block, the others start their own threads
    and allocate their own memory. Same bits as one call at a time."""
    import threading
    rng = np.random.default_rng(11)
    N, K, M = 260, 96, 200
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    want_y = cpu_ref.qlinear_forward(x, w)
    want_dx, want_dw = cpu_ref.qlinear_backward(dy, x, w)
    want_l = cpu_ref.linear_forward(x, w)
    errors = []

    def work():
        try:
            for _ in range(20):
                assert_bits_equal(cpu_ref.qlinear_forward(x, w), want_y, "y")
                dx, dw = cpu_ref.qlinear_backward(dy, x, w)
                assert_bits_equal(dx, want_dx, "dx")
                assert_bits_equal(dw, want_dw, "dw")
                assert_bits_equal(cpu_ref.linear_forward(x, w), want_l, "bf16 y")
        except AssertionError as e:        # pragma: no cover - reported below
            errors.append(e)
    with settings(threads=2):
        ts = [threading.Thread(target=work) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors, errors[0]


def test_quantizers_match_spec():
    rng = np.random.default_rng(1)
    w = rand_bf16(rng, (67, 301), 0.02)
    w[3] = 0                                    # zero row: s = +0, q = 0
    w[4] = 0x0001                               # subnormals flush: a zero row as well
    w[5, 7] = 0x7F80                            # +inf: the row's scale is NaN, q = 0
    w[6, 9] = 0x7FC1                            # NaN
    w[7] = 0x7F7F                               # huge: the row sum overflows -> NaN
    w[8, 0] = f32_to_bf16(np.float32(5.0))      # an outlier that clips (|t| > 127)
    q, s = cpu_ref.quant_weight_rows(w)
    q2, s2 = S.quant_weight_rows(w)
    assert np.array_equal(q, q2)
    assert_bits_equal(s, s2, "s_w")
    assert s[3] == 0 and s[4] == 0 and not q[3].any() and not q[4].any()
    for r in (5, 6, 7):
        assert s.view(np.uint32)[r] == 0x7FC00000 and not q[r].any()
    assert q[8, 0] == 127
    assert np.abs(q).max() <= 127
    for x in (rand_bf16(rng, (33, 65)), np.zeros((4, 4), np.uint16), sprinkle(rng, rand_bf16(rng, (40,)), SPECIAL_BF16[[0, 1, 6, 7, 8]])):
        qa, sa = cpu_ref.quant_tensor(x)
        qb, sb = S.quant_tensor(x)
        assert np.array_equal(qa, qb)
        assert_bits_equal(np.float32(sa), np.float32(sb), "s_x")
    for bad in (0x7F80, 0xFF80, 0x7FC1):
        x = rand_bf16(rng, (8, 8))
        x[2, 2] = bad
        qa, sa = cpu_ref.quant_tensor(x)
        assert np.float32(sa).view(np.uint32) == 0x7FC00000 and not qa.any()
    v = (rng.standard_normal(1000) * 3).astype(np.float32)
    v[0] = 1e-40
    qa, sa = cpu_ref.quant_tensor(v)
    qb, sb = S.quant_tensor_f32(v)
    assert np.array_equal(qa, qb) and np.float32(sa).view(np.uint32) == np.float32(sb).view(np.uint32)
    # ties go to even: values at exactly k + 1/2 steps
    v = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5], np.float32)   # s = 1 exactly
    qa, sa = cpu_ref.quant_tensor(v)
    assert sa == 1.0 and qa.tolist() == [127, 0, 2, 2, 0, -2, 126]


def test_special_values_in_the_layer():
    rng = np.random.default_rng(2)
    N, K, M = 140, 96, 150
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    w[10] = 0                                   # zero row: y column 0, dx unaffected by it
    w[11, 5] = 0x7FC1                           # NaN in a weight row: y column NaN, dW row NaN
    w[12, 0] = f32_to_bf16(np.float32(1.0))     # clipped weight: its dW element is +0
    x[3, 3] = 0x0001                            # subnormal input: flushed
    y, dx, dw = check_layer(x, w, dy, "specials")
    assert np.all(y[:, 10] == 0) and np.all(np.isnan(y[:, 11])) and not np.isnan(y[:, 12]).any()
    assert np.all(np.isnan(dw[11])) and dw[12, 0] == 0 and np.all(np.isnan(dx))  # NaN s_w[11] reaches every dx
    w[11, 5] = 0
    x[7, 7] = 0x7F80                            # inf activation: the tensor scale is NaN
    y, dx, dw = check_layer(x, w, dy, "inf x")
    assert np.all(np.isnan(y)) and np.all(np.isnan(dw[:10])) and not np.isnan(dx).any()
    dy[0, 0] = 0xFF80                           # inf gradient: both gradients NaN
    y, dx, dw = check_layer(x, w, dy, "inf dy")
    assert np.all(np.isnan(dx)) and np.all(np.isnan(dw[13:]))
    assert check_layer(np.zeros((N, K), np.uint16), w * 0, dy * 0, "zeros")[0].view(np.uint32).max() == 0


# ------------------------------------------------------------------ Hadamard
def test_hadamard_is_exact():
    B = cpu_ref.quant.QB
    Hi = S.hadamard_rows(np.eye(B, dtype=np.int64), integer=True)
    assert np.array_equal(Hi @ Hi, B * np.eye(B, dtype=np.int64))
    assert np.array_equal(Hi, Hi.T) and set(np.unique(Hi)) == {-1, 1}
    Hf = cpu_ref.hadamard_rows(np.eye(B, dtype=np.float32))
    assert np.array_equal(Hf, Hi.astype(np.float32))
    rng = np.random.default_rng(3)
    v = (rng.standard_normal((3 * B, 37)) * 10.0 ** rng.integers(-30, 30, (3 * B, 37))).astype(np.float32)
    v[0, 0], v[1, 1], v[2, 2] = 1e-40, np.inf, np.nan
    for th in (1, 2):
        with settings(threads=th):
            got = cpu_ref.hadamard_rows(v)
        want = S.hadamard_rows(v)
        want = np.where(np.isnan(want), np.float32(np.nan), want)
        assert_bits_equal(got, S.store(want), f"hadamard threads={th}")


def _dw_int8(dy, qx, sx, rotate):
    """The int8 weight gradient as the contract computes it, or without the rotation."""
    Np = S._pad(dy.shape[0])
    d = np.zeros((Np, dy.shape[1]), np.float32)
    d[:dy.shape[0]] = dy
    r = np.zeros((Np, qx.shape[1]), np.int64)
    r[:qx.shape[0]] = qx
    if rotate:
        d, r = S.hadamard_rows(d), S.hadamard_rows(r, integer=True)
    qa, sa = S.quant_tensor_f32(d)
    qb, sb = S.quant_tensor_f32(r.astype(np.float32))
    acc = (qa.astype(np.float64).T @ qb.astype(np.float64))
    return acc * float(sa) * float(sb) * float(sx) / (S.QB if rotate else 1)


def test_hadamard_reduces_weight_gradient_error():
    """Outlier-heavy gradients at a training shape (N 4096 tokens, M 512 out, K 512 in):
    relative Frobenius error of the int8 dW against float64 of the same (dequantized) operands."""
    rng = np.random.default_rng(4)
    N, M, K = 4096, 512, 512
    x = f32_to_bf16((rng.standard_normal((N, K))).astype(np.float32))
    qx, sx = S.quant_tensor(x)
    g = rng.standard_normal((N, M)) * 1e-4
    spikes = g.copy()
    spikes[rng.choice(N, 8, replace=False)] *= 80.0       # a few tokens with huge gradients
    sparse = g.copy()
    sparse.flat[rng.choice(N * M, N * M // 1000, replace=False)] *= 50.0   # 0.1% of elements x50
    for name, d in (("8 tokens x80", spikes), ("0.1% elements x50", sparse)):
        dyf = bf16_to_f32(f32_to_bf16(d.astype(np.float32))).astype(np.float64)
        ref = dyf.T @ (qx.astype(np.float64) * float(sx))
        err = {rot: np.linalg.norm(_dw_int8(dyf.astype(np.float32), qx, sx, rot) - ref) / np.linalg.norm(ref)
               for rot in (False, True)}
        print(f"int8 dW relative error, {name}: no rotation {err[False]:.4f}, Hadamard {err[True]:.4f}")
        assert err[True] < 0.25 * err[False] and err[True] < 0.04, (name, err)
    dy = f32_to_bf16(spikes.astype(np.float32))
    dyf = bf16_to_f32(dy).astype(np.float64)
    # and the C layer computes exactly the rotated version
    w = rand_bf16(rng, (M, K), 0.02)
    _, dw = cpu_ref.qlinear_backward(dy, x, w, need_dx=False)
    _, qwclip = S.quant_weight_rows(w, with_clip=True)[1:]
    got = _dw_int8(dyf.astype(np.float32), qx, sx, True)
    mask = qwclip == 0
    assert np.allclose(dw[mask], got[mask], rtol=1e-5, atol=0)


# ------------------------------------------------------------------ step size drift (§4.2)
def test_recomputed_step_size_cannot_drift():
    """AdamW-normalized updates move a trained step size by ~lr per step whatever the gradient's
    size: a small consistent gradient drives it past the weight range and the int8 levels
    collapse. The recomputed step size is a function of the weights and stays put."""
    rng = np.random.default_rng(6)
    M, K, lr, steps = 8, 256, 1e-3, 1000
    w = rng.standard_normal((M, K)).astype(np.float32) * 0.02
    s_trained = np.asarray(cpu_ref.quant_weight_rows(f32_to_bf16(w))[1], np.float64)
    m = v = np.zeros(M)
    snr_trained, snr_recomp, ratio = [], [], []
    for t in range(1, steps + 1):
        w = (w + rng.standard_normal(w.shape).astype(np.float32) * 1e-4).astype(np.float32)
        wb = f32_to_bf16(w)
        wf = bf16_to_f32(wb).astype(np.float64)
        g = -1e-6 * np.ones(M)          # tiny, consistent gradient on the step size (LSQ)
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        s_trained = s_trained - lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.95 ** t)) + 1e-8)
        qt = np.clip(np.rint(wf / s_trained[:, None]), -127, 127) * s_trained[:, None]
        q, s = cpu_ref.quant_weight_rows(wb)
        qr = q.astype(np.float64) * s[:, None]
        snr = lambda a: 10 * np.log10((wf ** 2).sum() / max(((a - wf) ** 2).sum(), 1e-300))
        snr_trained.append(snr(qt))
        snr_recomp.append(snr(qr))
        ratio.append(np.max(np.abs(s / np.abs(wf).mean(1) - 2 / np.sqrt(127))))
    # the trained step size has grown far past the weights: nearly every weight rounds to 0
    assert s_trained.min() > 10 * np.abs(w).max()
    assert snr_trained[-1] < 1.0 and snr_trained[0] > 20
    # the recomputed one stays 2·mean|w|/sqrt(127) (to rounding) and keeps the SNR high
    assert max(ratio) < 1e-6 and min(snr_recomp) > 20


# ------------------------------------------------------------------ argument errors
def test_bad_inputs():
    x = np.zeros((4, 8), np.uint16)
    w = np.zeros((3, 8), np.uint16)
    with pytest.raises(ValueError, match="w: dimension 1"):
        cpu_ref.qlinear_forward(x, np.zeros((3, 9), np.uint16))
    with pytest.raises(ValueError, match="dtype"):
        cpu_ref.qlinear_forward(x.astype(np.float32), w)
    with pytest.raises(ValueError, match="dy: dimension"):
        cpu_ref.qlinear_backward(np.zeros((4, 4), np.uint16), x, w)
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu_ref.quant_weight_rows(np.zeros((8, 3), np.uint16).T)
    with pytest.raises(ValueError, match="-128"):
        cpu_ref.gemm_i8(np.full((2, 2), -128, np.int8), np.zeros((2, 2), np.int8))
    with pytest.raises(ValueError, match="exceeds"):
        cpu_ref.gemm_i8(np.zeros((1, (1 << 17) + 1), np.int8), np.zeros((1, (1 << 17) + 1), np.int8))
    with pytest.raises(ValueError, match="multiple of the Hadamard block"):
        cpu_ref.hadamard_rows(np.zeros((100, 3), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        cpu_ref.gemm_i8(np.zeros((2, 2), np.int16), np.zeros((2, 2), np.int8))


# ------------------------------------------------------ the simulated int4 / int6 paths (qmax = 7 / 31)
@pytest.mark.parametrize("qmax", [7, 31], ids=["int4", "int6"])
@pytest.mark.parametrize("N,K,M", [(5, 3, 7), (130, 70, 129), (257, 96, 200)])
def test_int4_layer_matches_spec(N, K, M, qmax):
    """cpu_ref with qmax = 7 (int4) or 31 (int6) equals the spec bit for bit, with special values
    sprinkled in, at every SIMD level and thread count (the VNNI fast path is int8 only: int4 and
    int6 run the portable quantizers with whatever GEMM the level has)."""
    rng = np.random.default_rng(7 * N + K)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    w[0] = 0
    w[1, 1] = f32_to_bf16(np.float32(1.0))         # clipped at int4 and int6 (|t| ~ 170 steps of int6)
    x = sprinkle(rng, x, SPECIAL_BF16[[0, 1, 6, 7, 8]], 0.01)       # zeros and subnormals only
    want = (S.qlinear_forward(x, w, qmax),) + S.qlinear_backward(dy, x, w, qmax)
    for lvl in (0, 1, 2):
        for th in (1, 3):
            with settings(simd=lvl, threads=th):
                got = (cpu_ref.qlinear_forward(x, w, qmax=qmax),) + cpu_ref.qlinear_backward(dy, x, w, qmax=qmax)
            for name, a, b in zip(("y", "dx", "dw"), got, want):
                assert_bits_equal(a, b, f"qmax {qmax} {name} simd {lvl} threads {th}")
    if K >= 32:
        assert got[2][1, 1] == 0                   # the clipped weight passes no gradient
    y8 = cpu_ref.qlinear_forward(x, w)
    assert (y8.view(np.uint32) != got[0].view(np.uint32)).any()
    with pytest.raises(ValueError, match="qmax"):
        cpu_ref.qlinear_forward(x, w, qmax=15)
