"""The VNNI int8 path rounds tensors quantized by their own absmax without level()'s clamp
(CONTRACT.md §6.9 implementation notes: |t| < 127.5). Its edge is the largest element, whose
t = mul(a, div(1, div(a, 127))) can land just above 127 (for about a quarter of bf16 values of a,
found here by the same fp32 operations): such tensors, with ±a present, must give the portable
code's bits in the forward and the backward."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_open1b import cpu_ref as C
from mlx_open1b.spec.arith import f32_to_bf16

from helpers import rand_bf16

pytestmark = pytest.mark.skipif(not C.gemm_i8_has_vnni(), reason="no AVX-512 VNNI: the portable code alone runs")


def _above_127(n):
    """bf16 magnitudes a whose largest element's t exceeds 127 (fp32 s, 1/s and product)."""
    a = (np.arange(0x3C00, 0x4400, dtype=np.uint32) << 16).view(np.float32)
    s = (a / np.float32(127)).astype(np.float32)
    t = (a * (np.float32(1) / s).astype(np.float32)).astype(np.float32)
    hits = a[t > 127]
    assert hits.size > 0
    return hits[np.linspace(0, hits.size - 1, n).astype(int)]


@pytest.mark.parametrize("amax", list(_above_127(4)), ids=lambda a: f"{a:.6g}")
def test_largest_element_just_above_127(amax):
    rng = np.random.default_rng(int(amax * 1000))
    N, K, M = 64, 256, 96
    xf = rng.uniform(-1, 1, (N, K)).astype(np.float32) * np.float32(amax) * np.float32(0.99)
    xf[3, 5], xf[40, 200] = amax, -amax
    x = f32_to_bf16(xf)
    w = rand_bf16(rng, (M, K), 0.02)
    dyf = rng.uniform(-1, 1, (N, M)).astype(np.float32) * np.float32(amax)
    dyf[7, 9] = -amax
    dy = f32_to_bf16(dyf)
    got = [C.qlinear_forward(x, w), *C.qlinear_backward(dy, x, w)]
    with C.runtime.settings(simd=1):      # the portable code: level() with its clamp
        want = [C.qlinear_forward(x, w), *C.qlinear_backward(dy, x, w)]
    for g, wnt, name in zip(got, want, ("y", "dx", "dw")):
        assert np.array_equal(g.view(np.uint32), wnt.view(np.uint32)), name
