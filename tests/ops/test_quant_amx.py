"""The int8 GEMM's AMX tile blocks (cpu_ref/src/quant_amx.c) give the VNNI kernel's bits.

Both compute exact integer sums (u8 x s8, int32 with wraparound), so the tiles may not change a
bit of the layer's forward, backward or the plain int8 GEMM. The shapes cross every edge of the
tile path: contraction lengths below one tile (no tiles: VNNI only), whole tiles, and whole tiles
plus a VNNI tail of 4 ... 60; row runs of 16, 32 and 48 (a 32-row block then a 16-row block);
partial 32-column panels. The plain GEMM is also checked against an int64 matmul. Skipped where
the CPU or the kernel gives no AMX (the VNNI kernel then runs alone and test_quant covers it)."""
from __future__ import annotations

import numpy as np
import pytest

from mlx_open1b import cpu_ref as C

from helpers import rand_bf16

pytestmark = pytest.mark.skipif(not C.quant.gemm_i8_has_amx(), reason="no AMX int8 tiles on this CPU/kernel")

# (N, K, M): K or N is the GEMMs' contraction (forward: K; dx: M padded to 128; dW: N padded to 128)
SHAPES = [
    (16, 48, 40),      # forward contraction 48 < 64: the VNNI kernel alone there
    (16, 64, 32),      # one tile of contraction, 16 rows, one whole panel
    (48, 100, 70),     # 64 + a tail of 36; rows 32 + 16; partial panels
    (96, 252, 33),     # 192 + a tail of 60
    (130, 196, 97),    # 192 + a tail of 4; N past 128 (dW contraction 256)
    (300, 352, 129),   # the tiny preset's down projection's K (5 tiles + 32)
]


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def _layer(x, w, dy, amx, threads):
    with C.runtime.settings(amx=amx, threads=threads):
        y = C.qlinear_forward(x, w)
        dx, dw = C.qlinear_backward(dy, x, w)
    return [_bits(v).copy() for v in (y, dx, dw)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_tiles_equal_vnni(shape, threads):
    N, K, M = shape
    rng = np.random.default_rng(N * 7919 + K * 31 + M)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    runs = C.quant.gemm_i8_amx_runs()
    got = _layer(x, w, dy, True, threads)
    assert C.quant.gemm_i8_amx_runs() > runs          # the tiles really ran
    want = _layer(x, w, dy, False, threads)
    for g, wnt, name in zip(got, want, ("y", "dx", "dw")):
        assert np.array_equal(g, wnt), f"{name} differs with AMX at {shape}"


@pytest.mark.parametrize("shape", [(16, 64, 16), (48, 100, 70), (33, 188, 65), (64, 256, 96), (256, 130, 70)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_i8_tiles_exact(shape):
    """The plain int8 GEMM on tiles: extreme operands (all ±127, so the u8 offset sums reach
    255·127 per product) and random ones, against int64 arithmetic. One thread, so that 256 rows
    go in tasks of 64 and so in 32-row tile blocks (the smaller shapes give tasks of 16 rows)."""
    I, P, J = shape
    rng = np.random.default_rng(I + P + J)
    for A, B in ((rng.integers(-127, 128, (I, P), dtype=np.int8), rng.integers(-127, 128, (J, P), dtype=np.int8)),
                 (np.full((I, P), 127, np.int8), np.full((J, P), -127, np.int8))):
        runs = C.quant.gemm_i8_amx_runs()
        with C.runtime.settings(amx=True, threads=1):
            got = C.gemm_i8(A, B)
        assert C.quant.gemm_i8_amx_runs() > runs
        assert np.array_equal(got, A.astype(np.int64) @ B.astype(np.int64).T)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_held_layer_tiles_equal_vnni(shape, threads):
    """Held weights (one q_w per weight, its forward pack built from it, a backward taking its
    forward's s_x) on AMX tiles give the bits of the unheld layer on the VNNI kernel alone: two
    forwards and backwards in one hold, the second reusing the held operands; each forward's
    GEMM on tiles where its contraction reaches one (K >= 64), dx's and dW's always (padded to 128).
    x2's scale differs from x's, so a backward taking a stale s_x changes dW."""
    N, K, M = shape
    rng = np.random.default_rng(N * 104729 + K * 17 + M)
    x, w, dy = rand_bf16(rng, (N, K)), rand_bf16(rng, (M, K), 0.02), rand_bf16(rng, (N, M), 1e-3)
    x2 = rand_bf16(rng, (N, K), 4.0)
    want = [_layer(x, w, dy, False, threads), _layer(x2, w, dy, False, threads)]
    h0, s0 = C.quant.held_runs(), C.quant.sx_reused()
    got = []
    with C.runtime.settings(amx=True, threads=threads), C.quant.weights_held() as held:
        for xi in (x, x2):
            runs = C.quant.gemm_i8_amx_runs()
            y = C.qlinear_forward(xi, w)
            assert (C.quant.gemm_i8_amx_runs() > runs) == (K >= 64), "the held forward's tiles"
            runs = C.quant.gemm_i8_amx_runs()
            dx, dw = C.qlinear_backward(dy, xi, w)
            assert C.quant.gemm_i8_amx_runs() > runs, "the held backward's tiles"
            got.append([_bits(v).copy() for v in (y, dx, dw)])
    assert (held.made, held.reused) == (1, 3), "the hold was not used"
    assert C.quant.held_runs() - h0 == 4, "the C code did not run on the held operands"
    assert C.quant.sx_reused() - s0 == 2, "the backwards did not take their forward's s_x"
    for g, wnt in zip(got, want):
        for a, b, name in zip(g, wnt, ("y", "dx", "dw")):
            assert np.array_equal(a, b), f"held {name} differs with AMX at {shape}"
