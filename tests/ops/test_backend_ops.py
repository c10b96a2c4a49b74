"""Every GPU backend (metal, cuda: on their device, else their kernel sources on the CPU emulators)
against the C reference, bit for bit: the §3 primitives, the §4 functions, the §2 conversions, the
elementwise and host-scalar ops, every §6 layer, the optimizer, the reductions, the random numbers,
bad input, and the model's forward and backward. The int8 family is in test_backend_quant.py.

Each test runs on each backend (the `gpu` fixture, tests/ops/conftest.py). Inputs are seeded, hold
subnormals, ±0, ±inf, NaN and the largest and smallest normals, and use shapes that are multiples
of no tile, block or threadgroup size (128-thread blocks, 16x16 GEMM tiles, 64-key attention
blocks, 1024-entry cross-entropy chunks, 4096-element norm blocks). The cases come from two sets
that each held for one backend and must hold for both: case ids starting with m use the `seeded`
generators, those starting with c the `named` ones.

What tests one backend's machinery (the emulators' barriers, race checks, flush modes, caches,
compile errors; the device bindings) is in tests/emulators and tests/backends.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib

import numpy as np
import pytest

import mlx_open1b.cpu_ref as cpu_ref
from mlx_open1b.spec import arith as A

from helpers import SPECIAL_BF16, SPECIAL_F32, assert_bits_equal, near_min_normal_pairs, rand_bf16, rand_f32, sprinkle
# cpu_ref, each result computed once for both backends (one test function's cases held at a time)
from shared_reference import CPU_REF as C, scope

EXTRA_F32 = np.array([2.0 ** -126 * 1.5, np.float32(1.1754942e-38), -(2.0 ** -125), 88.72, -103.5, -87.4,
                      1e10, -3e9, 2.0 ** 31, 3.4e38, 25000.0, 0.5, -0.5, 1e-30], np.float32)
SPECIALS = np.concatenate([SPECIAL_F32, EXTRA_F32])
# edge values of fp32 around the flush threshold and the extremes
EDGES = np.array([2.0 ** -126, 2.0 ** -126 * (1 + 2.0 ** -23), 2.0 ** -125, 1.1754942e-38, 1.4e-45,
                  3.4028235e38, 3.4028233e38, 88.72283, 88.72284, -87.33655, -103.0, -103.00001,
                  2.0 ** -12, 2.0 ** -12 * (1 - 2.0 ** -24), 25735.0, 1e30], np.float32)


@pytest.fixture(autouse=True)
def _reference_shared_by_the_backends(request):
    scope(request.function)


# ------------------------------------------------------------------ the two sets' input generators
def seeded(*key) -> np.random.Generator:
    return np.random.default_rng([0x0E7A1, *key])


def named(name: str) -> np.random.Generator:
    return np.random.default_rng([ord(c) for c in name])


@functools.cache
def sweep(stride: int) -> np.ndarray:
    """Every stride-th fp32 bit pattern (both signs, all exponents), plus the specials; built once
    and read-only (every test reads it)."""
    u = np.arange(0, 2 ** 32, stride, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([u.view(np.float32), SPECIALS])
    x.setflags(write=False)
    return x


def with_specials(rng, a, frac=0.05):
    return sprinkle(rng, a, SPECIALS if a.dtype == np.float32 else SPECIAL_BF16, frac)


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


def case_id(case) -> str:
    return case[0] + "-".join(str(v) for v in case[1:])


def test_backend_available(gpu):
    ok, why = gpu.available()
    assert ok and why, why
    if gpu.NAME == "metal":
        assert "Metal" in why


# ---------------------------------------------------------------------------------------------
# §3 primitives through a test kernel
# ---------------------------------------------------------------------------------------------
# The results are written as the primitives return them, without o1b_store: a primitive must flush
# its own result (§3), and a flushing store would hide one that does not. Only NaN payloads are
# made canonical before comparing (o1b_store's other job).
PRIMS = ("add", "sub", "mul", "div", "max", "sqrt")
METAL_PRIM_SRC = """
uint i = thread_position_in_grid.x;
float x = o1b_load(a[i]), y = o1b_load(b[i]);
add_out[i] = o1b_add(x, y);
sub_out[i] = o1b_sub(x, y);
mul_out[i] = o1b_mul(x, y);
div_out[i] = o1b_div(x, y);
max_out[i] = o1b_max(x, y);
sqrt_out[i] = o1b_sqrt(x);
"""
CUDA_PRIM_SRC = """#include "contract.cuh"
extern "C" __global__ void o1b_binary_raw(int op, i64 n, const float *a, const float *b, float *y) {
    i64 i = o1b_gid();
    if (i >= n) return;
    float x = o1b_load(a[i]), z = o1b_load(b[i]), r;
    switch (op) {
    case 0: r = o1b_add(x, z); break;
    case 1: r = o1b_sub(x, z); break;
    case 2: r = o1b_mul(x, z); break;
    case 3: r = o1b_div(x, z); break;
    case 4: r = o1b_max(x, z); break;
    default: r = o1b_sqrt(x); break;
    }
    y[i] = r;
}
"""


def primitives(gpu, a: np.ndarray, b: np.ndarray) -> tuple[dict, dict]:
    """(raw, stored): each primitive of PRIMS on (a, b) elementwise as the backend's kernels compute
    it, unstored (NaNs made canonical, nothing else changed); and stored, through the backend's
    own elementwise kernel of the primitives where it has one (cuda's mathfn.cu o1b_binary)."""
    if gpu.NAME == "metal":
        from mlx_open1b.metal import runtime
        k = runtime.get_kernel("test_primitives_raw", ["a", "b"], [f"{p}_out" for p in PRIMS], METAL_PRIM_SRC,
                               runtime.header())
        outs = k(inputs=[a, b], output_shapes=[a.shape] * len(PRIMS), output_dtypes=[np.float32] * len(PRIMS),
                 grid=(a.size, 1, 1), threadgroup=(256, 1, 1))
        return {p: A.canon(o) for p, o in zip(PRIMS, outs)}, {}
    assert gpu.NAME == "cuda", f"no adapter for backend {gpu.NAME!r}"
    from mlx_open1b.cuda import runtime
    raw_mod = runtime.CudaModule(runtime.read_source_text(CUDA_PRIM_SRC, "prim_raw.cu"), name="prim_raw.cu")
    n, grid = np.int64(a.size), ((a.size + 127) // 128,)
    raw, stored = {}, {}
    for op, p in enumerate(PRIMS):
        dev = [gpu._dev(v) for v in (a, b, np.empty_like(a))]
        raw_mod.get_function("o1b_binary_raw")(grid, (128,), (np.int32(op), n, *dev))
        raw[p] = A.canon(gpu._host(dev[2]))
        if p != "max":      # o1b_binary: 0 add, 1 sub, 2 mul, 3 div, 4 sqrt
            dev = [gpu._dev(v) for v in (a, b, np.empty_like(a))]
            code = {"add": 0, "sub": 1, "mul": 2, "div": 3, "sqrt": 4}[p]
            runtime.load("mathfn.cu").get_function("o1b_binary")(grid, (128,), (np.int32(code), n, *dev))
            stored[p] = gpu._host(dev[2])
    return raw, stored



def tiny_product_pairs(rng, n=3000):
    """(a, b) whose exact product or quotient lies within a few ulps of 2^-126: the flush-before-
    rounding rule's only ambiguous case."""
    a = (1.0 + rng.random(n) * 0.999).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, n).astype(np.float32)
    b = (np.float64(2.0 ** -126) / a.astype(np.float64)).astype(np.float32)
    step = rng.integers(-3, 4, n).astype(np.int32)
    b = (b.view(np.int32) + step).view(np.float32)
    sign = rng.choice(np.array([1.0, -1.0], np.float32), n)
    return (a * sign).astype(np.float32), b


@functools.cache
def primitive_cases():
    """(a, b, ta, tb): the m set (a stride through every bit pattern against random partners,
    products and quotients near 2^-126, five boundary pairs) then the c set (random bit patterns,
    products and quotients near 2^-126, sums near and below 2^-126); ta, tb the c set's product
    pairs."""
    rng = seeded(1)
    x = sweep(2 ** 32 // 3000)
    a = np.repeat(x, 8)
    b = rng.choice(x, a.size)
    na, nb_mul, nb_div = near_min_normal_pairs(rng, 20000)
    edge_a = np.array([np.float32(1 - 2 ** -24), 2.0 ** -126, -(2.0 ** -126), 1.5, 2.0 ** -126], np.float32)
    edge_b = np.array([2.0 ** -126, np.float32(1 - 2 ** -24), np.float32(1 - 2 ** -24), 2.0 ** -126 / 1.5, 1.0],
                      np.float32)
    am = np.concatenate([a, na, na, edge_a]).astype(np.float32)
    bm = np.concatenate([b, nb_mul, nb_div, edge_b]).astype(np.float32)
    rng = named("prim")
    x = f32_inputs(rng, 3000)
    y = rng.permutation(x)
    ta, tb = tiny_product_pairs(rng)
    qa = (tb * np.float32(1.0)).astype(np.float32)   # a/b near 2^-126: a = 2^-126 * b' ...
    qb = (np.float64(1.0) / ta.astype(np.float64)).astype(np.float32)
    sa = (rng.uniform(-4, 4, 3000) * 2.0 ** -126).astype(np.float32)   # sums and differences near and
    sb = (sa * np.float32(-1.5)).astype(np.float32)                     # below 2^-126 (add's own flush)
    a = np.ascontiguousarray(np.concatenate([am, x, ta, qa, sa]))
    b = np.ascontiguousarray(np.concatenate([bm, y, tb, qb, sb]))
    return a, b, ta, tb, am.size


@functools.cache
def primitive_wants():
    """The C reference's scalar ops on every pair, and the numpy spec's (of the flushed operands)."""
    a, b, *_ = primitive_cases()
    scalar = {"add": C.mathfn.scalar_add, "sub": C.mathfn.scalar_sub, "mul": C.mathfn.scalar_mul,
              "div": C.mathfn.scalar_div, "sqrt": lambda u, v: C.optim.scalar_sqrt(u)}
    c_ref = {p: np.array([f(float(u), float(v)) for u, v in zip(a, b)], np.float32) for p, f in scalar.items()}
    fa, fb = A.flush(a), A.flush(b)
    spec = {"add": A.add(fa, fb), "sub": A.sub(fa, fb), "mul": A.mul(fa, fb), "div": A.div(fa, fb),
            "max": A.maximum(fa, fb), "sqrt": A.sqrt(fa)}
    return c_ref, {p: A.store(v) for p, v in spec.items()}


def test_primitives(gpu):
    """add, sub, mul, div, max and sqrt of the kernels: unstored (and stored, where the backend has
    a kernel of them) against the C reference's scalar ops and the numpy spec, on every fp32
    exponent, on products and quotients next to 2^-126 (the exact-product decision) and on sums
    near and below 2^-126 (add's own flush)."""
    a, b, ta, tb, m_size = primitive_cases()
    c_ref, spec = primitive_wants()
    raw, stored = primitives(gpu, a, b)
    for p in PRIMS:
        assert_bits_equal(raw[p], spec[p], f"{p} (spec)")
        if p in c_ref:
            assert_bits_equal(raw[p], c_ref[p], f"{p} (cpu_ref)")
    for p, out in stored.items():
        assert_bits_equal(out, c_ref[p], f"{p} stored")
    # (1 - 2^-24) * 2^-126: IEEE gives 2^-126; the contract's exact product is below it
    assert raw["mul"][m_size - 5] == 0 and raw["mul"][m_size - 5].view(np.uint32) == 0
    # the pairs do reach the ambiguous case: IEEE rounds some exact products below 2^-126 up to it
    exact = ta.astype(np.float64) * tb.astype(np.float64)
    assert np.any((np.abs(exact) < 2.0 ** -126) & (np.abs(ta * tb) == np.float32(2.0 ** -126)))


# ---------------------------------------------------------------------------------------------
# §4 functions, §2 conversions, elementwise, host scalars
# ---------------------------------------------------------------------------------------------
_MAP_DIGESTS: dict = {}


def _digest(a: np.ndarray) -> tuple:
    return a.dtype.str, a.shape, hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).digest()


@pytest.mark.parametrize("name", C.FUNCTIONS)
def test_map_functions(gpu, name):
    """Every §4 function on 8.6 million bit patterns (every 499th) and the specials, on ~30k
    specials, edges, random bit patterns and ordinary values, and on a 2-D array (kept shape)."""
    assert gpu.FUNCTIONS == C.FUNCTIONS
    fn, ref = getattr(gpu, name), getattr(C, name)
    for i, x in enumerate((sweep(499), f32_inputs(named("math")), rand_f32(seeded(2), (3, 37), 30.0))):
        got = fn(x)
        # the reference's digest is kept for the next backend (its 8.6 million results are not)
        if _MAP_DIGESTS.get((name, i)) == _digest(got):
            continue
        want = ref(x)
        _MAP_DIGESTS[name, i] = _digest(want)
        assert_bits_equal(got, want, name)


def test_conversions(gpu):
    every_bf16 = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)
    assert_bits_equal(gpu.bf16_to_f32(every_bf16), C.bf16_to_f32(every_bf16), "bf16_to_f32")
    h = every_bf16.reshape(256, 256)
    assert_bits_equal(gpu.bf16_to_f32(h), C.bf16_to_f32(h), "bf16_to_f32 2-d")
    x = sweep(4099)
    assert_bits_equal(gpu.f32_to_bf16(x), C.f32_to_bf16(x), "f32_to_bf16")
    x = f32_inputs(named("conv"), 100000)
    assert_bits_equal(gpu.f32_to_bf16(x), C.f32_to_bf16(x), "f32_to_bf16")
    x2 = x[:1001].reshape(7, 11, 13)
    assert_bits_equal(gpu.f32_to_bf16(x2), C.f32_to_bf16(x2), "f32_to_bf16 3-d")
    assert gpu.f32_to_bf16(np.zeros((0, 3), np.float32)).shape == (0, 3)


def test_add_scale_and_host_scalars(gpu):
    rng = seeded(3)
    am = with_specials(rng, rand_f32(rng, (29, 31), 1e-19), 0.2)
    bm = with_specials(rng, rand_f32(rng, (29, 31), 1e-19), 0.2)
    rng = named("inplace")
    ac, bc = f32_inputs(rng, 5000), rng.permutation(f32_inputs(rng, 5000))
    for a, b in ((am, bm), (ac, bc)):
        a1, a2 = a.copy(), a.copy()
        gpu.add_inplace(a1, b)
        C.add_inplace(a2, b)
        assert_bits_equal(a1, a2, "add_inplace")
        for s in (0.5, 1 / 3, 1e-30, -2.0, np.inf, 3e38, 3.0e-39, 7.0, -0.0):
            a1, a2 = a.copy(), a.copy()
            gpu.scale_inplace(a1, s)
            C.scale_inplace(a2, s)
            assert_bits_equal(a1, a2, f"scale_inplace {s}")
    for x in SPECIALS[::2]:
        for y in SPECIALS[1::3]:
            for gf, cf in ((gpu.scalar_add, C.mathfn.scalar_add), (gpu.scalar_sub, C.mathfn.scalar_sub),
                           (gpu.scalar_mul, C.mathfn.scalar_mul), (gpu.scalar_div, C.mathfn.scalar_div)):
                assert_bits_equal(np.float32(gf(float(x), float(y))), np.float32(cf(float(x), float(y))),
                                  f"{gf.__name__}({x}, {y})")
            assert_bits_equal(np.float32(gpu.clip_coef(x, y)), np.float32(C.clip_coef(x, y)), f"clip_coef({x}, {y})")


# ---------------------------------------------------------------------------------------------
# §6.1 the linear layer
# ---------------------------------------------------------------------------------------------
LINEAR_CASES = [("m", 1, 1, 1), ("m", 5, 7, 3), ("m", 17, 33, 9), ("m", 40, 70, 45),
                ("c", 37, 45, 29), ("c", 1, 1, 1), ("c", 3, 17, 1), ("c", 20, 0, 5), ("c", 33, 70, 18),
                ("c", 18, 200, 21)]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=case_id)
def test_linear(gpu, case):
    origin, N, K, M = case
    shapes = ((N, K), (M, K), (N, M))
    if origin == "m":
        rng = seeded(4, N, K)
        x, w, dy = (with_specials(rng, rand_bf16(rng, s), 0.03) for s in shapes)
    else:
        rng = named(f"lin{N}{K}{M}")
        x, w, dy = (bf16_with_specials(rng, s) for s in shapes)
    assert_bits_equal(gpu.linear_forward(x, w), C.linear_forward(x, w), "linear_forward")
    want_dx, want_dw = C.linear_backward(dy, x, w)
    for got, want, what in zip(gpu.linear_backward(dy, x, w), (want_dx, want_dw), ("dx", "dw")):
        assert_bits_equal(got, want, what)
    dx, dw = gpu.linear_backward(dy, x, w, need_dx=False)
    assert dx is None and dw.shape == (M, K)
    assert_bits_equal(dw, want_dw, "dw only")


def test_linear_no_fma_cases(gpu):
    """CONTRACT.md §6.1: sequences where a fused multiply-add would differ."""
    b = lambda v: np.array(v, np.float32).view(np.uint32).__rshift__(16).astype(np.uint16)
    x = b([[2.0 ** -100, 2.0 ** -64], [2.0 ** -64, 0.0], [np.float32(np.uint32(0x7F7F0000).view(np.float32)), 2.0 ** 64]])
    w = b([[2.0 ** -26, -(2.0 ** -64)], [-(2.0 ** -64), 0.0], [-1.0, 2.0 ** 64]])
    assert_bits_equal(gpu.linear_forward(x, w), C.linear_forward(x, w), "no-FMA cases")
    bf = lambda v: C.f32_to_bf16(np.array(v, np.float32))
    cases = [([2.0 ** -100, 2.0 ** -64], [2.0 ** -26, -(2.0 ** -64)]),
             ([2.0 ** -64], [-(2.0 ** -64)]),
             ([3.3895314e38, 2.0 ** 64], [-1.0, 2.0 ** 64])]
    for xs, ws in cases:
        x, w = bf([xs]), bf([ws])
        assert_bits_equal(gpu.linear_forward(x, w), C.linear_forward(x, w), f"fma case {xs}")


# ---------------------------------------------------------------------------------------------
# §6.2-§6.5 layers
# ---------------------------------------------------------------------------------------------
def test_embedding(gpu):
    rng = seeded(5)
    V, C_, N = 11, 13, 37
    wte = with_specials(rng, rand_bf16(rng, (V, C_)))
    tokens = rng.integers(0, V - 2, N).astype(np.int32)                 # rows V-2, V-1 unused
    dout = with_specials(rng, rand_f32(rng, (N, C_)), 0.1)
    rng = named("emb")
    Vc, Cc, Nc = 23, 19, 57
    wte_c = bf16_with_specials(rng, (Vc, Cc))
    tokens_c = rng.integers(0, Vc - 3, Nc).astype(np.int32)              # the last rows get no position
    dout_c = f32_with_specials(rng, (Nc, Cc))
    for wte, tokens, dout, V, C_ in ((wte, tokens, dout, V, C_), (wte_c, tokens_c, dout_c, Vc, Cc)):
        assert_bits_equal(gpu.embedding_forward(tokens, wte), C.embedding_forward(tokens, wte), "embedding_forward")
        assert_bits_equal(gpu.embedding_backward(tokens, dout, V), C.embedding_backward(tokens, dout, V),
                          "embedding_backward")
        empty = np.zeros(0, np.int32)
        assert_bits_equal(gpu.embedding_backward(empty, np.zeros((0, C_), np.float32), V),
                          C.embedding_backward(empty, np.zeros((0, C_), np.float32), V), "embedding_backward empty")


def _check_rmsnorm_backward(gpu, dy, x, g, rstd):
    dxm, dgm = gpu.rmsnorm_backward(dy, x, g, rstd)
    dxc, dgc = C.rmsnorm_backward(dy, x, g, rstd)
    assert_bits_equal(dxm, dxc, "dx")
    if g is not None:
        assert_bits_equal(dgm, dgc, "dg")
    else:
        assert dgm is None and dgc is None


@pytest.mark.parametrize("gain", [True, False])
def test_rmsnorm(gpu, gain):
    rng = seeded(6, gain)
    N, C_ = 19, 13
    x = with_specials(rng, rand_f32(rng, (N, C_)), 0.05)
    x[3] = 0.0
    x[4] = 1e-30
    g = with_specials(rng, rand_bf16(rng, (C_,)), 0.2) if gain else None
    dy = with_specials(rng, rand_f32(rng, (N, C_)), 0.05)
    rng = named(f"rms{gain}")
    xc = rand_f32(rng, (13, 37), 3.0)
    xc[2] = sprinkle(rng, xc[2], SPECIAL_F32, 0.2)
    xc[5, :] = 1e-40                                  # an all-subnormal row
    xc[7, :] = 0.0
    gc = bf16_with_specials(rng, (37,), 1.0, 0.1) if gain else None
    dyc = f32_with_specials(rng, (13, 37))
    for x, g, dy, eps_values in ((x, g, dy, (1e-6, 0.0)), (xc, gc, dyc, (1e-5, 0.0))):
        for eps in eps_values:
            ym, rm = gpu.rmsnorm_forward(x, g, eps)
            yc, rc = C.rmsnorm_forward(x, g, eps)
            assert_bits_equal(ym, yc, "y")
            assert_bits_equal(rm, rc, "rstd")
            _check_rmsnorm_backward(gpu, dy, x, g, rc)
            yb, rb = gpu.rmsnorm_forward(x, g, eps, bf16_out=True)
            assert_bits_equal(yb, C.rmsnorm_forward(x, g, eps, bf16_out=True)[0], "y bf16")
            assert_bits_equal(rb, rc, "rstd with y bf16")


@pytest.mark.parametrize("T,D,theta", [(9, 6, 10000.0), (40, 10, 500000.0), (3, 2, 1.5)])
def test_rope(gpu, T, D, theta):
    cm, sm = gpu.rope_tables(T, D, theta)
    cc, sc = C.rope_tables(T, D, theta)
    assert_bits_equal(cm, cc, "cos table")
    assert_bits_equal(sm, sc, "sin table")
    rng = seeded(7, T, D)
    x = with_specials(rng, rand_f32(rng, (2, T, 3, D)), 0.05)
    assert_bits_equal(gpu.rope_forward(x, cc, sc), C.rope_forward(x, cc, sc), "rope_forward")
    assert_bits_equal(gpu.rope_backward(x, cc, sc), C.rope_backward(x, cc, sc), "rope_backward")
    big_c, big_s = C.rope_tables(T + 5, D, theta)                       # a table longer than T
    assert_bits_equal(gpu.rope_forward(x, big_c, big_s), C.rope_forward(x, big_c, big_s), "rope_forward long table")


def test_rope_tables_and_a_longer_table(gpu):
    rng = named("rope")
    for T, D, theta in ((37, 18, 10000.0), (5, 2, 500000.0), (300, 10, 1e6)):
        for a, b in zip(gpu.rope_tables(T, D, theta), C.rope_tables(T, D, theta)):
            assert_bits_equal(a, b, f"tables T={T} D={D}")
    cos_t, sin_t = C.rope_tables(40, 18, 10000.0)
    x = f32_with_specials(rng, (2, 37, 3, 18))
    assert_bits_equal(gpu.rope_forward(x, cos_t, sin_t), C.rope_forward(x, cos_t, sin_t), "fwd")
    assert_bits_equal(gpu.rope_backward(x, cos_t, sin_t), C.rope_backward(x, cos_t, sin_t), "bwd")


def test_swiglu(gpu):
    rng = seeded(8)
    h = with_specials(rng, rand_f32(rng, (7, 2 * 23), 4.0), 0.05)
    dout = with_specials(rng, rand_f32(rng, (7, 23)), 0.05)
    rng = named("swiglu")
    hc = f32_with_specials(rng, (11, 2 * 27), 4.0)
    hc[0, :27] = np.linspace(-100, 100, 27)
    dout_c = f32_with_specials(rng, (11, 27))
    for h, dout in ((h, dout), (hc, dout_c)):
        assert_bits_equal(gpu.swiglu_forward(h), C.swiglu_forward(h), "swiglu_forward")
        assert_bits_equal(gpu.swiglu_backward(dout, h), C.swiglu_backward(dout, h), "swiglu_backward")
        assert_bits_equal(gpu.swiglu_forward(h, bf16_out=True), C.swiglu_forward(h, bf16_out=True), "forward bf16")
        assert_bits_equal(gpu.swiglu_backward(dout, h, bf16_out=True), C.swiglu_backward(dout, h, bf16_out=True),
                          "backward bf16")


# ---------------------------------------------------------------------------------------------
# §6.6 attention
# ---------------------------------------------------------------------------------------------
ATTN_CASES = [  # origin, B, T, H, G, D, W, special fraction
    ("m", 1, 1, 1, 1, 2, 0, 0.0),
    ("m", 2, 70, 4, 2, 8, 0, 0.0),
    ("m", 1, 130, 2, 1, 6, 5, 0.0),
    ("m", 1, 100, 3, 3, 4, 64, 0.0),
    ("m", 2, 67, 4, 1, 8, 70, 0.01),
    ("m", 1, 20, 2, 2, 4, 1, 0.02),
    ("c", 2, 150, 4, 2, 8, 0, 0.0),     # three key blocks, the last partial
    ("c", 1, 70, 2, 1, 5, 33, 0.0),     # window crossing a block boundary
    ("c", 1, 130, 3, 3, 4, 1, 0.0),     # each query sees only itself
    ("c", 2, 67, 2, 1, 6, 0, 0.01),     # special values in q, k, v, dout
    ("c", 1, 0, 2, 2, 4, 0, 0.0),       # T = 0
]


def attention_inputs(case):
    """q, k, v, dout and scale of a case (the m set's scale rounded to fp32 here, the c set's by the op)."""
    origin, B, T, H, G, D, W, frac = case
    if origin == "m":
        rng = seeded(9, T, D, W)
        q = rand_bf16(rng, (B, T, H, D), 2.0)
        k = rand_bf16(rng, (B, T, G, D), 2.0)
        v = rand_bf16(rng, (B, T, G, D))
        dout = rand_f32(rng, (B, T, H, D))
        if frac:
            q, k, v, dout = (with_specials(rng, a, frac) for a in (q, k, v, dout))
        return q, k, v, dout, float(np.float32(1 / np.sqrt(D)))
    rng = named(f"attn{B}{T}{H}{G}{D}{W}")
    q = bf16_with_specials(rng, (B, T, H, D), 1.0, frac) if frac else rand_bf16(rng, (B, T, H, D))
    k = bf16_with_specials(rng, (B, T, G, D), 1.0, frac) if frac else rand_bf16(rng, (B, T, G, D))
    v = bf16_with_specials(rng, (B, T, G, D), 1.0, frac) if frac else rand_bf16(rng, (B, T, G, D))
    dout = f32_with_specials(rng, (B, T, H, D), 1.0, frac) if frac else rand_f32(rng, (B, T, H, D))
    return q, k, v, dout, 1.0 / np.sqrt(D)


@pytest.mark.parametrize("case", ATTN_CASES, ids=case_id)
def test_attention(gpu, case):
    W = case[6]
    q, k, v, dout, scale = attention_inputs(case)
    om, lm = gpu.attention_forward(q, k, v, W, scale)
    oc, lc = C.attention_forward(q, k, v, W, scale)
    assert_bits_equal(om, oc, "o")
    assert_bits_equal(lm, lc, "lse")
    for got, want, what in zip(gpu.attention_backward(dout, q, k, v, oc, lc, W, scale),
                               C.attention_backward(dout, q, k, v, oc, lc, W, scale), ("dq", "dk", "dv")):
        assert_bits_equal(got, want, what)


# ---------------------------------------------------------------------------------------------
# §6.8 cross-entropy
# ---------------------------------------------------------------------------------------------
XENT_CASES = [("m", 5, 7, 2500, 0.0), ("m", 3, 4, 1024, 0.001), ("m", 4, 9, 37, 0.02),
              ("c", 7, 13, 2500, 0.0), ("c", 5, 9, 1000, 0.03), ("c", 3, 4, 1025, 0.0)]


@pytest.mark.parametrize("case", XENT_CASES, ids=case_id)
def test_xent(gpu, case):
    origin, N, C_, V, frac = case
    if origin == "m":
        rng = seeded(10, V)
        h = rand_bf16(rng, (N, C_), 2.0)
        w = rand_bf16(rng, (V, C_), 2.0)
        if frac:
            h, w = with_specials(rng, h, frac), with_specials(rng, w, frac)
    else:
        rng = named(f"xent{N}{C_}{V}")
        h = bf16_with_specials(rng, (N, C_), 1.0, frac) if frac else rand_bf16(rng, (N, C_))
        w = rand_bf16(rng, (V, C_), 0.5)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[0] = V - 1
    for zcoef in (1e-4, 0.0):
        fm, fc = gpu.xent_forward(h, w, targets, zcoef), C.xent_forward(h, w, targets, zcoef)
        for got, want, what in zip(fm, fc, ("loss", "lse", "ce")):
            assert_bits_equal(got, want, what)
        dloss = np.full(N, np.float32(1 / N), np.float32)
        if origin == "m":
            dloss[-1] = 3.0
        for got, want, what in zip(gpu.xent_backward(h, w, targets, zcoef, fc[1], dloss),
                                   C.xent_backward(h, w, targets, zcoef, fc[1], dloss), ("dh", "dw")):
            assert_bits_equal(got, want, what)


# ---------------------------------------------------------------------------------------------
# §7 optimizer, reductions, random numbers
# ---------------------------------------------------------------------------------------------
def test_adamw(gpu):
    rng = seeded(11)
    n = 1001
    p = with_specials(rng, rand_bf16(rng, (n,), 0.1), 0.03)
    g = with_specials(rng, rand_f32(rng, (n,), 0.01), 0.03)
    m = with_specials(rng, rand_f32(rng, (n,), 0.01), 0.03)
    v = np.abs(with_specials(rng, rand_f32(rng, (n,), 1e-4), 0.03))
    for step, wd in ((1, 0.0), (10, 0.1), (1000, 0.01)):
        a = [x.copy() for x in (p, g, m, v)]
        b = [x.copy() for x in (p, g, m, v)]
        gpu.adamw_step(a[0], a[1], a[2], a[3], lr=3e-4, weight_decay=wd, step=step)
        C.adamw_step(b[0], b[1], b[2], b[3], lr=3e-4, weight_decay=wd, step=step)
        for x, y, what in zip(a, b, ("p", "g", "m", "v")):
            assert_bits_equal(x, y, f"adamw {what} step {step}")
    # the same state through successive steps
    rng = named("adamw")
    p = bf16_with_specials(rng, (n,))
    m, v = f32_with_specials(rng, (n,), 1e-2), np.abs(f32_with_specials(rng, (n,), 1e-3))
    pa, ma, va = p.copy(), m.copy(), v.copy()
    pb, mb, vb = p.copy(), m.copy(), v.copy()
    for step, wd in ((1, 0.0), (2, 0.1), (3, 0.1), (1000, 0.0)):
        g = f32_with_specials(rng, (n,), 1e-2)
        gpu.adamw_step(pa, g, ma, va, lr=3e-4, weight_decay=wd, step=step)
        C.adamw_step(pb, g, mb, vb, lr=3e-4, weight_decay=wd, step=step)
        for a, b, what in ((pa, pb, "p"), (ma, mb, "m"), (va, vb, "v")):
            assert_bits_equal(a, b, f"{what} step {step}")


def test_reductions(gpu):
    rng = seeded(12)
    for n in (0, 1, 4095, 4096, 4097, 10000):
        x = with_specials(rng, rand_f32(rng, (n,), 1e-19), 0.001) if n > 100 else rand_f32(rng, (n,))
        assert_bits_equal(gpu.sumsq_blocks(x), C.sumsq_blocks(x), f"sumsq_blocks n={n}")
    for n in list(range(0, 20)) + [63, 64, 100, 1000]:
        vals = rand_f32(rng, (n,), 1e3)
        assert_bits_equal(np.float32(gpu.treefold(vals)), np.float32(C.treefold(vals)), f"treefold n={n}")
    vals = with_specials(rng, rand_f32(rng, (50,)), 0.1)
    assert_bits_equal(np.float32(gpu.treefold(vals)), np.float32(C.treefold(vals)), "treefold specials")
    ts = [rand_f32(rng, (9000,)), rand_f32(rng, (3, 5)), rand_f32(rng, (5000,), 1e-20)]
    assert_bits_equal(np.float32(gpu.global_norm(ts)), np.float32(C.global_norm(ts)), "global_norm")
    rng = named("reduce")
    x = f32_with_specials(rng, (2 * 4096 + 77,), 1.0, 0.0005)
    for t in (x, x[:1], x[:4096], np.zeros(0, np.float32), rand_f32(rng, (3, 1500)), np.abs(x)[:5000]):
        t = np.ascontiguousarray(t)
        assert_bits_equal(gpu.sumsq_blocks(t), C.sumsq_blocks(t), f"sumsq {t.shape}")
    for n in (0, 1, 2, 5, 6, 7, 100, 1023):
        vals = rand_f32(rng, (n,), 100.0)
        assert np.float32(gpu.treefold(vals)).view(np.uint32) == np.float32(C.treefold(vals)).view(np.uint32)
    tensors = [rand_f32(rng, (5000,)), rand_f32(rng, (7, 9)), rand_f32(rng, (4096,))]
    assert gpu.global_norm(tensors) == C.global_norm(tensors)
    for norm, mx in ((3.0, 1.0), (0.5, 1.0), (np.nan, 1.0), (0.0, 1.0), (np.inf, 1.0), (1e-39, 2.0)):
        a, b = np.float32(gpu.clip_coef(norm, mx)), np.float32(C.clip_coef(norm, mx))
        assert a.view(np.uint32) == b.view(np.uint32), (norm, mx)


def test_random(gpu):
    for seed, stream, index0, sub, n in ((0, 0, 0, 0, 5), (2 ** 40 + 5, 1, 2 ** 32 - 3, 7, 300),
                                          (2 ** 64 - 1, 0xFFFF, 2 ** 64 - 2, 2 ** 32 - 1, 9),
                                          (0, 1, 0, 0, 101), (2 ** 64 - 1, 0xFFFF, 2 ** 32 - 50, 7, 101),
                                          (1234567, 3, 2 ** 40, 0, 101)):
        assert_bits_equal(gpu.philox_blocks(seed, stream, index0, n, sub).view(np.float32),
                          C.philox_blocks(seed, stream, index0, n, sub).view(np.float32), "philox")
        assert np.array_equal(gpu.philox_blocks(seed, stream, index0, n, sub),
                              C.philox_blocks(seed, stream, index0, n, sub))
    for seed, index0, n, sigma in ((1234, 0, 3000, 0.02), (2 ** 50 + 3, 2 ** 33, 500, 1.0)):
        assert_bits_equal(gpu.trunc_normal(seed, 1, index0, n, sigma), C.trunc_normal(seed, 1, index0, n, sigma),
                          "trunc_normal")
    for seed, index0 in ((42, 0), (2 ** 63 + 5, 2 ** 32 - 1000)):
        assert_bits_equal(gpu.trunc_normal(seed, 1, index0, 3001), C.trunc_normal(seed, 1, index0, 3001),
                          "trunc_normal")
    assert gpu.philox_blocks(1, 1, 0, 0).shape == (0, 4)


# ---------------------------------------------------------------------------------------------
# seeded random shapes
# ---------------------------------------------------------------------------------------------
CASES = 20   # seeded random-shape cases per op, besides the fixed cases above


def _random_case(op, seed):
    rng = seeded(100, seed, len(op))
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
def test_random_cases(gpu, op):
    for seed in range(CASES):
        for i, call in enumerate(_random_case(op, seed)):
            for j, (got, want) in enumerate(zip(_flat(call(gpu)), _flat(call(C)))):
                assert_bits_equal(got, want, f"{op} case {seed} call {i} output {j}")


# ---------------------------------------------------------------------------------------------
# bad input: cpu_ref's error, before any kernel runs
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def no_kernel_runs(gpu, monkeypatch):
    """Inside: no kernel of gpu runs (metal: the emulator's launch count stays; cuda: no kernel
    module is even loaded). On a device the Metal emulator's count cannot move either way."""
    if gpu.NAME == "metal":
        from mlx_open1b.metal import emu as metal_emu
        before = metal_emu.stats["launches"]
        yield
        assert metal_emu.stats["launches"] == before, "a kernel ran before the arguments were checked"
        return
    assert gpu.NAME == "cuda", f"no adapter for backend {gpu.NAME!r}"
    from mlx_open1b.cuda import runtime as cuda_runtime

    def refuse(*a, **k):
        raise AssertionError("a kernel was loaded before the arguments were checked")
    with monkeypatch.context() as mp:
        mp.setattr(cuda_runtime, "load", refuse)
        yield


_x, _w = np.zeros((3, 4), np.float32), np.zeros((5, 4), np.uint16)
BAD_CALLS = [
    ("x dtype", lambda o: o.linear_forward(_x, _w)),                                   # x must be bf16
    ("not contiguous", lambda o: o.linear_forward(_w[:, :3], _w)),
    ("token", lambda o: o.embedding_forward(np.array([0, 5], np.int32), _w)),           # token out of range
    ("eps", lambda o: o.rmsnorm_forward(_x, None, -1.0)),
    ("attention", lambda o: o.attention_forward(*(np.zeros((1, 2, 3, 4), np.uint16),) * 2,
                                                np.zeros((1, 2, 3, 4), np.uint16), -1, 0.5)),
    ("xent targets", lambda o: o.xent_forward(_w, _w, np.array([0, 1, 2, 3, 9], np.int32), 1e-4)),
    ("adamw v", lambda o: o.adamw_step(np.zeros(3, np.uint16), np.zeros(3, np.float32), np.zeros(3, np.float32),
                                       np.zeros(2, np.float32), lr=1e-3, step=1)),
    ("philox seed", lambda o: o.philox_blocks(-1, 0, 0, 3)),
    ("exp float64", lambda o: o.exp(np.zeros(3, np.float64))),
    ("linear K", lambda o: o.linear_forward(np.zeros((2, 3), np.uint16), np.zeros((4, 5), np.uint16))),
    ("tokens", lambda o: o.embedding_forward(np.array([0, 9], np.int32), np.zeros((4, 2), np.uint16))),
    ("window", lambda o: o.attention_forward(*(np.zeros((1, 2, 2, 4), np.uint16),) * 3, -1, 0.5)),
    ("targets", lambda o: o.xent_forward(np.zeros((2, 3), np.uint16), np.zeros((4, 3), np.uint16),
                                         np.array([0, 4], np.int32), 1e-4)),
    ("adamw", lambda o: o.adamw_step(np.zeros(3, np.uint16), np.zeros(3, np.float32), np.zeros(3, np.float32),
                                     np.zeros(4, np.float32), lr=1e-3, step=1)),
    ("rope", lambda o: o.rope_tables(4, 3, 1e4)),
]


@pytest.mark.parametrize("what,call", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_same_error_before_any_kernel(gpu, monkeypatch, what, call):
    with pytest.raises(ValueError) as e_ref:
        call(C)
    with no_kernel_runs(gpu, monkeypatch), pytest.raises(ValueError) as e_gpu:
        call(gpu)
    assert str(e_gpu.value) == str(e_ref.value)


# ---------------------------------------------------------------------------------------------
# the model program on the backend
# ---------------------------------------------------------------------------------------------
def test_model_forward_backward_and_step(gpu):
    from mlx_open1b.config import ModelConfig
    from mlx_open1b.model import Model, init_params
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      ffn_hidden=48, seq_len=16, window=4)
    params = init_params(cfg, 7, ops=cpu_ref)
    assert_bits_equal(init_params(cfg, 7, ops=gpu), params, "init_params")
    windows = seeded(13).integers(0, cfg.vocab_size, (2, cfg.seq_len + 1)).astype(np.uint32)
    lm, cem, zm, gm = Model(cfg, ops=gpu).loss_and_grad(params, windows)
    lc, cec, zc, gc = Model(cfg).loss_and_grad(params, windows)
    assert_bits_equal(np.float32([lm, cem, zm]), np.float32([lc, cec, zc]), "loss, ce, z")
    assert_bits_equal(gm, gc, "gradient")
    windows = named("model").integers(0, cfg.vocab_size, (2, cfg.seq_len + 1)).astype(np.uint32)
    results = []
    for ops in (gpu, cpu_ref):
        model = Model(cfg, ops=ops)
        loss, ce, zl, cache = model.forward(params, windows)
        results.append((loss, ce, zl, model.backward(params, cache)))
    assert results[0][:3] == results[1][:3]
    assert_bits_equal(results[0][3], results[1][3], "gradient")
