"""The int8 P·V attention forward (CONTRACT.md §6.10) on the C reference's SIMD rows: at every SIMD
level, with the AVX-512 rows' VNNI product from packed levels and without it (their fp32 lanes),
bit for bit equal to contract.h's scalar path and to the numpy spec. The shapes reach the edges of
the packed product: key blocks starting at every offset within a group of 4 keys (windows), the
last group running past T, head dims below, at and past each 16 and 32 values, rows with no
weight left (s_p = +0), rows whose s_p is near 2^-126, and non-finite value rows. The same shapes
again with flat inputs (value rows of one magnitude, mild scores), where most keys of a block have
a nonzero level q_p: with value rows 2^126 apart most levels are 0, and a key left out of the packed
product (say the last group of a block that ends one key past a group) would go unseen."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import mlx_open1b.cpu_ref as C
from mlx_open1b.cpu_ref import attention as CA
from mlx_open1b.cpu_ref._lib import lib
from mlx_open1b.cpu_ref.mathfn import vector_math
from mlx_open1b.spec import attention as SA
from mlx_open1b.spec.arith import f32_to_bf16

from helpers import assert_bits_equal

LEVELS = list(range(C.simd_level() + 1))


def inputs(seed, B, T, H, G, D, flat=False):
    """q, k at a scale that makes peaked and flat rows; value rows of very different magnitudes
    (down to 2^-118, where t = p s_v and s_p = max t / 127 reach 2^-126 and flush), a block of
    zero value rows (its s_p = +0 for the queries that see only it) and one +inf value row.
    flat: small q, k (weights of one order across a block) and value rows of one magnitude."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, T, H, D)) * (0.3 if flat else 2)).astype(np.float32)
    k = (rng.standard_normal((B, T, G, D)) * (0.3 if flat else 2)).astype(np.float32)
    mag = 1.0 if flat else 2.0 ** rng.integers(-118, 8, (B, T, G, 1)).astype(np.float64)
    v = (rng.standard_normal((B, T, G, D)) * mag).astype(np.float32)
    if T > 40 and not flat:
        v[:, 20:40] = 0.0
        v[B - 1, T - 9, 0, D // 2] = np.inf
    return f32_to_bf16(q), f32_to_bf16(k), f32_to_bf16(v)


SHAPES = [  # B, T, H, G, D, W: windows 5, 33, 62, 66 start blocks at offsets 0-3 of a group
    (1, 150, 4, 2, 20, 33),
    (2, 70, 2, 1, 16, 5),
    (1, 131, 2, 2, 48, 62),
    (1, 133, 4, 1, 3, 66),
    (1, 97, 2, 1, 80, 0),
    (1, 9, 1, 1, 32, 0),
]


@pytest.mark.parametrize("flat", [False, True], ids=["spread", "flat"])
@pytest.mark.parametrize("B,T,H,G,D,W", SHAPES)
def test_i8_rows_equal_scalar_and_spec(B, T, H, G, D, W, flat):
    q, k, v = inputs(T * 7 + D + W, B, T, H, G, D, flat)
    scale = float(np.float32(1.3 / np.sqrt(D)))
    with vector_math(False):
        want = CA.attention_forward_i8(q, k, v, W, scale)
    for a, b, what in zip(want, SA.attention_forward_i8(q, k, v, W, scale), ("o", "lse")):
        assert_bits_equal(a, b, f"i8 {what}: scalar C vs spec")
    if T > 40 and not flat:                      # the +inf row: NaN exactly where a query sees it
        i, h = np.arange(T)[:, None], np.arange(H)[None, :]
        sees = (i >= T - 9) & ((W == 0) | (i - (T - 9) < W)) & (h // (H // G) == 0)
        nan = (want[0].view(np.uint32) == 0x7FC00000).all(-1)
        assert (nan[-1] == sees).all() and not nan[:-1].any()
    for lv in LEVELS:
        for use in (True, False):
            with C.settings(simd=lv, attn_vnni=use), vector_math(True):
                got = CA.attention_forward_i8(q, k, v, W, scale)
            for a, b, what in zip(got, want, ("o", "lse")):
                assert_bits_equal(a, b, f"i8 {what}, level {lv}, vnni {use}")


def test_vnni_switch():
    """The packed product is what level 2 runs where the CPU has VNNI, and the switch turns it off
    (so the test above really compares both products)."""
    lib.o1b_attn_vnni_now.restype = ctypes.c_int
    with C.settings(simd=0), vector_math(True):
        assert lib.o1b_attn_vnni_now() == 0
    with C.settings(attn_vnni=False):
        assert lib.o1b_attn_vnni_now() == 0
    if not C.gemm_i8_has_vnni():
        pytest.skip("no AVX-512 VNNI here")
    assert lib.o1b_attn_vnni_now() == 1
