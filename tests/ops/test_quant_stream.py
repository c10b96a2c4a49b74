"""The int8 layer's large outputs y and dx (past 2 MiB, quant_vnni.c STREAM_BYTES; not dW, which the
model writes into its gradient buffer) leave the GEMM epilogue as streaming stores of whole 64-byte
lines (cpu_ref.qlinear_* allocate them line-aligned); the values must be the portable code's, bit for
bit, including the rows' partial vectors and the outputs under the threshold."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_open1b import cpu_ref as C

from helpers import rand_bf16

pytestmark = pytest.mark.skipif(not C.gemm_i8_has_vnni(), reason="no AVX-512 VNNI: the portable code alone runs")


@pytest.mark.parametrize("shape", [(1100, 136, 520), (520, 1100, 136)], ids=["y-streamed", "dx-dw-streamed"])
def test_streamed_outputs_are_the_portable_bits(shape):
    N, K, M = shape                       # y (N, M) 2.2 MiB; dx (N, K) and dW (M, K) 2.2 / 0.6 MiB
    rng = np.random.default_rng(N + K + M)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    got = [C.qlinear_forward(x, w), *C.qlinear_backward(dy, x, w)]
    for a in got:
        assert a.ctypes.data % 64 == 0
    with C.runtime.settings(simd=1):      # below AVX-512: the portable int8 code
        want = [C.qlinear_forward(x, w), *C.qlinear_backward(dy, x, w)]
    for g, wnt, name in zip(got, want, ("y", "dx", "dw")):
        assert np.array_equal(g.view(np.uint32), wnt.view(np.uint32)), name


@pytest.mark.parametrize("shape,dtype", [((1100, 520), np.float32), ((3, 5), np.float32), ((0, 7), np.float32),
                                         ((7,), np.int32), ((), np.float32)])
def test_empty_lines_is_line_aligned(shape, dtype):
    """The allocator behind those outputs: the shape and dtype asked for, its data on a 64-byte line,
    and its own memory (writing one array leaves the next untouched)."""
    from mlx_open1b.cpu_ref._lib import empty_lines
    a, b = empty_lines(shape, dtype), empty_lines(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
    assert a.size == 0 or (a.ctypes.data % 64 == 0 and b.ctypes.data % 64 == 0)
    a.fill(1)
    b.fill(2)
    assert (a == 1).all() and (b == 2).all()
