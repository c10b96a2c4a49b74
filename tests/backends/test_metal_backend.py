"""The Metal backend (mlx_open1b.metal.ops) against the C reference, bit for bit.

Where Metal is available (mx.metal.is_available()) the kernels run through mx.fast.metal_kernel;
everywhere else the same kernel sources run in the emulator (mlx_open1b.metal.emu), which needs
only g++. Inputs are seeded and include subnormals, ±0, ±inf, NaN and the largest and smallest
normals; shapes are not multiples of any tile or threadgroup size.

The emulator's own tests (barriers, race check, compile errors, cache) use the emulator directly,
so they run on every machine.
"""
from __future__ import annotations

import platform
import subprocess
import sys

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.metal import emu, ops as M, runtime
from mlx_open1b.spec import arith as A

from helpers import SPECIAL_BF16, SPECIAL_F32, assert_bits_equal, rand_bf16, rand_f32, sprinkle

EXTRA_F32 = np.array([2.0 ** -126 * 1.5, np.float32(1.1754942e-38), -(2.0 ** -125), 88.72, -103.5, -87.4,
                      1e10, -3e9, 2.0 ** 31, 3.4e38, 25000.0, 0.5, -0.5, 1e-30], np.float32)
SPECIALS = np.concatenate([SPECIAL_F32, EXTRA_F32])


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng([0x0E7A1, *key])


def sweep(stride: int) -> np.ndarray:
    """Every stride-th fp32 bit pattern (both signs, all exponents), plus the specials."""
    u = np.arange(0, 2 ** 32, stride, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([u.view(np.float32), SPECIALS])


def with_specials(rng, a, frac=0.05):
    return sprinkle(rng, a, SPECIALS if a.dtype == np.float32 else SPECIAL_BF16, frac)


def test_backend_available():
    ok, why = M.available()
    assert ok, why
    assert ("Metal" in why)


# ---------------------------------------------------------------------------------------------
# §3 primitives through a test kernel: the integer tiny-check of mul/div equals the double one
# ---------------------------------------------------------------------------------------------
# The results are written as the primitives return them, without o1b_store: a primitive must flush
# its own result (§3), and a flushing store would hide one that does not. Only NaN payloads are
# left to compare canonically (o1b_store's other job), through raw().
PRIM_SRC = """
uint i = thread_position_in_grid.x;
float x = o1b_load(a[i]), y = o1b_load(b[i]);
mul_out[i] = o1b_mul(x, y);
div_out[i] = o1b_div(x, y);
add_out[i] = o1b_add(x, y);
max_out[i] = o1b_max(x, y);
"""


def raw(out: np.ndarray) -> np.ndarray:
    """A primitive's unstored result with its NaNs made canonical and nothing else changed."""
    return A.canon(out)


def _near_min_normal_pairs(rng, n):
    """Operand pairs whose exact product (or quotient) lies within a few ulp of 2^-126."""
    a = rng.uniform(1.0, 2.0, n).astype(np.float32) * np.float32(2.0) ** rng.integers(-60, 60, n).astype(np.float32)
    b_mul = (np.float64(2.0 ** -126) / a.astype(np.float64)).astype(np.float32)
    with np.errstate(over="ignore"):
        b_div = (a.astype(np.float64) / np.float64(2.0 ** -126)).astype(np.float32)
    steps = rng.integers(-3, 4, n).astype(np.int32)
    b_mul = (b_mul.view(np.int32) + steps).view(np.float32)
    b_div = (b_div.view(np.int32) + steps).view(np.float32)
    sign = rng.choice(np.array([1, -1], np.float32), n)
    return a * sign, b_mul, b_div


def test_primitives_mul_div_add_max():
    rng = rng_for(1)
    x = sweep(2 ** 32 // 3000)
    a = np.repeat(x, 8)
    b = rng.choice(x, a.size)
    na, nb_mul, nb_div = _near_min_normal_pairs(rng, 20000)
    edge_a = np.array([np.float32(1 - 2 ** -24), 2.0 ** -126, -(2.0 ** -126), 1.5, 2.0 ** -126], np.float32)
    edge_b = np.array([2.0 ** -126, np.float32(1 - 2 ** -24), np.float32(1 - 2 ** -24), 2.0 ** -126 / 1.5, 1.0],
                      np.float32)
    a = np.concatenate([a, na, na, edge_a]).astype(np.float32)
    b = np.concatenate([b, nb_mul, nb_div, edge_b]).astype(np.float32)
    k = runtime.get_kernel("test_primitives_raw", ["a", "b"], ["mul_out", "div_out", "add_out", "max_out"],
                           PRIM_SRC, runtime.header())
    outs = k(inputs=[a, b], output_shapes=[a.shape] * 4, output_dtypes=[np.float32] * 4,
             grid=(a.size, 1, 1), threadgroup=(256, 1, 1))
    fa, fb = A.flush(a), A.flush(b)
    assert_bits_equal(raw(outs[0]), A.store(A.mul(fa, fb)), "mul")
    assert_bits_equal(raw(outs[1]), A.store(A.div(fa, fb)), "div")
    assert_bits_equal(raw(outs[2]), A.store(A.add(fa, fb)), "add")
    assert_bits_equal(raw(outs[3]), A.store(A.maximum(fa, fb)), "max")
    # the C reference's scalar ops agree on the boundary cases
    sel = np.r_[np.arange(a.size - 5, a.size), rng.choice(a.size, 300)]
    mul, div = raw(outs[0]), raw(outs[1])
    for i in sel:
        assert np.float32(C.mathfn.scalar_mul(float(a[i]), float(b[i]))).view(np.uint32) == mul[i].view(np.uint32)
        assert np.float32(C.mathfn.scalar_div(float(a[i]), float(b[i]))).view(np.uint32) == div[i].view(np.uint32)
    assert outs[0][-5] == 0 and outs[0][-5].view(np.uint32) == 0     # (1 - 2^-24) * 2^-126: IEEE gives 2^-126


# ---------------------------------------------------------------------------------------------
# §4 functions, §2 conversions, elementwise
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", M.FUNCTIONS)
def test_map_functions(name):
    x = sweep(499)                                                  # 8.6 million bit patterns
    assert_bits_equal(getattr(M, name)(x), getattr(C, name)(x), name)
    x2 = rand_f32(rng_for(2), (3, 37), 30.0)                        # a 2-D array keeps its shape
    assert_bits_equal(getattr(M, name)(x2), getattr(C, name)(x2), name)


def test_conversions():
    h = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    assert_bits_equal(M.bf16_to_f32(h), C.bf16_to_f32(h), "bf16_to_f32")
    x = sweep(4099)
    assert_bits_equal(M.f32_to_bf16(x), C.f32_to_bf16(x), "f32_to_bf16")
    assert M.f32_to_bf16(np.zeros((0, 3), np.float32)).shape == (0, 3)


def test_add_scale_scalars():
    rng = rng_for(3)
    a = with_specials(rng, rand_f32(rng, (29, 31), 1e-19), 0.2)
    b = with_specials(rng, rand_f32(rng, (29, 31), 1e-19), 0.2)
    a1, a2 = a.copy(), a.copy()
    M.add_inplace(a1, b)
    C.add_inplace(a2, b)
    assert_bits_equal(a1, a2, "add_inplace")
    for s in (0.5, 1 / 3, 1e-30, -2.0, np.inf, 3e38):
        a1, a2 = a.copy(), a.copy()
        M.scale_inplace(a1, s)
        C.scale_inplace(a2, s)
        assert_bits_equal(a1, a2, f"scale_inplace {s}")
    for x in SPECIALS[::2]:
        for y in SPECIALS[1::3]:
            for mf, cf in ((M.scalar_add, C.mathfn.scalar_add), (M.scalar_sub, C.mathfn.scalar_sub),
                           (M.scalar_mul, C.mathfn.scalar_mul), (M.scalar_div, C.mathfn.scalar_div)):
                assert_bits_equal(np.float32(mf(float(x), float(y))), np.float32(cf(float(x), float(y))),
                                  f"{mf.__name__}({x}, {y})")
            assert_bits_equal(np.float32(M.clip_coef(x, y)), np.float32(C.clip_coef(x, y)), f"clip_coef({x}, {y})")


# ---------------------------------------------------------------------------------------------
# §6 ops
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,K,M_", [(1, 1, 1), (5, 7, 3), (17, 33, 9), (40, 70, 45)])
def test_linear(N, K, M_):
    rng = rng_for(4, N, K)
    x = with_specials(rng, rand_bf16(rng, (N, K)), 0.03)
    w = with_specials(rng, rand_bf16(rng, (M_, K)), 0.03)
    dy = with_specials(rng, rand_bf16(rng, (N, M_)), 0.03)
    assert_bits_equal(M.linear_forward(x, w), C.linear_forward(x, w), "linear_forward")
    for got, want, what in zip(M.linear_backward(dy, x, w), C.linear_backward(dy, x, w), ("dx", "dw")):
        assert_bits_equal(got, want, what)
    dx, dw = M.linear_backward(dy, x, w, need_dx=False)
    assert dx is None and dw.shape == (M_, K)


def test_linear_no_fma_cases():
    # CONTRACT.md §6.1: sequences where a fused multiply-add would differ.
    b = lambda v: np.array(v, np.float32).view(np.uint32).__rshift__(16).astype(np.uint16)
    x = b([[2.0 ** -100, 2.0 ** -64], [2.0 ** -64, 0.0], [np.float32(np.uint32(0x7F7F0000).view(np.float32)), 2.0 ** 64]])
    w = b([[2.0 ** -26, -(2.0 ** -64)], [-(2.0 ** -64), 0.0], [-1.0, 2.0 ** 64]])
    assert_bits_equal(M.linear_forward(x, w), C.linear_forward(x, w), "no-FMA cases")


def test_embedding():
    rng = rng_for(5)
    V, C_, N = 11, 13, 37
    wte = with_specials(rng, rand_bf16(rng, (V, C_)))
    tokens = rng.integers(0, V - 2, N).astype(np.int32)                 # rows V-2, V-1 unused
    dout = with_specials(rng, rand_f32(rng, (N, C_)), 0.1)
    assert_bits_equal(M.embedding_forward(tokens, wte), C.embedding_forward(tokens, wte), "embedding_forward")
    assert_bits_equal(M.embedding_backward(tokens, dout, V), C.embedding_backward(tokens, dout, V), "embedding_backward")
    empty = np.zeros(0, np.int32)
    assert_bits_equal(M.embedding_backward(empty, np.zeros((0, C_), np.float32), V),
                      C.embedding_backward(empty, np.zeros((0, C_), np.float32), V), "embedding_backward empty")


@pytest.mark.parametrize("gain", [True, False])
def test_rmsnorm(gain):
    rng = rng_for(6, gain)
    N, C_ = 19, 13
    x = with_specials(rng, rand_f32(rng, (N, C_)), 0.05)
    x[3] = 0.0
    x[4] = 1e-30
    g = with_specials(rng, rand_bf16(rng, (C_,)), 0.2) if gain else None
    dy = with_specials(rng, rand_f32(rng, (N, C_)), 0.05)
    for eps in (1e-6, 0.0):
        ym, rm = M.rmsnorm_forward(x, g, eps)
        yc, rc = C.rmsnorm_forward(x, g, eps)
        assert_bits_equal(ym, yc, "y")
        assert_bits_equal(rm, rc, "rstd")
        dxm, dgm = M.rmsnorm_backward(dy, x, g, rc)
        dxc, dgc = C.rmsnorm_backward(dy, x, g, rc)
        assert_bits_equal(dxm, dxc, "dx")
        if gain:
            assert_bits_equal(dgm, dgc, "dg")
        else:
            assert dgm is None and dgc is None


@pytest.mark.parametrize("T,D,theta", [(9, 6, 10000.0), (40, 10, 500000.0), (3, 2, 1.5)])
def test_rope(T, D, theta):
    cm, sm = M.rope_tables(T, D, theta)
    cc, sc = C.rope_tables(T, D, theta)
    assert_bits_equal(cm, cc, "cos table")
    assert_bits_equal(sm, sc, "sin table")
    rng = rng_for(7, T, D)
    x = with_specials(rng, rand_f32(rng, (2, T, 3, D)), 0.05)
    assert_bits_equal(M.rope_forward(x, cc, sc), C.rope_forward(x, cc, sc), "rope_forward")
    assert_bits_equal(M.rope_backward(x, cc, sc), C.rope_backward(x, cc, sc), "rope_backward")
    big_c, big_s = C.rope_tables(T + 5, D, theta)                       # a table longer than T
    assert_bits_equal(M.rope_forward(x, big_c, big_s), C.rope_forward(x, big_c, big_s), "rope_forward long table")


def test_swiglu():
    rng = rng_for(8)
    h = with_specials(rng, rand_f32(rng, (7, 2 * 23), 4.0), 0.05)
    dout = with_specials(rng, rand_f32(rng, (7, 23)), 0.05)
    assert_bits_equal(M.swiglu_forward(h), C.swiglu_forward(h), "swiglu_forward")
    assert_bits_equal(M.swiglu_backward(dout, h), C.swiglu_backward(dout, h), "swiglu_backward")


ATTN_CASES = [  # B, T, H, G, D, W, special fraction
    (1, 1, 1, 1, 2, 0, 0.0),
    (2, 70, 4, 2, 8, 0, 0.0),
    (1, 130, 2, 1, 6, 5, 0.0),
    (1, 100, 3, 3, 4, 64, 0.0),
    (2, 67, 4, 1, 8, 70, 0.01),
    (1, 20, 2, 2, 4, 1, 0.02),
]


@pytest.mark.parametrize("B,T,H,G,D,W,frac", ATTN_CASES)
def test_attention(B, T, H, G, D, W, frac):
    rng = rng_for(9, T, D, W)
    q = rand_bf16(rng, (B, T, H, D), 2.0)
    k = rand_bf16(rng, (B, T, G, D), 2.0)
    v = rand_bf16(rng, (B, T, G, D))
    dout = rand_f32(rng, (B, T, H, D))
    if frac:
        q, k, v, dout = (with_specials(rng, a, frac) for a in (q, k, v, dout))
    scale = float(np.float32(1 / np.sqrt(D)))
    om, lm = M.attention_forward(q, k, v, W, scale)
    oc, lc = C.attention_forward(q, k, v, W, scale)
    assert_bits_equal(om, oc, "o")
    assert_bits_equal(lm, lc, "lse")
    for got, want, what in zip(M.attention_backward(dout, q, k, v, oc, lc, W, scale),
                               C.attention_backward(dout, q, k, v, oc, lc, W, scale), ("dq", "dk", "dv")):
        assert_bits_equal(got, want, what)


@pytest.mark.parametrize("N,C_,V,frac", [(5, 7, 2500, 0.0), (3, 4, 1024, 0.001), (4, 9, 37, 0.02)])
def test_xent(N, C_, V, frac):
    rng = rng_for(10, V)
    h = rand_bf16(rng, (N, C_), 2.0)
    w = rand_bf16(rng, (V, C_), 2.0)
    if frac:
        h, w = with_specials(rng, h, frac), with_specials(rng, w, frac)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[0] = V - 1
    for zcoef in (1e-4, 0.0):
        fm, fc = M.xent_forward(h, w, targets, zcoef), C.xent_forward(h, w, targets, zcoef)
        for got, want, what in zip(fm, fc, ("loss", "lse", "ce")):
            assert_bits_equal(got, want, what)
        dloss = np.full(N, np.float32(1 / N), np.float32)
        dloss[-1] = 3.0
        for got, want, what in zip(M.xent_backward(h, w, targets, zcoef, fc[1], dloss),
                                   C.xent_backward(h, w, targets, zcoef, fc[1], dloss), ("dh", "dw")):
            assert_bits_equal(got, want, what)


def test_adamw():
    rng = rng_for(11)
    n = 1001
    p = with_specials(rng, rand_bf16(rng, (n,), 0.1), 0.03)
    g = with_specials(rng, rand_f32(rng, (n,), 0.01), 0.03)
    m = with_specials(rng, rand_f32(rng, (n,), 0.01), 0.03)
    v = np.abs(with_specials(rng, rand_f32(rng, (n,), 1e-4), 0.03))
    for step, wd in ((1, 0.0), (10, 0.1), (1000, 0.01)):
        a = [x.copy() for x in (p, g, m, v)]
        b = [x.copy() for x in (p, g, m, v)]
        M.adamw_step(a[0], a[1], a[2], a[3], lr=3e-4, weight_decay=wd, step=step)
        C.adamw_step(b[0], b[1], b[2], b[3], lr=3e-4, weight_decay=wd, step=step)
        for x, y, what in zip(a, b, ("p", "g", "m", "v")):
            assert_bits_equal(x, y, f"adamw {what} step {step}")


def test_reductions():
    rng = rng_for(12)
    for n in (0, 1, 4095, 4096, 4097, 10000):
        x = with_specials(rng, rand_f32(rng, (n,), 1e-19), 0.001) if n > 100 else rand_f32(rng, (n,))
        assert_bits_equal(M.sumsq_blocks(x), C.sumsq_blocks(x), f"sumsq_blocks n={n}")
    for n in list(range(0, 20)) + [63, 64, 100, 1000]:
        vals = rand_f32(rng, (n,), 1e3)
        assert_bits_equal(np.float32(M.treefold(vals)), np.float32(C.treefold(vals)), f"treefold n={n}")
    vals = with_specials(rng, rand_f32(rng, (50,)), 0.1)
    assert_bits_equal(np.float32(M.treefold(vals)), np.float32(C.treefold(vals)), "treefold specials")
    ts = [rand_f32(rng, (9000,)), rand_f32(rng, (3, 5)), rand_f32(rng, (5000,), 1e-20)]
    assert_bits_equal(np.float32(M.global_norm(ts)), np.float32(C.global_norm(ts)), "global_norm")


def test_random():
    for seed, stream, index0, sub, n in ((0, 0, 0, 0, 5), (2 ** 40 + 5, 1, 2 ** 32 - 3, 7, 300),
                                          (2 ** 64 - 1, 0xFFFF, 2 ** 64 - 2, 2 ** 32 - 1, 9)):
        assert_bits_equal(M.philox_blocks(seed, stream, index0, n, sub).view(np.float32),
                          C.philox_blocks(seed, stream, index0, n, sub).view(np.float32), "philox")
    for seed, index0, n, sigma in ((1234, 0, 3000, 0.02), (2 ** 50 + 3, 2 ** 33, 500, 1.0)):
        assert_bits_equal(M.trunc_normal(seed, 1, index0, n, sigma), C.trunc_normal(seed, 1, index0, n, sigma),
                          "trunc_normal")
    assert M.philox_blocks(1, 1, 0, 0).shape == (0, 4)


CASES = 20   # seeded random-shape cases per op, besides the fixed cases above


def _random_case(op, seed):
    rng = rng_for(100, seed, len(op))
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    frac = float(rng.choice([0.0, 0.002, 0.02]))
    bf = lambda *shape, scale=1.0: with_specials(rng, rand_bf16(rng, shape, scale), frac)
    f32 = lambda *shape, scale=1.0: with_specials(rng, rand_f32(rng, shape, scale), frac)
    if op == "linear":
        N, K, M_ = r(1, 40), r(1, 70), r(1, 40)
        x, w, dy = bf(N, K), bf(M_, K), bf(N, M_)
        return [(lambda o: o.linear_forward(x, w)), (lambda o: o.linear_backward(dy, x, w))]
    if op == "attention":
        G, rep, D = r(1, 3), r(1, 3), 2 * r(1, 6)
        B, T, W = r(1, 2), r(1, 150), int(rng.choice([0, 1, r(1, 80)]))
        q, k, v, dout = bf(B, T, G * rep, D, scale=3.0), bf(B, T, G, D, scale=3.0), bf(B, T, G, D), f32(B, T, G * rep, D)
        sc = float(rng.uniform(0.1, 1.0))
        o, lse = C.attention_forward(q, k, v, W, sc)
        return [(lambda m: m.attention_forward(q, k, v, W, sc)),
                (lambda m: m.attention_backward(dout, q, k, v, o, lse, W, sc))]
    if op == "xent":
        N, C_, V = r(1, 9), r(1, 20), r(1, 3000)
        h, w, t = bf(N, C_, scale=2.0), bf(V, C_, scale=2.0), rng.integers(0, V, N).astype(np.int32)
        zc, dloss = float(rng.choice([0.0, 1e-4, 0.5])), f32(N)
        lse = C.xent_forward(h, w, t, zc)[1]
        return [(lambda m: m.xent_forward(h, w, t, zc)), (lambda m: m.xent_backward(h, w, t, zc, lse, dloss))]
    if op == "norm_rope_swiglu_embedding":
        N, C_, V, D = r(1, 30), r(1, 30), r(1, 20), 2 * r(1, 8)
        x, dy, g = f32(N, C_), f32(N, C_), bf(C_) if rng.random() < 0.5 else None
        rstd = C.rmsnorm_forward(x, g, 1e-6)[1]
        T = r(1, 12)
        cs, sn = C.rope_tables(T, D, float(rng.choice([10000.0, 500000.0])))
        xr, h2, d2 = f32(r(1, 2), T, r(1, 3), D), f32(N, 2 * C_, scale=5.0), f32(N, C_)
        tok, wte, dout = rng.integers(0, V, N).astype(np.int32), bf(V, C_), f32(N, C_)
        return [(lambda m: m.rmsnorm_forward(x, g, 1e-6)), (lambda m: m.rmsnorm_backward(dy, x, g, rstd)),
                (lambda m: m.rope_tables(T, D, 10000.0)), (lambda m: m.rope_forward(xr, cs, sn)),
                (lambda m: m.rope_backward(xr, cs, sn)), (lambda m: m.swiglu_forward(h2)),
                (lambda m: m.swiglu_backward(d2, h2)), (lambda m: m.embedding_forward(tok, wte)),
                (lambda m: m.embedding_backward(tok, dout, V))]
    raise ValueError(op)


def _flat(res):
    if isinstance(res, (tuple, list)):
        return [a for r in res if r is not None for a in _flat(r)]
    return [np.asarray(res)]


@pytest.mark.parametrize("op", ["linear", "attention", "xent", "norm_rope_swiglu_embedding"])
def test_random_cases(op):
    for seed in range(CASES):
        for i, call in enumerate(_random_case(op, seed)):
            for j, (got, want) in enumerate(zip(_flat(call(M)), _flat(call(C)))):
                assert_bits_equal(got, want, f"{op} case {seed} call {i} output {j}")


def test_bad_input_same_errors_before_launch():
    launches = emu.stats["launches"]
    x = np.zeros((3, 4), np.float32)
    w = np.zeros((5, 4), np.uint16)
    cases = [
        lambda ops: ops.linear_forward(x, w),                                  # x must be bf16
        lambda ops: ops.linear_forward(w[:, :3], w),                           # not contiguous
        lambda ops: ops.embedding_forward(np.array([0, 5], np.int32), w),      # token out of range
        lambda ops: ops.rmsnorm_forward(x, None, -1.0),
        lambda ops: ops.attention_forward(*(np.zeros((1, 2, 3, 4), np.uint16),) * 2,
                                          np.zeros((1, 2, 3, 4), np.uint16), -1, 0.5),
        lambda ops: ops.xent_forward(w, w, np.array([0, 1, 2, 3, 9], np.int32), 1e-4),
        lambda ops: ops.adamw_step(np.zeros(3, np.uint16), np.zeros(3, np.float32), np.zeros(3, np.float32),
                                   np.zeros(2, np.float32), lr=1e-3, step=1),
        lambda ops: ops.philox_blocks(-1, 0, 0, 3),
        lambda ops: ops.exp(np.zeros(3, np.float64)),
    ]
    for case in cases:
        with pytest.raises(ValueError) as em:
            case(M)
        with pytest.raises(ValueError) as ec:
            case(C)
        assert str(em.value) == str(ec.value)
    assert emu.stats["launches"] == launches


def test_model_step_matches_cpu_ref():
    from mlx_open1b.config import ModelConfig
    from mlx_open1b.model import Model, init_params
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      ffn_hidden=48, seq_len=16, window=4)
    params = init_params(cfg, 7, ops=M)
    assert_bits_equal(params, init_params(cfg, 7), "init_params")
    windows = rng_for(13).integers(0, cfg.vocab_size, (2, cfg.seq_len + 1)).astype(np.uint32)
    lm, cem, zm, gm = Model(cfg, ops=M).loss_and_grad(params, windows)
    lc, cec, zc, gc = Model(cfg).loss_and_grad(params, windows)
    assert_bits_equal(np.float32([lm, cem, zm]), np.float32([lc, cec, zc]), "loss, ce, z")
    assert_bits_equal(gm, gc, "gradient")


# ---------------------------------------------------------------------------------------------
# The kernels are the contract: a one-ulp change in a source is caught
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ftz", [False, True] if platform.machine() in ("x86_64", "AMD64") else [False])
def test_results_do_not_depend_on_hardware_flushing(ftz):
    """The header's primitives give the contract's bits whether or not the hardware flushes
    subnormals (emulated with x86 FTZ|DAZ, tininess after rounding, as a flushing GPU)."""
    rng = rng_for(16)
    na, nb_mul, nb_div = _near_min_normal_pairs(rng, 5000)
    tiny = (rng.uniform(-4, 4, 5000) * 2.0 ** -126).astype(np.float32)     # sums near and below 2^-126
    a = np.concatenate([na, na, tiny, rng.choice(SPECIALS, 2000)]).astype(np.float32)
    b = np.concatenate([nb_mul, nb_div, -(tiny * np.float32(1.5)), rng.choice(SPECIALS, 2000)]).astype(np.float32)
    k = emu.EmuKernel("test_primitives_raw_ftz", ["a", "b"], ["mul_out", "div_out", "add_out", "max_out", "sub_out"],
                      PRIM_SRC + "sub_out[i] = o1b_sub(x, y);", runtime.header(), ftz=ftz)
    outs = k(inputs=[a, b], output_shapes=[a.shape] * 5, output_dtypes=[np.float32] * 5,
             grid=(a.size, 1, 1), threadgroup=(256, 1, 1))
    fa, fb = A.flush(a), A.flush(b)
    for got, want, what in zip(outs, (A.mul(fa, fb), A.div(fa, fb), A.add(fa, fb), A.maximum(fa, fb),
                                      A.sub(fa, fb)), ("mul", "div", "add", "max", "sub")):
        assert_bits_equal(raw(got), A.store(want), f"{what} (ftz={ftz})")
    x = sweep(99991)
    (y,) = emu.EmuKernel("map_ftz", ["x"], ["y"], runtime.source("map"), runtime.header(), ftz=ftz)(
        inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(x.size, 1, 1),
        threadgroup=(256, 1, 1), template=[("OP", 7)])
    assert_bits_equal(y, C.silu(x), f"silu (ftz={ftz})")


def test_planted_one_ulp_mutation_is_caught():
    header = runtime.header()
    assert header.count("0x3E2AAAABu") == 1          # exp's 1/3! coefficient (0x1.555556p-3)
    mutated = header.replace("0x3E2AAAABu", "0x3E2AAAAAu")
    x = sweep(9973)
    want = C.exp(x)
    for hdr, expect_equal in ((header, True), (mutated, False)):
        k = runtime.get_kernel("map_mutation_check" + ("" if expect_equal else "_planted"), ["x"], ["y"],
                               runtime.source("map"), hdr)
        (got,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(x.size, 1, 1),
                   threadgroup=(256, 1, 1), template=[("OP", 0)])
        same = np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert same == expect_equal, (f"{'unchanged' if expect_equal else 'mutated'} exp: "
                                      f"{np.count_nonzero(got.view(np.uint32) != want.view(np.uint32))} mismatches")


# ---------------------------------------------------------------------------------------------
# The emulator: barriers, race check, compile errors, the signature, the cache
# ---------------------------------------------------------------------------------------------
REDUCE_SRC = """
threadgroup uint buf[64];
uint t = thread_position_in_threadgroup.x;
uint g = threadgroup_position_in_grid.x;
buf[t] = x[g * 64 + t];
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = 32; s > 0; s >>= 1) {
    if (t < s) buf[t] = buf[t] + buf[t + s];
    BARRIER
}
if (t == 0) out[g] = buf[0];
"""
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def _reduce(src, x, race_check, real=False):
    if real:
        k = runtime.MetalKernel("tree_reduce_real", ["x"], ["out"], src)
    else:
        k = emu.EmuKernel("tree_reduce", ["x"], ["out"], src, race_check=race_check)
    (out,) = k(inputs=[x], output_shapes=[(x.size // 64,)], output_dtypes=[np.uint32],
               grid=(x.size, 1, 1), threadgroup=(64, 1, 1))
    return out


def test_barrier_reduction_gives_the_right_answer():
    x = rng_for(14).integers(0, 2 ** 20, 64 * 5).astype(np.uint32)
    want = x.reshape(5, 64).sum(1).astype(np.uint32)
    np.testing.assert_array_equal(_reduce(REDUCE_SRC.replace("BARRIER", BARRIER), x, True), want)
    np.testing.assert_array_equal(_reduce(REDUCE_SRC.replace("BARRIER", BARRIER), x, False, real=True), want)


def test_missing_barrier_is_detected():
    x = rng_for(15).integers(0, 2 ** 20, 64 * 5).astype(np.uint32)
    want = x.reshape(5, 64).sum(1).astype(np.uint32)
    src = REDUCE_SRC.replace("BARRIER", "")
    with pytest.raises(emu.EmuRaceError, match="tree_reduce.*missing threadgroup_barrier"):
        _reduce(src, x, True)
    # without the race check the forward order already gives a wrong sum
    assert not np.array_equal(_reduce(src, x, False), want)


def test_barrier_holds_every_thread():
    # each thread reads its neighbour's value after the barrier: right only if no thread passes early
    src = """
    threadgroup float buf[100];
    uint t = thread_position_in_threadgroup.x, n = threads_per_threadgroup.x;
    buf[t] = x[thread_position_in_grid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float v = buf[(t + 1) % n];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    buf[t] = v * 2.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = buf[(t + n - 1) % n];
    """
    x = np.arange(250, dtype=np.float32)                    # groups of 100, 100, 50 (a partial group)
    k = emu.EmuKernel("neighbour", ["x"], ["out"], src, race_check=True)
    (out,) = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(250, 1, 1),
               threadgroup=(100, 1, 1))
    np.testing.assert_array_equal(out, 2 * x)


def test_barrier_divergence_is_an_error():
    src = """
    threadgroup float buf[8];
    uint t = thread_position_in_threadgroup.x;
    if (t == 3) return;
    buf[t] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[t] = buf[0];
    """
    k = emu.EmuKernel("diverge", ["x"], ["out"], src)
    with pytest.raises(emu.EmuError, match="diverge.*barrier divergence"):
        k(inputs=[np.zeros(8, np.float32)], output_shapes=[(8,)], output_dtypes=[np.float32],
          grid=(8, 1, 1), threadgroup=(8, 1, 1))


def test_compile_error_names_the_kernel():
    k = emu.EmuKernel("broken_kernel", ["x"], ["out"], "out[0] = x[0] + undefined_name;", runtime.header())
    with pytest.raises(emu.EmuCompileError) as e:
        k(inputs=[np.zeros(3, np.float32)], output_shapes=[(3,)], output_dtypes=[np.float32],
          grid=(1, 1, 1), threadgroup=(1, 1, 1))
    msg = str(e.value)
    assert "broken_kernel" in msg and "undefined_name" in msg and "error" in msg


def test_signature_is_mlx_s():
    x = np.zeros(10, np.float32)
    tiny = np.zeros(3, np.int64)
    name = emu.kernel_name("k", [x, tiny], [np.dtype(np.uint16)], [("T", np.float32), ("N", 3), ("B", True)])
    assert name == "custom_kernel_k__float_3_1_float_int64_tc_uint16_t"
    src = "out[thread_position_in_grid.x] = x_shape[0] + threads_per_threadgroup.x;"
    text = emu.write_signature(name, "", src, ["x", "prm"], [x, tiny], ["out"], [np.dtype(np.uint16)],
                               [("T", np.float32), ("N", 3)], emu.attributes(src), emu.shape_infos(src, ["x", "prm"]))
    assert text == (
        "template <typename T, int N>\n"
        "[[kernel]] void custom_kernel_k__float_3_1_float_int64_tc_uint16_t(\n"
        "  const device float* x [[buffer(0)]],\n"
        "  const constant int* x_shape [[buffer(1)]],\n"
        "  const constant int64_t* prm [[buffer(2)]],\n"
        "  device uint16_t* out [[buffer(3)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]],\n"
        "  uint3 threads_per_threadgroup [[threads_per_threadgroup]]) {\n"
        + src + "\n}\n")


def test_shape_strides_ndim_and_template_args_reach_the_kernel():
    src = """
    uint i = thread_position_in_grid.x;
    out[i] = T(a_shape[1] * 1000 + a_strides[0] * 10 + a_ndim + N);
    """
    k = emu.EmuKernel("shapes", ["a"], ["out"], src)
    (out,) = k(inputs=[np.zeros((4, 6), np.float32)], output_shapes=[(2,)], output_dtypes=[np.float32],
               grid=(2, 1, 1), threadgroup=(32, 1, 1), template=[("T", np.float32), ("N", 5)])
    np.testing.assert_array_equal(out, [6000 + 60 + 2 + 5] * 2)


def test_compiled_kernels_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = "uint i = thread_position_in_grid.x; y[i] = o1b_store(o1b_exp(o1b_load(x[i]))) ; // cache test"
    x = np.linspace(-5, 5, 7, dtype=np.float32)
    call = dict(inputs=[x], output_shapes=[x.shape], output_dtypes=[np.float32], grid=(7, 1, 1),
                threadgroup=(4, 1, 1))
    c0 = emu.stats["compiles"]
    (y1,) = emu.EmuKernel("cached", ["x"], ["y"], src, runtime.header())(**call)
    assert emu.stats["compiles"] == c0 + 1
    assert list(tmp_path.glob("mlx-open1b/emu/*.so"))
    (y2,) = emu.EmuKernel("cached", ["x"], ["y"], src, runtime.header())(**call)   # second construction
    assert emu.stats["compiles"] == c0 + 1
    emu.clear_memory_cache()                                                      # as a new process
    d0 = emu.stats["disk_hits"]
    (y3,) = emu.EmuKernel("cached", ["x"], ["y"], src, runtime.header())(**call)
    assert emu.stats["compiles"] == c0 + 1 and emu.stats["disk_hits"] == d0 + 1
    assert_bits_equal(y1, y2)
    assert_bits_equal(y1, y3)
    assert_bits_equal(y1, C.exp(x))
    # the runtime reuses one MetalKernel per (name, names, source)
    assert runtime.kernel("map", ["x"], ["y"]) is runtime.kernel("map", ["x"], ["y"])


def test_a_fresh_process_reuses_the_disk_cache():
    code = ("import numpy as np; from mlx_open1b.metal import ops, emu; "
            "ops.exp(np.ones(3, np.float32)); print(emu.stats['compiles'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    M.exp(np.ones(3, np.float32))                       # built (and cached) in this process already
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_real_binding_accepts_the_same_call(monkeypatch):
    """The mx.fast.metal_kernel path gets the same arguments the emulator gets: on a Mac the op
    runs and matches cpu_ref; elsewhere MLX accepts the kernel and the call and stops only at
    'No Metal back-end'."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install mlx[cpu])")
    monkeypatch.setattr(runtime, "real_metal", lambda: True)
    monkeypatch.setattr(runtime, "_kernels", {})
    x = sweep(2 ** 32 // 1000)
    try:
        got = M.exp(x)
    except RuntimeError as e:
        assert not mx.metal.is_available() and "No Metal back-end" in str(e)
    else:
        assert_bits_equal(got, C.exp(x), "exp on Metal")
    k = runtime.kernel("gemm", *M.KERNELS["gemm"])
    assert k.real and k.header == runtime.header()
