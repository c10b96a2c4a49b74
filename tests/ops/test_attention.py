"""Attention (CONTRACT.md "Attention"): the C reference against the numpy spec bit for bit,
against a float64 reference within argued per-element bounds, thread-count independence,
special values and argument checking."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_open1b import cpu_ref
from mlx_open1b.spec import attention as spec
from mlx_open1b.spec.arith import bf16_to_f32, f32_to_bf16

U = 2.0 ** -24          # unit roundoff of fp32
NAN = 0x7FC00000

# (B, T, H, G, D, W): T = 1, inside one block, across blocks, not a multiple of 64; global,
# tiny, mid and block-sized windows, and windows longer than T.
SHAPES = [
    (1, 1, 4, 1, 8, 0),
    (1, 7, 4, 2, 8, 0),
    (2, 7, 4, 4, 16, 1),
    (2, 70, 4, 1, 16, 5),
    (1, 70, 4, 2, 8, 64),
    (1, 130, 4, 4, 8, 100),
    (2, 130, 4, 2, 16, 0),
    (1, 130, 4, 1, 16, 64),
]


def bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def assert_bits_equal(a, b, what=""):
    a, b = bits(a), bits(b)
    assert a.shape == b.shape, what
    diff = np.flatnonzero(a != b)
    assert diff.size == 0, f"{what}: {diff.size} elements differ, first at flat index {diff[:5]}"


def make_inputs(seed, B, T, H, G, D, sigma=1.0):
    """bf16 q, k, v with std sigma; fp32 dout. A slow ramp in the key values makes later key
    blocks hold larger scores, so the online-softmax rescaling (corr < 1) really happens."""
    rng = np.random.default_rng(seed)
    q = f32_to_bf16((sigma * rng.standard_normal((B, T, H, D))).astype(np.float32))
    ramp = np.linspace(0.0, 1.0, T, dtype=np.float32)[None, :, None, None]
    k = f32_to_bf16((sigma * rng.standard_normal((B, T, G, D)) + ramp * sigma).astype(np.float32))
    v = f32_to_bf16(rng.standard_normal((B, T, G, D)).astype(np.float32))
    dout = rng.standard_normal((B, T, H, D)).astype(np.float32)
    return q, k, v, dout


def run_c(q, k, v, dout, W, scale):
    o, lse = cpu_ref.attention_forward(q, k, v, W, scale)
    return (o, lse) + cpu_ref.attention_backward(dout, q, k, v, o, lse, W, scale)


def run_spec(q, k, v, dout, W, scale):
    o, lse = spec.attention_forward(q, k, v, W, scale)
    return (o, lse) + spec.attention_backward(dout, q, k, v, o, lse, W, scale)


NAMES = ("o", "lse", "dq", "dk", "dv")


# ---------------------------------------------------------------- C == spec, bit for bit

@pytest.mark.parametrize("B,T,H,G,D,W", SHAPES)
@pytest.mark.parametrize("sigma", [1.0, 3.0])
def test_c_matches_spec(B, T, H, G, D, W, sigma):
    q, k, v, dout = make_inputs(B * 1000 + T * 10 + G + W, B, T, H, G, D, sigma)
    scale = 1.1 / np.sqrt(D)      # not a power of two, so scaling rounds (1/sqrt(16) would not)
    for name, c, s in zip(NAMES, run_c(q, k, v, dout, W, scale), run_spec(q, k, v, dout, W, scale)):
        assert_bits_equal(c, s, name)


def test_key_block_size_enters_the_arithmetic(monkeypatch):
    """The 64-key block is part of the definition: the spec with another block size gives other
    bits for T > 64, so the C == spec test really checks the block structure."""
    q, k, v, _ = make_inputs(5, 1, 130, 4, 2, 16, sigma=3.0)
    o, _ = cpu_ref.attention_forward(q, k, v, 0, 0.25)
    monkeypatch.setattr(spec, "BK", 32)
    o32, _ = spec.attention_forward(q, k, v, 0, 0.25)
    assert (bits(o) != bits(o32)).any()


def test_window_at_least_T_is_causal():
    q, k, v, dout = make_inputs(6, 1, 70, 4, 2, 8)
    ref = run_c(q, k, v, dout, 0, 0.3)
    for W in (70, 100):
        for name, a, b in zip(NAMES, ref, run_c(q, k, v, dout, W, 0.3)):
            assert_bits_equal(a, b, f"{name} W={W}")


def test_batch_rows_are_independent():
    q, k, v, dout = make_inputs(7, 2, 70, 4, 2, 8)
    both = run_c(q, k, v, dout, 5, 0.3)
    for b in range(2):
        one = run_c(*(x[b:b + 1].copy() for x in (q, k, v, dout)), 5, 0.3)
        for name, a, c in zip(NAMES, both, one):
            assert_bits_equal(a[b:b + 1], c, name)


# ---------------------------------------------------------------- bits and threads

def test_bits_independent_of_threads_and_repeatable():
    q, k, v, dout = make_inputs(8, 2, 130, 4, 2, 16, sigma=2.0)
    with cpu_ref.settings(threads=1):
        one = run_c(q, k, v, dout, 100, 0.3)
    for threads in (2, 3, 7):
        with cpu_ref.settings(threads=threads):
            for _ in range(2):
                for name, a, b in zip(NAMES, one, run_c(q, k, v, dout, 100, 0.3)):
                    assert_bits_equal(a, b, f"{name} threads={threads}")


# ---------------------------------------------------------------- accuracy against float64

def ref64(q, k, v, dout, W, scale):
    """Exact-ish float64 attention on the same values; returns o, lse, dq, dk, dv and the
    intermediates the error bounds need."""
    B, T, H, D = q.shape
    G = k.shape[2]
    rep = H // G
    kh, vh = k[:, :, np.arange(H) // rep], v[:, :, np.arange(H) // rep]   # (B, T, H, D)
    vis = spec.visible(T, W)
    s = np.einsum("bihd,bjhd->bhij", q, kh) * scale
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    P = e / l                                                            # (B, H, T, T), 0 off-mask
    o = np.einsum("bhij,bjhd->bihd", P, vh)
    lse = (m + np.log(l))[..., 0]
    dP = np.einsum("bihd,bjhd->bhij", dout, vh)
    Di = np.einsum("bihd,bihd->bhi", dout, o)
    dS = P * (dP - Di[..., None])
    dq = scale * np.einsum("bhij,bjhd->bihd", dS, kh)
    dk = scale * np.einsum("bhij,bihd->bjhd", dS, q).reshape(B, T, G, rep, D).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", P, dout).reshape(B, T, G, rep, D).sum(3)
    return dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv, s=s, P=P, dP=dP, Di=Di, dS=dS, kh=kh, vh=vh,
                vis=vis, l=l[..., 0])


def test_float64_reference_gradient_matches_finite_differences():
    rng = np.random.default_rng(11)
    B, T, H, G, D, W, scale = 1, 7, 4, 2, 8, 5, 0.35
    q, k, v = (rng.standard_normal(sh) for sh in [(B, T, H, D), (B, T, G, D), (B, T, G, D)])
    dout = rng.standard_normal((B, T, H, D))
    r = ref64(q, k, v, dout, W, scale)
    h = 1e-6
    for name, x in (("dq", q), ("dk", k), ("dv", v)):
        num = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + h
            up = np.sum(dout * ref64(q, k, v, dout, W, scale)["o"])
            x[idx] = saved - h
            down = np.sum(dout * ref64(q, k, v, dout, W, scale)["o"])
            x[idx] = saved
            num[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(r[name], num, rtol=1e-6, atol=1e-8, err_msg=name)


def error_bounds(q, k, v, dout, W, scale, r, o_c, lse_c):
    """Per-element bounds on |C - float64| (u = 2^-24), from the contract's operation order.

    Forward, per query row (b, h, i), K visible keys in nb blocks:
      - a score is a D-term dot from +0 (bf16 x bf16 products are exact) and one multiply:
        |ds_j| <= scale (D+1) u sum_d |q_d k_jd| + u |s_j| =: Es_j.
      - each softmax term w_j = exp(s_j - m) * (the corr of every later block) carries, relative
        to the exact term, Es_j + u R (rounding of s_j - m, |s_j - m| <= R = score range)
        + eps_exp (2u: the contract exp is within 1.65 ulp) per exp, one such exp per later
        corr, and u per rescaling multiply: eps_term = max Es + (nb+1)(u R + eps_exp + u).
        The running max m cancels between numerator and denominator, so its own error does not
        appear.
      - the sums l and acc_d add each term at most min(K, 64) times within a block plus once per
        block: eps_sum = (min(K, 64) + nb) u, relative to the sum of |terms|.
      - o_d = N/L with both perturbed by eps = eps_term + eps_sum relative to sum_j P_j |v_jd|
        =: A_d and to L, and one divide and one multiply: |do_d| <= 2 eps A_d + 2u |o_d|.
      - lse = m + log(l) is logsumexp of the rounded scores: eps + the log's error (measured
        <= 4.4u absolute for l in [1, 200], taken as 8u max(1, log l)) + u |lse|.
    Backward (inputs o_c, lse_c from the C forward; their actual errors dO, dlse enter):
      - p_ij: relative eps_p = Es_ij + dlse_i + u |s_ij - lse_i| + eps_exp + u.
      - dp_ij, Di_i: (D+1)-term fp32 sums: (D+1) u sum|terms|, plus sum_d |dout_d| dO_d for Di.
      - ds = p (dp - Di): |dds| <= P ((eps_p + 2u) |dp - Di| + Edp + EDi).
      - dq_d = scale sum_j ds_j k_jd over K terms: scale (sum_j Eds_j |k_jd| + (K+1) u sum_j
        |ds_j k_jd|) + u |dq_d|; dk and dv likewise over rep * (visible queries) terms.
    Every bound is then doubled to absorb the second-order terms left out above, and 2^-100 is
    added for flushed subnormal products (absolute errors < 2^-126 each).
    """
    B, T, H, D = q.shape
    G = k.shape[2]
    rep = H // G
    vis, P, s, kh, vh = r["vis"], r["P"], r["s"], r["kh"], r["vh"]
    i = np.arange(T)
    first = np.maximum(0, i - W + 1) if W else np.zeros(T, int)
    K = (i - first + 1).astype(float)                                    # visible keys per query
    nb = (i // spec.BK - first // spec.BK + 1).astype(float)
    sfin = np.where(vis, s, 0.0)
    Es = np.where(vis, scale * (D + 1) * U * np.einsum("bihd,bjhd->bhij", np.abs(q), np.abs(kh))
                  + U * np.abs(sfin), 0.0)
    R = np.where(vis, s, -np.inf).max(-1) - np.where(vis, s, np.inf).min(-1)   # (B, H, T)
    eps_exp = 2 * U
    eps_term = Es.max(-1) + (nb + 1) * (U * R + eps_exp + U)
    eps = eps_term + (np.minimum(K, spec.BK) + nb) * U                  # (B, H, T)
    A = np.einsum("bhij,bjhd->bihd", P, np.abs(vh))
    eps_bihd = eps.transpose(0, 2, 1)[..., None]
    bound = {}
    bound["o"] = 2 * (2 * eps_bihd * A + 2 * U * np.abs(r["o"])) + 2.0 ** -100
    bound["lse"] = 2 * (eps + 8 * U * np.maximum(1.0, np.log(r["l"])) + U * np.abs(r["lse"]))

    dO = np.abs(o_c.astype(np.float64) - r["o"])
    dlse = np.abs(lse_c.astype(np.float64) - r["lse"])
    eps_p = np.where(vis, Es + dlse[..., None] + U * np.abs(sfin - r["lse"][..., None]) + eps_exp + U, 0.0)
    Edp = (D + 1) * U * np.einsum("bihd,bjhd->bhij", np.abs(dout), np.abs(vh))
    EDi = ((D + 1) * U * np.einsum("bihd,bihd->bhi", np.abs(dout), np.abs(r["o"]))
           + np.einsum("bihd,bihd->bhi", np.abs(dout), dO))
    X = np.abs(r["dP"] - r["Di"][..., None])
    Eds = P * ((eps_p + 2 * U) * X + Edp + EDi[..., None])
    absdS = np.abs(r["dS"])
    Kq = K[None, None, :, None]                                           # terms per query row
    Kk = rep * vis.sum(0).astype(float)[None, None, :, None]              # terms per key row
    bound["dq"] = 2 * (scale * (np.einsum("bhij,bjhd->bihd", Eds, np.abs(kh))
                                + (Kq.transpose(0, 2, 1, 3) + 1) * U
                                * np.einsum("bhij,bjhd->bihd", absdS, np.abs(kh)))
                       + U * np.abs(r["dq"])) + 2.0 ** -100

    def per_group(x):                                                     # (B,T,H,D) -> (B,T,G,D)
        return x.reshape(B, T, G, rep, D).sum(3)
    Kk_t = Kk.transpose(0, 2, 1, 3)
    bound["dk"] = 2 * (scale * (per_group(np.einsum("bhij,bihd->bjhd", Eds, np.abs(q)))
                                + (Kk_t + 1) * U * per_group(np.einsum("bhij,bihd->bjhd", absdS, np.abs(q))))
                       + U * np.abs(r["dk"])) + 2.0 ** -100
    bound["dv"] = 2 * (per_group(np.einsum("bhij,bihd->bjhd", eps_p * P, np.abs(dout)))
                       + (Kk_t + 1) * U * per_group(np.einsum("bhij,bihd->bjhd", P, np.abs(dout)))) \
        + 2.0 ** -100
    return bound


ACCURACY_CASES = [(1, 7, 4, 2, 8, 0, 1.0), (2, 70, 4, 1, 16, 5, 1.0), (1, 130, 4, 4, 8, 100, 3.0),
                  (2, 130, 4, 2, 16, 0, 1.0), (1, 130, 4, 2, 16, 64, 3.0)]


@pytest.mark.parametrize("B,T,H,G,D,W,sigma", ACCURACY_CASES)
def test_accuracy_against_float64(B, T, H, G, D, W, sigma):
    q, k, v, dout = make_inputs(T + 17 * G + W, B, T, H, G, D, sigma)
    scale = float(np.float32(1.0 / np.sqrt(D)))
    out = dict(zip(NAMES, run_c(q, k, v, dout, W, scale)))
    q64, k64, v64 = (bf16_to_f32(x).astype(np.float64) for x in (q, k, v))
    r = ref64(q64, k64, v64, dout.astype(np.float64), W, scale)
    bound = error_bounds(q64, k64, v64, dout.astype(np.float64), W, scale, r, out["o"], out["lse"])
    for name in NAMES:
        err = np.abs(out[name].astype(np.float64) - r[name])
        worst = np.unravel_index(np.argmax(err / bound[name]), err.shape)
        assert np.all(err <= bound[name]), (
            f"{name}: error {err[worst]:.3g} > bound {bound[name][worst]:.3g} at {worst}")


# ---------------------------------------------------------------- special values

def test_subnormal_inputs_behave_as_zero():
    B, T, H, G, D, W = 1, 70, 4, 2, 8, 0
    q, k, v, dout = make_inputs(21, B, T, H, G, D)
    rng = np.random.default_rng(22)
    sub_bf16 = np.array([0x0001, 0x8001, 0x007F, 0x807F, 0x0040], np.uint16)
    sub_f32 = np.array([0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF], np.uint32)
    zero_bf16 = lambda x: x & np.uint16(0x8000)                       # noqa: E731
    zero_f32 = lambda x: x & np.uint32(0x80000000)                    # noqa: E731
    qs, ks, vs, qz, kz, vz = q.copy(), k.copy(), v.copy(), q.copy(), k.copy(), v.copy()
    for xs, xz in ((qs, qz), (ks, kz), (vs, vz)):
        mask = rng.random(xs.shape) < 0.3
        pat = rng.choice(sub_bf16, xs.shape)
        xs[mask], xz[mask] = pat[mask], zero_bf16(pat[mask])
    o, lse = cpu_ref.attention_forward(qs, ks, vs, W, 0.3)
    oz, lsez = cpu_ref.attention_forward(qz, kz, vz, W, 0.3)
    assert_bits_equal(o, oz, "o")
    assert_bits_equal(lse, lsez, "lse")
    # fp32 subnormals in dout, o and lse of the backward
    douts, dz = dout.copy(), dout.copy()
    os_, oz2 = oz.copy(), oz.copy()
    mask = rng.random(dout.shape) < 0.3
    pat = rng.choice(sub_f32, dout.shape)
    douts.view(np.uint32)[mask], dz.view(np.uint32)[mask] = pat[mask], zero_f32(pat[mask])
    os_.view(np.uint32)[mask], oz2.view(np.uint32)[mask] = pat[mask], zero_f32(pat[mask])
    for name, a, b in zip(("dq", "dk", "dv"),
                          cpu_ref.attention_backward(douts, qs, ks, vs, os_, lsez, W, 0.3),
                          cpu_ref.attention_backward(dz, qz, kz, vz, oz2, lsez, W, 0.3)):
        assert_bits_equal(a, b, name)
    for name, a, b in zip(("dq", "dk", "dv"),
                          spec.attention_backward(douts, qs, ks, vs, os_, lsez, W, 0.3),
                          spec.attention_backward(dz, qz, kz, vz, oz2, lsez, W, 0.3)):
        assert_bits_equal(a, b, "spec " + name)


def affected(T, W, j0, g0, b0, B, H, G):
    """The query rows (B, T, H) that see key j0 of kv head g0 in batch b0, and the key rows
    (B, T, G) that any of those queries see."""
    vis = spec.visible(T, W)
    rep = H // G
    qa = np.zeros((B, T, H), bool)
    qa[b0, :, g0 * rep:(g0 + 1) * rep] = vis[:, j0, None]
    ka = np.zeros((B, T, G), bool)
    ka[b0, :, g0] = (vis & vis[:, j0, None]).any(0)
    return qa, ka


@pytest.mark.parametrize("kind", ["nan", "+inf"])
@pytest.mark.parametrize("T,W,j0", [(7, 0, 3), (130, 0, 64), (130, 5, 100), (70, 64, 0)])
def test_nonfinite_key_row(kind, T, W, j0):
    """A NaN in one key row, or +inf where q > 0 (s = +inf, then exp(inf - inf) = NaN), makes
    exactly the outputs that depend on it canonical NaN: o and lse of the queries that see the
    key; in the backward their dq, and dk, dv of every key those queries see. Everything else
    keeps the bits of the clean run."""
    B, H, G, D = 2, 4, 2, 8
    b0, g0 = 1, 1
    q, k, v, dout = make_inputs(31 + T + W, B, T, H, G, D)
    q[..., 0] = f32_to_bf16(np.abs(bf16_to_f32(q[..., 0])) + 1)       # q_0 >= 1: s = +inf
    bad = k.copy()
    bad[b0, j0, g0, 0] = 0x7FC0 if kind == "nan" else 0x7F80
    clean = run_c(q, k, v, dout, W, 0.3)
    o, lse = cpu_ref.attention_forward(q, bad, v, W, 0.3)
    got = (o, lse) + cpu_ref.attention_backward(dout, q, bad, v, o, lse, W, 0.3)
    ref = run_spec(q, bad, v, dout, W, 0.3)
    qa, ka = affected(T, W, j0, g0, b0, B, H, G)
    expect_nan = {"o": qa[..., None], "lse": qa.transpose(0, 2, 1), "dq": qa[..., None],
                  "dk": ka[..., None], "dv": ka[..., None]}
    for name, c, s, cl in zip(NAMES, got, ref, clean):
        assert_bits_equal(c, s, name)
        nan = np.broadcast_to(expect_nan[name], c.shape)
        assert np.all(bits(c)[nan] == NAN), name
        assert_bits_equal(c[~nan], cl[~nan], name + " (outside the affected set)")
        assert nan.any() and not nan.all()


def test_minus_inf_key_row():
    """s = -inf for one key gives that key p = 0 (the query stays finite) unless it is the only
    key the query sees in its first block: then m = -inf and corr = exp(-inf - -inf) = NaN. With
    W = 1 every query sees only itself, so exactly the rows of query j0 are NaN."""
    B, T, H, G, D, j0, g0 = 1, 70, 4, 2, 8, 66, 0
    q, k, v, dout = make_inputs(41, B, T, H, G, D)
    q[..., 0] = f32_to_bf16(np.abs(bf16_to_f32(q[..., 0])) + 1)       # q_0 >= 1: s = -inf
    k[0, j0, g0, 0] = 0xFF80                                            # -inf
    for W in (0, 1, 5):
        c, s = run_c(q, k, v, dout, W, 0.3), run_spec(q, k, v, dout, W, 0.3)
        for name, a, b in zip(NAMES, c, s):
            assert_bits_equal(a, b, f"{name} W={W}")
        o = c[0]
        if W == 1:
            nan = np.zeros(o.shape, bool)
            nan[0, j0, :H // G] = True
            assert np.all(bits(o)[nan] == NAN) and np.all(np.isfinite(o[~nan]))
        else:
            assert np.all(np.isfinite(o)) and np.all(np.isfinite(c[1]))


def test_signed_zero_inputs_give_finite_results():
    B, T, H, G, D, W = 1, 70, 4, 2, 8, 0
    rng = np.random.default_rng(51)
    q, k, v = ((rng.random(sh) < 0.5).astype(np.uint16) << 15
               for sh in [(B, T, H, D), (B, T, G, D), (B, T, G, D)])
    dout = rng.standard_normal((B, T, H, D)).astype(np.float32)
    c, s = run_c(q, k, v, dout, W, 0.3), run_spec(q, k, v, dout, W, 0.3)
    for name, a, b in zip(NAMES, c, s):
        assert_bits_equal(a, b, name)
        assert np.all(np.isfinite(a)), name
    o, lse = c[0], c[1]
    assert np.all(o == 0)
    # every score is 0, so every p is 1 and l counts the visible keys
    np.testing.assert_allclose(lse[0, 0], np.log(np.arange(1, T + 1)), rtol=4e-7, atol=4e-7)


# ---------------------------------------------------------------- argument checking

def _args():
    q, k, v, dout = make_inputs(61, 1, 7, 4, 2, 8)
    o, lse = cpu_ref.attention_forward(q, k, v, 0, 0.3)
    return dict(dout=dout, q=q, k=k, v=v, o=o, lse=lse, window=0, scale=0.3)


def _call(which, a):
    if which == "forward":
        return cpu_ref.attention_forward(a["q"], a["k"], a["v"], a["window"], a["scale"])
    return cpu_ref.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["o"], a["lse"],
                                      a["window"], a["scale"])


BAD = [
    ("q", lambda a: a["q"].astype(np.float32)),                       # wrong dtype
    ("k", lambda a: a["k"].astype(np.int16)),
    ("v", lambda a: a["v"][:, :6].copy()),                            # wrong T
    ("k", lambda a: a["k"][..., :4].copy()),                          # wrong D
    ("v", lambda a: np.concatenate([a["v"], a["v"]], axis=2)),        # G differs from k
    ("q", lambda a: np.concatenate([a["q"], a["q"]], axis=3)[..., ::2]),   # not contiguous
    ("q", lambda a: a["q"][0]),                                       # 3 dimensions
    ("k", lambda a: np.zeros((1, 7, 3, 8), np.uint16)),               # H % G != 0
    ("window", lambda a: -1),
    ("window", lambda a: 1.5),
    ("scale", lambda a: float("nan")),
    ("scale", lambda a: "0.3"),
]
BAD_BACKWARD = [
    ("dout", lambda a: a["dout"].astype(np.float64)),
    ("dout", lambda a: a["dout"][:, :, :2].copy()),
    ("o", lambda a: np.asfortranarray(a["o"])),
    ("lse", lambda a: a["lse"].transpose(0, 2, 1).copy()),
    ("lse", lambda a: a["lse"].view(np.uint32)),
]


@pytest.mark.parametrize("which", ["forward", "backward"])
@pytest.mark.parametrize("name,make", BAD)
def test_bad_arguments(which, name, make):
    a = _args()
    a[name] = make(a)
    with pytest.raises(ValueError, match=f"^{name}:"):
        _call(which, a)


@pytest.mark.parametrize("name,make", BAD_BACKWARD)
def test_bad_backward_arguments(name, make):
    a = _args()
    a[name] = make(a)
    with pytest.raises(ValueError, match=f"^{name}:"):
        _call("backward", a)
