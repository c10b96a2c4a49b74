"""The emulators' opt-in work counters (metal/emu/counters.py) on tiny kernels whose counts are
derived by hand from their loops, and their being inert when off."""
import numpy as np
import pytest

from mlx_open1b.cuda import emu as cuda_emu
from mlx_open1b.metal import emu as metal_emu
from mlx_open1b.metal.emu import counters

# Each of the first n threads sums m products a[i*m + j] * b[j] into y[i]; the others do nothing.
# By hand, for n threads at work: loads a: n*m*4 bytes (each element once), b: n*m*4 bytes (each of
# its m elements n times, so m*4 distinct bytes), stores y: n*4; fp32 operations: n*m mul, n*m add;
# a __shared__ scratch value written and read by every thread is not global memory.
CUDA_SRC = r'''
extern "C" __global__ void dot_rows(long long n, long long m, const float *a, const float *b, float *y) {
    __shared__ float scratch[64];
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float acc = 0.0f;
    for (long long j = 0; j < m; j++) acc = __fadd_rn(acc, __fmul_rn(a[i * m + j], b[j]));
    scratch[threadIdx.x] = acc;
    y[i] = scratch[threadIdx.x];
}
'''

METAL_HEADER = '''
#ifndef O1B_HW_ADD
#define O1B_HW_ADD(a, b) ((a) + (b))
#define O1B_HW_MUL(a, b) ((a) * (b))
#endif
'''
METAL_SRC = '''
uint i = thread_position_in_grid.x;
long n = prm[0], m = prm[1];
if ((long)i >= n) return;
float acc = 0.0f;
for (long j = 0; j < m; j++) {
    float p = O1B_HW_MUL(a[i * m + j], b[j]);
    acc = O1B_HW_ADD(acc, p);
}
y[i] = acc;
'''


def _inputs(n, m, pad):
    rng = np.random.default_rng(3)
    return rng.uniform(-1, 1, n * m).astype(np.float32), rng.uniform(-1, 1, m).astype(np.float32), pad


@pytest.mark.parametrize("n,m", [(37, 5), (100, 12)])
def test_cuda_counts_by_hand(n, m):
    a, b, _ = _inputs(n, m, 0)
    y = np.zeros(n + 27, np.float32)              # threads past n never touch the tail
    fn = cuda_emu.EmuModule(CUDA_SRC, "dot_rows.cu").get_function("dot_rows")
    args = (np.int64(n), np.int64(m), a, b, y)
    with counters.counting() as log:
        fn(((n + 63) // 64,), (64,), args)
    (ln,) = log.launches
    # the array arguments in order: a, b, y (n and m are passed by value)
    assert ln.read == [n * m * 4, n * m * 4, 0]
    assert ln.read_unique == [n * m * 4, m * 4, 0]
    assert ln.written == [0, 0, n * 4] and ln.written_unique == [0, 0, n * 4]
    assert ln.ops == {"add": n * m, "sub": 0, "mul": n * m, "div": 0, "sqrt": 0, "fma": 0}
    assert (ln.loads, ln.stores) == (2 * n * m, n)
    assert ln.groups == (n + 63) // 64 and ln.kernel == "dot_rows" and ln.backend == "cuda"
    plain = np.zeros_like(y)
    fn(((n + 63) // 64,), (64,), (np.int64(n), np.int64(m), a, b, plain))   # counting off
    assert plain.view(np.uint32).tolist() == y.view(np.uint32).tolist()
    assert len(log.launches) == 1                 # nothing logged outside the block


@pytest.mark.parametrize("n,m", [(37, 5), (100, 12)])
def test_metal_counts_by_hand(n, m):
    a, b, _ = _inputs(n, m, 0)
    prm = np.array([n, m], np.int64)
    k = metal_emu.EmuKernel("dot_rows", ["a", "b", "prm"], ["y"], METAL_SRC, header=METAL_HEADER)
    call = dict(inputs=[a, b, prm], output_shapes=[(n + 27,)], output_dtypes=[np.float32],
                grid=(n + 27, 1, 1), threadgroup=(32, 1, 1), init_value=0)
    with counters.counting() as log:
        (y,) = k(**call)
    (ln,) = log.launches
    # buffers: a, b, prm, y (how often prm's two int64 are read is the compiler's choice: g++ loads
    # m after the bounds test, so only the n working threads read it)
    threads = n + 27
    assert ln.read[:2] + ln.read[3:] == [n * m * 4, n * m * 4, 0]
    assert ln.read_unique == [n * m * 4, m * 4, 16, 0]
    assert ln.written == [0, 0, 0, n * 4] and ln.written_unique == [0, 0, 0, n * 4]
    assert ln.ops["add"] == n * m and ln.ops["mul"] == n * m and ln.ops["fma"] == 0
    assert ln.groups == -(-threads // 32) and ln.backend == "metal"
    (plain,) = k(**call)
    assert plain.view(np.uint32).tolist() == y.view(np.uint32).tolist()
    assert len(log.launches) == 1


def test_counting_refuses_a_modelled_fault():
    k = metal_emu.EmuKernel("dot_rows", ["a", "b", "prm"], ["y"], METAL_SRC, header=METAL_HEADER)
    a, b, _ = _inputs(4, 2, 0)
    with counters.counting(), metal_emu.hardware(fault="fma"):
        with pytest.raises(metal_emu.EmuError, match="plain hardware"):
            k(inputs=[a, b, np.array([4, 2], np.int64)], output_shapes=[(4,)], output_dtypes=[np.float32],
              grid=(4, 1, 1), threadgroup=(4, 1, 1))


def test_cuda_fused_multiply_adds_count_once_each():
    """__fmaf_rn and the emulated PTX fma.rn.ftz (contract.cuh's o1b_fma_ftz) are one `fma` each:
    n threads x m steps of each."""
    src = r'''
extern "C" __global__ void fma_rows(long long n, long long m, const float *a, float *y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float acc = 0.0f, acc2 = 0.0f;
    for (long long j = 0; j < m; j++) {
        acc = __fmaf_rn(a[i * m + j], a[i * m + j], acc);
        acc2 = emu_fma_rn_ftz(a[i * m + j], 2.0f, acc2);
    }
    y[i] = __fadd_rn(acc, acc2);
}
'''
    n, m = 50, 7
    a = np.random.default_rng(1).uniform(-1, 1, n * m).astype(np.float32)
    fn = cuda_emu.EmuModule(src, "fma_rows.cu").get_function("fma_rows")
    with counters.counting() as log:
        fn((1,), (64,), (np.int64(n), np.int64(m), a, np.zeros(n, np.float32)))
    (ln,) = log.launches
    assert ln.ops == {"add": n, "sub": 0, "mul": 0, "div": 0, "sqrt": 0, "fma": 2 * n * m}
    assert ln.flops == n + 4 * n * m
