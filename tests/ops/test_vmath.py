"""The SIMD forms of the software functions and of the ops built on them (cpu_ref/src/vmath.c):
at every SIMD level this machine has, bit-identical to contract.h's scalar loops and to the numpy
spec, on every class of fp32 pattern, including the lanes that need the exact (scalar) path."""
import contextlib

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref import layers as CL, xent as CX
from mlx_open1b.cpu_ref.mathfn import vector_math
from mlx_open1b.spec import arith as A, layers as SL, mathfn as S, xent as SX

from helpers import SPECIAL_F32, assert_attention_is_spec, assert_bits_equal

NAMES = ["exp", "log", "sin", "cos", "sqrt", "rsqrt", "sigmoid", "silu"]
LEVELS = list(range(C.simd_level() + 1))     # 0 portable (SSE2/NEON), 1 AVX2, 2 AVX-512


@contextlib.contextmanager
def level(lv):
    with C.settings(simd=lv), vector_math(True):
        yield


def scalar():
    return vector_math(False)


def patterns(lo: float, hi: float) -> np.ndarray:
    """Every fp32 bit pattern between lo and hi (same sign)."""
    a, b = sorted((int(np.float32(lo).view(np.uint32)), int(np.float32(hi).view(np.uint32))))
    return np.arange(a, b + 1, dtype=np.uint32).view(np.float32)


def pattern_classes(stride: int) -> np.ndarray:
    """Every stride-th pattern of the whole fp32 line (both signs, NaNs and infinities included),
    random values at several scales, the special values, and every pattern at the edges where the
    scalar helpers branch: exp's overflow, underflow and 2^-126 thresholds and the ends of its
    vector main path (-87, 88), the smallest normals,
    log's sqrt(2) split, sin's 2^-12 shortcut, sigmoid's edge."""
    rng = np.random.default_rng(7)
    whole = np.arange(0, 2 ** 32, stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    parts = [whole, SPECIAL_F32.astype(np.float32),
             (rng.standard_normal(50000) * 3).astype(np.float32),
             (rng.standard_normal(50000) * 300).astype(np.float32),
             rng.integers(0, 2 ** 32, 50000, dtype=np.uint64).astype(np.uint32).view(np.float32),
             np.arange(0x00700000, 0x00900000, 3, dtype=np.uint32).view(np.float32),
             np.arange(0x80700000, 0x80900000, 3, dtype=np.uint32).view(np.float32)]
    for lo, hi in ((88.70, 88.73), (-87.34, -87.33), (-103.01, -102.99), (-88.73, -88.70),
                   (-87.01, -86.98), (87.99, 88.01),
                   (1.41421, 1.41422), (0.70710, 0.70711), (2.0 ** -12 * 0.999, 2.0 ** -12 * 1.001)):
        x = patterns(lo, hi)
        parts += [x, -x]
    return np.ascontiguousarray(np.concatenate(parts))


def spec_sqrt(x):
    # IEEE sqrt of the flushed input, flushed and canonical (the spec has no sqrt of its own).
    with np.errstate(invalid="ignore"):
        return A.canon(A.flush(np.sqrt(A.flush(x))))


def check_all_levels(name: str, x: np.ndarray, spec: bool = True) -> None:
    with scalar():
        want = getattr(C, name)(x)
    if spec:
        ref = spec_sqrt(x) if name == "sqrt" else getattr(S, name)(x)
        assert_bits_equal(want, ref, f"{name}: scalar C vs spec")
    for lv in LEVELS:
        with level(lv):
            assert_bits_equal(getattr(C, name)(x), want, f"{name}: SIMD level {lv} vs scalar")


@pytest.mark.parametrize("name", NAMES)
def test_vector_functions_equal_scalar_and_spec(name):
    # The numpy spec is slow on millions of points: it sees a strided part of the patterns.
    x = pattern_classes(65537)
    check_all_levels(name, x)
    x = pattern_classes(4099)
    check_all_levels(name, x, spec=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_vector_functions_equal_scalar_dense(name):
    check_all_levels(name, pattern_classes(37), spec=False)


def test_every_length_and_offset():
    # Vectors of W lanes plus a scalar tail, in threads: each length up to three vectors of the
    # widest level, at unaligned starts.
    base = (np.random.default_rng(3).standard_normal(200) * 20).astype(np.float32)
    for n in range(0, 50):
        for off in (0, 1, 3):
            x = np.ascontiguousarray(base[off:off + n])
            check_all_levels("exp", x, spec=False)
            check_all_levels("silu", x, spec=False)


@pytest.mark.parametrize("n", [0, 5, 16, 37, 100003])
def test_elementwise_ops_equal_scalar(n):
    # f32 <-> bf16, add_inplace and scale_inplace on every pattern class (several threads'
    # ranges, vectors and tails); scale by an s whose products with some elements round up to
    # 2^-126 (those vectors go the exact way) and by an s with subnormal, inf and NaN results.
    x = np.resize(pattern_classes(1 << 16), n).astype(np.float32)
    y = np.resize(pattern_classes(1 << 16)[::-1], n).astype(np.float32)
    h = np.resize(np.arange(0, 1 << 16, 7, dtype=np.uint32).astype(np.uint16), n)
    if n >= 16:      # subnormal left operands of small normals: an unflushed one changes the sum
        x[8:12] = np.array([2.0 ** -127, -2.0 ** -127, 2.0 ** -140, -2.0 ** -149], np.float32)
        y[8:12] = np.array([2.0 ** -126, 2.0 ** -125, -2.0 ** -126, 2.0 ** -124], np.float32)
    if n > 1000:         # products in the upper half below 2^-126: the hardware flush mode keeps
        v, s_tiny = upper_pair_near(0.75)     # them at 2^-126 too, so they take the exact way there
        x[:64] = v
    else:
        s_tiny = np.float32(1e-20)
    def run():
        a, a2, a3 = x.copy(), x.copy(), x.copy()
        C.add_inplace(a, y)
        C.scale_inplace(a2, float(s_tiny))
        C.scale_inplace(a3, 3.0e30)
        return [C.f32_to_bf16(x), C.bf16_to_f32(h), a, a2, a3, C.add(x, y)]
    x0 = x.copy()
    with scalar():
        want = run()
    if n > 1000:
        assert (want[3][:64] == 0).all()          # flushed: the exact path is really taken
    assert_bits_equal(want[0], A.f32_to_bf16(x), "f32_to_bf16: scalar C vs spec")
    assert_bits_equal(want[2], A.store(A.add(A.flush(x), A.flush(y))), "add_inplace: scalar C vs spec")
    assert_bits_equal(want[5], want[2], "add: scalar C vs add_inplace")
    for lv in LEVELS:
        for threads in (1, 2):
            with level(lv), C.settings(threads=threads):
                got = run()
            for k, (a, b) in enumerate(zip(got, want)):
                assert_bits_equal(a, b, f"elementwise op {k}, level {lv}, {threads} threads")
    assert_bits_equal(x, x0, "add: its left operand unchanged")


def tiny_product_pairs(s: np.ndarray) -> np.ndarray:
    """For each fp32 s in (0.5, 1): a normal d whose exact product d*s lies in
    [2^-126 - 2^-150, 2^-126), so the IEEE product rounds up to 2^-126 (gradual underflow and
    x86 FTZ alike) while the contract flushes it to zero; NaN where no candidate d does."""
    out = np.full(s.shape, np.nan, np.float32)
    lo, hi = 2.0 ** -126 - 2.0 ** -150, 2.0 ** -126
    for i, sv in enumerate(s.astype(np.float64)):
        d0 = np.float32(2.0 ** -126 / sv).view(np.uint32)
        for d in np.arange(d0 - 3, d0 + 4, dtype=np.uint32).view(np.float32):
            if lo <= float(d) * sv < hi:
                out[i] = d
                break
    return out


def upper_tiny_pair(s: np.ndarray) -> np.float32:
    """For an fp32 s in (0.5, 1): a normal d whose exact product d*s lies in [2^-126 - 2^-151,
    2^-126): it rounds up to 2^-126 under gradual underflow and under x86's flush-to-zero alike
    (tininess after rounding), so the hardware flush mode leaves it for the exact path too; NaN
    where no d near 2^-126 / s does."""
    sv = float(np.float32(s))
    d0 = int(np.float32(2.0 ** -126 / sv).view(np.uint32))
    for d in np.arange(d0 - 8, d0 + 9, dtype=np.uint32).view(np.float32):
        if 2.0 ** -126 - 2.0 ** -151 <= float(d) * sv < 2.0 ** -126:
            return d
    return np.float32(np.nan)


def upper_pair_near(v0: float) -> tuple[np.float32, np.float32]:
    """(v, d): the first fp32 v from v0 up whose upper_tiny_pair d exists."""
    u0 = int(np.float32(v0).view(np.uint32))
    for v in np.arange(u0, u0 + 4096, dtype=np.uint32).view(np.float32):
        d = upper_tiny_pair(v)
        if not np.isnan(d):
            return v, d
    raise AssertionError(f"no pair near {v0}")


def test_swiglu_lanes_on_the_exact_path():
    # mul(dout, silu(g)) with an exact value just below 2^-126: the vector marks the lane and the
    # whole vector is recomputed by the scalar helpers. Mixed with ordinary lanes in every vector.
    rng = np.random.default_rng(5)
    N, F = 4, 64
    g = rng.uniform(0.8, 3.0, (N, F)).astype(np.float32)
    with scalar():
        sv = C.silu(g.ravel())
    d = tiny_product_pairs(sv).reshape(N, F)
    ok = ~np.isnan(d)
    assert ok.sum() > N * F // 4
    d = np.where(ok & (rng.random((N, F)) < 0.5), d, rng.standard_normal((N, F))).astype(np.float32)
    u = rng.standard_normal((N, F)).astype(np.float32)
    h = np.ascontiguousarray(np.concatenate([g, u], axis=1))
    hf = np.ascontiguousarray(np.concatenate([g, d], axis=1))   # the forward's mul(silu(g), up)
    with scalar():
        want_f, want_b = CL.swiglu_forward(hf), CL.swiglu_backward(d, h)
    assert_bits_equal(want_b, SL.swiglu_backward(d, h), "swiglu backward: scalar C vs spec")
    assert_bits_equal(want_f, SL.swiglu_forward(hf), "swiglu forward: scalar C vs spec")
    dup = want_b[:, F:]
    flushed = (ok & (np.abs(d) < 1e-37)).ravel()
    assert (dup.ravel()[flushed] == 0).all() and flushed.any()   # the case is really exercised
    assert (want_f.ravel()[flushed] == 0).all()
    # lanes whose product lies in the upper half below 2^-126 (kept at 2^-126 by the hardware
    # flush mode too, so they take the exact way there)
    assert (np.abs(sv.astype(np.float64) * d.ravel())[flushed] >= 2.0 ** -126 - 2.0 ** -151).any()
    for lv in LEVELS:
        with level(lv):
            assert_bits_equal(CL.swiglu_backward(d, h), want_b, f"swiglu backward, level {lv}")
            assert_bits_equal(CL.swiglu_forward(hf), want_f, f"swiglu forward, level {lv}")


@pytest.mark.parametrize("F", [1, 7, 16, 37, 128])
def test_swiglu_equals_scalar(F):
    # Rows of gate | up with special values (subnormals among them) in both halves and in dout;
    # 21 rows: threads' ranges of rows.
    rng = np.random.default_rng(F)
    N = 21
    h = (rng.standard_normal((N, 2 * F)) * 4).astype(np.float32)
    h.ravel()[:: 7] = np.resize(SPECIAL_F32.astype(np.float32), h.ravel()[::7].shape)
    d = rng.standard_normal((N, F)).astype(np.float32)
    d.ravel()[3:: 5] = np.resize(SPECIAL_F32.astype(np.float32), d.ravel()[3::5].shape)
    with scalar():
        want_f, want_b = CL.swiglu_forward(h), CL.swiglu_backward(d, h)
    for lv in LEVELS:
        for threads in (1, 2):
            with level(lv), C.settings(threads=threads):
                where = f"F={F} level {lv}, {threads} threads"
                assert_bits_equal(CL.swiglu_forward(h), want_f, f"forward {where}")
                assert_bits_equal(CL.swiglu_backward(d, h), want_b, f"backward {where}")


@pytest.mark.parametrize("N,C_,V,chunk,spread", [(9, 16, 3000, 1024, 3), (5, 8, 37, 16, 3),
                                                 (33, 24, 1500, 1024, 3), (37, 8, 1003, 1024, 0.5)])
def test_xent_equals_scalar(N, C_, V, chunk, spread):
    # Logits spread wide (spread 3: exps near underflow) or narrow (0.5: every exp counts in the
    # sums), NaN-free; rows in whole vectors of each level and a tail; chunks whose length is not a
    # multiple of the exps computed side by side (4).
    rng = np.random.default_rng(N)
    h = A.f32_to_bf16((rng.standard_normal((N, C_)) * spread).astype(np.float32))
    w = A.f32_to_bf16((rng.standard_normal((V, C_)) * spread).astype(np.float32))
    t = rng.integers(0, V, N).astype(np.int32)
    dloss = (rng.standard_normal(N) * 1e-3).astype(np.float32)
    dloss[::3] = -0.0                           # rows whose loss gradient is -0
    zc = np.float32(1e-4)
    with scalar():
        want_f = CX._forward_chunked(h, w, t, zc, chunk)
        want_b = CX._backward_chunked(h, w, t, zc, want_f[1], dloss, chunk)
    for k, (a, b) in enumerate(zip(want_f, SX.xent_forward(h, w, t, zc, chunk=chunk))):
        assert_bits_equal(a, b, f"xent forward output {k}: scalar C vs spec")
    if chunk == CX.XENT_CHUNK:                 # the backward's bits do not depend on the chunk
        for k, (a, b) in enumerate(zip(want_b, SX.xent_backward(h, w, t, zc, want_f[1], dloss))):
            assert_bits_equal(a, b, f"xent backward output {k}: scalar C vs spec")
    for lv in LEVELS:
        with level(lv):
            got_f = CX._forward_chunked(h, w, t, zc, chunk)
            got_b = CX._backward_chunked(h, w, t, zc, want_f[1], dloss, chunk)
        for k, (a, b) in enumerate(zip(got_f, want_f)):
            assert_bits_equal(a, b, f"xent forward output {k}, level {lv}")
        for k, (a, b) in enumerate(zip(got_b, want_b)):
            assert_bits_equal(a, b, f"xent backward output {k}, level {lv}")


@pytest.mark.parametrize("B,T,H,G,D,W", [(1, 150, 4, 2, 20, 0), (2, 70, 2, 1, 16, 33), (1, 9, 1, 1, 3, 0),
                                         (1, 131, 2, 2, 64, 0)])
def test_attention_equals_scalar(B, T, H, G, D, W):
    # Blocks of 64 keys and their tails, lanes of rows (2W, W and the scalar tail), windows, GQA.
    from mlx_open1b.cpu_ref import attention as CA
    rng = np.random.default_rng(T)
    q = A.f32_to_bf16((rng.standard_normal((B, T, H, D)) * 2).astype(np.float32))
    k = A.f32_to_bf16((rng.standard_normal((B, T, G, D)) * 2).astype(np.float32))
    v = A.f32_to_bf16(rng.standard_normal((B, T, G, D)).astype(np.float32))
    dout = (rng.standard_normal((B, T, H, D)) * 1e-2).astype(np.float32)
    scale = float(np.float32(1 / np.sqrt(D)))
    with scalar():
        o, lse = CA.attention_forward(q, k, v, W, scale)
        grads = CA.attention_backward(dout, q, k, v, o, lse, W, scale)
        o8, lse8 = CA.attention_forward_i8(q, k, v, W, scale)
    assert_attention_is_spec(q, k, v, dout, o, lse, grads, W, scale, "attention ")
    for lv in LEVELS:
        with level(lv):
            got = CA.attention_forward(q, k, v, W, scale)
            got_g = CA.attention_backward(dout, q, k, v, o, lse, W, scale)
            got8 = CA.attention_forward_i8(q, k, v, W, scale)
        for a, b, what in zip(got + got8 + got_g, (o, lse, o8, lse8) + tuple(grads),
                              ("o", "lse", "o i8", "lse i8", "dq", "dk", "dv")):
            assert_bits_equal(a, b, f"attention {what}, level {lv}")


def test_attention_lanes_on_the_exact_path():
    # dv sums mul(p, dout): with dout rows at ~2^-126/p, products just below 2^-126 round up to
    # 2^-126 in IEEE and are flushed by the contract; the vectors holding them go the scalar way.
    from mlx_open1b.cpu_ref import attention as CA
    from mlx_open1b.spec import attention as SA
    B, T, H, G, D, W = 1, 40, 1, 1, 32, 0
    rng = np.random.default_rng(11)
    q = A.f32_to_bf16((rng.standard_normal((B, T, H, D)) * 0.1).astype(np.float32))
    k = A.f32_to_bf16((rng.standard_normal((B, T, G, D)) * 0.1).astype(np.float32))
    v = A.f32_to_bf16(rng.standard_normal((B, T, G, D)).astype(np.float32))
    scale = float(np.float32(1 / np.sqrt(D)))
    with scalar():
        o, lse = CA.attention_forward(q, k, v, W, scale)
    # p of the pair (query i, key j) as the backward recomputes it, for the last query row
    qf, kf = A.bf16_to_f32(q)[0, :, 0], A.bf16_to_f32(k)[0, :, 0]
    i = T - 1
    s = np.array([SA_dot(qf[i], kf[j]) for j in range(T)], np.float32)
    p = S.exp(A.sub(A.mul(s, np.float32(scale)), lse[0, 0, i]))
    d = tiny_product_pairs(p[:1])
    assert not np.isnan(d).any()
    dout = np.zeros((B, T, H, D), np.float32)
    dout[0, i, 0, :] = d[0]                        # key 0's dv is the one product mul(p_0i, d)
    with scalar():
        want = CA.attention_backward(dout, q, k, v, o, lse, W, scale)
    for a, b, what in zip(want, SA.attention_backward(dout, q, k, v, o, lse, W, scale), "qkv"):
        assert_bits_equal(a, b, f"attention d{what}: scalar C vs spec")
    assert (want[2][0, 0, 0] == 0).all()           # flushed: the case is really exercised
    for lv in LEVELS:
        with level(lv):
            got = CA.attention_backward(dout, q, k, v, o, lse, W, scale)
        for a, b, what in zip(got, want, "qkv"):
            assert_bits_equal(a, b, f"attention d{what}, level {lv}")


def test_attention_sums_through_the_flush():
    # dv of the one key of a 1-token sequence sums dout over the 4 query heads of its group (p = 1):
    # 2^-125 - 1.25 * 2^-125 is -2^-127, flushed to -0 by the contract, then + 1.75 * 2^-126. The
    # SIMD rows add with the hardware flush mode set; without it the sum would keep -2^-127 and
    # end at 1.25 * 2^-126. No product or result is exactly 2^-126 (no row goes the exact way).
    from mlx_open1b.cpu_ref import attention as CA
    from mlx_open1b.spec import attention as SA
    B, T, H, G, D, W = 1, 1, 4, 1, 20, 0
    rng = np.random.default_rng(13)
    q = A.f32_to_bf16(rng.standard_normal((B, T, H, D)).astype(np.float32))
    k = A.f32_to_bf16(rng.standard_normal((B, T, G, D)).astype(np.float32))
    v = A.f32_to_bf16((1 + np.abs(rng.standard_normal((B, T, G, D)))).astype(np.float32))  # dout v: no tiny sums
    scale = float(np.float32(1 / np.sqrt(D)))
    dout = np.zeros((B, T, H, D), np.float32)
    for h, x in enumerate([2.0 ** -125, -1.25 * 2.0 ** -125, 1.75 * 2.0 ** -126, 0.0]):
        dout[0, 0, h, :] = x
    with scalar():
        o, lse = CA.attention_forward(q, k, v, W, scale)
        want = CA.attention_backward(dout, q, k, v, o, lse, W, scale)
    for a, b, what in zip(want, SA.attention_backward(dout, q, k, v, o, lse, W, scale), "qkv"):
        assert_bits_equal(a, b, f"attention d{what}: scalar C vs spec")
    assert (want[2] == np.float32(1.75 * 2.0 ** -126)).all()     # the flush really decides
    for lv in LEVELS:
        with level(lv):
            got = CA.attention_backward(dout, q, k, v, o, lse, W, scale)
        for a, b, what in zip(got, want, "qkv"):
            assert_bits_equal(a, b, f"attention d{what}, level {lv}")


def test_attention_i8_zero_and_nonfinite_blocks():
    # §6.10's special blocks on the SIMD rows: keys 64..127 have zero value rows, so that block's
    # weight step is +0 (pv = +0) while its larger scores still rescale acc; batch 1 has an inf in
    # value row 100, so every later query's second block is non-finite (the contract.h way).
    from mlx_open1b.cpu_ref import attention as CA
    from mlx_open1b.spec import attention as SA
    B, T, H, G, D, W = 2, 150, 2, 1, 16, 0
    rng = np.random.default_rng(17)
    q = (rng.standard_normal((B, T, H, D)) * 2).astype(np.float32)
    k = (rng.standard_normal((B, T, G, D)) * 2).astype(np.float32)
    k[:, 64:128] = q[:, 64:128, :1] * 3            # the block's own scores rise: corr < 1
    v = rng.standard_normal((B, T, G, D)).astype(np.float32)
    v[:, 64:128] = 0.0
    v[1, 140, 0, 5] = np.inf
    q, k, v = A.f32_to_bf16(q), A.f32_to_bf16(k), A.f32_to_bf16(v)
    scale = float(np.float32(1 / np.sqrt(D)))
    with scalar():
        want = CA.attention_forward_i8(q, k, v, W, scale)
    for a, b, what in zip(want, SA.attention_forward_i8(q, k, v, W, scale), ("o", "lse")):
        assert_bits_equal(a, b, f"attention i8 {what}: scalar C vs spec")
    assert np.isnan(want[0][1, 140:]).all() and not np.isnan(want[0][:, :140]).any()
    for lv in LEVELS:
        with level(lv):
            got = CA.attention_forward_i8(q, k, v, W, scale)
        for a, b, what in zip(got, want, ("o", "lse")):
            assert_bits_equal(a, b, f"attention i8 {what}, level {lv}")


def SA_dot(x, y):
    """sum_{d ascending} mul(x[d], y[d]) from +0, the contract's dot product."""
    acc = np.float32(0.0)
    for a, b in zip(x, y):
        acc = A.add(acc, A.mul(a, b))
    return acc


@pytest.mark.parametrize("gain", [True, False])
@pytest.mark.parametrize("N,Cc", [(17, 64), (33, 130), (4, 7), (40, 32), (21, 48)])
def test_rmsnorm_equals_scalar(N, Cc, gain):
    # Rows with inf, NaN, -FLT_MAX and subnormals (r = 0, b = -0, products of zeros of both signs).
    # Vectors of rows and a partial last one (a thread's range), columns in whole transposed
    # blocks of a level and a gathered tail; 1 to 3 threads.
    from helpers import sprinkle
    rng = np.random.default_rng(N + Cc)
    x = sprinkle(rng, (rng.standard_normal((N, Cc)) * 3).astype(np.float32), SPECIAL_F32.astype(np.float32), 0.03)
    x[1, 0] = np.float32(-3.4028235e38)
    g = A.f32_to_bf16(rng.standard_normal(Cc).astype(np.float32)) if gain else None
    dy = rng.standard_normal((N, Cc)).astype(np.float32)
    dy[2] = -0.0
    with scalar():
        y, r = CL.rmsnorm_forward(x, g, 1e-6)
        dx, dg = CL.rmsnorm_backward(dy, x, g, r)
    for lv in LEVELS:
        for threads in (1, 2, 3):
            with level(lv), C.settings(threads=threads):
                y2, r2 = CL.rmsnorm_forward(x, g, 1e-6)
                dx2, dg2 = CL.rmsnorm_backward(dy, x, g, r)
            where = f"level {lv}, {threads} threads"
            assert_bits_equal(y2, y, f"rmsnorm y, {where}")
            assert_bits_equal(r2, r, f"rmsnorm rstd, {where}")
            assert_bits_equal(dx2, dx, f"rmsnorm dx, {where}")
            if gain:
                assert_bits_equal(dg2, dg, f"rmsnorm dg, {where}")


def test_rmsnorm_rows_on_the_exact_path():
    # The backward's dot of a row that is zero but for one x = 0.75 whose dy makes mul(dy, x)
    # round up to 2^-126 (the contract flushes it): that vector of rows goes the scalar way.
    N, Cc = 33, 16
    rng = np.random.default_rng(17)
    x = rng.standard_normal((N, Cc)).astype(np.float32)
    dy = rng.standard_normal((N, Cc)).astype(np.float32)
    d = tiny_product_pairs(np.array([0.75], np.float32))[0]
    assert not np.isnan(d)
    for row in (3, 20):
        x[row] = 0.0
        dy[row] = 0.0
        x[row, 5], dy[row, 5] = 0.75, d
    with scalar():
        y, r = CL.rmsnorm_forward(x, None, 1e-6)
        dx, _ = CL.rmsnorm_backward(dy, x, None, r)
    sy, sr = SL.rmsnorm_forward(x, None, 1e-6)
    assert_bits_equal(y, sy, "rmsnorm y: scalar C vs spec")
    assert_bits_equal(dx, SL.rmsnorm_backward(dy, x, None, sr)[0], "rmsnorm dx: scalar C vs spec")
    for lv in LEVELS:
        with level(lv):
            dx2, _ = CL.rmsnorm_backward(dy, x, None, r)
        assert_bits_equal(dx2, dx, f"rmsnorm dx, level {lv}")


def square_over_count_rounding_up(Cc: int) -> np.float32:
    """An fp32 x whose mul(mul(x, x), 1/Cc) rounds up to 2^-126 from an exact product below it
    (the contract flushes it); NaN where none near sqrt(2^-126 Cc) does."""
    s = np.float32(1) / np.float32(Cc)
    u0 = int(np.float32(np.sqrt(2.0 ** -126 / float(s))).view(np.uint32))
    xs = np.arange(u0 - 3000, u0 + 3000, dtype=np.uint32).view(np.float32)
    e = (xs * xs).astype(np.float64) * float(s)
    ok = (e >= 2.0 ** -126 - 2.0 ** -150) & (e < 2.0 ** -126)
    return xs[ok][0] if ok.any() else np.float32(np.nan)


def test_rmsnorm_row_scalars_on_the_exact_path():
    # The row scalars computed on lanes: a forward row whose mul(ss, 1/C) rounds up to 2^-126
    # (with eps = 0 the flushed r is rsqrt(0) = inf, not 2^63), and a backward row whose
    # t = mul(dy, g) rounds up to 2^-126 (its dot, b and dx change): each marks its vector of
    # rows, which gets its row scalars from contract.h. The gain's column sums: a product that
    # rounds up marks its block of columns, summed again by contract.h.
    N, Cc = 37, 25
    x0 = square_over_count_rounding_up(Cc)
    gs = next(b for b in range(0x3F01, 0x3F80)          # a bf16 gain with such a dy
              if not np.isnan(upper_tiny_pair(A.bf16_to_f32(np.array([b], np.uint16))[0])))
    d = upper_tiny_pair(A.bf16_to_f32(np.array([gs], np.uint16))[0])
    assert not np.isnan(x0) and not np.isnan(d)
    rng = np.random.default_rng(23)
    x = rng.standard_normal((N, Cc)).astype(np.float32)
    dy = rng.standard_normal((N, Cc)).astype(np.float32)
    g = A.f32_to_bf16(rng.standard_normal(Cc).astype(np.float32))
    g[5] = gs
    for row in (3, 34):
        x[row] = 0.0
        x[row, 5] = x0
    for row in (7, 20):
        x[row], dy[row] = 0.0, 0.0
        x[row, 5], dy[row, 5] = 1.0, d
    # the gain's column sum of one column: zero but for a row whose mul(dy, mul(x, r)) rounds up
    col = 9
    x[13] = 1.0
    for v in np.arange(0.70, 0.80, 0.001, dtype=np.float32):   # a mul(x, r) that has such a dy
        x[13, col] = v
        with scalar():
            r0 = CL.rmsnorm_forward(x, None, 0.0)[1]
        dy13 = upper_tiny_pair(x[13, col] * r0[13])
        if not np.isnan(dy13):
            break
    assert not np.isnan(dy13)
    dy[:, col] = 0.0
    dy[13, col] = dy13
    with scalar():
        y, r = CL.rmsnorm_forward(x, None, 0.0)
    rb = r.copy()
    rb[[3, 34]] = 1.0                                   # the backward's r: no inf rows (0 inf = NaN)
    with scalar():
        dx, dg = CL.rmsnorm_backward(dy, x, g, rb)
    assert dg[col] == 0                                 # the product flushed: dg's sum is +0
    sy, sr = SL.rmsnorm_forward(x, None, 0.0)
    assert_bits_equal(r, sr, "rmsnorm rstd: scalar C vs spec")
    assert_bits_equal(y, sy, "rmsnorm y: scalar C vs spec")
    assert np.isinf(r[3]) and np.isinf(r[34])           # the flush really decides r
    sdx, sdg = SL.rmsnorm_backward(dy, x, g, rb)
    assert_bits_equal(dx, sdx, "rmsnorm dx: scalar C vs spec")
    assert_bits_equal(dg, sdg, "rmsnorm dg: scalar C vs spec")
    assert dx[7, 5] == 0 and dx[20, 5] == 0             # t flushed: no -b x term at the column
    for lv in LEVELS:
        with level(lv):
            y2, r2 = CL.rmsnorm_forward(x, None, 0.0)
            dx2, dg2 = CL.rmsnorm_backward(dy, x, g, rb)
        assert_bits_equal(r2, r, f"rmsnorm rstd, level {lv}")
        assert_bits_equal(y2, y, f"rmsnorm y, level {lv}")
        assert_bits_equal(dx2, dx, f"rmsnorm dx, level {lv}")
        assert_bits_equal(dg2, dg, f"rmsnorm dg, level {lv}")


@pytest.mark.parametrize("D", [32, 20, 64])
def test_rope_embedding_sumsq_equal_scalar(D):
    # RoPE rows with special values (D/2 in whole vectors of a level, or a scalar row); the
    # embedding backward's rows of repeated token ids (positions in order, C in vectors and a
    # tail); sums of squares of whole blocks on lanes and the partial last block; each at every
    # level and thread count, against the scalar C and the spec. A RoPE row whose products
    # round up to 2^-126 (cos, sin = 0.75) goes the exact way.
    from mlx_open1b.cpu_ref import optim as CO
    from mlx_open1b.spec import optim as SO
    from helpers import sprinkle
    rng = np.random.default_rng(D)
    B, T, R = 2, 9, 3
    x = sprinkle(rng, (rng.standard_normal((B, T, R, D)) * 3).astype(np.float32), SPECIAL_F32.astype(np.float32), 0.03)
    cos, sin = CL.rope_tables(T, D, 10000.0)
    v, d = upper_pair_near(0.75)
    cos, sin = cos.copy(), sin.copy()
    cos[4], sin[4] = v, v
    x[1, 4, 2, :] = d                               # every product of that row rounds up to 2^-126
    V, N = 11, 40
    tok = rng.integers(0, V - 3, N).astype(np.int32)
    dout = sprinkle(rng, rng.standard_normal((N, D + 5)).astype(np.float32), SPECIAL_F32.astype(np.float32), 0.05)
    xs = sprinkle(rng, rng.standard_normal(CO.NORM_BLOCK * 17 + 37).astype(np.float32), SPECIAL_F32.astype(np.float32), 0.001)
    xs[5 * CO.NORM_BLOCK + 3] = np.float32(2.0 ** -63)   # a square of exactly 2^-126, kept
    # (no fp32 square rounds up to 2^-126 from below: test_no_square_rounds_up_to_2_126)

    def run():
        return [CL.rope_forward(x, cos, sin), CL.rope_backward(x, cos, sin),
                CL.embedding_backward(tok, dout, V), CO.sumsq_blocks(xs)]
    with scalar():
        want = run()
    assert_bits_equal(want[0], SL.rope(x, cos, sin), "rope forward: scalar C vs spec")
    assert_bits_equal(want[1], SL.rope(x, cos, sin, backward=True), "rope backward: scalar C vs spec")
    assert_bits_equal(want[2], SL.embedding_backward(tok, dout, V), "embedding backward: scalar C vs spec")
    assert_bits_equal(want[3], SO.sumsq_blocks(xs, CO.NORM_BLOCK), "sumsq: scalar C vs spec")
    assert (want[0][1, 4, 2] == 0).all()             # the tiny products really flush
    for lv in LEVELS:
        for threads in (1, 2):
            with level(lv), C.settings(threads=threads):
                got = run()
            for k, (a, b) in enumerate(zip(got, want)):
                assert_bits_equal(a, b, f"op {k}, level {lv}, {threads} threads")


SUMSQ_SIZES = [1, 7, 100, 4096, 4097, 3 * 4096 + 100, 5 * 4096 + 16, 16 * 4096, 17 * 4096 + 37,
               33 * 4096 - 5, 50 * 4096 + 1234]


def sumsq_inputs(n: int) -> list[np.ndarray]:
    """Arrays of n floats: varied magnitudes (a sum in another order differs); sparse special
    values; squares below 2^-126 (flushed: summed without the flush they would show) among zeros,
    with exact 2^-126 squares (x = +-2^-63) and subnormals."""
    from helpers import sprinkle
    rng = np.random.default_rng(n)
    plain = (rng.standard_normal(n) * np.exp2(rng.integers(-8, 8, n))).astype(np.float32)
    special = sprinkle(rng, plain, SPECIAL_F32.astype(np.float32), 0.0003)
    tiny = np.zeros(n, np.float32)
    k = rng.choice(n, max(1, n // 5), replace=False)
    tiny[k] = (rng.choice([-1.0, 1.0], k.size) * np.exp2(rng.uniform(-80.0, -62.0, k.size))).astype(np.float32)
    tiny[rng.choice(n, max(1, n // 50))] = rng.choice(np.array([2.0 ** -63, -(2.0 ** -63), 1e-40, -1e-45], np.float32))
    return [plain, special, tiny]


@pytest.mark.parametrize("n", SUMSQ_SIZES)
def test_sumsq_blocks_equal_scalar_and_spec(n):
    # Whole groups of W blocks, groups of fewer blocks than lanes, one block, short last blocks
    # (a partial vector of elements, and exactly one), threads' ranges starting inside a group;
    # at every level and 1-3 threads against the scalar C and the spec.
    from mlx_open1b.cpu_ref import optim as CO
    from mlx_open1b.spec import optim as SO
    for k, x in enumerate(sumsq_inputs(n)):
        with scalar():
            want = CO.sumsq_blocks(x)
        assert_bits_equal(want, SO.sumsq_blocks(x, CO.NORM_BLOCK), f"sumsq n={n} input {k}: scalar C vs spec")
        for lv in LEVELS:
            for threads in (1, 2, 3):
                with level(lv), C.settings(threads=threads):
                    got = CO.sumsq_blocks(x)
                assert_bits_equal(got, want, f"sumsq n={n} input {k}, level {lv}, {threads} threads")


def test_no_square_rounds_up_to_2_126():
    # Why sumsq's vectors can square under the hardware flush mode: an IEEE square of 2^-126 is
    # exact (x = 2^-63), never a tiny square rounded up, so it is o1b_mul's result: the exact
    # square of every fp32 below 2^-63 lies below 2^-126 - 2^-151, the point from which it would
    # round up to 2^-126 with an unbounded exponent (x86's tininess after rounding), and below
    # 2^-126 - 2^-150 (gradual underflow's).
    with np.errstate(under="ignore"):
        x = patterns(2.0 ** -64, 2.0 ** -63)[:-1]
        assert (x.astype(np.float64) ** 2 < 2.0 ** -126 - 2.0 ** -151).all()
        assert (x * x < np.float32(2.0 ** -126)).all()
        assert np.float32(2.0 ** -63) * np.float32(2.0 ** -63) == np.float32(2.0 ** -126)


def test_rope_ranges_start_mid_position():
    # Threads' ranges of rows that start inside a position's heads (row 82 of (3, 11, 5) rows:
    # position 5, head 2): each row's position is counted on from its range's start.
    rng = np.random.default_rng(5)
    B, T, R, D = 3, 11, 5, 32
    x = rng.standard_normal((B, T, R, D)).astype(np.float32)
    cos, sin = CL.rope_tables(T, D, 10000.0)
    want = SL.rope(x, cos, sin), SL.rope(x, cos, sin, backward=True)
    for lv in LEVELS:
        for threads in (1, 2):
            with level(lv), C.settings(threads=threads):
                got = CL.rope_forward(x, cos, sin), CL.rope_backward(x, cos, sin)
            for a, b, what in zip(got, want, ("forward", "backward")):
                assert_bits_equal(a, b, f"rope {what}, level {lv}, {threads} threads")


@pytest.mark.parametrize("n", [5, 16, 1000])
def test_adamw_equals_scalar(n):
    # Gradients and moments with specials and zeros of both signs; the first and a later step;
    # moments whose decay product rounds up to 2^-126 (flushed by the contract).
    from helpers import sprinkle
    from mlx_open1b.cpu_ref import optim as CO
    rng = np.random.default_rng(n)
    p0 = A.f32_to_bf16((rng.standard_normal(n) * 0.02).astype(np.float32))
    g = sprinkle(rng, (rng.standard_normal(n) * 1e-3).astype(np.float32), SPECIAL_F32.astype(np.float32), 0.05)
    m0 = sprinkle(rng, (rng.standard_normal(n) * 1e-4).astype(np.float32), np.array([0.0, -0.0], np.float32), 0.1)
    v0 = np.abs(rng.standard_normal(n) * 1e-7).astype(np.float32)
    d = tiny_product_pairs(np.array([0.75], np.float32))[0]   # mul(b1 = 0.75, d) rounds up to 2^-126
    assert not np.isnan(d)
    for i in (3, 20):                                          # the exact way, in vectors of a pair
        if i < n:
            m0[i], g[i] = d, 0.0
    for step, b1 in ((1, 0.9), (7, 0.9), (7, 0.75)):
        outs = []
        for ctx in [scalar()] + [level(lv) for lv in LEVELS]:
            p, m, v = p0.copy(), m0.copy(), v0.copy()
            with ctx:
                CO.adamw_step(p, g, m, v, lr=3e-3, beta1=b1, beta2=0.95, eps=1e-8, weight_decay=0.1,
                              step=step)
            outs.append((p, m, v))
        for lv, got in zip(LEVELS, outs[1:]):
            for a, b, what in zip(got, outs[0], "pmv"):
                assert_bits_equal(a, b, f"adamw {what}, step {step}, beta1 {b1}, level {lv}")


def _widen_rows(x, n, D, ld, want_t, want_ranges):
    """vmath.c's o1b_vwiden_rows on n rows of D values ld apart in x (bf16 as uint16, or float32):
    (out (n, D), out_t (D, n) or None, elo, ehi or None). The transposed copy goes, as attention.c
    has it, into a wider array (rows of n + 5, from column 2); every output sits between guard
    values, which must come back untouched."""
    import ctypes
    from mlx_open1b.cpu_ref import _lib
    f = _lib.lib.o1b_vwiden_rows
    f.restype = None
    f.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    G, ldt = 16, n + 5
    out = np.full(n * D + 2 * G, 0x7FBADBAD, np.uint32)
    out_t = np.full(D * ldt + 2 * G, 0x7FBADBAD, np.uint32) if want_t else None
    lo, hi = (np.full(n + 2 * G, -7, np.int32) for _ in range(2)) if want_ranges else (None, None)
    at = lambda a, k=G: None if a is None else a.ctypes.data + 4 * k
    bf = x.dtype == np.uint16
    f(n, D, at(x, 0) if bf else None, None if bf else at(x, 0), ld, at(out), at(out_t, G + 2), ldt, at(lo), at(hi))
    for a, what in ((out, "rows"), (out_t, "transposed"), (lo, "exponent min"), (hi, "exponent max")):
        if a is not None:
            assert (a[:G] == a[0]).all() and (a[-G:] == a[0]).all(), f"{what}: written outside the output"
    if out_t is not None:
        t = out_t[G:-G].reshape(D, ldt)
        assert (t[:, :2] == 0x7FBADBAD).all() and (t[:, 2 + n:] == 0x7FBADBAD).all(), \
            "transposed: written outside its columns"
        out_t = t[:, 2:2 + n]
    cut = lambda a: None if a is None else a[G:-G]
    return cut(out).reshape(n, D).view(np.float32), out_t, cut(lo), cut(hi)


@pytest.mark.parametrize("n,D", [(1, 1), (15, 16), (16, 16), (17, 20), (33, 32), (40, 48), (16, 8), (5, 4)])
@pytest.mark.parametrize("bf16", [True, False])
def test_widen_rows_moves_bits_and_finds_exponent_ranges(n, D, bf16):
    # attention.c's widening: rows of D values (ld apart) widened, flushed, copied transposed, and
    # each row's exponent range (min of the nonzero fields, 255 if none; max). Every row has its one
    # largest exponent in column r % D and its one smallest in column (7r + 3) % D, so every column
    # position of a block of rows holds some row's max and some row's min; zeros, subnormals (read as
    # zeros), infinities and NaN are mixed in, and the last rows are zeros only.
    rng = np.random.default_rng(1000 * n + D)
    ld = D + 3
    e = rng.integers(40, 200, (n, ld)).astype(np.uint32)
    for r in range(n):
        e[r, r % D] = 250
        if (7 * r + 3) % D != r % D:
            e[r, (7 * r + 3) % D] = 2 + r % 3
    bits = (e << 23) | rng.integers(0, 1 << 23, (n, ld), dtype=np.uint32) | (rng.integers(0, 2, (n, ld), dtype=np.uint32) << 31)
    special = rng.random((n, ld))
    bits[special < 0.05] = 0x80000000                                  # -0
    bits[(special >= 0.05) & (special < 0.1)] = 0x00000123             # subnormal: a zero
    if n > 2:
        bits[n - 2:] = 0
    bits[0, D - 1] = 0x7F800000 if D > 1 else bits[0, D - 1]           # inf: exponent 255
    bits[n // 2, 0] = 0x7FC00001 if n > 3 else bits[n // 2, 0]          # a NaN
    if bf16:
        x = (bits >> 16).astype(np.uint16)
        want_bits = x.astype(np.uint32) << 16
    else:
        x = bits.view(np.float32)
        want_bits = bits.copy()
    want_bits = want_bits[:, :D]
    want_bits = np.where((want_bits & 0x7F800000) == 0, want_bits & 0x80000000, want_bits).astype(np.uint32)
    fields = (want_bits >> 23 & 0xFF).astype(np.int32)
    want_lo = np.where(fields == 0, 255, fields).min(axis=1)
    want_hi = fields.max(axis=1)
    runs = [("scalar", lambda: vector_math(False))] + [(f"level {lv}", lambda lv=lv: level(lv)) for lv in LEVELS]
    for name, ctx in runs:
        for want_t, want_ranges in ((True, True), (True, False), (False, True), (False, False)):
            with ctx():
                out, out_t, lo, hi = _widen_rows(np.ascontiguousarray(x), n, D, ld, want_t, want_ranges)
            what = f"{name}, transposed {want_t}, ranges {want_ranges}"
            assert_bits_equal(out.view(np.uint32), want_bits, f"rows, {what}")
            if want_t:
                assert_bits_equal(out_t, want_bits.T, f"transposed, {what}")
            if want_ranges:
                assert_bits_equal(lo, want_lo.astype(np.int32), f"exponent min, {what}")
                assert_bits_equal(hi, want_hi.astype(np.int32), f"exponent max, {what}")
