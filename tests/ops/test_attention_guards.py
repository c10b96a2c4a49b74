"""The exponent guards of the C reference's SIMD attention rows (cpu_ref/src/vmath.c): a block whose
products cannot round to exactly 2^-126 (no pair of exponents sums to 127) runs its inner loops with
bare products; any other block runs them marked, and a row with such a product goes the contract.h way.
Each case below builds one product whose exact value lies just below 2^-126 (IEEE rounds it up to
2^-126, the contract flushes it), in each guarded loop: the forward's p v, both passes' dout v (dp),
dk's ds q, dv's p dout and dq's ds k. Every SIMD level and thread count must give the scalar loops'
bits, which equal the numpy spec's. The cases have one kv head: with one thread the backward runs
its two passes as one (attention.c fused_range), with two threads apart, so check_all sees both."""
import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref import attention as CA
from mlx_open1b.cpu_ref.mathfn import vector_math
from mlx_open1b.spec import arith as A, attention as SA, mathfn as S

from helpers import assert_attention_is_spec, assert_bits_equal

LEVELS = list(range(C.simd_level() + 1))
MIN = np.float32(2.0 ** -126)
BF = A.f32_to_bf16


LO, HI = 2.0 ** -126 - 2.0 ** -151, 2.0 ** -126


def rounds_up(x, y) -> bool:
    """The exact x y lies in [2^-126 - 2^-151, 2^-126): rounded to 24 bits it is 2^-126, which
    x86 keeps even with FTZ set (tininess after rounding); the contract flushes it to 0."""
    return LO <= float(x) * float(y) < HI


def partner(x, bf16: bool):
    """A normal y (a bf16 value with bf16) whose product with x rounds up (rounds_up), or None."""
    y0 = np.float32(2.0 ** -126 / float(x))
    if bf16:
        y0 = A.bf16_to_f32(BF(np.array([y0], np.float32)))[0]
        cands = (np.uint16(y0.view(np.uint32) >> 16) + np.arange(-3, 4)).astype(np.uint16)
        cands = A.bf16_to_f32(cands)
    else:
        cands = (y0.view(np.uint32) + np.arange(-3, 4)).astype(np.uint32).view(np.float32)
    for y in cands:
        if rounds_up(x, y):
            return np.float32(y)
    return None


#: Where a case's columns go in an embedding (None: the case as built): D2 = 48 columns, a whole
#: number of vectors at every level, and T + 16 rows, so that the case's rows lie in a whole block
#: of rows (vmath.c widen_rows transposes W x W blocks and takes the rows' exponent ranges from the
#: columns there); c -> c + 16 moves every column past the first AVX-512 vector (two at AVX2),
#: c -> 2c + 1 spreads them over the vectors.
LAYOUTS = {None: None, "shift16": lambda c: c + 16, "spread": lambda c: 2 * c + 1}


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return request.param


def embed(x, cols, T2, D2):
    """(B, T, n, D) -> (B, T2, n, D2): column c at cols[c], zeros elsewhere (a zero adds nothing to a
    sum that starts from +0, and zero rows after the case's see keys its queries never see)."""
    out = np.zeros(x.shape[:1] + (T2,) + x.shape[2:3] + (D2,), x.dtype)
    out[:, :x.shape[1], :, cols] = x
    return out


def check_all(q, k, v, dout, W, scale, layout=None):
    """Scalar C equals the spec; every SIMD level and thread count equals scalar C. With a layout,
    on the case embedded (LAYOUTS), returning the case's part of the outputs."""
    if LAYOUTS[layout] is not None:
        T, D = q.shape[1], q.shape[3]
        cols = np.array([LAYOUTS[layout](c) for c in range(D)])
        o, lse, grads = check_all(*(embed(x, cols, T + 16, 48) for x in (q, k, v, dout)), W, scale)
        return o[:, :T][..., cols], lse[:, :, :T], tuple(g[:, :T][..., cols] for g in grads)
    with vector_math(False):
        o, lse = CA.attention_forward(q, k, v, W, scale)
        grads = CA.attention_backward(dout, q, k, v, o, lse, W, scale)
    assert_attention_is_spec(q, k, v, dout, o, lse, grads, W, scale)
    for lv in LEVELS:
        for threads in (1, 2):
            with C.settings(simd=lv, threads=threads), vector_math(True):
                got = CA.attention_forward(q, k, v, W, scale)
                got_g = CA.attention_backward(dout, q, k, v, o, lse, W, scale)
            for a, b, what in zip(got + got_g, (o, lse) + tuple(grads), ("o", "lse", "dq", "dk", "dv")):
                assert_bits_equal(a, b, f"{what}, level {lv}, {threads} threads")
    return o, lse, grads


def test_forward_block_product(layout):
    # Query 1 sees keys 0 and 1 with scores 0 and `scale` (q1 . k0 = 0, q1 . k1 = 1), so
    # p0 = exp(-scale), p1 = 1; scale is chosen so that a bf16 v0[0] makes p0 v0[0] round up.
    # v1[0] = 2^-120 keeps the difference visible in o (2^-126 + 2^-120 vs 2^-120).
    scales = np.arange(np.float32(0.3).view(np.uint32), np.float32(0.3).view(np.uint32) + (1 << 20),
                       dtype=np.uint32).view(np.float32)
    p0 = S.exp(A.sub(np.float32(0.0), scales)).astype(np.float64)
    top = (np.float32(2.0 ** -126 / p0).view(np.uint32) >> 16).astype(np.int64)
    for off in range(-2, 3):                          # the bf16 values next to 2^-126 / p0
        cand = ((top + off) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
        hit = np.flatnonzero((cand * p0 >= LO) & (cand * p0 < HI))
        if hit.size:
            break
    assert hit.size
    scale, v0 = scales[hit[0]], np.float32(cand[hit[0]])
    assert rounds_up(S.exp(A.sub(np.float32(0.0), scale)), v0)
    B, T, H, G, D = 1, 2, 1, 1, 20
    q, k, v = (np.zeros((B, T, n, D), np.float32) for n in (H, G, G))
    q[0, 1, 0, 1] = 1.0
    k[0, 1, 0, 1] = 1.0
    v[0, 0, 0, 0], v[0, 1, 0, 0] = v0, 2.0 ** -120
    v[0, 1, 0, 2:] = 0.5                              # v0's row: v0[0] alone (its exponent range a point)
    dout = np.zeros((B, T, H, D), np.float32)
    o, _, _ = check_all(BF(q), BF(k), BF(v), dout, 0, float(scale), layout)
    assert o[0, 1, 0, 0] != 0                        # the flushed product, then 2^-120 on it


def two_keys(x, r=None):
    """B = 1, T = 2, H = 2, G = 1, D = 6, scale 1. Query 1 of each head sees keys 0 and 1 with equal
    scores (dim 1); dout_1 = x at d = 2 of head 0 and 64 x of head 1, with v0[2] = 1, v1[2] = 0, so
    dp = (x, 0) and ds = (t, -t), t = mul(p, x/2) (about 64 t for head 1); query 0 adds nothing
    (ds = 0). Dims 0 and 3 carry the bf16 QV without changing a score (k[., 0] = 0, q[., 3] = 0):
    q1[0] = QV in both heads for dk's ds q, k0[3] = QV and k1[3] = 64 QV for dq's ds k, so dk0[0],
    dk1[0] and dq1[3] (head 0) each hold one product t QV next to normal ones near 2^-120. k0[4] = 1
    (q[., 4] = 0) puts ds_10 alone in dq1[4]. With r, dout_1[5] of head 0 is r and v0[5] = VR:
    one more product of dp."""
    B, T, H, G, D = 1, 2, 2, 1, 6
    q, k, v = (np.zeros((B, T, n, D), np.float32) for n in (H, G, G))
    q[0, :, :, 1] = 1.0
    k[0, :, 0, 1] = 1.0
    v[0, 0, 0, 2] = 1.0
    v[0, 0, 0, 5] = VR
    q[0, 1, :, 0] = QV
    k[0, 0, 0, 3] = QV
    k[0, 1, 0, 3] = 64 * QV
    k[0, 0, 0, 4] = 1.0
    dout = np.zeros((B, T, H, D), np.float32)
    dout[0, 1, 0, 2] = x
    dout[0, 1, 1, 2] = 64 * x
    if r is not None:
        dout[0, 1, 0, 5] = r
    return BF(q), BF(k), BF(v), dout


QV = np.float32(1.0078125 * 2.0 ** -60)     # bf16 values with a partner (rounds_up)
VR = np.float32(0.50390625)


def test_ds_q_and_ds_k_products(layout):
    # x is chosen so that t QV rounds up (the contract flushes it; bare, it would stay 2^-126).
    q, k, v, _ = two_keys(np.float32(1.0))
    _, lse = SA.attention_forward(q, k, v, 0, 1.0)
    p = S.exp(A.sub(np.float32(1.0), lse[0, 0, 1]))       # p of (1, j), j = 0, 1, head 0
    t = partner(QV, bf16=False)
    assert t is not None
    x0 = np.float32(2 * float(t) / float(p))
    xs = (x0.view(np.uint32) + np.arange(-16, 17)).astype(np.uint32).view(np.float32)
    x = next((x for x in xs if A.mul(p, A.mul(np.float32(0.5), x)) == t), None)
    assert x is not None
    _, _, (dq, dk, dv) = check_all(*two_keys(x), 0, 1.0, layout)
    assert dk[0, 0, 0, 0] != 0 and dq[0, 1, 0, 3] != 0


def test_dout_v_products_of_both_passes(layout):
    # dp_10 = x + r VR (d ascending), x = 2^-110: the contract flushes r VR, a bare product
    # would add 2^-126 to x (visible: x's ulp is 2^-133), changing ds_10 in dk0[1] (pass 2's dp) and
    # dq1[4] (pass 1's). Di = x/2 either way (o1[5] = VR/2 and r VR/2 flushes).
    r = partner(VR, bf16=False)
    assert r is not None
    _, _, (dq, dk, dv) = check_all(*two_keys(np.float32(2.0 ** -110), r), 0, 1.0, layout)
    assert dk[0, 0, 0, 1] != 0 and dq[0, 1, 0, 4] != 0


def test_p_dout_products(layout):
    # Query 1 sees keys 0 and 1 with scores 0 and `scale`: pass 2's p_10 = exp(-lse_1); dout_1[0] is
    # its partner, so p_10 dout_1[0] rounds up; query 0 (p = 1) adds dout_0[0] = 2^-120 first, so
    # dv0[0] shows the product (2^-120 + 2^-126 if it stayed). dout_0[0] sits in the row's
    # exponent range's top; dout_1's row holds only the partner (a range of one exponent).
    B, T, H, G, D = 1, 2, 1, 1, 8
    q, k, v = (np.zeros((B, T, n, D), np.float32) for n in (H, G, G))
    q[0, 1, 0, 1] = 1.0
    k[0, 1, 0, 1] = 1.0
    v[0, :, 0, 2:] = 0.5
    q, k, v = BF(q), BF(k), BF(v)
    for bits in range(np.float32(0.3).view(np.uint32), np.float32(0.3).view(np.uint32) + 256):
        scale = np.uint32(bits).view(np.float32)
        _, lse = SA.attention_forward(q, k, v, 0, float(scale))
        p10 = S.exp(A.sub(np.float32(0.0), lse[0, 0, 1]))
        d = partner(p10, bf16=False)
        if d is not None:
            break
    assert d is not None
    dout = np.zeros((B, T, H, D), np.float32)
    dout[0, 0, 0, 0] = 2.0 ** -120
    dout[0, 1, 0, 0] = d
    _, _, (dq, dk, dv) = check_all(q, k, v, dout, 0, float(scale), layout)
    assert dv[0, 0, 0, 0] == np.float32(2.0 ** -120)                       # the product flushed


@pytest.mark.parametrize("B,T,H,G,D,W", [(1, 67, 8, 2, 32, 5), (2, 130, 4, 1, 17, 64), (1, 61, 6, 3, 8, 0),
                                           (1, 130, 4, 2, 32, 63), (1, 134, 2, 1, 40, 66)])
def test_rows_and_groups(B, T, H, G, D, W):
    # Query and key rows in groups of four (T not a multiple of 4), windows shorter and longer than
    # a block and around it (63-66: a group's keys or queries cross a block edge in their middle),
    # GQA ratios 4 and 2; ordinary values: every block on the guards' bare path.
    rng = np.random.default_rng(T)
    q = BF((rng.standard_normal((B, T, H, D)) * 2).astype(np.float32))
    k = BF((rng.standard_normal((B, T, G, D)) * 2).astype(np.float32))
    v = BF(rng.standard_normal((B, T, G, D)).astype(np.float32))
    dout = (rng.standard_normal((B, T, H, D)) * 1e-2).astype(np.float32)
    check_all(q, k, v, dout, W, float(np.float32(1 / np.sqrt(D))))


@pytest.mark.parametrize("d", [1, 17])
def test_di_products(d):
    # Di = sum_d dout_d o_d (o as given to the backward, so it can be chosen freely): in rows
    # (query 0, head 0) and (query 2, head 1), dout[d] o[d] rounds up (the contract flushes it) and
    # dout[d + 1] o[d + 1] = 2^-110 follows, so a bare product would leave 2^-110 + 2^-126 (ulp
    # 2^-133). v = 0 makes dp = 0, so ds = -p Di and dq[., 0] = ds k[0] shows Di. D = 20: d = 1 sits
    # in a whole vector of columns, d = 17 among the last D % W (gathered) at 16 lanes; T = 3 rows
    # fill part of a vector of rows (attention.c's Di runs, vmath.c's dot_rows).
    B, T, H, G, D, scale = 1, 3, 2, 1, 20, 1.0
    q = np.zeros((B, T, H, D), np.float32)
    k = np.zeros((B, T, G, D), np.float32)
    k[0, :, 0, 0] = 1.0
    q, k, v = BF(q), BF(k), BF(np.zeros((B, T, G, D), np.float32))
    with vector_math(False):
        _, lse = CA.attention_forward(q, k, v, 0, scale)
    o = np.full((B, T, H, D), VR, np.float32)
    dout = np.zeros((B, T, H, D), np.float32)
    r = partner(VR, bf16=False)
    assert r is not None
    for i, h in ((0, 0), (2, 1)):
        dout[0, i, h, d] = r
        dout[0, i, h, d + 1] = np.float32(2.0 ** -110) / VR
        assert A.mul(dout[0, i, h, d + 1], VR) == np.float32(2.0 ** -110)
    with vector_math(False):
        want = CA.attention_backward(dout, q, k, v, o, lse, 0, scale)
    for a, b, what in zip(want, SA.attention_backward(dout, q, k, v, o, lse, 0, scale), "qkv"):
        assert_bits_equal(a, b, f"d{what}: scalar C vs spec")
    assert want[0][0, 0, 0, 0] == np.float32(-(2.0 ** -110))        # p = 1: ds = -Di, the product flushed
    for lv in LEVELS:
        for threads in (1, 2):
            with C.settings(simd=lv, threads=threads), vector_math(True):
                got = CA.attention_backward(dout, q, k, v, o, lse, 0, scale)
            for a, b, what in zip(got, want, "qkv"):
                assert_bits_equal(a, b, f"d{what}, level {lv}, {threads} threads")


def test_ds_k_products_of_a_whole_group():
    # dq's ds k where a whole group of four key rows (keys 0-3) holds the query: vmath.c's q_sums
    # runs such lanes without a search per lane (q_sums_all), and must mark them as the others.
    # q = k = 0 but k1[3] = kv: every score 0, so query 4's p = exp(-lse_4) for keys 0-4. v = 0
    # makes dp = 0, so ds_4j = mul(p, -Di_4), and o (free for the backward) = 1 at d = 0 makes
    # Di_4 = y = dout_4[0]. kv (a bf16 near 2^-60) and y are searched so that ds_4j is kv's partner.
    # Then dq_4[3] = ds_41 kv alone, which the contract flushes to 0 (a bare product would leave
    # 2^-126). Query 4 is a lane that every row of the group holds; T = 5 leaves the last group one row.
    B, T, H, G, D, scale = 1, 5, 1, 1, 20, 1.0
    q, v = (BF(np.zeros((B, T, n, D), np.float32)) for n in (H, G))
    _, lse = SA.attention_forward(q, BF(np.zeros((B, T, G, D), np.float32)), v, 0, scale)
    p = S.exp(A.sub(np.float32(0.0), lse[0, 0, 4]))
    for mant in range(128):                         # bf16 values 2^-60 (1 + mant/128)
        kv = np.uint32((127 - 60) << 23 | mant << 16).view(np.float32)
        t = partner(kv, bf16=False)
        if t is None:
            continue
        y0 = np.float32(-float(t) / float(p))
        ys = (y0.view(np.uint32) + np.arange(-16, 17)).astype(np.uint32).view(np.float32)
        y = next((y for y in ys if A.mul(p, A.sub(np.float32(0.0), y)) == t), None)
        if y is not None:
            break
    assert y is not None
    k = np.zeros((B, T, G, D), np.float32)
    k[0, 1, 0, 3] = kv
    k = BF(k)
    o = np.zeros((B, T, H, D), np.float32)
    o[0, 4, 0, 0] = 1.0
    dout = np.zeros((B, T, H, D), np.float32)
    dout[0, 4, 0, 0] = y
    want = SA.attention_backward(dout, q, k, v, o, lse, 0, scale)
    assert want[0][0, 4, 0, 3] == 0                                 # the product flushed
    for lv in LEVELS:
        for threads in (1, 2):                  # one thread: the fused pass (q_sums)
            with C.settings(simd=lv, threads=threads), vector_math(True):
                got = CA.attention_backward(dout, q, k, v, o, lse, 0, scale)
            for a, b, what in zip(got, want, "qkv"):
                assert_bits_equal(a, b, f"d{what}, level {lv}, {threads} threads")
