"""AdamW, the canonical sum of squares, the tree fold, global norm and clipping."""
import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref.mathfn import scalar_add
from mlx_open1b.hostmath import adamw_scalars, pow_int
from mlx_open1b.spec import arith as A, optim as S

from helpers import SPECIAL_F32, assert_bits_equal, rand_bf16, rand_f32, sprinkle

U = 2.0 ** -24


def _state(rng, n):
    return (rand_bf16(rng, n, 0.02), rand_f32(rng, n, 1e-3), rand_f32(rng, n, 1e-3),
            np.abs(rand_f32(rng, n, 1e-6)))


@pytest.mark.parametrize("n", [1, 1000, 70001])
def test_adamw_bits(n):
    rng = np.random.default_rng(n)
    p, g, m, v = _state(rng, n)
    if n > 1:
        g = sprinkle(rng, g, SPECIAL_F32, 0.01)
    hp = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    s = adamw_scalars(hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], 7)
    ps, ms, vs = S.adamw_step(p, g, m, v, s)
    outs = []
    for threads in (1, 2):
        pp, mm, vv = p.copy(), m.copy(), v.copy()
        with C.settings(threads=threads):
            C.adamw_step(pp, g, mm, vv, step=7, **hp)
        outs.append((pp, mm, vv))
    for (pp, mm, vv) in outs:
        assert_bits_equal(pp, ps, "p")
        assert_bits_equal(mm, ms, "m")
        assert_bits_equal(vv, vs, "v")


def test_adamw_accuracy():
    rng = np.random.default_rng(3)
    n = 20000
    p, g, m, v = _state(rng, n)
    lr, b1, b2, eps, wd, t = 1e-3, 0.9, 0.95, 1e-8, 0.1, 3
    pp, mm, vv = p.copy(), m.copy(), v.copy()
    C.adamw_step(pp, g, mm, vv, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=t)
    g64, m64, v64 = g.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    m64 = b1 * m64 + (1 - b1) * g64
    v64 = b2 * v64 + (1 - b2) * g64 * g64
    upd = (m64 / (1 - b1 ** t)) / (np.sqrt(v64 / (1 - b2 ** t)) + eps)
    p64 = A.bf16_to_f32(p).astype(np.float64) * (1 - lr * wd) - lr * upd
    # moments: two products and a sum (scalars rounded once each): <= 4u relative to the terms
    assert (np.abs(mm - m64) <= 4 * U * (b1 * np.abs(m) + (1 - b1) * np.abs(g))).all()
    assert (np.abs(vv - v64) <= 5 * U * (b2 * np.abs(v) + (1 - b2) * g64 ** 2)).all()
    # the param is rounded to bf16 once: within half a bf16 ulp (2^-8 relative) of a value that
    # carries ~10u of fp32 error, so at most one bf16 ulp from the float64 result
    got = A.bf16_to_f32(pp).astype(np.float64)
    ulp_bf16 = 2.0 ** (np.floor(np.log2(np.abs(p64))) - 7)
    assert (np.abs(got - p64) <= ulp_bf16).all()


def test_adamw_bad_input():
    p, g = np.zeros(4, np.uint16), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="m: dimension 0 is 3, expected 4"):
        C.adamw_step(p, g, np.zeros(3, np.float32), g.copy(), lr=1e-3, step=1)
    with pytest.raises(ValueError, match="adamw step must be >= 1"):
        C.adamw_step(p, g, g.copy(), g.copy(), lr=1e-3, step=0)
    with pytest.raises(ValueError, match="lr: expected a finite value"):
        C.adamw_step(p, g, g.copy(), g.copy(), lr=float("inf"), step=1)
    ro = g.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="m: array is read-only"):
        C.adamw_step(p, g, ro, g.copy(), lr=1e-3, step=1)


def test_pow_int_is_plain_binary_exponentiation():
    assert pow_int(0.9, 0) == 1.0
    assert pow_int(0.9, 1) == 0.9
    # §8's order: the squares b, b^2, b^4 from the lowest bit of the exponent up, multiplied into
    # the result in that order (for these bases other orders round differently)
    b, c = 0.95, 0.999
    assert pow_int(b, 5) == b * ((b * b) * (b * b)) != b * b * b * b * b
    assert pow_int(b, 5) != (b * (b * b)) * (b * b)
    assert pow_int(c, 6) == (c * c) * ((c * c) * (c * c)) != c * c * c * c * c * c
    x, r = 0.95, 1.0
    sq = x
    for bit in bin(1000)[2:][::-1]:
        if bit == "1":
            r *= sq
        sq *= sq
    assert pow_int(0.95, 1000) == r


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 13, 64, 100])
def test_treefold_matches_algorithm_2(n):
    rng = np.random.default_rng(n)
    vals = rand_f32(rng, n) * np.float32(2.0) ** rng.integers(-20, 20, n).astype(np.float32)
    want = S.treefold(list(vals), add_fn=lambda a, b: np.float32(scalar_add(float(a), float(b))))
    assert np.float32(C.treefold(vals)).view(np.uint32) == np.float32(want).view(np.uint32)
    assert np.float32(S.treefold(list(vals))).view(np.uint32) == np.float32(want).view(np.uint32)


def test_treefold_pairing_order_explicitly():
    # For 5 values the contract's tree is (((v0+v1)+(v2+v3)) + v4); for 6: (((v0+v1)+(v2+v3)) + (v4+v5)).
    f = lambda a, b: np.float32(scalar_add(float(a), float(b)))
    for n in (5, 6, 7):
        v = np.array([1.0, 2.0 ** 24, 1.0, -(2.0 ** 24), 3.0, 2.0 ** -10, 7.0][:n], np.float32)
        t = f(f(v[0], v[1]), f(v[2], v[3]))
        if n == 5:
            want = f(t, v[4])
        elif n == 6:
            want = f(t, f(v[4], v[5]))
        else:
            want = f(f(t, f(v[4], v[5])), v[6])
        assert np.float32(C.treefold(v)) == want


def test_sumsq_and_global_norm():
    rng = np.random.default_rng(4)
    ts = [rand_f32(rng, s) for s in [(10,), (4097,), (3, 5000), (1,)]]
    ts[1] = sprinkle(rng, ts[1], np.array([1e-40, -0.0, 1e20], np.float32), 0.01)
    for t in ts:
        assert_bits_equal(C.sumsq_blocks(t), S.sumsq_blocks(t, C.optim.NORM_BLOCK), "blocks")
    with C.settings(threads=1):
        a = C.global_norm(ts)
    with C.settings(threads=2):
        b = C.global_norm(ts)
    assert a == b
    parts = np.concatenate([S.sumsq_blocks(t, C.optim.NORM_BLOCK) for t in ts])
    assert np.float32(a) == A.sqrt(S.treefold(list(parts)))
    clean = [rand_f32(rng, s) for s in [(10,), (4097,), (3, 5000)]]
    ref = np.sqrt(sum((t.astype(np.float64) ** 2).sum() for t in clean))
    # a block sum of 4096 positive terms errs by <= 4096 u (relative), the fold by log2(#blocks) u;
    # sqrt halves the relative error and adds half an ulp
    assert abs(C.global_norm(clean) - ref) <= (4096 / 2 + 8) * U * ref


def test_clip_coef():
    c = C.clip_coef(2.0, 1.0)
    assert np.float32(c) == A.div(np.float32(1.0), A.add(np.float32(2.0), np.float32(1e-6)))
    assert C.clip_coef(0.5, 1.0) > 1.0
    assert np.isnan(C.clip_coef(float("nan"), 1.0))
    g = rand_f32(np.random.default_rng(0), 1000)
    h = g.copy()
    C.scale_inplace(h, c)
    assert_bits_equal(h, A.mul(g, np.float32(c)), "clip scaling")


def test_fold_of_gradients_with_add_inplace():
    rng = np.random.default_rng(9)
    grads = [rand_f32(rng, 50) for _ in range(6)]

    def add(a, b):
        a = a.copy()
        C.add_inplace(a, b)
        return a
    got = S.treefold(grads, add_fn=add)
    want = S.treefold(grads)       # the spec's elementwise add
    assert_bits_equal(got, want, "gradient fold")
    C.scale_inplace(got, 1 / 6)
    assert_bits_equal(got, A.mul(want, np.float32(1 / 6)), "average by reciprocal")
