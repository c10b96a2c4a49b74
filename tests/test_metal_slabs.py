"""Bounded Metal dispatches (metal/slabs.py): the plan at every preset's real shapes keeps each
launch within MAX_DISPATCH_WORK (pure planning, nothing runs), and launching in slabs changes no
bit (the emulator, small shapes, a tiny bound against the default single launch and cpu_ref)."""
from __future__ import annotations

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.config import PRESETS
from mlx_open1b.contract import XENT_CHUNK
from mlx_open1b.metal import emu, ops as M, slabs

from helpers import assert_bits_equal, rand_bf16, rand_f32

BOUND = slabs.MAX_DISPATCH_WORK
QB = 128


def test_bound_is_the_stated_budget():
    # 5 s shared by 50 dispatches of one command buffer at 50e9 units/s: 0.1 s, 5e9 units each
    assert BOUND == int(slabs.WATCHDOG_S / slabs.OPS_PER_BUFFER * slabs.RATE) == 5 * 10 ** 9


# ---------------------------------------------------------------------------------------------
# the plan at the presets' real shapes
# ---------------------------------------------------------------------------------------------
def preset_shapes(name: str) -> dict:
    """The launch sizes of one training step (and the initialization) of a preset."""
    cfg = PRESETS[name]
    m, t = cfg.model, cfg.train
    B, T = t.microbatch_seqs, m.seq_len
    N, d, H, G, D, F, V = B * T, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_hidden, m.vocab_size
    linears = [((H + 2 * G) * D, d), (d, H * D), (2 * F, d), (d, F)]          # (M, K): qkv, wo, gate_up, down
    gemms = []
    for Mo, K in linears:
        gemms += [(N, Mo, K), (N, K, Mo), (Mo, K, N)]                           # y, dx, dW
    gemms += [(N, XENT_CHUNK, d), (N, d, XENT_CHUNK), (XENT_CHUNK, d, N)]       # logits, dh, dW of a chunk
    pad = lambda n: -(-n // QB) * QB
    gemms_i8 = []
    for Mo, K in linears:
        gemms_i8 += [(N, Mo, K), (N, K, pad(Mo)), (Mo, K, pad(N))]
    largest = max(V * d, max(Mo * K for Mo, K in linears))                      # elements of one tensor
    windows = sorted({m.layer_window(l) for l in range(m.n_layers)})
    return dict(B=B, T=T, N=N, d=d, H=H, G=G, D=D, F=F, V=V, gemms=gemms, gemms_i8=gemms_i8,
                largest=largest, windows=windows)


def _check_gemm_plan(I, J, P):
    blocks = slabs.gemm_slabs(I, J, P)
    covered = np.zeros((I, J), np.int8) if I * J <= 2 ** 26 else None
    area = 0
    for i0, i1, j0, j1 in blocks:
        assert 0 <= i0 < i1 <= I and 0 <= j0 < j1 <= J
        assert 2 * (i1 - i0) * (j1 - j0) * P <= BOUND, (I, J, P, (i0, i1, j0, j1))
        area += (i1 - i0) * (j1 - j0)
        if covered is not None:
            covered[i0:i1, j0:j1] += 1
    assert area == I * J                          # with the bound check: a tiling of C
    if covered is not None:
        assert (covered == 1).all()
    return len(blocks)


def _check_rows(slab_list, work):
    assert slab_list[0][0] == 0 and slab_list[-1][1] == work.size
    assert all(a[1] == b[0] for a, b in zip(slab_list, slab_list[1:]))       # consecutive, no gaps
    assert max(slabs.slab_work(slab_list, work)) <= BOUND


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plan_bounds_every_launch_at_the_preset(name):
    s = preset_shapes(name)
    for I, J, P in s["gemms"] + s["gemms_i8"]:
        _check_gemm_plan(I, J, P)
    B, T, H, G, D = s["B"], s["T"], s["H"], s["G"], s["D"]
    pair = slabs.attention_pair_work(D)
    for W in s["windows"]:
        qw = np.tile(np.repeat(slabs.query_keys(T, W), H), B) * pair
        _check_rows(slabs.attention_query_slabs(B, T, H, W, D), qw)
        kw = np.tile(np.repeat(slabs.key_queries(T, W), G), B) * (H // G) * pair
        _check_rows(slabs.attention_key_slabs(B, T, H, G, W, D), kw)
    for kernel, n in (("adamw", s["largest"]), ("trunc_normal", s["largest"]), ("philox", s["largest"]),
                      ("map", s["largest"]), ("swiglu_forward", s["N"]), ("swiglu_backward", s["N"])):
        per = slabs.ITEM_UNITS[kernel] * (s["F"] if kernel.startswith("swiglu") else 1)
        ranges = slabs.even_slabs(n, per)
        assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(b - a for a, b in ranges) * per <= BOUND, kernel
    # the kernels launched whole: their largest launch at the preset (items x units per item, the
    # units estimated as for ITEM_UNITS) fits the bound too
    N, d, F, V = s["N"], s["d"], s["F"], s["V"]
    whole = {
        "xent_forward_chunk / xent_backward_dz": N * XENT_CHUNK * 64,    # an exp and a few ops per logit
        "rmsnorm_forward / backward / dg": N * d * 16,
        "rope": B * T * H * D * 16,
        "embedding_forward / backward": (N + V) * d * 2,
        "quant_apply / qdequant / qgrad_scale / quant_absmax": N * 2 * F * 24,
        "hadamard / hadamard_i8": -(-N // QB) * QB * 2 * F * 16,           # 7 butterfly stages per value
        "qw_scale": 2 * F * d * 4,
        "attention_vquant / attention_di": B * T * H * D * 8,
        "sumsq_blocks, add, scale, conversions": s["largest"] * 8,
        "treefold, quant_absmax (second pass)": -(-s["largest"] // 4096) * 64 * 4,
    }
    over = {k: v for k, v in whole.items() if v > BOUND}
    assert not over, over


def test_plan_is_needed_at_open1b():
    """Not vacuous: unsplit, the open1b launches exceed the bound many times over."""
    s = preset_shapes("open1b")
    I, J, P = max(s["gemms"], key=lambda g: g[0] * g[1] * g[2])
    assert 2 * I * J * P > 100 * BOUND and _check_gemm_plan(I, J, P) > 100
    B, T, H, D = s["B"], s["T"], s["H"], s["D"]
    total = int(np.tile(np.repeat(slabs.query_keys(T, 0), H), B).sum()) * slabs.attention_pair_work(D)
    assert total > 50 * BOUND and len(slabs.attention_query_slabs(B, T, H, 0, D)) > 50
    assert len(slabs.even_slabs(s["largest"], slabs.ITEM_UNITS["trunc_normal"])) > 10


def test_row_plan_edges():
    assert slabs.row_slabs(np.array([], np.int64)) == [(0, 0)]
    assert slabs.row_slabs(np.array([5, 5, 5]), bound=10) == [(0, 2), (2, 3)]
    assert slabs.row_slabs(np.array([30, 1, 1]), bound=10) == [(0, 1), (1, 3)]     # an over-bound row alone
    assert slabs.gemm_slabs(3, 5, 2, bound=8) == [(i, i + 1, j, min(5, j + 2)) for i in range(3) for j in (0, 2, 4)]
    assert slabs.gemm_slabs(4, 2, 3, bound=24) == [(0, 2, 0, 2), (2, 4, 0, 2)]
    with pytest.raises(ValueError, match="one output element sums 10 products"):
        slabs.gemm_slabs(2, 2, 10, bound=8)
    assert slabs.even_slabs(0, 3) == [(0, 0)] and slabs.even_slabs(7, 3, bound=6) == [(0, 2), (2, 4), (4, 6), (6, 7)]


# ---------------------------------------------------------------------------------------------
# slabs change no bit (emulator)
# ---------------------------------------------------------------------------------------------
def _launches(fn):
    n0 = emu.stats["launches"]
    out = fn()
    return out, emu.stats["launches"] - n0


def _same(fn, monkeypatch, bound: int, what: str):
    """fn() with the default bound (one launch per kernel here) == fn() with `bound`, bit for bit;
    the small bound must really split."""
    whole, n_whole = _launches(fn)
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", bound)
    split, n_split = _launches(fn)
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", BOUND)
    assert n_split > n_whole, f"{what}: {n_split} launches with the small bound, {n_whole} without"
    whole = whole if isinstance(whole, tuple) else (whole,)
    split = split if isinstance(split, tuple) else (split,)
    for a, b in zip(whole, split):
        if a is not None:
            assert_bits_equal(np.asarray(b), np.asarray(a), what)
    return whole


def test_slabbed_gemms_equal_whole(monkeypatch):
    rng = np.random.default_rng(31)
    N, K, Mo = 13, 37, 11
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (Mo, K)), rand_bf16(rng, (N, Mo))
    for bound in (2 * K * 3, 2 * K + 1):                 # row blocks of 3; single rows in column blocks
        y = _same(lambda: M.linear_forward(x, w), monkeypatch, bound, f"linear_forward bound={bound}")
        assert_bits_equal(y[0], C.linear_forward(x, w), "linear_forward vs cpu_ref")
        dx, dw = _same(lambda: M.linear_backward(dy, x, w), monkeypatch, bound, f"linear_backward bound={bound}")
        for got, want in zip((dx, dw), C.linear_backward(dy, x, w)):
            assert_bits_equal(got, want, "linear_backward vs cpu_ref")
    qa = rng.integers(-127, 128, (9, 300)).astype(np.int8)
    qb = rng.integers(-127, 128, (7, 300)).astype(np.int8)
    (acc,) = _same(lambda: M.gemm_i8(qa, qb), monkeypatch, 2 * 300 * 2, "gemm_i8")
    assert_bits_equal(acc, C.gemm_i8(qa, qb), "gemm_i8 vs cpu_ref")
    xq, wq, dyq = rand_bf16(rng, (5, 130)), rand_bf16(rng, (6, 130)), rand_bf16(rng, (5, 6))
    _same(lambda: M.qlinear_forward(xq, wq), monkeypatch, 2 * 130 * 2, "qlinear_forward")
    _same(lambda: M.qlinear_backward(dyq, xq, wq), monkeypatch, 2 * 256 * 2, "qlinear_backward")


def test_slabbed_xent_equals_whole(monkeypatch):
    rng = np.random.default_rng(32)
    N, Cd, V = 6, 24, 1100                           # two vocabulary chunks
    h, w = rand_bf16(rng, (N, Cd)), rand_bf16(rng, (V, Cd))
    t = rng.integers(0, V, N).astype(np.int32)
    fwd = _same(lambda: M.xent_forward(h, w, t, 1e-4), monkeypatch, 2 * Cd * 100, "xent_forward")
    for got, want in zip(fwd, C.xent_forward(h, w, t, 1e-4)):
        assert_bits_equal(got, want, "xent_forward vs cpu_ref")
    dl = rand_f32(rng, (N,))
    bwd = _same(lambda: M.xent_backward(h, w, t, 1e-4, fwd[1], dl), monkeypatch, 2 * Cd * 100, "xent_backward")
    for got, want in zip(bwd, C.xent_backward(h, w, t, 1e-4, fwd[1], dl)):
        assert_bits_equal(got, want, "xent_backward vs cpu_ref")


@pytest.mark.parametrize("W", [0, 5])
def test_slabbed_attention_equals_whole(monkeypatch, W):
    rng = np.random.default_rng(33 + W)
    B, T, H, G, D = 2, 70, 4, 2, 8
    q, k, v = rand_bf16(rng, (B, T, H, D)), rand_bf16(rng, (B, T, G, D)), rand_bf16(rng, (B, T, G, D))
    small = 40 * slabs.attention_pair_work(D)        # a few rows per slab, many slabs
    o, lse = _same(lambda: M.attention_forward(q, k, v, W, 0.35), monkeypatch, small, "attention_forward")
    for got, want in zip((o, lse), C.attention_forward(q, k, v, W, 0.35)):
        assert_bits_equal(got, want, "attention_forward vs cpu_ref")
    oi = _same(lambda: M.attention_forward_i8(q, k, v, W, 0.35), monkeypatch, small, "attention_forward_i8")
    for got, want in zip(oi, C.attention_forward_i8(q, k, v, W, 0.35)):
        assert_bits_equal(got, want, "attention_forward_i8 vs cpu_ref")
    dout = rand_f32(rng, (B, T, H, D))
    grads = _same(lambda: M.attention_backward(dout, q, k, v, o, lse, W, 0.35), monkeypatch, small,
                  "attention_backward")
    for got, want in zip(grads, C.attention_backward(dout, q, k, v, o, lse, W, 0.35)):
        assert_bits_equal(got, want, "attention_backward vs cpu_ref")


def test_slabbed_elementwise_equals_whole(monkeypatch):
    rng = np.random.default_rng(34)
    h = rand_f32(rng, (9, 2 * 10), 3.0)
    out = _same(lambda: M.swiglu_forward(h), monkeypatch, 10 * 128 * 2, "swiglu_forward")
    assert_bits_equal(out[0], C.swiglu_forward(h), "swiglu_forward vs cpu_ref")
    dout = rand_f32(rng, (9, 10))
    dh = _same(lambda: M.swiglu_backward(dout, h), monkeypatch, 10 * 192 * 2, "swiglu_backward")
    assert_bits_equal(dh[0], C.swiglu_backward(dout, h), "swiglu_backward vs cpu_ref")
    x = rand_f32(rng, (7, 33), 5.0)
    y = _same(lambda: M.silu(x), monkeypatch, 128 * 10, "map silu")
    assert_bits_equal(y[0], C.silu(x), "silu vs cpu_ref")
    n = 1000
    p, g = rand_bf16(rng, (n,)), rand_f32(rng, (n,))
    m, v = rand_f32(rng, (n,), 0.1), np.abs(rand_f32(rng, (n,), 0.01))
    kw = dict(lr=1e-3, weight_decay=0.1, step=3)
    got = _same(lambda: M.adamw(p, g, m, v, **kw), monkeypatch, 192 * 64, "adamw")
    for a, b in zip(got, C.adamw(p, g, m, v, **kw)):
        assert_bits_equal(np.asarray(a), np.asarray(b), "adamw vs cpu_ref")
    start = 2 ** 64 - 100                                 # the counter wraps inside the range
    tn = _same(lambda: M.trunc_normal(7, 1, start, 500), monkeypatch, 600 * 64, "trunc_normal")
    assert_bits_equal(tn[0], C.trunc_normal(7, 1, start, 500), "trunc_normal vs cpu_ref")
    pb = _same(lambda: M.philox_blocks(7, 1, start, 300), monkeypatch, 64 * 50, "philox")
    assert_bits_equal(pb[0], C.philox_blocks(7, 1, start, 300), "philox vs cpu_ref")
