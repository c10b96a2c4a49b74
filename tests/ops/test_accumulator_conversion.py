"""The int32 -> fp32 conversion of int8 GEMM accumulators (CONTRACT.md §6.9) by exact halves:
add(mul(i2f(hi), 2^16), i2f(lo)) with hi = floor(acc / 2^16), lo = acc mod 2^16 equals the IEEE
conversion (round to nearest even) for every int32 — the edges (2^24 + 1, 2^31 - 1, -2^31), every
kind of tie, the boundaries of hi and lo, random words — in the C reference, the numpy spec, the
Metal dequantization kernel and CUDA's epilogue (emulators), bit for bit; and the int8 layer with
accumulators beyond 2^24 gives the same bits on every backend."""
import numpy as np

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref import mathfn
from mlx_open1b.cuda import ops as G
from mlx_open1b.metal import ops as M, runtime
from mlx_open1b.spec import arith as A
from mlx_open1b.spec import quant as SQ

from helpers import assert_bits_equal

I32, F32 = np.int32, np.float32


def edge_words() -> np.ndarray:
    """int32 values at every edge of the conversion and of the split."""
    e = [0, 1, -1, 2 ** 24 - 1, 2 ** 24, 2 ** 24 + 1, 2 ** 24 + 2, 2 ** 24 + 3, 2 ** 25 + 2, 2 ** 25 + 6,
         2 ** 31 - 1, 2 ** 31 - 64, 2 ** 31 - 65, 2 ** 31 - 192, -2 ** 31, -2 ** 31 + 1, -2 ** 31 + 64,
         -(2 ** 24 + 1), -(2 ** 24 + 3), -(2 ** 25 + 2)]
    e += [h * 65536 + lo for h in (-32768, -32767, -2, -1, 0, 1, 32766, 32767)
          for lo in (0, 1, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF)]
    # ties at every scale above 2^24: m 2^k + 2^(k-1) with k = e - 23, odd and even m, and their
    # neighbours; then a random spread of each magnitude
    rng = np.random.default_rng(11)
    for ex in range(24, 31):
        k = ex - 23
        m = rng.integers(2 ** 23, 2 ** 24, 64, dtype=np.int64)
        t = m * 2 ** k + 2 ** (k - 1)
        for d in (-1, 0, 1):
            e += list(t + d) + list(-(t + d))
    v = np.array(e, np.int64)
    v = v[(v >= -2 ** 31) & (v < 2 ** 31)]
    return v.astype(I32)


def words() -> np.ndarray:
    rng = np.random.default_rng(12)
    r = rng.integers(-2 ** 31, 2 ** 31, 1_000_000, dtype=np.int64).astype(I32)
    small = (rng.integers(-2 ** 31, 2 ** 31, 200_000, dtype=np.int64) >> rng.integers(0, 31, 200_000)).astype(I32)
    return np.concatenate([edge_words(), r, small])


RAW_SRC = """
uint i = thread_position_in_grid.x;
y[i] = o1b_bits(o1b_i2f_acc(v[i]));
"""


def _metal_dequant(v: np.ndarray) -> np.ndarray:
    """qdequant's forward mode with unit scales: mul(mul(i2f(acc), 1), 1) = i2f(acc)."""
    return M._dequant(0, v.reshape(1, -1), np.ones(1, F32), cs=np.ones(v.size, F32)).reshape(-1)


CUDA_EPILOGUE_SRC = """
extern "C" __global__ void test_epilogue_y(i64 n, const int *acc, const float *scx, const float *sw, float *y) {
    i64 t = o1b_gid();
    if (t < n) o1b_gi_y{y, scx[0], sw}.put(0, t, n, acc[t]);
}
"""


def _cuda_epilogue(v: np.ndarray) -> np.ndarray:
    """CUDA's forward epilogue (quant.cu's o1b_gi_y, which o1b_qgemm_y applies to each sum it makes)
    with unit scales, on given accumulators."""
    from mlx_open1b.cuda import runtime as cuda_runtime
    mod = cuda_runtime.CudaModule(cuda_runtime.read_source("quant.cu") + CUDA_EPILOGUE_SRC, name="quant.cu + test")
    y = G._empty((1, v.size), np.float32)
    mod.get_function("test_epilogue_y")(((v.size + 127) // 128,), (128,),
                                        (G.i64(v.size), G._dev(v), G._dev(np.ones(1, F32)),
                                         G._dev(np.ones(v.size, F32)), y))
    return np.asarray(G._host(y)).reshape(-1)


def test_split_conversion_equals_ieee_conversion():
    v = words()
    want = v.astype(F32)                                       # numpy's int32 -> float32 (IEEE)
    assert_bits_equal(mathfn.i2f_acc(v), want, "C o1b_i2f_acc")
    assert_bits_equal(SQ.i2f(v), want, "spec")
    raw = runtime.get_kernel("test_i2f_acc", ["v"], ["y"], RAW_SRC, runtime.header())
    (got,) = raw(inputs=[v], output_shapes=[v.shape], output_dtypes=[np.uint32], grid=(v.size, 1, 1),
                 threadgroup=(256, 1, 1))
    assert_bits_equal(got.view(F32), want, "metal o1b_i2f_acc")
    assert_bits_equal(_metal_dequant(v), want, "metal qdequant")
    assert_bits_equal(_cuda_epilogue(v), want, "cuda o1b_gi_y")


def test_edges_round_as_ieee_says():
    v = np.array([2 ** 24 + 1, 2 ** 24 + 3, 2 ** 25 + 2, 2 ** 31 - 1, 2 ** 31 - 64, -2 ** 31, -(2 ** 24 + 1)], I32)
    # ties go to the even significand: 2^24 + 1 -> 2^24, 2^24 + 3 -> 2^24 + 4, 2^25 + 2 -> 2^25;
    # 2^31 - 1 and the tie 2^31 - 64 round up to 2^31; -2^31 is exact
    want = np.array([2.0 ** 24, 2.0 ** 24 + 4, 2.0 ** 25, 2.0 ** 31, 2.0 ** 31, -2.0 ** 31, -2.0 ** 24], F32)
    assert_bits_equal(mathfn.i2f_acc(v), want, "edges")
    assert_bits_equal(_metal_dequant(v), want, "edges (metal)")


def test_int8_layer_with_accumulators_beyond_2_24():
    """qlinear_forward with K = 40000 and same-signed rows: activation levels near 127, weight levels
    near 1/QW_COEF (the step is the row's mean |w| times QW_COEF), so |acc| is about 127 * 5.6 * K > 2^24
    and most accumulators are not representable in fp32; every backend gives the C reference's bits."""
    rng = np.random.default_rng(13)
    N, M_, K = 5, 6, 40000
    x = A.f32_to_bf16(rng.uniform(0.9, 1.0, (N, K)).astype(F32) * rng.choice(np.array([1, -1], F32), (N, 1)))
    w = A.f32_to_bf16(rng.uniform(0.5, 1.0, (M_, K)).astype(F32) * rng.choice(np.array([1, -1], F32), (M_, 1)))
    qx, _ = C.quant_tensor(x)
    qw, _ = C.quant_weight_rows(w)
    acc = C.gemm_i8(qx, qw)
    big = np.abs(acc.astype(np.int64)) > 2 ** 24
    assert big.all() and (acc.astype(F32).astype(np.int64) != acc)[big].mean() > 0.5
    want = C.qlinear_forward(x, w)
    assert_bits_equal(M.qlinear_forward(x, w), want, "metal")
    assert_bits_equal(G.qlinear_forward(x, w), want, "cuda")
    assert_bits_equal(SQ.qlinear_forward(x, w), want, "spec")
