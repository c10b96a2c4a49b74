"""Embedding, RMSNorm (gain and gain-free/QK-norm), RoPE, SwiGLU: C == spec bit for bit,
accuracy against float64 with argued per-element bounds, thread independence, bad input."""
import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.spec import arith as A, layers as S

from helpers import SPECIAL_BF16, SPECIAL_F32, assert_bits_equal, rand_bf16, rand_f32, sprinkle

U = 2.0 ** -24   # unit roundoff of float32 (round to nearest)
SHAPES = [(1, 1), (3, 5), (17, 64), (33, 130)]


def both_threads(fn):
    with C.settings(threads=1):
        a = fn()
    with C.settings(threads=2):
        b = fn()
    return a, b


# ---------------------------------------------------------------- embedding
def test_embedding_bits_and_order():
    rng = np.random.default_rng(10)
    V, Cc, N = 50, 24, 300
    wte = sprinkle(rng, rand_bf16(rng, (V, Cc)), SPECIAL_BF16)
    tok = rng.integers(0, V, N).astype(np.int32)
    tok[:40] = 7                              # one row gets many positions: order matters
    out = C.embedding_forward(tok, wte)
    assert_bits_equal(out, S.embedding_forward(tok, wte), "embedding forward")
    dout = sprinkle(rng, rand_f32(rng, (N, Cc)), SPECIAL_F32, 0.01)
    a, b = both_threads(lambda: C.embedding_backward(tok, dout, V))
    assert_bits_equal(a, b, "threads")
    assert_bits_equal(a, S.embedding_backward(tok, dout, V), "embedding backward vs spec")


def test_embedding_backward_accuracy():
    rng = np.random.default_rng(11)
    V, Cc, N = 20, 16, 500
    tok = rng.integers(0, V, N).astype(np.int32)
    dout = rand_f32(rng, (N, Cc))
    got = C.embedding_backward(tok, dout, V).astype(np.float64)
    ref, mag = np.zeros((V, Cc)), np.zeros((V, Cc))
    np.add.at(ref, tok, dout.astype(np.float64))
    np.add.at(mag, tok, np.abs(dout.astype(np.float64)))
    cnt = np.bincount(tok, minlength=V)[:, None]
    # a sequential sum of k terms errs by at most (k-1) u sum|terms| (Higham 4.2)
    assert (np.abs(got - ref) <= cnt * U * mag + 1e-30).all()


def test_embedding_bad_input():
    wte = np.zeros((4, 3), np.uint16)
    with pytest.raises(ValueError, match=r"tokens: token id 4 at index 1 is outside \[0, 4\)"):
        C.embedding_forward(np.array([0, 4], np.int32), wte)
    with pytest.raises(ValueError, match="tokens: expected dtype int32"):
        C.embedding_forward(np.array([0, 1], np.int64), wte)
    with pytest.raises(ValueError, match="wte: expected dtype uint16"):
        C.embedding_forward(np.array([0], np.int32), wte.astype(np.float32))
    with pytest.raises(ValueError, match="dout: dimension 0 is 3, expected 2"):
        C.embedding_backward(np.array([0, 1], np.int32), np.zeros((3, 3), np.float32), 4)


# ---------------------------------------------------------------- RMSNorm / QK-norm
@pytest.mark.parametrize("N,Cc", SHAPES)
@pytest.mark.parametrize("gain", [True, False])
def test_rmsnorm_bits(N, Cc, gain):
    rng = np.random.default_rng(N * 100 + Cc)
    x = sprinkle(rng, rand_f32(rng, (N, Cc), 3.0), SPECIAL_F32, 0.02) if N > 3 else rand_f32(rng, (N, Cc))
    g = rand_bf16(rng, (Cc,)) if gain else None
    (y, r), (y2, r2) = both_threads(lambda: C.rmsnorm_forward(x, g, 1e-6))
    assert_bits_equal(y, y2, "threads y")
    ys, rs = S.rmsnorm_forward(x, g, 1e-6)
    assert_bits_equal(y, ys, "y")
    assert_bits_equal(r, rs, "rstd")
    dy = rand_f32(rng, (N, Cc))
    (dx, dg), (dx2, dg2) = both_threads(lambda: C.rmsnorm_backward(dy, x, g, r))
    assert_bits_equal(dx, dx2, "threads dx")
    dxs, dgs = S.rmsnorm_backward(dy, x, g, r)
    assert_bits_equal(dx, dxs, "dx")
    if gain:
        assert_bits_equal(dg, dgs, "dg")
        assert_bits_equal(dg, dg2, "threads dg")


@pytest.mark.parametrize("N,Cc", [(1, 1), (37, 13), (700, 32), (40, 2048), (3, 9000), (0, 8), (5, 0)],
                         ids=["1x1", "37x13", "chunks-of-rows", "16-rows-a-chunk", "rows-wider-than-the-scratch",
                              "no-rows", "empty-rows"])
@pytest.mark.parametrize("gain", [True, False])
def test_rmsnorm_bf16_out_is_the_conversion_of_the_fp32_output(N, Cc, gain):
    """bf16_out: the rows computed into a cache-sized scratch and converted there: y's bits are
    f32_to_bf16 of the fp32 y (specials, zero and subnormal rows included), rstd the same, on one
    thread and two, and the spec's."""
    rng = np.random.default_rng(N + Cc)
    x = rand_f32(rng, (N, Cc), 3.0)
    if x.size:
        x = sprinkle(rng, x, SPECIAL_F32, 0.02)
    if N > 2:
        x[1], x[2] = 0.0, 1e-40
    g = rand_bf16(rng, (Cc,)) if gain else None
    y, r = C.rmsnorm_forward(x, g, 1e-6)
    (yb, rb), (yb2, rb2) = both_threads(lambda: C.rmsnorm_forward(x, g, 1e-6, bf16_out=True))
    assert yb.dtype == np.uint16 and yb.shape == x.shape
    assert_bits_equal(yb, C.f32_to_bf16(y), "fused vs converted")
    assert_bits_equal(yb2, yb, "threads")
    assert_bits_equal(rb, r, "rstd")
    assert_bits_equal(rb2, r, "rstd threads")
    assert_bits_equal(yb, A.f32_to_bf16(S.rmsnorm_forward(x, g, 1e-6)[0]), "spec")


@pytest.mark.parametrize("N,Cc", [(9, 8), (20, 128), (5, 1000)])
def test_rmsnorm_accuracy(N, Cc):
    rng = np.random.default_rng(5)
    x, dy = rand_f32(rng, (N, Cc), 2.0), rand_f32(rng, (N, Cc))
    g = rand_bf16(rng, (Cc,))
    x64, dy64, g64 = x.astype(np.float64), dy.astype(np.float64), A.bf16_to_f32(g).astype(np.float64)
    eps = float(np.float32(1e-6))
    y, r = C.rmsnorm_forward(x, g, eps)
    r64 = 1 / np.sqrt((x64 ** 2).mean(1) + eps)
    y64 = x64 * r64[:, None] * g64
    # ms: a sum of C positive terms (rel. error <= C u) then 3 roundings; rsqrt 1.5 ulp halves the
    # relative error of its argument and adds ~3u; y: two more roundings. (C/2 + 8) u covers it.
    assert (np.abs(y - y64) <= (Cc / 2 + 8) * U * np.abs(y64) + 1e-37).all()
    dx, dg = C.rmsnorm_backward(dy, x, g, r)
    t = dy64 * g64
    dot = (t * x64).sum(1)
    dx64 = t * r64[:, None] - x64 * (dot * r64 ** 3 / Cc)[:, None]
    scale = np.abs(t * r64[:, None]) + np.abs(x64) * ((np.abs(t * x64).sum(1)) * r64 ** 3 / Cc)[:, None]
    # dot carries <= C u sum|t x| (that is in `scale`), r^3 about 3(C/2+8)u, the rest a few u.
    assert (np.abs(dx - dx64) <= (2 * Cc + 30) * U * scale + 1e-37).all()
    dg64 = (dy64 * x64 * r64[:, None]).sum(0)
    mag = np.abs(dy64 * x64 * r64[:, None]).sum(0)
    assert (np.abs(dg - dg64) <= (N + Cc / 2 + 10) * U * mag + 1e-37).all()
    # and the analytic float64 gradient itself agrees with finite differences
    h, j = 1e-6, (1, 3)
    f = lambda xx: (dy64 * xx * (1 / np.sqrt((xx ** 2).mean(1) + eps))[:, None] * g64).sum()
    xp, xm = x64.copy(), x64.copy()
    xp[j] += h
    xm[j] -= h
    assert abs((f(xp) - f(xm)) / (2 * h) - dx64[j]) < 1e-6 * max(1, abs(dx64[j]))


def test_rmsnorm_bad_input():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="g: dimension 0 is 3, expected 4"):
        C.rmsnorm_forward(x, np.zeros(3, np.uint16), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        C.rmsnorm_forward(x, None, float("nan"))
    with pytest.raises(ValueError, match="rstd: dimension 0 is 3, expected 2"):
        C.rmsnorm_backward(x, x, None, np.zeros(3, np.float32))


# ---------------------------------------------------------------- RoPE
@pytest.mark.parametrize("B,T,R,D", [(1, 1, 1, 2), (2, 7, 3, 8), (1, 70, 4, 16)])
def test_rope_bits(B, T, R, D):
    rng = np.random.default_rng(T)
    cos, sin = C.rope_tables(T + 3, D, 500000.0)
    cs, ss = S.rope_tables(T + 3, D, 500000.0)
    assert_bits_equal(cos, cs, "cos table")
    assert_bits_equal(sin, ss, "sin table")
    x = sprinkle(rng, rand_f32(rng, (B, T, R, D)), SPECIAL_F32, 0.02)
    y, y2 = both_threads(lambda: C.rope_forward(x, cos, sin))
    assert_bits_equal(y, y2, "threads")
    assert_bits_equal(y, S.rope(x, cos, sin), "forward")
    assert_bits_equal(C.rope_backward(x, cos, sin), S.rope(x, cos, sin, backward=True), "backward")


def test_rope_accuracy():
    T, D, theta = 256, 64, 500000.0
    cos, sin = C.rope_tables(T, D, theta)
    i = np.arange(D // 2)
    f64 = theta ** (-2.0 * i / D)
    ang = np.arange(T)[:, None] * f64[None, :]
    # inv_freq: exp of an argument |a| = (2i/D) ln(theta) <= 13.2 whose rounding errs by about
    # (|a| + 2) u absolutely, so f errs relatively by that plus exp's 1.25 ulp; the angle
    # t*f inherits it and adds half an ulp of the angle; sin/cos add <= 9e-8 (§4).
    a = 2.0 * i / D * np.log(theta)
    dang = ang * (a + 6) * U + np.abs(ang) * U + 1e-30
    assert (np.abs(cos - np.cos(ang)) <= dang + 9e-8).all()
    assert (np.abs(sin - np.sin(ang)) <= dang + 9e-8).all()
    # the rotation given the tables: two products and one sum, relative to |x1 c| + |x2 s|
    rng = np.random.default_rng(0)
    x = rand_f32(rng, (1, T, 2, D))
    y = C.rope_forward(x, cos, sin)
    c64, s64 = cos.astype(np.float64)[None, :, None], sin.astype(np.float64)[None, :, None]
    x1, x2 = x[..., :D // 2].astype(np.float64), x[..., D // 2:].astype(np.float64)
    ref = np.concatenate([x1 * c64 - x2 * s64, x2 * c64 + x1 * s64], -1)
    mag = np.concatenate([np.abs(x1 * c64) + np.abs(x2 * s64), np.abs(x2 * c64) + np.abs(x1 * s64)], -1)
    assert (np.abs(y - ref) <= 2 * U * mag + 1e-37).all()
    # backward is the transpose: <R^T dy, x> == <dy, R x> in float64 up to rounding
    dy = rand_f32(rng, (1, T, 2, D))
    dx = C.rope_backward(dy, cos, sin)
    lhs = (dx.astype(np.float64) * x).sum()
    rhs = (dy.astype(np.float64) * ref).sum()
    assert abs(lhs - rhs) <= 4 * U * (np.abs(dy) * mag).sum()


def test_rope_bad_input():
    with pytest.raises(ValueError, match="D: head dimension must be even"):
        C.rope_tables(4, 5, 10000.0)
    cos, sin = C.rope_tables(4, 8, 10000.0)
    with pytest.raises(ValueError, match="cos: table has 4 positions, x needs 5"):
        C.rope_forward(np.zeros((1, 5, 1, 8), np.float32), cos, sin)
    with pytest.raises(ValueError, match="x: expected 4 dimensions"):
        C.rope_forward(np.zeros((5, 8), np.float32), cos, sin)


# ---------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("N,F", [(1, 1), (7, 13), (40, 96)])
def test_swiglu_bits(N, F):
    rng = np.random.default_rng(F)
    h = sprinkle(rng, rand_f32(rng, (N, 2 * F), 4.0), SPECIAL_F32, 0.05)
    out, out2 = both_threads(lambda: C.swiglu_forward(h))
    assert_bits_equal(out, out2, "threads")
    assert_bits_equal(out, S.swiglu_forward(h), "forward")
    dout = rand_f32(rng, (N, F))
    assert_bits_equal(C.swiglu_backward(dout, h), S.swiglu_backward(dout, h), "backward")


@pytest.mark.parametrize("N,F", [(1, 1), (7, 13), (300, 64), (3, 5000)],
                         ids=["1x1", "7x13", "chunks-of-rows", "rows-wider-than-the-scratch"])
def test_swiglu_bf16_out_is_the_conversion_of_the_fp32_output(N, F):
    """bf16_out: each range's rows computed into a cache-sized scratch and converted there (several
    chunks a range at 300 x 64; one row a chunk past the scratch's 8192 floats): the bits of
    f32_to_bf16 of the fp32 output, specials (NaN canonical, subnormals flushed) and bf16 rounding
    ties included, on one thread and two, and the spec's."""
    rng = np.random.default_rng(N * F)
    h = sprinkle(rng, rand_f32(rng, (N, 2 * F), 4.0), SPECIAL_F32, 0.05)
    h[0, :min(F, 4)] = [0.5, 1.0 + 2.0 ** -8, -(1.0 + 3 * 2.0 ** -8), 3.0][:min(F, 4)]   # near bf16 ties
    dout = sprinkle(rng, rand_f32(rng, (N, F)), SPECIAL_F32, 0.05)
    for fwd in (True, False):
        op = (lambda **k: C.swiglu_forward(h, **k)) if fwd else (lambda **k: C.swiglu_backward(dout, h, **k))
        want = C.f32_to_bf16(op())
        got, got2 = both_threads(lambda: op(bf16_out=True))
        assert got.dtype == np.uint16 and got.shape == want.shape
        assert_bits_equal(got, want, "fused vs converted")
        assert_bits_equal(got2, want, "threads")
        spec = S.swiglu_forward(h) if fwd else S.swiglu_backward(dout, h)
        assert_bits_equal(got, A.f32_to_bf16(spec), "spec")


def test_swiglu_accuracy():
    rng = np.random.default_rng(7)
    N, F = 64, 200
    h, dout = rand_f32(rng, (N, 2 * F), 4.0), rand_f32(rng, (N, F))
    g, u, d = (a.astype(np.float64) for a in (h[:, :F], h[:, F:], dout))
    s = 1 / (1 + np.exp(-g))
    out = C.swiglu_forward(h)
    # silu is within 2.65 ulp (§4), one more product: 4 ulp = 8u relative (ulp <= 2u |v|)
    assert (np.abs(out - g * s * u) <= 8 * U * np.abs(g * s * u) + 1e-37).all()
    dh = C.swiglu_backward(dout, h)
    dsilu = s * (1 + g * (1 - s))
    # s errs by <= 2.5 ulp (5u s); 1 - s then errs absolutely by ~5u, amplified by |g|; the
    # products add a few u: |d u| (5u(1 + |g|) s + 8u |dsilu|) bounds dgate.
    bound = np.abs(d * u) * (5 * U * (1 + np.abs(g)) * s + 8 * U * np.abs(dsilu)) + 1e-37
    assert (np.abs(dh[:, :F] - d * u * dsilu) <= bound).all()
    assert (np.abs(dh[:, F:] - d * g * s) <= 8 * U * np.abs(d * g * s) + 1e-37).all()


def test_swiglu_bad_input():
    with pytest.raises(ValueError, match="h: last dimension must be 2F"):
        C.swiglu_forward(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="dout: dimension 1 is 3, expected 2"):
        C.swiglu_backward(np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32))
