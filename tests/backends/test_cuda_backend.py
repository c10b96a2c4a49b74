"""The CUDA backend (cuda/*.cu) against the C reference, bit for bit.

Where CuPy and a GPU exist the ops run the real runtime; elsewhere they run the same .cu text on
the CPU emulator (cuda/emu). The emulator-specific tests (barriers, race check, FTZ modes, compile
errors, the cache, a planted one-ulp mutation) force emulation and need only g++. Inputs are seeded,
include subnormals, ±0, ±inf, NaN and the largest and smallest normals, and use shapes that are not
multiples of any block or tile size (128-thread blocks, 128x128 GEMM tiles, 64-key attention blocks,
1024-entry cross-entropy chunks, 4096-element norm blocks).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from helpers import SPECIAL_BF16, SPECIAL_F32, assert_bits_equal, rand_bf16, rand_f32, sprinkle

import mlx_open1b.cpu_ref as ref
from mlx_open1b import arrays
from mlx_open1b.cuda import emu, ops as cu, runtime

OK, HOW = cu.available()
pytestmark = pytest.mark.skipif(not OK, reason=HOW)
HAVE_GXX = emu.compiler_available()[0]
needs_emulator = pytest.mark.skipif(not HAVE_GXX, reason="the CUDA emulator needs g++")
CU_FILES = sorted(p.name for p in runtime.SOURCE_DIR.glob("*.cu"))

# edge values of fp32 around the flush threshold and the extremes
EDGES = np.array([2.0 ** -126, 2.0 ** -126 * (1 + 2.0 ** -23), 2.0 ** -125, 1.1754942e-38, 1.4e-45,
                  3.4028235e38, 3.4028233e38, 88.72283, 88.72284, -87.33655, -103.0, -103.00001,
                  2.0 ** -12, 2.0 ** -12 * (1 - 2.0 ** -24), 25735.0, 1e30], np.float32)


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng([ord(c) for c in name])


def f32_inputs(rng, n_bits: int = 20000) -> np.ndarray:
    """Specials, edges and their negatives, random bit patterns (every exponent), and ordinary
    values over several scales."""
    bits = rng.integers(0, 2 ** 32, n_bits, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ordinary = np.concatenate([rand_f32(rng, 2000, s) for s in (1e-3, 1.0, 10.0, 100.0)])
    return np.ascontiguousarray(np.concatenate([SPECIAL_F32, EDGES, -EDGES, bits, ordinary]).astype(np.float32))


def bf16_with_specials(rng, shape, scale=1.0, frac=0.05):
    a = rand_bf16(rng, shape, scale)
    return sprinkle(rng, a, SPECIAL_BF16, frac) if a.size else a


def f32_with_specials(rng, shape, scale=1.0, frac=0.05):
    return sprinkle(rng, rand_f32(rng, shape, scale), SPECIAL_F32, frac)


def run_kernel(file: str, kernel: str, n: int, *args, directory=None):
    """Launch a kernel of a .cu file directly (1-D, 128 threads a block) on device copies of the
    numpy arguments; returns the arguments back on the host."""
    dev = [cu._dev(a) if isinstance(a, np.ndarray) else a for a in args]
    runtime.load(file, directory).get_function(kernel)(((n + 127) // 128,), (128,), tuple(dev))
    return [cu._host(d) if isinstance(a, np.ndarray) else a for a, d in zip(args, dev)]


# ================================================================== math functions and conversions
FTZ_MODES = [None] + ([0, 1, 2] if HAVE_GXX else [])


@pytest.mark.parametrize("ftz", FTZ_MODES, ids=lambda m: "default" if m is None else f"emu-ftz{m}")
def test_math_functions(ftz):
    """Every §4 function on ~30k inputs per function; with each emulated flush mode of the
    single-precision intrinsics (IEEE, FTZ after rounding, FTZ before rounding) as well: the
    contract helpers must not depend on the hardware's flush mode."""
    x = f32_inputs(rng_for("math"))
    ctx = runtime.emulate() if ftz is not None else _nullctx()
    with ctx, emu.options(ftz=ftz):
        for name in ref.FUNCTIONS:
            assert_bits_equal(getattr(cu, name)(x), getattr(ref, name)(x), name)


class _nullctx:
    def __enter__(self): return self
    def __exit__(self, *a): return False


def tiny_product_pairs(rng, n=3000):
    """(a, b) whose exact product or quotient lies within a few ulps of 2^-126: the flush-before-
    rounding rule's only ambiguous case."""
    a = (1.0 + rng.random(n) * 0.999).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, n).astype(np.float32)
    b = (np.float64(2.0 ** -126) / a.astype(np.float64)).astype(np.float32)
    step = rng.integers(-3, 4, n).astype(np.int32)
    b = (b.view(np.int32) + step).view(np.float32)
    sign = rng.choice(np.array([1.0, -1.0], np.float32), n)
    return (a * sign).astype(np.float32), b


# The primitives' results as they return them, without o1b_store: a primitive must flush its own
# result (§3), and a flushing store would hide one that does not. (o1b_binary in mathfn.cu stores.)
PRIM_RAW_SRC = """#include "contract.cuh"
extern "C" __global__ void o1b_binary_raw(int op, i64 n, const float *a, const float *b, float *y) {
    i64 i = o1b_gid();
    if (i >= n) return;
    float x = o1b_load(a[i]), z = o1b_load(b[i]), r;
    switch (op) {
    case 0: r = o1b_add(x, z); break;
    case 1: r = o1b_sub(x, z); break;
    case 2: r = o1b_mul(x, z); break;
    case 3: r = o1b_div(x, z); break;
    default: r = o1b_sqrt(x); break;
    }
    y[i] = r;
}
"""


@pytest.mark.parametrize("ftz", FTZ_MODES, ids=lambda m: "default" if m is None else f"emu-ftz{m}")
def test_primitive_ops_tiny_results(ftz):
    """add/sub/mul/div/sqrt of the kernels against the C reference's scalar ops, on random bit
    patterns and on products/quotients next to 2^-126 (including the exact-product decision):
    through mathfn.cu's o1b_binary (stored results) and unstored (NaNs made canonical, nothing
    else changed)."""
    rng = rng_for("prim")
    x = f32_inputs(rng, 3000)
    y = rng.permutation(x)
    ta, tb = tiny_product_pairs(rng)
    qa = (tb * np.float32(1.0)).astype(np.float32)   # a/b near 2^-126: a = 2^-126 * b' ...
    qb = (np.float64(1.0) / ta.astype(np.float64)).astype(np.float32)
    sa = (rng.uniform(-4, 4, 3000) * 2.0 ** -126).astype(np.float32)   # sums and differences near and
    sb = (sa * np.float32(-1.5)).astype(np.float32)                     # below 2^-126 (add's own flush)
    a = np.ascontiguousarray(np.concatenate([x, ta, qa, sa]))
    b = np.ascontiguousarray(np.concatenate([y, tb, qb, sb]))
    refs = (ref.mathfn.scalar_add, ref.mathfn.scalar_sub, ref.mathfn.scalar_mul, ref.mathfn.scalar_div,
            lambda u, v: ref.optim.scalar_sqrt(u))
    ctx = runtime.emulate() if ftz is not None else _nullctx()
    with ctx, emu.options(ftz=ftz):
        raw = runtime.CudaModule(runtime.read_source_text(PRIM_RAW_SRC, "prim_raw.cu"), name="prim_raw.cu")
        for op, fref in enumerate(refs):
            out = np.empty_like(a)
            (out,) = run_kernel("mathfn.cu", "o1b_binary", a.size, np.int32(op), np.int64(a.size), a, b, out)[4:]
            want = np.array([fref(float(u), float(v)) for u, v in zip(a, b)], np.float32)
            assert_bits_equal(out, want, f"binary op {op}")
            dev = [cu._dev(v) for v in (a, b, np.empty_like(a))]
            raw.get_function("o1b_binary_raw")(((a.size + 127) // 128,), (128,),
                                               (np.int32(op), np.int64(a.size), *dev))
            got = cu._host(dev[2])
            got = np.where(np.isnan(got), np.float32(np.nan), got)         # 0x7FC00000, as o1b_store
            assert_bits_equal(got, want, f"binary op {op} unstored")
    # the pairs do reach the ambiguous case: IEEE rounds some exact products below 2^-126 up to it
    exact = ta.astype(np.float64) * tb.astype(np.float64)
    assert np.any((np.abs(exact) < 2.0 ** -126) & (np.abs(ta * tb) == np.float32(2.0 ** -126)))


def test_conversions():
    rng = rng_for("conv")
    every_bf16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    assert_bits_equal(cu.bf16_to_f32(every_bf16), ref.bf16_to_f32(every_bf16), "bf16_to_f32")
    x = f32_inputs(rng, 100000)
    assert_bits_equal(cu.f32_to_bf16(x), ref.f32_to_bf16(x), "f32_to_bf16")
    x2 = x[:1001].reshape(7, 11, 13)
    assert_bits_equal(cu.f32_to_bf16(x2), ref.f32_to_bf16(x2), "f32_to_bf16 3-d")


def test_add_and_scale_inplace():
    rng = rng_for("inplace")
    a, b = f32_inputs(rng, 5000), rng.permutation(f32_inputs(rng, 5000))
    a1, a2 = a.copy(), a.copy()
    cu.add_inplace(a1, b)
    ref.add_inplace(a2, b)
    assert_bits_equal(a1, a2, "add_inplace")
    for s in (0.5, 1.0 / 3, 3.0e-39, 7.0, -0.0, np.inf):
        a1, a2 = a.copy(), a.copy()
        cu.scale_inplace(a1, s)
        ref.scale_inplace(a2, s)
        assert_bits_equal(a1, a2, f"scale_inplace({s})")


# ================================================================== linear (§6.1)
@pytest.mark.parametrize("N,K,M", [(37, 45, 29), (1, 1, 1), (3, 17, 1), (20, 0, 5), (33, 70, 18), (18, 200, 21)])
def test_linear(N, K, M):
    rng = rng_for(f"lin{N}{K}{M}")
    x, w, dy = (bf16_with_specials(rng, s) for s in ((N, K), (M, K), (N, M)))
    assert_bits_equal(cu.linear_forward(x, w), ref.linear_forward(x, w), "y")
    for a, b, what in zip(cu.linear_backward(dy, x, w), ref.linear_backward(dy, x, w), ("dx", "dw")):
        assert_bits_equal(a, b, what)
    assert cu.linear_backward(dy, x, w, need_dx=False)[0] is None


def test_linear_no_fused_multiply_add():
    """The contract's table of sequences where an FMA would differ (CONTRACT.md §6.1)."""
    bf = lambda v: ref.f32_to_bf16(np.array(v, np.float32))
    cases = [([2.0 ** -100, 2.0 ** -64], [2.0 ** -26, -(2.0 ** -64)]),
             ([2.0 ** -64], [-(2.0 ** -64)]),
             ([3.3895314e38, 2.0 ** 64], [-1.0, 2.0 ** 64])]
    for xs, ws in cases:
        x, w = bf([xs]), bf([ws])
        assert_bits_equal(cu.linear_forward(x, w), ref.linear_forward(x, w), f"fma case {xs}")


@needs_emulator
def test_gemm_under_race_check(fibers):
    """The tiled GEMM's barriers are placed right: forward and reverse thread orders agree."""
    rng = rng_for("race")
    x, w = bf16_with_specials(rng, (21, 135)), bf16_with_specials(rng, (19, 135))
    with runtime.emulate(), emu.options(race_check=True):
        assert_bits_equal(cu.linear_forward(x, w), ref.linear_forward(x, w), "y (race check)")


# ================================================================== layers (§6.2–§6.5)
def test_embedding():
    rng = rng_for("emb")
    V, C, N = 23, 19, 57
    wte = bf16_with_specials(rng, (V, C))
    tokens = rng.integers(0, V - 3, N).astype(np.int32)     # the last rows get no position
    assert_bits_equal(cu.embedding_forward(tokens, wte), ref.embedding_forward(tokens, wte), "fwd")
    dout = f32_with_specials(rng, (N, C))
    assert_bits_equal(cu.embedding_backward(tokens, dout, V), ref.embedding_backward(tokens, dout, V), "bwd")
    empty = np.zeros(0, np.int32)
    assert_bits_equal(cu.embedding_backward(empty, np.zeros((0, C), np.float32), V),
                      ref.embedding_backward(empty, np.zeros((0, C), np.float32), V), "bwd empty")


@pytest.mark.parametrize("gain", [True, False])
def test_rmsnorm(gain):
    rng = rng_for(f"rms{gain}")
    N, C = 13, 37
    x = rand_f32(rng, (N, C), 3.0)
    x[2] = sprinkle(rng, x[2], SPECIAL_F32, 0.2)
    x[5, :] = 1e-40                                   # an all-subnormal row
    x[7, :] = 0.0
    g = bf16_with_specials(rng, (C,), 1.0, 0.1) if gain else None
    for eps in (1e-5, 0.0):
        y1, r1 = cu.rmsnorm_forward(x, g, eps)
        y2, r2 = ref.rmsnorm_forward(x, g, eps)
        assert_bits_equal(y1, y2, "y")
        assert_bits_equal(r1, r2, "rstd")
    dy = f32_with_specials(rng, (N, C))
    for a, b, what in zip(cu.rmsnorm_backward(dy, x, g, r2), ref.rmsnorm_backward(dy, x, g, r2), ("dx", "dg")):
        if b is None:
            assert a is None
        else:
            assert_bits_equal(a, b, what)


def test_rope():
    rng = rng_for("rope")
    for T, D, theta in ((37, 18, 10000.0), (5, 2, 500000.0), (300, 10, 1e6)):
        for a, b in zip(cu.rope_tables(T, D, theta), ref.rope_tables(T, D, theta)):
            assert_bits_equal(a, b, f"tables T={T} D={D}")
    cos_t, sin_t = ref.rope_tables(40, 18, 10000.0)
    x = f32_with_specials(rng, (2, 37, 3, 18))
    assert_bits_equal(cu.rope_forward(x, cos_t, sin_t), ref.rope_forward(x, cos_t, sin_t), "fwd")
    assert_bits_equal(cu.rope_backward(x, cos_t, sin_t), ref.rope_backward(x, cos_t, sin_t), "bwd")


def test_swiglu():
    rng = rng_for("swiglu")
    h = f32_with_specials(rng, (11, 2 * 27), 4.0)
    h[0, :27] = np.linspace(-100, 100, 27)
    assert_bits_equal(cu.swiglu_forward(h), ref.swiglu_forward(h), "fwd")
    dout = f32_with_specials(rng, (11, 27))
    assert_bits_equal(cu.swiglu_backward(dout, h), ref.swiglu_backward(dout, h), "bwd")


# ================================================================== attention (§6.6)
ATTN_CASES = [  # B, T, H, G, D, W, specials
    (2, 150, 4, 2, 8, 0, False),    # three key blocks, the last partial
    (1, 70, 2, 1, 5, 33, False),    # window crossing a block boundary
    (1, 130, 3, 3, 4, 1, False),    # each query sees only itself
    (2, 67, 2, 1, 6, 0, True),      # special values in q, k, v, dout
    (1, 0, 2, 2, 4, 0, False),      # T = 0
]


@pytest.mark.parametrize("B,T,H,G,D,W,specials", ATTN_CASES)
def test_attention(B, T, H, G, D, W, specials):
    rng = rng_for(f"attn{B}{T}{H}{G}{D}{W}")
    frac = 0.01 if specials else 0.0
    q = bf16_with_specials(rng, (B, T, H, D), 1.0, frac) if frac else rand_bf16(rng, (B, T, H, D))
    k = bf16_with_specials(rng, (B, T, G, D), 1.0, frac) if frac else rand_bf16(rng, (B, T, G, D))
    v = bf16_with_specials(rng, (B, T, G, D), 1.0, frac) if frac else rand_bf16(rng, (B, T, G, D))
    scale = 1.0 / np.sqrt(D)
    o1, l1 = cu.attention_forward(q, k, v, W, scale)
    o2, l2 = ref.attention_forward(q, k, v, W, scale)
    assert_bits_equal(o1, o2, "o")
    assert_bits_equal(l1, l2, "lse")
    dout = f32_with_specials(rng, (B, T, H, D), 1.0, frac) if frac else rand_f32(rng, (B, T, H, D))
    for a, b, what in zip(cu.attention_backward(dout, q, k, v, o2, l2, W, scale),
                          ref.attention_backward(dout, q, k, v, o2, l2, W, scale), ("dq", "dk", "dv")):
        assert_bits_equal(a, b, what)


# ================================================================== cross-entropy (§6.8)
@pytest.mark.parametrize("N,C,V,specials", [(7, 13, 2500, False), (5, 9, 1000, True), (3, 4, 1025, False)])
def test_xent(N, C, V, specials):
    rng = rng_for(f"xent{N}{C}{V}")
    h = bf16_with_specials(rng, (N, C), 1.0, 0.03) if specials else rand_bf16(rng, (N, C))
    w = rand_bf16(rng, (V, C), 0.5)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[0] = V - 1
    for zcoef in (1e-4, 0.0):
        out1 = cu.xent_forward(h, w, targets, zcoef)
        out2 = ref.xent_forward(h, w, targets, zcoef)
        for a, b, what in zip(out1, out2, ("loss", "lse", "ce")):
            assert_bits_equal(a, b, what)
        dloss = np.full(N, 1.0 / N, np.float32)
        for a, b, what in zip(cu.xent_backward(h, w, targets, zcoef, out2[1], dloss),
                              ref.xent_backward(h, w, targets, zcoef, out2[1], dloss), ("dh", "dw")):
            assert_bits_equal(a, b, what)


# ================================================================== optimizer, reductions, random
def test_adamw():
    rng = rng_for("adamw")
    n = 1001
    p = bf16_with_specials(rng, (n,))
    m, v = f32_with_specials(rng, (n,), 1e-2), np.abs(f32_with_specials(rng, (n,), 1e-3))
    pa, ma, va = p.copy(), m.copy(), v.copy()
    pb, mb, vb = p.copy(), m.copy(), v.copy()
    for step, wd in ((1, 0.0), (2, 0.1), (3, 0.1), (1000, 0.0)):
        g = f32_with_specials(rng, (n,), 1e-2)
        cu.adamw_step(pa, g, ma, va, lr=3e-4, weight_decay=wd, step=step)
        ref.adamw_step(pb, g, mb, vb, lr=3e-4, weight_decay=wd, step=step)
        for a, b, what in ((pa, pb, "p"), (ma, mb, "m"), (va, vb, "v")):
            assert_bits_equal(a, b, f"{what} step {step}")


def test_reductions():
    rng = rng_for("reduce")
    x = f32_with_specials(rng, (2 * 4096 + 77,), 1.0, 0.0005)
    for t in (x, x[:1], x[:4096], np.zeros(0, np.float32), rand_f32(rng, (3, 1500)), np.abs(x)[:5000]):
        t = np.ascontiguousarray(t)
        assert_bits_equal(cu.sumsq_blocks(t), ref.sumsq_blocks(t), f"sumsq {t.shape}")
    for n in (0, 1, 2, 5, 6, 7, 100, 1023):
        vals = rand_f32(rng, (n,), 100.0)
        assert np.float32(cu.treefold(vals)).view(np.uint32) == np.float32(ref.treefold(vals)).view(np.uint32)
    tensors = [rand_f32(rng, (5000,)), rand_f32(rng, (7, 9)), rand_f32(rng, (4096,))]
    assert cu.global_norm(tensors) == ref.global_norm(tensors)
    for norm, mx in ((3.0, 1.0), (0.5, 1.0), (np.nan, 1.0), (0.0, 1.0), (np.inf, 1.0), (1e-39, 2.0)):
        a, b = np.float32(cu.clip_coef(norm, mx)), np.float32(ref.clip_coef(norm, mx))
        assert a.view(np.uint32) == b.view(np.uint32), (norm, mx)


def test_random():
    for seed, stream, index0, sub in ((0, 1, 0, 0), (2 ** 64 - 1, 0xFFFF, 2 ** 32 - 50, 7), (1234567, 3, 2 ** 40, 0)):
        assert np.array_equal(cu.philox_blocks(seed, stream, index0, 101, sub),
                              ref.philox_blocks(seed, stream, index0, 101, sub))
    for seed, index0 in ((42, 0), (2 ** 63 + 5, 2 ** 32 - 1000)):
        assert_bits_equal(cu.trunc_normal(seed, 1, index0, 3001), ref.trunc_normal(seed, 1, index0, 3001),
                          "trunc_normal")


# ================================================================== bad input: the same errors as cpu_ref
BAD_CALLS = [
    ("exp", lambda o: o.exp(np.zeros(3, np.float64))),
    ("linear", lambda o: o.linear_forward(np.zeros((2, 3), np.uint16), np.zeros((4, 5), np.uint16))),
    ("tokens", lambda o: o.embedding_forward(np.array([0, 9], np.int32), np.zeros((4, 2), np.uint16))),
    ("window", lambda o: o.attention_forward(*(np.zeros((1, 2, 2, 4), np.uint16),) * 3, -1, 0.5)),
    ("targets", lambda o: o.xent_forward(np.zeros((2, 3), np.uint16), np.zeros((4, 3), np.uint16),
                                         np.array([0, 4], np.int32), 1e-4)),
    ("adamw", lambda o: o.adamw_step(np.zeros(3, np.uint16), np.zeros(3, np.float32), np.zeros(3, np.float32),
                                     np.zeros(4, np.float32), lr=1e-3, step=1)),
    ("rope", lambda o: o.rope_tables(4, 3, 1e4)),
]


@pytest.mark.parametrize("what,call", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_same_error(what, call):
    with pytest.raises(ValueError) as e_ref:
        call(ref)
    with pytest.raises(ValueError) as e_cu:
        call(cu)
    assert str(e_cu.value) == str(e_ref.value)


# ================================================================== the model program on this backend
def test_model_forward_backward_equal():
    from mlx_open1b.config import ModelConfig
    from mlx_open1b.model import Model
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      ffn_hidden=48, seq_len=16, window=4)
    rng = rng_for("model")
    windows = rng.integers(0, cfg.vocab_size, (2, cfg.seq_len + 1)).astype(np.uint32)
    from mlx_open1b.model import init_params
    params = init_params(cfg, 7, ops=ref)
    assert_bits_equal(init_params(cfg, 7, ops=cu), params, "init_params")
    results = []
    for ops in (cu, ref):
        model = Model(cfg, ops=ops)
        loss, ce, zl, cache = model.forward(params, windows)
        results.append((loss, ce, zl, model.backward(params, cache)))
    assert results[0][:3] == results[1][:3]
    assert_bits_equal(results[0][3], results[1][3], "gradient")


# ================================================================== device arrays: cupy in, cupy out
_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
             "Please use `.get()` to construct a NumPy array explicitly.")     # cupy's own message


def _unwrap(x):
    return x._a if isinstance(x, FakeCupyArray) else x


def _unwrap_key(key):
    return tuple(_unwrap(k) for k in key) if isinstance(key, tuple) else _unwrap(key)


class _Flags:
    """cupy's ndarray.flags: c_contiguous, f_contiguous, owndata (no writeable)."""

    def __init__(self, a: np.ndarray):
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = bool(a.flags.owndata)


class FakeCupyArray:
    """A stand-in for a cupy array where there is none: an object (not an np.ndarray) holding the
    numpy memory the emulator runs on, that mlx_open1b.arrays.kind reports as cupy by the same test
    it applies to real cupy arrays (a module named cupy*, __cuda_array_interface__).

    Strict like cupy: no implicit conversion to numpy — np.asarray / np.array / numpy setitem
    (`host[...] = dev`) raise cupy's TypeError (__array__ refuses), there is no buffer protocol
    (memoryview, np.frombuffer), and numpy functions and ufuncs on it raise. Stricter than cupy
    where cupy would run host code on a device value (so the ops must name their array module,
    arrays.module / ops._xp): numpy functions and ufuncs are refused rather than dispatched,
    Python arithmetic, comparisons, bool(), index(), .item(), .tolist() and .tobytes() raise.
    What cupy allows and the ops use: .shape .size .ndim .dtype .flags.c_contiguous, views that
    share memory (.reshape .view .ravel, basic indexing — 0-d arrays, never scalars), .copy
    .astype .min .max (0-d), setitem from device arrays, Python scalars or numpy arrays (a
    host-to-device copy, as cupy.ndarray.__setitem__ does), int()/float() of a 0-d array (a sync),
    and the explicit host copy .get()."""

    __module__ = "cupy._fake"          # arrays.kind: type(a).__module__ starts with "cupy"
    __slots__ = ("_a",)
    __array_ufunc__ = None             # numpy ufuncs and numpy binary operators refuse it
    __hash__ = None                    # as cupy.ndarray

    def __init__(self, a: np.ndarray):
        assert type(a) is np.ndarray, type(a)
        self._a = a

    # ---- what cupy.ndarray has and the backend uses
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    dtype = property(lambda self: self._a.dtype)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr, "version": 3,
                "data": (self._a.ctypes.data, False),
                "strides": None if self._a.flags.c_contiguous else self.strides}

    def reshape(self, *shape, order="C"):
        return FakeCupyArray(self._a.reshape(*shape, order=order))

    def view(self, dtype=None):
        return FakeCupyArray(self._a.view() if dtype is None else self._a.view(dtype))

    def ravel(self, order="C"):
        return FakeCupyArray(self._a.ravel(order))

    def copy(self, order="C"):
        return FakeCupyArray(self._a.copy(order))

    __copy__ = copy

    def __deepcopy__(self, memo):
        return self.copy()

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        out = self._a.astype(dtype, order=order, copy=copy)
        return self if out is self._a else FakeCupyArray(out)

    def min(self, axis=None):
        return FakeCupyArray(np.asarray(self._a.min(axis)))

    def max(self, axis=None):
        return FakeCupyArray(np.asarray(self._a.max(axis)))

    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        """The explicit device-to-host copy."""
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def __getitem__(self, key):
        key = _unwrap_key(key)
        out = self._a[key]
        if not isinstance(out, np.ndarray):          # integers only: cupy gives a 0-d view, not a scalar
            out = self._a[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
        return FakeCupyArray(out)

    def __setitem__(self, key, value):
        self._a[_unwrap_key(key)] = _unwrap(value)   # a numpy value is a host-to-device copy (cupy allows it)

    def __len__(self):
        if not self.ndim:
            raise TypeError("len() of unsized object")
        return len(self._a)

    def __iter__(self):
        if not self.ndim:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self._a)))

    def _scalar(self, convert):
        if self.ndim:
            raise TypeError(f"only 0-d device arrays convert to Python scalars (got shape {self.shape})")
        return convert(self._a[()])

    def __int__(self):
        return self._scalar(int)

    def __float__(self):
        return self._scalar(float)

    def __repr__(self):
        return f"FakeCupyArray({self._a!r})"

    # ---- refused: implicit conversion to numpy, numpy functions, host values of device data
    def __array__(self, dtype=None, copy=None):
        raise TypeError(_IMPLICIT)

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} applied to a device array (name the array module: "
                        "arrays.module(kind) or the backend's _xp())")

    def _refuse(self, *_, **__):
        raise TypeError("a host value of a device array without .get() (an implicit device-to-host copy)")

    __bool__ = __index__ = __eq__ = __ne__ = item = tolist = tobytes = _refuse


def _fake_cupy_module():
    """The part of cupy's namespace the backend and mlx_open1b.arrays use, on FakeCupyArray; what
    real cupy refuses (concatenating or making contiguous numpy arrays) it refuses too."""
    def device_only(name, a):
        if not isinstance(a, FakeCupyArray):
            raise TypeError(f"cupy.{name}: expected a cupy array, got {type(a).__name__}")
        return a._a

    def asarray(a, dtype=None, order=None):
        if isinstance(a, FakeCupyArray):
            return a.astype(dtype, copy=False) if dtype is not None else a
        return FakeCupyArray(np.array(a, dtype, copy=True, order=order or "K"))      # host -> device

    def array(a, dtype=None, copy=True, order="K", ndmin=0):
        if isinstance(a, FakeCupyArray) and not copy:
            return asarray(a, dtype)
        return FakeCupyArray(np.array(_unwrap(a), dtype, copy=True, order=order, ndmin=ndmin))

    def ascontiguousarray(a, dtype=None):
        host = device_only("ascontiguousarray", a)
        if host.flags.c_contiguous and (dtype is None or np.dtype(dtype) == host.dtype):
            return a
        return FakeCupyArray(np.ascontiguousarray(host, dtype))

    def concatenate(arrs, axis=0, out=None, dtype=None):
        if out is not None:
            raise NotImplementedError("concatenate(out=...) in the cupy stand-in")
        return FakeCupyArray(np.concatenate([device_only("concatenate", a) for a in arrs], axis=axis, dtype=dtype))

    m = types.ModuleType("cupy")
    m.ndarray = FakeCupyArray
    m.asarray, m.array, m.ascontiguousarray, m.concatenate = asarray, array, ascontiguousarray, concatenate
    m.empty = lambda shape, dtype=float, order="C": FakeCupyArray(np.empty(shape, dtype, order))
    m.zeros = lambda shape, dtype=float, order="C": FakeCupyArray(np.zeros(shape, dtype, order))
    m.dtype = np.dtype
    for name in ("bool_", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", "float32", "float64"):
        setattr(m, name, getattr(np, name))
    return m


@pytest.fixture
def fake_gpu(monkeypatch):
    """The backend as on a GPU (inputs copied to 'device' arrays, results left there or copied
    back) with FakeCupyArray as the device arrays and the kernels still on the emulator. A launch
    passes the emulator each device array's own memory (so the kernel's writes land in it) and,
    as cupy does, refuses a numpy array argument (a host array the op forgot to copy to the
    device)."""
    fake = _fake_cupy_module()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cu, "_xp", lambda: fake)
    launch = emu.EmuFunction.__call__

    def device_launch(self, grid, block, args, shared_mem=0):
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                raise TypeError(f"{self.kernel}: argument {i} is a numpy array; a cupy kernel takes "
                                "device arrays (a missing _dev?)")
        return launch(self, grid, block, tuple(_unwrap(a) for a in args), shared_mem)

    monkeypatch.setattr(emu.EmuFunction, "__call__", device_launch)
    with runtime.emulate():        # on a GPU machine too: the stand-in's memory is host memory
        yield fake


def _device_cases(rng):
    """(name, call(ops, to_dev)) for a spread of ops; to_dev maps a numpy input to the kind under test."""
    N, K, M, V, C = 9, 37, 21, 1500, 11
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K)), rand_bf16(rng, (N, M))
    tokens = rng.integers(0, 17, 29).astype(np.int32)
    wte, dout_e = rand_bf16(rng, (19, C)), rand_f32(rng, (29, C))
    xf, g = rand_f32(rng, (N, K), 3.0), rand_bf16(rng, (K,))
    rstd = ref.rmsnorm_forward(xf, g, 1e-5)[1]
    cos_t, sin_t = ref.rope_tables(13, 6, 10000.0)
    xr = rand_f32(rng, (2, 13, 3, 6))
    hs = rand_f32(rng, (N, 2 * 10), 4.0)
    B, T, H, G, D, W = 1, 70, 2, 1, 5, 33
    q, k, v = rand_bf16(rng, (B, T, H, D)), rand_bf16(rng, (B, T, G, D)), rand_bf16(rng, (B, T, G, D))
    o, lse_a = ref.attention_forward(q, k, v, W, 0.5)
    dout_a = rand_f32(rng, (B, T, H, D))
    h, wv = rand_bf16(rng, (N, C)), rand_bf16(rng, (V, C))
    targets = rng.integers(0, V, N).astype(np.int32)
    lse_x, dloss = ref.xent_forward(h, wv, targets, 1e-4)[1], rand_f32(rng, (N,), 0.1)
    a8, b8 = rng.integers(-127, 128, (N, K)).astype(np.int8), rng.integers(-127, 128, (M, K)).astype(np.int8)
    fh = rand_f32(rng, (128, 5))
    big = rand_f32(rng, (5000,))
    tensors = [big, rand_f32(rng, (7, 9)), rand_f32(rng, (4096,))]
    fa, fb = rand_f32(rng, (1001,)), rand_f32(rng, (1001,))
    p, m, vv = rand_bf16(rng, (1001,)), rand_f32(rng, (1001,), 1e-2), np.abs(rand_f32(rng, (1001,), 1e-3))
    return [
        ("exp", lambda o_, d: o_.exp(d(fa))),
        ("f32_to_bf16", lambda o_, d: o_.f32_to_bf16(d(xf))),
        ("bf16_to_f32", lambda o_, d: o_.bf16_to_f32(d(x))),
        ("linear_forward", lambda o_, d: o_.linear_forward(d(x), d(w))),
        ("linear_backward", lambda o_, d: o_.linear_backward(d(dy), d(x), d(w))),
        ("linear_backward dw only", lambda o_, d: o_.linear_backward(d(dy), d(x), d(w), need_dx=False)),
        ("embedding_forward", lambda o_, d: o_.embedding_forward(d(tokens), d(wte))),
        ("embedding_backward", lambda o_, d: o_.embedding_backward(d(tokens), d(dout_e), 19)),
        ("rmsnorm_forward", lambda o_, d: o_.rmsnorm_forward(d(xf), d(g), 1e-5)),
        ("rmsnorm_backward", lambda o_, d: o_.rmsnorm_backward(d(xf), d(xf), d(g), d(rstd))),
        ("rmsnorm_backward no gain", lambda o_, d: o_.rmsnorm_backward(d(xf), d(xf), None, d(rstd))),
        ("rope_forward", lambda o_, d: o_.rope_forward(d(xr), d(cos_t), d(sin_t))),
        ("swiglu_backward", lambda o_, d: o_.swiglu_backward(d(hs[:, :10].copy()), d(hs))),
        ("attention_forward", lambda o_, d: o_.attention_forward(d(q), d(k), d(v), W, 0.5)),
        ("attention_forward_i8", lambda o_, d: o_.attention_forward_i8(d(q), d(k), d(v), W, 0.5)),
        ("attention_backward", lambda o_, d: o_.attention_backward(d(dout_a), d(q), d(k), d(v), d(o), d(lse_a), W, 0.5)),
        ("xent_forward", lambda o_, d: o_.xent_forward(d(h), d(wv), d(targets), 1e-4)),
        ("xent_backward", lambda o_, d: o_.xent_backward(d(h), d(wv), d(targets), 1e-4, d(lse_x), d(dloss))),
        ("quant_weight_rows", lambda o_, d: o_.quant_weight_rows(d(w))),
        ("quant_tensor", lambda o_, d: o_.quant_tensor(d(xf))),
        ("gemm_i8", lambda o_, d: o_.gemm_i8(d(a8), d(b8))),
        ("hadamard_rows", lambda o_, d: o_.hadamard_rows(d(fh))),
        ("qlinear_forward", lambda o_, d: o_.qlinear_forward(d(x), d(w))),
        ("qlinear_backward", lambda o_, d: o_.qlinear_backward(d(dy), d(x), d(w))),
        ("qlinear_backward int4", lambda o_, d: o_.qlinear_backward(d(dy), d(x), d(w), qmax=7)),
        ("sumsq_blocks", lambda o_, d: o_.sumsq_blocks(d(big))),
        ("treefold", lambda o_, d: o_.treefold(d(fa[:100]))),
        ("global_norm", lambda o_, d: o_.global_norm([d(t) for t in tensors])),
        ("add", lambda o_, d: o_.add(d(fa), d(fb))),
        ("scale", lambda o_, d: o_.scale(d(fa), 1.0 / 3)),
        ("adamw", lambda o_, d: o_.adamw(d(p), d(fa), d(m), d(vv), lr=3e-4, weight_decay=0.1, step=3)),
    ]


def _leaves(result):
    return [u for r in result for u in _leaves(r)] if isinstance(result, tuple) else [result]


def _same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if b.dtype.itemsize in (2, 4):
        assert_bits_equal(a, b, what)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), what


def _check_device_case(name, call, to_dev, device_kind):
    """call on device inputs: every array result of device_kind and bit-equal to cpu_ref's on numpy
    inputs, float results floats; the inputs unchanged (the functional ops copy)."""
    inputs = []

    def d(a):
        inputs.append((a.copy(), to_dev(a)))
        return inputs[-1][1]
    got, want = _leaves(call(cu, d)), _leaves(call(ref, lambda a: a))
    assert len(got) == len(want), name
    for i, (a, b) in enumerate(zip(got, want)):
        what = f"{name} result {i}"
        if b is None:
            assert a is None, what
        elif isinstance(b, float):
            assert type(a) is float and np.float32(a).view(np.uint32) == np.float32(b).view(np.uint32), what
        elif isinstance(b, np.generic):      # quant_tensor's scale: a 0-d array of the kind given
            if device_kind == arrays.NUMPY:
                assert type(a) is type(b), what
            else:
                assert arrays.kind(a) == device_kind and a.shape == (), what
                a = arrays.to_host(a)
            _same_bits(np.asarray(a), np.asarray(b), what)
        else:
            assert arrays.kind(a) == device_kind, f"{what}: {type(a).__name__}"
            assert arrays.dtype(a) == b.dtype, what
            _same_bits(arrays.to_host(a), b, what)
    for before, dev in inputs:
        _same_bits(arrays.to_host(dev), before, f"{name}: an input changed")


def test_fake_cupy_array_is_strict(fake_gpu):
    """The stand-in refuses, as cupy does, every implicit conversion to numpy (and, stricter than
    cupy, numpy functions and host arithmetic on it), so an op that slips one in fails here."""
    a = fake_gpu.asarray(np.arange(4, dtype=np.float32))
    assert not isinstance(a, np.ndarray)
    assert arrays.kind(a) == arrays.CUPY and arrays.any_device([[a]]) == arrays.CUPY   # the real kind()
    host = np.zeros(4, np.float32)

    def setitem(target, key, value):
        target[key] = value

    refused = {
        "np.asarray": lambda: np.asarray(a), "np.array": lambda: np.array(a),
        "np.array of a list": lambda: np.array([a, a]), "np.asarray dtype": lambda: np.asarray(a, np.float64),
        "np.ascontiguousarray": lambda: np.ascontiguousarray(a), "memoryview": lambda: memoryview(a),
        "bytes": lambda: bytes(a), "np.frombuffer": lambda: np.frombuffer(a, np.float32),
        "host[...] = dev": lambda: setitem(host, Ellipsis, a), "host[:2] = dev[:2]": lambda: setitem(host, slice(0, 2), a[:2]),
        "host[1:2] = dev 0-d": lambda: setitem(host, slice(1, 2), a[1]), "np.copyto": lambda: np.copyto(host, a),
        "ufunc": lambda: np.add(a, 1), "ufunc on 0-d": lambda: np.exp(a[0]), "ufunc out=": lambda: np.add(host, host, out=a),
        "np.concatenate": lambda: np.concatenate([a, a]), "np.sum": lambda: np.sum(a), "np.ndim": lambda: np.ndim(a),
        "dev + 1": lambda: a + 1, "1.0 + dev": lambda: 1.0 + a, "host + dev": lambda: host + a,
        "np.float32 * dev": lambda: np.float32(2) * a, "dev == dev": lambda: a == a[:], "dev < 1": lambda: a < 1,
        "bool": lambda: bool(a[0]), "float of 1-d": lambda: float(a), "int of 1-d": lambda: int(a[:1]),
        "index": lambda: [0, 1][a[1]], "tobytes": lambda: a.tobytes(), "item": lambda: a.item(),
        "tolist": lambda: a.tolist(), "cupy.concatenate with numpy": lambda: fake_gpu.concatenate([a, host]),
        "cupy.ascontiguousarray of numpy": lambda: fake_gpu.ascontiguousarray(host),
    }
    for what, bad in refused.items():
        with pytest.raises(TypeError):
            bad()
            pytest.fail(f"{what} was allowed")
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    assert not host.any() and a.get().tolist() == [0, 1, 2, 3]
    assert type(arrays.to_host(a)) is np.ndarray and type(arrays.concat([a, a])) is FakeCupyArray
    assert type(cu.to_device(np.zeros(3, np.float32))) is FakeCupyArray
    assert type(cu.to_host(a)) is np.ndarray


def test_fake_cupy_array_allows_what_cupy_allows(fake_gpu):
    """Views share the device memory, copies do not, indexing gives 0-d arrays, setitem takes
    device arrays, Python scalars and numpy arrays (a host-to-device copy), int()/float() of 0-d."""
    h = np.arange(4, dtype=np.float32)
    a = fake_gpu.asarray(h)
    h[0] = -1                                        # asarray copied the host array
    assert fake_gpu.asarray(a) is a and fake_gpu.ascontiguousarray(a) is a
    assert type(a[1]) is FakeCupyArray and a[1].shape == () and a[..., 1].shape == ()
    assert float(a[3]) == 3.0 and int(a.min()) == 0 and int(a.max()) == 3 and len(a) == 4
    host = np.zeros(2, np.float32)
    host[1] = a[3]                                   # numpy converts one element by float(): cupy syncs
    assert host.tolist() == [0, 3]
    a[1] = 7
    a[2:] = np.array([8, 9], np.float32)
    a[0] = a[3]
    a.reshape(2, 2)[1, 0] = 10                       # a view: the write lands in a
    a.ravel()[3] = 11
    a[1][...] = 12                                   # a 0-d view
    assert a.get().tolist() == [9, 12, 10, 11] and [float(x) for x in a] == [9, 12, 10, 11]
    g = a.get()
    g[0] = -1
    c = a.copy()
    c[0] = -2
    assert a.get()[0] == 9
    assert a.view(np.uint32).dtype == np.uint32 and arrays.to_host(a.view(np.uint32))[0] == np.float32(9).view(np.uint32)
    assert a.astype(np.float64).dtype == np.float64 and a.reshape(2, 2).flags.c_contiguous
    assert not a.reshape(2, 2)[:, 0].flags.c_contiguous and arrays.contiguous(a.reshape(2, 2)[:, 0]).flags.c_contiguous
    assert a.__cuda_array_interface__["shape"] == (4,)
    assert arrays.dtype(a) == np.float32 and arrays.c_contiguous(a) and arrays.is_device(a)


@needs_emulator
def test_fake_gpu_kernel_launches(fake_gpu):
    """A launch on the stand-in writes the device array's own memory, and refuses a numpy array
    argument as cupy does (an op that forgot to copy an input to the device fails here)."""
    fn = runtime.load("mathfn.cu").get_function("o1b_add_inplace")
    a, b = fake_gpu.zeros(5, np.float32), fake_gpu.asarray(np.arange(5, dtype=np.float32))
    view = a.reshape(5)
    fn((1,), (128,), (np.int64(5), view, b))
    assert a.get().tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match="numpy array"):
        fn((1,), (128,), (np.int64(5), a, np.arange(5, dtype=np.float32)))


@needs_emulator
def test_device_arrays_in_device_arrays_out(fake_gpu):
    """Device mode without a GPU: every op given (fake) cupy arrays returns cupy arrays, copies
    nothing to the host on the way (FakeCupyArray refuses it) and gives cpu_ref's bits."""
    for name, call in _device_cases(rng_for("device")):
        _check_device_case(name, call, fake_gpu.asarray, arrays.CUPY)


@needs_emulator
def test_numpy_in_numpy_out_through_device_copies(fake_gpu):
    """The same ops given numpy arrays on a (fake) GPU: inputs copied to the device, numpy out."""
    for name, call in _device_cases(rng_for("device")):
        _check_device_case(name, call, lambda a: a, arrays.NUMPY)


@needs_emulator
def test_mixed_kinds_give_device_arrays(fake_gpu):
    """An op given numpy and cupy arguments together works on the device (its numpy arguments are
    moved up) and returns cupy arrays: nested calls (global_norm's partials) and the functional
    ops (add with a numpy left operand) included."""
    rng = rng_for("device mixed")
    a, b = rand_f32(rng, (5000,)), rand_f32(rng, (33, 7))
    assert cu.global_norm([fake_gpu.asarray(a), b]) == ref.global_norm([a, b])
    c = rand_f32(rng, (5000,))
    got = cu.add(a, fake_gpu.asarray(c))
    assert type(got) is FakeCupyArray
    assert_bits_equal(arrays.to_host(got), ref.add(a, c), "add(numpy, cupy)")
    x, w = rand_bf16(rng, (9, 64)), rand_bf16(rng, (17, 64))
    y = cu.qlinear_forward(fake_gpu.asarray(x), w)
    assert type(y) is FakeCupyArray
    assert_bits_equal(arrays.to_host(y), ref.qlinear_forward(x, w), "qlinear_forward(cupy, numpy)")


@needs_emulator
def test_inplace_ops_on_device_arrays(fake_gpu):
    """add_inplace, scale_inplace and adamw_step write device arrays in place (no copy back), and
    numpy arrays through a device copy; mixed kinds work."""
    rng = rng_for("device inplace")
    a, b = rand_f32(rng, (777,)), rand_f32(rng, (777,))
    want = a.copy()
    ref.add_inplace(want, b)
    ref.scale_inplace(want, 0.3)
    for da, db in ((fake_gpu.asarray(a), fake_gpu.asarray(b)), (a.copy(), b), (a.copy(), fake_gpu.asarray(b))):
        cu.add_inplace(da, db)
        cu.scale_inplace(da, 0.3)
        assert_bits_equal(arrays.to_host(da), want, f"{type(da).__name__} += {type(db).__name__}")
    p, g = rand_bf16(rng, (301,)), rand_f32(rng, (301,), 1e-2)
    m, v = rand_f32(rng, (301,), 1e-2), np.abs(rand_f32(rng, (301,), 1e-3))
    pw, mw, vw = p.copy(), m.copy(), v.copy()
    ref.adamw_step(pw, g, mw, vw, lr=1e-3, weight_decay=0.1, step=2)
    dp, dm, dv = (fake_gpu.asarray(t) for t in (p, m, v))
    cu.adamw_step(dp, fake_gpu.asarray(g), dm, dv, lr=1e-3, weight_decay=0.1, step=2)
    for got, w_, what in ((dp, pw, "p"), (dm, mw, "m"), (dv, vw, "v")):
        assert type(got) is FakeCupyArray
        assert_bits_equal(arrays.to_host(got), w_, what)


@pytest.mark.skipif(not runtime.real_cuda(), reason="needs CuPy and a CUDA device")
def test_cupy_arrays_in_cupy_arrays_out():
    """On a GPU: the ops on real cupy arrays return cupy arrays with cpu_ref's bits."""
    import cupy
    for name, call in _device_cases(rng_for("device")):
        _check_device_case(name, call, cupy.asarray, arrays.CUPY)


# ================================================================== compile checks (nvcc)
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles_every_source(arch, tmp_path):
    """Each module text, exactly as handed to NVRTC, compiles to PTX with CuPy's flush mode and our
    options, and the PTX holds no fused multiply-add on fp32 but linear.cu's explicit fma.rn.ftz.f32
    steps (the FMA tile guard's fast path, CONTRACT.md §6.1)."""
    procs = []
    for name in CU_FILES:
        src = tmp_path / name
        src.write_text(runtime.read_source(name))
        procs.append((name, subprocess.Popen(
            [NVCC, "--ptx", f"-arch={arch}", "-ftz=true", *runtime.OPTIONS, str(src), "-o",
             str(tmp_path / f"{name}.ptx")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for name, proc in procs:
        out, _ = proc.communicate()
        assert proc.returncode == 0, f"{name} ({arch}):\n{out}"
        ptx = (tmp_path / f"{name}.ptx").read_text()
        if name == "linear.cu":   # the guarded fast path's FMA, written as inline PTX (o1b_fma_ftz)
            ptx, n = re.subn(r"// begin inline asm\s*fma\.rn\.ftz\.f32[^\n]*\n\s*// end inline asm", "", ptx)
            assert n >= 64, f"linear.cu: {n} FMA steps in the PTX"
        assert "fma.rn.f32" not in ptx and "fma.rn.ftz.f32" not in ptx, f"{name}: FMA in the PTX"


# ================================================================== the emulator itself
BARRIER_SRC = r'''
#include "contract.cuh"
/* Block-wide pairwise sum in shared memory: out[block] = ((x0+x1)+(x2+x3))+... for 64 threads.
 * Every step reads values written by other threads in the previous step. */
extern "C" __global__ void block_sum(const float *x, float *out) {
    __shared__ float buf[64];
    const int t = threadIdx.x;
    buf[t] = x[blockIdx.x * 64 + t];
    BARRIER
    for (int s = 1; s < 64; s *= 2) {
        float mine = buf[t];
        float other = (t % (2 * s) == 0) ? buf[t + s] : 0.0f;
        BARRIER
        if (t % (2 * s) == 0) buf[t] = o1b_add(mine, other);
        BARRIER
    }
    if (t == 0) out[blockIdx.x] = buf[0];
}
/* out[t] = x[t+1 mod n]: a rotation through shared memory. */
extern "C" __global__ void rotate(const float *x, float *out) {
    __shared__ float buf[64];
    const int t = threadIdx.x;
    buf[t] = x[t];
    BARRIER
    out[t] = buf[(t + 1) % 64];
}
extern "C" __global__ void diverge(float *out) {
    if (threadIdx.x == 3) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
'''


@pytest.fixture(params=[False, True], ids=["fast-switch", "ucontext"])
def fibers(request):
    """Both fiber implementations of the emulator (the x86-64 stack switch, where available, and
    ucontext's swapcontext)."""
    with emu.options(ucontext=request.param):
        yield request.param


def _emu_module(src: str, name: str, directory=runtime.SOURCE_DIR):
    return emu.EmuModule(runtime.read_source_text(src, name, directory), name=name)


def _pairwise(v: np.ndarray) -> np.float32:
    v = list(v.astype(np.float32))
    while len(v) > 1:
        v = [np.float32(v[i] + v[i + 1]) for i in range(0, len(v), 2)]
    return v[0]


@needs_emulator
def test_barrier_emulation_right_placement(fibers):
    x = rand_f32(rng_for("barrier"), (3 * 64,))
    mod = _emu_module(BARRIER_SRC.replace("BARRIER", "__syncthreads();"), "barrier_ok.cu")
    out = np.zeros(3, np.float32)
    with emu.options(race_check=True):
        mod.get_function("block_sum")((3,), (64,), (x, out))
    assert_bits_equal(out, np.array([_pairwise(x[64 * b:64 * b + 64]) for b in range(3)]), "block sums")
    rot = np.zeros(64, np.float32)
    with emu.options(race_check=True):
        mod.get_function("rotate")((1,), (64,), (x[:64].copy(), rot))
    assert_bits_equal(rot, np.roll(x[:64], -1), "rotate")


@needs_emulator
def test_missing_barrier_is_detected(fibers):
    x = rand_f32(rng_for("nobarrier"), (64,))
    mod = _emu_module(BARRIER_SRC.replace("BARRIER", "").replace("diverge", "diverge_unused"),
                      "barrier_missing.cu")
    rot = np.zeros(64, np.float32)
    mod.get_function("rotate")((1,), (64,), (x, rot))            # plain run: a wrong result ...
    assert not np.array_equal(rot, np.roll(x, -1))
    with emu.options(race_check=True), pytest.raises(emu.EmuRaceError, match="rotate"):
        mod.get_function("rotate")((1,), (64,), (x, rot))         # ... and the race check names it
    out = np.zeros(1, np.float32)
    with emu.options(race_check=True), pytest.raises(emu.EmuRaceError, match="block_sum"):
        mod.get_function("block_sum")((1,), (64,), (x, out))


@needs_emulator
def test_barrier_divergence_is_an_error(fibers):
    mod = _emu_module(BARRIER_SRC.replace("BARRIER", "__syncthreads();"), "barrier_ok.cu")
    with pytest.raises(emu.EmuLaunchError, match="barrier divergence"):
        mod.get_function("diverge")((1,), (32,), (np.zeros(32, np.float32),))


@needs_emulator
def test_compile_error_names_file_and_kernel():
    src = '#include "contract.cuh"\nextern "C" __global__ void o1b_broken(float *y) {\n  y[0] = o1b_add(y[0]);\n}\n'
    with runtime.emulate(), pytest.raises(runtime.KernelCompileError) as e:
        runtime.CudaModule(runtime.read_source_text(src, "broken.cu"), name="broken.cu")
    msg = str(e.value)
    assert "broken.cu" in msg and "o1b_broken" in msg and "error" in msg, msg
    assert "broken.cu:3" in msg, msg     # the #line markers point at the file's own line


@needs_emulator
def test_argument_types_are_checked():
    fn = runtime.load("mathfn.cu").get_function("o1b_scale_inplace") if not runtime.real_cuda() else None
    if fn is None:
        with runtime.emulate():
            fn = runtime.load("mathfn.cu").get_function("o1b_scale_inplace")
    a = np.ones(4, np.float32)
    with pytest.raises(emu.EmuLaunchError, match="int64"):
        fn((1,), (32,), (4, a, np.float32(2.0)))          # a Python int where the kernel takes i64
    with pytest.raises(emu.EmuLaunchError, match="float32"):
        fn((1,), (32,), (np.int64(4), a, 2.0))            # a Python float where it takes float


MUTATIONS = [  # (file, original, mutated, function whose bits must change): one constant, one ulp
    ("contract.cuh", "p = o1b_add(o1b_mul(p, r), 0x1p-1f);", "p = o1b_add(o1b_mul(p, r), 0x1.000002p-1f);", "exp"),
    ("contract.cuh", "p = o1b_add(o1b_mul(p, z), -0x1.555556p-3f);", "p = o1b_add(o1b_mul(p, z), -0x1.555558p-3f);", "sin"),
    ("contract.cuh", "p = o1b_add(o1b_mul(p, z), -0x1p-1f);", "p = o1b_add(o1b_mul(p, z), -0x1.000002p-1f);", "cos"),
]


@needs_emulator
@pytest.mark.parametrize("file,old,new,fn", MUTATIONS, ids=[m[3] for m in MUTATIONS])
def test_planted_one_ulp_mutation_is_caught(tmp_path, file, old, new, fn):
    """A copy of the sources with one constant moved by one ulp disagrees with cpu_ref, and the
    unmutated copy agrees: the comparison is sharp enough to catch it."""
    for p in runtime.SOURCE_DIR.glob("*.cu*"):
        shutil.copy(p, tmp_path / p.name)
    text = (tmp_path / file).read_text()
    assert text.count(old) == 1
    x = f32_inputs(rng_for("mutation"), 20000)
    want = getattr(ref, fn)(x)
    op = ref.FUNCTIONS.index(fn)
    with runtime.emulate():
        y = np.empty_like(x)
        run_kernel("mathfn.cu", "o1b_map", x.size, np.int32(op), np.int64(x.size), x, y, directory=tmp_path)
        assert_bits_equal(y, want, "unmutated copy")
        (tmp_path / file).write_text(text.replace(old, new))
        mutated = tmp_path / "mutated"
        mutated.mkdir()
        for p in tmp_path.glob("*.cu*"):
            shutil.copy(p, mutated / p.name)
        y = np.empty_like(x)
        run_kernel("mathfn.cu", "o1b_map", x.size, np.int32(op), np.int64(x.size), x, y, directory=mutated)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_bits_equal(y, want, f"mutated {fn}")


@needs_emulator
def test_compiled_library_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = runtime.read_source_text(
        '#include "contract.cuh"\n/* cache test %s */\nextern "C" __global__ void k(float *y) { y[threadIdx.x] = o1b_exp(y[threadIdx.x]); }\n'
        % tmp_path.name, "cache_test.cu")
    m1 = emu.EmuModule(src, name="cache_test.cu")
    assert m1.path.parent == tmp_path / "mlx-open1b" / "emu" and m1.path.exists()
    emu._loaded.clear()                       # a new process: only the disk cache remains

    def no_compiler(*a, **k):
        raise AssertionError("g++ was run although the library is cached")
    monkeypatch.setattr(emu.subprocess, "run", no_compiler)
    m2 = emu.EmuModule(src, name="cache_test.cu")
    assert m2.path == m1.path
    y = np.zeros(4, np.float32)
    m2.get_function("k")((1,), (4,), (y,))
    assert_bits_equal(y, np.ones(4, np.float32), "exp(0)")


@needs_emulator
@pytest.mark.parametrize("which", [0, 1], ids=["after-load", "after-use"])
def test_gemm_with_a_barrier_removed_is_caught(tmp_path, which, fibers):
    """linear.cu's tiled GEMM with one of its two __syncthreads deleted: the race check (or a
    wrong result) catches it."""
    text = (runtime.SOURCE_DIR / "linear.cu").read_text()
    parts = text.split("__syncthreads();")
    assert len(parts) == 3
    broken = parts[0] + ("" if which == 0 else "__syncthreads();") + parts[1] + \
        ("__syncthreads();" if which == 0 else "") + parts[2]
    shutil.copy(runtime.SOURCE_DIR / "contract.cuh", tmp_path / "contract.cuh")
    (tmp_path / "linear.cu").write_text(broken)
    rng = rng_for("gemm-race")
    P = 150                                                         # 19 slices of p, the last partial
    x, w = rand_bf16(rng, (21, P)), rand_bf16(rng, (19, P))
    # y[7, 11] = 2^-126 + mul(2^-63, -2^-64) (a product that flushes) in the first slice, which the
    # FMA guard must send down the exact path; a guard missing other threads' operands fuses it
    x[7] = 0x8000                                                   # -0: the other steps change nothing
    x[7, :2] = ref.f32_to_bf16(np.float32([2.0 ** -63, 2.0 ** -63]))
    w[11, :2] = ref.f32_to_bf16(np.float32([2.0 ** -63, -(2.0 ** -64)]))
    want = ref.linear_forward(x, w)
    assert want[7, 11] == np.float32(2.0 ** -126)
    fn = _emu_module(broken, "linear.cu", tmp_path).get_function("o1b_gemm")
    y = np.zeros((21, 19), np.float32)
    args = (np.int64(21), np.int64(19), np.int64(P), x, np.int64(P), np.int64(1), w, np.int64(1),
            np.int64(P), y, np.int64(19), np.int32(0))
    fn((4,), (16, 16), args)
    wrong = y.view(np.uint32).tobytes() != want.view(np.uint32).tobytes()
    try:
        with emu.options(race_check=True):
            fn((4,), (16, 16), args)
        raced = False
    except emu.EmuRaceError:
        raced = True
    assert wrong or raced
    assert raced, "the race check should name the kernel"
