"""Bounded Metal dispatches (metal/slabs.py): the plan at every preset's real shapes keeps each
launch within MAX_DISPATCH_WORK (pure planning, nothing runs), and launching in slabs changes no
bit (the emulator, small shapes, a tiny bound against the default single launch and cpu_ref)."""
from __future__ import annotations

import collections

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.config import PRESETS
from mlx_open1b.contract import NORM_BLOCK, XENT_CHUNK
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
def paths(name: str) -> list[tuple[str, int, bool]]:
    """(path, sequences per batch, backward) of every batch the code runs a preset's model at: the
    training microbatch (forward and backward; Trainer.step and the distributed trainer), the
    held-out evaluation (forward only: a source's eval_windows probe windows as one batch, as
    Trainer.heldout_ce and the distributed trainer call Model.eval_loss; int8's per-tensor scales
    make that batching part of the result) and lm-eval's default batch (forward and the logits)."""
    t = PRESETS[name].train
    return [("train", t.microbatch_seqs, True), ("eval", t.eval_windows, False), ("lm-eval", 8, False)]


#: ITEM_UNITS keys that plan several kernels; the others are named for their kernel
PLANS = {"convert": ("f32_to_bf16", "bf16_to_f32", "add", "scale"), "rmsnorm": ("rmsnorm_forward", "rmsnorm_backward"),
         "xent_chunk": ("xent_forward_chunk", "xent_backward_dz"), "hadamard": ("hadamard", "hadamard_i8")}


def launches(name: str, B: int, backward: bool) -> dict:
    """The launches of the model program at B sequences of a preset, every precision path (a GNMR
    controller moves single units between bf16 and the quantized path; both attention forwards):
    ranged: (plan, items, per) of the kernels the ops launch in slabs.item_slabs(plan, items, per)
    ranges; gemms, gemms_i8: (I, J, P); attention: (B, T, H, G, W, D); whole: {kernel: units of its
    largest launch} for the kernels launched whole (their per-thread work estimated as for
    ITEM_UNITS), with backward the training step's (optimizer and initialization included)."""
    m = PRESETS[name].model
    T, d, H, G, D = m.seq_len, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    F, V, L = m.ffn_hidden, m.vocab_size, XENT_CHUNK
    N = B * T
    pad = lambda n: -(-n // QB) * QB                                            # noqa: E731
    cdiv = lambda a, b: -(-a // b)                                              # noqa: E731
    linears = [((H + 2 * G) * D, d), (d, H * D), (2 * F, d), (d, F)]          # (M, K): qkv, wo, gate_up, down
    tensors = [int(np.prod(shape)) for _, shape, _ in m.param_shapes()]
    largest, n_params = max(tensors), m.n_params()
    elementwise = [n_params, largest, N * d, N * H * D, N * F, N * 2 * F]       # flat buffers, activations
    ranged = [("embedding_forward", N, d), ("rmsnorm", N, d), ("rmsnorm", N * H, D), ("rmsnorm", N * G, D),
              ("rope", B, T * H * D), ("rope", B, T * G * D), ("swiglu_forward", N, F),
              ("attention_vquant", B * T * G, D), ("xent_chunk", N, L)]
    ranged += [(k, n, 1) for n in elementwise for k in ("convert", "div", "map")]
    gemms = [(N, Mo, K) for Mo, K in linears] + [(N, L, d), (N, V, d)]       # y; a logits chunk; lm-eval's logits
    gemms_i8 = [(N, Mo, K) for Mo, K in linears]
    quantized = [N * K for _, K in linears]                                     # per-tensor quantized activations
    for Mo, K in linears:
        ranged += [("quant_apply", Mo, K), ("qdequant", N, Mo)]
    whole = {"xent_forward_final": N * 64, "qw_scale": max(Mo * K for Mo, K in linears) * 8,
             "rope_tables": T * (D // 2) * 128, "treefold": cdiv(n_params, NORM_BLOCK) * 8, "scalar": 128}
    if backward:
        ranged += [("rmsnorm", N, d), ("swiglu_backward", N, F), ("attention_di", B, T * H * D), ("xent_chunk", N, L),
                   ("adamw", largest, 1), ("trunc_normal", largest, 1), ("philox", largest, 1),
                   ("sumsq_blocks", cdiv(largest, NORM_BLOCK), NORM_BLOCK)]
        for Mo, K in linears:
            gemms += [(N, K, Mo), (Mo, K, N)]
            gemms_i8 += [(N, K, pad(Mo)), (Mo, K, pad(N))]
            ranged += [("qgrad_scale", N, Mo), ("hadamard", pad(Mo) // QB, QB * N), ("hadamard", pad(Mo) // QB, QB * K),
                       ("hadamard", pad(N) // QB, QB * Mo), ("hadamard", pad(N) // QB, QB * K),
                       ("qdequant", N, K), ("qdequant", Mo, K)]
            quantized += [pad(Mo) * N, pad(Mo) * K, pad(N) * Mo, pad(N) * K]
        gemms += [(N, d, L), (L, d, N)]
        whole.update({"rmsnorm_dg": N * d * 16, "embedding_backward": (N + V) * d * 4})
    ranged += [("quant_absmax", cdiv(n, M.QUANT_BLOCK), M.QUANT_BLOCK) for n in quantized]
    ranged += [("quant_apply", n, 1) for n in quantized]
    whole["quant_absmax"] = cdiv(max(quantized), M.QUANT_BLOCK) * 8            # the second pass, one threadgroup
    attention = [(B, T, H, G, W, D) for W in sorted({m.layer_window(l) for l in range(m.n_layers)})]
    return dict(ranged=ranged, gemms=gemms, gemms_i8=gemms_i8, attention=attention, whole=whole,
                kernels=_kernels(ranged, whole, backward))


def _kernels(ranged, whole, backward) -> set:
    names = {k for plan, _, _ in ranged for k in PLANS.get(plan, (plan,))} | set(whole) | {"gemm", "gemm_i8"}
    names |= {"attention_forward", "attention_forward_i8"} | ({"attention_dq", "attention_dkv"} if backward else set())
    return names


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


def _check_tiles(B, T, heads, row_work):
    """The attention kernels' launches (metal/ops.py attention_tile_slabs: ranges of whole tiles of
    ATTN_ROWS rows of one head, row_work (T,) units a row) bound; returns their number."""
    nt = -(-T // M.ATTN_ROWS)
    work = np.zeros(nt * M.ATTN_ROWS, np.int64)
    work[:T] = row_work
    plan = M.attention_tile_slabs(B, T, heads, row_work)
    _check_rows(plan, np.tile(work.reshape(nt, M.ATTN_ROWS).sum(1), B * heads))
    return len(plan)


def _check_ranges(plan, n, per):
    ranges = slabs.item_slabs(plan, n, per)
    assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(b - a for a, b in ranges) * slabs.ITEM_UNITS[plan] * per <= BOUND, (plan, n, per)
    return len(ranges)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plan_bounds_every_launch_at_the_preset(name):
    for path, B, backward in paths(name):
        s = launches(name, B, backward)
        for I, J, P in s["gemms"] + s["gemms_i8"]:
            _check_gemm_plan(I, J, P)
        for B_, T, H, G, W, D in s["attention"]:
            pair = slabs.attention_pair_work(D)
            _check_tiles(B_, T, H, slabs.query_keys(T, W) * pair)                  # forward (both), dq
            if backward:
                _check_tiles(B_, T, G, slabs.key_queries(T, W) * (H // G) * pair)  # dk/dv
        for plan, n, per in s["ranged"]:
            _check_ranges(plan, n, per)
        over = {k: v for k, v in s["whole"].items() if v > BOUND}
        assert not over, (path, over)


def test_every_kernel_is_planned():
    """Each kernel of metal/ops.py is in the inventory above (ranged, GEMM, attention or whole), so
    a new kernel cannot escape the plan check."""
    s = launches("tiny", 1, True)
    assert s["kernels"] == set(M.KERNELS), (set(M.KERNELS) ^ s["kernels"])
    assert set(slabs.ITEM_UNITS) == {plan for plan, _, _ in s["ranged"]}


def test_plan_is_needed_at_open1b():
    """Not vacuous: unsplit, the open1b launches exceed the bound many times over, in training and
    in held-out evaluation (a whole source's windows in one batch)."""
    s = launches("open1b", PRESETS["open1b"].train.microbatch_seqs, True)
    I, J, P = max(s["gemms"], key=lambda g: g[0] * g[1] * g[2])
    assert 2 * I * J * P > 100 * BOUND and _check_gemm_plan(I, J, P) > 100
    B, T, H, G, W, D = s["attention"][0]
    total = int(np.tile(np.repeat(slabs.query_keys(T, 0), H), B).sum()) * slabs.attention_pair_work(D)
    assert total > 50 * BOUND and _check_tiles(B, T, H, slabs.query_keys(T, 0) * slabs.attention_pair_work(D)) > 50
    largest = max(n for plan, n, _ in s["ranged"] if plan == "trunc_normal")
    assert _check_ranges("trunc_normal", largest, 1) > 10
    e = launches("open1b", PRESETS["open1b"].train.eval_windows, False)
    split = {plan for plan, n, per in e["ranged"] if _check_ranges(plan, n, per) > 1}
    assert {"xent_chunk", "rmsnorm", "rope", "quant_apply", "quant_absmax", "qdequant", "convert"} <= split, split


def test_row_plan_edges():
    assert slabs.row_slabs(np.array([], np.int64)) == [(0, 0)]
    assert slabs.row_slabs(np.array([5, 5, 5]), bound=10) == [(0, 2), (2, 3)]
    assert slabs.row_slabs(np.array([30, 1, 1]), bound=10) == [(0, 1), (1, 3)]     # an over-bound row alone
    assert slabs.gemm_slabs(3, 5, 2, bound=8) == [(i, i + 1, j, min(5, j + 2)) for i in range(3) for j in (0, 2, 4)]
    assert slabs.gemm_slabs(4, 2, 3, bound=24) == [(0, 2, 0, 2), (2, 4, 0, 2)]
    # whole 64 x 64 tiles of the tiled kernels where the bound allows a tile's rows (or its square)
    T = slabs.GEMM_TILE
    rows = [(i, min(200, i + T), 0, 10) for i in range(0, 200, T)]
    assert slabs.gemm_slabs(200, 10, 5, bound=2 * 5 * 10 * 100) == rows           # 100 rows fit: 64 a slab
    assert slabs.gemm_slabs(70, 5000, 1, bound=2 * T * T) == [(i, min(70, i + T), j, min(5000, j + T))
                                                             for i in (0, T) for j in range(0, 5000, T)]
    with pytest.raises(ValueError, match="one output element sums 10 products"):
        slabs.gemm_slabs(2, 2, 10, bound=8)
    assert slabs.even_slabs(0, 3) == [(0, 0)] and slabs.even_slabs(7, 3, bound=6) == [(0, 2), (2, 4), (4, 6), (6, 7)]


# ---------------------------------------------------------------------------------------------
# slabs change no bit (emulator)
# ---------------------------------------------------------------------------------------------
def _eq(a, b, what: str) -> None:
    """Bit equality of two arrays of any element type (int8 levels, clip codes included)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.itemsize == 1:
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), what
    else:
        assert_bits_equal(a, b, what)


def _launches(fn, monkeypatch):
    """fn()'s result and its launches per kernel (metal/ops.py's _run counted)."""
    counts, run = collections.Counter(), M._run

    def counting(name, *args, **kwargs):
        counts[name] += 1
        return run(name, *args, **kwargs)
    monkeypatch.setattr(M, "_run", counting)
    try:
        return fn(), counts
    finally:
        monkeypatch.setattr(M, "_run", run)


def _same(fn, monkeypatch, bound: int, what: str, kernels=()):
    """fn() with the default bound (one launch per kernel here) == fn() with `bound`, bit for bit;
    the small bound must really split (each of `kernels` into more launches, and the whole)."""
    whole, n_whole = _launches(fn, monkeypatch)
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", bound)
    split, n_split = _launches(fn, monkeypatch)
    monkeypatch.setattr(slabs, "MAX_DISPATCH_WORK", BOUND)
    total = lambda c: sum(c.values())                   # noqa: E731
    assert total(n_split) > total(n_whole), \
        f"{what}: {total(n_split)} launches with the small bound, {total(n_whole)} without"
    unsplit = [k for k in kernels if not n_split[k] > n_whole[k] > 0]
    assert not unsplit, f"{what}: not split by the small bound: {[(k, n_whole[k], n_split[k]) for k in unsplit]}"
    whole = whole if isinstance(whole, tuple) else (whole,)
    split = split if isinstance(split, tuple) else (split,)
    for a, b in zip(whole, split):
        if a is not None:
            _eq(b, a, what)
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
    fwd = _same(lambda: M.xent_forward(h, w, t, 1e-4), monkeypatch, 2 * Cd * 100, "xent_forward",
                ["gemm", "xent_forward_chunk"])
    for got, want in zip(fwd, C.xent_forward(h, w, t, 1e-4)):
        assert_bits_equal(got, want, "xent_forward vs cpu_ref")
    dl = rand_f32(rng, (N,))
    bwd = _same(lambda: M.xent_backward(h, w, t, 1e-4, fwd[1], dl), monkeypatch, 2 * Cd * 100, "xent_backward",
                ["gemm", "xent_backward_dz"])
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
    oi = _same(lambda: M.attention_forward_i8(q, k, v, W, 0.35), monkeypatch, small, "attention_forward_i8",
               ["attention_forward_i8", "attention_vquant"])
    for got, want in zip(oi, C.attention_forward_i8(q, k, v, W, 0.35)):
        assert_bits_equal(got, want, "attention_forward_i8 vs cpu_ref")
    dout = rand_f32(rng, (B, T, H, D))
    grads = _same(lambda: M.attention_backward(dout, q, k, v, o, lse, W, 0.35), monkeypatch, small,
                  "attention_backward", ["attention_di", "attention_dq", "attention_dkv"])
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


def test_slabbed_rowwise_equals_whole(monkeypatch):
    """The row-wise kernels whose work grows with the batch: whole rows (sequences for RoPE and
    attention_di) per launch, the same bits."""
    rng = np.random.default_rng(35)
    N, Cd = 9, 10
    x, g, dy = rand_f32(rng, (N, Cd), 2.0), rand_bf16(rng, (Cd,)), rand_f32(rng, (N, Cd))
    for gg in (g, None):
        y, r = _same(lambda: M.rmsnorm_forward(x, gg, 1e-6), monkeypatch, 16 * Cd * 2, "rmsnorm_forward",
                     ["rmsnorm_forward"])
        for got, want in zip((y, r), C.rmsnorm_forward(x, gg, 1e-6)):
            assert_bits_equal(got, want, "rmsnorm_forward vs cpu_ref")
        dx, dg = _same(lambda: M.rmsnorm_backward(dy, x, gg, r), monkeypatch, 16 * Cd * 2, "rmsnorm_backward",
                       ["rmsnorm_backward"])
        for got, want in zip((dx, dg), C.rmsnorm_backward(dy, x, gg, r)):
            if want is not None:
                assert_bits_equal(got, want, "rmsnorm_backward vs cpu_ref")
    B, T, R, D = 3, 5, 2, 6
    cos_t, sin_t = C.rope_tables(T, D, 10000.0)
    xr = rand_f32(rng, (B, T, R, D))
    for name in ("rope_forward", "rope_backward"):
        (got,) = _same(lambda: getattr(M, name)(xr, cos_t, sin_t), monkeypatch, 16 * T * R * D, name, ["rope"])
        assert_bits_equal(got, getattr(C, name)(xr, cos_t, sin_t), f"{name} vs cpu_ref")
    tokens, wte = rng.integers(0, 20, N).astype(np.int32), rand_bf16(rng, (20, 8))
    (e,) = _same(lambda: M.embedding_forward(tokens, wte), monkeypatch, 4 * 8 * 2, "embedding_forward",
                 ["embedding_forward"])
    assert_bits_equal(e, C.embedding_forward(tokens, wte), "embedding_forward vs cpu_ref")


def test_slabbed_pointwise_equals_whole(monkeypatch):
    rng = np.random.default_rng(36)
    a, b = rand_f32(rng, (10, 10), 3.0), rand_f32(rng, (10, 10), 3.0)
    h = rand_bf16(rng, (100,))
    for name, args, kernel in (("add", (a, b), "add"), ("scale", (a, 0.3), "scale"), ("div_int", (a, b), "div"),
                               ("f32_to_bf16", (a,), "f32_to_bf16"), ("bf16_to_f32", (h,), "bf16_to_f32")):
        units = slabs.ITEM_UNITS["div" if kernel == "div" else "convert"]
        (got,) = _same(lambda: getattr(M, name)(*args), monkeypatch, units * 30, name, [kernel])
        assert_bits_equal(got, getattr(C, name)(*args), f"{name} vs cpu_ref")
    xs = rand_f32(rng, (3 * NORM_BLOCK + 5,))
    (got,) = _same(lambda: M.sumsq_blocks(xs), monkeypatch, 4 * NORM_BLOCK, "sumsq_blocks", ["sumsq_blocks"])
    assert_bits_equal(got, C.sumsq_blocks(xs), "sumsq_blocks vs cpu_ref")


def test_slabbed_quantization_equals_whole(monkeypatch):
    """The per-tensor absmax over whole blocks of QUANT_BLOCK per launch (its second pass over all
    the block maxima, the contract's order), the levels, the rotations over whole QB-row blocks,
    the dequantization and the dx operand: the same bits."""
    rng = np.random.default_rng(37)
    x = rand_bf16(rng, (3, M.QUANT_BLOCK))                # three absmax blocks
    got = _same(lambda: M.quant_tensor(x), monkeypatch, 8 * M.QUANT_BLOCK, "quant_tensor",
                ["quant_absmax", "quant_apply"])
    for a, b in zip(got, C.quant_tensor(x)):
        _eq(a, b, "quant_tensor vs cpu_ref")
    w = rand_bf16(rng, (5, 7))
    got = _same(lambda: M.quant_weight_rows(w), monkeypatch, 48 * 7 * 2, "quant_weight_rows", ["quant_apply"])
    for a, b in zip(got, C.quant_weight_rows(w)):
        _eq(a, b, "quant_weight_rows vs cpu_ref")
    f = rand_f32(rng, (2 * QB, 3))                        # two blocks of QB rows
    (got,) = _same(lambda: M.hadamard_rows(f), monkeypatch, 16 * QB * 3, "hadamard_rows", ["hadamard"])
    assert_bits_equal(got, C.hadamard_rows(f), "hadamard_rows vs cpu_ref")
    N, K, Mo = 130, 3, 2
    xq, wq, dyq = rand_bf16(rng, (N, K)), rand_bf16(rng, (Mo, K)), rand_bf16(rng, (N, Mo))
    grads = _same(lambda: M.qlinear_backward(dyq, xq, wq), monkeypatch, 2 * 2 * QB * 2, "qlinear_backward",
                  ["qgrad_scale", "hadamard", "hadamard_i8", "quant_apply", "qdequant", "gemm_i8"])
    for a, b in zip(grads, C.qlinear_backward(dyq, xq, wq)):
        assert_bits_equal(a, b, "qlinear_backward vs cpu_ref")
