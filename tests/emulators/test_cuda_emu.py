"""The CUDA emulator (cuda/emu) itself: the device's flush modes (the contract's bits must not
depend on them), barriers and the race check, both fiber implementations, compile errors, argument
type checks, the disk cache, and planted faults (a one-ulp constant, a removed barrier) caught.

These force emulation (runtime.emulate()) and need only g++; the op results on every backend are
tests/ops/test_backend_ops.py's and test_backend_quant.py's.
"""
from __future__ import annotations

import contextlib
import functools
import platform
import shutil
import sys

import numpy as np
import pytest

from helpers import (QMAX4, QMAX6, SPECIAL_BF16, SPECIAL_F32, TINY_E, assert_bits_equal, attention_i8_inputs,
                     rand_bf16, rand_f32, sprinkle)
# cpu_ref and the numpy spec, each result computed once for every flush mode of a test
from shared_reference import CPU_REF as ref, check_attention_i8_backend, check_qlinear_low, scope

from mlx_open1b.cuda import emu, ops as cu, runtime
from mlx_open1b.spec.arith import f32_to_bf16

HAVE_GXX, WHY = emu.compiler_available()
pytestmark = pytest.mark.skipif(not HAVE_GXX, reason=f"the CUDA emulator needs g++ ({WHY})")
# the emulated single-precision intrinsics' flush modes: IEEE, FTZ after rounding, FTZ before rounding
FTZ_MODES = [0, 1, 2]
ftz_ids = lambda m: f"emu-ftz{m}"

# edge values of fp32 around the flush threshold and the extremes
EDGES = np.array([2.0 ** -126, 2.0 ** -126 * (1 + 2.0 ** -23), 2.0 ** -125, 1.1754942e-38, 1.4e-45,
                  3.4028235e38, 3.4028233e38, 88.72283, 88.72284, -87.33655, -103.0, -103.00001,
                  2.0 ** -12, 2.0 ** -12 * (1 - 2.0 ** -24), 25735.0, 1e30], np.float32)


@pytest.fixture(autouse=True)
def _references_shared_by_the_modes(request):
    scope(request.function)


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


def bf(v) -> np.ndarray:
    return f32_to_bf16(np.asarray(v, np.float32))


def run_kernel(file: str, kernel: str, n: int, *args, directory=None):
    """Launch a kernel of a .cu file directly (1-D, 128 threads a block) on device copies of the
    numpy arguments; returns the arguments back on the host."""
    dev = [cu._dev(a) if isinstance(a, np.ndarray) else a for a in args]
    runtime.load(file, directory).get_function(kernel)(((n + 127) // 128,), (128,), tuple(dev))
    return [cu._host(d) if isinstance(a, np.ndarray) else a for a, d in zip(args, dev)]


@contextlib.contextmanager
def ftz_mode(ftz):
    """The emulator with the device's flush mode forced."""
    with runtime.emulate(), emu.options(ftz=ftz):
        yield


# ================================================================== flush modes: the same bits
@pytest.mark.parametrize("ftz", FTZ_MODES, ids=ftz_ids)
def test_math_functions_in_every_flush_mode(ftz):
    """Every §4 function on ~30k inputs: the contract helpers must not depend on the single-precision
    intrinsics' flush mode."""
    x = f32_inputs(rng_for("math"))
    with ftz_mode(ftz):
        for name in ref.FUNCTIONS:
            assert_bits_equal(getattr(cu, name)(x), getattr(ref, name)(x), name)


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


@functools.cache
def primitive_cases():
    """(a, b, wants): operand pairs and the C reference's scalar add, sub, mul, div, sqrt of each."""
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
    return a, b, [np.array([fref(float(u), float(v)) for u, v in zip(a, b)], np.float32) for fref in refs]


@pytest.mark.parametrize("ftz", FTZ_MODES, ids=ftz_ids)
def test_primitive_ops_tiny_results_in_every_flush_mode(ftz):
    """add/sub/mul/div/sqrt of the kernels against the C reference's scalar ops, on random bit
    patterns and on products/quotients next to 2^-126 (including the exact-product decision):
    through mathfn.cu's o1b_binary (stored results) and unstored (NaNs made canonical, nothing
    else changed), in each flush mode."""
    a, b, wants = primitive_cases()
    with ftz_mode(ftz):
        raw = runtime.CudaModule(runtime.read_source_text(PRIM_RAW_SRC, "prim_raw.cu"), name="prim_raw.cu")
        for op, want in enumerate(wants):
            out = np.empty_like(a)
            (out,) = run_kernel("mathfn.cu", "o1b_binary", a.size, np.int32(op), np.int64(a.size), a, b, out)[4:]
            assert_bits_equal(out, want, f"binary op {op}")
            dev = [cu._dev(v) for v in (a, b, np.empty_like(a))]
            raw.get_function("o1b_binary_raw")(((a.size + 127) // 128,), (128,),
                                               (np.int32(op), np.int64(a.size), *dev))
            got = cu._host(dev[2])
            got = np.where(np.isnan(got), np.float32(np.nan), got)         # 0x7FC00000, as o1b_store
            assert_bits_equal(got, want, f"binary op {op} unstored")


def check_layer(x, w, dy, what):
    assert_bits_equal(cu.qlinear_forward(x, w), ref.qlinear_forward(x, w), f"{what} y")
    for got, want, g in zip(cu.qlinear_backward(dy, x, w), ref.qlinear_backward(dy, x, w), ("dx", "dw")):
        assert_bits_equal(got, want, f"{what} {g}")


def special_layer_inputs():
    """(x, w, dy, what) in turn: test_backend_quant.py's test_special_values_in_the_layer's inputs
    (the structure of the results is asserted there; bit equality with cpu_ref carries it here)."""
    rng = rng_for("specials")
    N, K, M = 140, 96, 150
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    w[10] = 0                                   # zero row: y column 0
    w[11, 5] = 0x7FC1                           # NaN in a weight row: y column NaN, dW row NaN
    w[12, 0] = bf(1.0)                          # clipped weight: its dW element is +0
    w[13] = 0x0080                              # flushed step size: a zero row
    x[3, 3] = 0x0001                            # subnormal input: flushed
    dy[5, 6] = 0x8001
    yield x, w, dy, "specials"
    w[11, 5] = 0
    x[7, 7] = 0x7F80                            # inf activation: the tensor scale is NaN
    yield x, w, dy, "inf x"
    dy[0, 0] = 0xFF80                           # inf gradient: both gradients NaN
    yield x, w, dy, "inf dy"
    yield np.zeros((N, K), np.uint16), w * 0, dy * 0, "zeros"
    xs = sprinkle(rng, rand_bf16(rng, (N, K)), SPECIAL_BF16, 0.01)
    ws = sprinkle(rng, rand_bf16(rng, (M, K), 0.02), SPECIAL_BF16, 0.001)
    yield xs, ws, rand_bf16(rng, (N, M), 1e-3), "sprinkled"


def int4_special_layer_inputs(qmax):
    """(x, w, dy, what) in turn: test_backend_quant.py's test_int4_special_values_in_the_layer's inputs."""
    rng = rng_for("specials4")
    N, K, M = 140, 96, 150
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    w[10] = 0                                   # zero row: y column 0
    w[11, 5] = 0x7FC1                           # NaN in a weight row: y column NaN, dW row NaN
    w[12, 0] = bf(0.2 if qmax == QMAX4 else 0.35)   # clipped at int4 (int6); not at int8
    w[13] = 0x0080                              # flushed step size: a zero row
    w[14] = bf(np.full(K, 2.0 ** -122))         # s_w = 2^-122 QW_COEF4 (6): a normal step size
    w[15, :3] = 0x7F7F                          # the row sum overflows: NaN step
    x[3, 3] = 0x0001                            # subnormal input: flushed
    dy[5, 6] = 0x8001
    yield x, w, dy, "specials"
    w[11, 5] = 0
    w[15] = 0
    x[7, 7] = 0x7F80                            # inf activation: the tensor scale is NaN
    yield x, w, dy, "inf x"
    dy[0, 0] = 0xFF80                           # inf gradient: both gradients NaN
    yield x, w, dy, "inf dy"
    yield np.zeros((N, K), np.uint16), w * 0, dy * 0, "zeros"
    xs = sprinkle(rng, rand_bf16(rng, (N, K)), SPECIAL_BF16, 0.01)
    ws = sprinkle(rng, rand_bf16(rng, (M, K), 0.02), SPECIAL_BF16, 0.001)
    yield xs, ws, rand_bf16(rng, (N, M), 1e-3), "sprinkled"
    tx = bf(np.where(rng.integers(0, 2, (N, K)) == 1, 1.0, -1.0) * 2.0 ** TINY_E[qmax])   # s_x: / qmax normal, / 127 flushed
    yield tx, rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3), "tiny activations"


@pytest.mark.parametrize("ftz", FTZ_MODES, ids=ftz_ids)
def test_quantized_layer_in_every_flush_mode(ftz):
    with ftz_mode(ftz):
        for x, w, dy, what in special_layer_inputs():
            check_layer(x, w, dy, what)


@pytest.mark.parametrize("qmax", [QMAX4, QMAX6], ids=["int4", "int6"])
@pytest.mark.parametrize("ftz", FTZ_MODES, ids=ftz_ids)
def test_int4_layer_in_every_flush_mode(ftz, qmax):
    with ftz_mode(ftz):
        for x, w, dy, what in int4_special_layer_inputs(qmax):
            check_qlinear_low(cu, x, w, dy, what, qmax)


@pytest.mark.parametrize("ftz", FTZ_MODES, ids=ftz_ids)
def test_attention_forward_i8_in_every_flush_mode(ftz):
    """The same bits whatever the emulated device's flushing (tiny values, flushed scales)."""
    with ftz_mode(ftz):
        rng = np.random.default_rng([0xA778, 23])
        q, k, v = attention_i8_inputs(rng, 1, 67, 2, 1, 4, specials=True)
        check_attention_i8_backend(cu.attention_forward_i8, q, k, v, 0, 1.0, f"ftz={ftz}")
        tiny = f32_to_bf16((rng.uniform(-1, 1, v.shape) * 2.0 ** -112).astype(np.float32))
        check_attention_i8_backend(cu.attention_forward_i8, q, k, tiny, 0, 1.0, f"tiny values, ftz={ftz}")


# ================================================================== barriers and the race check
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


def test_fibers_use_the_switch_they_are_asked_for(fibers):
    """The fixture's two modes differ: fiber_switch.h's stack switch on x86-64 Linux, ucontext with
    options(ucontext=True) or on any other host (the built library reports which)."""
    mod = _emu_module(BARRIER_SRC.replace("BARRIER", "__syncthreads();"), "barrier_ok.cu")
    lib = mod.library(emu.hwmodel.Hardware())[0]
    fast_host = platform.machine() == "x86_64" and sys.platform.startswith("linux")
    assert lib.o1b_emu_fast_switch() == int(fast_host and not fibers)


def test_gemm_under_race_check(fibers):
    """The tiled GEMM's barriers are placed right: forward and reverse thread orders agree."""
    rng = rng_for("race")
    x, w = bf16_with_specials(rng, (21, 135)), bf16_with_specials(rng, (19, 135))
    with runtime.emulate(), emu.options(race_check=True):
        assert_bits_equal(cu.linear_forward(x, w), ref.linear_forward(x, w), "y (race check)")


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


def test_barrier_divergence_is_an_error(fibers):
    mod = _emu_module(BARRIER_SRC.replace("BARRIER", "__syncthreads();"), "barrier_ok.cu")
    with pytest.raises(emu.EmuLaunchError, match="barrier divergence"):
        mod.get_function("diverge")((1,), (32,), (np.zeros(32, np.float32),))


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
    P = 150                                                         # slices of p, the last one partial
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


# ================================================================== compile errors, arguments, cache
def test_compile_error_names_file_and_kernel():
    src = '#include "contract.cuh"\nextern "C" __global__ void o1b_broken(float *y) {\n  y[0] = o1b_add(y[0]);\n}\n'
    with runtime.emulate(), pytest.raises(runtime.KernelCompileError) as e:
        runtime.CudaModule(runtime.read_source_text(src, "broken.cu"), name="broken.cu")
    msg = str(e.value)
    assert "broken.cu" in msg and "o1b_broken" in msg and "error" in msg, msg
    assert "broken.cu:3" in msg, msg     # the #line markers point at the file's own line


def test_argument_types_are_checked():
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
