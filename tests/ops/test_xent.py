"""Fused cross-entropy + z-loss: C reference vs the numpy spec (bits), vs float64 (argued
per-element bounds), determinism, special values and argument checking."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mlx_open1b import cpu_ref
from mlx_open1b.cpu_ref import xent as cx
from mlx_open1b.cpu_ref.mathfn import vector_math
from mlx_open1b.spec import arith as A
from mlx_open1b.spec import xent as S

U = 2.0 ** -24            # unit roundoff of fp32
TINY = 2.0 ** -126        # smallest normal: anything below is flushed to zero
# Accuracy of the contract's exp and log (CONTRACT.md §4), used in the bounds below. Measured on
# 2e7 points: exp within 1.71 U relative on [-87, 0], log within 1.37 U relative on [1, 2^23).
# The bounds use 4 U for both, a margin over the measurement rather than a proof.
E_EXP = 4 * U
E_LOG = 4 * U
ZCOEF = np.float32(1e-4)

NS, CS, VS = (1, 5, 33), (8, 24), (7, 1024, 1500, 3000)


def u32(a):
    return np.asarray(a, np.float32).view(np.uint32)


def assert_bits(got, want, what=""):
    got, want = u32(got), u32(want)
    assert got.shape == want.shape, what
    bad = np.flatnonzero(got.ravel() != want.ravel())
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} differ, first at flat index {bad[0]}: "
                           f"{got.ravel()[bad[0]]:#010x} != {want.ravel()[bad[0]]:#010x}")


def make(N, C, V, seed=0, hscale=1.0, wscale=0.5):
    """bf16 inputs: h ~ N(0, hscale^2), w ~ N(0, wscale^2); logits of order wscale sqrt(C)."""
    rng = np.random.default_rng(seed)
    h = A.f32_to_bf16((rng.standard_normal((N, C)) * hscale).astype(np.float32))
    w = A.f32_to_bf16((rng.standard_normal((V, C)) * wscale).astype(np.float32))
    t = rng.integers(0, V, N).astype(np.int32)
    return h, w, t


def mean_dloss(N):
    return np.full(N, np.float32(1.0 / N), np.float32)


def f64(x_bf16):
    return A.bf16_to_f32(x_bf16).astype(np.float64)


def gamma(k):
    """Relative error bound of k roundings in a row (Higham's gamma_k)."""
    return k * U / (1 - k * U)


# ---------------------------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------------------------
def ref_forward64(h, w, t, zcoef):
    """Exact-enough logits (bf16 products are exact in float64 and C <= 24 terms add error
    ~1e-15 relative), a max-shifted logsumexp, and the loss in float64."""
    z = f64(h) @ f64(w).T
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    ce = lse - z[np.arange(len(t)), t]
    return ce + float(zcoef) * lse ** 2, lse, ce, z


def ref_dz64(z, t, zcoef, lse, dloss):
    """The analytic gradient d(sum_n dloss_n loss_n)/dz, NOT rounded to bf16."""
    p = np.exp(z - lse[:, None])
    g = p * (1.0 + 2.0 * float(zcoef) * lse)[:, None]
    g[np.arange(len(t)), t] -= 1.0
    return g * np.asarray(dloss, np.float64)[:, None]


def loss64(hf, wf, t, zcoef, dloss):
    z = hf @ wf.T
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    return float(np.sum(dloss * (lse - z[np.arange(len(t)), t] + zcoef * lse ** 2)))


# ---------------------------------------------------------------------------------------------
# Bits: C == spec
# ---------------------------------------------------------------------------------------------
def test_chunk_constant():
    assert cpu_ref.XENT_CHUNK == S.XENT_CHUNK == 1024


@pytest.mark.parametrize("V", VS)
@pytest.mark.parametrize("C", CS)
@pytest.mark.parametrize("N", NS)
def test_matches_spec(N, C, V):
    h, w, t = make(N, C, V, seed=N * 10007 + C * 101 + V)
    if N >= 5:
        t[0], t[1] = 0, V - 1                    # first and last vocabulary entries (last chunk)
    for zc in (ZCOEF, np.float32(0.0), np.float32(0.37)):
        got = cpu_ref.xent_forward(h, w, t, zc)
        want = S.xent_forward(h, w, t, zc)
        for name, g, s in zip(("loss", "lse", "ce"), got, want):
            assert_bits(g, s, f"{name} zcoef={zc}")
    lse = got[1]
    rng = np.random.default_rng(V)
    dloss_rand = (rng.standard_normal(N) * 0.1).astype(np.float32)   # signs and sizes vary per row
    for zc, dloss in ((ZCOEF, mean_dloss(N)), (np.float32(0.37), dloss_rand)):
        dh, dw = cpu_ref.xent_backward(h, w, t, zc, lse, dloss)
        sdh, sdw = S.xent_backward(h, w, t, zc, lse, dloss)
        assert_bits(dh, sdh, "dh")
        assert_bits(dw, sdw, "dw")


def test_logits_are_linear_forward():
    """The op's logits are the linear layer's bits: the spec GEMM equals linear_forward, and
    the C op's outputs equal the spec's logsumexp applied to linear_forward's logits."""
    for N, C, V in ((5, 24, 1500), (33, 8, 3000)):
        h, w, t = make(N, C, V, seed=V + 1)
        z = cpu_ref.linear_forward(h, w)
        assert_bits(S.logits(h, w), z, "logits")
        got = cpu_ref.xent_forward(h, w, t, ZCOEF)
        want = S.xent_forward_from_logits(z, t, ZCOEF)
        for name, g, s in zip(("loss", "lse", "ce"), got, want):
            assert_bits(g, s, name)
        assert_bits(got[2], A.sub(got[1], z[np.arange(N), t]), "ce = lse - z[target]")


def test_chunk_size_enters_forward_only():
    """XENT_CHUNK is a contract constant because the online rescaling happens at chunk
    boundaries (lse bits change with it); the backward's sums do not see the chunks."""
    N, C, V = 33, 24, 3000
    h, w, t = make(N, C, V, seed=7)
    lses = {}
    for chunk in (7, 100, 1024, V):
        loss, lse, ce = cx._forward_chunked(h, w, t, ZCOEF, chunk)
        sl, slse, sce = S.xent_forward(h, w, t, ZCOEF, chunk=chunk)
        assert_bits(lse, slse, f"lse chunk={chunk}")
        assert_bits(loss, sl, f"loss chunk={chunk}")
        lses[chunk] = lse
    assert np.any(u32(lses[1024]) != u32(lses[V])), "expected the chunk size to show in lse bits"
    assert np.any(u32(lses[7]) != u32(lses[1024]))
    dloss = mean_dloss(N)
    dh0, dw0 = cpu_ref.xent_backward(h, w, t, ZCOEF, lses[1024], dloss)
    for chunk in (1, 7, 100, 1024, V):
        dh, dw = cx._backward_chunked(h, w, t, ZCOEF, lses[1024], dloss, chunk)
        assert_bits(dh, dh0, f"dh chunk={chunk}")
        assert_bits(dw, dw0, f"dw chunk={chunk}")


# ---------------------------------------------------------------------------------------------
# Accuracy vs float64, bounds argued per element
# ---------------------------------------------------------------------------------------------
ACC_CASES = [(5, 24, 1500, 0.5), (33, 8, 3000, 1.0), (33, 24, 1024, 0.25), (1, 24, 7, 2.0)]


def forward_bounds(h, w, t, zcoef, lse64, ce64, z64):
    """First-order error bounds of (loss, lse, ce) per row, and e_z (N, V), from the
    contract's operation order (a factor 1.01 covers the second-order terms).

    e_z: a logit is C exact bf16 products added in fp32 from +0 (the first add is exact), so
         |z - z64| <= gamma(C-1) sum_c |h w|.
    lse = m + log(s): lse as a function of the logits moves by at most max_v e_z (its gradient
         is the softmax, which sums to 1). The sum s of exp(z_v - m) carries, per term: the
         rounding of z_v - m (relative u|z_v - m| <= u R after exp) and exp's own error; L-1
         adds within the chunk and the add into s; then for each later chunk a rescale by corr
         (itself an exp of a rounded difference: E_EXP + u R), one mul and one add. All terms
         are positive, so these are relative bounds on s:
             eps_s = nch (E_EXP + u R) + (L + 2 nch) u.
         Then log: |log s_hat - log s| <= eps_s (1 + eps_s), plus log's own E_LOG |log s|,
         plus the final add's u|lse|.
    ce = lse - z[t]: |d lse| + e_z[t] + u|ce|.
    zl = zcoef lse^2 (two muls): zcoef (2|lse| d + d^2) + 2u zcoef lse^2.
    loss = ce + zl: the sum of both plus u|loss|.
    """
    N, V = z64.shape
    C = h.shape[1]
    ez = gamma(C - 1) * (np.abs(f64(h)) @ np.abs(f64(w)).T)
    nch = -(-V // S.XENT_CHUNK)
    L = min(V, S.XENT_CHUNK)
    R = (z64.max(axis=1) - z64.min(axis=1)) + 2 * ez.max(axis=1)
    eps_s = nch * (E_EXP + U * R) + (L + 2 * nch) * U
    log_s = lse64 - z64.max(axis=1)                       # log of the sum with the max at 1
    d_lse = 1.01 * (ez.max(axis=1) + eps_s * (1 + eps_s) + E_LOG * (log_s + eps_s)
                    + U * (np.abs(lse64) + ez.max(axis=1) + 2 * eps_s))
    d_ce = 1.01 * (d_lse + ez[np.arange(N), t] + U * (np.abs(ce64) + d_lse + ez[np.arange(N), t]))
    zc = float(zcoef)
    d_zl = 1.01 * (zc * (2 * np.abs(lse64) * d_lse + d_lse ** 2) + 2 * U * zc * (np.abs(lse64) + d_lse) ** 2)
    loss_mag = np.abs(ce64 + zc * lse64 ** 2) + d_ce + d_zl
    d_loss = 1.01 * (d_ce + d_zl + U * loss_mag)
    return d_loss, d_lse, d_ce, ez


@pytest.mark.parametrize("N,C,V,wscale", ACC_CASES)
def test_forward_accuracy(N, C, V, wscale):
    h, w, t = make(N, C, V, seed=3 * V + N, wscale=wscale)
    zc = np.float32(0.01)                          # large enough that z-loss shows in the loss
    loss, lse, ce = cpu_ref.xent_forward(h, w, t, zc)
    loss64, lse64, ce64, z64 = ref_forward64(h, w, t, zc)
    bounds = forward_bounds(h, w, t, zc, lse64, ce64, z64)[:3]
    for name, got, ref, bound in zip(("loss", "lse", "ce"), (loss, lse, ce), (loss64, lse64, ce64), bounds):
        err = np.abs(got.astype(np.float64) - ref)
        assert np.all(err <= bound), f"{name}: max err/bound {np.max(err / bound):.3g}"


def backward_bounds(h, w, t, zcoef, lse_c, dloss, z64, lse64, ez):
    """Per-element bounds of (dh, dw) against the float64 analytic gradient with dz unrounded.

    Per (n, v), with d = |lse_c - lse64| the input lse's actual error:
      pv = exp(z - lse): log-ratio to p64 <= e_z + d + u|z - lse| (the sub) + E_EXP,
          so relative eps_p = expm1(that).
      coef = 1 + (2 zcoef) lse: 2 zcoef is exact; abs error E_c = 2 zcoef (d + u|lse|) + u|coef|.
      g = pv coef (one mul), g - 1 at the target (u |g - 1|), dz = g dloss (u), each adding
          its rounding relative to the value; flushes to zero add at most 2^-126 per step.
      bf16: the GEMM operand is dz rounded to bf16: bf16 has 8 significant bits, so its unit
          roundoff is 2^-8 (half of the 2^-7 spacing just above a power of two; 2^-9 holds
          only at the top of a binade, and the test fails with it).
    dh = sum_v dzb w: propagated E_dzb @ |w| plus the fp32 sum of V exact bf16*bf16 products,
         gamma(V-1) sum |dzb w|, plus one flushed 2^-126 per add. dw likewise over n.
    """
    N, V = z64.shape
    hf, wf = f64(h), f64(w)
    zc = float(zcoef)
    dl = np.abs(np.asarray(dloss, np.float64))[:, None]
    d = np.abs(lse_c.astype(np.float64) - lse64)[:, None]
    x = np.abs(z64 - lse64[:, None]) + ez + d
    eps_p = np.expm1(ez + d + U * x + E_EXP)
    p64 = np.exp(z64 - lse64[:, None])
    coef64 = (1 + 2 * zc * lse64)[:, None]
    E_c = 2 * zc * (d + U * (np.abs(lse64)[:, None] + d)) + U * (np.abs(coef64) + 2 * zc * d)
    E_g = p64 * (np.abs(coef64) * (eps_p + U + eps_p * U) + E_c * (1 + eps_p) * (1 + U)) + TINY * (np.abs(coef64) + 1)
    g64 = p64 * coef64
    onehot = np.zeros_like(g64)
    onehot[np.arange(N), t] = 1.0
    E_g = E_g + onehot * U * (np.abs(g64 - 1) + E_g)
    E_dz = dl * (E_g + U * (np.abs(g64 - onehot) + E_g)) + TINY
    dz64 = ref_dz64(z64, t, zc, lse64, dloss)
    E_dzb = E_dz + 2.0 ** -8 * (np.abs(dz64) + E_dz)
    dzb_mag = np.abs(dz64) + E_dzb
    E_dh = E_dzb @ np.abs(wf) + gamma(V - 1) * (dzb_mag @ np.abs(wf)) + V * TINY
    E_dw = E_dzb.T @ np.abs(hf) + gamma(N - 1) * (dzb_mag.T @ np.abs(hf)) + N * TINY
    return 1.01 * E_dh, 1.01 * E_dw, dz64


@pytest.mark.parametrize("N,C,V,wscale", ACC_CASES)
def test_backward_accuracy(N, C, V, wscale):
    h, w, t = make(N, C, V, seed=5 * V + N, wscale=wscale)
    zc = np.float32(0.01)
    _, lse, _ = cpu_ref.xent_forward(h, w, t, zc)
    _, lse64, ce64, z64 = ref_forward64(h, w, t, zc)
    ez = forward_bounds(h, w, t, zc, lse64, ce64, z64)[3]
    dloss = mean_dloss(N)
    dh, dw = cpu_ref.xent_backward(h, w, t, zc, lse, dloss)
    E_dh, E_dw, dz64 = backward_bounds(h, w, t, zc, lse, dloss, z64, lse64, ez)
    dh64, dw64 = dz64 @ f64(w), dz64.T @ f64(h)
    for name, got, ref, bound in (("dh", dh, dh64, E_dh), ("dw", dw, dw64, E_dw)):
        err = np.abs(got.astype(np.float64) - ref)
        assert np.all(err <= bound), f"{name}: max err/bound {np.max(err / bound):.3g}"


def test_analytic_gradient_matches_finite_differences():
    """The float64 gradient used above is the gradient of sum_n dloss_n loss_n (checked once
    by central differences in float64, on unconstrained float64 inputs)."""
    rng = np.random.default_rng(11)
    N, C, V, zc = 3, 4, 6, 0.3
    hf, wf = rng.standard_normal((N, C)), rng.standard_normal((V, C))
    t = np.array([0, 5, 2])
    dloss = np.array([0.5, -1.25, 2.0])
    z = hf @ wf.T
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    dz = ref_dz64(z, t, zc, lse, dloss)
    dh, dw = dz @ wf, dz.T @ hf
    eps = 1e-6
    for x, grad in ((hf, dh), (wf, dw)):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = loss64(hf, wf, t, zc, dloss)
            x[idx] = old - eps
            down = loss64(hf, wf, t, zc, dloss)
            x[idx] = old
            fd[idx] = (up - down) / (2 * eps)
        # truncation O(eps^2 |f'''|) ~ 1e-11 and cancellation ~ 1e-16 |f| / eps ~ 1e-10
        np.testing.assert_allclose(fd, grad, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------
def test_threads_and_repeats_identical():
    N, C, V = 33, 24, 3000
    h, w, t = make(N, C, V, seed=21)
    dloss = mean_dloss(N)
    results = []
    for kw in (dict(threads=1), dict(threads=2), dict(threads=3), dict(threads=7),
               dict(threads=2, gemm_fast=False), dict(), dict()):
        with cpu_ref.settings(**kw):
            fwd = cpu_ref.xent_forward(h, w, t, ZCOEF)
            bwd = cpu_ref.xent_backward(h, w, t, ZCOEF, fwd[1], dloss)
        results.append((kw, fwd + bwd))
    _, first = results[0]
    for kw, r in results[1:]:
        for name, a, b in zip(("loss", "lse", "ce", "dh", "dw"), r, first):
            assert_bits(a, b, f"{name} with {kw}")


# ---------------------------------------------------------------------------------------------
# Special values
# ---------------------------------------------------------------------------------------------
def check_against_spec(h, w, t, zc=ZCOEF, dloss=None):
    N = h.shape[0]
    dloss = mean_dloss(N) if dloss is None else dloss
    fwd = cpu_ref.xent_forward(h, w, t, zc)
    sfwd = S.xent_forward(h, w, t, zc)
    bwd = cpu_ref.xent_backward(h, w, t, zc, fwd[1], dloss)
    sbwd = S.xent_backward(h, w, t, zc, fwd[1], dloss)
    out = {}
    for name, g, s in zip(("loss", "lse", "ce", "dh", "dw"), fwd + bwd, sfwd + sbwd):
        assert_bits(g, s, name)
        nan = np.isnan(g)
        assert np.all(u32(g)[nan] == A.NAN_BITS), f"{name}: non-canonical NaN"
        out[name] = g
    return out


def test_nan_in_h():
    N, C, V = 5, 8, 1500
    h, w, t = make(N, C, V, seed=31)
    h[2, 3] = 0xFFC1                                  # a negative NaN with a payload
    out = check_against_spec(h, w, t)
    for name in ("loss", "lse", "ce"):
        assert list(np.flatnonzero(np.isnan(out[name]))) == [2], name
    assert np.all(np.isnan(out["dh"][2])) and not np.any(np.isnan(out["dh"][[0, 1, 3, 4]]))
    assert np.all(np.isnan(out["dw"]))                # every dw[v, c] sums dz[2, v] h[2, c]


def test_inf_in_w():
    """w[v0, 0] = +inf: rows with h[n, 0] > 0 get z = +inf (lse = inf - inf -> NaN), rows with
    h[n, 0] = 0 get inf * 0 = NaN, rows with h[n, 0] < 0 get z = -inf, a zero term of the
    softmax, and stay finite."""
    N, C, V = 5, 8, 3000
    h, w, t = make(N, C, V, seed=41)
    t[:] = 3
    w[2500, 0] = 0x7F80
    h[:, 0] = A.f32_to_bf16(np.array([1.5, -2.0, 0.0, -0.5, 3.0], np.float32))
    out = check_against_spec(h, w, t)
    assert list(np.flatnonzero(np.isnan(out["lse"]))) == [0, 2, 4]
    assert np.all(np.isfinite(out["loss"][[1, 3]]))


def test_huge_logits_do_not_overflow():
    """Logits near 80 and near 3000: exp(z) would overflow fp32 (above 88.7), exp(z - m) never."""
    N, C, V = 5, 8, 1500
    rng = np.random.default_rng(51)
    for top, scale in ((80.0, 10.0), (3000.0, 100.0)):
        zt = top - rng.random((V, C)) * scale / C     # each logit = 8 h w with h = 1
        h = A.f32_to_bf16(np.full((N, C), 1.0, np.float32))
        w = A.f32_to_bf16((zt / C).astype(np.float32))
        t = rng.integers(0, V, N).astype(np.int32)
        out = check_against_spec(h, w, t)
        for name in out:
            assert np.all(np.isfinite(out[name])), name
        _, lse64, ce64, z64 = ref_forward64(h, w, t, ZCOEF)
        bound = forward_bounds(h, w, t, ZCOEF, lse64, ce64, z64)[1]
        assert np.all(np.abs(out["lse"] - lse64) <= bound)
        assert np.all(out["lse"] > top - scale)


def test_subnormal_inputs_act_as_zero():
    N, C, V = 5, 24, 1500
    h, w, t = make(N, C, V, seed=61)
    rng = np.random.default_rng(62)
    hs, ws = h.copy(), w.copy()
    for x, xs in ((h, hs), (w, ws)):
        idx = rng.random(x.shape) < 0.2
        sign = (rng.random(x.shape) < 0.5).astype(np.uint16) << 15
        sub = (rng.integers(1, 0x80, x.shape).astype(np.uint16)) | sign   # exponent field 0
        xs[idx] = sub[idx]
        x[idx] = sign[idx]                           # the zero of the same sign
    dloss = mean_dloss(N)
    a = cpu_ref.xent_forward(hs, ws, t, ZCOEF)
    b = cpu_ref.xent_forward(h, w, t, ZCOEF)
    for name, x, y in zip(("loss", "lse", "ce"), a, b):
        assert_bits(x, y, name)
    for name, x, y in zip(("dh", "dw"), cpu_ref.xent_backward(hs, ws, t, ZCOEF, a[1], dloss),
                          cpu_ref.xent_backward(h, w, t, ZCOEF, b[1], dloss)):
        assert_bits(x, y, name)
    check_against_spec(hs, ws, t)


# ---------------------------------------------------------------------------------------------
# Argument checking
# ---------------------------------------------------------------------------------------------
def _good(N=5, C=8, V=7):
    h, w, t = make(N, C, V, seed=71)
    return h, w, t, np.zeros(N, np.float32), mean_dloss(N)


@pytest.mark.parametrize("which,bad,match", [
    ("h", lambda h: h.astype(np.float32), "h: expected dtype"),
    ("h", lambda h: h[:, ::2], "h: must be C-contiguous"),
    ("h", lambda h: h[0], "h: expected 2 dimensions"),
    ("h", lambda h: h[:0], "h rows"),
    ("w", lambda w: w.astype(np.int16), "w: expected dtype"),
    ("w", lambda w: w[:, :4].copy(), "w: dimension 1"),
    ("w", lambda w: np.asfortranarray(w), "w: must be C-contiguous"),
    ("t", lambda t: t.astype(np.int64), "targets: expected dtype"),
    ("t", lambda t: t[:4].copy(), "targets: dimension 0"),
    ("t", lambda t: np.where(np.arange(5) == 3, -1, t).astype(np.int32), r"targets: entry 3 is -1, outside \[0, 7\)"),
    ("t", lambda t: np.where(np.arange(5) == 1, 7, t).astype(np.int32), r"targets: entry 1 is 7, outside \[0, 7\)"),
])
def test_bad_arrays(which, bad, match):
    h, w, t, lse, dloss = _good()
    args = dict(h=h, w=w, t=t)
    args[which] = bad(args[which])
    with pytest.raises(ValueError, match=match):
        cpu_ref.xent_forward(args["h"], args["w"], args["t"], ZCOEF)
    with pytest.raises(ValueError, match=match):
        cpu_ref.xent_backward(args["h"], args["w"], args["t"], ZCOEF, lse, dloss)


@pytest.mark.parametrize("which,bad,match", [
    ("lse", lambda a: a.astype(np.float64), "lse: expected dtype"),
    ("lse", lambda a: a[:4].copy(), "lse: dimension 0"),
    ("lse", lambda a: np.zeros(10, np.float32)[::2], "lse: must be C-contiguous"),
    ("dloss", lambda a: a.astype(np.float16), "dloss: expected dtype"),
    ("dloss", lambda a: a[None], "dloss: expected 1 dimensions"),
])
def test_bad_backward_arrays(which, bad, match):
    h, w, t, lse, dloss = _good()
    args = dict(lse=lse, dloss=dloss)
    args[which] = bad(args[which])
    with pytest.raises(ValueError, match=match):
        cpu_ref.xent_backward(h, w, t, ZCOEF, args["lse"], args["dloss"])


@pytest.mark.parametrize("zc", [float("nan"), -1e-4, float("inf"), 1e39, "x", np.ones(2)])
def test_bad_zcoef(zc):
    h, w, t, lse, dloss = _good()
    with pytest.raises(ValueError, match="zcoef"):
        cpu_ref.xent_forward(h, w, t, zc)
    with pytest.raises(ValueError, match="zcoef"):
        cpu_ref.xent_backward(h, w, t, zc, lse, dloss)


def test_zcoef_zero_and_python_float_allowed():
    h, w, t, _, _ = _good()
    a = cpu_ref.xent_forward(h, w, t, 0.0)
    assert_bits(a[0], a[2], "loss = ce when zcoef = 0")
    b = cpu_ref.xent_forward(h, w, t, 1e-4)          # a Python float is rounded to float32
    assert_bits(b[0], cpu_ref.xent_forward(h, w, t, np.float32(1e-4))[0], "zcoef rounding")
    assert math.isfinite(float(b[0][0]))


# ---------------------------------------------------------------------------------------------
# The logits kept by the forward for the backward (keep=True / saved=)
# ---------------------------------------------------------------------------------------------
LEVELS = list(range(cpu_ref.simd_level() + 1))     # 0 portable (SSE2/NEON), 1 AVX2, 2 AVX-512
# N: one row, rows in no whole vector of any level, a tail after whole vectors; V: shorter than a
# chunk, one entry past a chunk boundary, several chunks with a short last one
KEEP_SHAPES = [(1, 8, 7), (17, 16, 2049), (33, 24, 3000), (70, 8, 1030)]


def kept_and_recomputed(h, w, t, zc, dloss):
    """-> (forward outputs, backward outputs) with the logits kept, and the same recomputed."""
    fk = cpu_ref.xent_forward(h, w, t, zc, keep=True)
    assert len(fk) == 4 and isinstance(fk[3], cx.XentSaved), "the logits were not kept"
    bk = cpu_ref.xent_backward(h, w, t, zc, fk[1], dloss, saved=fk[3])
    fr = cpu_ref.xent_forward(h, w, t, zc)
    br = cpu_ref.xent_backward(h, w, t, zc, fr[1], dloss)
    return (fk[:3], bk), (fr, br)


@pytest.mark.parametrize("N,C,V", KEEP_SHAPES)
def test_kept_logits_give_the_recomputed_bits(N, C, V):
    """The backward reading the forward's logits gives the bits of the backward that computes them
    again (and the forward the bits it gives without keeping), at every SIMD level, with the
    scalar loops, on 1 and 2 threads; targets at the first entry and in the last chunk."""
    h, w, t = make(N, C, V, seed=N + V)
    t[-1] = V - 1
    t[0] = 0 if N > 1 else t[0]
    rng = np.random.default_rng(V)
    dloss = (rng.standard_normal(N) * 0.1).astype(np.float32)
    with cpu_ref.settings(threads=1):
        (fk, want), _ = kept_and_recomputed(h, w, t, ZCOEF, dloss)
    for name, a, b in zip(("dh", "dw"), want, S.xent_backward(h, w, t, ZCOEF, fk[1], dloss)):
        assert_bits(a, b, f"kept {name} vs spec")
    for threads in (1, 2):
        for how, ctx in [(f"level {lv}", dict(simd=lv)) for lv in LEVELS] + [("scalar loops", None)]:
            with cpu_ref.settings(threads=threads, **(ctx or {})), vector_math(ctx is not None):
                (fk, bk), (fr, br) = kept_and_recomputed(h, w, t, ZCOEF, dloss)
            for name, a, b in zip(("loss", "lse", "ce", "dh", "dw"), fk + bk, fr + br):
                assert_bits(a, b, f"{name}: kept vs recomputed, {how}, {threads} threads")
            for name, a, b in zip(("dh", "dw"), bk, want):
                assert_bits(a, b, f"{name}: kept, {how}, {threads} threads vs level {LEVELS[-1]}, 1 thread")


def test_keep_budget(monkeypatch):
    """Logits over XENT_KEEP_BYTES are not kept (saved None, the backward computes them); at the
    budget they are; the bits are the same either way."""
    N, C, V = 33, 24, 3000
    h, w, t = make(N, C, V, seed=5)
    t[-1] = V - 1
    dloss = mean_dloss(N)
    need = cx.kept_bytes(N, V)
    assert cx.keeps(1024, 8192) and not cx.keeps(16384, 128256), "small's logits kept, open1b's not"
    outs = {}
    for budget in (need - 1, need):
        monkeypatch.setattr(cx, "XENT_KEEP_BYTES", budget)
        loss, lse, ce, saved = cpu_ref.xent_forward(h, w, t, ZCOEF, keep=True)
        assert (saved is not None) == (budget == need) == cx.keeps(N, V)
        outs[budget] = (loss, lse, ce) + cpu_ref.xent_backward(h, w, t, ZCOEF, lse, dloss, saved=saved)
    for name, a, b in zip(("loss", "lse", "ce", "dh", "dw"), outs[need - 1], outs[need]):
        assert_bits(a, b, f"{name}: over the budget vs at it")


def test_saved_of_other_arrays_is_refused():
    """The kept logits are those of the forward's h and w: a backward given others, or anything
    but a handle, is a ValueError naming saved; evaluation (keep False) returns no handle."""
    h, w, t = make(9, 8, 1500, seed=6)
    assert len(cpu_ref.xent_forward(h, w, t, ZCOEF)) == 3
    loss, lse, ce, saved = cpu_ref.xent_forward(h, w, t, ZCOEF, keep=True)
    dloss = mean_dloss(9)
    for hh, ww in ((h.copy(), w), (h, w.copy())):
        with pytest.raises(ValueError, match="saved: the logits kept by xent_forward are of another h, w"):
            cpu_ref.xent_backward(hh, ww, t, ZCOEF, lse, dloss, saved=saved)
    with pytest.raises(ValueError, match="saved: expected what xent_forward"):
        cpu_ref.xent_backward(h, w, t, ZCOEF, lse, dloss, saved=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="another h, w or chunk"):
        cx._backward_chunked(h, w, t, ZCOEF, lse, dloss, 512, saved=saved)
    cpu_ref.xent_backward(h, w, t, ZCOEF, lse, dloss, saved=saved)
    with pytest.raises(ValueError, match="saved: already consumed by a backward"):
        cpu_ref.xent_backward(h, w, t, ZCOEF, lse, dloss, saved=saved)


def test_a_handle_is_not_taken_for_an_array_made_where_its_h_was():
    """The handle holds the forward's h: an h made after the caller let go of the forward's own
    cannot take its memory and pass the handle's check with logits that are not its own (h of 512
    bytes: numpy hands the last freed block of a small size out first). Refused, or the right bits."""
    N, C, V = 16, 16, 1500
    h, w, t = make(N, C, V, seed=11)
    h2 = make(N, C, V, seed=12)[0]
    dloss = mean_dloss(N)
    saved = cpu_ref.xent_forward(h, w, t, ZCOEF, keep=True)[3]
    del h
    h_new = np.empty((N, C), np.uint16)         # where the forward's h was, if the handle let it go
    h_new[:] = h2
    lse = cpu_ref.xent_forward(h_new, w, t, ZCOEF)[1]
    want = cpu_ref.xent_backward(h_new, w, t, ZCOEF, lse, dloss)
    try:
        got = cpu_ref.xent_backward(h_new, w, t, ZCOEF, lse, dloss, saved=saved)
    except ValueError as e:
        assert "of another h, w or chunk" in str(e)
    else:
        for name, a, b in zip(("dh", "dw"), got, want):
            assert_bits(a, b, f"{name}: a handle of another h accepted")


def test_a_reused_buffer_keeps_nothing_of_before():
    """The buffer a backward consumed serves the next forward of that shape: the logits of other
    inputs in it never reach a result."""
    N, C, V = 40, 16, 2100
    dloss = mean_dloss(N)
    for seed in (1, 2, 3):
        h, w, t = make(N, C, V, seed=seed)
        (fk, bk), (fr, br) = kept_and_recomputed(h, w, t, ZCOEF, dloss)
        for name, a, b in zip(("loss", "lse", "ce", "dh", "dw"), fk + bk, fr + br):
            assert_bits(a, b, f"{name}: kept vs recomputed, inputs {seed}")
    assert cx._spare[0] is not None and cx._spare[0].shape == (V, cx.kept_bytes(N, V) // (4 * V))


@pytest.mark.parametrize("precision,recompute_blocks", [("bf16", False), ("bf16", True), ("int8", False)])
def test_model_keeps_the_logits_from_forward_to_backward(monkeypatch, precision, recompute_blocks):
    """A training forward leaves the kept logits in its Cache, the backward takes them out (one
    microbatch's logits live at a time), and the gradient has the bits of a model whose logits
    are over the budget; evaluation asks for nothing to be kept."""
    from mlx_open1b.config import ModelConfig
    from mlx_open1b.model import Model, init_params
    cfg = ModelConfig(vocab_size=1100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      ffn_hidden=48, seq_len=16, window=4)
    m = Model(cfg, precision=precision, recompute_blocks=recompute_blocks)
    params = init_params(cfg, seed=3)
    win = np.random.default_rng(4).integers(0, cfg.vocab_size, (3, cfg.seq_len + 1)).astype(np.uint32)
    loss, _, _, cache = m.forward(params, win)
    assert isinstance(cache.xent_saved, cx.XentSaved)
    kept = m.backward(params, cache)
    assert cache.xent_saved is None
    monkeypatch.setattr(cx, "XENT_KEEP_BYTES", 0)
    loss0, _, _, cache0 = m.forward(params, win)
    assert cache0.xent_saved is None and loss0 == loss
    assert_bits(kept, m.backward(params, cache0), "gradient: logits kept vs computed again")
    asked = []
    real = cpu_ref.xent_forward
    monkeypatch.setattr(cpu_ref, "xent_forward", lambda *a, **k: asked.append(k) or real(*a, **k))
    m.eval_loss(params, win)
    assert asked == [{}]


def test_every_backend_takes_keep_and_saved():
    """keep=True on every backend that loads here: the same three results and a fourth, which
    that backend's backward takes as saved (None where it keeps nothing) with the same bits."""
    from mlx_open1b import backend
    from mlx_open1b.parity import spec_backend
    mods = [spec_backend]
    for name in backend.BACKENDS:
        try:
            mods.append(backend.load(name))
        except backend.BackendUnavailable:
            pass
    h, w, t = make(5, 8, 1500, seed=8)
    dloss = mean_dloss(5)
    want = cpu_ref.xent_forward(h, w, t, ZCOEF)
    want_b = cpu_ref.xent_backward(h, w, t, ZCOEF, want[1], dloss)
    for m in mods:
        out = m.xent_forward(h, w, t, ZCOEF, keep=True)
        assert len(out) == 4 and (out[3] is None) == (m is not cpu_ref), m.NAME
        got_b = m.xent_backward(h, w, t, ZCOEF, out[1], dloss, saved=out[3])
        got = tuple(out[:3]) + tuple(got_b)
        for name, a, b in zip(("loss", "lse", "ce", "dh", "dw"), got, want + want_b):
            assert_bits(m.to_host(a), b, f"{m.NAME} {name}")
